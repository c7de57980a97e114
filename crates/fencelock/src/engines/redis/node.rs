//! One Redis node: its connection, the id it keeps in memory, and whether its votes count.
//!
//! - **Delayed restart, done by the client.** Each node keeps a random id in memory (the
//!   `node` key). When a node answers with a different id than before, it lost its data, and
//!   with it possibly locks it had granted: its votes do not count for one maximum TTL of this
//!   client. A client that first meets a node after its restart cannot tell; run Redis with
//!   `appendfsync always` for correctness locks.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;

use crate::core::error::{Error, Result};
use crate::core::url::HostPort;

/// One node's answer, or the text of its failure (naming the node).
pub(super) type NodeResult<T> = std::result::Result<T, String>;

#[derive(Default)]
struct NodeSeen {
    id: Option<String>,
    sit_out_until: Option<Instant>,
}

pub(super) struct Node {
    seen: Mutex<NodeSeen>,
    /// Its connection, name and reachability, also handed to futures that must outlive a call.
    link: OwnedNode,
}

/// What the node's metrics last recorded of it, shared with its [`OwnedNode`]s: its series
/// move only when that changes, found without a process-wide lookup on every call.
struct Reach {
    /// `host:port`, the `node` label.
    addr: String,
    /// 0 before the first call, then [`REACHED`] or [`NOT_REACHED`].
    last: AtomicU8,
}

const REACHED: u8 = 1;
const NOT_REACHED: u8 = 2;

impl Node {
    /// A node that connects on its first call, and the client its wake-up subscription uses.
    pub(super) fn connect(
        kind: &'static str,
        node: &HostPort,
        client: redis::Client,
        op_timeout: Duration,
    ) -> Result<(Node, redis::Client)> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(op_timeout))
            // Every call already has a deadline of its own (per node, per operation); a third
            // timer per request would only cost time.
            .set_response_timeout(None)
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(200));
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), config).map_err(|e| {
                Error::engine_failure(kind, format!("node {}:{}", node.host, node.port))
                    .with_source(e)
            })?;
        let addr = format!("{}:{}", node.host, node.port);
        let node = Node {
            link: OwnedNode {
                kind,
                reach: Arc::new(Reach {
                    addr,
                    last: AtomicU8::new(0),
                }),
                conn,
            },
            seen: Mutex::new(NodeSeen::default()),
        };
        Ok((node, client))
    }

    /// `host:port`, as the URL writes it (never its password): how errors and metrics name
    /// the node.
    pub(super) fn addr(&self) -> &str {
        &self.link.reach.addr
    }

    pub(super) async fn ping(&self, limit: Duration) -> redis::RedisResult<()> {
        let mut conn = self.link.conn.clone();
        match tokio::time::timeout(limit, redis::cmd("PING").query_async::<String>(&mut conn)).await
        {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer to PING",
            ))),
        }
    }

    /// Runs a script with a deadline; errors become text naming the node.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        call: ScriptCall,
        limit: Duration,
    ) -> NodeResult<T> {
        self.link.run(call, limit).await
    }

    /// What running a script on the node needs, owned: for a future that must be able to
    /// finish on its own after its caller stopped waiting for it (see
    /// [`RedisEngine::ask_until`](super::RedisEngine::ask_until)).
    pub(super) fn owned(&self) -> OwnedNode {
        self.link.clone()
    }

    /// Runs one command with a deadline; errors become text naming the node.
    pub(super) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        limit: Duration,
    ) -> NodeResult<T> {
        let mut conn = self.link.conn.clone();
        self.bounded(cmd.query_async::<T>(&mut conn), limit).await
    }

    /// Runs a pipeline (a transaction, when atomic) with a deadline; errors become text naming
    /// the node.
    pub(super) async fn query_pipe<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
        limit: Duration,
    ) -> NodeResult<T> {
        let mut conn = self.link.conn.clone();
        self.bounded(pipe.query_async::<T>(&mut conn), limit).await
    }

    async fn bounded<T>(
        &self,
        request: impl std::future::Future<Output = redis::RedisResult<T>>,
        limit: Duration,
    ) -> NodeResult<T> {
        bounded(self.link.kind, &self.link.reach, request, limit).await
    }

    /// Whether the node refuses this client's credentials: found by one PING, so that a wrong
    /// password reads as such and not as a node that never answers. `None` when the node
    /// accepted them or could not be asked within `limit`.
    pub(super) async fn auth_refusal(&self, limit: Duration) -> Option<String> {
        match self.ping(limit).await {
            Err(e) if is_auth_failure(&e) => Some(format!(
                "{}: authentication failed ({e}); check the user and password in the URL",
                self.addr()
            )),
            _ => None,
        }
    }

    /// Records the node id a node answered with; a changed id means the node restarted without
    /// its data, so its votes are ignored until `sit_out` has passed.
    pub(super) fn observe(&self, id: &str, sit_out: Duration) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.id.as_deref() {
            Some(prev) if prev != id => {
                tracing::warn!(node = %self.addr(), "node lost its data (restarted); it sits out of quorum votes for one maximum TTL");
                seen.sit_out_until = Some(Instant::now() + sit_out);
                seen.id = Some(id.to_owned());
            }
            Some(_) => {}
            None => seen.id = Some(id.to_owned()),
        }
    }

    /// The node id this client last saw on the node, empty before the first: the acquire
    /// script answers in full only when the node's id differs from it.
    pub(super) fn known_id(&self) -> String {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.id.clone().unwrap_or_default()
    }

    pub(super) fn votes(&self) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.sit_out_until.is_none_or(|t| Instant::now() >= t)
    }
}

