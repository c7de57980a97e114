//! What the bench keeps of the `fencelock` command line's conventions: the same `--backend` and
//! `--prefix` options with the same environment variables, and the same exit codes for the same
//! library errors, so that a script driving both reads them alike. These are the few pieces of
//! `crates/fencelock-cli/src/main.rs` the bench needs, restated here because a binary crate
//! cannot be depended on.

use anyhow::Result;
use clap::Args;
use fencelock::{Client, ErrorKind};

/// Exit codes, from sysexits(3) where one fits; the same numbers as `fencelock`'s.
pub(crate) mod exit {
    /// Invalid arguments or URLs (EX_USAGE).
    pub(crate) const USAGE: u8 = 64;
    /// The engine could not be reached or failed (EX_UNAVAILABLE).
    pub(crate) const UNAVAILABLE: u8 = 69;
    /// A lock the bench took was held elsewhere or not granted in time (EX_TEMPFAIL).
    pub(crate) const HELD: u8 = 75;
    /// A lease the bench held was lost before it was released.
    pub(crate) const LEASE_LOST: u8 = 79;
}

#[derive(Args, Debug, Clone)]
pub(crate) struct BackendArg {
    /// Backend URL: sqlite:///path.db, redis://host:port, redlock://h1:p1,h2:p2,h3:p3,
    /// postgres://user@host:port/db[?mode=lease], etcd://h1:p1,h2:p2,h3:p3.
    /// Default: $FENCELOCK_URL, else the SQLite file in the user's state directory.
    #[arg(long, env = "FENCELOCK_URL")]
    backend: Option<String>,
    /// Namespace every engine key starts with.
    #[arg(long, env = "FENCELOCK_PREFIX", default_value = fencelock::DEFAULT_PREFIX)]
    prefix: String,
}

impl BackendArg {
    /// The URL given, else the library's default.
    pub(crate) fn url(&self) -> Result<String> {
        match &self.backend {
            Some(u) => Ok(u.clone()),
            None => fencelock::default_url().map_err(fail),
        }
    }

    /// The key namespace.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// An error already reported to the user, carrying the exit code to leave with.
#[derive(Debug)]
pub(crate) struct Exit(pub(crate) u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}", self.0)
    }
}
impl std::error::Error for Exit {}

/// Prints a library error and turns it into an exit with the code `fencelock` would use.
pub(crate) fn fail(e: fencelock::Error) -> anyhow::Error {
    eprintln!("fencelock-bench: {e}");
    let code = match e.kind() {
        ErrorKind::InvalidInput => exit::USAGE,
        ErrorKind::HeldByAnother | ErrorKind::TimedOut => exit::HELD,
        ErrorKind::LeaseLost | ErrorKind::NotHolder => exit::LEASE_LOST,
        _ => exit::UNAVAILABLE,
    };
    Exit(code).into()
}

pub(crate) async fn connect(backend: &BackendArg, client_name: &str) -> Result<Client> {
    Client::builder(backend.url()?)
        .prefix(&backend.prefix)
        .client_name(client_name)
        .connect()
        .await
        .map_err(fail)
}
