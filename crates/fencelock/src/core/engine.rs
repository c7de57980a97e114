//! The contract between the core and an engine. The core (lease, watchdog, retries, validity)
//! is written once against [`Engine`]; an engine only knows how to talk to its server.
//! Engines receive resource names (already validated) and derive their own keys from them and
//! the client's prefix.
//!
//! [`Engine`] is the lock itself, which every engine has. What only some engines have is a
//! capability the engine hands out when it is opened ([`Opened`]): an engine-side FIFO queue
//! that one attempt joins ([`FairQueue`], Redis), a queue the engine waits in by itself
//! ([`WaitQueue`], etcd), native elections ([`Elections`], etcd) and a feed of leases lost as
//! it happens (PostgreSQL sessions). Without a capability the core does without it or falls
//! back to what the lock alone gives (`crate::ops::election` reads leaders by polling).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::core::error::Result;
use crate::core::holder::{Holder, HolderMeta};
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock, Leader};
use crate::core::token::FencingToken;
use crate::core::wake::WakeRx;

/// The key prefix used when none is configured. Every key fencelock writes starts with it.
pub const DEFAULT_PREFIX: &str = "fencelock:v1:";

/// What every engine is opened with.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    /// The namespace every key starts with.
    pub prefix: String,
    /// Deadline of one engine call.
    pub op_timeout: Duration,
    /// The longest TTL any lease of this client may have.
    pub max_ttl: Duration,
    /// Who this client is for the `max-held-per-client` limit: its client name, or a random
    /// id when it was given none.
    pub holder_id: String,
}

/// One acquisition attempt as the engine sees it.
#[derive(Debug, Clone)]
pub(crate) struct AcquireRequest {
    pub name: String,
    pub owner: String,
    pub ttl: Duration,
    /// What the grant records about its holder. For an election campaign on an engine without
    /// elections of its own, the campaign value stands in the client name.
    pub meta: HolderMeta,
    /// Whether a refusal may be followed by waiting: only then does the engine subscribe the
    /// attempt to release announcements. A `try_acquire` would drop the subscription unread,
    /// and making it is the largest part of the client's work in an uncontended attempt.
    pub waits: bool,
}

/// The engine's answer to one attempt.
#[derive(Debug)]
pub(crate) enum Attempt {
    /// Granted to this owner with this token. Granting again to the same owner (a retried
    /// attempt whose first answer was lost) returns the token already granted.
    Granted(FencingToken),
    /// Held by someone else; `retry_in` is the holder's remaining TTL when the engine knows it.
    Held {
        holder: Option<Holder>,
        retry_in: Option<Duration>,
        /// Changes when the engine announces a release of this resource. Subscribed before
        /// the attempt was sent, so a release right after the answer is not missed.
        wake: Option<Box<WakeRx>>,
    },
    /// Refused by the `max-held-per-client` limit (`max`): this client holds that many leases
    /// under the prefix already. `retry_in` is when the engine expects one of them to expire.
    OverQuota {
        max: u32,
        retry_in: Option<Duration>,
    },
}

/// One lease to renew in a batch.
#[derive(Debug, Clone)]
pub(crate) struct Renewal {
    pub name: String,
    pub owner: String,
    pub ttl: Duration,
}

/// What became of one renewal in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Renewed {
    /// The engine confirmed this owner still holds the key and pushed its expiry out by the TTL.
    Extended,
    /// Confirmed as [`Renewed::Extended`], but the engine vouches for the expiry only as if the
    /// renewal had been sent at this instant, earlier than the batch was (ZooKeeper: how much
    /// of the session the quorum is known to have seen): the validity counts from it.
    ExtendedFrom(Instant),
    /// The key is gone or belongs to another owner: the lease is lost.
    NotHolder,
    /// Neither confirmed nor refused (a quorum engine reached too few nodes, the call failed or
    /// was not answered in time), for this reason: a failed renewal.
    Failed(String),
    /// Refused by the `max-ttl` limit stored in the engine (the cap, in the error): the
    /// expiry stays where the last grant or renewal put it. Refused rather than cut to the
    /// cap, so the engine's expiry never falls short of the validity the client counts.
    OverLimit(Duration),
}

impl Renewed {
    /// The instant a confirmed renewal of a batch started at `started` counts its validity
    /// from; `None` when the renewal was not confirmed.
    pub(crate) fn confirmed_from(&self, started: Instant) -> Option<Instant> {
        match self {
            Renewed::Extended => Some(started),
            Renewed::ExtendedFrom(at) => Some((*at).min(started)),
            _ => None,
        }
    }
}

