//! One renewal task per client, serving all its leases.
//!
//! Renewals that fall due close together are coalesced into one engine call (one call per node
//! for engines with several): a lease is renewed early when its renewal is due within a quarter
//! of its cadence of the one that woke the task. After one such early round, leases of the same
//! TTL renew in lock step, so ten thousand leases cost a handful of calls per TTL/3, not ten
//! thousand.
//!
//! The task also enforces the end of every validity window: a lease whose deadline passes
//! without a confirmed renewal is marked lost even while a renewal call is still hanging. It
//! gives up a small margin before the deadline ([`give_up_at`]), because a timer fires a little
//! late on a busy machine and the holder must learn of the loss inside its window, not after.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::core::call::Calls;
use crate::core::engine::{Engine, LossFeed, Renewal, Renewed};
use crate::core::error::Result;
use crate::core::lease::LeaseState;
use crate::core::metrics::Loss;
use crate::core::options::{drift, renew_interval};
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Consecutive failed renewals after which a lease is declared lost.
const MAX_FAILED_RENEWALS: u32 = 2;

/// When the watchdog declares an unconfirmed lease lost: one drift allowance before its
/// validity deadline (4 ms at a 200 ms TTL, 302 ms at 30 s). Timers and the task that wakes
/// on them run late by a few milliseconds under load; measured against partitioned holders,
/// firing at the deadline itself let one loss in ten be reported after the window had ended.
fn give_up_at(lease: &LeaseState) -> Instant {
    let deadline = lease.deadline();
    deadline.checked_sub(drift(lease.ttl)).unwrap_or(deadline)
}

struct Entry {
    lease: Arc<LeaseState>,
    auto_renew: bool,
    next_renew: Instant,
    failures: u32,
    in_flight: bool,
}

struct Shared {
    entries: Mutex<HashMap<u64, Entry>>,
    /// When the task plans to wake next; always locked after `entries`.
    planned: Mutex<Option<Instant>>,
    changed: Notify,
    engine: Arc<dyn Engine>,
    calls: Calls,
    op_timeout: Duration,
    tasks: TaskTracker,
    /// Release the leases that lapse ([`Opened::release_abandoned`](crate::core::engine::Opened)).
    release_lapsed: bool,
}

pub(crate) struct Watchdog {
    shared: Arc<Shared>,
    shutdown: CancellationToken,
}

struct BatchResult {
    ids: Vec<u64>,
    started: Instant,
    outcome: Result<Vec<Renewed>>,
}

impl Watchdog {
    /// Starts the renewal task of a client; `losses` is the engine's feed of leases lost as it
    /// happens, if it has one; `release_lapsed` releases every lease whose validity ends
    /// unrenewed, for engines that would keep it otherwise.
    pub(crate) fn start(
        engine: Arc<dyn Engine>,
        losses: Option<LossFeed>,
        release_lapsed: bool,
        calls: Calls,
        op_timeout: Duration,
        tasks: TaskTracker,
    ) -> Self {
        let shared = Arc::new(Shared {
            entries: Mutex::new(HashMap::new()),
            planned: Mutex::new(None),
            changed: Notify::new(),
            engine,
            calls,
            op_timeout,
            tasks,
            release_lapsed,
        });
        let shutdown = CancellationToken::new();
        tokio::spawn(run(shared.clone(), losses, shutdown.clone()));
        Watchdog { shared, shutdown }
    }

    pub(crate) fn register(&self, lease: Arc<LeaseState>, auto_renew: bool) {
        let now = Instant::now();
        // A lease that starts with much less validity than its TTL (a lock handed over by a
        // release, whose expiry was cut to the waiter's queue entry) renews once a third of
        // that validity has passed, not a third of its TTL, which would be too late.
        let left = lease.deadline().saturating_duration_since(now);
        let next_renew = now
            + if left < lease.ttl / 2 {
                left / 3
            } else {
                renew_interval(lease.ttl)
            };
        let first_event = if auto_renew {
            next_renew.min(give_up_at(&lease))
        } else {
            give_up_at(&lease)
        };
        let mut entries = self.shared.lock();
        entries.insert(
            lease.id,
            Entry {
                lease,
                auto_renew,
                next_renew,
                failures: 0,
                in_flight: false,
            },
        );
        let planned = *self
            .shared
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        drop(entries);
        // Waking the task costs a cross-thread wake-up on every acquisition; it is needed only
        // when this lease needs attention before the task would wake anyway.
        if planned.is_none_or(|p| first_event < p) {
            self.shared.changed.notify_one();
        }
    }

