//! The `fencelock` command line: argument parsing and exit codes around the library.
// Output goes through `outln!`/`out!` (module `out`): `println!` panics on a closed pipe.
#![warn(clippy::print_stdout)]

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};
use fencelock::{Client, ErrorKind};

// First: its macros are visible only to the modules declared after it.
#[macro_use]
mod out;

mod acl;
mod chaos;
pub mod config;
mod demo;
mod doctor;
#[cfg(feature = "redis")]
mod doctor_acl;
mod elect;
mod json;
mod limits;
mod ops;
mod run;
mod serve;
mod supervise;

/// Exit codes, from sysexits(3) where one fits.
pub mod exit {
    /// Invalid arguments, names or URLs (EX_USAGE).
    pub const USAGE: u8 = 64;
    /// The engine could not be reached or failed (EX_UNAVAILABLE).
    pub const UNAVAILABLE: u8 = 69;
    /// The lock is held elsewhere and was not acquired within `--wait`, or a forced release
    /// was refused because its holder looks alive (EX_TEMPFAIL).
    pub const HELD: u8 = 75;
    /// The command's supervisor could not be started or died (EX_SOFTWARE); what the command
    /// started was killed.
    pub const SUPERVISOR: u8 = 70;
    /// The lease was lost while the command ran; the command was terminated.
    pub const LEASE_LOST: u8 = 79;
    /// The output could not be written (a full disk), though the command did its work
    /// (EX_IOERR). A closed pipe is not an error.
    pub const IO: u8 = 74;
    /// `list` or `audit` printed what the backends that answered hold, but at least one
    /// backend of the routing configuration failed (named on stderr).
    pub const PARTIAL: u8 = 80;
    /// A limit stored in the engine refused the lock: a TTL above its cap, or this client
    /// holding its quota of leases (EX_NOPERM).
    pub const LIMIT: u8 = 77;
}

#[derive(Parser, Debug)]
#[command(
    name = "fencelock",
    version,
    about = "Distributed locks with fencing tokens",
    after_help = "Exit codes: 64 invalid input, 69 engine unavailable, 70 the command's \
                  supervisor died (the command was killed), 75 held elsewhere (or a forced \
                  release refused: the holder looks alive), 77 refused by a limit stored in \
                   the engine, 74 the output could not be written (a closed pipe ends it \
                   quietly), 79 lease lost while running, 80 list or audit partial (a \
                   backend failed; named on stderr); otherwise the command's own status."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug, Clone)]
pub struct BackendArg {
    /// Backend URL: sqlite:///path.db, redis://host:port, redlock://h1:p1,h2:p2,h3:p3,
    /// postgres://user@host:port/db[?mode=lease], etcd://h1:p1,h2:p2,h3:p3,
    /// zk://h1:p1,h2:p2,h3:p3[/chroot].
    /// Default: $FENCELOCK_URL, else a routing configuration (--config), else the SQLite
    /// file in the user's state directory.
    #[arg(long, global = true, conflicts_with = "config")]
    backend: Option<String>,
    /// Routing configuration (TOML: backends, prefix routes, a default; see docs/routing.md).
    /// Default: $FENCELOCK_CONFIG, else $XDG_CONFIG_HOME/fencelock/config.toml if it exists.
    /// --backend wins over it, and it over $FENCELOCK_URL.
    #[arg(long, global = true, value_name = "PATH")]
    config: Option<std::path::PathBuf>,
    /// Namespace every engine key starts with.
    #[arg(long, env = "FENCELOCK_PREFIX", global = true, default_value = fencelock::DEFAULT_PREFIX)]
    prefix: String,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a command while holding a lock, like flock(1) across machines.
    Run(RunArgs),
    /// Run a command only while leading an election, or watch who leads (best on etcd and ZooKeeper).
    Elect(elect::ElectArgs),
    /// Print the engine keys a resource name maps to, so other tools can take the same lock.
    Key {
        /// Resource name.
        name: String,
        #[command(flatten)]
        backend: BackendArg,
    },
    /// Show who holds a lock: holder, token, TTL left, last renewal, healthy or suspect.
    Inspect(ops::InspectArgs),
    /// List the held locks, all or those whose name starts with a prefix.
    List(ops::ListArgs),
    /// Force the release of a stuck lock (its holder is dead), advancing the fencing counter.
    Release(ops::ReleaseArgs),
    /// Show the audit log of forced releases, newest first.
    Audit(ops::AuditArgs),
    /// Print the commands that create a user confined to the prefix, and a read-only one.
    Acl(acl::AclArgs),
    /// Check a backend: reachability, latency, clocks, unsafe settings, what fencelock needs of
    /// the server (scripting, privileges), security (TLS, authentication), TTL advice.
    Doctor(doctor::DoctorArgs),
    /// Store, show or clear the limits the engine enforces under a prefix (TTL cap, quota).
    Limits(limits::LimitsArgs),
    /// The nightly-invoice story: a stalled holder is made harmless by a fenced ledger.
    Demo(demo::DemoArgs),
    /// Serve locks over HTTP to applications in any language, with a dashboard (a sidecar).
    Serve(serve::ServeArgs),
    /// Test support, not a user command: the lock client that the chaos suite
    /// (`tests/chaos.rs`) starts as separate processes and drives through its ledger.
    /// Hidden from `--help`.
    #[command(hide = true)]
    ChaosWorker(chaos::WorkerArgs),
    /// Internal, not a user command: the process `run` and `elect` start to be the parent of
    /// the command and of everything it starts. Hidden from `--help`.
    #[command(hide = true)]
    Supervisor(supervise::WorkerArgs),
}

