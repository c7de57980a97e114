//! The etcd engine: the recipe of etcd's own `concurrency` package (`mutex.go`), so that
//! `etcdctl lock` and fencelock exclude each other on the same name.
//!
//! Each part is documented with its code: the client's session leases in [`session`]; each
//! acquisition's key, its renewal and release in [`hold`]; the lock, the waiting and the
//! token in [`queue`];
//! native elections in [`election`]; the runbook in [`runbook`]; etcd calls in [`call`].

pub(crate) mod acl;
mod call;
mod election;
mod hold;
mod keys;
mod limits;
mod queue;
mod runbook;
mod session;
pub(crate) mod url;

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::core::engine::{
    AcquireRequest, Attempt, Engine, EngineConfig, Opened, Renewal, Renewed, WaitQueue,
    DEFAULT_PREFIX,
};
use crate::core::error::Result;
use crate::core::holder::Holder;
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
use async_trait::async_trait;
use keys::{Keys, DEFAULT_ETCD_PREFIX};
use session::State;
use url::EtcdUrl;

const KIND: &str = "etcd";

pub(crate) struct EtcdEngine {
    client: etcd_client::Client,
    keys: Keys,
    op_timeout: Duration,
    /// The endpoints as the URL gave them, for messages about a cluster that does not answer.
    endpoints: String,
    /// The sessions and every acquisition's key on them (see [`session`]).
    state: Mutex<State>,
    /// Held while a session is granted, so that acquisitions starting together share one.
    granting: tokio::sync::Mutex<()>,
    /// The owners of leases lost with their session, for the watchdog.
    losses: tokio::sync::mpsc::UnboundedSender<String>,
    /// This engine, for the tasks that finish a key's creation after its caller left.
    this: Weak<EtcdEngine>,
    /// The limits of the prefix as last read, and when (see [`limits`]).
    limits_seen: Mutex<Option<(tokio::time::Instant, Limits)>>,
}

/// Opens the engine for an `etcd://` / `etcds://` backend. Connecting is lazy: an unreachable
/// cluster shows at the first call, which is bounded like every call.
/// Hands out the lock, etcd's own waiter queue (every acquisition waits in FIFO order),
/// native elections and the feed of leases lost with their session. The keys of a session
/// outlive a lease the client stops renewing, so the client releases every lease it drops or
/// declares lost.
pub(crate) async fn open(url: EtcdUrl, cfg: &EngineConfig) -> Result<Opened> {
    let client = call::connect_client(&url, cfg.op_timeout).await?;
    let (losses, rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Arc::new_cyclic(|this| EtcdEngine {
        client,
        keys: Keys {
            prefix: etcd_prefix(&cfg.prefix),
        },
        op_timeout: cfg.op_timeout,
        endpoints: url
            .endpoints
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
        state: Mutex::new(State::default()),
        granting: tokio::sync::Mutex::new(()),
        losses,
        this: this.clone(),
        limits_seen: Mutex::new(None),
    });
    Ok(Opened {
        queue: Some(engine.clone()),
        elections: Some(engine.clone()),
        losses: Some(rx),
        release_abandoned: true,
        ..Opened::lock(engine)
    })
}

/// The client's prefix on etcd: the default one is written the etcd way, as a path.
fn etcd_prefix(prefix: &str) -> String {
    if prefix == DEFAULT_PREFIX {
        DEFAULT_ETCD_PREFIX.to_owned()
    } else {
        prefix.to_owned()
    }
}

fn keys_of(keys: &Keys, name: &str) -> Vec<(&'static str, String)> {
    vec![
        ("etcdctl lock/elect name", keys.lock_prefix(name)),
        (
            "waiter keys",
            format!("{}<lease id hex>", keys.waiters(name)),
        ),
    ]
}

/// The labelled keys of `name` under `prefix`, as [`Engine::keys`] gives them, without a
/// connection.
pub(crate) fn labelled_keys(prefix: &str, name: &str) -> Vec<(&'static str, String)> {
    keys_of(
        &Keys {
            prefix: etcd_prefix(prefix),
        },
        name,
    )
}

#[async_trait]
impl Engine for EtcdEngine {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        keys_of(&self.keys, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        Ok(self.acquire_queued(req, Duration::ZERO, None).await?.0)
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        self.renew_within_limits(batch).await
    }

    async fn release(&self, _name: &str, owner: &str) -> Result<bool> {
        self.close_session(owner).await
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
        self.force_release_head(name, expected_owner, draft).await
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
