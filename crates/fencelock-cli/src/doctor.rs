//! `fencelock doctor`: is this backend fit for the locks we take on it?
//!
//! Per node: reachable, round-trip latency, clock offset against this machine (and so between
//! nodes), and the settings that make a correctness lock unsafe. Then TTL advice from the
//! observed hold-time p99: a TTL of three times the p99 leaves room for pauses and renewals.

use std::time::Duration;

use anyhow::Result;
use clap::Args;

use crate::{connect, exit, fail, parse_duration, BackendArg};

#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// The observed hold-time p99, for TTL advice.
    #[arg(long, value_parser = parse_duration, conflicts_with = "metrics_url")]
    hold_p99: Option<Duration>,
    /// A running fencelock's Prometheus endpoint (as served by `run --metrics-addr`), to read
    /// the hold-time p99 from, e.g. http://127.0.0.1:9464/metrics.
    #[arg(long)]
    metrics_url: Option<String>,
    /// The TTL in use, to compare with the advice.
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
}

/// What the doctor found, printed as it goes.
struct Findings {
    problems: usize,
    unreachable: usize,
}

impl Findings {
    fn ok(&self, what: &str) {
        println!("  ok    {what}");
    }
    fn warn(&mut self, what: &str) {
        self.problems += 1;
        println!("  WARN  {what}");
    }
}

/// With a routing configuration, every backend is checked in turn, each under its name.
pub async fn doctor(args: DoctorArgs) -> Result<u8> {
    let mut f = Findings {
        problems: 0,
        unreachable: 0,
    };
    match crate::config::target(&args.backend).map_err(fail)? {
        crate::config::Target::Url(url) => check_backend(&args, url, None, &mut f).await?,
        crate::config::Target::Routes(routes) => {
            for (name, url) in routes.backends() {
                // Each backend is checked as if named by --backend.
                let mut one = args.clone();
                one.backend.backend = Some(url.to_owned());
                one.backend.config = None;
                check_backend(&one, url.to_owned(), Some(name), &mut f).await?;
            }
        }
    }
    ttl_advice(&args, &mut f).await;
    println!(
        "{} problem(s){}",
        f.problems,
        if f.unreachable > 0 {
            format!(", {} node(s) unreachable", f.unreachable)
        } else {
            String::new()
        }
    );
    Ok(if f.unreachable > 0 {
        exit::UNAVAILABLE
    } else {
        0
    })
}

async fn check_backend(
    args: &DoctorArgs,
    url: String,
    name: Option<&str>,
    f: &mut Findings,
) -> Result<()> {
    let backend = fencelock::Backend::parse(&url).map_err(fail)?;
    println!(
        "fencelock doctor: {}{} at {}",
        name.map(|n| format!("backend {n}: ")).unwrap_or_default(),
        backend.engine(),
        fencelock::redact_url(&url)
    );
    match &backend {
        #[cfg(feature = "sqlite")]
        fencelock::Backend::Sqlite(u) => sqlite(args, &u.path, f).await?,
        #[cfg(feature = "etcd")]
        fencelock::Backend::Etcd(_) => etcd(args, f).await,
        #[cfg(feature = "redis")]
        fencelock::Backend::Redis(u) => redis_nodes(u, f).await,
        _ => {}
    }
    Ok(())
}

#[cfg(feature = "etcd")]
/// etcd: one linearizable read through the library (it needs a leader and a quorum).
async fn etcd(args: &DoctorArgs, f: &mut Findings) {
    let started = std::time::Instant::now();
    // `connect` reports its own error; etcd connections are lazy, so it rarely fails here.
    let Ok(client) = connect(&args.backend, "fencelock-doctor").await else {
        f.unreachable += 1;
        return;
    };
    match client.inspect("fencelock-doctor").await {
        Ok(_) => f.ok(&format!(
            "cluster answered a linearizable read in {}",
            crate::human_duration(started.elapsed())
        )),
        Err(e) => {
            f.unreachable += 1;
            f.warn(&format!("unreachable: {e}"));
        }
    }
    client.close().await;
    println!("  note  tokens are etcd revisions; lease TTLs are whole seconds (rounded up)");
}

