//! The ZooKeeper engine: Apache Curator's lock recipe (`InterProcessMutex`, `LockInternals`,
//! `StandardLockInternalsDriver`), so that Curator and fencelock exclude each other on the same
//! path, and Curator's `LeaderLatch` layout for elections.
//!
//! Each part is documented with its code: the client's one ZooKeeper session, its renewals,
//! losses and releases in [`session`]; how long the client may count on that session, which
//! only the leader can tell, in [`proof`]; the waiter nodes, the waiting and the token in
//! [`queue`]; elections in [`election`]; the runbook in [`runbook`]; ZooKeeper calls in
//! [`call`]; the name mapping in [`paths`].

pub(crate) mod acl;
mod call;
mod election;
mod limits;
mod paths;
mod proof;
mod queue;
mod runbook;
mod session;
pub(crate) mod url;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;
use zookeeper_client::{Acl, AuthId, Permission};

use crate::core::engine::{
    AcquireRequest, Attempt, Engine, EngineConfig, Opened, Renewal, Renewed, WaitQueue,
};
use crate::core::error::Result;
use crate::core::holder::Holder;
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
use paths::Paths;
use session::{Node, Session};
use url::ZkUrl;

const KIND: &str = "zookeeper";

pub(crate) struct ZkEngine {
    url: ZkUrl,
    paths: Paths,
    op_timeout: Duration,
    /// The ACL of every node this client creates: with digest credentials, only this identity
    /// may change or delete it (and create or delete children of a lock path), everyone may
    /// read it; without, ZooKeeper's open ACL, as Curator's default.
    acls: Vec<Acl>,
    /// `zks://`: the TLS settings every connection uses.
    tls: Option<zookeeper_client::TlsOptions>,
    /// The client's one session, opened at the first call.
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
    /// This client's waiter and holder nodes, by owner value.
    nodes: Mutex<HashMap<String, Node>>,
    /// Where the owners of leases lost with their session go (the watchdog's loss feed).
    losses: mpsc::UnboundedSender<String>,
    /// The limits of the prefix as last read, and when (see [`limits`]).
    limits_seen: Mutex<Option<(tokio::time::Instant, Limits)>>,
    /// The engine itself, for the tasks it starts (which must not keep it alive).
    me: Weak<ZkEngine>,
}

/// Opens the engine for a `zk://` backend. The session is opened at the first call (bounded
/// like every call), with its timeout taken from that call's TTL unless the URL sets one.
/// Hands out the lock, ZooKeeper's own waiter queue (every acquisition waits in FIFO order),
/// elections and the feed of leases lost with their session.
pub(crate) async fn open(url: ZkUrl, cfg: &EngineConfig) -> Result<Opened> {
    let (tx, rx) = mpsc::unbounded_channel();
    let acls = if url.user.is_some() {
        vec![
            Acl::new(Permission::ALL, AuthId::authed()),
            Acl::new(Permission::READ, AuthId::anyone()),
        ]
    } else {
        vec![Acl::new(Permission::ALL, AuthId::anyone())]
    };
    let prefix = paths::zk_prefix(&cfg.prefix)?;
    // Bad TLS files are the caller's input: refused here, before any connection.
    let tls = url.tls_options()?;
    let engine = Arc::new_cyclic(|me| ZkEngine {
        url,
        tls,
        paths: Paths { prefix },
        op_timeout: cfg.op_timeout,
        acls,
        session: tokio::sync::Mutex::new(None),
        nodes: Mutex::new(HashMap::new()),
        losses: tx,
        limits_seen: Mutex::new(None),
        me: me.clone(),
    });
    session::sweep_dropped(Arc::downgrade(&engine));
    Ok(Opened {
        queue: Some(engine.clone()),
        elections: Some(engine.clone()),
        losses: Some(rx),
        // Ephemeral nodes: a client that closes its session on the way out deletes them.
        ends_with_process: true,
        ..Opened::lock(engine)
    })
}

fn keys_of(paths: &Paths, name: &str) -> Vec<(&'static str, String)> {
    vec![
        (
            "lock path (Curator InterProcessMutex / LeaderLatch)",
            paths.lock(name),
        ),
        (
            "waiter nodes",
            format!("{}/_c_<uuid>-lock-<sequence>", paths.lock(name)),
        ),
    ]
}

/// The labelled paths of `name` under `prefix`, as [`Engine::keys`] gives them, without a
/// connection.
pub(crate) fn labelled_keys(prefix: &str, name: &str) -> Result<Vec<(&'static str, String)>> {
    Ok(keys_of(
        &Paths {
            prefix: paths::zk_prefix(prefix)?,
        },
        name,
    ))
}

#[async_trait]
impl Engine for ZkEngine {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        keys_of(&self.paths, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        Ok(self.acquire_queued(req, Duration::ZERO, None).await?.0)
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        self.renew_within_limits(batch).await
    }

    async fn release(&self, _name: &str, owner: &str) -> Result<bool> {
        self.delete_node(owner).await
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
