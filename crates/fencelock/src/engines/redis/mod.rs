//! Redis engines: one node (`redis://`) and Redlock over N independent nodes (`redlock://`).
//!
//! Both are one engine with N nodes and a quorum of `N / 2 + 1` (1 for a single node).
//!
//! - **Interoperable lock key.** The lock key holds the owner value as a plain string set with
//!   `NX PX`, so a client in another language using `SET key value NX PX ttl` on the same key
//!   (see [`keys`] for the layout, or `fencelock key NAME`) excludes fencelock and vice versa.
//! - **One round trip per node.** A script takes the lock and advances the fencing counter
//!   atomically; extension and release are owner-checked scripts.
//! - **Tokens on a quorum.** Each granting node answers `max(counter + 1, floor)`, where the
//!   floor is the client's clock in microseconds (the server's, for one node). The lease token
//!   `T` is the maximum over the granting nodes; unless a majority already answered `T`, the
//!   counter is raised to `T` on a majority before the lease is handed out, so any later
//!   majority, which intersects that one, grants above `T`. With synchronised clocks the nodes
//!   answer the same floor and the raise is skipped: one round trip.
//! - **Delayed restart, done by the client.** Each node keeps a random id in memory (the
//!   `node` key). When a node answers with a different id than before, it lost its data, and
//!   with it possibly locks it had granted: its votes do not count for one maximum TTL of this
//!   client. A client that first meets a node after its restart cannot tell; run Redis with
//!   `appendfsync always` for correctness locks.
//! - **Wake-ups.** A refused attempt sets the resource's `wait` flag; a release that finds it
//!   publishes on the resource's wake channel (an uncontended release publishes nothing). Each
//!   client keeps one pattern subscription per node and wakes the waiters of that resource. A
//!   waiter subscribes before it sends its attempt, so a release right after a refusal is never
//!   missed; without a message it sleeps no longer than the holder's remaining TTL.
//! - **Fairness.** By default woken waiters race and the fastest wins: no order, and a waiter
//!   can in principle lose many races in a row. Fair mode ([`LockOptions::fair`]) keeps a FIFO
//!   queue on the node: the lock is granted to the oldest waiter still asking; a waiter that
//!   stops asking (crashed, cancelled) leaves the queue after its entry expires, or at once
//!   when its acquisition is cancelled. On one node a release hands the lock straight to the
//!   head of the queue and names it, with its token, in the wake-up: the handoff costs one
//!   message instead of a message and a round trip (see the release script for the expiry
//!   such a grant gets, and the client's acquire loop for the validity it counts). On Redlock
//!   every node places a waiter by the start of its acquisition, so that all nodes agree on
//!   the head, and a split vote's rollback leaves the waiter's place alone.
//!
//! [`LockOptions::fair`]: crate::LockOptions::fair

pub(crate) mod keys;
mod runbook;
mod scripts;
pub(crate) mod url;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures_util::future::join_all;
use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Value;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::core::engine::{
    AcquireRequest, Attempt, Engine, EngineConfig, FairQueue, Opened, Renewal, Renewed,
};
use crate::core::error::{Error, Result};
use crate::core::holder::{from_unix_millis, unix_millis, Holder, HolderMeta};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::token::FencingToken;
use crate::core::wake::{keep_listening, Wakers};
use keys::Keys;
use url::RedisUrl;

/// Leases per extension script call: keeps each call's argument list and run time small.
const EXTEND_CHUNK: usize = 1000;

