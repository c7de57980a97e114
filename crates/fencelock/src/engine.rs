//! The small internal trait every engine implements. The core (lease, watchdog, retries,
//! validity) is written once against it; an engine only knows how to talk to its server.
//! Engines receive resource names (already validated) and derive their own keys from them and
//! the client's prefix.

use std::time::Duration;

use async_trait::async_trait;

use crate::election::Leader;
use crate::error::Result;
use crate::holder::{Holder, HolderMeta};
use crate::runbook::{AuditRecord, HeldLock};
use crate::token::FencingToken;

/// What every engine is opened with.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    /// The namespace every key starts with.
    pub prefix: String,
    /// Deadline of one engine call.
    pub op_timeout: Duration,
    /// The longest TTL any lease of this client may have.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub max_ttl: Duration,
}

/// One acquisition attempt as the engine sees it.
#[derive(Debug, Clone)]
pub(crate) struct AcquireRequest {
    pub name: String,
    pub owner: String,
    pub ttl: Duration,
    pub meta: HolderMeta,
    /// An election campaign's value, kept with the grant where the holder metadata would be
    /// (engines with elections) so that observers read it as the leader's value.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub campaign: Option<String>,
    /// FIFO mode: queue behind earlier waiters; the waiter entry lives this long unless the
    /// waiter tries again.
    pub fair: Option<Duration>,
    /// When this acquisition began, by the wall clock: where engines with several independent
    /// queues (Redlock) place the waiter, so that every node orders the waiters alike.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub since: std::time::SystemTime,
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
        wake: Option<crate::wakers::WakeRx>,
    },
}

/// The release announcements of one resource as waiters see them: the newest few, numbered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Wake {
    /// The newest announcements, oldest first, at most [`Wake::KEPT`], numbered from 1 so that
    /// equal announcements still tell apart.
    pub recent: std::collections::VecDeque<Announcement>,
}

/// One release announcement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Announcement {
    pub seq: u64,
    /// In FIFO mode, the only waiter that can win next; the others keep waiting.
    pub only: Option<String>,
    /// The release handed the lock straight to `only` with this token: that waiter holds it
    /// from the moment the release ran, for its TTL cut to what was left of its queue entry.
    pub granted: Option<FencingToken>,
}

impl Wake {
    /// Enough for the announcements of one release by every node of a Redlock set, and some.
    pub(crate) const KEPT: usize = 16;

    /// The number of the newest announcement, 0 before the first.
    pub(crate) fn seq(&self) -> u64 {
        self.recent.back().map_or(0, |a| a.seq)
    }

    pub(crate) fn push(&mut self, only: Option<String>, granted: Option<FencingToken>) {
        let seq = self.seq().wrapping_add(1);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Announcement { seq, only, granted });
    }
}

impl Announcement {
    pub(crate) fn concerns(&self, owner: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == owner)
    }
}

/// One lease to renew in a batch.
#[derive(Debug, Clone)]
pub(crate) struct Renewal {
    pub name: String,
    pub owner: String,
    pub ttl: Duration,
}

/// What became of one renewal in a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewed {
    /// The engine confirmed this owner still holds the key and pushed its expiry out by the TTL.
    Extended,
    /// The key is gone or belongs to another owner: the lease is lost.
    NotHolder,
    /// Neither confirmed nor refused (a quorum engine reached too few nodes): a failed renewal.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "etcd")),
        allow(dead_code)
    )]
    Unconfirmed,
}

#[async_trait]
pub(crate) trait Engine: Send + Sync + 'static {
    /// Short engine name for messages and metrics: `sqlite`, `redis`, `redlock`, ...
    fn kind(&self) -> &'static str;

    /// One attempt, atomically taking the lock and advancing the fencing counter.
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt>;

    /// Whether the engine keeps its own FIFO queue of waiters and waits in it
    /// ([`Engine::acquire_queued`]), instead of the client retrying [`Engine::try_acquire`].
    fn queues_waiters(&self) -> bool {
        false
    }

    /// Engine-native queued acquisition: enqueue `req` and wait up to `wait` to reach the head
    /// of the queue. Returns the outcome and the instant the grant's validity counts from.
    /// Whatever the outcome, and if the future is dropped, the queue entry may remain until
    /// the caller releases `req.owner`; the client does so unless the outcome is a grant.
    async fn acquire_queued(
        &self,
        req: &AcquireRequest,
        wait: Duration,
    ) -> Result<(Attempt, tokio::time::Instant)> {
        let _ = wait;
        let started = tokio::time::Instant::now();
        Ok((self.try_acquire(req).await?, started))
    }

    /// The leader of the election on `name`: the campaign value and token of the grant that
    /// holds it, if any.
    /// The default reads the holder: its client-name metadata is the campaign value.
    async fn leader(&self, name: &str) -> Result<Option<Leader>> {
        Ok(self.inspect(name).await?.map(crate::election::from_holder))
    }

    /// Replaces the campaign value of `owner`'s grant on `name`. `Ok(false)` when that owner
    /// no longer holds it.
    async fn proclaim(&self, name: &str, owner: &str, value: &str) -> Result<bool> {
        let _ = (name, owner, value);
        Err(crate::election::no_proclaim(self.kind()))
    }

    /// Publishes every change of `name`'s leader on `tx` until `tx` has no receiver left.
    /// The default reads the leader every `poll`; engines with change notifications do better.
    async fn observe(
        &self,
        name: &str,
        tx: &tokio::sync::watch::Sender<Option<Leader>>,
        poll: Duration,
    ) {
        loop {
            let step = async {
                match tokio::time::timeout(poll, self.leader(name)).await {
                    Ok(Ok(leader)) => crate::election::publish(tx, leader),
                    Ok(Err(e)) => tracing::debug!(error = %e, "reading the leader failed"),
                    Err(_) => tracing::debug!("reading the leader timed out"),
                }
                tokio::time::sleep(poll).await;
            };
            tokio::select! {
                _ = tx.closed() => return,
                _ = step => {}
            }
        }
    }

    /// Owner-checked renewal of many leases in as few server calls as the engine allows (one
    /// per node). The answer has one entry per renewal, in order.
    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>>;

    /// Owner-checked release. `Ok(true)` when this owner held the key and it was deleted.
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

    /// The engine keys (or rows) a resource name maps to, labelled, for `fencelock key`.
    fn keys(&self, name: &str) -> Vec<(&'static str, String)>;

    /// For engines that learn of lost leases as it happens (a session that ended): the owner
    /// values of leases lost, pushed as soon as the engine knows. Taken once, by the watchdog,
    /// which marks those leases lost without waiting for their next renewal.
    fn take_loss_feed(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<String>> {
        None
    }
}
