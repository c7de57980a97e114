//! The engine's Redis nodes, reached directly rather than through fencelock: the bench needs
//! their command counters to say how many requests the lock really sent, and must delete the
//! keys it wrote whatever happened to the run. Without the `redis` feature no Redis URL gets
//! past `connect`, so the stubs that stand in for the node calls are never reached.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Result;
use fencelock::Client;

use crate::cli::{exit, Exit};
use crate::engine::RedisTarget;
use crate::reference::{Reference, REFERENCE_SET_KEY};

/// The engine's nodes, reached directly (not through fencelock) to read their command counters
/// and to delete what the bench wrote.
pub(crate) struct Servers {
    pub(crate) target: RedisTarget,
    pub(crate) addrs: Vec<String>,
    conns: Vec<NodeConn>,
}

#[cfg(feature = "redis")]
pub(crate) type NodeConn = redis::aio::MultiplexedConnection;
// Without the feature no Redis URL gets past `connect`, so no node is ever opened.
#[cfg(not(feature = "redis"))]
pub(crate) type NodeConn = ();

pub(crate) const NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// One reply of a node: a bulk string or an integer.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
enum Reply {
    Text(String),
    Int(i64),
}

impl Servers {
    pub(crate) async fn open(target: RedisTarget) -> Result<Servers> {
        let mut conns = Vec::new();
        let mut addrs = Vec::new();
        for (node, node_url) in target.nodes.iter().zip(&target.urls) {
            match tokio::time::timeout(NODE_TIMEOUT, open_node(node_url)).await {
                Ok(Ok(c)) => conns.push(c),
                Ok(Err(e)) => {
                    eprintln!("fencelock-bench: cannot reach redis node {node}: {e}");
                    return Err(Exit(exit::UNAVAILABLE).into());
                }
                Err(_) => {
                    eprintln!("fencelock-bench: no answer from redis node {node} within 5s");
                    return Err(Exit(exit::UNAVAILABLE).into());
                }
            }
            addrs.push(node.to_string());
        }
        Ok(Servers {
            target,
            addrs,
            conns,
        })
    }

    async fn call(&self, node: usize, args: &[&str]) -> std::result::Result<Reply, String> {
        let (Some(conn), Some(addr)) = (self.conns.get(node), self.addrs.get(node)) else {
            return Err(format!("no node {node}"));
        };
        match tokio::time::timeout(NODE_TIMEOUT, call_node(conn, args)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{addr}: {}: {e}", args.first().unwrap_or(&""))),
            Err(_) => Err(format!("{addr}: no answer within 5s")),
        }
    }

    pub(crate) async fn text(
        &self,
        node: usize,
        args: &[&str],
    ) -> std::result::Result<String, String> {
        match self.call(node, args).await? {
            Reply::Text(t) => Ok(t),
            Reply::Int(i) => Ok(i.to_string()),
        }
    }

    pub(crate) async fn int(&self, node: usize, args: &[&str]) -> std::result::Result<u64, String> {
        match self.call(node, args).await? {
            Reply::Int(i) => Ok(u64::try_from(i).unwrap_or(0)),
            Reply::Text(t) => t.parse().map_err(|_| format!("unexpected reply {t:?}")),
        }
    }

