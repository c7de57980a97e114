//! Section 1, the uncontended pair: how fast one client can take and give back a free lock,
//! and how far 64 tasks sharing one client push that, each next to a reference measured on the
//! same server in the same run (redis-benchmark for Redis engines). The sequential run is cut
//! into rounds interleaved with the reference because a small VM's round-trip time drifts
//! faster than one run lasts; the same run on the main runtime, two worker threads like the
//! `fencelock` command line's, shows what crossing worker threads costs on top.

use std::time::Duration;

use anyhow::Result;
use fencelock::{Client, LockOptions};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cli::{connect, fail, BackendArg};
use crate::engine::Engine;
use crate::plumbing::{bounded, dur, join_all, rate, Samples, Stop};
use crate::reference::{median, Bracket, PairRate, Reference};
use crate::servers::Servers;
use crate::{runtime, Bench, LibResult, CLIENT_NAME, CONCURRENT_TASKS};

#[cfg(feature = "redis")]
use crate::floor;

const TARGET_SEQ_REDIS: f64 = 0.80;
const TARGET_SEQ_REDLOCK: f64 = 0.65;

impl Bench<'_> {
    pub(crate) async fn uncontended(&mut self, servers: Option<&Servers>) -> Result<()> {
        self.out.line(String::new());
        self.out
            .line("== 1. uncontended acquire+release (try_acquire + release, TTL 30 s) ==");
        let interleaved = sequential_on_own_thread(
            self.backend,
            self.names.take("seq"),
            self.dur,
            self.stop,
            self.reference,
        )
        .await?;
        let seq = &interleaved.run;
        // The same run on the main runtime, where the client's tasks and this loop wake each
        // other across two worker threads: the difference is that toll, not the lock's.
        let seq_mt =
            sequential(self.client, &self.names.take("seq-mt"), self.dur, self.stop).await?;
        let ref50_before = self.reference_rate(50).await;
        let task_names: Vec<String> = (0..CONCURRENT_TASKS)
            .map(|i| self.names.take(&format!("par-{i}")))
            .collect();
        let par = concurrent(self.client, task_names, self.dur, self.stop).await?;
        let ref50_after = self.reference_rate(50).await;

        self.out.line(format!(
            "{:<38} {:>9} {:>9} {:>9} {:>12} {:>12}",
            "run", "pairs/s", "p50", "p99", "acquire p50", "release p50"
        ));
        for (label, key, r) in [
            ("sequential, 1 client", "sequential", seq),
            (
                "sequential, 1 client, 2-worker runtime",
                "sequential_2worker_runtime",
                &seq_mt,
            ),
            ("64 tasks, 1 shared client", "tasks64", &par),
        ] {
            self.out.line(format!(
                "{label:<38} {:>9} {:>9} {:>9} {:>12} {:>12}",
                rate(r.ops_per_s),
                dur(r.pair.p(50.0)),
                dur(r.pair.p(99.0)),
                dur(r.acquire.p(50.0)),
                dur(r.release.p(50.0)),
            ));
            self.out
                .num(&format!("uncontended.{key}.ops_per_s"), r.ops_per_s);
            self.out
                .micros(&format!("uncontended.{key}.p50_us"), r.pair.p(50.0));
            self.out
                .micros(&format!("uncontended.{key}.p99_us"), r.pair.p(99.0));
        }
        self.out.line(
            "sequential, 1 client: own thread, single-threaded runtime (like redis-benchmark's \
             one event loop); 2-worker runtime: the same loop on the CLI's runtime",
        );

        #[cfg(feature = "etcd")]
        if let Some(e) = self.etcd {
            if !self.stop.is_set() {
                let name = self.names.take("writes");
                e.report(self.out, self.dur, self.stop, seq, &par, self.client, &name)
                    .await;
            }
        }
        #[cfg(feature = "zookeeper")]
        if let Some(z) = self.zookeeper {
            if !self.stop.is_set() {
                z.report(self.out, self.dur, self.stop, seq, &par).await;
            }
        }
        if self.reference.is_none() {
            return Ok(());
        }
        let ref1 = Bracket::of(interleaved.rounds.iter().map(|(r, _)| Some(r.clone())));
        let ref50 = Bracket::of([ref50_before, ref50_after]);
        self.out.line(
            "reference pair rate = 1 / (1/SET + 1/EVALSHA), mean of its runs: 1 client, one run \
             before each round of the sequential run; 50 clients, before and after the 64 tasks",
        );
        for (label, key, b) in [("1 client", "c1", &ref1), ("50 clients", "c50", &ref50)] {
            match b {
                Ok(b) => {
                    let runs: Vec<String> = b.runs.iter().map(|r| rate(*r)).collect();
                    self.out.line(format!(
                        "  {label:<11} SET {:>8}/s  EVALSHA {:>8}/s  pair rate {:>8}/s  \
                         (runs: {})",
                        rate(b.set),
                        rate(b.evalsha),
                        rate(b.pair),
                        runs.join(", "),
                    ));
                    self.out.num(&format!("reference.{key}.set_rps"), b.set);
                    self.out
                        .num(&format!("reference.{key}.evalsha_rps"), b.evalsha);
                    self.out.num(&format!("reference.{key}.pair_rate"), b.pair);
                }
                Err(e) => self.out.line(format!("  {label:<11} unavailable: {e}")),
            }
        }
        if let (Ok(b), Some(ratio)) = (&ref1, interleaved.ratio()) {
            let rounds: Vec<String> = interleaved
                .rounds
                .iter()
                .filter_map(|(r, v)| r.as_ref().ok().map(|r| format!("{:.2}", v / r.pair())))
                .collect();
            self.out.line(format!(
                "sequential / same round's 1-client pair rate, per round: {}",
                rounds.join(" ")
            ));
            let (limit, what) = if matches!(self.engine, Engine::Redis(r) if r.quorum) {
                (TARGET_SEQ_REDLOCK, "Redlock over 3 nodes")
            } else {
                (TARGET_SEQ_REDIS, "one node")
            };
            self.out.num("uncontended.sequential.ratio", ratio);
            self.out.target(
                "uncontended.sequential.ratio",
                &format!(
                    "sequential / 1-client pair rate >= {limit:.2} ({what}, median of rounds)"
                ),
                &format!("{ratio:.2}"),
                Some(ratio >= limit),
            );
            let ratio_mt = seq_mt.ops_per_s / b.pair;
            self.out
                .num("uncontended.sequential_2worker_runtime.ratio", ratio_mt);
            self.out.target(
                "uncontended.sequential_2worker_runtime.ratio",
                "2-worker sequential / 1-client pair rate (no target)",
                &format!("{ratio_mt:.2}"),
                None,
            );
        }
        #[cfg(feature = "redis")]
        if let (Some(url), false) = (
            servers.and_then(|s| s.target.urls.first()),
            self.stop.is_set(),
        ) {
            match floor::measure_on_own_thread(url, self.dur, self.stop).await {
                Ok(f) => {
                    // Each rate also as a share of redis-benchmark's 1-client pair rate, so the
                    // client crate's own share of the gap shows.
                    let of_ref = |v: f64| match &ref1 {
                        Ok(b) => format!(" ({:.2})", v / b.pair),
                        Err(_) => String::new(),
                    };
                    self.out.line(
                        "client floor: the redis crate's multiplexed connection (fencelock's), \
                         1 client on a single-threaded runtime of its own, like the sequential \
                         run (share of the redis-benchmark pair rate)",
                    );
                    self.out.line(format!(
                        "  SET + no-op EVALSHA {:>8}/s{}  two no-op scripts with fencelock's keys \
                         and arguments {:>8}/s{}  fencelock sequential {:>8}/s{}",
                        rate(f.reference),
                        of_ref(f.reference),
                        rate(f.shaped),
                        of_ref(f.shaped),
                        rate(seq.ops_per_s),
                        of_ref(seq.ops_per_s),
                    ));
                    self.out.num("floor.reference_pair_rate", f.reference);
                    self.out.num("floor.shaped_pair_rate", f.shaped);
                }
                Err(e) => self.out.line(format!("  client floor unavailable: {e}")),
            }
        }
        #[cfg(not(feature = "redis"))]
        let _ = servers;
        if let Ok(b) = &ref50 {
            let ratio = par.ops_per_s / b.pair;
            self.out.num("uncontended.tasks64.ratio", ratio);
            self.out.target(
                "uncontended.tasks64.ratio",
                "64 tasks / 50-client pair rate (no target)",
                &format!("{ratio:.2}"),
                None,
            );
        }
        Ok(())
    }

    async fn reference_rate(&self, clients: u32) -> Option<Result<PairRate, String>> {
        if self.stop.is_set() {
            return None;
        }
        Some(self.reference?.measure(clients).await)
    }
}

