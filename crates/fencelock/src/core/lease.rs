//! The lease a client holds, its lost signal and `run`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::core::call::Calls;
use crate::core::client::ClientInner;
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::metrics::{self, Loss};
use crate::core::token::FencingToken;

/// State shared between a [`Lease`] and the client's watchdog.
pub(crate) struct LeaseState {
    pub id: u64,
    pub resource: String,
    pub owner: String,
    pub token: FencingToken,
    pub ttl: Duration,
    pub engine: &'static str,
    /// The `backend` label of its metrics.
    pub backend: metrics::Label,
    /// The resource's metrics label, chosen once so that a lease's series never change.
    pub label: metrics::Label,
    deadline: Mutex<Instant>,
    lost: CancellationToken,
    lost_reason: OnceLock<String>,
    granted: Instant,
    hold_recorded: AtomicBool,
}

impl LeaseState {
    pub(crate) fn new(
        id: u64,
        resource: String,
        owner: String,
        token: FencingToken,
        ttl: Duration,
        deadline: Instant,
        calls: &Calls,
    ) -> LeaseState {
        LeaseState {
            id,
            label: metrics::resource_label(&resource),
            resource,
            owner,
            token,
            ttl,
            engine: calls.engine,
            backend: calls.backend_metric_label(),
            deadline: Mutex::new(deadline),
            lost: CancellationToken::new(),
            lost_reason: OnceLock::new(),
            granted: Instant::now(),
            hold_recorded: AtomicBool::new(false),
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_deadline(&self, d: Instant) {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner()) = d;
    }

    pub(crate) fn mark_lost(&self, loss: Loss, reason: String) {
        if self.lost_reason.set(reason).is_ok() {
            // The window ends here even when its deadline is still ahead (the watchdog gives
            // up early, and releases the lock at once), so that what the lease reports as its
            // validity never outlasts the loss that others may already be acting on.
            let now = Instant::now();
            let mut deadline = self.deadline.lock().unwrap_or_else(|p| p.into_inner());
            if *deadline > now {
                *deadline = now;
            }
            drop(deadline);
            tracing::warn!(
                resource = %self.resource,
                token = %self.token,
                reason = %self.lost_reason.get().map(String::as_str).unwrap_or(""),
                "lease lost"
            );
            metrics::lease_lost(self.engine, &self.backend, &self.label, loss);
            self.end_hold();
        }
        self.lost.cancel();
    }

    /// Records the hold duration, once: the hold ends at the first of loss, release or drop.
    pub(crate) fn end_hold(&self) {
        if !self.hold_recorded.swap(true, Ordering::Relaxed) {
            metrics::hold_ended(
                self.engine,
                &self.backend,
                &self.label,
                self.granted.elapsed(),
            );
        }
    }

    /// Records one renewal attempt; `extended` when it pushed the validity window out.
    pub(crate) fn renewal_attempted(&self, extended: bool) {
        metrics::renewal(self.engine, &self.backend, &self.label, extended);
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled() || Instant::now() >= self.deadline()
    }

    pub(crate) fn lost_error(&self, engine: &'static str) -> Error {
        let reason = self
            .lost_reason
            .get()
            .map(String::as_str)
            .unwrap_or("its validity ended without a confirmed renewal");
        Error::new(
            ErrorKind::LeaseLost,
            format!(
                "lease with token {} lost: {reason}; stop work done under it",
                self.token
            ),
        )
        .with_resource(&self.resource)
        .with_engine(engine)
    }
}

/// Ownership of a named resource for a while, with a fencing token.
///
/// While auto-renewal is on (the default) the client's watchdog extends the lease every TTL/3.
/// Two failed renewals in a row, an engine that no longer lists this owner, or the validity
/// deadline passing without a confirmed renewal mark the lease lost: [`Lease::lost`] completes
/// and [`Lease::run`] cancels its work, never later than the end of the validity window.
///
/// Release it with [`Lease::release`]. Dropping a lease without releasing it stops its renewals
/// and lets it expire on the engine after its TTL; on etcd, whose keys live as long as the
/// client's session, the client deletes its key at once instead (in the background, which
/// [`Client::close`](crate::Client::close) waits for).
#[must_use = "dropping a Lease stops its renewals; hold it while you work and release it when done"]
pub struct Lease {
    state: Arc<LeaseState>,
    client: Arc<ClientInner>,
    released: bool,
}

impl Lease {
    pub(crate) fn new(state: Arc<LeaseState>, client: Arc<ClientInner>) -> Lease {
        Lease {
            state,
            client,
            released: false,
        }
    }

    /// The client (one backend) that holds this lease and renews it.
    pub(crate) fn client(&self) -> &Arc<ClientInner> {
        &self.client
    }

    /// The resource name this lease is for.
    pub fn resource(&self) -> &str {
        &self.state.resource
    }