    pub(crate) fn unregister(&self, id: u64) {
        self.shared.lock().remove(&id);
    }

    /// Records a renewal confirmed outside the watchdog (an explicit `extend`) that started at
    /// `started` and counts its validity `from` then or earlier.
    pub(crate) fn confirmed(&self, id: u64, from: Instant, started: Instant) {
        if let Some(e) = self.shared.lock().get_mut(&id) {
            apply_success(e, from, started);
        }
        self.shared.changed.notify_one();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_wake(&self) -> Option<Instant> {
        let entries = self.lock();
        let wake = entries
            .values()
            .flat_map(|e| {
                let renew = (e.auto_renew && !e.in_flight).then_some(e.next_renew);
                [Some(give_up_at(&e.lease)), renew]
            })
            .flatten()
            .min();
        *self.planned.lock().unwrap_or_else(|p| p.into_inner()) = wake;
        wake
    }

    fn expire(&self, now: Instant) {
        let mut lapsed = Vec::new();
        self.lock().retain(|_, e| {
            if now >= give_up_at(&e.lease) {
                e.lease.mark_lost(
                    Loss::Expired,
                    "its validity ended without a confirmed renewal".to_owned(),
                );
                lapsed.push(e.lease.clone());
                false
            } else {
                true
            }
        });
        if self.release_lapsed {
            for lease in lapsed {
                self.release_in_background(lease);
            }
        }
    }

    fn take_due(&self, now: Instant) -> Option<(Vec<u64>, Vec<Renewal>)> {
        let mut entries = self.lock();
        let earliest = entries
            .values()
            .filter(|e| e.auto_renew && !e.in_flight)
            .map(|e| e.next_renew)
            .min()?;
        if earliest > now {
            return None;
        }
        let mut ids = Vec::new();
        let mut batch = Vec::new();
        for (id, e) in entries.iter_mut() {
            if e.auto_renew && !e.in_flight && e.next_renew <= now + renew_interval(e.lease.ttl) / 4
            {
                e.in_flight = true;
                ids.push(*id);
                batch.push(Renewal {
                    name: e.lease.resource.clone(),
                    owner: e.lease.owner.clone(),
                    ttl: e.lease.ttl,
                });
            }
        }
        Some((ids, batch))
    }

    fn apply(&self, result: BatchResult) {
        let now = Instant::now();
        let mut entries = self.lock();
        let outcomes: Vec<Renewed> = match result.outcome {
            Ok(v) if v.len() == result.ids.len() => v,
            Ok(v) => vec![
                Renewed::Failed(format!(
                    "the engine answered {} renewals for {} leases",
                    v.len(),
                    result.ids.len()
                ));
                result.ids.len()
            ],
            Err(e) => vec![Renewed::Failed(e.to_string()); result.ids.len()],
        };
        for (id, outcome) in result.ids.iter().zip(outcomes) {
            let Some(e) = entries.get_mut(id) else {
                continue;
            };
            e.in_flight = false;
            let in_time = now < e.lease.deadline();
            let from = outcome.confirmed_from(result.started);
            e.lease.renewal_attempted(in_time && from.is_some());
            if !in_time {
                e.lease.mark_lost(
                    Loss::Expired,
                    "its validity ended before a renewal was confirmed".to_owned(),
                );
                if self.release_lapsed {
                    self.release_in_background(e.lease.clone());
                }
                entries.remove(id);
                continue;
            }
            if let Some(from) = from {
                apply_success(e, from, result.started);
                continue;
            }
            let msg = match outcome {
                Renewed::Extended | Renewed::ExtendedFrom(_) => continue,
                Renewed::NotHolder => {
                    e.lease.mark_lost(
                        Loss::NotHolder,
                        "the engine no longer lists this owner as holder: the lock expired or \
                         was taken or force-released"
                            .to_owned(),
                    );
                    entries.remove(id);
                    continue;
                }
                Renewed::Failed(msg) => msg,
                // The lease stays valid until its deadline, which the refusal did not move:
                // two refusals in a row mark it lost, or the deadline does.
                Renewed::OverLimit(max) => format!(
                    "refused by the limit max-ttl = {}",
                    crate::core::options::display_duration(max)
                ),
            };
            e.failures += 1;
            tracing::warn!(resource = %e.lease.resource, failures = e.failures, error = %msg, "renewal failed");
            if e.failures >= MAX_FAILED_RENEWALS {
                e.lease.mark_lost(
                    Loss::RenewalsFailed,
                    format!(
                        "{} renewals in a row failed, the last with: {msg}",
                        e.failures
                    ),
                );
                let lease = e.lease.clone();
                entries.remove(id);
                self.release_in_background(lease);
            } else {
                // Retrying after half a cadence, with calls capped at half a cadence, puts the
                // second failure at 5/6 of the TTL at the latest: the lease is declared lost
                // while it is still valid, not when it has already ended.
                e.next_renew = now + renew_interval(e.lease.ttl) / 2;
            }
        }
    }

    /// Marks lost the leases of `first` and of every other owner already queued in `more`, in
    /// one pass over the entries: a dropped session may take thousands of leases at once.
    fn lost_owners(&self, first: String, more: Option<&mut LossFeed>) {
        let mut owners = std::collections::HashSet::from([first]);
        if let Some(rx) = more {
            while let Ok(owner) = rx.try_recv() {
                owners.insert(owner);
            }
        }
        self.lock().retain(|_, e| {
            if owners.contains(&e.lease.owner) {
                e.lease.mark_lost(
                    Loss::NotHolder,
                    "the engine reported it lost: the session holding it ended, or a forced \
                     release took it"
                        .to_owned(),
                );
                false
            } else {
                true
            }
        });
    }

    /// A lease declared lost after failed renewals may still be ours on the engine; releasing
    /// it (owner-checked) frees the resource sooner than its expiry would.
    fn release_in_background(self: &Shared, lease: Arc<LeaseState>) {
        let engine = self.engine.clone();
        let calls = self.calls.clone();
        let op_timeout = self.op_timeout;
        self.tasks.spawn(async move {
            let release = engine.release(&lease.resource, &lease.owner);
            let _ = calls.traced(&lease.resource, op_timeout, release).await;
        });
    }
}

/// A renewal confirmed: the validity counts `from` (the batch's start, or earlier when the
/// engine vouches for less), the next renewal a cadence after the batch's start.
fn apply_success(e: &mut Entry, from: Instant, started: Instant) {
    let ttl = e.lease.ttl;
    let deadline = from + ttl.saturating_sub(drift(ttl));
    if deadline > e.lease.deadline() {
        e.lease.set_deadline(deadline);
    }
    e.failures = 0;
    e.next_renew = started + renew_interval(ttl);
}

/// The next owner the engine reports lost; never completes without a feed (or once it closed).
async fn next_loss(feed: &mut Option<LossFeed>) -> Option<String> {
    match feed {
        Some(rx) => match rx.recv().await {
            Some(owner) => Some(owner),
            None => {
                *feed = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn run(shared: Arc<Shared>, mut losses: Option<LossFeed>, shutdown: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel::<BatchResult>();
    loop {
        let wake = shared.next_wake();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = shared.changed.notified() => {}
            Some(result) = rx.recv() => shared.apply(result),
            Some(owner) = next_loss(&mut losses) => shared.lost_owners(owner, losses.as_mut()),
            _ = sleep_until(wake) => {}
        }
        let now = Instant::now();
        shared.expire(now);
        if let Some((ids, batch)) = shared.take_due(now) {
            let call_timeout = batch
                .iter()
                .map(|r| renew_interval(r.ttl) / 2)
                .min()
                .unwrap_or(shared.op_timeout)
                .min(shared.op_timeout);
            let engine = shared.engine.clone();
            let calls = shared.calls.clone();
            let tx = tx.clone();
            let label = match batch.as_slice() {
                [one] => one.name.clone(),
                many => format!("{} leases", many.len()),
            };
            // Renewals are not cleanup work: `Client::close` must not wait on them.
            tokio::spawn(async move {
                let started = Instant::now();
                let outcome = calls
                    .traced(&label, call_timeout, engine.extend(&batch))
                    .await;
                let _ = tx.send(BatchResult {
                    ids,
                    started,
                    outcome,
                });
            });
        }
    }
}
