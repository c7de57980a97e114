//! `fencelock-bench`: throughput and latency of one engine, against targets and, for Redis
//! engines, against `redis-benchmark` run on the same server(s) in the same run. It lives
//! beside the `fencelock` command line rather than in it: users run locks, the project measures
//! them.
//!
//! Each section of the run has a module of its own: `uncontended` (1), `contention` (2) and
//! `renewal` (3), so that each reads as what it measures. What the figures are compared with
//! lives apart: `reference` (redis-benchmark), `floor` (what the redis crate itself allows),
//! `etcd`, `zookeeper` and `postgres` (those servers' own rates, pgbench in section 4). `engine` says which
//! engine the URL names and what the sections need of it, `servers` reaches the Redis nodes
//! directly, `runtime` gives a run a thread of its own, `plumbing` holds what every section
//! shares (the output, the formatting of figures, the Ctrl-C flag and the bound on each phase)
//! and `cli` the options and exit codes it keeps in common with `fencelock`. `harness` holds
//! the loops that drive a lock library, fencelock or a peer, and `peers` is the `peers`
//! subcommand: fencelock and rslock side by side on the same Redis servers.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use fencelock::Client;

mod cli;
mod contention;
mod engine;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "redis")]
mod floor;
mod harness;
#[cfg(feature = "redis")]
mod peers;
#[cfg(feature = "postgres")]
mod pg_driver;
mod plumbing;
#[cfg(feature = "postgres")]
mod postgres;
mod reference;
mod renewal;
mod runtime;
mod servers;
mod uncontended;
#[cfg(feature = "zookeeper")]
mod zookeeper;

use cli::{connect, exit, BackendArg, Exit};
use engine::Engine;
use plumbing::{run_id, Names, Out, Stop};
use reference::Reference;
use servers::Servers;

type LibResult<T> = std::result::Result<T, fencelock::Error>;

const CLIENT_NAME: &str = "fencelock-bench";
const CONCURRENT_TASKS: usize = 64;
/// Slack on top of a phase's nominal length before it is abandoned: every library call is
/// already bounded by the client's 5 s operation timeout, so this only catches a wedged phase.
const PHASE_SLACK: Duration = Duration::from_secs(40);

#[derive(Parser, Debug)]
#[command(
    name = "fencelock-bench",
    version,
    about = "Measure a fencelock engine: uncontended and contended throughput, renewal load, \
             and a reference run on the same server",
    after_help = "Exit codes, as fencelock's: 64 invalid input, 69 engine unavailable, 75 a lock \
                  not granted in time, 79 a lease lost; 130 after Ctrl-C (leases are still \
                  released and the bench's keys deleted).",
    args_conflicts_with_subcommands = true
)]
struct BenchArgs {
    #[command(subcommand)]
    command: Option<Command>,
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

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// fencelock and rslock side by side on the same Redis node(s) in one run, through one
    /// harness, interleaved round by round; fencelock's figures as ratios of rslock's.
    #[cfg(feature = "redis")]
    Peers(peers::PeersArgs),
    /// A fixed number of sequential acquire+release pairs through fencelock or rslock and
    /// nothing else: what `scripts/client-cost` counts the client's instructions on.
    #[cfg(feature = "redis")]
    Pairs(peers::pairs::PairsArgs),
}

