//! Section 2, contention: many workers on one name, each holding it for a moment, to measure
//! what the lock costs when it is actually contended: how long a handoff takes from one holder's
//! release to the next holder's acquire, how long a waiter waits, and how evenly the default
//! and the fair mode share the lock. Each worker is a thread with a runtime and a Client of its
//! own, standing for a separate process, so that handoffs cross the server as they would
//! between machines.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use fencelock::{ErrorKind, LockOptions};
use tokio::sync::{mpsc, oneshot, Barrier};

use crate::cli::{connect, fail, BackendArg};
use crate::harness::{worker, Contention, Fencelock, ReleaseStart, WorkerTimes};
use crate::plumbing::{bounded, dur, rate, ratio_text, Stop};
use crate::servers::{CommandStats, Servers};
use crate::uncontended::PairTimes;
use crate::{runtime, Bench, LibResult, CLIENT_NAME};

const CONTENDERS: usize = 16;
const HOLD: Duration = Duration::from_millis(1);
const CONTENTION_WAIT: Duration = Duration::from_secs(10);

const TARGET_ACQ_PER_S: f64 = 900.0;
const TARGET_HANDOFF_P50: Duration = Duration::from_micros(150);
const TARGET_WAIT_P99: Duration = Duration::from_millis(50);
const TARGET_FAIR_RATIO: f64 = 1.5;