/// Opens the nodes of `url`: the lock, and a FIFO queue of waiters on every node (fair mode).
pub(crate) async fn open(url: RedisUrl, cfg: &EngineConfig) -> Result<Opened> {
    let urls = url.node_urls();
    let kind = url.engine();
    let RedisUrl {
        tls, quorum, nodes, ..
    } = url;
    if tls {
        return Err(Error::invalid(
            "rediss:// (TLS) is not supported by this build yet; use redis:// on a trusted \
             network or a TLS tunnel",
        ));
    }
    let shutdown = CancellationToken::new();
    let wakers = Arc::new(Wakers::default());
    let channel = keys::client_channel(&cfg.prefix, &format!("{:016x}", rand::random::<u64>()));
    let mut conns = Vec::with_capacity(nodes.len());
    for (node, url) in nodes.iter().zip(&urls) {
        let client = redis::Client::open(url.as_str())
            .map_err(|e| Error::invalid(format!("node {}:{}: {e}", node.host, node.port)))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(cfg.op_timeout))
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
        tokio::spawn(listen_for_wakeups(
            client,
            cfg.prefix.clone(),
            channel.clone(),
            wakers.clone(),
            shutdown.clone(),
        ));
        conns.push(Node {
            addr: format!("{}:{}", node.host, node.port),
            conn,
            seen: Mutex::new(NodeSeen::default()),
        });
    }
    let engine = RedisEngine {
        kind,
        quorum: conns.len() / 2 + 1,
        nodes: conns,
        prefix: cfg.prefix.clone(),
        op_timeout: cfg.op_timeout,
        max_ttl: cfg.max_ttl,
        wakers,
        channel,
        shutdown,
    };
    if !quorum {
        // One node: fail early with a clear error when it cannot be reached at all.
        engine.nodes[0].ping(cfg.op_timeout).await.map_err(|e| {
            let hint = if e.kind() == redis::ErrorKind::AuthenticationFailed {
                "authentication failed; check the user and password in the URL"
            } else {
                "cannot connect; check that the server is up and the URL is right"
            };
            Error::engine_failure(kind, format!("{}: {hint}", engine.nodes[0].addr)).with_source(e)
        })?;
    }
    let engine = Arc::new(engine);
    Ok(Opened {
        fair: Some(engine.clone()),
        ..Opened::lock(engine)
    })
}

pub(crate) struct RedisEngine {
    kind: &'static str,
    nodes: Vec<Node>,
    quorum: usize,
    prefix: String,
    op_timeout: Duration,
    max_ttl: Duration,
    wakers: Arc<Wakers>,
    /// This client's own wake-up channel: handoffs to its fair waiters.
    channel: String,
    shutdown: CancellationToken,
}

impl Drop for RedisEngine {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

#[derive(Default)]
struct NodeSeen {
    id: Option<String>,
    sit_out_until: Option<Instant>,
}

struct Node {
    addr: String,
    conn: ConnectionManager,
    seen: Mutex<NodeSeen>,
}

type NodeResult<T> = std::result::Result<T, String>;

impl Node {
    async fn ping(&self, limit: Duration) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
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
    async fn run<T: redis::FromRedisValue>(
        &self,
        inv: redis::ScriptInvocation<'_>,
        limit: Duration,
    ) -> NodeResult<T> {
        let mut conn = self.conn.clone();
        self.bounded(inv.invoke_async::<T>(&mut conn), limit).await
    }

    /// Waits for one request to this node with a deadline; errors become text naming the node.
    async fn bounded<T>(
        &self,
        request: impl std::future::Future<Output = redis::RedisResult<T>>,
        limit: Duration,
    ) -> NodeResult<T> {
        match tokio::time::timeout(limit, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{}: {e}", self.addr)),
            Err(_) => Err(format!(
                "{}: no answer within {}",
                self.addr,
                crate::core::options::display_duration(limit)
            )),
        }
    }

    /// Records the node id a node answered with; a changed id means the node restarted without
    /// its data, so its votes are ignored until `sit_out` has passed.
    fn observe(&self, id: &str, sit_out: Duration) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.id.as_deref() {
            Some(prev) if prev != id => {
                tracing::warn!(node = %self.addr, "node lost its data (restarted); it sits out of quorum votes for one maximum TTL");
                seen.sit_out_until = Some(Instant::now() + sit_out);
                seen.id = Some(id.to_owned());
            }
            Some(_) => {}
            None => seen.id = Some(id.to_owned()),
        }
    }

