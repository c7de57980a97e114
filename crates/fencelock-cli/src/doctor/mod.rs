//! `fencelock doctor`: is this backend fit for the locks we take on it?
//!
//! Per node: reachable, round-trip latency, clock offset against this machine (and so between
//! nodes), the settings that make a correctness lock unsafe, what fencelock needs of the
//! server (scripting on Redis, privileges on PostgreSQL), and its security: TLS (the version
//! negotiated and whether the server's certificate was verified), plaintext off this machine,
//! a Redis open to anyone, etcd without authentication. Then TTL advice from the observed
//! hold-time p99.
//!
//! Each engine's checks live in a file of their own; what they find goes through [`Findings`],
//! and checks that return a list of [`Finding`]s are appended with [`Findings::add_all`].

use std::time::Duration;

use anyhow::Result;
use clap::Args;

use crate::{connect, exit, fail, BackendArg};

#[cfg(feature = "etcd")]
mod etcd;
mod net;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
mod ttl;
#[cfg(feature = "zookeeper")]
mod zookeeper;

#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// The observed hold-time p99, for TTL advice.
    #[arg(long, value_parser = crate::parse_duration, conflicts_with = "metrics_url")]
    hold_p99: Option<Duration>,
    /// A running fencelock's Prometheus endpoint (as served by `run --metrics-addr`), to read
    /// the hold-time p99 from, e.g. http://127.0.0.1:9464/metrics.
    #[arg(long)]
    metrics_url: Option<String>,
    /// The TTL in use, to compare with the advice.
    #[arg(long, value_parser = crate::parse_duration)]
    ttl: Option<Duration>,
}

/// How long the doctor waits for one server to connect or answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// One thing a check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Finding {
    /// As it should be.
    Ok(String),
    /// A problem: counted, but it does not change the exit code.
    Warn(String),
    /// Worth knowing, not a problem.
    Note(String),
}

/// What the doctor found, printed as it goes.
pub(crate) struct Findings {
    problems: usize,
    unreachable: usize,
}

impl Findings {
    pub(crate) fn ok(&self, what: &str) {
        outln!("  ok    {what}");
    }
    pub(crate) fn warn(&mut self, what: &str) {
        self.problems += 1;
        outln!("  WARN  {what}");
    }
    pub(crate) fn note(&self, what: &str) {
        outln!("  note  {what}");
    }
    /// A server that could not be reached: a problem, and exit 69.
    pub(crate) fn unreachable_node(&mut self, what: &str) {
        self.unreachable += 1;
        self.warn(what);
    }
    pub(crate) fn add(&mut self, finding: Finding) {
        match finding {
            Finding::Ok(w) => self.ok(&w),
            Finding::Warn(w) => self.warn(&w),
            Finding::Note(w) => self.note(&w),
        }
    }
    pub(crate) fn add_all(&mut self, findings: impl IntoIterator<Item = Finding>) {
        findings.into_iter().for_each(|f| self.add(f));
    }
}

/// With a routing configuration, every backend is checked in turn, each under its name.
pub async fn doctor(args: DoctorArgs) -> Result<u8> {
    let mut f = Findings {
        problems: 0,
        unreachable: 0,
    };
    match crate::config::target(&args.backend).map_err(fail)? {
        crate::config::Target::Url(url) => check_backend(&args, url, None, &mut f).await?,
        crate::config::Target::Routes(routes) => {
            for (name, url) in routes.backends() {
                // Each backend is checked as if named by --backend.
                let mut one = args.clone();
                one.backend.backend = Some(url.to_owned());
                one.backend.config = None;
                check_backend(&one, url.to_owned(), Some(name), &mut f).await?;
            }
        }
    }
    ttl::ttl_advice(&args, &mut f).await;
    outln!(
        "{} problem(s){}",
        f.problems,
        if f.unreachable > 0 {
            format!(", {} node(s) unreachable", f.unreachable)
        } else {
            String::new()
        }
    );
    Ok(if f.unreachable > 0 {
        exit::UNAVAILABLE
    } else {
        0
    })
}

async fn check_backend(
    args: &DoctorArgs,
    url: String,
    name: Option<&str>,
    f: &mut Findings,
) -> Result<()> {
    let backend = fencelock::Backend::parse(&url).map_err(fail)?;
    outln!(
        "fencelock doctor: {}{} at {}",
        name.map(|n| format!("backend {n}: ")).unwrap_or_default(),
        backend.engine(),
        fencelock::redact_url(&url)
    );
    match &backend {
        #[cfg(feature = "sqlite")]
        fencelock::Backend::Sqlite(u) => sqlite(args, &u.path, f).await?,
        #[cfg(feature = "etcd")]
        fencelock::Backend::Etcd(u) => etcd::etcd(args, u, f).await,
        #[cfg(feature = "redis")]
        fencelock::Backend::Redis(u) => {
            redis::redis_nodes(u, f).await;
            f.problems += crate::doctor_acl::redis(u, &args.backend.prefix).await;
        }
        #[cfg(feature = "postgres")]
        fencelock::Backend::Postgres(u) => postgres::postgres(u, f).await?,
        #[cfg(feature = "zookeeper")]
        fencelock::Backend::Zookeeper(_) => zookeeper::zookeeper(args, f).await,
        _ => {}
    }
    Ok(())
}

async fn sqlite(args: &DoctorArgs, path: &std::path::Path, f: &mut Findings) -> Result<()> {
    outln!("database {}", path.display());
    let started = std::time::Instant::now();
    let client = connect(&args.backend, "fencelock-doctor").await?;
    client.inspect("fencelock-doctor").await.map_err(fail)?;
    f.ok(&format!(
        "opened and queried in {}",
        crate::human_duration(started.elapsed())
    ));
    f.ok("expiry on CLOCK_BOOTTIME: wall-clock jumps do not move it");
    f.note("SQLite locks hold between processes of this machine only");
    Ok(())
}

/// The median of a few round trips.
pub(crate) fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}
