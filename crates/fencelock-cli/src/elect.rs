//! `fencelock elect`: run a command only while leading an election, or watch who leads.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::LockOptions;

use crate::supervise::{supervise, Supervision};
use crate::{connect, fail, parse_duration, BackendArg};

/// Waiting "forever" for leadership: long enough for any deployment, short enough that
/// deadline arithmetic cannot overflow.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[derive(Args, Debug)]
pub struct ElectArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// The value observers see while this candidate leads (`etcdctl elect -l` prints it).
    /// Default: HOST:PID.
    #[arg(long)]
    pub value: Option<String>,
    /// Lease TTL of the leadership; a dead leader is replaced within about this long.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub ttl: Duration,
    /// Give up (exit 75) when not leading within this long. Default: wait as long as it takes.
    #[arg(long, value_parser = parse_duration)]
    pub wait: Option<Duration>,
    /// After leadership is lost, how long the command gets between SIGTERM and SIGKILL.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub kill_after: Duration,
    /// Release leadership when the command exits, terminating what it left running, instead
    /// of leading until every process it started has exited.
    #[arg(long)]
    pub release_on_exit: bool,
    /// Pass FENCELOCK_URL and fencelock's password variables on to the command.
    #[arg(long)]
    pub pass_env: bool,
    /// Client name recorded with the lease.
    #[arg(long, default_value = "fencelock-elect")]
    pub client_name: String,
    /// Do not campaign: print the leader's value and token (tab-separated) at start and on
    /// every change, until interrupted.
    #[arg(long, conflicts_with = "value")]
    pub listen: bool,
    /// Election name (1-256 bytes, no control characters).
    pub name: String,
    /// The command to run while leading, and its arguments.
    #[arg(last = true, num_args = 1.., required_unless_present = "listen")]
    pub command: Vec<String>,
}

pub async fn elect(args: ElectArgs) -> Result<u8> {
    fencelock::validate_name(&args.name).map_err(fail)?;
    let client = connect(&args.backend, &args.client_name).await?;
    let election = client.election(&args.name).map_err(fail)?;
    if args.listen {
        return listen(&election).await;
    }
    let value = match args.value {
        Some(v) => v,
        None => {
            let host = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "unknown-host".into());
            format!("{host}:{}", std::process::id())
        }
    };
    let opts = LockOptions::default()
        .ttl(args.ttl)
        .wait(args.wait.unwrap_or(FOREVER));
    let leadership = tokio::select! {
        l = election.campaign(&value, &opts) => l.map_err(fail)?,
        // Interrupted while campaigning: the dropped campaign withdraws the candidacy.
        _ = tokio::signal::ctrl_c() => {
            client.close().await;
            return Ok(130);
        }
    };
    eprintln!(
        "fencelock: leading {:?} with token {}",
        args.name,
        leadership.token()
    );
    let opts = Supervision {
        kill_after: args.kill_after,
        release_on_exit: args.release_on_exit,
        pass_env: args.pass_env,
    };
    supervise(client, leadership.into_lease(), &args.command, &opts).await
}

async fn listen(election: &fencelock::Election) -> Result<u8> {
    let mut rx = election.observe().await.map_err(fail)?;
    loop {
        let line = match &*rx.borrow_and_update() {
            Some(l) => format!("{}\t{}", l.value, l.token),
            None => "-\t-".to_owned(),
        };
        outln!("{line}");
        // No one reads any more (a closed pipe), or nothing can be written: watching on
        // would print to no one for ever.
        if crate::out::failed() {
            return Ok(0);
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return Ok(0) },
            _ = tokio::signal::ctrl_c() => return Ok(0),
        }
    }
}