impl Bench<'_> {
    pub(crate) async fn contention(&mut self, servers: Option<&Servers>) -> Result<()> {
        self.out.line(String::new());
        self.out.line(format!(
            "== 2. contention: {CONTENDERS} workers, one name, acquire (wait 10 s), hold 1 ms, \
             release =="
        ));
        // One thread per worker, each with a single-threaded runtime and a Client of its own,
        // like 16 processes: each has its own connection and its own wake-up subscription, so
        // handoffs cross the server as they would between machines, and no wake-up has to
        // cross between the worker threads of one shared runtime on the way. Tasks sharing one
        // Client would measure a single socket and one subscription instead.
        self.out.line(format!(
            "workers: {CONTENDERS}, each its own thread with a single-threaded runtime and its \
             own Client (own connections{}), as separate processes would be",
            if self.engine.subscribes_to_wake_ups() {
                " and wake-up subscription"
            } else {
                ""
            }
        ));
        let name = self.names.take("contended");
        let warm: Vec<String> = (0..CONTENDERS)
            .map(|i| self.names.take(&format!("warm-{i}")))
            .collect();
        let mut crew = Crew::default();
        let result = self
            .contention_modes(&mut crew, &name, &warm, servers)
            .await;
        // Every thread is joined whatever happened above; the run's own error comes first.
        let ended = crew.finish().await;
        result.and(ended)
    }

    async fn contention_modes(
        &mut self,
        crew: &mut Crew,
        name: &str,
        warm: &[String],
        servers: Option<&Servers>,
    ) -> Result<()> {
        // Each worker connects and warms up before the next starts, so a backend that refuses
        // connections is reported once, not by every worker.
        for (i, warm) in warm.iter().enumerate() {
            crew.start(i, self.backend, warm, self.stop).await?;
        }
        // Redis engines bring a Client's wake-up subscription up in the background; give
        // them time to be in place before the clock starts.
        tokio::time::sleep(Duration::from_millis(200)).await;

        let default = contend_counted(crew, name, false, self.dur, servers).await?;
        let fair = if self.stop.is_set() {
            None
        } else {
            let probe = LockOptions::default().fair(true);
            match crew.probe(name, &probe).await? {
                Ok(()) => Some(contend_counted(crew, name, true, self.dur, servers).await?),
                Err(e) if e.kind() == ErrorKind::InvalidInput => {
                    self.out.line(format!("fair mode skipped: {e}"));
                    None
                }
                Err(e) => return Err(fail(e)),
            }
        };

        self.out.line(format!(
            "{:<8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>13} {:>7} {:>9} {:>6} {:>8} {:>7}",
            "mode",
            "acq/s",
            "handoff50",
            "handoff99",
            "wait p50",
            "wait p99",
            "per-worker",
            "max/min",
            "hold mean",
            "idle",
            "timeouts",
            "req/acq"
        ));
        let modes: Vec<(&str, &Contention)> = std::iter::once(("default", &default))
            .chain(fair.as_ref().map(|f| ("fair", f)))
            .collect();
        for (mode, c) in &modes {
            self.out.line(format!(
                "{mode:<8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>13} {:>7} {:>9} {:>5.0}% {:>8} {:>7}",
                rate(c.per_s),
                dur(c.handoff.p(50.0)),
                dur(c.handoff.p(99.0)),
                dur(c.wait.p(50.0)),
                dur(c.wait.p(99.0)),
                format!("{}..{}", c.min, c.max),
                ratio_text(c.ratio()),
                dur(c.hold_mean),
                c.idle * 100.0,
                c.timeouts,
                c.requests_per_acq
                    .map_or("-".to_owned(), |r| format!("{r:.1}")),
            ));
            let k = format!("contention.{mode}");
            self.out.num(&format!("{k}.acquisitions_per_s"), c.per_s);
            self.out
                .micros(&format!("{k}.handoff_p50_us"), c.handoff.p(50.0));
            self.out
                .micros(&format!("{k}.handoff_p99_us"), c.handoff.p(99.0));
            self.out.micros(&format!("{k}.wait_p99_us"), c.wait.p(99.0));
            self.out.num(&format!("{k}.worker_min"), c.min as f64);
            self.out.num(&format!("{k}.worker_max"), c.max as f64);
            if let Some(r) = c.ratio() {
                self.out.num(&format!("{k}.worker_max_over_min"), r);
            }
            self.out.num(&format!("{k}.timeouts"), c.timeouts as f64);
            if let Some(r) = c.requests_per_acq {
                self.out.num(&format!("{k}.requests_per_acquisition"), r);
            }
        }
        self.out.line(
            "handoff: a holder starts its release -> the next holder's acquire returns; wait: \
             acquire called -> lock held; idle: share of the run with the lock not held",
        );
        // The ceiling shows what the hold alone allows, whatever the handoff costs.
        let ceilings: Vec<String> = modes
            .iter()
            .filter(|(_, c)| !c.hold_mean.is_zero())
            .map(|(mode, c)| format!("{mode} {}/s", rate(1.0 / c.hold_mean.as_secs_f64())))
            .collect();
        self.out.line(format!(
            "ceiling from the hold alone (1 / hold mean, zero-cost handoffs): {}",
            ceilings.join(", ")
        ));
        if servers.is_some() {
            self.out.line(
                "req/acq: server requests (script calls) per acquisition, its release included; \
                 1 acquire + 1 release is 2 on each node",
            );
        }
        for (mode, c) in &modes {
            let k = format!("contention.{mode}");
            self.out.target(
                &format!("{k}.acquisitions_per_s"),
                &format!("{mode}: acquisitions/s >= {TARGET_ACQ_PER_S:.0}"),
                &rate(c.per_s),
                Some(c.per_s >= TARGET_ACQ_PER_S),
            );
            self.out.target(
                &format!("{k}.handoff_p50"),
                &format!("{mode}: handoff p50 <= {}", dur(TARGET_HANDOFF_P50)),
                &dur(c.handoff.p(50.0)),
                Some(!c.handoff.is_empty() && c.handoff.p(50.0) <= TARGET_HANDOFF_P50),
            );
            self.out.target(
                &format!("{k}.wait_p99"),
                &format!("{mode}: wait p99 <= {}", dur(TARGET_WAIT_P99)),
                &dur(c.wait.p(99.0)),
                Some(!c.wait.is_empty() && c.wait.p(99.0) <= TARGET_WAIT_P99),
            );
        }
        if let Some(f) = &fair {
            self.out.target(
                "contention.fair.worker_max_over_min",
                &format!("fair: per-worker max/min <= {TARGET_FAIR_RATIO:.1}"),
                &ratio_text(f.ratio()),
                Some(f.ratio().is_some_and(|r| r <= TARGET_FAIR_RATIO)),
            );
        }
        Ok(())
    }
}

