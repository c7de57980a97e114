//! The floor under fencelock's one-node fair handoff: the least a FIFO lock can run whose
//! release hands the lock straight to the next waiter and tells only that waiter's client, as
//! fencelock's fair mode does on one node. Its acquire is `SET NX PX`, or a place at the back
//! of a list; its release checks the owner, pops the next waiter, sets the lock to it with the
//! next token and publishes the token on the client's channel. Five calls a handoff, where
//! fencelock's handoff release makes about a dozen (limits, queue expiry, holder record).
//!
//! It is no design to ship: a waiter that dies or gives up stays in the list and is handed a
//! lock nobody takes until its TTL ends, and nothing records the holder. It only tells, in the
//! same run and harness, how close to one round trip a script-based handoff can get on this
//! server: the utilisation fencelock's fair mode is read against.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{RedisError, Script, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::harness::{lock, LockLib};
use crate::servers::node_clients;

/// KEYS: lock, fence, queue. ARGV: owner, ttl_ms. The token when granted, else queued: false.
const ACQUIRE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
     return redis.call('INCR', KEYS[2]) end redis.call('RPUSH', KEYS[3], ARGV[1]) return false";
/// KEYS: lock, fence, queue, channel. ARGV: owner, ttl_ms. 1 when it was the owner's.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end \
     local nxt = redis.call('LPOP', KEYS[3]) \
     if not nxt then redis.call('DEL', KEYS[1]) return 1 end \
     redis.call('SET', KEYS[1], nxt, 'PX', ARGV[2]) \
     redis.call('PUBLISH', KEYS[4], nxt .. ' ' .. redis.call('INCR', KEYS[2])) return 1";

/// Waiters of this client, by owner, told when a release handed them the lock.
type Waiting = Arc<Mutex<HashMap<String, oneshot::Sender<()>>>>;

/// One connection for the scripts and one subscription to the client's channel, shared by
/// every worker, as fencelock's client keeps. A release publishes on its own client's channel:
/// the floor serves the waiters of one client, as the bench runs them.
pub(crate) struct Handoff {
    conn: MultiplexedConnection,
    acquire: Script,
    release: Script,
    prefix: String,
    channel: String,
    waiting: Waiting,
    listener: JoinHandle<()>,
}

pub(crate) struct HandoffGuard {
    name: String,
    owner: String,
}

impl Handoff {
    /// Connects to the one node of `url` and subscribes to this client's channel; keys go
    /// under `prefix`.
    pub(crate) async fn connect(url: &str, prefix: &str) -> Result<Handoff, String> {
        let mut clients = node_clients(url)?;
        let client = match (clients.pop(), clients.is_empty()) {
            (Some(c), true) => c,
            _ => return Err("the handoff floor runs on one node".to_owned()),
        };
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        let channel = format!("{prefix}handoff-floor:{:016x}", super::floor::rand_owner());
        let mut pubsub = client.get_async_pubsub().await.map_err(|e| e.to_string())?;
        pubsub
            .subscribe(&channel)
            .await
            .map_err(|e| e.to_string())?;
        let waiting: Waiting = Arc::default();
        let routes = waiting.clone();
        let listener = tokio::spawn(async move {
            let mut stream = pubsub.into_on_message();
            while let Some(msg) = stream.next().await {
                let payload = String::from_utf8_lossy(msg.get_payload_bytes()).into_owned();
                let owner = payload.split(' ').next().unwrap_or_default();
                let told = lock(&routes).remove(owner);
                if let Some(tx) = told {
                    let _ = tx.send(());
                }
            }
        });
        Ok(Handoff {
            conn,
            acquire: Script::new(ACQUIRE),
            release: Script::new(RELEASE),
            prefix: prefix.to_owned(),
            channel,
            waiting,
            listener,
        })
    }

    fn keys(&self, name: &str) -> [String; 3] {
        let p = &self.prefix;
        [
            format!("{p}lock:{name}"),
            format!("{p}fence:{name}"),
            format!("{p}queue:{name}"),
        ]
    }

    /// The acquire script once: whether it granted (else the owner is queued).
    async fn attempt(&self, name: &str, owner: &str) -> Result<bool, RedisError> {
        let mut conn = self.conn.clone();
        let reply: Value = self
            .acquire
            .key(&self.keys(name)[..])
            .arg(owner)
            .arg(super::TTL.as_millis() as u64)
            .invoke_async(&mut conn)
            .await?;
        Ok(matches!(reply, Value::Int(_)))
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

impl LockLib for Handoff {
    type Guard = HandoffGuard;
    type Error = RedisError;

    async fn try_acquire(&self, name: &str) -> Result<HandoffGuard, RedisError> {
        match self.acquire(name).await? {
            Some(guard) => Ok(guard),
            None => Err(RedisError::from((
                redis::ErrorKind::Client,
                "not handed the lock in time",
            ))),
        }
    }

    async fn acquire(&self, name: &str) -> Result<Option<HandoffGuard>, RedisError> {
        let owner = format!("{:016x}", super::floor::rand_owner());
        // Listening before the attempt: a release right after it queues this waiter must
        // find it.
        let (tx, rx) = oneshot::channel();
        lock(&self.waiting).insert(owner.clone(), tx);
        let granted = self.attempt(name, &owner).await;
        let handed = match granted {
            Ok(true) => true,
            Ok(false) => matches!(tokio::time::timeout(super::WAIT, rx).await, Ok(Ok(()))),
            Err(e) => {
                lock(&self.waiting).remove(&owner);
                return Err(e);
            }
        };
        lock(&self.waiting).remove(&owner);
        Ok(handed.then(|| HandoffGuard {
            name: name.to_owned(),
            owner,
        }))
    }

    async fn release(&self, guard: HandoffGuard) -> Result<(), RedisError> {
        let keys = self.keys(&guard.name);
        let mut conn = self.conn.clone();
        self.release
            .key(&keys[..])
            .key(&self.channel)
            .arg(&guard.owner)
            .arg(super::TTL.as_millis() as u64)
            .invoke_async::<Value>(&mut conn)
            .await
            .map(|_| ())
    }
}
