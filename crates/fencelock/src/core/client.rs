//! The client: one opened engine, its capabilities and the watchdog that renews its leases.
//! The acquire loops are in `acquire`; opening an engine from a URL is the registry's job
//! (`crate::engines`), which hands the client an [`Opened`] engine.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::core::call::Calls;
use crate::core::engine::{
    Elections, Engine, EngineConfig, FairQueue, Opened, Renewal, Renewed, WaitQueue,
};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::{Holder, HolderMeta};
use crate::core::lease::LeaseState;
use crate::core::metrics::Loss;
use crate::core::name::{validate_name, MAX_NAME_BYTES};
use crate::core::options::{display_duration, OP_TIMEOUT_CEILING, TTL_CEILING};
use crate::core::url::redact_url;
use crate::core::watchdog::Watchdog;

pub use crate::core::engine::DEFAULT_PREFIX;

/// A handle on one lock engine. Cheap to clone; clones share one connection set and one
/// renewal task.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

pub(crate) struct ClientInner {
    pub(crate) engine: Arc<dyn Engine>,
    pub(crate) fair: Option<Arc<dyn FairQueue>>,
    pub(crate) queue: Option<Arc<dyn WaitQueue>>,
    pub(crate) elections: Option<Arc<dyn Elections>>,
    pub(crate) watchdog: Watchdog,
    pub(crate) meta: HolderMeta,
    pub(crate) cfg: EngineConfig,
    pub(crate) calls: Calls,
    pub(crate) cleanup: TaskTracker,
    pub(crate) next_id: AtomicU64,
}

/// Builds a [`Client`]: the backend URL plus optional settings.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    url: String,
    prefix: String,
    client_name: String,
    named: bool,
    max_ttl: Duration,
    op_timeout: Duration,
}

impl ClientBuilder {
    /// The key prefix (namespace). Default `fencelock:v1:`. An empty prefix is refused by
    /// [`ClientBuilder::connect`] as invalid input.
    pub fn prefix(mut self, prefix: impl Into<String>) -> ClientBuilder {
        self.prefix = prefix.into();
        self
    }

    /// The client name recorded with every lease, shown by `inspect`. Default `fencelock`.
    /// Checked like a resource name (1 to 256 bytes, no control characters) on connect.
    ///
    /// The name is also who the client is for a `max-held-per-client` limit stored in the
    /// engine: clients of one name share its quota. A client given no name counts alone,
    /// under a random id of its own.
    pub fn client_name(mut self, name: impl Into<String>) -> ClientBuilder {
        self.client_name = name.into();
        self.named = true;
        self
    }

    /// The longest TTL this client accepts. Default one day; at most a year.
    pub fn max_ttl(mut self, max: Duration) -> ClientBuilder {
        self.max_ttl = max;
        self
    }

    /// The deadline of every single engine call. Default 5 s; at most an hour.
    pub fn op_timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.op_timeout = timeout;
        self
    }

    /// The backend URL as given.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The settings every engine is opened with, checked.
    pub(crate) fn config(&self) -> Result<EngineConfig> {
        if self.prefix.is_empty() {
            return Err(Error::invalid(
                "the key prefix is empty; an empty namespace shares keys with every other \
                 user of the engine, so give one such as fencelock:v1:",
            ));
        }
        if self.prefix.len() > 64 || self.prefix.chars().any(char::is_control) {
            return Err(Error::invalid(
                "the key prefix must be at most 64 bytes without control characters",
            ));
        }
        // The client name is written next to every lease and shown by `inspect` and in "held
        // by" messages on other machines: the same rules as a resource name keep it one line.
        if self.client_name.is_empty()
            || self.client_name.len() > MAX_NAME_BYTES
            || self.client_name.chars().any(char::is_control)
        {
            return Err(Error::invalid(format!(
                "the client name {:?} must be 1 to {MAX_NAME_BYTES} bytes without control \
                 characters",
                self.client_name
            )));
        }
        if self.op_timeout.is_zero() || self.op_timeout > OP_TIMEOUT_CEILING {
            return Err(Error::invalid(format!(
                "the operation timeout must be positive and at most {}",
                display_duration(OP_TIMEOUT_CEILING)
            )));
        }
        if self.max_ttl > TTL_CEILING {
            return Err(Error::invalid(format!(
                "a TTL cap of {} is beyond the {} any lease may have",
                display_duration(self.max_ttl),
                display_duration(TTL_CEILING)
            )));
        }
        Ok(EngineConfig {
            prefix: self.prefix.clone(),
            op_timeout: self.op_timeout,
            max_ttl: self.max_ttl,
            holder_id: if self.named {
                self.client_name.clone()
            } else {
                format!("{:032x}", rand::random::<u128>())
            },
        })
    }

    /// The client on an engine the registry opened with [`ClientBuilder::config`]: starts the
    /// renewal task, so it must run inside a tokio runtime.
    pub(crate) fn start(self, cfg: EngineConfig, opened: Opened) -> Client {
        let Opened {
            engine,
            fair,
            queue,
            elections,
            losses,
        } = opened;
        let calls = Calls {
            engine: engine.kind(),
            url: redact_url(&self.url),
        };
        let cleanup = TaskTracker::new();
        let watchdog = Watchdog::start(
            engine.clone(),
            losses,
            calls.clone(),
            cfg.op_timeout,
            cleanup.clone(),
        );
        Client {
            inner: Arc::new(ClientInner {
                engine,
                fair,
                queue,
                elections,
                watchdog,
                meta: HolderMeta::current(self.client_name),
                cfg,
                calls,
                cleanup,
                next_id: AtomicU64::new(1),
            }),
        }
    }
}

