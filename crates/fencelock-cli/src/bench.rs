//! `fencelock bench`: throughput and latency of one engine, against targets and, for Redis
//! engines, against `redis-benchmark` run on the same server(s) in the same run.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::RedisNode;
use fencelock::{Client, ErrorKind, Lease, LockOptions};
use tokio::sync::{mpsc, oneshot, watch, Barrier};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::{connect, exit, fail, BackendArg, Exit};

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "redis")]
mod floor;
#[cfg(feature = "postgres")]
mod postgres;
mod runtime;

type LibResult<T> = std::result::Result<T, fencelock::Error>;

const CLIENT_NAME: &str = "fencelock-bench";
const CONCURRENT_TASKS: usize = 64;
const CONTENDERS: usize = 16;
const HOLD: Duration = Duration::from_millis(1);
const CONTENTION_WAIT: Duration = Duration::from_secs(10);
const RENEWAL_LEASES: usize = 10_000;
const RENEWAL_IN_FLIGHT: usize = 256;
/// Slack on top of a phase's nominal length before it is abandoned: every library call is
/// already bounded by the client's 5 s operation timeout, so this only catches a wedged phase.
const PHASE_SLACK: Duration = Duration::from_secs(40);

const TARGET_SEQ_REDIS: f64 = 0.80;
const TARGET_SEQ_REDLOCK: f64 = 0.65;
const TARGET_ACQ_PER_S: f64 = 900.0;
const TARGET_HANDOFF_P50: Duration = Duration::from_micros(150);
const TARGET_WAIT_P99: Duration = Duration::from_millis(50);
const TARGET_FAIR_RATIO: f64 = 1.5;
const TARGET_RENEWAL_CALLS: f64 = 50.0;
const TARGET_RENEWAL_TTL: Duration = Duration::from_secs(30);

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Length of each timed run (uncontended and contention), in seconds.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=600))]
    seconds: u64,
    /// Shorter renewal window: 6 s with a 3 s TTL (instead of 25 s at 30 s), so that renewals
    /// still fall inside it.
    #[arg(long)]
    quick: bool,
    /// Print the figures as one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub async fn bench(args: BenchArgs) -> Result<u8> {
    let url = match &args.backend.backend {
        Some(u) => u.clone(),
        None => fencelock::default_url().map_err(fail)?,
    };
    let client = connect(&args.backend, CLIENT_NAME).await?;
    let engine = client.engine();
    let stop = Stop::on_interrupt();
    let mut out = Out::new(args.json, stop.clone());
    let dur = Duration::from_secs(args.seconds);
    let mut names = Names::new(&run_id());

    let servers = match engine {
        "redis" | "redlock" => Some(Servers::open(&url).await?),
        _ => None,
    };
    #[cfg(feature = "etcd")]
    let etcd_ref = match engine {
        "etcd" => Some(etcd::EtcdReference::open(&url, &names.base).await),
        _ => None,
    };
    let reference = match &servers {
        Some(s) => Reference::prepare(s).await,
        None if engine.starts_with("postgres") => Err("pgbench, measured in section 4".to_owned()),
        #[cfg(feature = "etcd")]
        None if engine == "etcd" => Err(match &etcd_ref {
            Some(Ok(_)) => "etcd's own Put rate on the same cluster, measured after each \
                            uncontended run"
                .to_owned(),
            Some(Err(e)) => format!("unavailable (no etcd connection: {e})"),
            None => String::new(),
        }),
        None => Err(format!("not applicable to the {engine} engine")),
    };

    out.line(format!(
        "fencelock bench: engine {engine} at {}, {} s per timed run{}, names {}-*",
        client.url(),
        args.seconds,
        if args.quick { ", quick" } else { "" },
        names.base
    ));
    out.text("engine", engine);
    out.num("seconds", args.seconds as f64);
    match &reference {
        Ok(r) => out.line(format!("reference: {} against {}", r.version, r.node)),
        Err(why) if engine == "etcd" => out.line(format!("reference: {why}")),
        Err(why) => out.line(format!("reference: unavailable ({why})")),
    }
    if let Ok(r) = &reference {
        out.text("reference.tool", &r.version);
    }

    let mut bench = Bench {
        client: &client,
        backend: &args.backend,
        engine,
        dur,
        stop: &stop,
        out: &mut out,
        names: &mut names,
        reference: reference.as_ref().ok(),
        #[cfg(feature = "etcd")]
        etcd: etcd_ref.as_ref().and_then(|r| r.as_ref().ok()),
    };
    let outcome = bench.all(args.quick, servers.as_ref()).await;
    #[cfg(feature = "postgres")]
    if outcome.is_ok() && engine.starts_with("postgres") && !stop.is_set() {
        postgres::reference(&url, args.seconds, &mut out, &stop).await;
    }

    // Clean-up runs whatever happened above, so an engine failure mid-run leaves no bench keys.
    let cleaned = match &servers {
        Some(s) => s.delete_bench_keys(&client, &names.used, &reference).await,
        #[cfg(feature = "etcd")]
        None if engine == "etcd" => match &etcd_ref {
            Some(Ok(r)) => r.clean().await,
            Some(Err(e)) => Err(format!("no reference connection: {e}")),
            None => Ok(String::new()),
        },
        None => Ok(format!(
            "the {engine} engine keeps a row per name with its fencing counter ({} names under \
             {}-*)",
            names.used.len(),
            names.base
        )),
    };
    client.close().await;
    // A failed phase may have left leases to expire on their own; only a clean run can say
    // that every lease was released.
    let released = if outcome.is_ok() {
        "released every lease; "
    } else {
        ""
    };
    match cleaned {
        Ok(msg) => out.line(format!("clean-up: {released}{msg}")),
        Err(e) => out.line(format!("clean-up: incomplete: {e}")),
    }
    out.finish();
    outcome?;
    if stop.is_set() {
        eprintln!("fencelock: bench interrupted");
        return Ok(130);
    }
    Ok(0)
}

