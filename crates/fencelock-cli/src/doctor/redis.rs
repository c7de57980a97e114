//! Redis and Redlock nodes: reachability, latency, clocks, persistence, scripting, and
//! security (TLS, a node open to anyone).

use std::time::{Duration, Instant};

use super::{median, net, Finding, Findings, ANSWER_WITHIN};

pub(super) async fn redis_nodes(url: &fencelock::RedisUrl, f: &mut Findings) {
    let (nodes, quorum) = (&url.nodes, url.quorum);
    let mut offsets = Vec::new();
    let mut run_ids = Vec::new();
    let clients = match url.clients() {
        Ok(c) => c,
        Err(e) => {
            f.unreachable += nodes.len();
            f.warn(&e.to_string());
            return;
        }
    };
    // The same nodes without credentials: does a node let anyone in?
    let mut anonymous_url = url.clone();
    anonymous_url.user = None;
    anonymous_url.password = None;
    let anonymous = anonymous_url.clients().ok();
    for (i, (node, client)) in nodes.iter().zip(clients).enumerate() {
        outln!("node {node}");
        let conn =
            match tokio::time::timeout(ANSWER_WITHIN, client.get_multiplexed_async_connection())
                .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    f.unreachable_node(&format!("unreachable: {e}"));
                    continue;
                }
                Err(_) => {
                    f.unreachable_node("no answer within 5s (hung or partitioned)");
                    continue;
                }
            };
        let p = match tokio::time::timeout(ANSWER_WITHIN, probe(conn.clone())).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                f.unreachable_node(&format!("unreachable: {e}"));
                continue;
            }
            Err(_) => {
                f.unreachable_node("no answer within 5s (hung or partitioned)");
                continue;
            }
        };
        f.ok(&format!(
            "reachable, Redis {}, round trip p50 {}",
            p.version,
            crate::human_duration(p.rtt)
        ));
        f.ok(&format!(
            "clock offset {:+.1} ms against this machine",
            p.offset_ms
        ));
        offsets.push(p.offset_ms);
        run_ids.push(p.run_id.clone());
        match (p.appendonly.as_deref(), p.appendfsync.as_deref()) {
            (Some("yes"), Some("always")) => {
                f.ok("appendonly yes, appendfsync always: grants survive a restart")
            }
            (ao, fs) => f.warn(&format!(
                "appendonly {}, appendfsync {}: a restart can forget granted locks and \
                 fencing counters. fencelock delays the restarted node's votes only for \
                 clients that saw it before (its node id changes); for correctness locks \
                 set appendonly yes and appendfsync always",
                ao.unwrap_or("unknown"),
                fs.unwrap_or("unknown")
            )),
        }
        f.add_all(scripting(conn.clone()).await);
        let open = match anonymous.as_ref().and_then(|c| c.get(i)) {
            Some(c) => accepts_anyone(c).await,
            None => false,
        };
        f.add_all(exposure(open, p.protected_mode.as_deref()));
        f.add_all(transport(url, i).await);
        // The ACL user's own checks (commands and key patterns fencelock needs, `@all`, keys
        // beyond the prefix) follow the per-node section: `crate::doctor_acl`.
    }
    if offsets.len() > 1 {
        let spread = offsets.iter().cloned().fold(f64::MIN, f64::max)
            - offsets.iter().cloned().fold(f64::MAX, f64::min);
        outln!("nodes");
        if spread > 100.0 {
            f.warn(&format!(
                "clocks differ by {spread:.1} ms between nodes: Redlock tokens use the client's \
                 clock as their floor, and expiry drift grows with the difference; run NTP"
            ));
        } else {
            f.ok(&format!("clocks within {spread:.1} ms of each other"));
        }
        let known: Vec<&String> = run_ids.iter().flatten().collect();
        let mut distinct = known.clone();
        distinct.sort();
        distinct.dedup();
        if distinct.len() < known.len() {
            f.warn("two URLs reach the same server: Redlock needs independent nodes");
        } else if known.len() < run_ids.len() {
            f.note(
                "INFO is denied to this user, so whether two URLs reach the same server (Redlock \
                 needs independent nodes) was not checked; run doctor as an administrator once",
            );
        }
    }
    if quorum {
        let quorum_size = nodes.len() / 2 + 1;
        if nodes.len() - f.unreachable < quorum_size {
            f.warn(&format!(
                "only {} of {} nodes reachable: below the quorum of {quorum_size}, no lock can be granted",
                nodes.len() - f.unreachable,
                nodes.len()
            ));
        }
    } else {
        f.note(
            "one node: a restart without persistence loses its locks; use redlock:// for a quorum",
        );
    }
}

