//! The acquire loops: retrying attempts with jittered backoff and wake-ups, or waiting in an
//! engine's own queue, and turning a grant into a [`Lease`] whose validity is counted as the
//! Redlock spec does.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rand::Rng;
use tokio::time::Instant;
use tracing::Instrument;

use crate::core::client::{Client, ClientInner};
use crate::core::engine::{AcquireRequest, Attempt};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::{Holder, HolderMeta};
use crate::core::lease::{Lease, LeaseState};
use crate::core::limits::quota_refused;
use crate::core::name::validate_name;
use crate::core::options::{display_duration, handoff_validity, usable, validity, LockOptions};
use crate::core::token::FencingToken;
use crate::core::wake::WakeRx;

impl Client {
    /// Acquires `name`, waiting up to `opts.wait` while another owner holds it.
    ///
    /// # Errors
    /// [`ErrorKind::TimedOut`] when the wait ran out (the error names the holder),
    /// [`ErrorKind::HeldByAnother`] when `opts.wait` is zero and the lock is held,
    /// [`ErrorKind::InvalidInput`] for an invalid name or options,
    /// [`ErrorKind::LimitExceeded`] when a limit stored in the engine refused the grant (a TTL
    /// above its cap at once; a client holding its quota of leases once the wait ran out), and
    /// [`ErrorKind::Engine`] when the engine failed or did not answer in time.
    ///
    /// # Cancel safety
    /// Dropping the returned future at any point leaves nothing held or queued. An attempt
    /// whose answer had not arrived is released (owner-checked) in the background;
    /// [`Client::close`] waits for that clean-up.
    ///
    /// # Examples
    /// ```no_run
    /// # async fn demo(client: fencelock::Client) -> fencelock::Result<()> {
    /// use std::time::Duration;
    /// let opts = fencelock::LockOptions::default()
    ///     .ttl(Duration::from_secs(30))
    ///     .wait(Duration::from_secs(10));
    /// let lease = client.acquire("nightly-invoices", &opts).await?;
    /// println!("holding with token {}", lease.token());
    /// lease.release().await
    /// # }
    /// ```
    pub async fn acquire(&self, name: &str, opts: &LockOptions) -> Result<Lease> {
        self.acquire_within(name, opts, opts.wait_value(), None)
            .await
    }

    /// One attempt to acquire `name`, whatever `opts.wait` says.
    ///
    /// # Errors
    /// [`ErrorKind::HeldByAnother`], carrying the holder, when the lock is held; otherwise as
    /// [`Client::acquire`].
    ///
    /// # Cancel safety
    /// As [`Client::acquire`]: dropping the future leaves nothing held or queued.
    ///
    /// # Examples
    /// ```no_run
    /// # async fn demo(client: fencelock::Client) -> fencelock::Result<()> {
    /// use fencelock::{ErrorKind, LockOptions};
    /// match client.try_acquire("nightly-invoices", &LockOptions::default()).await {
    ///     Ok(lease) => lease.release().await?,
    ///     Err(e) if e.kind() == ErrorKind::HeldByAnother => {
    ///         println!("held by {}", e.holder().map(ToString::to_string).unwrap_or_default())
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn try_acquire(&self, name: &str, opts: &LockOptions) -> Result<Lease> {
        self.acquire_within(name, opts, Duration::ZERO, None).await
    }

