//! What the contention section and the side-by-side run (`peers`) measure, over any lock
//! library: a sequential loop of acquire+release on distinct free names, and a worker that
//! takes one contended name again and again, holding it for a moment, timing its waits and the
//! handoffs it receives. A library plugs in through [`LockLib`] (acquire a name, release the
//! guard), so fencelock and a peer go through the very same loops and clocks.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{Client, ErrorKind, Lease, LockOptions};
use tokio::time::Instant;

use crate::plumbing::{Samples, Stop};

/// A lock library as the harness drives it.
pub(crate) trait LockLib: Send + Sync + 'static {
    type Guard: Send;
    type Error: Send;

    /// One attempt on a name nobody holds (the sequential loop's names are all distinct).
    // Only `peers` (a Redis-only command) runs the sequential loop.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Future<Output = Result<Self::Guard, Self::Error>> + Send + 'a;

    /// Waits for the lock; `Ok(None)` when the library's wait ran out.
    fn acquire<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Future<Output = Result<Option<Self::Guard>, Self::Error>> + Send + 'a;

    fn release(
        &self,
        guard: Self::Guard,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + '_;
}

/// fencelock through one Client, with the options every acquisition uses.
pub(crate) struct Fencelock {
    pub(crate) client: Client,
    pub(crate) opts: LockOptions,
}

impl LockLib for Fencelock {
    type Guard = Lease;
    type Error = fencelock::Error;

    fn try_acquire<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Future<Output = Result<Lease, fencelock::Error>> + Send + 'a {
        self.client.try_acquire(name, &self.opts)
    }

    async fn acquire(&self, name: &str) -> Result<Option<Lease>, fencelock::Error> {
        match self.client.acquire(name, &self.opts).await {
            Ok(lease) => Ok(Some(lease)),
            Err(e) if e.kind() == ErrorKind::TimedOut => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn release(
        &self,
        guard: Lease,
    ) -> impl Future<Output = Result<(), fencelock::Error>> + Send + '_ {
        guard.release()
    }
}

/// The sequential loop's figures.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Pairs {
    pub(crate) per_s: f64,
    pub(crate) acquire: Samples,
    pub(crate) release: Samples,
}

/// Pairs of `try_acquire` + `release`, each on a name of its own (`name(i)`), run in slices:
/// libraries compared side by side take turns slice by slice, so that a machine whose speed
/// drifts over seconds (a shared virtual machine's does, by a fifth) weighs on each alike. A
/// few untimed pairs first keep connection set-up and script loading out of the figures.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct Sequential {
    next: u64,
    acquire: Vec<Duration>,
    release: Vec<Duration>,
    timed: Duration,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl Sequential {
    /// The untimed pairs.
    pub(crate) async fn start<L: LockLib>(
        lib: &L,
        name: impl Fn(u64) -> String,
    ) -> Result<Sequential, L::Error> {
        let mut run = Sequential {
            next: 0,
            acquire: Vec::new(),
            release: Vec::new(),
            timed: Duration::ZERO,
        };
        for _ in 0..20 {
            let guard = lib.try_acquire(&name(run.next)).await?;
            lib.release(guard).await?;
            run.next += 1;
        }
        Ok(run)
    }

    /// Timed pairs until `dur` has passed.
    pub(crate) async fn slice<L: LockLib>(
        &mut self,
        lib: &L,
        name: impl Fn(u64) -> String,
        dur: Duration,
        stop: &Stop,
    ) -> Result<(), L::Error> {
        let start = Instant::now();
        while start.elapsed() < dur && !stop.is_set() {
            let n = name(self.next);
            self.next += 1;
            let t0 = Instant::now();
            let guard = lib.try_acquire(&n).await?;
            let t1 = Instant::now();
            lib.release(guard).await?;
            self.acquire.push(t1 - t0);
            self.release.push(t1.elapsed());
        }
        self.timed += start.elapsed();
        Ok(())
    }

    /// The figures of every slice together.
    pub(crate) fn pairs(self) -> Pairs {
        Pairs {
            per_s: self.acquire.len() as f64 / self.timed.as_secs_f64().max(f64::EPSILON),
            acquire: Samples::new(self.acquire),
            release: Samples::new(self.release),
        }
    }
}

/// When the last holder started its release, on the process's monotonic clock: the next
/// holder takes it to time the handoff.
pub(crate) type ReleaseStart = Arc<Mutex<Option<Instant>>>;

/// What one contention worker saw.
#[derive(Default)]
pub(crate) struct WorkerTimes {
    /// Acquisitions inside the timed window.
    pub(crate) acquired: u64,
    /// Every acquisition, the ones finishing after the window included.
    pub(crate) all_acquired: u64,
    waits: Vec<Duration>,
    handoffs: Vec<Duration>,
    held: Duration,
    timeouts: u64,
}