    fn votes(&self) -> bool {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.sit_out_until.is_none_or(|t| Instant::now() >= t)
    }
}

/// What a release means for the owner's place in the FIFO queues.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// The owner is done: a lease released, or an acquisition abandoned; it leaves the queues.
    Done,
    /// A split vote rolled back: the owner goes on waiting and keeps its place in the queues
    /// of the nodes that refused it. Nodes that answered one attempt in different orders
    /// would otherwise send a waiter that won on a minority to the back of every queue, again
    /// and again.
    KeepWaiting,
}

/// One node's answer to an acquisition attempt.
enum NodeAttempt {
    Granted(u64),
    Held {
        holder: Option<Holder>,
        pttl: Option<Duration>,
    },
}

fn unix_micros() -> u64 {
    crate::core::holder::unix_micros(SystemTime::now())
}

fn ms(d: Duration) -> i64 {
    crate::core::holder::millis_of(d).max(1)
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        Value::Okay => Some("OK".to_owned()),
        _ => None,
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => as_string(other)?.parse().ok(),
    }
}

/// The `who` part of the holder metadata: `pid\nhost\nclient`. The client name comes last so it
/// may hold any byte; a newline in the host (no real host name has one) would shift the fields,
/// so it is replaced.
fn who(meta: &HolderMeta) -> String {
    format!(
        "{}\n{}\n{}",
        meta.pid,
        meta.host.replace('\n', " "),
        meta.client
    )
}

/// Builds a holder from the current lock value, its PTTL and the metadata string
/// (`token\nowner\nttl\nacquired_at\npid\nhost\nclient`, see the scripts).
fn holder_from(owner: String, pttl: Option<Duration>, meta: &Value) -> Holder {
    let mut h = Holder::bare(owner);
    h.ttl_left = pttl;
    let Some(text) = as_string(meta) else {
        return h;
    };
    let f: Vec<&str> = text.splitn(7, '\n').collect();
    // Metadata written by another owner (a stale value) must not be attributed to this one.
    if f.len() != 7 || f[1] != h.owner {
        return h;
    }
    h.token = f[0].parse().ok().map(FencingToken::new);
    h.ttl = f[2].parse().ok().map(Duration::from_millis);
    h.acquired_at = f[3].parse().ok().map(from_unix_millis);
    h.pid = f[4].parse().ok();
    h.host = Some(f[5].to_owned());
    h.client = Some(f[6].to_owned());
    // Every renewal restores the full TTL, so the last one was `ttl - left` ago.
    h.renewed_at = match (h.ttl, pttl) {
        (Some(ttl), Some(left)) => SystemTime::now().checked_sub(ttl.saturating_sub(left)),
        _ => None,
    };
    h
}

fn pttl_of(v: Option<&Value>) -> Option<Duration> {
    v.and_then(as_i64)
        .and_then(|p| u64::try_from(p).ok())
        .map(Duration::from_millis)
}

impl RedisEngine {
    fn keys(&self, name: &str) -> Keys {
        Keys::new(&self.prefix, name)
    }

    /// Where a fair waiter goes in a node's queue: 0 lets one node number its waiters in
    /// arrival order; Redlock nodes get the acquisition's start in microseconds instead, the
    /// same on every node, because two waiters' attempts can reach two nodes in opposite
    /// orders, and nodes whose queues disagree on the head split their votes.
    fn queue_place(&self, since: SystemTime) -> u64 {
        if self.nodes.len() == 1 {
            return 0;
        }
        // 0 is taken by "number them here".
        crate::core::holder::unix_micros(since).max(1)
    }

    /// Per-node deadline of an acquisition: small against the TTL, as Redlock asks, so a hung
    /// node costs a fraction of the validity, not all of it. One node gets the whole call.
    fn node_timeout(&self, ttl: Duration) -> Duration {
        if self.nodes.len() == 1 {
            self.op_timeout
        } else {
            (ttl / 20)
                .clamp(Duration::from_millis(50), Duration::from_millis(500))
                .min(self.op_timeout)
        }
    }