pub(crate) struct Uncontended {
    pub(crate) ops_per_s: f64,
    pair: Samples,
    acquire: Samples,
    release: Samples,
}

#[derive(Default)]
pub(crate) struct PairTimes {
    pair: Vec<Duration>,
    acquire: Vec<Duration>,
    release: Vec<Duration>,
}

impl PairTimes {
    /// One try_acquire + release, timed unless `record` is off (warm-up).
    pub(crate) async fn one(
        &mut self,
        client: &Client,
        name: &str,
        opts: &LockOptions,
        record: bool,
    ) -> LibResult<()> {
        let t0 = Instant::now();
        let lease = client.try_acquire(name, opts).await?;
        let t1 = Instant::now();
        lease.release().await?;
        if record {
            let t2 = Instant::now();
            self.pair.push(t2 - t0);
            self.acquire.push(t1 - t0);
            self.release.push(t2 - t1);
        }
        Ok(())
    }

    /// Pairs until `dur` has passed; returns pairs per second.
    async fn run(
        &mut self,
        client: &Client,
        name: &str,
        dur: Duration,
        stop: &Stop,
    ) -> LibResult<f64> {
        let opts = LockOptions::default();
        // Connection set-up and script loading happen on first use; keep them out of the
        // figures.
        for _ in 0..20 {
            self.one(client, name, &opts, false).await?;
        }
        let start = Instant::now();
        while start.elapsed() < dur && !stop.is_set() {
            self.one(client, name, &opts, true).await?;
        }
        Ok(self.pair.len() as f64 / start.elapsed().as_secs_f64())
    }
}