    /// Splits a node's call counts into requests (commands no script can run: EVALSHA, EVAL,
    /// SCRIPT, connection commands) and the rest, most of which the scripts ran.
    pub(crate) async fn requests(
        &self,
        node: usize,
        calls: &CommandStats,
    ) -> std::result::Result<u64, String> {
        let names: Vec<&str> = calls.calls.iter().map(|(n, _)| n.as_str()).collect();
        if names.is_empty() {
            return Ok(0);
        }
        let (Some(conn), Some(addr)) = (self.conns.get(node), self.addrs.get(node)) else {
            return Err(format!("no node {node}"));
        };
        let flags = match tokio::time::timeout(NODE_TIMEOUT, noscript_flags(conn, &names)).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => return Err(format!("{addr}: COMMAND INFO: {e}")),
            Err(_) => return Err(format!("{addr}: no answer within 5s")),
        };
        Ok(calls
            .calls
            .iter()
            .zip(flags)
            .filter(|(_, noscript)| *noscript)
            .map(|((_, n), _)| n)
            .sum())
    }

    pub(crate) async fn commandstats(&self) -> std::result::Result<Vec<CommandStats>, String> {
        let mut all = Vec::with_capacity(self.conns.len());
        for node in 0..self.conns.len() {
            let text = self.text(node, &["INFO", "commandstats"]).await?;
            all.push(CommandStats::parse(&text));
        }
        Ok(all)
    }

    /// Deletes every key matching `pattern` on every node (SCAN, then UNLINK in batches), for
    /// keys written by a library whose key names the bench does not derive itself. Returns
    /// how many were deleted.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) async fn unlink_matching(&self, pattern: &str) -> std::result::Result<u64, String> {
        let mut deleted = 0;
        for node in 0..self.conns.len() {
            let mut cursor = "0".to_owned();
            loop {
                let (next, keys) = self.scan(node, &cursor, pattern).await?;
                if !keys.is_empty() {
                    let mut args = vec!["UNLINK"];
                    args.extend(keys.iter().map(String::as_str));
                    deleted += self.int(node, &args).await?;
                }
                if next == "0" {
                    break;
                }
                cursor = next;
            }
        }
        Ok(deleted)
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    async fn scan(
        &self,
        node: usize,
        cursor: &str,
        pattern: &str,
    ) -> std::result::Result<(String, Vec<String>), String> {
        let (Some(conn), Some(addr)) = (self.conns.get(node), self.addrs.get(node)) else {
            return Err(format!("no node {node}"));
        };
        match tokio::time::timeout(NODE_TIMEOUT, scan_node(conn, cursor, pattern)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{addr}: SCAN: {e}")),
            Err(_) => Err(format!("{addr}: no answer within 5s")),
        }
    }

    /// Deletes the keys of every name the bench used (fencing counters, metadata, queues) on
    /// every node, and redis-benchmark's SET key if the bench created it. The names carry a
    /// random run id, so nothing else can be using these counters.
    pub(crate) async fn delete_bench_keys(
        &self,
        client: &Client,
        names: &[String],
        reference: &std::result::Result<Reference, String>,
    ) -> std::result::Result<String, String> {
        let mut keys = Vec::with_capacity(names.len() * 6);
        for name in names {
            let labelled = client.keys_for(name).map_err(|e| e.to_string())?;
            keys.extend(
                labelled
                    .into_iter()
                    .filter(|(label, _)| *label != "wake")
                    .map(|(_, k)| k),
            );
        }
        let mut deleted = 0u64;
        for node in 0..self.conns.len() {
            for chunk in keys.chunks(1000) {
                let mut args = vec!["UNLINK"];
                args.extend(chunk.iter().map(String::as_str));
                deleted += self.int(node, &args).await?;
            }
        }
        let mut msg = format!(
            "deleted {deleted} keys of {} bench names on {} node(s)",
            names.len(),
            self.conns.len()
        );
        if let Ok(r) = reference {
            if r.created_set_key {
                self.int(0, &["UNLINK", REFERENCE_SET_KEY]).await?;
                let _ = write!(msg, " and redis-benchmark's {REFERENCE_SET_KEY:?}");
            }
        }
        Ok(msg)
    }
}