impl Client {
    /// Starts building a client for a backend URL (`sqlite:///path.db`, `redis://host:port`,
    /// `redlock://h1:p1,h2:p2,h3:p3`, `postgres://user@host/db`, ...).
    pub fn builder(url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            prefix: DEFAULT_PREFIX.to_owned(),
            client_name: "fencelock".to_owned(),
            named: false,
            max_ttl: Duration::from_secs(24 * 3600),
            op_timeout: Duration::from_secs(5),
        }
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres`, `postgres-lease`.
    pub fn engine(&self) -> &'static str {
        self.inner.engine.kind()
    }

    /// The backend URL, password redacted.
    pub fn url(&self) -> &str {
        &self.inner.calls.url
    }

    /// The limits stored in the engine under this client's prefix, as each node (one entry
    /// per Redlock node; one for every other engine) has them.
    ///
    /// # Errors
    /// [`ErrorKind::Engine`] when the engine cannot be read at all.
    pub async fn limits(&self) -> Result<Vec<crate::core::limits::StoredLimits>> {
        let engine = self.inner.engine.clone();
        self.inner
            .calls
            .traced("limits", self.inner.cfg.op_timeout, engine.limits())
            .await
    }

    /// Stores `limits` in the engine under this client's prefix (on every node), where every
    /// grant and renewal under the prefix is checked against them; empty limits remove them.
    /// Leases granted before keep their TTL; renewing one beyond a new cap is refused.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a cap below the minimum TTL or a quota of zero;
    /// [`ErrorKind::Engine`] unless every node stored them.
    pub async fn set_limits(&self, limits: &crate::core::limits::Limits) -> Result<()> {
        limits.validate()?;
        let engine = self.inner.engine.clone();
        self.inner
            .calls
            .traced(
                "limits",
                self.inner.cfg.op_timeout,
                engine.set_limits(limits),
            )
            .await
    }

    /// The engine keys a resource name maps to, labelled (`lock`, `fence`, ...), so that other
    /// tools can take or inspect the same lock.
    pub fn keys_for(&self, name: &str) -> Result<Vec<(&'static str, String)>> {
        validate_name(name)?;
        Ok(self.inner.engine.keys(name))
    }

    /// The current holder of `name`, if the lock is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        validate_name(name)?;
        let inner = &self.inner;
        inner
            .calls
            .call(name, inner.cfg.op_timeout, inner.engine.inspect(name))
            .await
    }

    /// Waits for background clean-up (releases of cancelled acquisitions and of leases lost
    /// after failed renewals) to finish. Call it before a process exits.
    pub async fn close(&self) {
        self.inner.cleanup.close();
        self.inner.cleanup.wait().await;
        self.inner.cleanup.reopen();
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("engine", &self.engine())
            .field("url", &self.url())
            .finish()
    }
}

impl ClientInner {
    pub(crate) async fn extend_now(self: &Arc<Self>, lease: &LeaseState) -> Result<()> {
        if lease.is_lost() {
            return Err(lease.lost_error(self.engine.kind()));
        }
        let started = Instant::now();
        let batch = [Renewal {
            name: lease.resource.clone(),
            owner: lease.owner.clone(),
            ttl: lease.ttl,
        }];
        let limit = self.cfg.op_timeout.min(lease.ttl);
        let answer = self
            .calls
            .call(&lease.resource, limit, self.engine.extend(&batch))
            .await;
        let in_time = Instant::now() < lease.deadline();
        let extended = matches!(answer.as_deref(), Ok([Renewed::Extended, ..]));
        lease.renewal_attempted(in_time && extended);
        match answer?.first() {
            Some(Renewed::Extended) if in_time => {
                self.watchdog.confirmed(lease.id, started);
                Ok(())
            }
            // The engine's limit refused it: the lease stays valid until its deadline, which the
            // refusal did not move, and the caller learns why.
            Some(Renewed::OverLimit(max)) => Err(crate::core::limits::ttl_refused(*max, lease.ttl)
                .with_resource(&lease.resource)
                .with_engine(self.engine.kind())),
            Some(Renewed::Extended) => {
                lease.mark_lost(
                    Loss::Expired,
                    "its validity ended before the extension was confirmed".into(),
                );
                Err(lease.lost_error(self.engine.kind()))
            }
            // Refused, or not confirmed by enough of the engine: the lease cannot be counted
            // on any more.
            _ => {
                lease.mark_lost(
                    Loss::NotHolder,
                    "the engine no longer lists this owner as holder: the lock expired or was \
                     taken or force-released"
                        .into(),
                );
                self.watchdog.unregister(lease.id);
                Err(lease.lost_error(self.engine.kind()))
            }
        }
    }

    /// Owner-checked release of `owner`'s grant (or queue entry) on `name`.
    pub(crate) async fn release_owner(&self, name: &str, owner: &str) -> Result<bool> {
        self.calls
            .call(name, self.cfg.op_timeout, self.engine.release(name, owner))
            .await
    }

    pub(crate) async fn release_state(&self, lease: &LeaseState) -> Result<()> {
        if self.release_owner(&lease.resource, &lease.owner).await? {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::NotHolder,
                format!(
                    "the lease with token {} had already expired or been taken before release; \
                     work done under it may have overlapped another holder",
                    lease.token
                ),
            )
            .with_resource(&lease.resource)
            .with_engine(self.engine.kind()))
        }
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        tracing::trace!(url = %self.calls.url, "client dropped");
    }
}