struct Bench<'a> {
    client: &'a Client,
    backend: &'a BackendArg,
    engine: &'static str,
    dur: Duration,
    stop: &'a Stop,
    out: &'a mut Out,
    names: &'a mut Names,
    reference: Option<&'a Reference>,
    #[cfg(feature = "etcd")]
    etcd: Option<&'a etcd::EtcdReference>,
}

impl Bench<'_> {
    async fn all(&mut self, quick: bool, servers: Option<&Servers>) -> Result<()> {
        self.uncontended(servers).await?;
        if !self.stop.is_set() {
            self.contention(servers).await?;
        }
        if !self.stop.is_set() {
            self.renewal(quick, servers).await?;
        }
        Ok(())
    }

    async fn uncontended(&mut self, servers: Option<&Servers>) -> Result<()> {
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
        // The same run on the CLI's own runtime, where the client's tasks and this loop wake
        // each other across two worker threads: the difference is that toll, not the lock's.
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
                e.report(self.out, self.dur, self.stop, seq, &par).await;
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
            let (limit, what) = if self.engine == "redlock" {
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

    async fn contention(&mut self, servers: Option<&Servers>) -> Result<()> {
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
            if self.engine == "sqlite" {
                ""
            } else {
                " and wake-up subscription"
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

    async fn renewal(&mut self, quick: bool, servers: Option<&Servers>) -> Result<()> {
        let (ttl, window) = if quick {
            (Duration::from_secs(3), Duration::from_secs(6))
        } else {
            (TARGET_RENEWAL_TTL, Duration::from_secs(25))
        };
        self.out.line(String::new());
        self.out.line(format!(
            "== 3. renewal load: {} leases, TTL {}, auto-renew, window {} ==",
            rate(RENEWAL_LEASES as f64),
            dur(ttl),
            dur(window)
        ));
        let Some(servers) = servers else {
            self.out.line(format!(
                "skipped: Redis engines only (engine {})",
                self.engine
            ));
            return Ok(());
        };
        let names: Vec<String> = (0..RENEWAL_LEASES)
            .map(|i| self.names.take(&format!("renew-{i}")))
            .collect();
        let opts = LockOptions::default().ttl(ttl);
        let started = Instant::now();
        let leases = acquire_many(self.client, names, &opts, self.stop).await?;
        let took = started.elapsed();
        self.out.line(format!(
            "acquired {} in {} ({}/s, {RENEWAL_IN_FLIGHT} in flight)",
            rate(leases.len() as f64),
            dur(took),
            rate(leases.len() as f64 / took.as_secs_f64())
        ));

        let before = servers.commandstats().await;
        let window_start = Instant::now();
        tokio::select! {
            _ = tokio::time::sleep(window) => {}
            _ = self.stop.wait() => {}
        }
        let after = servers.commandstats().await;
        let elapsed = window_start.elapsed();
        let lost = leases.iter().filter(|l| l.is_lost()).count();

        let started = Instant::now();
        let (released, failed) = release_many(leases).await;
        let release_took = started.elapsed();

        match (before, after) {
            (Ok(before), Ok(after)) => {
                self.renewal_calls(servers, &before, &after, elapsed, ttl)
                    .await;
            }
            (Err(e), _) | (_, Err(e)) => {
                self.out
                    .line(format!("server call counts unavailable: {e}"));
            }
        }
        self.out.line(format!(
            "leases lost during the window: {lost}; released {} in {}{}",
            rate(released as f64),
            dur(release_took),
            if failed.is_empty() {
                String::new()
            } else {
                format!(" ({} failed, first: {})", failed.len(), failed[0])
            }
        ));
        self.out.num("renewal.lost", lost as f64);
        self.out
            .num("renewal.release_failures", failed.len() as f64);
        Ok(())
    }
}

impl Bench<'_> {
    async fn renewal_calls(
        &mut self,
        servers: &Servers,
        before: &[CommandStats],
        after: &[CommandStats],
        elapsed: Duration,
        ttl: Duration,
    ) {
        let secs = elapsed.as_secs_f64();
        let (mut all, mut requests) = (0u64, Some(0u64));
        for (node, ((addr, b), a)) in servers.addrs.iter().zip(before).zip(after).enumerate() {
            let d = CommandStats::delta(b, a);
            // The window's opening INFO is counted once it has been answered, so it falls
            // inside the delta; the closing one does not.
            let calls = d.total().saturating_sub(1);
            all += calls;
            let req = servers.requests(node, &d).await;
            let req_text = match &req {
                Ok(r) => format!("{} requests/s, ", rate2(*r as f64 / secs)),
                Err(e) => format!("requests unknown ({e}), "),
            };
            requests = requests.zip(req.ok()).map(|(t, r)| t + r);
            self.out.line(format!(
                "  node {addr}: {req_text}{} commands/s ({calls} commands: {})",
                rate2(calls as f64 / secs),
                d.top(5, "info", 1)
            ));
            self.out.num(
                &format!("renewal.node.{addr}.commands_per_s"),
                calls as f64 / secs,
            );
        }
        let all_per_s = all as f64 / secs;
        self.out.line(format!(
            "all commands (every cmdstat_*, including those run inside scripts) over {} \
             node(s): {all} = {}/s",
            servers.addrs.len(),
            rate2(all_per_s)
        ));
        self.out.num("renewal.commands_per_s", all_per_s);
        let Some(requests) = requests else {
            return;
        };
        let per_s = requests as f64 / secs;
        self.out.line(format!(
            "requests (calls of commands no script can run: EVALSHA, EVAL, SCRIPT, ...): \
             {requests} = {}/s",
            rate2(per_s)
        ));
        self.out.num("renewal.requests_per_s", per_s);
        if ttl == TARGET_RENEWAL_TTL {
            self.out.target(
                "renewal.requests_per_s",
                &format!(
                    "renewal requests <= {TARGET_RENEWAL_CALLS:.0}/s ({} leases, TTL {})",
                    rate(RENEWAL_LEASES as f64),
                    dur(TARGET_RENEWAL_TTL)
                ),
                &rate2(per_s),
                Some(per_s <= TARGET_RENEWAL_CALLS),
            );
        } else {
            // Renewals run every TTL/3, so the request rate scales with 1/TTL.
            let scaled = per_s * ttl.as_secs_f64() / TARGET_RENEWAL_TTL.as_secs_f64();
            self.out.target(
                "renewal.requests_per_s",
                &format!(
                    "renewal requests <= {TARGET_RENEWAL_CALLS:.0}/s at TTL {} (scaled from {})",
                    dur(TARGET_RENEWAL_TTL),
                    dur(ttl)
                ),
                &format!("~{}", rate2(scaled)),
                None,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Uncontended runs

struct Uncontended {
    ops_per_s: f64,
    pair: Samples,
    acquire: Samples,
    release: Samples,
}

#[derive(Default)]
struct PairTimes {
    pair: Vec<Duration>,
    acquire: Vec<Duration>,
    release: Vec<Duration>,
}

impl PairTimes {
    /// One try_acquire + release, timed unless `record` is off (warm-up).
    async fn one(
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

// ---------------------------------------------------------------------------------------------
// Contention

struct Contention {
    per_s: f64,
    handoff: Samples,
    wait: Samples,
    min: u64,
    max: u64,
    hold_mean: Duration,
    idle: f64,
    timeouts: u64,
    /// Server requests per acquisition, summed over nodes; Redis engines only.
    requests_per_acq: Option<f64>,
}

impl Contention {
    fn ratio(&self) -> Option<f64> {
        (self.min > 0).then(|| self.max as f64 / self.min as f64)
    }
}

#[derive(Default)]
struct WorkerTimes {
    /// Acquisitions inside the timed window.
    acquired: u64,
    /// Every acquisition, the ones finishing after the window included.
    all_acquired: u64,
    waits: Vec<Duration>,
    handoffs: Vec<Duration>,
    held: Duration,
    timeouts: u64,
}

type ReleaseStart = Arc<Mutex<Option<Instant>>>;

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
    let (mut c, all_acquired) = contend(crew, name, fair, dur).await?;
    if let (Some(s), Some(before)) = (servers, before) {
        if let Ok(after) = s.commandstats().await {
            let mut requests = 0;
            for (node, (b, a)) in before.iter().zip(&after).enumerate() {
                requests += s
                    .requests(node, &CommandStats::delta(b, a))
                    .await
                    .unwrap_or(0);
            }
            if all_acquired > 0 {
                c.requests_per_acq = Some(requests as f64 / all_acquired as f64);
            }
        }
    }
    Ok(c)
}

/// Returns the figures and the number of acquisitions in all (the window's and the stragglers').
async fn contend(crew: &Crew, name: &str, fair: bool, dur: Duration) -> Result<(Contention, u64)> {
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
    let workers = gather(answers).await?;
    let mut handoffs = Vec::new();
    let mut waits = Vec::new();
    let mut held = Duration::ZERO;
    let (mut total, mut timeouts, mut all_acquired) = (0, 0, 0);
    for w in &workers {
        all_acquired += w.all_acquired;
        handoffs.extend_from_slice(&w.handoffs);
        waits.extend_from_slice(&w.waits);
        held += w.held;
        total += w.acquired;
        timeouts += w.timeouts;
    }
    let counts = workers.iter().map(|w| w.acquired);
    let contention = Contention {
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
        requests_per_acq: None,
    };
    Ok((contention, all_acquired))
}

async fn worker(
    client: &Client,
    name: &str,
    opts: &LockOptions,
    dur: Duration,
    released_at: &ReleaseStart,
    stop: &Stop,
) -> LibResult<WorkerTimes> {
    let mut w = WorkerTimes::default();
    let end = Instant::now() + dur;
    while Instant::now() < end && !stop.is_set() {
        let asked = Instant::now();
        let lease = match client.acquire(name, opts).await {
            Ok(lease) => lease,
            Err(e) if e.kind() == ErrorKind::TimedOut => {
                w.timeouts += 1;
                continue;
            }
            Err(e) => return Err(e),
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
        hold(HOLD).await;
        let releasing = Instant::now();
        if in_window {
            w.held += releasing.min(end) - got;
        }
        *lock(released_at) = Some(releasing);
        lease.release().await?;
    }
    Ok(w)
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
                    worker(&client, &name, &opts, dur, &released_at, &stop).await
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Many leases at once

async fn acquire_many(
    client: &Client,
    names: Vec<String>,
    opts: &LockOptions,
    stop: &Stop,
) -> Result<Vec<Lease>> {
    let names = Arc::new(names);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..RENEWAL_IN_FLIGHT {
        let (client, names, next, opts, stop) = (
            client.clone(),
            names.clone(),
            next.clone(),
            opts.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let mut held = Vec::new();
            while !stop.is_set() {
                let Some(name) = names.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                match client.try_acquire(name, &opts).await {
                    Ok(lease) => held.push(lease),
                    Err(e) => return (held, Some(e)),
                }
            }
            (held, None)
        });
    }
    let mut leases = Vec::with_capacity(names.len());
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((held, err)) => {
                leases.extend(held);
                if first_error.is_none() {
                    first_error = err;
                }
            }
            Err(e) => return Err(anyhow::anyhow!("an acquiring task failed: {e}")),
        }
    }
    if let Some(e) = first_error {
        let _ = release_many(leases).await;
        return Err(fail(e));
    }
    Ok(leases)
}

/// Releases every lease, `RENEWAL_IN_FLIGHT` at a time. Returns how many were released and the
/// errors of those that were not.
async fn release_many(leases: Vec<Lease>) -> (usize, Vec<String>) {
    let mut shares: Vec<Vec<Lease>> = (0..RENEWAL_IN_FLIGHT).map(|_| Vec::new()).collect();
    for (i, lease) in leases.into_iter().enumerate() {
        shares[i % RENEWAL_IN_FLIGHT].push(lease);
    }
    let mut tasks = JoinSet::new();
    for share in shares {
        tasks.spawn(async move {
            let mut ok = 0;
            let mut errors = Vec::new();
            for lease in share {
                match lease.release().await {
                    Ok(()) => ok += 1,
                    Err(e) => errors.push(e.to_string()),
                }
            }
            (ok, errors)
        });
    }
    let (mut released, mut failed) = (0, Vec::new());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((ok, errors)) => {
                released += ok;
                failed.extend(errors);
            }
            Err(e) => failed.push(format!("a releasing task failed: {e}")),
        }
    }
    (released, failed)
}

// ---------------------------------------------------------------------------------------------
// Redis servers: node addresses, commandstats, reference runs, clean-up

/// The parts of a `redis://` or `redlock://` URL the bench needs to reach the nodes itself.
struct RedisTarget {
    nodes: Vec<RedisNode>,
    /// One `redis://` URL per node, credentials included, for the redis crate.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    urls: Vec<String>,
    user: Option<String>,
    password: Option<String>,
    db: i64,
}

fn redis_target(url: &str) -> std::result::Result<RedisTarget, String> {
    let backend = fencelock::Backend::parse(url).map_err(|e| e.to_string())?;
    let urls = backend.redis_node_urls();
    match backend {
        fencelock::Backend::Redis {
            nodes,
            user,
            password,
            db,
            ..
        } => Ok(RedisTarget {
            nodes,
            urls,
            user,
            password,
            db,
        }),
        _ => Err("not a Redis backend".to_owned()),
    }
}

/// The engine's nodes, reached directly (not through fencelock) to read their command counters
/// and to delete what the bench wrote.
struct Servers {
    target: RedisTarget,
    addrs: Vec<String>,
    conns: Vec<NodeConn>,
}

#[cfg(feature = "redis")]
type NodeConn = redis::aio::MultiplexedConnection;
// Without the feature no Redis URL gets past `connect`, so no node is ever opened.
#[cfg(not(feature = "redis"))]
type NodeConn = ();

const NODE_TIMEOUT: Duration = Duration::from_secs(5);

/// One reply of a node: a bulk string or an integer.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
enum Reply {
    Text(String),
    Int(i64),
}

impl Servers {
    async fn open(url: &str) -> Result<Servers> {
        let target = redis_target(url).map_err(|e| {
            eprintln!("fencelock: backend URL: {e}");
            Exit(exit::USAGE)
        })?;
        let mut conns = Vec::new();
        let mut addrs = Vec::new();
        for (node, node_url) in target.nodes.iter().zip(&target.urls) {
            match tokio::time::timeout(NODE_TIMEOUT, open_node(node_url)).await {
                Ok(Ok(c)) => conns.push(c),
                Ok(Err(e)) => {
                    eprintln!("fencelock: cannot reach redis node {node}: {e}");
                    return Err(Exit(exit::UNAVAILABLE).into());
                }
                Err(_) => {
                    eprintln!("fencelock: no answer from redis node {node} within 5s");
                    return Err(Exit(exit::UNAVAILABLE).into());
                }
            }
            addrs.push(node.to_string());
        }
        Ok(Servers {
            target,
            addrs,
            conns,
        })
    }

    async fn call(&self, node: usize, args: &[&str]) -> std::result::Result<Reply, String> {
        let (Some(conn), Some(addr)) = (self.conns.get(node), self.addrs.get(node)) else {
            return Err(format!("no node {node}"));
        };
        match tokio::time::timeout(NODE_TIMEOUT, call_node(conn, args)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{addr}: {}: {e}", args.first().unwrap_or(&""))),
            Err(_) => Err(format!("{addr}: no answer within 5s")),
        }
    }

    async fn text(&self, node: usize, args: &[&str]) -> std::result::Result<String, String> {
        match self.call(node, args).await? {
            Reply::Text(t) => Ok(t),
            Reply::Int(i) => Ok(i.to_string()),
        }
    }

    async fn int(&self, node: usize, args: &[&str]) -> std::result::Result<u64, String> {
        match self.call(node, args).await? {
            Reply::Int(i) => Ok(u64::try_from(i).unwrap_or(0)),
            Reply::Text(t) => t.parse().map_err(|_| format!("unexpected reply {t:?}")),
        }
    }

    /// Splits a node's call counts into requests (commands no script can run: EVALSHA, EVAL,
    /// SCRIPT, connection commands) and the rest, most of which the scripts ran.
    async fn requests(
        &self,
        node: usize,
        calls: &CommandStats,
    ) -> std::result::Result<u64, String> {
        let names: Vec<&str> = calls.calls.iter().map(|(n, _)| n.as_str()).collect();
        if names.is_empty() {
            return Ok(0);
        }
        let (Some(conn), Some(addr)) = (self.conns.get(node), self.addrs.get(node)) else {
            return Err(format!("no node {node}"));
        };
        let flags = match tokio::time::timeout(NODE_TIMEOUT, noscript_flags(conn, &names)).await {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => return Err(format!("{addr}: COMMAND INFO: {e}")),
            Err(_) => return Err(format!("{addr}: no answer within 5s")),
        };
        Ok(calls
            .calls
            .iter()
            .zip(flags)
            .filter(|(_, noscript)| *noscript)
            .map(|((_, n), _)| n)
            .sum())
    }

    async fn commandstats(&self) -> std::result::Result<Vec<CommandStats>, String> {
        let mut all = Vec::with_capacity(self.conns.len());
        for node in 0..self.conns.len() {
            let text = self.text(node, &["INFO", "commandstats"]).await?;
            all.push(CommandStats::parse(&text));
        }
        Ok(all)
    }

    /// Deletes the keys of every name the bench used (fencing counters, metadata, queues) on
    /// every node, and redis-benchmark's SET key if the bench created it. The names carry a
    /// random run id, so nothing else can be using these counters.
    async fn delete_bench_keys(
        &self,
        client: &Client,
        names: &[String],
        reference: &std::result::Result<Reference, String>,
    ) -> std::result::Result<String, String> {
        let mut keys = Vec::with_capacity(names.len() * 6);
        for name in names {
            let labelled = client.keys_for(name).map_err(|e| e.to_string())?;
            keys.extend(
                labelled
                    .into_iter()
                    .filter(|(label, _)| *label != "wake")
                    .map(|(_, k)| k),
            );
        }
        let mut deleted = 0u64;
        for node in 0..self.conns.len() {
            for chunk in keys.chunks(1000) {
                let mut args = vec!["UNLINK"];
                args.extend(chunk.iter().map(String::as_str));
                deleted += self.int(node, &args).await?;
            }
        }
        let mut msg = format!(
            "deleted {deleted} keys of {} bench names on {} node(s)",
            names.len(),
            self.conns.len()
        );
        if let Ok(r) = reference {
            if r.created_set_key {
                self.int(0, &["UNLINK", REFERENCE_SET_KEY]).await?;
                let _ = write!(msg, " and redis-benchmark's {REFERENCE_SET_KEY:?}");
            }
        }
        Ok(msg)
    }
}

#[cfg(feature = "redis")]
async fn open_node(url: &str) -> redis::RedisResult<NodeConn> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
}

#[cfg(feature = "redis")]
async fn call_node(conn: &NodeConn, args: &[&str]) -> redis::RedisResult<Reply> {
    let mut conn = conn.clone();
    let mut cmd = redis::Cmd::new();
    for a in args {
        cmd.arg(*a);
    }
    Ok(match cmd.query_async::<redis::Value>(&mut conn).await? {
        redis::Value::Int(i) => Reply::Int(i),
        other => Reply::Text(redis::from_redis_value(other)?),
    })
}

/// Which of `names` carry the `noscript` flag: commands a script cannot run, so every call
/// of them is a request some client sent.
#[cfg(feature = "redis")]
async fn noscript_flags(conn: &NodeConn, names: &[&str]) -> redis::RedisResult<Vec<bool>> {
    use redis::Value;
    let mut conn = conn.clone();
    let reply: Vec<Value> = redis::cmd("COMMAND")
        .arg("INFO")
        .arg(names)
        .query_async(&mut conn)
        .await?;
    Ok(reply
        .iter()
        .map(|info| match info {
            Value::Array(fields) => match fields.get(2) {
                Some(Value::Array(flags)) => flags.iter().any(|f| match f {
                    Value::SimpleString(s) => s == "noscript",
                    Value::BulkString(b) => b == b"noscript",
                    _ => false,
                }),
                _ => false,
            },
            _ => false,
        })
        .collect())
}

#[cfg(not(feature = "redis"))]
async fn noscript_flags(_: &NodeConn, _: &[&str]) -> std::result::Result<Vec<bool>, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[cfg(not(feature = "redis"))]
async fn open_node(_: &str) -> std::result::Result<NodeConn, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[cfg(not(feature = "redis"))]
async fn call_node(_: &NodeConn, _: &[&str]) -> std::result::Result<Reply, String> {
    Err("this build of fencelock lacks the `redis` feature".to_owned())
}

#[derive(Default)]
struct CommandStats {
    calls: Vec<(String, u64)>,
}

impl CommandStats {
    /// Reads `cmdstat_<name>:calls=N,...` lines of `INFO commandstats`.
    fn parse(text: &str) -> CommandStats {
        let calls = text
            .lines()
            .filter_map(|line| {
                let (name, fields) = line.strip_prefix("cmdstat_")?.split_once(':')?;
                let n = fields
                    .split(',')
                    .find_map(|f| f.strip_prefix("calls="))?
                    .trim()
                    .parse()
                    .ok()?;
                Some((name.to_owned(), n))
            })
            .collect();
        CommandStats { calls }
    }

    fn delta(before: &CommandStats, after: &CommandStats) -> CommandStats {
        let calls = after
            .calls
            .iter()
            .map(|(name, n)| {
                let was = before
                    .calls
                    .iter()
                    .find(|(b, _)| b == name)
                    .map_or(0, |(_, b)| *b);
                (name.clone(), n.saturating_sub(was))
            })
            .filter(|(_, n)| *n > 0)
            .collect();
        CommandStats { calls }
    }

    fn total(&self) -> u64 {
        self.calls.iter().map(|(_, n)| n).sum()
    }

    /// The busiest commands, with `own` calls of `own_cmd` (the bench's) taken off.
    fn top(&self, n: usize, own_cmd: &str, own: u64) -> String {
        let mut calls: Vec<(String, u64)> = self
            .calls
            .iter()
            .map(|(c, k)| {
                (
                    c.clone(),
                    if c == own_cmd {
                        k.saturating_sub(own)
                    } else {
                        *k
                    },
                )
            })
            .filter(|(_, k)| *k > 0)
            .collect();
        calls.sort_by_key(|c| std::cmp::Reverse(c.1));
        if calls.is_empty() {
            return "none".to_owned();
        }
        calls
            .iter()
            .take(n)
            .map(|(c, k)| format!("{c} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The key `redis-benchmark -t set` writes.
const REFERENCE_SET_KEY: &str = "key:__rand_int__";

/// `redis-benchmark` against the first node: SET, and EVALSHA of a trivial script, each the
/// cheapest single round trip of its kind, as a ceiling for one acquire plus one release.
#[derive(Clone)]
struct Reference {
    bin: String,
    version: String,
    node: String,
    args: Vec<String>,
    sha: String,
    created_set_key: bool,
}

#[derive(Clone)]
struct PairRate {
    set: f64,
    evalsha: f64,
}

impl PairRate {
    fn pair(&self) -> f64 {
        1.0 / (1.0 / self.set + 1.0 / self.evalsha)
    }
}

impl Reference {
    async fn prepare(servers: &Servers) -> std::result::Result<Reference, String> {
        let bin = std::env::var("FENCELOCK_REDIS_BENCHMARK")
            .ok()
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "redis-benchmark".to_owned());
        let version = tokio::process::Command::new(&bin)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| {
                format!("{bin}: {e}; install redis-tools or set FENCELOCK_REDIS_BENCHMARK")
            })?;
        let version = String::from_utf8_lossy(&version.stdout)
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        let t = &servers.target;
        let node = t.nodes.first().ok_or("no nodes")?;
        let mut args = vec![
            "-h".to_owned(),
            node.host.clone(),
            "-p".to_owned(),
            node.port.to_string(),
        ];
        if let Some(u) = &t.user {
            args.extend(["--user".to_owned(), u.clone()]);
        }
        if let Some(p) = &t.password {
            args.extend(["-a".to_owned(), p.clone()]);
        }
        if t.db != 0 {
            args.extend(["--dbnum".to_owned(), t.db.to_string()]);
        }
        let sha = servers.text(0, &["SCRIPT", "LOAD", "return 1"]).await?;
        let existed = servers.int(0, &["EXISTS", REFERENCE_SET_KEY]).await?;
        Ok(Reference {
            bin,
            version,
            node: servers.addrs[0].clone(),
            args,
            sha,
            created_set_key: existed == 0,
        })
    }

    async fn measure(&self, clients: u32) -> std::result::Result<PairRate, String> {
        self.measure_n(clients, if clients == 1 { 20_000 } else { 100_000 })
            .await
    }

    async fn measure_n(
        &self,
        clients: u32,
        requests: u32,
    ) -> std::result::Result<PairRate, String> {
        let set = self.rps(clients, requests, &["-t", "set"]).await?;
        let evalsha = self
            .rps(clients, requests, &["EVALSHA", &self.sha, "0"])
            .await?;
        Ok(PairRate { set, evalsha })
    }

    async fn rps(
        &self,
        clients: u32,
        requests: u32,
        test: &[&str],
    ) -> std::result::Result<f64, String> {
        let run = tokio::process::Command::new(&self.bin)
            .args(&self.args)
            .args([
                "-c",
                &clients.to_string(),
                "-n",
                &requests.to_string(),
                "-q",
                "--csv",
            ])
            .args(test)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .map_err(|_| format!("{} {} did not finish within 60s", self.bin, test.join(" ")))?
            .map_err(|e| format!("{}: {e}", self.bin))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        // --csv prints a header line, then `"TEST","rps",...` per test.
        stdout
            .lines()
            .filter_map(|l| {
                let mut fields = l.split(',').map(|f| f.trim().trim_matches('"'));
                let test = fields.next()?;
                let rps: f64 = fields.next()?.parse().ok()?;
                (test != "test" && rps > 0.0).then_some(rps)
            })
            .next()
            .ok_or_else(|| {
                let err = String::from_utf8_lossy(&output.stderr);
                format!(
                    "no rate in redis-benchmark's output: {}",
                    first_line(&stdout)
                        .or(first_line(&err))
                        .unwrap_or("(empty)")
                )
            })
    }
}

fn first_line(s: &str) -> Option<&str> {
    s.lines().map(str::trim).find(|l| !l.is_empty())
}

/// A reference measured before and after a fencelock run.
struct Bracket {
    set: f64,
    evalsha: f64,
    pair: f64,
    /// Each run's pair rate, in order.
    runs: Vec<f64>,
}

impl Bracket {
    fn of(
        results: impl IntoIterator<Item = Option<std::result::Result<PairRate, String>>>,
    ) -> std::result::Result<Bracket, String> {
        let (mut runs, mut errors) = (Vec::new(), Vec::new());
        for r in results.into_iter().flatten() {
            match r {
                Ok(r) => runs.push(r),
                Err(e) => errors.push(e),
            }
        }
        if runs.is_empty() {
            return Err(errors
                .into_iter()
                .next()
                .unwrap_or_else(|| "not run".to_owned()));
        }
        let n = runs.len() as f64;
        let pairs: Vec<f64> = runs.iter().map(PairRate::pair).collect();
        Ok(Bracket {
            set: runs.iter().map(|r| r.set).sum::<f64>() / n,
            evalsha: runs.iter().map(|r| r.evalsha).sum::<f64>() / n,
            pair: pairs.iter().sum::<f64>() / n,
            runs: pairs,
        })
    }
}

/// The median of some ratios (the mean of the middle two for an even count).
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

// ---------------------------------------------------------------------------------------------
// Plumbing

/// Latency samples, sorted for percentiles.
struct Samples(Vec<Duration>);

impl Samples {
    fn new(mut v: Vec<Duration>) -> Samples {
        v.sort_unstable();
        Samples(v)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Nearest-rank percentile; zero without samples.
    fn p(&self, pct: f64) -> Duration {
        let n = self.0.len();
        if n == 0 {
            return Duration::ZERO;
        }
        let rank = ((pct / 100.0) * n as f64).ceil() as usize;
        self.0[rank.clamp(1, n) - 1]
    }
}

/// The bench's resource names: one random run id, so runs never meet each other's (or
/// anybody's) locks, and the list of every name used, for clean-up.
struct Names {
    base: String,
    used: Vec<String>,
}

impl Names {
    fn new(run: &str) -> Names {
        Names {
            base: format!("fencelock-bench-{run}"),
            used: Vec::new(),
        }
    }

    fn take(&mut self, what: &str) -> String {
        let name = format!("{}-{what}", self.base);
        self.used.push(name.clone());
        name
    }
}

fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:x}{:08x}", std::process::id(), nanos)
}

/// Set on Ctrl-C: every phase stops early and the bench still releases what it holds. A second
/// Ctrl-C exits at once.
#[derive(Clone)]
struct Stop(Arc<watch::Sender<bool>>);

impl Stop {
    fn on_interrupt() -> Stop {
        let stop = Stop(Arc::new(watch::channel(false).0));
        let s = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("fencelock: interrupted; releasing what the bench holds");
                s.set();
                if tokio::signal::ctrl_c().await.is_ok() {
                    std::process::exit(130);
                }
            }
        });
        stop
    }

    fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    fn set(&self) {
        self.0.send_replace(true);
    }

    async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|set| *set).await;
    }
}