    async fn acquire_on(
        &self,
        node: &Node,
        req: &AcquireRequest,
        fair: Option<(Duration, SystemTime)>,
        keys: &Keys,
        floor: u64,
        limit: Duration,
    ) -> NodeResult<NodeAttempt> {
        let mut inv = scripts::ACQUIRE.prepare_invoke();
        inv.key(&keys.lock)
            .key(&keys.fence)
            .key(&keys.meta)
            .key(keys::node_key(&self.prefix))
            .key(&keys.wait)
            .key(&keys.queue)
            .key(&keys.qexp)
            .key(&keys.qseq)
            .key(&keys.qinfo)
            .arg(&req.owner)
            .arg(ms(req.ttl))
            .arg(floor)
            .arg(format!("{:016x}", rand::random::<u64>()))
            .arg(unix_millis(SystemTime::now()))
            .arg(who(&req.meta))
            .arg(fair.map_or(0, |(window, _)| ms(window)))
            .arg(&self.channel)
            .arg(fair.map_or(0, |(_, since)| self.queue_place(since)));
        let reply: Vec<Value> = node.run(inv, limit).await?;
        let bad = || format!("{}: unexpected reply to the acquire script", node.addr);
        let id = reply.get(2).and_then(as_string).ok_or_else(bad)?;
        node.observe(&id, self.max_ttl);
        match reply.first().and_then(as_i64) {
            Some(1) => {
                let token = reply
                    .get(1)
                    .and_then(as_string)
                    .and_then(|s| s.parse::<u64>().ok())
                    .ok_or_else(bad)?;
                Ok(NodeAttempt::Granted(token))
            }
            Some(0) => {
                let pttl = pttl_of(reply.get(1));
                let holder = reply
                    .get(3)
                    .and_then(as_string)
                    .map(|owner| holder_from(owner, pttl, reply.get(4).unwrap_or(&Value::Nil)));
                Ok(NodeAttempt::Held { holder, pttl })
            }
            _ => Err(bad()),
        }
    }

    async fn release_on(
        &self,
        node: &Node,
        keys: &Keys,
        owner: &str,
        release: Release,
        limit: Duration,
    ) -> NodeResult<bool> {
        let mut inv = scripts::RELEASE.prepare_invoke();
        inv.key(&keys.lock)
            .key(&keys.meta)
            .key(&keys.wait)
            .key(&keys.queue)
            .key(&keys.qexp)
            .key(&keys.qinfo)
            .key(&keys.fence)
            .arg(owner)
            .arg(&keys.wake)
            .arg(u8::from(self.nodes.len() == 1))
            .arg(u8::from(release == Release::KeepWaiting));
        let n: i64 = node.run(inv, limit).await?;
        Ok(n == 1)
    }

    async fn release_everywhere(
        &self,
        keys: &Keys,
        owner: &str,
        release: Release,
        limit: Duration,
    ) -> Vec<NodeResult<bool>> {
        join_all(
            self.nodes
                .iter()
                .map(|n| self.release_on(n, keys, owner, release, limit)),
        )
        .await
    }

    async fn extend_on(&self, node: &Node, batch: &[Renewal]) -> NodeResult<Vec<bool>> {
        let mut out = Vec::with_capacity(batch.len());
        let limit = self.op_timeout;
        for chunk in batch.chunks(EXTEND_CHUNK) {
            let mut inv = scripts::EXTEND.prepare_invoke();
            for r in chunk {
                let k = self.keys(&r.name);
                inv.key(k.lock).key(k.meta).arg(&r.owner).arg(ms(r.ttl));
            }
            let flags: Vec<i64> = node.run(inv, limit).await?;
            if flags.len() != chunk.len() {
                return Err(format!(
                    "{}: unexpected reply to the extend script",
                    node.addr
                ));
            }
            out.extend(flags.into_iter().map(|f| f == 1));
        }
        Ok(out)
    }