/// The lock, which every engine has.
#[async_trait]
pub(crate) trait Engine: Send + Sync + 'static {
    /// Short engine name for messages and metrics: `sqlite`, `redis`, `redlock`, ...
    fn kind(&self) -> &'static str;

    /// The engine keys (or rows) a resource name maps to, labelled, for `fencelock key`.
    fn keys(&self, name: &str) -> Vec<(&'static str, String)>;

    /// One attempt, atomically taking the lock and advancing the fencing counter.
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt>;

    /// Owner-checked renewal of many leases in as few server calls as the engine allows (one
    /// per node). The answer has one entry per renewal, in order.
    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>>;

    /// Owner-checked release. `Ok(true)` when this owner held the key and it was deleted.
    /// Also withdraws the owner from any waiter queue it joined.
    async fn release(&self, name: &str, owner: &str) -> Result<bool>;

    /// The current holder of a resource, if the lock is held.
    async fn inspect(&self, name: &str) -> Result<Option<Holder>>;

    /// Every held lock whose name starts with `prefix` (a plain string, not a pattern), in no
    /// particular order. Held means what `inspect` says: on a quorum engine, on a majority.
    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>>;

    /// Deletes the lock whatever its owner (only if `expected_owner` holds it, when given),
    /// advances the fencing counter past every token granted so far, and appends `draft` to
    /// the engine's audit log with the old holder's metadata as the engine recorded it and the
    /// new counter value filled in; all in one atomic step per node. `Ok(None)` when there was
    /// nothing to delete: the lock is free, or held by another owner than the expected one.
    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>>;

    /// The audit log of forced releases under this client's prefix, of one resource or all,
    /// newest first.
    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>>;

    /// The limits stored under this client's prefix, as each node (or the database) has them.
    async fn limits(&self) -> Result<Vec<StoredLimits>>;

    /// Stores `limits` under this client's prefix, on every node; empty limits remove them.
    /// Fails unless every node stored them.
    async fn set_limits(&self, limits: &Limits) -> Result<()>;
}

/// A FIFO queue of waiters kept by the engine, which one attempt joins (fair mode): the client
/// retries, and a release may hand the lock straight to the head of the queue.
#[async_trait]
pub(crate) trait FairQueue: Send + Sync + 'static {
    /// One attempt that, when refused, queues `req.owner` as a waiter for `window` unless it
    /// tries again. `since` is when this acquisition began by the wall clock: engines with
    /// several independent queues (Redlock) place the waiter by it, so that every node orders
    /// the waiters alike.
    async fn try_acquire_fair(
        &self,
        req: &AcquireRequest,
        window: Duration,
        since: SystemTime,
    ) -> Result<Attempt>;
}

/// A queue the engine waits in by itself (etcd's recipe: each waiter watches its predecessor),
/// instead of the client retrying [`Engine::try_acquire`]. Every acquisition is FIFO.
#[async_trait]
pub(crate) trait WaitQueue: Send + Sync + 'static {
    /// Enqueues `req` and waits up to `wait` to reach the head of the queue. Returns the
    /// outcome and the instant the grant's validity counts from. `campaign` is an election
    /// campaign's value, which the engine keeps with the grant in place of the holder
    /// metadata, so that observers read it as the leader's value. Whatever the outcome, and if
    /// the future is dropped, the queue entry may remain until the caller releases
    /// `req.owner`; the client does so unless the outcome is a grant.
    async fn acquire_queued(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<(Attempt, Instant)>;
}

/// Elections the engine runs natively, interoperable with its own tools (`etcdctl elect`).
#[async_trait]
pub(crate) trait Elections: Send + Sync + 'static {
    /// The leader of the election on `name`, if any.
    async fn leader(&self, name: &str) -> Result<Option<Leader>>;

    /// Replaces the campaign value of `owner`'s grant on `name`. `Ok(false)` when that owner
    /// no longer holds it.
    async fn proclaim(&self, name: &str, owner: &str, value: &str) -> Result<bool>;

    /// Publishes every change of `name`'s leader on `tx` until `tx` has no receiver left.
    async fn observe(&self, name: &str, tx: &watch::Sender<Option<Leader>>);
}

/// The owner values of leases lost, pushed as soon as the engine knows (a session that ended).
pub(crate) type LossFeed = mpsc::UnboundedReceiver<String>;

/// An opened engine and the capabilities it hands out.
pub(crate) struct Opened {
    pub engine: Arc<dyn Engine>,
    pub fair: Option<Arc<dyn FairQueue>>,
    pub queue: Option<Arc<dyn WaitQueue>>,
    pub elections: Option<Arc<dyn Elections>>,
    /// Taken by the watchdog, which marks those leases lost without waiting for their next
    /// renewal.
    pub losses: Option<LossFeed>,
    /// The engine keeps a lease's key alive for as long as *any* lease of the client renews
    /// (one etcd session serves them all), not for its TTL: the client then releases every
    /// lease it drops or declares lost, instead of letting it expire.
    pub release_abandoned: bool,
    /// The engine ends this client's leases when the process exits (they live in its database
    /// or coordination session), instead of keeping each to the end of its TTL.
    pub ends_with_process: bool,
}

impl Opened {
    /// An engine that has the lock and nothing more.
    pub(crate) fn lock(engine: Arc<dyn Engine>) -> Opened {
        Opened {
            engine,
            fair: None,
            queue: None,
            elections: None,
            losses: None,
            release_abandoned: false,
            ends_with_process: false,
        }
    }
}
