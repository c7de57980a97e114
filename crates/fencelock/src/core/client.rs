//! The client: one opened engine, its capabilities and the watchdog that renews its leases.
//! The acquire loops are in `acquire`; opening an engine from a URL is the registry's job
//! (`crate::engines`), which hands the client an [`Opened`] engine.

use std::collections::BTreeMap;
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
use crate::core::routes::{Routes, SINGLE_BACKEND};
use crate::core::url::redact_url;
use crate::core::watchdog::Watchdog;

pub use crate::core::engine::DEFAULT_PREFIX;

/// A handle on one lock engine, or on several with names routed among them by prefix
/// ([`Client::routed`]). Cheap to clone; clones share one connection set and one renewal task
/// per backend.
#[derive(Clone)]
pub struct Client {
    /// The one backend of a client opened on a URL; for a routed client, its default backend
    /// (else its first): every call about a name goes through [`Client::on`] first.
    pub(crate) inner: Arc<ClientInner>,
    pub(crate) router: Option<Arc<Router>>,
}

/// The backends of a routed client, each a client on one URL with its own watchdog,
/// capabilities and metrics label, and the table that picks one per name.
pub(crate) struct Router {
    pub(crate) routes: Routes,
    pub(crate) backends: BTreeMap<String, Client>,
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
    /// A dropped lease is released, not left to expire ([`Opened::release_abandoned`]).
    pub(crate) release_abandoned: bool,
}

/// Builds a [`Client`]: the backend URL plus optional settings.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    url: String,
    routes: Option<Routes>,
    backend: Option<String>,
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

    /// The routing table of a routed client.
    pub(crate) fn routing(&self) -> Option<&Routes> {
        self.routes.as_ref()
    }

    /// The builder of one backend of a routed client: same settings, its URL and name.
    pub(crate) fn for_backend(&self, name: &str, url: &str) -> ClientBuilder {
        ClientBuilder {
            url: url.to_owned(),
            routes: None,
            backend: Some(name.to_owned()),
            ..self.clone()
        }
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
            release_abandoned,
        } = opened;
        let calls = Calls {
            engine: engine.kind(),
            url: redact_url(&self.url),
            backend: self.backend.clone().map(Arc::from),
        };
        let cleanup = TaskTracker::new();
        let watchdog = Watchdog::start(
            engine.clone(),
            losses,
            release_abandoned,
            calls.clone(),
            cfg.op_timeout,
            cleanup.clone(),
        );
        Client {
            router: None,
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
                release_abandoned,
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
            routes: None,
            backend: None,
            prefix: DEFAULT_PREFIX.to_owned(),
            client_name: "fencelock".to_owned(),
            named: false,
            max_ttl: Duration::from_secs(24 * 3600),
            op_timeout: Duration::from_secs(5),
        }
    }

    /// Starts building a client that routes names among the backends of `routes` by
    /// prefix; see [`Routes`]. The builder's settings apply to every backend, each of which
    /// is opened once by [`ClientBuilder::connect`].
    pub fn routed(routes: Routes) -> ClientBuilder {
        ClientBuilder {
            routes: Some(routes),
            ..Client::builder("")
        }
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres`, `postgres-lease`.
    /// For a routed client, the default backend's (see [`Client::backend_for`]).
    pub fn engine(&self) -> &'static str {
        self.inner.engine.kind()
    }

    /// The backend URL, password redacted. For a routed client, the default backend's.
    pub fn url(&self) -> &str {
        &self.inner.calls.url
    }

    /// The limits stored in the engine under this client's prefix, as each node (one entry
    /// per Redlock node; one for every other engine) has them. A routed client reads its
    /// default backend's: [`Client::backend_for`] reaches the others.
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

    /// The name of the backend this client talks to (`default` for a client opened on one
    /// URL); for a routed client, its default backend's.
    pub fn backend(&self) -> &str {
        self.inner.calls.backend_label()
    }

    /// The backend `name` is routed to: a client on that backend alone (the client itself
    /// when it is not routed).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when no route matches and the table has no default.
    pub fn backend_for(&self, name: &str) -> Result<&Client> {
        self.on(name)
    }

    /// Every backend: `(name, client on it)`, in name order; one entry, `default`, for a client
    /// opened on one URL.
    pub fn backends(&self) -> Vec<(&str, &Client)> {
        match &self.router {
            None => vec![(SINGLE_BACKEND, self)],
            Some(r) => r.backends.iter().map(|(n, c)| (n.as_str(), c)).collect(),
        }
    }

    /// The routing table of a routed client.
    pub fn routes(&self) -> Option<&Routes> {
        self.router.as_ref().map(|r| &r.routes)
    }

    /// A routed client on backends already opened, one per name of `routes`.
    pub(crate) fn on_routes(routes: Routes, backends: BTreeMap<String, Client>) -> Result<Client> {
        let first = routes
            .default_backend_name()
            .and_then(|d| backends.get(d))
            .or_else(|| backends.values().next())
            .ok_or_else(|| Error::invalid("the routing table names no backend"))?;
        Ok(Client {
            inner: first.inner.clone(),
            router: Some(Arc::new(Router { routes, backends })),
        })
    }

    /// The single-backend client that serves `name`.
    pub(crate) fn on(&self, name: &str) -> Result<&Client> {
        let Some(router) = &self.router else {
            return Ok(self);
        };
        let backend = router.routes.backend_for(name)?;
        router.backends.get(backend).ok_or_else(|| {
            Error::invalid(format!("backend {backend:?} is not open")).with_resource(name)
        })
    }

    /// The engine keys a resource name maps to, labelled (`lock`, `fence`, ...), so that other
    /// tools can take or inspect the same lock.
    pub fn keys_for(&self, name: &str) -> Result<Vec<(&'static str, String)>> {
        validate_name(name)?;
        Ok(self.on(name)?.inner.engine.keys(name))
    }

    /// The current holder of `name`, if the lock is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        validate_name(name)?;
        let inner = &self.on(name)?.inner;
        inner
            .calls
            .call(name, inner.cfg.op_timeout, inner.engine.inspect(name))
            .await
    }

    /// Waits for background clean-up (releases of cancelled acquisitions and of leases lost
    /// after failed renewals) to finish, on every backend. Call it before a process exits.
    pub async fn close(&self) {
        for (_, client) in self.backends() {
            let inner = &client.inner;
            inner.cleanup.close();
            inner.cleanup.wait().await;
            inner.cleanup.reopen();
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.router {
            None => f
                .debug_struct("Client")
                .field("engine", &self.engine())
                .field("url", &self.url())
                .finish(),
            Some(r) => f
                .debug_struct("Client")
                .field("backends", &r.backends)
                .finish(),
        }
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
        let from = match answer.as_deref() {
            Ok([first, ..]) => first.confirmed_from(started),
            _ => None,
        };
        lease.renewal_attempted(in_time && from.is_some());
        match answer?.first() {
            Some(Renewed::Extended | Renewed::ExtendedFrom(_)) if in_time => {
                self.watchdog
                    .confirmed(lease.id, from.unwrap_or(started), started);
                Ok(())
            }
            // The engine's limit refused it: the lease stays valid until its deadline, which the
            // refusal did not move, and the caller learns why.
            Some(Renewed::OverLimit(max)) => Err(crate::core::limits::ttl_refused(*max, lease.ttl)
                .with_resource(&lease.resource)
                .with_engine(self.engine.kind())),
            Some(Renewed::Extended | Renewed::ExtendedFrom(_)) => {
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