    fn errors_text(errors: &[String]) -> String {
        errors.join("; ")
    }

    /// An engine error naming every node's failure when no node answered at all.
    fn unless_every_node_failed<T>(&self, answers: &[NodeResult<T>]) -> Result<()> {
        let errors: Vec<String> = answers
            .iter()
            .filter_map(|r| r.as_ref().err().cloned())
            .collect();
        if errors.len() == self.nodes.len() {
            return Err(Error::engine_failure(self.kind, Self::errors_text(&errors)));
        }
        Ok(())
    }
}

impl RedisEngine {
    /// One attempt on every node; `fair` is the queue entry's window and the acquisition's
    /// start, for a waiter in fair mode.
    async fn attempt(
        &self,
        req: &AcquireRequest,
        fair: Option<(Duration, SystemTime)>,
    ) -> Result<Attempt> {
        let keys = self.keys(&req.name);
        // Subscribed before the attempt is sent: a release announced after the refusal below
        // changes this receiver even if the waiter has not started waiting yet.
        let wake = self.wakers.subscribe(&req.name);
        let limit = self.node_timeout(req.ttl);
        let floor = if self.nodes.len() == 1 {
            0
        } else {
            unix_micros()
        };
        let answers = join_all(
            self.nodes
                .iter()
                .map(|n| self.acquire_on(n, req, fair, &keys, floor, limit)),
        )
        .await;

        let mut votes = 0;
        let mut top = 0u64;
        let mut holders = Vec::new();
        let mut errors = Vec::new();
        let mut granted_any = false;
        for (node, answer) in self.nodes.iter().zip(&answers) {
            match answer {
                Ok(NodeAttempt::Granted(t)) => {
                    granted_any = true;
                    top = top.max(*t);
                    if node.votes() {
                        votes += 1;
                    }
                }
                Ok(NodeAttempt::Held { holder, pttl }) => holders.push((holder.clone(), *pttl)),
                Err(e) => errors.push(e.clone()),
            }
        }

        if votes >= self.quorum {
            let agree = self
                .nodes
                .iter()
                .zip(&answers)
                .filter(|(n, a)| matches!(a, Ok(NodeAttempt::Granted(t)) if *t == top) && n.votes())
                .count();
            if agree >= self.quorum {
                return Ok(Attempt::Granted(FencingToken::new(top)));
            }
            // Raise the counter to `top` where it is lower, so a majority holds at least `top`.
            let raised = join_all(self.nodes.iter().zip(&answers).map(|(n, a)| async move {
                if matches!(a, Ok(NodeAttempt::Granted(t)) if *t == top) {
                    return false;
                }
                let mut inv = scripts::RAISE.prepare_invoke();
                inv.key(self.keys(&req.name).fence).arg(top);
                n.run::<i64>(inv, limit).await.is_ok() && n.votes()
            }))
            .await;
            if agree + raised.iter().filter(|r| **r).count() >= self.quorum {
                return Ok(Attempt::Granted(FencingToken::new(top)));
            }
            errors.push("the fencing counter could not be raised on a majority".to_owned());
        }

        if granted_any || !errors.is_empty() {
            // A minority grant (or an answer that never came) must not linger: release it on
            // every node, including those that timed out.
            self.release_everywhere(&keys, &req.owner, Release::KeepWaiting, limit)
                .await;
        }
        // Nobody else holds it, or too few nodes answered for any grant to be possible:
        // that is an engine problem, not contention.
        if holders.is_empty() || errors.len() > self.nodes.len() - self.quorum {
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "only {votes} of {} nodes granted (quorum {}): {}",
                    self.nodes.len(),
                    self.quorum,
                    Self::errors_text(&errors)
                ),
            ));
        }
        // The holder most nodes name, and the shortest remaining TTL among them.
        let mut counts: HashMap<Option<String>, usize> = HashMap::new();
        for (h, _) in &holders {
            *counts
                .entry(h.as_ref().map(|h| h.owner.clone()))
                .or_default() += 1;
        }
        let top_owner = counts.into_iter().max_by_key(|(_, c)| *c).map(|(o, _)| o);
        let holder = holders
            .iter()
            .find(|(h, _)| {
                top_owner
                    .as_ref()
                    .is_some_and(|o| h.as_ref().map(|h| &h.owner) == o.as_ref())
            })
            .and_then(|(h, _)| h.clone());
        let split = granted_any || holders.len() < self.quorum;
        let retry_in = if split {
            None
        } else {
            holders.iter().filter_map(|(_, p)| *p).min()
        };
        Ok(Attempt::Held {
            holder,
            retry_in,
            wake: Some(wake),
        })
    }
}

