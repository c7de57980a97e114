//! Redis engines: one node (`redis://`) and Redlock over N independent nodes (`redlock://`),
//! each also over TLS (`rediss://`, `redlocks://`; see [`url`]).
//!
//! Both are one engine with N nodes and a quorum of `N / 2 + 1` (1 for a single node).
//!
//! - **Interoperable lock key.** The lock key holds the owner value as a plain string set with
//!   `NX PX`, so a client in another language using `SET key value NX PX ttl` on the same key
//!   (see [`keys`] for the layout, or `fencelock key NAME`) excludes fencelock and vice versa.
//! - **One round trip per node.** A script takes the lock and advances the fencing counter
//!   atomically; extension and release are owner-checked scripts.
//!
//! The rest lives with its code: tokens on a quorum and fairness in [`acquire`], the delayed
//! restart in [`node`], wake-ups in [`wakeup`], the counting of votes in [`votes`].

pub(crate) mod acl;
mod acquire;
mod extend;
mod keys;
mod limits;
mod node;
mod pair;
mod release;
mod runbook;
pub(super) mod scripts;
pub(crate) mod url;
mod values;
mod votes;
mod wakeup;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

use crate::core::engine::{
    AcquireRequest, Attempt, Engine, EngineConfig, Opened, Renewal, Renewed,
};
use crate::core::error::{Error, Result};
use crate::core::holder::Holder;
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::wake::Wakers;
use keys::Keys;
use node::Node;
pub use pair::{RedisPairCalls, RedisScriptCall, NODE_ID_ARG};
use url::RedisUrl;

/// Opens the nodes of `url`: the lock, and a FIFO queue of waiters on every node (fair mode).
pub(crate) async fn open(url: RedisUrl, cfg: &EngineConfig) -> Result<Opened> {
    let clients = url.clients()?;
    let kind = url.engine();
    let RedisUrl {
        quorum, nodes, tls, ..
    } = url;
    let shutdown = CancellationToken::new();
    let wakers = Arc::new(Wakers::default());
    let channel = keys::client_channel(&cfg.prefix, &format!("{:016x}", rand::random::<u64>()));
    let mut conns = Vec::with_capacity(nodes.len());
    for (i, (node, client)) in nodes.iter().zip(clients).enumerate() {
        let (node, client) = Node::connect(kind, node, client, cfg.op_timeout)?;
        tokio::spawn(wakeup::listen_for_wakeups(
            client,
            cfg.prefix.clone(),
            channel.clone(),
            i,
            wakers.clone(),
            shutdown.clone(),
        ));
        conns.push(node);
    }
    let engine = RedisEngine {
        kind,
        quorum: votes::quorum(conns.len()),
        nodes: conns,
        prefix: cfg.prefix.clone(),
        op_timeout: cfg.op_timeout,
        max_ttl: cfg.max_ttl,
        limits_key: keys::limits_key(&cfg.prefix),
        node_key: keys::node_key(&cfg.prefix),
        held_key: keys::held_key(&cfg.prefix, &cfg.holder_id),
        quota_seen: Arc::new(AtomicBool::new(false)),
        wakers,
        channel,
        shutdown,
    };
    if quorum {
        // Redlock tolerates nodes that are down, but not credentials a node refuses: that is
        // a configuration error, and later it would read as votes that never come.
        let limit = cfg.op_timeout.min(Duration::from_secs(1));
        let refusals =
            futures_util::future::join_all(engine.nodes.iter().map(|n| n.auth_refusal(limit)))
                .await;
        if let Some(why) = refusals.into_iter().flatten().next() {
            return Err(Error::engine_failure(kind, why));
        }
    } else {
        // One node: fail early with a clear error when it cannot be reached at all.
        engine.nodes[0].ping(cfg.op_timeout).await.map_err(|e| {
            let hint = if e.kind() == redis::ErrorKind::AuthenticationFailed {
                "authentication failed; check the user and password in the URL"
            } else if tls {
                "cannot connect over TLS; check that the server is up and serves TLS on this \
                 port, that ca= holds the CA that signed its certificate, which must name the \
                 host as written in the URL, and that cert= and key= are given when it \
                 requires a client certificate"
            } else {
                "cannot connect; check that the server is up and the URL is right (rediss:// \
                 if it serves TLS only)"
            };
            Error::engine_failure(kind, format!("{}: {hint}", engine.nodes[0].addr()))
                .with_source(e)
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
    /// Where the limits of the prefix are stored, and this client's set of held leases.
    limits_key: String,
    held_key: String,
    /// Whether a node told this client of a quota: from then on the acquire and release
    /// scripts get the `held` set, which they need only under a quota (see the scripts).
    quota_seen: Arc<AtomicBool>,
    /// The node's id (see [`node`]), read by every grant.
    node_key: String,
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

/// The labelled keys of `name` under `prefix`, as [`Engine::keys`] gives them, without a
/// connection: `fencelock key` prints them for an engine it does not open.
pub(crate) fn labelled_keys(prefix: &str, name: &str) -> Vec<(&'static str, String)> {
    Keys::new(prefix, name).labelled()
}

impl RedisEngine {
    fn keys(&self, name: &str) -> Keys {
        Keys::new(&self.prefix, name)
    }

    /// One node, not Redlock: it numbers its own queue, uses its own clock, hands a released
    /// lock straight to its next fair waiter, and gets a whole call's deadline.
    fn one_node(&self) -> bool {
        self.nodes.len() == 1
    }

    /// The least counter a node may answer with a grant or a forced release: the client's
    /// clock in microseconds on Redlock, so that healthy nodes agree on one value; 0 on one
    /// node, which uses its own clock.
    /// Whether the scripts need this client's `held` set: once a node told of a quota.
    fn quota_seen(&self) -> bool {
        self.quota_seen.load(Ordering::Relaxed)
    }

    /// A node told of a quota: pass the `held` set from now on.
    fn saw_quota(&self) {
        self.quota_seen.store(true, Ordering::Relaxed);
    }

    fn floor(&self) -> u64 {
        if self.one_node() {
            0
        } else {
            values::unix_micros()
        }
    }
}

#[async_trait]
impl Engine for RedisEngine {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        labelled_keys(&self.prefix, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.attempt(req, None).await
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        self.extend_leases(batch).await
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        self.release_lease(name, owner).await
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        self.inspect_holder(name).await
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

    async fn limits(&self) -> Result<Vec<StoredLimits>> {
        self.read_limits().await
    }

    async fn set_limits(&self, limits: &Limits) -> Result<()> {
        self.store_limits(limits).await
    }
}