/// [`contend`], with the servers' request counters read around it.
async fn contend_counted(
    crew: &Crew,
    name: &str,
    fair: bool,
    dur: Duration,
    servers: Option<&Servers>,
) -> Result<Contention> {
    let before = match servers {
        Some(s) => s.commandstats().await.ok(),
        None => None,
    };
    let mut c = contend(crew, name, fair, dur).await?;
    if let (Some(s), Some(before)) = (servers, before) {
        if let Ok(after) = s.commandstats().await {
            let mut requests = 0;
            for (node, (b, a)) in before.iter().zip(&after).enumerate() {
                requests += s
                    .requests(node, &CommandStats::delta(b, a))
                    .await
                    .unwrap_or(0);
            }
            if c.all_acquired > 0 {
                c.requests_per_acq = Some(requests as f64 / c.all_acquired as f64);
            }
        }
    }
    Ok(c)
}

/// Every worker of the crew on `name` for `dur`, through the harness' [`worker`].
async fn contend(crew: &Crew, name: &str, fair: bool, dur: Duration) -> Result<Contention> {
    let opts = LockOptions::default().wait(CONTENTION_WAIT).fair(fair);
    let released_at: ReleaseStart = Arc::new(Mutex::new(None));
    let go = Arc::new(Barrier::new(crew.len()));
    let mut answers = Vec::with_capacity(crew.len());
    for i in 0..crew.len() {
        let (answer, rx) = oneshot::channel();
        crew.order(
            i,
            Order::Contend {
                name: name.to_owned(),
                opts: opts.clone(),
                dur,
                go: go.clone(),
                released_at: released_at.clone(),
                answer,
            },
        )?;
        answers.push(rx);
    }
    // Every worker bounds its own run; this only waits for their answers.
    Ok(Contention::of(&gather(answers).await?, dur))
}

/// The contention workers, one thread each with a single-threaded runtime and a Client of its
/// own, taking orders until their order channel closes.
#[derive(Default)]
struct Crew {
    orders: Vec<mpsc::UnboundedSender<Order>>,
    threads: Vec<tokio::task::JoinHandle<Result<()>>>,
}

enum Order {
    /// Meet every other worker at `go`, then run [`worker`] for `dur`.
    Contend {
        name: String,
        opts: LockOptions,
        dur: Duration,
        go: Arc<Barrier>,
        released_at: ReleaseStart,
        answer: Answer<WorkerTimes>,
    },
    /// One try_acquire + release: the answer is try_acquire's error, if any.
    Probe {
        name: String,
        opts: LockOptions,
        answer: Answer<()>,
    },
}

/// A worker's answer to one order. The outer error has been reported already (the order ran
/// out of time, or a release failed); the inner one is the library's, for the coordinator to
/// report or to read.
type Answer<T> = oneshot::Sender<Result<LibResult<T>>>;

impl Crew {
    fn len(&self) -> usize {
        self.orders.len()
    }

    /// Starts worker `i` and waits until it is connected and warmed up on its own `warm` name,
    /// so connection set-up stays out of every figure.
    async fn start(
        &mut self,
        i: usize,
        backend: &BackendArg,
        warm: &str,
        stop: &Stop,
    ) -> Result<()> {
        let (orders_tx, orders) = mpsc::unbounded_channel();
        let (ready_tx, ready) = oneshot::channel();
        let (backend, warm, stop) = (backend.clone(), warm.to_owned(), stop.clone());
        let thread = tokio::spawn(async move {
            let name = format!("fencelock-bench-worker-{i}");
            runtime::on_own_thread(&name, move || {
                crew_member(backend, warm, stop, ready_tx, orders)
            })
            .await
        });
        if ready.await.is_ok() {
            self.orders.push(orders_tx);
            self.threads.push(thread);
            return Ok(());
        }
        // A worker that could not get ready has ended, and its result says why.
        match bounded(Duration::ZERO, thread).await? {
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Err(anyhow::anyhow!(
                "contention worker {i} ended before it was ready"
            )),
            Err(e) => Err(anyhow::anyhow!("contention worker {i} failed: {e}")),
        }
    }