/// One contention worker: acquire `name`, hold it for `hold_for`, release, until `dur` has
/// passed. A handoff runs from a holder starting its release to the next holder's acquire
/// returning; a wait from the acquire call to the lock being held.
pub(crate) async fn worker<L: LockLib>(
    lib: &L,
    name: &str,
    hold_for: Duration,
    dur: Duration,
    released_at: &ReleaseStart,
    stop: &Stop,
) -> Result<WorkerTimes, L::Error> {
    let mut w = WorkerTimes::default();
    let end = Instant::now() + dur;
    while Instant::now() < end && !stop.is_set() {
        let asked = Instant::now();
        let Some(guard) = lib.acquire(name).await? else {
            w.timeouts += 1;
            continue;
        };
        let got = Instant::now();
        w.all_acquired += 1;
        let handoff_from = lock(released_at).take();
        let in_window = got < end;
        if in_window {
            w.acquired += 1;
            w.waits.push(got - asked);
            if let Some(from) = handoff_from {
                w.handoffs.push(got - from);
            }
        }
        hold(hold_for).await;
        let releasing = Instant::now();
        if in_window {
            w.held += releasing.min(end) - got;
        }
        *lock(released_at) = Some(releasing);
        lib.release(guard).await?;
    }
    Ok(w)
}

/// The figures of one contention run, over every worker.
pub(crate) struct Contention {
    pub(crate) per_s: f64,
    pub(crate) handoff: Samples,
    pub(crate) wait: Samples,
    pub(crate) min: u64,
    pub(crate) max: u64,
    pub(crate) hold_mean: Duration,
    pub(crate) idle: f64,
    pub(crate) timeouts: u64,
    /// Acquisitions in all, the window's and the stragglers'.
    pub(crate) all_acquired: u64,
    /// Server requests per acquisition, summed over nodes; Redis engines only.
    pub(crate) requests_per_acq: Option<f64>,
}

impl Contention {
    pub(crate) fn of(workers: &[WorkerTimes], dur: Duration) -> Contention {
        let mut handoffs = Vec::new();
        let mut waits = Vec::new();
        let mut held = Duration::ZERO;
        let (mut total, mut timeouts, mut all_acquired) = (0, 0, 0);
        for w in workers {
            all_acquired += w.all_acquired;
            handoffs.extend_from_slice(&w.handoffs);
            waits.extend_from_slice(&w.waits);
            held += w.held;
            total += w.acquired;
            timeouts += w.timeouts;
        }
        let counts = workers.iter().map(|w| w.acquired);
        Contention {
            per_s: total as f64 / dur.as_secs_f64(),
            handoff: Samples::new(handoffs),
            wait: Samples::new(waits),
            min: counts.clone().min().unwrap_or(0),
            max: counts.max().unwrap_or(0),
            hold_mean: if total > 0 {
                held / u32::try_from(total).unwrap_or(u32::MAX)
            } else {
                Duration::ZERO
            },
            idle: (1.0 - held.as_secs_f64() / dur.as_secs_f64()).max(0.0),
            timeouts,
            all_acquired,
            requests_per_acq: None,
        }
    }

    /// The busiest worker's acquisitions over the least busy one's; none if a worker got none.
    pub(crate) fn ratio(&self) -> Option<f64> {
        (self.min > 0).then(|| self.max as f64 / self.min as f64)
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Holds for `d` as precisely as the scheduler allows. Tokio's timer wheel has 1 ms ticks and
/// rounds deadlines up, so `sleep(1ms)` holds about 2 ms and would measure the timer rather
/// than the lock; the last stretch is spent yielding to other tasks instead.
async fn hold(d: Duration) {
    let until = Instant::now() + d;
    if d > Duration::from_millis(2) {
        tokio::time::sleep(d - Duration::from_millis(2)).await;
    }
    while Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contention_figures_add_up_over_workers() {
        let w = |acquired: u64, held_ms: u64| WorkerTimes {
            acquired,
            all_acquired: acquired + 1,
            waits: vec![Duration::from_millis(1); acquired as usize],
            handoffs: vec![Duration::from_micros(100); acquired as usize],
            held: Duration::from_millis(held_ms),
            timeouts: 0,
        };
        let c = Contention::of(&[w(30, 300), w(10, 100)], Duration::from_secs(1));
        assert_eq!(c.per_s, 40.0);
        assert_eq!((c.min, c.max, c.all_acquired), (10, 30, 42));
        assert_eq!(c.ratio(), Some(3.0));
        assert_eq!(c.hold_mean, Duration::from_millis(10));
        assert!((c.idle - 0.6).abs() < 1e-9);
        let starved = Contention::of(&[w(5, 5), w(0, 0)], Duration::from_secs(1));
        assert_eq!(starved.ratio(), None);
    }
}
