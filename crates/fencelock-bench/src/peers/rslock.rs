//! rslock, the Rust Redlock crate on the same `redis` crate as fencelock, as the harness drives
//! it: `lock` (its attempts with retries) for the sequential loop, `acquire` (which repeats
//! `lock` until it succeeds) bounded by the same wait as fencelock's for contention, and
//! `release`, which deletes the key on every node by a compare-owner script.

use std::time::Duration;

use rslock::{LockError, LockGuard, LockManager};

use crate::harness::LockLib;
use crate::servers::node_clients;

/// How rslock retries a refused attempt: after each one it deletes its key on every node and
/// sleeps a random time below `delay` (whole milliseconds), up to `count` attempts per `lock`
/// call; `acquire` calls `lock` again at once when they run out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retry {
    pub(crate) count: u32,
    pub(crate) delay: Duration,
}

pub(crate) struct Rslock {
    manager: LockManager,
    ttl: Duration,
    wait: Duration,
}

impl Rslock {
    /// A lock manager over every node of `url` (the redis crate's clients as fencelock builds
    /// them, so credentials and TLS settings are the same), connecting on first use.
    pub(crate) fn new(
        url: &str,
        ttl: Duration,
        wait: Duration,
        retry: Retry,
    ) -> Result<Rslock, String> {
        let mut manager = LockManager::from_clients(node_clients(url)?);
        manager.set_retry(retry.count, retry.delay);
        Ok(Rslock { manager, ttl, wait })
    }
}

impl LockLib for Rslock {
    type Guard = LockGuard;
    type Error = LockError;

    async fn try_acquire(&self, name: &str) -> Result<LockGuard, LockError> {
        let lock = self.manager.lock(name.as_bytes(), self.ttl).await?;
        Ok(LockGuard { lock })
    }

    async fn acquire(&self, name: &str) -> Result<Option<LockGuard>, LockError> {
        // rslock's acquire loops until it wins; the wait bounds it as fencelock's `wait`
        // bounds fencelock's. A cancelled attempt may leave its key on a node until the TTL,
        // which the run's clean-up deletes.
        match tokio::time::timeout(self.wait, self.manager.acquire(name.as_bytes(), self.ttl)).await
        {
            Ok(guard) => guard.map(Some),
            Err(_) => Ok(None),
        }
    }

    async fn release(&self, guard: LockGuard) -> Result<(), LockError> {
        guard.release().await;
        Ok(())
    }
}
