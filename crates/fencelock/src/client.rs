//! The client: built from a backend URL, it acquires leases and runs their watchdog.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::backend::{self, Backend};
use crate::engine::{AcquireRequest, Attempt, Engine, EngineConfig, Renewal, Renewed};
use crate::error::{Error, ErrorKind, Result};
use crate::holder::{Holder, HolderMeta};
use crate::lease::{Lease, LeaseState};
use crate::metrics::Loss;
use crate::name::validate_name;
use crate::options::{display_duration, handoff_validity, usable, validity, LockOptions};
use crate::watchdog::Watchdog;

/// The key prefix used when none is configured. Every key fencelock writes starts with it.
pub const DEFAULT_PREFIX: &str = "fencelock:v1:";

/// A handle on one lock engine. Cheap to clone; clones share one connection set and one
/// renewal task.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

pub(crate) struct ClientInner {
    pub(crate) engine: Arc<dyn Engine>,
    pub(crate) watchdog: Watchdog,
    pub(crate) meta: HolderMeta,
    max_ttl: Duration,
    pub(crate) op_timeout: Duration,
    cleanup: TaskTracker,
    next_id: AtomicU64,
    url: String,
}

/// Builds a [`Client`]: the backend URL plus optional settings.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    url: String,
    prefix: String,
    client_name: String,
    max_ttl: Duration,
    op_timeout: Duration,
}

impl ClientBuilder {
    /// The key prefix (namespace). Default `fencelock:v1:`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> ClientBuilder {
        self.prefix = prefix.into();
        self
    }

    /// The client name recorded with every lease, shown by `inspect`. Default `fencelock`.
    pub fn client_name(mut self, name: impl Into<String>) -> ClientBuilder {
        self.client_name = name.into();
        self
    }

    /// The longest TTL this client accepts. Default one day.
    pub fn max_ttl(mut self, max: Duration) -> ClientBuilder {
        self.max_ttl = max;
        self
    }

    /// The deadline of every single engine call. Default 5 s.
    pub fn op_timeout(mut self, timeout: Duration) -> ClientBuilder {
        self.op_timeout = timeout;
        self
    }

    /// Parses the URL, opens the engine and starts the renewal task. Must be called inside a
    /// tokio runtime.
    pub async fn connect(self) -> Result<Client> {
        if self.prefix.len() > 64 || self.prefix.chars().any(char::is_control) {
            return Err(Error::invalid(
                "the key prefix must be at most 64 bytes without control characters",
            ));
        }
        if self.op_timeout.is_zero() {
            return Err(Error::invalid("the operation timeout must be positive"));
        }
        let backend = backend::parse(&self.url)?;
        let cfg = EngineConfig {
            prefix: self.prefix,
            op_timeout: self.op_timeout,
            max_ttl: self.max_ttl,
        };
        let engine = open_engine(backend, &cfg).await?;
        let cleanup = TaskTracker::new();
        let watchdog = Watchdog::start(engine.clone(), self.op_timeout, cleanup.clone());
        Ok(Client {
            inner: Arc::new(ClientInner {
                engine,
                watchdog,
                meta: HolderMeta::current(self.client_name),
                max_ttl: self.max_ttl,
                op_timeout: self.op_timeout,
                cleanup,
                next_id: AtomicU64::new(1),
                url: backend::redact_url(&self.url),
            }),
        })
    }
}