/// Bounds a phase: `nominal` plus [`PHASE_SLACK`].
async fn bounded<T>(nominal: Duration, fut: impl std::future::Future<Output = T>) -> Result<T> {
    let limit = nominal + PHASE_SLACK;
    tokio::time::timeout(limit, fut).await.map_err(|_| {
        eprintln!(
            "fencelock: a bench phase did not finish within {}",
            dur(limit)
        );
        Exit(exit::UNAVAILABLE).into()
    })
}

/// Waits for every task; the first error wins (and is reported once), but only after all have
/// stopped, so no task is left holding a lease.
async fn join_all<T: 'static>(mut tasks: JoinSet<LibResult<T>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_error.get_or_insert_with(|| fail(e));
            }
            Err(e) => {
                first_error.get_or_insert(anyhow::anyhow!("a bench task failed: {e}"));
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Human tables on stdout as the run goes, or one JSON object at the end.
struct Out {
    json: bool,
    fields: Vec<(String, String)>,
    stop: Stop,
}

impl Out {
    fn new(json: bool, stop: Stop) -> Out {
        Out {
            json,
            fields: Vec::new(),
            stop,
        }
    }

    fn line(&mut self, s: impl AsRef<str>) {
        if !self.json {
            self.write(s.as_ref());
        }
    }

    /// A reader that went away (`| head`) ends the run like Ctrl-C does, so the bench still
    /// releases its leases and deletes its keys instead of dying on a broken pipe.
    fn write(&self, s: &str) {
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        if writeln!(stdout, "{s}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            self.stop.set();
        }
    }

    fn num(&mut self, key: &str, v: f64) {
        let v = if v.is_finite() {
            format!("{}", (v * 1000.0).round() / 1000.0)
        } else {
            "null".to_owned()
        };
        self.fields.push((key.to_owned(), v));
    }

    /// The last number recorded under `key`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    fn value(&self, key: &str) -> Option<f64> {
        let (_, v) = self.fields.iter().rev().find(|(k, _)| k == key)?;
        v.parse().ok()
    }

    fn micros(&mut self, key: &str, d: Duration) {
        self.num(key, d.as_secs_f64() * 1e6);
    }

    fn text(&mut self, key: &str, v: &str) {
        self.fields.push((key.to_owned(), crate::json::string(v)));
    }

    /// A target line next to its figure; `pass` is `None` where no verdict applies.
    fn target(&mut self, key: &str, what: &str, measured: &str, pass: Option<bool>) {
        let verdict = match pass {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None => "-",
        };
        self.line(format!("  target  {what:<58} {measured:>9}  {verdict}"));
        if pass.is_some() {
            self.text(&format!("{key}.target"), verdict);
        }
    }

    fn finish(&self) {
        if !self.json {
            return;
        }
        let body = self
            .fields
            .iter()
            .map(|(k, v)| format!("{}:{v}", crate::json::string(k)))
            .collect::<Vec<_>>()
            .join(",");
        self.write(&format!("{{{body}}}"));
    }
}