struct Probe {
    version: String,
    /// `None` when INFO is denied to the user.
    run_id: Option<String>,
    rtt: Duration,
    offset_ms: f64,
    appendonly: Option<String>,
    appendfsync: Option<String>,
    /// `None` when `CONFIG GET` is renamed or denied.
    protected_mode: Option<String>,
}

async fn probe(mut conn: redis::aio::MultiplexedConnection) -> redis::RedisResult<Probe> {
    let mut rtts = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        rtts.push(t.elapsed());
    }
    // The server's clock against ours, read halfway through the round trip.
    let before = std::time::SystemTime::now();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
    let after = std::time::SystemTime::now();
    let local = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0)
    };
    let mid = (local(before) + local(after)) / 2.0;
    let server = secs as f64 + micros as f64 / 1e6;
    // The least-privilege user `fencelock acl` prints may not run INFO (fencelock needs it for
    // nothing): then the version and the restart id are unknown, and the node is no less usable.
    let info: Option<String> = match redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
    {
        Ok(info) => Some(info),
        Err(e) if e.code() == Some("NOPERM") => None,
        Err(e) => return Err(e),
    };
    let field = |name: &str| {
        info.as_deref()?
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
    };
    // CONFIG may be renamed or denied by ACL: then the setting is reported unknown.
    let config = |name: &'static str| {
        let mut c = conn.clone();
        async move {
            redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query_async::<Vec<String>>(&mut c)
                .await
                .ok()
                .and_then(|v| v.get(1).cloned())
        }
    };
    Ok(Probe {
        version: match &info {
            Some(_) => field("redis_version").unwrap_or_else(|| "unknown".into()),
            None => "version unknown (INFO is denied to this user)".into(),
        },
        run_id: field("run_id"),
        rtt: median(rtts),
        offset_ms: (server - mid) * 1000.0,
        appendonly: config("appendonly").await,
        appendfsync: config("appendfsync").await,
        protected_mode: config("protected-mode").await,
    })
}

/// fencelock runs every lock operation as a server-side script, by its digest (`EVALSHA`),
/// loading it first with `SCRIPT LOAD` when the node does not know it: both must work.
async fn scripting(mut conn: redis::aio::MultiplexedConnection) -> Vec<Finding> {
    const SCRIPT: &str = "return 1";
    let loaded = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(SCRIPT)
        .query_async::<String>(&mut conn)
        .await;
    let sha = match loaded {
        Ok(sha) => sha,
        Err(e) => return vec![Finding::Warn(scripting_problem("SCRIPT LOAD", &e))],
    };
    match redis::cmd("EVALSHA")
        .arg(&sha)
        .arg(0)
        .query_async::<i64>(&mut conn)
        .await
    {
        Ok(1) => vec![Finding::Ok(
            "scripting available (SCRIPT LOAD, EVALSHA), as every lock operation needs".into(),
        )],
        Ok(other) => vec![Finding::Warn(format!(
            "a test script returned {other} instead of 1: this server does not run Lua \
             scripts as Redis does"
        ))],
        Err(e) => vec![Finding::Warn(scripting_problem("EVALSHA", &e))],
    }
}