/// A node's connection and name, owned: see [`Node::owned`].
#[derive(Clone)]
pub(super) struct OwnedNode {
    /// `redis` or `redlock`, the `engine` label of the node's metrics.
    kind: &'static str,
    reach: Arc<Reach>,
    conn: ConnectionManager,
}

impl OwnedNode {
    /// Runs a script with a deadline; errors become text naming the node.
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        call: ScriptCall,
        limit: Duration,
    ) -> NodeResult<T> {
        run_script(self.kind, &self.reach, &self.conn, call, limit).await
    }
}

/// One call of a script, written as its `EVALSHA` command as the keys and arguments come:
/// the driver's own invocation gathers each item in a buffer of its own and then copies them
/// all into the command, about twenty allocations per acquire and release pair.
pub(super) struct ScriptCall {
    script: &'static redis::Script,
    cmd: redis::Cmd,
}

impl ScriptCall {
    /// A call of `script` with `keys` keys: the first `keys` items given to [`ScriptCall::arg`]
    /// are its `KEYS`, the rest its `ARGV`.
    pub(super) fn new(script: &'static redis::Script, keys: usize) -> ScriptCall {
        // Room for an acquisition's items (its value, the holder, is the longest) without
        // growing the buffers as they come; a batch of renewals grows them once or twice.
        let mut cmd = redis::Cmd::with_capacity(12, 512);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        ScriptCall { script, cmd }
    }

    pub(super) fn arg(&mut self, item: impl redis::ToRedisArgs) -> &mut ScriptCall {
        self.cmd.arg(item);
        self
    }
}

/// Runs a script on the node with a deadline, loading it first where the node does not know
/// it (a new or restarted node); errors become text naming the node.
async fn run_script<T: redis::FromRedisValue>(
    kind: &'static str,
    reach: &Reach,
    conn: &ConnectionManager,
    call: ScriptCall,
    limit: Duration,
) -> NodeResult<T> {
    let mut conn = conn.clone();
    let request = async move {
        match call.cmd.query_async(&mut conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                call.script.load_async(&mut conn).await?;
                call.cmd.query_async(&mut conn).await
            }
            answer => answer,
        }
    };
    bounded(kind, reach, request, limit).await
}

/// Waits for one request to the node at `addr` with a deadline; errors become text naming the
/// node.
async fn bounded<T>(
    kind: &'static str,
    reach: &Reach,
    request: impl std::future::Future<Output = redis::RedisResult<T>>,
    limit: Duration,
) -> NodeResult<T> {
    let answer = tokio::time::timeout(limit, request).await;
    // Reached: the node answered, if only with an error of its own (a script's refusal).
    // Not reached: no connection, a dropped one, no answer in time, or credentials
    // refused, none of which the other nodes' answers make visible while a quorum holds.
    // `addr` is host:port, never the URL's password.
    let reached = match &answer {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e.code().is_some() && !is_auth_failure(e),
        Err(_) => false,
    };
    let addr = reach.addr.as_str();
    let now = if reached { REACHED } else { NOT_REACHED };
    let was = reach.last.swap(now, Ordering::Relaxed);
    if was != now || !reached {
        crate::core::metrics::node_answered(kind, addr, reached, was == 0);
    }
    match answer {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if is_auth_failure(&e) => Err(format!(
            "{}: authentication failed ({e}); check the user and password",
            addr
        )),
        Ok(Err(e)) => match scripting_refusal(&e) {
            Some(why) => Err(format!("{}: {why}", addr)),
            None if e.code() == Some("NOPERM") || e.to_string().starts_with("NoPerm") => {
                Err(format!(
                    "{}: {e}; the ACL user may not do this under this prefix (`fencelock acl` \
                     prints the user fencelock needs, `fencelock doctor` names what is \
                     missing)",
                    addr
                ))
            }
            None => Err(format!("{}: {e}", addr)),
        },
        Err(_) => Err(format!(
            "{}: no answer within {}",
            addr,
            crate::core::options::display_duration(limit)
        )),
    }
}

/// A refusal of the credentials: a failed AUTH, or a command refused for want of one.
pub(super) fn is_auth_failure(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// The scripting commands the engine runs (the driver sends a script by its digest and loads
/// it when the node does not know it yet) refused by the node: renamed away in its
/// configuration (`rename-command`) or denied by its ACL. Said as such, since the node's own
/// message quotes the script's digest and keys and names no cause.
pub(super) fn scripting_refusal(e: &redis::RedisError) -> Option<String> {
    let text = e.to_string();
    let lower = text.to_ascii_lowercase();
    let command = ["evalsha", "script"]
        .into_iter()
        .find(|c| lower.contains(&format!("'{c}")))?;
    let command = if command == "script" {
        "SCRIPT LOAD"
    } else {
        "EVALSHA"
    };
    let why = if lower.contains("unknown command") {
        format!(
            "this server has no {command} command (renamed or disabled by rename-command in its configuration)"
        )
    } else if e.code() == Some("NOPERM") {
        format!("this user may not run {command} (the server's ACL)")
    } else {
        return None;
    };
    Some(format!(
        "{why}; fencelock runs every lock operation as a server-side script and needs EVALSHA and SCRIPT LOAD (`fencelock doctor` checks a server)"
    ))
}