async fn sequential(
    client: &Client,
    name: &str,
    dur: Duration,
    stop: &Stop,
) -> Result<Uncontended> {
    let mut t = PairTimes::default();
    let ops_per_s = bounded(dur, t.run(client, name, dur, stop))
        .await?
        .map_err(fail)?;
    Ok(Uncontended {
        ops_per_s,
        pair: Samples::new(t.pair),
        acquire: Samples::new(t.acquire),
        release: Samples::new(t.release),
    })
}

/// Rounds the sequential run is cut into, each after a reference measurement of its own.
const SEQ_ROUNDS: u32 = 6;
/// Requests per redis-benchmark test in one round: a few tenths of a second at one client.
const SEQ_ROUND_REQUESTS: u32 = 2_000;

/// The sequential run, and with a reference its rounds: each round measures redis-benchmark's
/// 1-client pair rate, then runs fencelock for its share of the time, so that both see the
/// machine in the same state. On a small VM the round-trip time drifts by tens of percent
/// within seconds; one reference before and one after a 3 s run compare across that drift.
struct Sequential {
    run: Uncontended,
    /// Per round: the reference's pair rate and fencelock's pairs per second.
    rounds: Vec<(std::result::Result<PairRate, String>, f64)>,
}

impl Sequential {
    /// The median over rounds of fencelock's rate as a share of the same round's reference.
    fn ratio(&self) -> Option<f64> {
        median(
            self.rounds
                .iter()
                .filter_map(|(r, v)| r.as_ref().ok().map(|r| v / r.pair()))
                .collect(),
        )
    }
}

