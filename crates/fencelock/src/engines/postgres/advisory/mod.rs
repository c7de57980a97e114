//! Advisory mode: session advisory locks on a few pooled sessions. See the module docs of
//! [`super`] for the design.
//!
//! - [`session`]: the slots, their sessions, and each session's queue of statements;
//! - [`acquire`]: one grant, its token in the same round trip;
//! - [`renew`]: renewal as a liveness check per session, and the TTL this process enforces;
//! - [`release`]: the owner's release, and undoing a grant whose answer was lost;
//! - [`runbook`]: who holds a key as the server sees it, and the forced release.

mod acquire;
mod release;
mod renew;
mod runbook;
mod session;

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::mpsc;

use super::Shared;
use crate::core::engine::{AcquireRequest, Attempt, Engine, LossFeed, Renewal, Renewed};
use crate::core::error::{Error, Result};
use crate::core::holder::Holder;
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
pub(super) use acquire::{GRANT, GRANT_PARAMS};
pub(super) use release::{RELEASE, RELEASE_PARAMS};
use session::Session;

pub(crate) struct AdvisoryEngine {
    shared: Shared,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Session>>>>,
    loss_tx: mpsc::UnboundedSender<String>,
}

impl AdvisoryEngine {
    /// The engine and its feed of leases lost with a session that ended.
    pub(super) fn new(shared: Shared, sessions: usize) -> (AdvisoryEngine, LossFeed) {
        let (loss_tx, loss_rx) = mpsc::unbounded_channel();
        let engine = AdvisoryEngine {
            shared,
            slots: (0..sessions.max(1))
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            loss_tx,
        };
        (engine, loss_rx)
    }

    fn gone(&self) -> Error {
        Error::engine_failure(
            self.shared.kind,
            "the PostgreSQL session ended before answering (server restarted or unreachable?)",
        )
    }
}

#[async_trait]
impl Engine for AdvisoryEngine {
    fn kind(&self) -> &'static str {
        self.shared.kind
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        super::labelled_keys(super::url::PgMode::Advisory, &self.shared.prefix, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        self.attempt(req).await
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        self.renew(batch).await
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        self.release_held(name, owner).await
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        self.holder_named(name).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        self.held_under(prefix).await
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        self.force(name, expected_owner, draft).await
    }

    async fn limits(&self) -> Result<Vec<StoredLimits>> {
        let s = self.any_session().await?;
        self.shared.read_limits(&s.client).await
    }

    async fn set_limits(&self, limits: &Limits) -> Result<()> {
        let s = self.any_session().await?;
        self.shared.write_limits(&s.client, limits).await
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        self.audit_log(name).await
    }
}
