//! `fencelock bench`: throughput and latency of one engine, against targets and, for Redis
//! engines, against `redis-benchmark` run on the same server(s) in the same run.
//!
//! Each section of the run has a module of its own: `uncontended` (1), `contention` (2) and
//! `renewal` (3), so that each reads as what it measures. What the figures are compared with
//! lives apart: `reference` (redis-benchmark), `floor` (what the redis crate itself allows),
//! `etcd` and `postgres` (those servers' own rates, pgbench in section 4). `servers` reaches the
//! Redis nodes directly, `runtime` gives a run a thread of its own, and `plumbing` holds what
//! every section shares: the output, the formatting of figures, the Ctrl-C flag and the bound
//! on each phase.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::Client;

use crate::{connect, fail, BackendArg};

mod contention;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "redis")]
mod floor;
mod plumbing;
#[cfg(feature = "postgres")]
mod postgres;
mod reference;
mod renewal;
mod runtime;
mod servers;
mod uncontended;

use plumbing::{run_id, Names, Out, Stop};
use reference::Reference;
use servers::Servers;

type LibResult<T> = std::result::Result<T, fencelock::Error>;

const CLIENT_NAME: &str = "fencelock-bench";
const CONCURRENT_TASKS: usize = 64;
/// Slack on top of a phase's nominal length before it is abandoned: every library call is
/// already bounded by the client's 5 s operation timeout, so this only catches a wedged phase.
const PHASE_SLACK: Duration = Duration::from_secs(40);

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
}
