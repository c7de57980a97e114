//! The floors under fencelock's sequential figure: the bare `redis` crate running, on every node
//! at once, (a) the very scripts fencelock's engine runs for an uncontended pair, with its keys
//! and arguments (`RedisUrl::pair_calls`), and (b) the least a fenced lock can run as scripts:
//! `SET NX PX` and `INCR` of a counter in one script, and rslock's own compare-and-delete.
//!
//! Against rslock in the same round, (a) tells what fencelock's scripts cost on the servers
//! with no client work around them, and fencelock against (a) what its client adds; (b) tells
//! what any script-based fenced lock costs, whatever it keeps beside the token. (c) takes the
//! lock and the token without a script, `SET NX PX` and `INCR` in one `MULTI`/`EXEC`: what the
//! script machinery itself costs. It is no design fencelock could ship: the counter advances on
//! every refused attempt too, restarts at 1 on a node that comes back empty (tokens going
//! back), and nothing checks limits or records the holder.

use futures_util::future::join_all;
use redis::aio::MultiplexedConnection;
use redis::{RedisError, Script, Value};

use crate::harness::LockLib;
use crate::servers::node_clients;
use crate::CLIENT_NAME;

/// `SET NX PX` and, only when it took the lock, the next token: the least work a fenced grant
/// does in one script.
const MINIMAL_ACQUIRE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return redis.call('INCR', KEYS[2]) end return false";
/// rslock's release, word for word.
const MINIMAL_RELEASE: &str = "if redis.call(\"get\",KEYS[1]) == ARGV[1] then return \
     redis.call(\"del\",KEYS[1]) else return 0 end";

/// Which scripts a [`Bare`] client runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scripts {
    /// fencelock's own, with its keys and arguments.
    Fencelock,
    /// The minimal fenced pair.
    Minimal,
    /// `SET NX PX` and `INCR` in a transaction, and rslock's release.
    Transaction,
}

impl Scripts {
    pub(crate) fn key(self) -> &'static str {
        match self {
            Scripts::Fencelock => "fencelock_scripts",
            Scripts::Minimal => "minimal_scripts",
            Scripts::Transaction => "transaction",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Scripts::Fencelock => "redis crate + fencelock's scripts",
            Scripts::Minimal => "redis crate + SET NX PX/INCR script",
            Scripts::Transaction => "redis crate + SET NX PX/INCR in MULTI",
        }
    }
}

/// One multiplexed connection per node, as fencelock and rslock each keep, and the two scripts.
pub(crate) struct Bare {
    url: fencelock::RedisUrl,
    conns: Vec<MultiplexedConnection>,
    scripts: Scripts,
    acquire: Script,
    release: Script,
    prefix: String,
    /// fencelock's scripts: the id each node last answered with, which the acquire call
    /// carries as the engine's does (see `fencelock::REDIS_NODE_ID_ARG`).
    node_ids: std::sync::Mutex<Vec<String>>,
}

/// A pair's release call, kept from its acquisition.
pub(crate) struct BareGuard {
    keys: Vec<String>,
    args: Vec<String>,
}

impl Bare {
    /// Connects to every node of `url`; keys go under `prefix`.
    pub(crate) async fn connect(url: &str, scripts: Scripts, prefix: &str) -> Result<Bare, String> {
        let parsed = match fencelock::Backend::parse(url) {
            Ok(fencelock::Backend::Redis(u)) => u,
            _ => return Err("not a Redis URL".to_owned()),
        };
        let mut conns = Vec::new();
        for client in node_clients(url)? {
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?;
            conns.push(conn);
        }
        let (acquire, release) = match scripts {
            Scripts::Fencelock => {
                let calls = parsed.pair_calls(prefix, CLIENT_NAME, "-", "-", super::TTL);
                (
                    Script::new(&calls.acquire.source),
                    Script::new(&calls.release.source),
                )
            }
            Scripts::Minimal | Scripts::Transaction => {
                (Script::new(MINIMAL_ACQUIRE), Script::new(MINIMAL_RELEASE))
            }
        };
        Ok(Bare {
            url: parsed,
            node_ids: std::sync::Mutex::new(vec![String::new(); conns.len()]),
            conns,
            scripts,
            acquire,
            release,
            prefix: prefix.to_owned(),
        })
    }

    /// `MULTI`, `SET lock owner NX PX ttl`, `INCR fence`, `EXEC` on every node at once (one
    /// round trip each); the number of nodes whose `SET` took the lock.
    async fn transaction(&self, lock: &str, fence: &str, owner: &str) -> Result<usize, RedisError> {
        let ttl = super::TTL.as_millis().to_string();
        let calls = self.conns.iter().map(|conn| {
            let mut conn = conn.clone();
            let mut pipe = redis::pipe();
            pipe.atomic()
                .cmd("SET")
                .arg(lock)
                .arg(owner)
                .arg("NX")
                .arg("PX")
                .arg(&ttl)
                .cmd("INCR")
                .arg(fence);
            async move { pipe.query_async::<(Option<String>, i64)>(&mut conn).await }
        });
        let mut yes = 0;
        for reply in join_all(calls).await {
            if reply?.0.is_some() {
                yes += 1;
            }
        }
        Ok(yes)
    }

