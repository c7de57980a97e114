//! `fencelock chaos-worker`: the lock client the chaos suite drives (hidden from help).
//!
//! It loops: acquire, report the grant to the suite's ledger, wait for the go-ahead, write to
//! the ledger with its token, release. It writes whether or not its lease is still valid, as
//! a zombie would: the point of the suite is that the ledger's fence, not the client's good
//! manners, keeps stale writes out. Timestamps are CLOCK_MONOTONIC nanoseconds, which every
//! process of a machine shares, so the suite can order events across processes.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::LockOptions;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::{fail, parse_duration, BackendArg};

#[derive(Args, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Resource name.
    #[arg(long)]
    name: String,
    /// Lease TTL.
    #[arg(long, value_parser = parse_duration)]
    ttl: Duration,
    /// The suite's ledger, host:port on loopback.
    #[arg(long)]
    ledger: String,
    /// This worker's id in the suite's log.
    #[arg(long)]
    id: u32,
    /// The client's maximum TTL: how long a restarted Redis node sits out of quorum votes.
    #[arg(long, value_parser = parse_duration, default_value = "24h")]
    max_ttl: Duration,
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn mono_ns() -> u128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128)
        .unwrap_or(0)
}

pub async fn worker(args: WorkerArgs) -> Result<u8> {
    let url = match &args.backend.backend {
        Some(u) => u.clone(),
        None => fencelock::default_url().map_err(fail)?,
    };
    let client = fencelock::Client::builder(url)
        .prefix(&args.backend.prefix)
        .client_name("fencelock-chaos")
        .max_ttl(args.max_ttl)
        .connect()
        .await
        .map_err(fail)?;
    let stream = tokio::net::TcpStream::connect(&args.ledger).await?;
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let id = args.id;
    write
        .write_all(format!("HELLO {id} {}\n", std::process::id()).as_bytes())
        .await?;
    let opts = LockOptions::default()
        .ttl(args.ttl)
        .wait(Duration::from_secs(10));
    loop {
        let requested = mono_ns();
        let lease = match client.acquire(&args.name, &opts).await {
            Ok(l) => l,
            Err(e) if e.kind() == fencelock::ErrorKind::InvalidInput => return Err(fail(e)),
            Err(e) => {
                let kind = format!("{:?}", e.kind());
                write
                    .write_all(format!("FAIL {id} {kind}\n").as_bytes())
                    .await?;
                continue;
            }
        };
        let acquired = mono_ns();
        let valid_until = acquired + lease.time_left().as_nanos();
        let token = lease.token();
        write
            .write_all(
                format!("GRANT {id} {token} {requested} {acquired} {valid_until}\n").as_bytes(),
            )
            .await?;
        match lines.next_line().await? {
            Some(l) if l == "GO" => {}
            _ => return Ok(0),
        }
        write
            .write_all(format!("WRITE {id} {token}\n").as_bytes())
            .await?;
        if lines.next_line().await?.is_none() {
            return Ok(0);
        }
        // The believed-valid window ends when the release starts.
        write
            .write_all(format!("RELEASE {id} {token} {}\n", mono_ns()).as_bytes())
            .await?;
        let _ = lease.release().await;
        // A short random rest after each release gives the other workers, and so the victim
        // the suite pauses, their turn: otherwise the releaser usually wins again at once.
        let rest = args.ttl.mul_f64((mono_ns() % 1000) as f64 / 4000.0);
        tokio::time::sleep(rest).await;
    }
}