#[async_trait]
impl FairQueue for RedisEngine {
    async fn try_acquire_fair(
        &self,
        req: &AcquireRequest,
        window: Duration,
        since: SystemTime,
    ) -> Result<Attempt> {
        self.attempt(req, Some((window, since))).await
    }
}

#[async_trait]
impl Engine for RedisEngine {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        self.keys(name).labelled()
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.attempt(req, None).await
    }
    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let per_node = join_all(self.nodes.iter().map(|n| self.extend_on(n, batch))).await;
        self.unless_every_node_failed(&per_node)?;
        let n = self.nodes.len();
        Ok((0..batch.len())
            .map(|i| {
                let yes = per_node
                    .iter()
                    .filter(|r| matches!(r, Ok(v) if v[i]))
                    .count();
                let no = per_node
                    .iter()
                    .filter(|r| matches!(r, Ok(v) if !v[i]))
                    .count();
                if yes >= self.quorum {
                    Renewed::Extended
                } else if n - no < self.quorum {
                    Renewed::NotHolder
                } else {
                    Renewed::Failed("too few nodes confirmed the renewal".to_owned())
                }
            })
            .collect())
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        let keys = self.keys(name);
        let answers = self
            .release_everywhere(&keys, owner, Release::Done, self.op_timeout)
            .await;
        self.unless_every_node_failed(&answers)?;
        let released = answers.iter().filter(|r| matches!(r, Ok(true))).count();
        Ok(released >= self.quorum)
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        let keys = self.keys(name);
        let limit = self.node_limit();
        let answers = join_all(self.nodes.iter().map(|n| {
            let mut inv = scripts::INSPECT.prepare_invoke();
            inv.key(&keys.lock).key(&keys.meta);
            async move { n.run::<Vec<Value>>(inv, limit).await }
        }))
        .await;
        self.unless_every_node_failed(&answers)?;
        let holders: Vec<Holder> = answers
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .filter_map(|v| {
                let owner = v.first().and_then(as_string)?;
                Some(holder_from(
                    owner,
                    pttl_of(v.get(1)),
                    v.get(2).unwrap_or(&Value::Nil),
                ))
            })
            .collect();
        // Held means held on a majority: a minority grant is not a lock.
        let found = holders
            .iter()
            .find(|h| holders.iter().filter(|o| o.owner == h.owner).count() >= self.quorum);
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if found.is_none() && answered < self.quorum {
            // The silent nodes may hold the majority: "free" would be a guess, and the
            // runbook acts on this answer.
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "only {answered} of {} nodes answered (quorum {}), too few to tell whether \
                     the lock is held",
                    self.nodes.len(),
                    self.quorum
                ),
            ));
        }
        Ok(found.cloned())
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        self.list_held(prefix).await
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        self.force_release_everywhere(name, expected_owner, draft)
            .await
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        self.read_audit(name).await
    }
}