async fn open_engine(backend: Backend, cfg: &EngineConfig) -> Result<Arc<dyn Engine>> {
    // Unused when the build has no engine that needs it.
    let _ = cfg;
    match backend {
        #[cfg(feature = "sqlite")]
        Backend::Sqlite { path } => Ok(Arc::new(
            crate::sqlite::SqliteEngine::open(path, cfg).await?,
        )),
        #[cfg(not(feature = "sqlite"))]
        Backend::Sqlite { .. } => Err(left_out("sqlite")),
        #[cfg(feature = "redis")]
        Backend::Redis { .. } => crate::redis::open(backend, cfg).await,
        #[cfg(not(feature = "redis"))]
        Backend::Redis { .. } => Err(left_out("redis")),
        #[cfg(feature = "postgres")]
        Backend::Postgres { .. } => crate::postgres::open(backend, cfg).await,
        #[cfg(not(feature = "postgres"))]
        Backend::Postgres { .. } => Err(left_out("postgres")),
        #[cfg(feature = "etcd")]
        Backend::Etcd { .. } => crate::etcd::open(backend, cfg).await,
        #[cfg(not(feature = "etcd"))]
        Backend::Etcd { .. } => Err(left_out("etcd")),
    }
}

/// The error for a URL whose engine this build was compiled without.
#[cfg_attr(
    all(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "etcd"
    ),
    allow(dead_code)
)]
fn left_out(feature: &str) -> Error {
    Error::invalid(format!(
        "this build of fencelock lacks the `{feature}` feature"
    ))
}

impl Client {
    /// Starts building a client for a backend URL (`sqlite:///path.db`, `redis://host:port`,
    /// `redlock://h1:p1,h2:p2,h3:p3`, `postgres://user@host/db`, ...).
    pub fn builder(url: impl Into<String>) -> ClientBuilder {
        ClientBuilder {
            url: url.into(),
            prefix: DEFAULT_PREFIX.to_owned(),
            client_name: "fencelock".to_owned(),
            max_ttl: Duration::from_secs(24 * 3600),
            op_timeout: Duration::from_secs(5),
        }
    }