/// [`sequential`] with a Client of its own, connected and closed on a thread of its own with a
/// single-threaded runtime (see [`runtime`]), interleaved with the reference when there is one
/// (see [`Sequential`]).
async fn sequential_on_own_thread(
    backend: &BackendArg,
    name: String,
    dur: Duration,
    stop: &Stop,
    reference: Option<&Reference>,
) -> Result<Sequential> {
    let (backend, stop, reference) = (backend.clone(), stop.clone(), reference.cloned());
    runtime::on_own_thread("fencelock-bench-seq", move || async move {
        let client = connect(&backend, CLIENT_NAME).await?;
        let result = async {
            let Some(reference) = reference else {
                let run = sequential(&client, &name, dur, &stop).await?;
                return Ok(Sequential {
                    run,
                    rounds: Vec::new(),
                });
            };
            let mut all = PairTimes::default();
            let mut rounds = Vec::new();
            let (mut pairs, mut spent) = (0usize, Duration::ZERO);
            for _ in 0..SEQ_ROUNDS {
                if stop.is_set() {
                    break;
                }
                let r = reference.measure_n(1, SEQ_ROUND_REQUESTS).await;
                let mut t = PairTimes::default();
                let share = dur / SEQ_ROUNDS;
                let started = Instant::now();
                let per_s = bounded(share, t.run(&client, &name, share, &stop))
                    .await?
                    .map_err(fail)?;
                spent += started.elapsed();
                pairs += t.pair.len();
                rounds.push((r, per_s));
                all.pair.extend(t.pair);
                all.acquire.extend(t.acquire);
                all.release.extend(t.release);
            }
            Ok(Sequential {
                run: Uncontended {
                    ops_per_s: pairs as f64 / spent.as_secs_f64().max(1e-9),
                    pair: Samples::new(all.pair),
                    acquire: Samples::new(all.acquire),
                    release: Samples::new(all.release),
                },
                rounds,
            })
        }
        .await;
        client.close().await;
        result
    })
    .await
}

async fn concurrent(
    client: &Client,
    names: Vec<String>,
    dur: Duration,
    stop: &Stop,
) -> Result<Uncontended> {
    let mut tasks = JoinSet::new();
    for name in names {
        let client = client.clone();
        let stop = stop.clone();
        tasks.spawn(async move {
            let mut t = PairTimes::default();
            let rate = t.run(&client, &name, dur, &stop).await?;
            Ok((rate, t))
        });
    }
    let results = bounded(dur, join_all(tasks)).await??;
    let mut all = PairTimes::default();
    // Each task's own rate over its own run, summed: the tasks start within microseconds of
    // each other but each stops on its own clock.
    let mut ops_per_s = 0.0;
    for (rate, t) in results {
        ops_per_s += rate;
        all.pair.extend(t.pair);
        all.acquire.extend(t.acquire);
        all.release.extend(t.release);
    }
    Ok(Uncontended {
        ops_per_s,
        pair: Samples::new(all.pair),
        acquire: Samples::new(all.acquire),
        release: Samples::new(all.release),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequential_ratio_is_the_median_of_same_round_ratios() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![0.9, 0.5, 0.7]), Some(0.7));
        assert_eq!(median(vec![0.4, 0.8, 0.6, 0.5]), Some(0.55));
        let pair = |p: f64| PairRate {
            set: 2.0 * p,
            evalsha: 2.0 * p,
        };
        let seq = Sequential {
            run: Uncontended {
                ops_per_s: 0.0,
                pair: Samples::new(Vec::new()),
                acquire: Samples::new(Vec::new()),
                release: Samples::new(Vec::new()),
            },
            // A failed reference round counts for nothing, not as zero.
            rounds: vec![
                (Ok(pair(1000.0)), 500.0),
                (Err("gone".to_owned()), 10.0),
                (Ok(pair(2000.0)), 1600.0),
                (Ok(pair(1000.0)), 700.0),
            ],
        };
        assert_eq!(seq.ratio(), Some(0.7));
    }
}
