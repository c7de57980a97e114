//! `fencelock-bench peers`: fencelock and rslock side by side, through one harness, on the same
//! Redis node(s) in the same run. One process and the bench's 2-worker runtime; each library has
//! one client (a fencelock `Client`, an rslock `LockManager`) shared by every worker. So that a
//! machine whose speed drifts weighs on both, the sequential loops (fencelock's, rslock's and
//! the floors') take turns in slices of a quarter of a second within each round, and the
//! contended runs are interleaved round by round (fencelock first in odd rounds, rslock first
//! in even ones); each round also measures a plain `SET` round trip on the first node, the
//! unit in which handoffs and utilisation are read.

mod floor;
mod handoff;
pub(crate) mod pairs;
mod report;
mod rslock;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::LockOptions;
use tokio::sync::Barrier;
use tokio::task::JoinSet;

use crate::cli::{connect, exit, fail, BackendArg, Exit};
use crate::engine::Engine;
use crate::harness::{self, Contention, Fencelock, LockLib, Pairs, ReleaseStart, Sequential};
use crate::plumbing::{bounded, run_id, Out, Samples, Stop};
use crate::servers::Servers;
use crate::CLIENT_NAME;

use self::floor::{Bare, Scripts};
use self::handoff::Handoff;
use self::rslock::{Retry, Rslock};

const WORKERS: usize = 16;
const HOLD: Duration = Duration::from_millis(1);
const TTL: Duration = Duration::from_secs(10);
/// How long one contended acquire may wait, for both libraries.
const WAIT: Duration = Duration::from_secs(10);
/// The sequential loops take turns in slices of about this length.
const SLICE: Duration = Duration::from_millis(250);
/// `SET`s timed for the round trip, at the start and again at the end of every round.
const ROUND_TRIP_SAMPLES: usize = 1000;