fn main() -> ExitCode {
    let args = match BenchArgs::try_parse() {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { exit::USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FENCELOCK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .init();
    // Two worker threads, as the `fencelock` command line has: section 1 measures what crossing
    // them costs ("2-worker runtime"), and the shared-client runs use this runtime.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fencelock-bench: cannot start the async runtime: {e}");
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    let run = match args.command {
        #[cfg(feature = "redis")]
        Some(Command::Peers(peers)) => runtime.block_on(peers::run(peers)),
        #[cfg(feature = "redis")]
        Some(Command::Pairs(pairs)) => runtime.block_on(peers::pairs::run(pairs)),
        None => runtime.block_on(bench(args)),
    };
    match run {
        Ok(code) => ExitCode::from(code),
        Err(e) => match e.downcast_ref::<Exit>() {
            Some(Exit(code)) => ExitCode::from(*code),
            None => {
                eprintln!("fencelock-bench: {e:#}");
                ExitCode::from(exit::UNAVAILABLE)
            }
        },
    }
}

async fn bench(args: BenchArgs) -> Result<u8> {
    let url = args.backend.url()?;
    let client = connect(&args.backend, CLIENT_NAME).await?;
    // The client has parsed the same URL already, so this cannot fail in practice.
    let engine = Engine::parse(&url).map_err(|e| {
        eprintln!("fencelock-bench: backend URL: {e}");
        Exit(exit::USAGE)
    })?;
    let name = client.engine();
    let stop = Stop::on_interrupt();
    let mut out = Out::new(args.json, stop.clone());
    let dur = Duration::from_secs(args.seconds);
    let mut names = Names::new(&run_id());

    let servers = match &engine {
        Engine::Redis(target) => Some(Servers::open(target.clone()).await?),
        _ => None,
    };
    #[cfg(feature = "etcd")]
    let etcd_ref = match &engine {
        Engine::Etcd(target) => Some(etcd::EtcdReference::open(target, &names.base).await),
        _ => None,
    };
    #[cfg(feature = "zookeeper")]
    let zk_ref = match &engine {
        Engine::Zookeeper(target) => Some(zookeeper::ZkReference::open(target, &names.base).await),
        _ => None,
    };
    let reference = match (&engine, &servers) {
        (_, Some(s)) => Reference::prepare(s).await,
        (Engine::Postgres(_), None) => Err("pgbench, measured in section 4".to_owned()),
        #[cfg(feature = "etcd")]
        (Engine::Etcd(_), None) => Err(match &etcd_ref {
            Some(Ok(_)) => "etcd's own Put rate on the same cluster, measured after each \
                            uncontended run"
                .to_owned(),
            Some(Err(e)) => format!("unavailable (no etcd connection: {e})"),
            None => String::new(),
        }),
        #[cfg(feature = "zookeeper")]
        (Engine::Zookeeper(_), None) => Err(match &zk_ref {
            Some(Ok(_)) => "ZooKeeper's own create+delete rate on the same ensemble, measured \
                            after each uncontended run"
                .to_owned(),
            Some(Err(e)) => format!("unavailable (no ZooKeeper session: {e})"),
            None => String::new(),
        }),
        _ => Err(format!("not applicable to the {name} engine")),
    };

    out.line(format!(
        "fencelock bench: engine {name} at {}, {} s per timed run{}, names {}-*",
        client.url(),
        args.seconds,
        if args.quick { ", quick" } else { "" },
        names.base
    ));
    out.text("engine", name);
    out.num("seconds", args.seconds as f64);
    match &reference {
        Ok(r) => out.line(format!("reference: {} against {}", r.version, r.node)),
        // etcd's reference is measured later; the line says what it will be.
        Err(why) if matches!(engine, Engine::Etcd(_) | Engine::Zookeeper(_)) => {
            out.line(format!("reference: {why}"))
        }
        Err(why) => out.line(format!("reference: unavailable ({why})")),
    }
    if let Ok(r) = &reference {
        out.text("reference.tool", &r.version);
    }

    let mut bench = Bench {
        client: &client,
        backend: &args.backend,
        engine: &engine,
        engine_name: name,
        dur,
        stop: &stop,
        out: &mut out,
        names: &mut names,
        reference: reference.as_ref().ok(),
        #[cfg(feature = "etcd")]
        etcd: etcd_ref.as_ref().and_then(|r| r.as_ref().ok()),
        #[cfg(feature = "zookeeper")]
        zookeeper: zk_ref.as_ref().and_then(|r| r.as_ref().ok()),
    };
    let outcome = bench.all(args.quick, servers.as_ref()).await;
    #[cfg(feature = "postgres")]
    if let (Ok(()), Engine::Postgres(target), false) = (&outcome, &engine, stop.is_set()) {
        let name = names.take("pg-seq");
        postgres::reference(target, &args.backend, name, args.seconds, &mut out, &stop).await;
    }

    // Clean-up runs whatever happened above, so an engine failure mid-run leaves no bench keys.
    let cleaned = match (&engine, &servers) {
        (_, Some(s)) => s.delete_bench_keys(&client, &names.used, &reference).await,
        #[cfg(feature = "etcd")]
        (Engine::Etcd(_), None) => match &etcd_ref {
            Some(Ok(r)) => r.clean().await,
            Some(Err(e)) => Err(format!("no reference connection: {e}")),
            None => Ok(String::new()),
        },
        #[cfg(feature = "zookeeper")]
        (Engine::Zookeeper(_), None) => match &zk_ref {
            Some(Ok(r)) => r.clean().await,
            Some(Err(e)) => Err(format!("no reference session: {e}")),
            None => Ok(String::new()),
        },
        _ => Ok(format!(
            "the {name} engine keeps a row per name with its fencing counter ({} names under \
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
    out.end_run(outcome, &stop)
}

struct Bench<'a> {
    client: &'a Client,
    backend: &'a BackendArg,
    engine: &'a Engine,
    /// The engine's short name, for the output.
    engine_name: &'static str,
    dur: Duration,
    stop: &'a Stop,
    out: &'a mut Out,
    names: &'a mut Names,
    reference: Option<&'a Reference>,
    #[cfg(feature = "etcd")]
    etcd: Option<&'a etcd::EtcdReference>,
    #[cfg(feature = "zookeeper")]
    zookeeper: Option<&'a zookeeper::ZkReference>,
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
}