/// A rate with thousands separators, no decimals.
fn rate(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A small rate, with one decimal below 100.
fn rate2(v: f64) -> String {
    if v < 100.0 {
        format!("{v:.1}")
    } else {
        rate(v)
    }
}

fn ratio_text(r: Option<f64>) -> String {
    r.map_or("-".to_owned(), |r| format!("{r:.2}"))
}

fn dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0}µs")
    } else if us < 10_000.0 {
        format!("{:.2}ms", us / 1000.0)
    } else if us < 1_000_000.0 {
        format!("{:.1}ms", us / 1000.0)
    } else if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.2}s", d.as_secs_f64())
    }
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
    fn redis_urls_give_node_addresses_and_credentials() {
        let Ok(t) = redis_target("redlock://app:p%40ss@10.0.0.1:7000,[::1]:7001,h/3") else {
            unreachable!("parse failed")
        };
        let addrs: Vec<String> = t.nodes.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["10.0.0.1:7000", "[::1]:7001", "h:6379"]);
        assert_eq!(t.user.as_deref(), Some("app"));
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        assert_eq!(t.urls[0], "redis://app:p%40ss@10.0.0.1:7000/3");
        assert_eq!(t.db, 3);
        assert!(redis_target("sqlite:///tmp/x.db").is_err());
    }

    #[test]
    fn commandstats_deltas_and_percentiles() {
        let before = CommandStats::parse(
            "# Commandstats\r\ncmdstat_evalsha:calls=10,usec=5\r\ncmdstat_info:calls=2,usec=1\r\n",
        );
        let after = CommandStats::parse(
            "# Commandstats\r\ncmdstat_evalsha:calls=30,usec=9\r\ncmdstat_info:calls=3,usec=1\r\n\
             cmdstat_unlink:calls=4,usec=1\r\n",
        );
        let d = CommandStats::delta(&before, &after);
        assert_eq!(d.total(), 25);
        assert_eq!(d.top(4, "info", 1), "evalsha 20, unlink 4");

        let s = Samples::new((1..=100).rev().map(Duration::from_micros).collect());
        assert_eq!(s.p(50.0), Duration::from_micros(50));
        assert_eq!(s.p(99.0), Duration::from_micros(99));
        assert_eq!(Samples::new(Vec::new()).p(99.0), Duration::ZERO);
    }

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

    #[test]
    fn figures_read_well() {
        assert_eq!(rate(1234567.4), "1,234,567");
        assert_eq!(rate(999.0), "999");
        assert_eq!(dur(Duration::from_micros(48)), "48µs");
        assert_eq!(dur(Duration::from_micros(1234)), "1.23ms");
        assert_eq!(dur(Duration::from_secs(25)), "25s");
        let p = PairRate {
            set: 60_000.0,
            evalsha: 40_000.0,
        };
        assert!((p.pair() - 24_000.0).abs() < 1e-6);
        assert_eq!(crate::json::string("a\"b\n"), "\"a\\\"b\\n\"");
    }
}