/// The redis crate's client of every node of a `redis://` or `redlock://` URL, built by the
/// library from the URL, TLS settings and credentials included.
#[cfg(feature = "redis")]
pub(crate) fn node_clients(url: &str) -> std::result::Result<Vec<redis::Client>, String> {
    match fencelock::Backend::parse(url) {
        Ok(fencelock::Backend::Redis(u)) => u.clients().map_err(|e| e.to_string()),
        Ok(_) => Err("not a Redis URL".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// One node's connection, built by the library from the node's URL, TLS settings included.
#[cfg(feature = "redis")]
pub(crate) async fn open_node(url: &str) -> redis::RedisResult<NodeConn> {
    let client = node_clients(url)
        .and_then(|mut c| c.pop().ok_or_else(|| "no node in the URL".to_owned()))
        .map_err(|e| {
            redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "node URL", e))
        })?;
    client.get_multiplexed_async_connection().await
}

#[cfg(feature = "redis")]
async fn call_node(conn: &NodeConn, args: &[&str]) -> redis::RedisResult<Reply> {
    let mut conn = conn.clone();
    let mut cmd = redis::Cmd::new();
    for a in args {
        cmd.arg(*a);
    }
    Ok(match cmd.query_async::<redis::Value>(&mut conn).await? {
        redis::Value::Int(i) => Reply::Int(i),
        other => Reply::Text(redis::from_redis_value(other)?),
    })
}

#[cfg(feature = "redis")]
async fn scan_node(
    conn: &NodeConn,
    cursor: &str,
    pattern: &str,
) -> redis::RedisResult<(String, Vec<String>)> {
    let mut conn = conn.clone();
    redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(1000)
        .query_async(&mut conn)
        .await
}

#[cfg(not(feature = "redis"))]
#[allow(dead_code)]
async fn scan_node(
    _: &NodeConn,
    _: &str,
    _: &str,
) -> std::result::Result<(String, Vec<String>), String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

/// Which of `names` carry the `noscript` flag: commands a script cannot run, so every call
/// of them is a request some client sent.
#[cfg(feature = "redis")]
async fn noscript_flags(conn: &NodeConn, names: &[&str]) -> redis::RedisResult<Vec<bool>> {
    use redis::Value;
    let mut conn = conn.clone();
    let reply: Vec<Value> = redis::cmd("COMMAND")
        .arg("INFO")
        .arg(names)
        .query_async(&mut conn)
        .await?;
    Ok(reply
        .iter()
        .map(|info| match info {
            Value::Array(fields) => match fields.get(2) {
                Some(Value::Array(flags)) => flags.iter().any(|f| match f {
                    Value::SimpleString(s) => s == "noscript",
                    Value::BulkString(b) => b == b"noscript",
                    _ => false,
                }),
                _ => false,
            },
            _ => false,
        })
        .collect())
}

#[cfg(not(feature = "redis"))]
async fn noscript_flags(_: &NodeConn, _: &[&str]) -> std::result::Result<Vec<bool>, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[cfg(not(feature = "redis"))]
pub(crate) async fn open_node(_: &str) -> std::result::Result<NodeConn, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[cfg(not(feature = "redis"))]
async fn call_node(_: &NodeConn, _: &[&str]) -> std::result::Result<Reply, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[derive(Default)]
pub(crate) struct CommandStats {
    calls: Vec<(String, u64)>,
}

impl CommandStats {
    /// Reads `cmdstat_<name>:calls=N,...` lines of `INFO commandstats`.
    fn parse(text: &str) -> CommandStats {
        let calls = text
            .lines()
            .filter_map(|line| {
                let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let n = fields
                    .split(',')
                    .find_map(|f| f.strip_prefix("calls="))?
                    .trim()
                    .parse()
                    .ok()?;
                Some((name.to_owned(), n))
            })
            .collect();
        CommandStats { calls }
    }

    pub(crate) fn delta(before: &CommandStats, after: &CommandStats) -> CommandStats {
        let calls = after
            .calls
            .iter()
            .map(|(name, n)| {
                let was = before
                    .calls
                    .iter()
                    .find(|(b, _)| b == name)
                    .map_or(0, |(_, b)| *b);
                (name.clone(), n.saturating_sub(was))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        CommandStats { calls }
    }

    pub(crate) fn total(&self) -> u64 {
        self.calls.iter().map(|(_, n)| n).sum()
    }

    /// The busiest commands, with `own` calls of `own_cmd` (the bench's) taken off.
    pub(crate) fn top(&self, n: usize, own_cmd: &str, own: u64) -> String {
        let mut calls: Vec<(String, u64)> = self
            .calls
            .iter()
            .map(|(c, k)| {
                (
                    c.clone(),
                    if c == own_cmd {
                        k.saturating_sub(own)
                    } else {
                        *k
                    },
                )
            })
            .filter(|(_, k)| *k > 0)
            .collect();
        calls.sort_by_key(|c| std::cmp::Reverse(c.1));
        if calls.is_empty() {
            return "none".to_owned();
        }
        calls
            .iter()
            .take(n)
            .map(|(c, k)| format!("{c} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_deltas() {
        let before = CommandStats::parse(
            "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=5\r\ncmdstat_info:calls=2,usec=1\r\n",
        );
        let after = CommandStats::parse(
            "# Commandstats\r\ncmdstat_evalsha:calls=30,usec=9\r\ncmdstat_info:calls=3,usec=1\r\n\
             cmdstat_unlink:calls=4,usec=1\r\n",
        );
        let d = CommandStats::delta(&before, &after);
        assert_eq!(d.total(), 25);
        assert_eq!(d.top(4, "info", 1), "evalsha 20, unlink 4");
    }
}