async fn sqlite(args: &DoctorArgs, path: &std::path::Path, f: &mut Findings) -> Result<()> {
    println!("database {}", path.display());
    let started = std::time::Instant::now();
    let client = connect(&args.backend, "fencelock-doctor").await?;
    client.inspect("fencelock-doctor").await.map_err(fail)?;
    f.ok(&format!(
        "opened and queried in {}",
        crate::human_duration(started.elapsed())
    ));
    f.ok("expiry on CLOCK_BOOTTIME: wall-clock jumps do not move it");
    println!("  note  SQLite locks hold between processes of this machine only");
    Ok(())
}

#[cfg(feature = "redis")]
async fn redis_nodes(url: &fencelock::RedisUrl, f: &mut Findings) {
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
    for (node, client) in nodes.iter().zip(clients) {
        println!("node {node}");
        match tokio::time::timeout(Duration::from_secs(5), probe(client)).await {
            Ok(Ok(p)) => {
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
            }
            Ok(Err(e)) => {
                f.unreachable += 1;
                f.warn(&format!("unreachable: {e}"));
            }
            Err(_) => {
                f.unreachable += 1;
                f.warn("no answer within 5s (hung or partitioned)");
            }
        }
    }
    if offsets.len() > 1 {
        let spread = offsets.iter().cloned().fold(f64::MIN, f64::max)
            - offsets.iter().cloned().fold(f64::MAX, f64::min);
        println!("nodes");
        if spread > 100.0 {
            f.warn(&format!(
                "clocks differ by {spread:.1} ms between nodes: Redlock tokens use the client's \
                 clock as their floor, and expiry drift grows with the difference; run NTP"
            ));
        } else {
            f.ok(&format!("clocks within {spread:.1} ms of each other"));
        }
        let mut distinct = run_ids.clone();
        distinct.sort();
        distinct.dedup();
        if distinct.len() < run_ids.len() {
            f.warn("two URLs reach the same server: Redlock needs independent nodes");
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
        println!("  note  one node: a restart without persistence loses its locks; use redlock:// for a quorum");
    }
}

#[cfg(feature = "redis")]
struct Probe {
    version: String,
    run_id: String,
    rtt: Duration,
    offset_ms: f64,
    appendonly: Option<String>,
    appendfsync: Option<String>,
}

#[cfg(feature = "redis")]
async fn probe(client: redis::Client) -> redis::RedisResult<Probe> {
    let mut conn = client.get_multiplexed_async_connection().await?;
    let mut rtts = Vec::new();
    for _ in 0..5 {
        let t = std::time::Instant::now();
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        rtts.push(t.elapsed());
    }
    rtts.sort();
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
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await?;
    let field = |name: &str| {
        info.lines()
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
        version: field("redis_version").unwrap_or_else(|| "unknown".into()),
        run_id: field("run_id").unwrap_or_default(),
        rtt: rtts[rtts.len() / 2],
        offset_ms: (server - mid) * 1000.0,
        appendonly: config("appendonly").await,
        appendfsync: config("appendfsync").await,
    })
}

async fn ttl_advice(args: &DoctorArgs, f: &mut Findings) {
    let p99 = match (&args.hold_p99, &args.metrics_url) {
        (Some(p), _) => Some(*p),
        (None, Some(url)) => match scrape_hold_p99(url).await {
            Ok(p) => p,
            Err(e) => {
                f.warn(&format!("cannot read the hold-time p99 from {url}: {e}"));
                None
            }
        },
        (None, None) => None,
    };
    println!("TTL");
    let Some(p99) = p99 else {
        println!("  note  give --hold-p99 or --metrics-url for TTL advice (TTL = 3 x hold p99)");
        return;
    };
    let advice = p99 * 3;
    let text = format!(
        "hold p99 {}: a TTL of at least {} (3 x p99)",
        crate::human_duration(p99),
        crate::human_duration(advice)
    );
    match args.ttl {
        Some(ttl) if ttl < advice => f.warn(&format!(
            "{text}; the TTL in use, {}, is shorter",
            crate::human_duration(ttl)
        )),
        _ => f.ok(&text),
    }
}