/// What to do when the lock is held elsewhere and `--wait` runs out.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfHeld {
    /// Exit 75 with a message naming the holder.
    Fail,
    /// Exit 0 and say the command was skipped.
    Skip,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Lease TTL; renewed every TTL/3 while the command runs.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// How long to wait for the lock while another holder has it.
    #[arg(long, default_value = "0s", value_parser = parse_duration)]
    pub wait: Duration,
    /// What to do when the lock stays held.
    #[arg(long, value_enum, default_value = "fail")]
    pub if_held: IfHeld,
    /// After the lease is lost, how long the command gets between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub kill_after: Duration,
    /// Release the lock when the command exits, sending what it left running SIGTERM (SIGKILL
    /// after --kill-after) first, instead of holding it until every process it started has
    /// exited.
    #[arg(long)]
    pub release_on_exit: bool,
    /// Pass FENCELOCK_URL and fencelock's password variables on to the command (by default
    /// it gets only FENCELOCK_TOKEN, FENCELOCK_RESOURCE and FENCELOCK_OWNER).
    #[arg(long)]
    pub pass_env: bool,
    /// Client name recorded with the lease (shown by `inspect`).
    #[arg(long, default_value = "fencelock-run")]
    pub client_name: String,
    /// Wait in FIFO order behind earlier waiters (Redis engines; etcd and ZooKeeper always do).
    #[arg(long)]
    pub fair: bool,
    /// Serve metrics in Prometheus text format on this address (127.0.0.1:9464,
    /// localhost:9464; port 0 takes a free port and prints it) while the command runs.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<String>,
    /// Resource name (1-256 bytes, no control characters).
    pub name: String,
    /// The command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// Formats a duration as people write it and as `--ttl` takes it (`250ms`, `1.5s`, `2m`).
pub(crate) fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        if d.as_micros() % 1000 != 0 && ms < 10 {
            return format!("{:.1}ms", d.as_secs_f64() * 1000.0);
        }
        format!("{ms}ms")
    } else if ms % 60_000 == 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim())
        .map_err(|e| format!("{s:?} is not a duration ({e}); write it like 500ms, 30s or 2m"))
}

/// An error already reported to the user, carrying the exit code to leave with.
#[derive(Debug)]
pub struct Exit(pub u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}", self.0)
    }
}
impl std::error::Error for Exit {}

/// Maps a library error to the exit code a script can act on.
pub fn exit_code(e: &fencelock::Error) -> u8 {
    match e.kind() {
        ErrorKind::InvalidInput => exit::USAGE,
        ErrorKind::HeldByAnother | ErrorKind::TimedOut => exit::HELD,
        ErrorKind::LeaseLost | ErrorKind::NotHolder => exit::LEASE_LOST,
        ErrorKind::LimitExceeded => exit::LIMIT,
        _ => exit::UNAVAILABLE,
    }
}

/// Prints a library error and turns it into an exit.
pub fn fail(e: fencelock::Error) -> anyhow::Error {
    eprintln!("fencelock: {e}");
    Exit(exit_code(&e)).into()
}

/// The client of a command: on the backend URL or routing configuration `backend` selects
/// (see `config`), opened with the command's client name.
pub async fn connect(backend: &BackendArg, client_name: &str) -> Result<Client> {
    let target = config::target(backend).map_err(fail)?;
    config::builder(target)
        .prefix(&backend.prefix)
        .client_name(client_name)
        .connect()
        .await
        .map_err(fail)
}

/// Prints the keys from the URL alone: `key` must answer while the engine is down, which is
/// when an operator needs the keys most.
/// With a routing configuration, the first line names the backend the name routes to.
async fn key(name: &str, backend: &BackendArg) -> Result<u8> {
    fencelock::validate_name(name).map_err(fail)?;
    let url = match config::target(backend).map_err(fail)? {
        config::Target::Url(url) => url,
        config::Target::Routes(routes) => {
            let chosen = routes.backend_for(name).map_err(fail)?;
            let url = routes.url_of(chosen).unwrap_or_default().to_owned();
            outln!("backend\t{chosen}\t{}", fencelock::redact_url(&url));
            url
        }
    };
    let parsed = fencelock::Backend::parse(&url).map_err(fail)?;
    for (label, key) in parsed.keys(&backend.prefix, name).map_err(fail)? {
        outln!("{label}\t{key}");
    }
    Ok(0)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { exit::USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // The supervisor is single-threaded and talks to no engine: no runtime, no logging.
    let command = match cli.command {
        Command::Supervisor(args) => return ExitCode::from(supervise::worker(args)),
        other => other,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FENCELOCK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fencelock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    let result = runtime.block_on(async {
        match command {
            Command::Supervisor(_) => Ok(exit::SUPERVISOR),
            Command::Run(args) => run::run(args).await,
            Command::Elect(args) => elect::elect(args).await,
            Command::Inspect(args) => ops::inspect(args).await,
            Command::List(args) => ops::list(args).await,
            Command::Release(args) => ops::release(args).await,
            Command::Audit(args) => ops::audit(args).await,
            Command::Key { name, backend } => key(&name, &backend).await,
            Command::Doctor(args) => doctor::doctor(args).await,
            Command::Acl(args) => acl::acl(args).await,
            Command::Limits(args) => limits::limits(args).await,
            Command::Demo(args) => demo::demo(args).await,
            Command::Serve(args) => serve::serve(args).await,
            Command::ChaosWorker(args) => chaos::worker(args).await,
        }
    });
    let code = match result {
        Ok(code) => code,
        Err(e) => match e.downcast_ref::<Exit>() {
            Some(Exit(code)) => *code,
            None => {
                eprintln!("fencelock: {e:#}");
                exit::UNAVAILABLE
            }
        },
    };
    ExitCode::from(out::exit_code(code))
}
