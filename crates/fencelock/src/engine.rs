//! The small internal trait every engine implements. The core (lease, watchdog, retries,
//! validity) is written once against it; an engine only knows how to talk to its server.

use std::time::Duration;

use async_trait::async_trait;

use crate::error::Result;
use crate::holder::{Holder, HolderMeta};
use crate::token::FencingToken;

/// One acquisition attempt as the engine sees it. `key` is the namespaced key (prefix + name).
#[derive(Debug, Clone)]
pub(crate) struct AcquireRequest {
    pub key: String,
    pub owner: String,
    pub ttl: Duration,
    pub meta: HolderMeta,
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
    },
}

/// One lease to renew in a batch.
#[derive(Debug, Clone)]
pub(crate) struct Renewal {
    pub key: String,
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
}

#[async_trait]
pub(crate) trait Engine: Send + Sync + 'static {
    /// Short engine name for messages and metrics: `sqlite`, `redis`, `redlock`, ...
    fn kind(&self) -> &'static str;

    /// One attempt, atomically taking the lock and advancing the fencing counter.
    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt>;

    /// Owner-checked renewal of many leases in as few server calls as the engine allows (one
    /// per node). The answer has one entry per renewal, in order.
    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>>;

    /// Owner-checked release. `Ok(true)` when this owner held the key and it was deleted.
    async fn release(&self, key: &str, owner: &str) -> Result<bool>;

    /// The current holder of a key, if the lock is held.
    async fn inspect(&self, key: &str) -> Result<Option<Holder>>;

    /// Waits until the engine signals that `key` may have been released, or `max` passes.
    /// Engines without wake-ups simply sleep, which turns waiting into polling with backoff.
    async fn wait_for_release(&self, _key: &str, max: Duration) {
        tokio::time::sleep(max).await;
    }
}