    fn order(&self, i: usize, order: Order) -> Result<()> {
        self.orders
            .get(i)
            .ok_or_else(|| anyhow::anyhow!("no contention worker {i}"))?
            .send(order)
            .map_err(|_| anyhow::anyhow!("contention worker {i} has stopped"))
    }

    /// Whether the engine takes `opts`, asked by the first worker.
    async fn probe(&self, name: &str, opts: &LockOptions) -> Result<LibResult<()>> {
        let (answer, rx) = oneshot::channel();
        self.order(
            0,
            Order::Probe {
                name: name.to_owned(),
                opts: opts.clone(),
                answer,
            },
        )?;
        rx.await
            .map_err(|_| anyhow::anyhow!("contention worker 0 stopped before answering"))?
    }

    /// Closes every order channel, so that each worker closes its Client and its thread ends,
    /// then joins them all. The first failure wins.
    async fn finish(self) -> Result<()> {
        drop(self.orders);
        let mut first_error = None;
        for (i, thread) in self.threads.into_iter().enumerate() {
            let ended = match bounded(Duration::ZERO, thread).await {
                Ok(Ok(ended)) => ended,
                Ok(Err(e)) => Err(anyhow::anyhow!("contention worker {i} failed: {e}")),
                Err(e) => Err(e),
            };
            if let Err(e) = ended {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// One contention worker, on its own thread and runtime: connects, warms up, says it is ready,
/// then carries out orders until the coordinator closes the channel.
async fn crew_member(
    backend: BackendArg,
    warm: String,
    stop: Stop,
    ready: oneshot::Sender<()>,
    mut orders: mpsc::UnboundedReceiver<Order>,
) -> Result<()> {
    let client = connect(&backend, CLIENT_NAME).await?;
    let warmed = bounded(
        Duration::ZERO,
        PairTimes::default().one(&client, &warm, &LockOptions::default(), false),
    )
    .await
    .and_then(|r| r.map_err(fail));
    if let Err(e) = warmed {
        client.close().await;
        return Err(e);
    }
    // The coordinator waits for this before it starts the next worker; if it has gone, the
    // order channel is closed too and the loop below ends at once.
    let _ = ready.send(());
    while let Some(order) = orders.recv().await {
        // Each order is bounded here, on the worker's own clock, so the thread always comes
        // back to this loop and ends once the channel closes.
        match order {
            Order::Contend {
                name,
                opts,
                dur,
                go,
                released_at,
                answer,
            } => {
                let run = bounded(dur + CONTENTION_WAIT, async {
                    go.wait().await;
                    let lib = Fencelock {
                        client: client.clone(),
                        opts,
                    };
                    worker(&lib, &name, HOLD, dur, &released_at, &stop).await
                })
                .await;
                let _ = answer.send(run);
            }
            Order::Probe { name, opts, answer } => {
                let probe = bounded(Duration::ZERO, async {
                    match client.try_acquire(&name, &opts).await {
                        Ok(lease) => lease.release().await.map(Ok).map_err(fail),
                        Err(e) => Ok(Err(e)),
                    }
                })
                .await
                .and_then(|r| r);
                let _ = answer.send(probe);
            }
        }
    }
    client.close().await;
    Ok(())
}

/// Every worker's answer; the first error wins (and is reported once), but only once every
/// worker has answered, so no worker is left holding a lease.
async fn gather<T>(answers: Vec<oneshot::Receiver<Result<LibResult<T>>>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(answers.len());
    let mut first_error = None;
    for (i, rx) in answers.into_iter().enumerate() {
        match rx.await {
            Ok(Ok(Ok(v))) => out.push(v),
            Ok(Ok(Err(e))) => {
                first_error.get_or_insert_with(|| fail(e));
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert_with(|| {
                    anyhow::anyhow!("contention worker {i} stopped before answering")
                });
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}