    /// The random 128-bit owner value (hex) that identifies this holder to the engine.
    pub fn owner(&self) -> &str {
        &self.state.owner
    }

    /// The fencing token: greater than every earlier grant's token for this resource. Send it
    /// with every write to the protected resource.
    pub fn token(&self) -> FencingToken {
        self.state.token
    }

    /// The resource's metrics label (see [`LeaseState::label`]).
    pub(crate) fn metric_label(&self) -> &metrics::Label {
        &self.state.label
    }

    /// The TTL the lease was granted (and is renewed) with.
    pub fn ttl(&self) -> Duration {
        self.state.ttl
    }

    /// End of the validity window on the local monotonic clock, as of the last confirmed grant
    /// or renewal; once the lease is lost, the moment it was declared lost, if that was earlier.
    pub fn valid_until(&self) -> Instant {
        self.state.deadline()
    }

    /// Time left in the validity window (zero once it has ended).
    pub fn time_left(&self) -> Duration {
        self.state
            .deadline()
            .saturating_duration_since(Instant::now())
    }

    /// Whether the lease is lost or its validity window has ended.
    pub fn is_lost(&self) -> bool {
        self.state.is_lost()
    }

    /// Completes when the lease is lost. Cancel safe: dropping it changes nothing.
    pub async fn lost(&self) {
        self.state.lost.cancelled().await;
    }

    /// A handle that outlives borrows of the lease, for tasks that must stop when it is lost.
    pub fn lost_signal(&self) -> LostSignal {
        LostSignal {
            token: self.state.lost.clone(),
        }
    }

    /// Runs `work` until it finishes or the lease is lost, whichever comes first. On loss the
    /// work future is dropped (cancelled) and [`ErrorKind::LeaseLost`] is returned.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output> {
        tokio::select! {
            biased;
            _ = self.state.lost.cancelled() => Err(self.state.lost_error(self.client.engine.kind())),
            out = work => Ok(out),
        }
    }

    /// Owner-checked extension by the lease's TTL, now. The watchdog does this on its own
    /// when auto-renewal is on. Fails with [`ErrorKind::LeaseLost`] when the engine no longer
    /// lists this owner.
    pub async fn extend(&self) -> Result<()> {
        self.client.extend_now(&self.state).await
    }

    /// Stops renewing the lease and leaves it held on the engine, neither released nor renewed,
    /// as a holder that crashed leaves its lock: the engine lets it expire at the end of its
    /// TTL. Unlike a dropped lease, it is not released even where the engine would keep a
    /// dropped lease's key alive (etcd). For a holder that must not free the lock before the
    /// work it handed out can have stopped, and cannot tell that work to stop first.
    ///
    /// Where [`Lease::ends_with_process`] is true the lock still ends with this process:
    /// such a holder keeps its process up until [`Lease::valid_until`].
    pub fn leave(mut self) {
        self.client.watchdog.unregister(self.state.id);
        // Not released on drop: nothing here frees the lock before its TTL has run out.
        self.released = true;
    }

    /// Whether the engine ends this lease when this process exits, rather than keeping it
    /// held to the end of its TTL: its lock lives in this client's database or coordination
    /// session (PostgreSQL advisory locks, ZooKeeper's ephemeral nodes).
    pub fn ends_with_process(&self) -> bool {
        self.client.ends_with_process
    }

    /// Owner-checked release: deletes the lock only if this owner still holds it, and wakes
    /// waiters. Returns [`ErrorKind::NotHolder`] when the lease had already expired or been
    /// taken, so the caller learns its work may have overlapped another holder's.
    pub async fn release(mut self) -> Result<()> {
        self.client.watchdog.unregister(self.state.id);
        let released = self.client.release_state(&self.state).await;
        // Answered either way: a release that failed is not sent again on drop.
        self.released = true;
        released
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.client.watchdog.unregister(self.state.id);
        // `release` consumes the lease, so this also marks the end of a released hold.
        self.state.end_hold();
        if !self.released && self.client.release_abandoned {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let (client, state) = (self.client.clone(), self.state.clone());
                self.client.cleanup.spawn_on(
                    async move {
                        let _ = client.release_owner(&state.resource, &state.owner).await;
                    },
                    &rt,
                );
            }
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("resource", &self.state.resource)
            .field("token", &self.state.token)
            .field("owner", &self.state.owner)
            .field("ttl", &self.state.ttl)
            .field("time_left", &self.time_left())
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// A cloneable handle on a lease's lost signal.
#[derive(Clone, Debug)]
pub struct LostSignal {
    token: CancellationToken,
}

impl LostSignal {
    /// Completes when the lease is lost. Cancel safe.
    pub async fn wait(&self) {
        self.token.cancelled().await;
    }

    /// Whether the lease has been marked lost.
    pub fn is_lost(&self) -> bool {
        self.token.is_cancelled()
    }
}