/// Why a scripting command failed, in words an operator can act on.
fn scripting_problem(command: &str, e: &redis::RedisError) -> String {
    let text = e.to_string();
    let why = if text.to_ascii_lowercase().contains("unknown command") {
        format!(
            "{command} is not a command on this server: renamed or disabled by \
             rename-command in its configuration"
        )
    } else if e.code() == Some("NOPERM") {
        format!("the ACL user may not run {command} ({text})")
    } else {
        format!("{command} failed: {text}")
    };
    format!(
        "scripting unavailable: {why}. fencelock runs every lock operation as a server-side \
         script (SCRIPT LOAD, EVALSHA), so no lock can be taken here"
    )
}

/// Whether a client without credentials may run commands.
async fn accepts_anyone(client: &redis::Client) -> bool {
    let ping = async {
        let mut c = client.get_multiplexed_async_connection().await?;
        redis::cmd("PING").query_async::<String>(&mut c).await
    };
    matches!(tokio::time::timeout(ANSWER_WITHIN, ping).await, Ok(Ok(_)))
}

/// A node that lets clients in without a password, judged with its `protected-mode` (which,
/// while on, refuses such clients unless they come from loopback).
fn exposure(accepts_anyone: bool, protected_mode: Option<&str>) -> Vec<Finding> {
    if !accepts_anyone {
        return vec![Finding::Ok(
            "a client without a password is refused (AUTH required)".into(),
        )];
    }
    vec![match protected_mode {
        Some("no") => Finding::Warn(
            "no password and protected-mode no: anyone who reaches this port may run any \
             command, delete any lock or flush the node; set a password (requirepass, or ACL \
             users) or bind it to loopback"
                .into(),
        ),
        Some(_) => Finding::Note(
            "no password: clients need none; protected-mode yes refuses them unless they \
             come from loopback"
                .into(),
        ),
        None => Finding::Warn(
            "no password, and protected-mode could not be checked (CONFIG GET is renamed or \
             denied to this user): if it is off, anyone who reaches this port may run any \
             command"
                .into(),
        ),
    }]
}

/// TLS on `url`'s node `i`: the version negotiated and how the certificate was verified;
/// without TLS, a warning when the node is off loopback.
async fn transport(url: &fencelock::RedisUrl, i: usize) -> Vec<Finding> {
    let node = &url.nodes[i];
    if !url.tls {
        let loopback = net::on_loopback(&node.host, node.port).await;
        let scheme = if url.quorum {
            "redlocks://"
        } else {
            "rediss://"
        };
        return vec![
            match net::plaintext_warning(&format!("node {node}"), loopback, scheme) {
                Some(w) => Finding::Warn(w),
                None => Finding::Ok("plaintext, on a loopback address".into()),
            },
        ];
    }
    match url.tls_session(i, ANSWER_WITHIN).await {
        Ok(Some(s)) => vec![Finding::Ok(format!(
            "{} ({}); server certificate verified: chain against {}, name {}",
            s.version,
            s.cipher,
            url.ca
                .as_ref()
                .map(|p| format!("ca={}", p.display()))
                .unwrap_or_else(|| "the system's roots".into()),
            node.host
        ))],
        Ok(None) => Vec::new(),
        Err(e) => vec![Finding::Warn(format!("TLS: {e}"))],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_open_to_anyone_is_flagged_when_protected_mode_is_off_or_unknown() {
        assert!(matches!(exposure(false, Some("no"))[..], [Finding::Ok(_)]));
        assert!(matches!(
            exposure(true, Some("yes"))[..],
            [Finding::Note(_)]
        ));
        assert!(
            matches!(exposure(true, Some("no"))[..], [Finding::Warn(ref w)] if w.contains("protected-mode no"))
        );
        assert!(
            matches!(exposure(true, None)[..], [Finding::Warn(ref w)] if w.contains("could not be checked"))
        );
    }
}