    /// The acquisition behind [`Client::acquire`] and election campaigns (`campaign` is the
    /// campaign's value), with its span and metrics.
    pub(crate) async fn acquire_within(
        &self,
        name: &str,
        opts: &LockOptions,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<Lease> {
        // A routed client hands the acquisition to the name's backend, whose own watchdog
        // then renews the lease; a backend not yet opened is opened first, and one that cannot
        // be fails this call alone.
        let started = Instant::now();
        let this = match self.on(name).await {
            Ok(this) => this,
            Err(e) => {
                if let (Some(router), ErrorKind::Engine) = (self.router(), e.kind()) {
                    let backend = router.routes.backend_for(name).unwrap_or_default();
                    crate::core::metrics::acquire_finished(
                        router.engine_of(backend).unwrap_or("unknown"),
                        &std::sync::Arc::<str>::from(backend).into(),
                        &crate::core::metrics::resource_label(name),
                        started.elapsed(),
                        Err(e.kind()),
                    );
                }
                return Err(e.with_resource(name));
            }
        };
        let span = tracing::debug_span!(
            "acquire",
            resource = name,
            engine = this.engine.kind(),
            backend = this.calls.backend_label(),
            outcome = tracing::field::Empty,
        );
        let result = this
            .acquire_loop(name, opts, wait, campaign)
            .instrument(span.clone())
            .await
            .map_err(|e| this.calls.named(e));
        // A grant's label is its lease's, chosen once for all its series.
        let label = match &result {
            Ok(lease) => lease.metric_label().clone(),
            Err(_) => crate::core::metrics::resource_label(name),
        };
        let outcome = crate::core::metrics::acquire_finished(
            this.engine.kind(),
            &this.calls.backend_metric_label(),
            &label,
            started.elapsed(),
            result.as_ref().map(Lease::ttl).map_err(Error::kind),
        );
        span.record("outcome", outcome);
        result
    }
}

impl ClientInner {
    async fn acquire_loop(
        self: &Arc<Self>,
        name: &str,
        opts: &LockOptions,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<Lease> {
        validate_name(name)?;
        let inner = self;
        opts.validate(inner.cfg.max_ttl)?;
        let engine = inner.engine.kind();
        let ttl = opts.ttl_value();
        let (min_backoff, max_backoff) = opts.backoff_bounds();
        // A queue the engine waits in is FIFO whatever the options say.
        if opts.fair_value() && inner.fair.is_none() && inner.queue.is_none() {
            return Err(Error::invalid(format!(
                "fair (FIFO) mode needs an engine with a waiter queue; {engine} grants the \
                 lock to whichever waiter retries first"
            ))
            .with_resource(name)
            .with_engine(engine));
        }
        let req = AcquireRequest {
            name: name.to_owned(),
            owner: opts
                .owner_value()
                .map_or_else(|| format!("{:032x}", rand::random::<u128>()), str::to_owned),
            ttl,
            // Engines without elections of their own keep the campaign value with the holder,
            // as its client name (see `election`).
            meta: match campaign {
                Some(value) => HolderMeta {
                    client: value.to_owned(),
                    ..inner.meta.clone()
                },
                None => match opts.client_name_value() {
                    Some(client) => HolderMeta {
                        client: client.to_owned(),
                        ..inner.meta.clone()
                    },
                    None => inner.meta.clone(),
                },
            },
            waits: !wait.is_zero(),
        };
        let mut pending = Pending {
            client: inner.clone(),
            name: req.name.clone(),
            owner: req.owner.clone(),
            armed: false,
        };
        if inner.queue.is_some() {
            return self
                .acquire_in_queue(&req, &mut pending, wait, opts, campaign)
                .await;
        }
        let fair = match &inner.fair {
            Some(queue) if opts.fair_value() => Some((
                queue,
                max_backoff
                    .saturating_mul(4)
                    .saturating_add(inner.cfg.op_timeout),
                SystemTime::now(),
            )),
            _ => None,
        };
        let deadline = deadline_after(wait);
        let call_timeout = inner.cfg.op_timeout.min(ttl);
        let mut backoff = min_backoff;
        // The last wake-up subscription, kept until the next attempt's own is made: the
        // waiter's place among the client's waiters (see `core::wake`) lasts the acquisition.
        let mut place: Option<Box<WakeRx>> = None;
        loop {
            let started = Instant::now();
            pending.armed = true;
            let outcome = match fair {
                Some((queue, window, since)) => {
                    inner
                        .calls
                        .call(
                            name,
                            call_timeout,
                            queue.try_acquire_fair(&req, window, since),
                        )
                        .await
                }
                None => {
                    inner
                        .calls
                        .call(name, call_timeout, inner.engine.try_acquire(&req))
                        .await
                }
            };
            let (last, hint, wake) = match outcome {
                Ok(Attempt::Granted(token)) => {
                    let elapsed = started.elapsed();
                    match validity(ttl, elapsed).filter(|v| usable(ttl, *v)) {
                        Some(v) => {
                            pending.armed = false;
                            if let Some(p) = place.take() {
                                (*p).settle();
                            }
                            return Ok(inner.grant(&req, token, started + v, opts));
                        }
                        None => {
                            pending.release_now().await;
                            (Err(no_validity(engine, name, elapsed, ttl)), None, None)
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
                    pending.armed = fair.is_some();
                    (Ok(holder), retry_in, wake)
                }
                // The client holds its quota already: waiting helps once one of its leases
                // is released or expires, so a waiter retries as for a held lock.
                Ok(Attempt::OverQuota { max, retry_in }) => {
                    pending.armed = fair.is_some();
                    let refused = quota_refused(max, &inner.cfg.holder_id)
                        .with_resource(name)
                        .with_engine(engine);
                    (Err(refused), retry_in, None)
                }
                Err(e) if e.kind() == ErrorKind::Engine => (Err(e), None, None),
                Err(e) => {
                    pending.release_now().await;
                    return Err(e);
                }
            };
            let now = Instant::now();
            if now >= deadline {
                // After a refusal the release is one quick call. After an engine failure the
                // engine may not answer it either: `pending` releases in the background when
                // dropped, so the caller hears of the failure within its wait plus the one
                // attempt under way, not one more operation timeout later.
                if pending.armed && last.is_ok() {
                    pending.release_now().await;
                }
                return Err(match last {
                    Ok(holder) => self.refusal(name, wait, holder).await,
                    Err(e) => e,
                });
            }
            if fair.is_some() || (wake.is_some() && hint.is_some()) {
                // A queued waiter is woken (or handed the lock) by the release; its own
                // retries only keep its queue entry alive and cover a lost wake-up, so early
                // short pauses would only add server calls that the releases have to queue
                // behind. The same holds for a barging waiter refused by a holder on every
                // node it asked (the engine then gives the holder's time left as the hint):
                // the release announces itself to it, as Redisson's waiters wait for the
                // release message rather than poll. After a split vote (no hint) a release
                // may announce itself on too few nodes, so such a waiter keeps its backoff.
                backoff = max_backoff;
            }
            let mut pause = jitter(backoff).min(deadline - now);
            if let Some(hint) = hint {
                pause = pause.min(hint.max(Duration::from_millis(1)));
            }
            backoff = backoff.saturating_mul(2).min(max_backoff);
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
                    if let (Some(token), Some((_, window, _))) = (handed, fair) {
                        let v = handoff_validity(ttl, window, started.elapsed());
                        if let Some(v) = v.filter(|v| opts.auto_renew_value() && usable(ttl, *v)) {
                            pending.armed = false;
                            (*wake).settle();
                            if let Some(p) = place.take() {
                                (*p).settle();
                            }
                            return Ok(inner.grant(&req, token, started + v, opts));
                        }
                    }
                    place = Some(wake);
                }
                None => tokio::time::sleep(pause).await,
            }
        }
    }

    /// The acquisition loop of an engine that queues waiters itself (etcd): one call that
    /// enqueues and waits for the head of the queue. `pending` stays armed throughout, so a
    /// dropped future, a timeout or an error removes the queue entry.
    async fn acquire_in_queue(
        self: &Arc<Self>,
        req: &AcquireRequest,
        pending: &mut Pending,
        wait: Duration,
        opts: &LockOptions,
        campaign: Option<&str>,
    ) -> Result<Lease> {
        let inner = self;
        let Some(queue) = &inner.queue else {
            return Err(Error::invalid("this engine keeps no waiter queue"));
        };
        let (name, ttl, engine) = (req.name.as_str(), req.ttl, inner.engine.kind());
        let deadline = deadline_after(wait);
        let (mut backoff, max_backoff) = opts.backoff_bounds();
        loop {
            pending.armed = true;
            let left = deadline.saturating_duration_since(Instant::now());
            // The engine bounds each of its own calls; this bounds the whole wait plus the
            // calls around it (enqueue, confirm).
            let limit = left.saturating_add(inner.cfg.op_timeout.saturating_mul(3));
            let outcome = inner
                .calls
                .call(name, limit, queue.acquire_queued(req, left, campaign))
                .await;
            let failed = match outcome {
                Ok((Attempt::Granted(token), since)) => {
                    let elapsed = since.elapsed();
                    if let Some(v) = validity(ttl, elapsed).filter(|v| usable(ttl, *v)) {
                        pending.armed = false;
                        return Ok(inner.grant(req, token, since + v, opts));
                    }
                    no_validity(engine, name, elapsed, ttl)
                }
                Ok((Attempt::Held { holder, .. }, _)) => {
                    pending.release_now().await;
                    return Err(self.refusal(name, wait, holder).await);
                }
                Ok((Attempt::OverQuota { max, retry_in }, _)) => {
                    pending.release_now().await;
                    let refused = quota_refused(max, &inner.cfg.holder_id)
                        .with_resource(name)
                        .with_engine(engine);
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(refused);
                    }
                    let pause = retry_in.unwrap_or(max_backoff).min(max_backoff);
                    tokio::time::sleep(jitter(pause.max(Duration::from_millis(2))).min(left)).await;
                    continue;
                }
                Err(e) => e,
            };
            pending.release_now().await;
            // An engine failure (no leader for a moment, a member going down) or a grant too
            // slow to be of use leaves the queue and joins it again at the back, while the wait
            // lasts, as the retrying loop does.
            if failed.kind() != ErrorKind::Engine || Instant::now() >= deadline {
                return Err(failed);
            }
            tracing::debug!(error = %failed, "queued acquisition failed; retrying");
            let left = deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(jitter(backoff).min(left)).await;
            backoff = backoff.saturating_mul(2).min(max_backoff);
        }
    }
}

impl ClientInner {
    /// The error of an acquisition the lock stayed held through: held (one attempt) or timed
    /// out, naming the holder. An engine whose refusal cannot name the holder in the same step
    /// (PostgreSQL advisory locks) has it looked up once here, at the end, rather than on every
    /// refused attempt.
    async fn refusal(&self, name: &str, wait: Duration, holder: Option<Holder>) -> Error {
        let holder = match holder {
            Some(h) => Some(h),
            None => self.inspect(name).await.ok().flatten(),
        };
        let engine = self.engine.kind();
        if wait.is_zero() {
            Error::held(name, engine, holder)
        } else {
            Error::timed_out(name, engine, wait, holder)
        }
    }