    pub(crate) fn scripts(&self) -> Scripts {
        self.scripts
    }

    /// Runs `script` on every node at once (one future per node, joined on this task, as
    /// rslock does); the number of nodes whose reply `granted` accepts.
    async fn everywhere(
        &self,
        script: &Script,
        keys: &[String],
        args: &[String],
        granted: fn(&Value) -> bool,
        node_id_arg: Option<usize>,
    ) -> Result<usize, RedisError> {
        let ids = node_id_arg.map(|_| crate::harness::lock(&self.node_ids).clone());
        let calls = self.conns.iter().enumerate().map(|(n, conn)| {
            let mut conn = conn.clone();
            let mut inv = script.prepare_invoke();
            for k in keys {
                inv.key(k);
            }
            for (i, a) in args.iter().enumerate() {
                match (&ids, node_id_arg) {
                    (Some(ids), Some(at)) if at == i => inv.arg(&ids[n]),
                    _ => inv.arg(a),
                };
            }
            async move { inv.invoke_async::<Value>(&mut conn).await }
        });
        let mut yes = 0;
        for (n, reply) in join_all(calls).await.into_iter().enumerate() {
            let reply = reply?;
            if granted(&reply) {
                yes += 1;
            }
            // A node whose id the call did not carry answers with it.
            if let (Some(_), Value::Array(items)) = (node_id_arg, &reply) {
                if let Some(Value::BulkString(id)) = items.get(2) {
                    crate::harness::lock(&self.node_ids)[n] = String::from_utf8_lossy(id).into();
                }
            }
        }
        Ok(yes)
    }
}

fn refused(name: &str, granted: usize, nodes: usize) -> RedisError {
    RedisError::from((
        redis::ErrorKind::Client,
        "a node refused a free name",
        format!("{granted} of {nodes} nodes granted {name}"),
    ))
}

/// A grant by fencelock's acquire script: the bare token, or a table starting with 1.
fn granted_by_fencelock(v: &Value) -> bool {
    match v {
        Value::Int(_) => true,
        Value::BulkString(b) => b.first().is_some_and(u8::is_ascii_digit),
        Value::Array(items) => matches!(items.first(), Some(Value::Int(1))),
        _ => false,
    }
}

fn is_int(v: &Value) -> bool {
    matches!(v, Value::Int(_))
}

fn is_one(v: &Value) -> bool {
    matches!(v, Value::Int(1))
}

impl LockLib for Bare {
    type Guard = BareGuard;
    type Error = RedisError;

    async fn try_acquire(&self, name: &str) -> Result<BareGuard, RedisError> {
        let owner = format!("{:016x}", rand_owner());
        let (keys, args, guard, granted): (_, _, _, fn(&Value) -> bool) = match self.scripts {
            Scripts::Fencelock => {
                let calls =
                    self.url
                        .pair_calls(&self.prefix, CLIENT_NAME, name, &owner, super::TTL);
                let guard = BareGuard {
                    keys: calls.release.keys,
                    args: calls.release.args,
                };
                (
                    calls.acquire.keys,
                    calls.acquire.args,
                    guard,
                    granted_by_fencelock,
                )
            }
            Scripts::Transaction => {
                let lock = format!("{}lock:{name}", self.prefix);
                let fence = format!("{}fence:{name}", self.prefix);
                let guard = BareGuard {
                    keys: vec![lock.clone()],
                    args: vec![owner.clone()],
                };
                let granted = self.transaction(&lock, &fence, &owner).await?;
                return if granted == self.conns.len() {
                    Ok(guard)
                } else {
                    Err(refused(name, granted, self.conns.len()))
                };
            }
            Scripts::Minimal => {
                let lock = format!("{}lock:{name}", self.prefix);
                let fence = format!("{}fence:{name}", self.prefix);
                let ttl = super::TTL.as_millis().to_string();
                let guard = BareGuard {
                    keys: vec![lock.clone()],
                    args: vec![owner.clone()],
                };
                (vec![lock, fence], vec![owner, ttl], guard, is_int)
            }
        };
        let node_id_arg =
            (self.scripts == Scripts::Fencelock).then_some(fencelock::REDIS_NODE_ID_ARG);
        let granted = self
            .everywhere(&self.acquire, &keys, &args, granted, node_id_arg)
            .await?;
        // The sequential loop's names are free: every node grants, or the run is wrong.
        if granted == self.conns.len() {
            Ok(guard)
        } else {
            Err(refused(name, granted, self.conns.len()))
        }
    }

    async fn acquire(&self, name: &str) -> Result<Option<BareGuard>, RedisError> {
        self.try_acquire(name).await.map(Some)
    }

    async fn release(&self, guard: BareGuard) -> Result<(), RedisError> {
        self.everywhere(&self.release, &guard.keys, &guard.args, is_one, None)
            .await
            .map(|_| ())
    }
}

/// An owner value as unique as fencelock's and rslock's random ones.
pub(super) fn rand_owner() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