#[derive(Args, Debug)]
pub(crate) struct PeersArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Length of each timed run (each library's sequential and contended runs), in seconds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=600))]
    seconds: u64,
    /// Rounds; every figure printed is the median over them.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// rslock: attempts per `lock` call before `acquire` starts over.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    rslock_retry_count: u32,
    /// rslock: a refused attempt sleeps a random whole number of milliseconds below this.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
    rslock_retry_delay_ms: u64,
    /// Print every figure as one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// What one library measured in one round.
pub(crate) struct LibRound {
    pub(crate) sequential: Pairs,
    /// `default`, then `fair` where the library has it.
    pub(crate) modes: Vec<(&'static str, Contention)>,
}

pub(crate) struct Round {
    /// Which library ran first.
    pub(crate) first: &'static str,
    /// p50 of a plain `SET` on the first node, timed at the round's start and end.
    pub(crate) round_trip: Duration,
    pub(crate) fencelock: LibRound,
    pub(crate) rslock: LibRound,
    /// The bare `redis` crate's sequential pairs with each set of scripts (see [`floor`]).
    pub(crate) floors: Vec<(Scripts, Pairs)>,
    /// One node only: the least fair handoff's contended run (see [`handoff`]).
    pub(crate) handoff: Option<Contention>,
}

/// The run's fixed settings, for the output.
pub(crate) struct Setup {
    pub(crate) engine: &'static str,
    pub(crate) nodes: Vec<String>,
    pub(crate) seconds: u64,
    pub(crate) rounds: u32,
    pub(crate) retry: Retry,
    pub(crate) base: String,
}

pub(crate) async fn run(args: PeersArgs) -> Result<u8> {
    let url = args.backend.url()?;
    let target = match Engine::parse(&url) {
        Ok(Engine::Redis(t)) => t,
        Ok(_) => {
            eprintln!(
                "fencelock-bench peers: rslock is a Redis lock; give --backend redis://, \
                 rediss:// or redlock://"
            );
            return Err(Exit(exit::USAGE).into());
        }
        Err(e) => {
            eprintln!("fencelock-bench peers: backend URL: {e}");
            return Err(Exit(exit::USAGE).into());
        }
    };
    let retry = Retry {
        count: args.rslock_retry_count,
        delay: Duration::from_millis(args.rslock_retry_delay_ms),
    };
    let setup = Setup {
        engine: if target.quorum { "redlock" } else { "redis" },
        nodes: target.nodes.iter().map(ToString::to_string).collect(),
        seconds: args.seconds,
        rounds: args.rounds,
        retry,
        base: format!("fencelock-bench-{}", run_id()),
    };
    let servers = Servers::open(target).await?;
    let rs = Rslock::new(&url, TTL, WAIT, retry).map_err(|e| {
        eprintln!("fencelock-bench peers: rslock: {e}");
        Exit(exit::USAGE)
    })?;
    let mut floors = Vec::new();
    for scripts in [Scripts::Fencelock, Scripts::Minimal, Scripts::Transaction] {
        let bare = Bare::connect(&url, scripts, fencelock::DEFAULT_PREFIX)
            .await
            .map_err(|e| {
                eprintln!("fencelock-bench peers: {}: {e}", scripts.label());
                Exit(exit::UNAVAILABLE)
            })?;
        floors.push(bare);
    }
    let handoff = if setup.engine == "redis" {
        let floor = Handoff::connect(&url, fencelock::DEFAULT_PREFIX)
            .await
            .map_err(|e| {
                eprintln!("fencelock-bench peers: handoff floor: {e}");
                Exit(exit::UNAVAILABLE)
            })?;
        Some(Arc::new(floor))
    } else {
        None
    };
    let client = connect(&args.backend, CLIENT_NAME).await?;
    let stop = Stop::on_interrupt();
    let mut out = Out::new(args.json, stop.clone());
    report::header(&mut out, &setup);

    let libs = Libs {
        default: Arc::new(Fencelock {
            client: client.clone(),
            opts: LockOptions::default().ttl(TTL).wait(WAIT),
        }),
        fair: Arc::new(Fencelock {
            client: client.clone(),
            opts: LockOptions::default().ttl(TTL).wait(WAIT).fair(true),
        }),
        rslock: Arc::new(rs),
        floors,
        handoff,
    };
    let dur = Duration::from_secs(args.seconds);
    let mut rounds = Vec::new();
    let mut outcome = Ok(());
    for r in 1..=args.rounds {
        if stop.is_set() {
            break;
        }
        match libs.round(r, &servers, &setup.base, dur, &stop).await {
            // A round cut short by Ctrl-C would skew the medians.
            Ok(_) if stop.is_set() => break,
            Ok(round) => {
                report::round_line(&mut out, r, &round);
                rounds.push(round);
            }
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    // Clean-up runs whatever happened above: every key of this run's names, both libraries'
    // (rslock's keys are the names themselves, fencelock's sit under its prefix).
    let cleaned = servers.unlink_matching(&format!("*{}-*", setup.base)).await;
    client.close().await;
    if !rounds.is_empty() && outcome.is_ok() {
        report::summary(&mut out, &setup, &rounds);
    }
    match cleaned {
        Ok(n) => {
            out.line(format!(
                "clean-up: deleted {n} keys of {}-* on {} node(s)",
                setup.base,
                setup.nodes.len()
            ));
            out.num("clean_up.deleted_keys", n as f64);
        }
        Err(e) => out.line(format!("clean-up: incomplete: {e}")),
    }
    out.end_run(outcome, &stop)
}

struct Libs {
    default: Arc<Fencelock>,
    fair: Arc<Fencelock>,
    rslock: Arc<Rslock>,
    floors: Vec<Bare>,
    handoff: Option<Arc<Handoff>>,
}

impl Libs {
    async fn round(
        &self,
        r: u32,
        servers: &Servers,
        base: &str,
        dur: Duration,
        stop: &Stop,
    ) -> Result<Round> {
        let rtt_key = format!("{base}-round-trip");
        let mut rtt = round_trip(servers, &rtt_key).await?;
        let (f_seq, s_seq, floors) = self.sequential(r, base, dur, stop).await?;
        // Odd rounds start with fencelock, even ones with rslock.
        let (fencelock, rslock, first) = if r % 2 == 1 {
            let f = self.fencelock(f_seq, base, dur, stop).await?;
            let s = self.rslock(s_seq, base, dur, stop).await?;
            (f, s, "fencelock")
        } else {
            let s = self.rslock(s_seq, base, dur, stop).await?;
            let f = self.fencelock(f_seq, base, dur, stop).await?;
            (f, s, "rslock")
        };
        let handoff = match &self.handoff {
            Some(floor) => {
                let name = format!("{base}-handoff-floor-contended");
                Some(contend(floor, &name, dur, stop, handoff_failed).await?)
            }
            None => None,
        };
        rtt.extend(round_trip(servers, &rtt_key).await?);
        Ok(Round {
            first,
            round_trip: Samples::new(rtt).p(50.0),
            fencelock,
            rslock,
            floors,
            handoff,
        })
    }

    /// The sequential loops of fencelock, rslock and the floors, each `dur` in all, taking
    /// turns in slices of about [`SLICE`] (see [`harness::Sequential`]): fencelock and rslock
    /// swap places from one slice to the next, and the floors follow them.
    async fn sequential(
        &self,
        r: u32,
        base: &str,
        dur: Duration,
        stop: &Stop,
    ) -> Result<(Pairs, Pairs, Vec<(Scripts, Pairs)>)> {
        let slices = u32::try_from(dur.as_millis() / SLICE.as_millis())
            .unwrap_or(u32::MAX)
            .max(1);
        let slice = dur / slices;
        let f_name = |i: u64| format!("{base}-fencelock-seq-{r}-{i}");
        let s_name = |i: u64| format!("{base}-rslock-seq-{r}-{i}");
        let floor_name = |kind: Scripts| move |i: u64| format!("{base}-{}-seq-{r}-{i}", kind.key());
        let floor_failed = |kind: Scripts| {
            move |e: redis::RedisError| {
                eprintln!("fencelock-bench peers: {}: {e}", kind.label());
                anyhow::Error::from(Exit(exit::UNAVAILABLE))
            }
        };
        let mut f = bounded(dur, Sequential::start(&*self.default, f_name))
            .await?
            .map_err(fail)?;
        let mut s = bounded(dur, Sequential::start(&*self.rslock, s_name))
            .await?
            .map_err(rslock_failed)?;
        let mut floors = Vec::new();
        for bare in &self.floors {
            let kind = bare.scripts();
            let run = bounded(dur, Sequential::start(bare, floor_name(kind)))
                .await?
                .map_err(floor_failed(kind))?;
            floors.push(run);
        }
        for k in 0..slices {
            for fencelock_turn in if (k + r) % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            } {
                if fencelock_turn {
                    bounded(slice, f.slice(&*self.default, f_name, slice, stop))
                        .await?
                        .map_err(fail)?;
                } else {
                    bounded(slice, s.slice(&*self.rslock, s_name, slice, stop))
                        .await?
                        .map_err(rslock_failed)?;
                }
            }
            for (bare, run) in self.floors.iter().zip(&mut floors) {
                let kind = bare.scripts();
                bounded(slice, run.slice(bare, floor_name(kind), slice, stop))
                    .await?
                    .map_err(floor_failed(kind))?;
            }
        }
        let floors = self
            .floors
            .iter()
            .zip(floors)
            .map(|(bare, run)| (bare.scripts(), run.pairs()))
            .collect();
        Ok((f.pairs(), s.pairs(), floors))
    }

    async fn fencelock(
        &self,
        seq: Pairs,
        base: &str,
        dur: Duration,
        stop: &Stop,
    ) -> Result<LibRound> {
        let name = format!("{base}-fencelock-contended");
        let default = contend(&self.default, &name, dur, stop, fail).await?;
        let fair_name = format!("{base}-fencelock-contended-fair");
        let fair = contend(&self.fair, &fair_name, dur, stop, fail).await?;
        Ok(LibRound {
            sequential: seq,
            modes: vec![("default", default), ("fair", fair)],
        })
    }

    async fn rslock(&self, seq: Pairs, base: &str, dur: Duration, stop: &Stop) -> Result<LibRound> {
        let name = format!("{base}-rslock-contended");
        let default = contend(&self.rslock, &name, dur, stop, rslock_failed).await?;
        Ok(LibRound {
            sequential: seq,
            modes: vec![("default", default)],
        })
    }
}

fn handoff_failed(e: redis::RedisError) -> anyhow::Error {
    eprintln!("fencelock-bench peers: handoff floor: {e}");
    Exit(exit::UNAVAILABLE).into()
}

fn rslock_failed(e: ::rslock::LockError) -> anyhow::Error {
    eprintln!("fencelock-bench peers: rslock: {e}");
    Exit(exit::UNAVAILABLE).into()
}

/// [`WORKERS`] tasks on the shared runtime, one library client between them, all on `name`
/// for `dur`. Every task is joined before this returns, so none is left holding the lock.
async fn contend<L: LockLib>(
    lib: &Arc<L>,
    name: &str,
    dur: Duration,
    stop: &Stop,
    failed: fn(L::Error) -> anyhow::Error,
) -> Result<Contention> {
    let released_at: ReleaseStart = Arc::new(Mutex::new(None));
    let go = Arc::new(Barrier::new(WORKERS));
    let mut tasks = JoinSet::new();
    for _ in 0..WORKERS {
        let (lib, name, go) = (lib.clone(), name.to_owned(), go.clone());
        let (released_at, stop) = (released_at.clone(), stop.clone());
        tasks.spawn(async move {
            go.wait().await;
            harness::worker(&*lib, &name, HOLD, dur, &released_at, &stop).await
        });
    }
    let joined = bounded(dur + WAIT, async {
        let mut workers = Vec::with_capacity(WORKERS);
        let mut first_error = None;
        while let Some(j) = tasks.join_next().await {
            match j {
                Ok(Ok(w)) => workers.push(w),
                Ok(Err(e)) => {
                    first_error.get_or_insert_with(|| failed(e));
                }
                Err(e) => {
                    first_error.get_or_insert(anyhow::anyhow!("a bench task failed: {e}"));
                }
            }
        }
        first_error.map_or(Ok(workers), Err)
    })
    .await;
    // Abandoned workers (a wedged phase) must not run on into the next one.
    tasks.abort_all();
    Ok(Contention::of(&joined??, dur))
}

/// [`ROUND_TRIP_SAMPLES`] plain `SET`s on the first node, one at a time, through the redis
/// crate's multiplexed connection on this runtime.
async fn round_trip(servers: &Servers, key: &str) -> Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(ROUND_TRIP_SAMPLES);
    for _ in 0..ROUND_TRIP_SAMPLES {
        let t = tokio::time::Instant::now();
        servers.text(0, &["SET", key, "1"]).await.map_err(|e| {
            eprintln!("fencelock-bench peers: round trip: {e}");
            Exit(exit::UNAVAILABLE)
        })?;
        samples.push(t.elapsed());
    }
    Ok(samples)
}