/// Reads the largest hold-time p99 over all resources from a Prometheus text endpoint: either
/// a summary's `quantile="0.99"` sample or, for a histogram, the first bucket holding 99 % of
/// the observations.
async fn scrape_hold_p99(url: &str) -> std::result::Result<Option<Duration>, String> {
    let text = http_get(url).await?;
    Ok(hold_p99_from(&text))
}

pub(crate) fn hold_p99_from(text: &str) -> Option<Duration> {
    const NAME: &str = "fencelock_hold_duration_seconds";
    let value = |l: &str| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok());
    let summary = text
        .lines()
        .filter(|l| l.starts_with(NAME) && l.contains("quantile=\"0.99\""))
        .filter_map(value)
        .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))));
    if let Some(s) = summary {
        return Some(Duration::from_secs_f64(s.max(0.0)));
    }
    // Histogram: cumulative buckets of all series together, per upper bound.
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for l in text
        .lines()
        .filter(|l| l.starts_with(&format!("{NAME}_bucket")))
    {
        let le = l
            .split("le=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|b| {
                if b == "+Inf" {
                    Some(f64::INFINITY)
                } else {
                    b.parse().ok()
                }
            });
        if let (Some(le), Some(v)) = (le, value(l)) {
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, c)) => *c += v,
                None => buckets.push((le, v)),
            }
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets
        .iter()
        .find(|(_, c)| *c >= 0.99 * total)
        .filter(|(b, _)| b.is_finite())
        .map(|(b, _)| Duration::from_secs_f64(*b))
}

/// A plain HTTP/1.0 GET over loopback-or-LAN TCP: enough for a metrics endpoint, without an
/// HTTP client dependency.
async fn http_get(url: &str) -> std::result::Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{p}")),
        None => (rest, "/metrics".to_owned()),
    };
    let fetch = async {
        let mut s = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut body = String::new();
        s.read_to_string(&mut body)
            .await
            .map_err(|e| e.to_string())?;
        let (head, body) = body.split_once("\r\n\r\n").ok_or("malformed HTTP reply")?;
        if !head.starts_with("HTTP/1.") || head.split_whitespace().nth(1).is_none_or(|c| c != "200")
        {
            return Err(format!(
                "HTTP status {}",
                head.lines().next().unwrap_or_default()
            ));
        }
        Ok(body.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .map_err(|_| "no answer within 5s".to_owned())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_p99_from_a_summary_or_a_histogram() {
        let summary = "fencelock_hold_duration_seconds{resource=\"a\",quantile=\"0.5\"} 0.2\n\
                       fencelock_hold_duration_seconds{resource=\"a\",quantile=\"0.99\"} 1.5\n\
                       fencelock_hold_duration_seconds{resource=\"b\",quantile=\"0.99\"} 2.5\n";
        assert_eq!(hold_p99_from(summary), Some(Duration::from_millis(2500)));
        let histogram = "fencelock_hold_duration_seconds_bucket{le=\"0.5\"} 50\n\
                         fencelock_hold_duration_seconds_bucket{le=\"1\"} 98\n\
                         fencelock_hold_duration_seconds_bucket{le=\"2\"} 100\n\
                         fencelock_hold_duration_seconds_bucket{le=\"+Inf\"} 100\n";
        assert_eq!(hold_p99_from(histogram), Some(Duration::from_secs(2)));
        assert_eq!(hold_p99_from("other_metric 1\n"), None);
    }
}