    /// The lease for a grant of `req` with `token`, valid until `deadline`, registered with
    /// the watchdog.
    fn grant(
        self: &Arc<Self>,
        req: &AcquireRequest,
        token: FencingToken,
        deadline: Instant,
        opts: &LockOptions,
    ) -> Lease {
        let state = Arc::new(LeaseState::new(
            self.next_id.fetch_add(1, Ordering::Relaxed),
            req.name.clone(),
            req.owner.clone(),
            token,
            req.ttl,
            deadline,
            &self.calls,
        ));
        self.watchdog
            .register(state.clone(), opts.auto_renew_value());
        Lease::new(state, self.clone())
    }
}

/// The end of a wait of `wait` from now. A wait too long for the clock to represent (years
/// on end) waits as good as forever instead of overflowing.
fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// A pause of between half of `backoff` and all of it, so that waiters woken together do not
/// retry together.
fn jitter(backoff: Duration) -> Duration {
    rand::thread_rng().gen_range(backoff / 2..=backoff)
}

fn no_validity(engine: &'static str, name: &str, elapsed: Duration, ttl: Duration) -> Error {
    Error::engine_failure(
        engine,
        format!(
            "the grant took {} of a {} TTL, leaving no useful validity; use a longer TTL",
            display_duration(elapsed),
            display_duration(ttl)
        ),
    )
    .with_resource(name)
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
        let _ = self.client.release_owner(&self.name, &self.owner).await;
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
                let _ = client.release_owner(&name, &owner).await;
            },
            &handle,
        );
    }
}