    /// A client with default settings for `url`.
    pub async fn connect(url: &str) -> Result<Client> {
        Client::builder(url).connect().await
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres`, `postgres-lease`.
    pub fn engine(&self) -> &'static str {
        self.inner.engine.kind()
    }

    /// The backend URL, password redacted.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    /// The engine keys a resource name maps to, labelled (`lock`, `fence`, ...), so that other
    /// tools can take or inspect the same lock.
    pub fn keys_for(&self, name: &str) -> Result<Vec<(&'static str, String)>> {
        validate_name(name)?;
        Ok(self.inner.engine.keys(name))
    }

    /// Acquires `name`, waiting up to `opts.wait` while another owner holds it.
    ///
    /// Cancel safety: dropping the returned future at any point leaves nothing held. An
    /// attempt whose answer had not arrived is released (owner-checked) in the background;
    /// [`Client::close`] waits for that clean-up.
    pub async fn acquire(&self, name: &str, opts: &LockOptions) -> Result<Lease> {
        self.acquire_within(name, opts, opts.wait_value(), None)
            .await
    }

    /// One attempt to acquire `name`, whatever `opts.wait` says. Fails with
    /// [`ErrorKind::HeldByAnother`], carrying the holder, when the lock is held. Cancel safe as
    /// [`Client::acquire`].
    pub async fn try_acquire(&self, name: &str, opts: &LockOptions) -> Result<Lease> {
        self.acquire_within(name, opts, Duration::ZERO, None).await
    }

    /// The current holder of `name`, if the lock is held.
    pub async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        validate_name(name)?;
        self.call(name, self.inner.engine.inspect(name)).await
    }

    /// Waits for background clean-up (releases of cancelled acquisitions and of leases lost
    /// after failed renewals) to finish. Call it before a process exits.
    pub async fn close(&self) {
        self.inner.cleanup.close();
        self.inner.cleanup.wait().await;
        self.inner.cleanup.reopen();
    }

    async fn call<T>(
        &self,
        name: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        self.inner.call(name, self.inner.op_timeout, fut).await
    }

    pub(crate) async fn acquire_within(
        &self,
        name: &str,
        opts: &LockOptions,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<Lease> {
        let span = tracing::debug_span!(
            "acquire",
            resource = name,
            engine = self.engine(),
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        let result = self
            .acquire_loop(name, opts, wait, campaign)
            .instrument(span.clone())
            .await;
        let outcome = crate::metrics::acquire_finished(
            self.engine(),
            name,
            started.elapsed(),
            result.as_ref().map(Lease::ttl).map_err(Error::kind),
        );
        span.record("outcome", outcome);
        result
    }

    async fn acquire_loop(
        &self,
        name: &str,
        opts: &LockOptions,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<Lease> {
        validate_name(name)?;
        opts.validate(self.inner.max_ttl)?;
        let inner = &self.inner;
        let engine = inner.engine.kind();
        let ttl = opts.ttl_value();
        let (min_backoff, max_backoff) = opts.backoff_bounds();
        let req = AcquireRequest {
            name: name.to_owned(),
            owner: format!("{:032x}", rand::random::<u128>()),
            ttl,
            // Engines without elections of their own keep the campaign value with the holder,
            // as its client name (see `election`).
            meta: match campaign {
                Some(value) => HolderMeta {
                    client: value.to_owned(),
                    ..inner.meta.clone()
                },
                None => inner.meta.clone(),
            },
            campaign: campaign.map(str::to_owned),
            fair: opts
                .fair_value()
                .then(|| max_backoff * 4 + inner.op_timeout),
            since: std::time::SystemTime::now(),
        };
        let mut pending = Pending {
            client: inner.clone(),
            name: req.name.clone(),
            owner: req.owner.clone(),
            armed: false,
        };
        if inner.engine.queues_waiters() {
            return self.acquire_in_queue(&req, &mut pending, wait, opts).await;
        }
        let deadline = Instant::now() + wait;
        let call_timeout = inner.op_timeout.min(ttl);
        let mut backoff = min_backoff;
        loop {
            let started = Instant::now();
            pending.armed = true;
            let outcome = inner
                .call(name, call_timeout, inner.engine.try_acquire(&req))
                .await;
            let grant = |token, v: Duration| {
                let state = Arc::new(LeaseState::new(
                    inner.next_id.fetch_add(1, Ordering::Relaxed),
                    name.to_owned(),
                    req.owner.clone(),
                    token,
                    ttl,
                    started + v,
                    engine,
                ));
                inner
                    .watchdog
                    .register(state.clone(), opts.auto_renew_value());
                Lease::new(state, inner.clone())
            };
            let (last, hint, wake) = match outcome {
                Ok(Attempt::Granted(token)) => {
                    let elapsed = started.elapsed();
                    match validity(ttl, elapsed).filter(|v| usable(ttl, *v)) {
                        Some(v) => {
                            pending.armed = false;
                            return Ok(grant(token, v));
                        }
                        None => {
                            pending.release_now().await;
                            let e = Error::engine_failure(
                                engine,
                                format!(
                                    "the grant took {} of a {} TTL, leaving no useful validity; \
                                     use a longer TTL",
                                    display_duration(elapsed),
                                    display_duration(ttl)
                                ),
                            )
                            .with_resource(name);
                            (Err(e), None, None)
                        }
                    }
                }
                Ok(Attempt::Held {
                    holder,
                    retry_in,
                    wake,
                }) => {
                    // A fair-mode refusal queued this owner as a waiter: abandoning the
                    // acquisition must still remove that entry.
                    pending.armed = req.fair.is_some();
                    (Ok(holder), retry_in, wake)
                }
                Err(e) if e.kind() == ErrorKind::Engine => (Err(e), None, None),
                Err(e) => {
                    pending.release_now().await;
                    return Err(e);
                }
            };
            let now = Instant::now();
            if now >= deadline {
                if pending.armed {
                    pending.release_now().await;
                }
                return Err(match last {
                    Ok(holder) if wait.is_zero() => Error::held(name, engine, holder),
                    Ok(holder) => Error::timed_out(name, engine, wait, holder),
                    Err(e) => e,
                });
            }
            if req.fair.is_some() {
                // A queued waiter is woken (or handed the lock) by the release; its own
                // retries only keep its queue entry alive and cover a lost wake-up, so early
                // short pauses would only add server calls that the releases have to queue
                // behind.
                backoff = max_backoff;
            }
            let jittered = rand::thread_rng().gen_range(backoff / 2..=backoff);
            let mut pause = jittered.min(deadline - now);
            if let Some(hint) = hint {
                pause = pause.min(hint.max(Duration::from_millis(1)));
            }
            backoff = (backoff * 2).min(max_backoff);
            match wake {
                // A release announcement ends the pause early; the retry then races the
                // other woken waiters (or, in fair mode, only the head of the queue can win).
                Some(mut wake) => {
                    let mine = wake.concerning(&req.owner);
                    let handed = tokio::time::timeout(pause, mine)
                        .await
                        .ok()
                        .flatten()
                        .flatten();
                    // A release handed the lock to this waiter. Its expiry on the engine started
                    // after this attempt was answered (the release found the queue entry it
                    // made), so validity counts from the attempt's start; the entry's time
                    // left may cut it, and the watchdog then renews to the full TTL early. A
                    // lease that will not renew itself takes the grant by retrying instead,
                    // which resets the expiry to the full TTL.
                    if let (Some(token), Some(window)) = (handed, req.fair) {
                        let v = handoff_validity(ttl, window, started.elapsed());
                        if let Some(v) = v.filter(|v| opts.auto_renew_value() && usable(ttl, *v)) {
                            pending.armed = false;
                            return Ok(grant(token, v));
                        }
                        continue;
                    }
                }
                None => tokio::time::sleep(pause).await,
            }
        }
    }
}

impl Client {
    /// The acquisition loop of an engine that queues waiters itself (etcd): one call that
    /// enqueues and waits for the head of the queue. `pending` stays armed throughout, so a
    /// dropped future, a timeout or an error removes the queue entry.
    async fn acquire_in_queue(
        &self,
        req: &AcquireRequest,
        pending: &mut Pending,
        wait: Duration,
        opts: &LockOptions,
    ) -> Result<Lease> {
        let inner = &self.inner;
        let (name, ttl, engine) = (req.name.as_str(), req.ttl, inner.engine.kind());
        let deadline = Instant::now() + wait;
        let (mut backoff, max_backoff) = opts.backoff_bounds();
        let (token, since) = loop {
            pending.armed = true;
            let left = deadline.saturating_duration_since(Instant::now());
            // The engine bounds each of its own calls; this bounds the whole wait plus the
            // calls around it (enqueue, confirm).
            let limit = left + inner.op_timeout * 3;
            let outcome = inner
                .call(name, limit, inner.engine.acquire_queued(req, left))
                .await;
            match outcome {
                Ok((Attempt::Granted(token), since)) => break (token, since),
                Ok((Attempt::Held { holder, .. }, _)) => {
                    pending.release_now().await;
                    return Err(if wait.is_zero() {
                        Error::held(name, engine, holder)
                    } else {
                        Error::timed_out(name, engine, wait, holder)
                    });
                }
                // An engine failure (no leader for a moment, a member going down) leaves the
                // queue and joins it again at the back, while the wait lasts.
                Err(e) if e.kind() == ErrorKind::Engine && Instant::now() < deadline => {
                    pending.release_now().await;
                    tracing::debug!(error = %e, "queued acquisition failed; retrying");
                    let pause = rand::thread_rng().gen_range(backoff / 2..=backoff);
                    tokio::time::sleep(
                        pause.min(deadline.saturating_duration_since(Instant::now())),
                    )
                    .await;
                    backoff = (backoff * 2).min(max_backoff);
                }
                Err(e) => {
                    pending.release_now().await;
                    return Err(e);
                }
            }
        };
        let elapsed = since.elapsed();
        let Some(v) = validity(ttl, elapsed).filter(|v| usable(ttl, *v)) else {
            pending.release_now().await;
            return Err(Error::engine_failure(
                engine,
                format!(
                    "the grant took {} of a {} TTL, leaving no useful validity; use a longer TTL",
                    display_duration(elapsed),
                    display_duration(ttl)
                ),
            )
            .with_resource(name));
        };
        pending.armed = false;
        let state = Arc::new(LeaseState::new(
            inner.next_id.fetch_add(1, Ordering::Relaxed),
            name.to_owned(),
            req.owner.clone(),
            token,
            ttl,
            since + v,
            engine,
        ));
        inner
            .watchdog
            .register(state.clone(), opts.auto_renew_value());
        Ok(Lease::new(state, inner.clone()))
    }
}

impl ClientInner {
    /// Every engine call goes through here: bounded by a deadline, named in errors, traced.
    pub(crate) async fn call<T>(
        &self,
        name: &str,
        limit: Duration,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let engine = self.engine.kind();
        let span = engine_span(engine, name);
        let answer = tokio::time::timeout(limit, fut)
            .instrument(span.clone())
            .await;
        record_outcome(&span, answer.as_ref().map(|r| r.as_ref().map(|_| ())));
        match answer {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(if e.resource().is_none() {
                e.with_resource(name)
            } else {
                e
            }),
            Err(_) => Err(Error::engine_failure(
                engine,
                format!(
                    "no answer from {} within {}; check that the engine is up and reachable",
                    self.url,
                    display_duration(limit)
                ),
            )
            .with_resource(name)),
        }
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
        let limit = self.op_timeout.min(lease.ttl);
        let answer = self
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
            Some(Renewed::Extended) => {
                lease.mark_lost(
                    Loss::Expired,
                    "its validity ended before the extension was confirmed".into(),
                );
                Err(lease.lost_error(self.engine.kind()))
            }
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

    pub(crate) async fn release_state(&self, lease: &LeaseState) -> Result<()> {
        let limit = self.op_timeout;
        let released = self
            .call(
                &lease.resource,
                limit,
                self.engine.release(&lease.resource, &lease.owner),
            )
            .await?;
        if released {
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

/// The span around one engine call, named after its resource (or batch) and engine; its
/// `outcome` and `error` are recorded when the call ends.
pub(crate) fn engine_span(engine: &'static str, resource: &str) -> tracing::Span {
    tracing::debug_span!(
        "engine_call",
        engine,
        resource,
        outcome = tracing::field::Empty,
        error = tracing::field::Empty,
    )
}

/// Records `ok`, `error` (with the message) or `timeout` on an engine call's span.
pub(crate) fn record_outcome(
    span: &tracing::Span,
    answer: std::result::Result<std::result::Result<(), &Error>, &tokio::time::error::Elapsed>,
) {
    match answer {
        Ok(Ok(())) => {
            span.record("outcome", "ok");
        }
        Ok(Err(e)) => {
            span.record("outcome", "error");
            span.record("error", tracing::field::display(e));
        }
        Err(_) => {
            span.record("outcome", "timeout");
        }
    }
}

impl Drop for ClientInner {
    fn drop(&mut self) {
        tracing::trace!(url = %self.url, "client dropped");
    }
}

/// An attempt whose outcome is unknown to the caller (sent, answer not yet read). If the
/// acquisition is abandoned in that state, the owner is released so no lock is left behind.
struct Pending {
    client: Arc<ClientInner>,
    name: String,
    owner: String,
    armed: bool,
}

impl Pending {
    async fn release_now(&mut self) {
        let c = &self.client;
        let _ = c
            .call(
                &self.name,
                c.op_timeout,
                c.engine.release(&self.name, &self.owner),
            )
            .await;
        self.armed = false;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        let name = std::mem::take(&mut self.name);
        let owner = std::mem::take(&mut self.owner);
        self.client.cleanup.spawn_on(
            async move {
                let _ = client
                    .call(
                        &name,
                        client.op_timeout,
                        client.engine.release(&name, &owner),
                    )
                    .await;
            },
            &handle,
        );
    }
}
