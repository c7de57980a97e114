//! The client: one opened engine, its capabilities and the watchdog that renews its leases,
//! or a routed client's backends (`router`), each such a client once opened. The acquire loops
//! are in `acquire`; opening an engine from a URL is the registry's job (`crate::engines`),
//! which hands the client an [`Opened`] engine.

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
use crate::core::router::Router;
use crate::core::routes::{Routes, SINGLE_BACKEND};
use crate::core::url::redact_url;
use crate::core::watchdog::Watchdog;

pub use crate::core::engine::DEFAULT_PREFIX;

/// A handle on one lock engine, or on several with names routed among them by prefix
/// ([`Client::routed`]). Cheap to clone; clones share one connection set and one renewal task
/// per backend.
#[derive(Clone)]
pub struct Client {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    /// A client opened on one URL.
    One(Arc<ClientInner>),
    /// A routed client: every call about a name goes through [`Client::on`], which opens the
    /// name's backend when it is first needed.
    Routed(Arc<Router>),
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
    /// [`Opened::ends_with_process`].
    pub(crate) ends_with_process: bool,
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
        Client {
            kind: Kind::One(self.start_inner(cfg, opened)),
        }
    }

    /// [`ClientBuilder::start`], for one backend of a routed client.
    pub(crate) fn start_inner(self, cfg: EngineConfig, opened: Opened) -> Arc<ClientInner> {
        let Opened {
            engine,
            fair,
            queue,
            elections,
            losses,
            release_abandoned,
            ends_with_process,
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
        Arc::new(ClientInner {
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
            ends_with_process,
        })
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
    /// prefix; see [`Routes`]. The builder's settings apply to every backend.
    /// [`ClientBuilder::connect`] checks the table; each backend is opened when a call first
    /// needs it (see [`Client::backend_for`]).
    pub fn routed(routes: Routes) -> ClientBuilder {
        ClientBuilder {
            routes: Some(routes),
            ..Client::builder("")
        }
    }

    /// A routed client on `router`, none of whose backends is open yet.
    pub(crate) fn on_router(router: Router) -> Client {
        Client {
            kind: Kind::Routed(Arc::new(router)),
        }
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres`, `postgres-lease`.
    /// For a routed client, the default backend's (else the first's); see
    /// [`Client::backends`] for the others.
    pub fn engine(&self) -> &'static str {
        match &self.kind {
            Kind::One(inner) => inner.engine.kind(),
            Kind::Routed(r) => r.engine_of(r.main()).unwrap_or("unknown"),
        }
    }

    /// The backend URL, password redacted. For a routed client, the default backend's (else
    /// the first's).
    pub fn url(&self) -> &str {
        match &self.kind {
            Kind::One(inner) => &inner.calls.url,
            Kind::Routed(r) => r.url_of(r.main()).unwrap_or_default(),
        }
    }

    /// The client's one backend, or for a routed client its default backend (else its
    /// first), opened if it was not.
    pub(crate) async fn main(&self) -> Result<&Arc<ClientInner>> {
        match &self.kind {
            Kind::One(inner) => Ok(inner),
            Kind::Routed(r) => r.open(r.main()).await,
        }
    }

    /// The limits stored in the engine under this client's prefix, as each node (one entry
    /// per Redlock node; one for every other engine) has them. A routed client reads its
    /// default backend's: [`Client::backend_for`] reaches the others.
    ///
    /// # Errors
    /// [`ErrorKind::Engine`] when the engine cannot be read at all.
    pub async fn limits(&self) -> Result<Vec<crate::core::limits::StoredLimits>> {
        let inner = self.main().await?;
        let engine = inner.engine.clone();
        inner
            .calls
            .traced("limits", inner.cfg.op_timeout, engine.limits())
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
        let inner = self.main().await?;
        let engine = inner.engine.clone();
        inner
            .calls
            .traced("limits", inner.cfg.op_timeout, engine.set_limits(limits))
            .await
    }

    /// The name of the backend this client talks to (`default` for a client opened on one
    /// URL); for a routed client, its default backend's (else its first's).
    pub fn backend(&self) -> &str {
        match &self.kind {
            Kind::One(inner) => inner.calls.backend_label(),
            Kind::Routed(r) => r.main(),
        }
    }

    /// The name of the backend `name` routes to (`default` for a client opened on one URL),
    /// from the routing table alone: nothing is opened.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when no route matches and the table has no default.
    pub fn route_of(&self, name: &str) -> Result<&str> {
        match &self.kind {
            Kind::One(inner) => Ok(inner.calls.backend_label()),
            Kind::Routed(r) => r.routes.backend_for(name),
        }
    }

    /// The backend `name` is routed to: a client on that backend alone (a clone of the client
    /// itself when it is not routed). A backend not yet opened is opened now.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] when no route matches and the table has no default;
    /// [`ErrorKind::Engine`], naming the backend, when it cannot be opened.
    pub async fn backend_for(&self, name: &str) -> Result<Client> {
        let inner = self.on(name).await?;
        Ok(Client {
            kind: Kind::One(inner.clone()),
        })
    }

    /// Every backend, `(name, engine)` in name order, opened or not; one entry, `default`, for
    /// a client opened on one URL.
    pub fn backends(&self) -> Vec<(&str, &'static str)> {
        match &self.kind {
            Kind::One(inner) => vec![(SINGLE_BACKEND, inner.engine.kind())],
            Kind::Routed(r) => r.names().collect(),
        }
    }

    /// The routing table of a routed client.
    pub fn routes(&self) -> Option<&Routes> {
        match &self.kind {
            Kind::One(_) => None,
            Kind::Routed(r) => Some(&r.routes),
        }
    }

    /// The router of a routed client.
    pub(crate) fn router(&self) -> Option<&Arc<Router>> {
        match &self.kind {
            Kind::One(_) => None,
            Kind::Routed(r) => Some(r),
        }
    }

    /// The single-backend client that serves `name`, opened if it was not.
    pub(crate) async fn on(&self, name: &str) -> Result<&Arc<ClientInner>> {
        match &self.kind {
            Kind::One(inner) => Ok(inner),
            Kind::Routed(r) => r.route(name).await,
        }
    }

    /// The engine keys a resource name maps to, labelled (`lock`, `fence`, ...), so that other
    /// tools can take or inspect the same lock. Nothing is opened or contacted.
    pub fn keys_for(&self, name: &str) -> Result<Vec<(&'static str, String)>> {
        validate_name(name)?;
        match &self.kind {
            Kind::One(inner) => Ok(inner.engine.keys(name)),
            Kind::Routed(r) => r.keys(name),
        }
    }

    /// The current holder of `name`, if the lock is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        validate_name(name)?;
        self.on(name).await?.inspect(name).await
    }

    /// Owner-checked release of the grant `owner` holds on `name`, without its [`Lease`]: for
    /// a holder that acquired with a known owner value ([`LockOptions::owner`]) and lost its
    /// lease object, to a restart typically. `Ok(true)` when that owner held the lock and it is
    /// released (waiters are woken), `Ok(false)` when it did not hold it.
    ///
    /// Where the lock lives in the session of the process that took it (PostgreSQL advisory
    /// locks, etcd sessions, ZooKeeper's ephemeral nodes), only that process's client can
    /// release it; another finds nothing to release (`Ok(false)`), and the lock ends with
    /// that session.
    ///
    /// [`Lease`]: crate::Lease
    /// [`LockOptions::owner`]: crate::LockOptions::owner
    pub async fn release_owner(&self, name: &str, owner: &str) -> Result<bool> {
        validate_name(name)?;
        let inner = self.on(name).await?;
        inner
            .release_owner(name, owner)
            .await
            .map_err(|e| inner.calls.named(e))
    }

    /// Waits for background clean-up (releases of cancelled acquisitions and of leases lost
    /// after failed renewals) to finish, on every backend opened. Call it before a process
    /// exits.
    pub async fn close(&self) {
        let opened: Vec<&Arc<ClientInner>> = match &self.kind {
            Kind::One(inner) => vec![inner],
            Kind::Routed(r) => r.opened().collect(),
        };
        for inner in opened {
            inner.cleanup.close();
            inner.cleanup.wait().await;
            inner.cleanup.reopen();
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::One(inner) => f
                .debug_struct("Client")
                .field("engine", &inner.engine.kind())
                .field("url", &inner.calls.url)
                .finish(),
            Kind::Routed(r) => f
                .debug_struct("Client")
                .field("backends", &r.names().collect::<Vec<_>>())
                .field(
                    "opened",
                    &r.opened()
                        .map(|i| i.calls.backend_label())
                        .collect::<Vec<_>>(),
                )
                .finish(),
        }
    }
}

impl ClientInner {
    /// The current holder of `name` on this backend.
    pub(crate) async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        self.calls
            .call(name, self.cfg.op_timeout, self.engine.inspect(name))
            .await
    }

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