/// Keeps one pattern subscription to every wake channel under the prefix on one node, and one
/// to this client's own channel, and reconnects when they drop. While they are down, waiters
/// fall back to sleeping.
async fn listen_for_wakeups(
    client: redis::Client,
    prefix: String,
    channel: String,
    wakers: Arc<Wakers>,
    shutdown: CancellationToken,
) {
    let pattern = keys::wake_pattern(&prefix);
    keep_listening("wake-up subscription", shutdown, || async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.psubscribe(&pattern).await?;
        pubsub.subscribe(&channel).await?;
        let mut stream = pubsub.on_message();
        while let Some(msg) = stream.next().await {
            let payload = msg.get_payload_bytes();
            if msg.get_channel_name() == channel {
                if let Some((name, owner, token)) = handoff_payload(&prefix, payload) {
                    wakers.wake(name, Some(owner.to_owned()), Some(token));
                }
            } else if let Some(name) = keys::name_of_wake_channel(&prefix, msg.get_channel_name()) {
                let only =
                    Some(String::from_utf8_lossy(payload).into_owned()).filter(|o| !o.is_empty());
                wakers.wake(name, only, None);
            }
        }
        Ok::<(), redis::RedisError>(())
    })
    .await;
}

/// A handoff's payload on a client channel, `owner token wake-channel`: the resource (from its
/// wake channel, whose name may hold spaces), the waiter the lock was handed to, and its token.
fn handoff_payload<'a>(
    prefix: &str,
    payload: &'a [u8],
) -> Option<(&'a str, &'a str, FencingToken)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (owner, rest) = text.split_once(' ')?;
    let (token, channel) = rest.split_once(' ')?;
    let name = keys::name_of_wake_channel(prefix, channel)?;
    Some((name, owner, FencingToken::new(token.parse().ok()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_metadata_round_trips_and_is_never_misattributed() {
        let meta = HolderMeta {
            host: "box\n1".to_owned(),
            pid: 42,
            client: "billing\nnightly".to_owned(),
        };
        let text = format!("17\nabc\n30000\n1700000000000\n{}", who(&meta));
        let h = holder_from(
            "abc".to_owned(),
            Some(Duration::from_secs(20)),
            &Value::BulkString(text.clone().into_bytes()),
        );
        assert_eq!(h.token, Some(FencingToken::new(17)));
        assert_eq!(h.ttl, Some(Duration::from_secs(30)));
        assert_eq!(h.acquired_at, Some(from_unix_millis(1_700_000_000_000)));
        assert_eq!(h.pid, Some(42));
        assert_eq!(h.host.as_deref(), Some("box 1"));
        assert_eq!(h.client.as_deref(), Some("billing\nnightly"));
        // Renewed 10 s ago: 30 s of TTL, 20 s left.
        let ago = SystemTime::now()
            .duration_since(h.renewed_at.unwrap())
            .unwrap();
        assert!(
            ago >= Duration::from_secs(10) && ago < Duration::from_secs(11),
            "{ago:?}"
        );
        // A value left by another owner, or a malformed one, gives a bare holder.
        for other in [text.as_str(), "17\nabc\n30000"] {
            let h = holder_from("xyz".to_owned(), None, &Value::BulkString(other.into()));
            assert_eq!((h.token, h.host, h.renewed_at), (None, None, None));
        }
        let h = holder_from("abc".to_owned(), None, &Value::BulkString("17\nabc".into()));
        assert_eq!(h.token, None);
    }

    #[test]
    fn handoff_payload_names_resource_owner_and_token() {
        let p = "fencelock:v1:";
        assert_eq!(
            handoff_payload(
                p,
                b"abc 1700000000000001 fencelock:v1:wake:a name: with spaces"
            ),
            Some((
                "a name: with spaces",
                "abc",
                FencingToken::new(1_700_000_000_000_001)
            ))
        );
        assert_eq!(handoff_payload(p, b"abc 17 other:v1:wake:x"), None);
        assert_eq!(handoff_payload(p, b"abc def fencelock:v1:wake:x"), None);
        assert_eq!(handoff_payload(p, b"abc"), None);
        assert_eq!(handoff_payload(p, b""), None);
    }
}
