//! `fencelock chaos-worker`: the lock client the chaos suite drives (hidden from help).
//!
//! It loops: acquire, report the grant to the suite's ledger, wait for the go-ahead, write to
//! the ledger with its token, release. It writes whether or not its lease is still valid, as
//! a zombie would: the point of the suite is that the ledger's fence, not the client's good
//! manners, keeps stale writes out. Timestamps are CLOCK_MONOTONIC nanoseconds, which every
//! process of a machine shares, so the suite can order events across processes.
//!
//! With `--side NAME` the same client runs a second such loop on another name, reported under
//! id `id + 1000` on a connection of its own: the shards row routes the two names to different
//! backends and cuts one off, to see whether the other's loop in the same process slows down.

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
    /// How long one acquisition waits before it is reported as failed.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    wait: Duration,
    /// The client's per-call deadline (a partitioned node answers never).
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    op_timeout: Duration,
    /// A second resource name the same client locks in a loop of its own.
    #[arg(long)]
    side: Option<String>,
    /// How long one acquisition of the side name waits before it is reported as failed.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    side_wait: Duration,
}

/// The ledger id of the side loop of worker `id`.
const SIDE_ID_OFFSET: u32 = 1000;

/// `at` on CLOCK_MONOTONIC, in nanoseconds. Both clocks are CLOCK_MONOTONIC, but an `Instant`
/// shows no raw value: the offset is read as a pair of readings, taken again when the process
/// was preempted between them (under load that alone shifted a deadline by 11 ms).
fn mono_of(at: tokio::time::Instant) -> u128 {
    let mut best: Option<(u128, u128, tokio::time::Instant)> = None;
    for _ in 0..20 {
        let a = mono_ns();
        let now = tokio::time::Instant::now();
        let b = mono_ns();
        if best.is_none_or(|(ba, bb, _)| b - a < bb - ba) {
            best = Some((a, b, now));
        }
        if b - a < 20_000 {
            break;
        }
    }
    let Some((a, b, now)) = best else { return 0 };
    let mid = a + (b - a) / 2;
    match at.checked_duration_since(now) {
        Some(ahead) => mid + ahead.as_nanos(),
        None => mid.saturating_sub(now.duration_since(at).as_nanos()),
    }
}

/// CLOCK_MONOTONIC in nanoseconds.
pub fn mono_ns() -> u128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128)
        .unwrap_or(0)
}

pub async fn worker(args: WorkerArgs) -> Result<u8> {
    // `--backend URL` or a routing configuration (`--config`), as every command takes them.
    let target = crate::config::target(&args.backend).map_err(fail)?;
    let client = crate::config::builder(target)
        .prefix(&args.backend.prefix)
        .client_name("fencelock-chaos")
        .max_ttl(args.max_ttl)
        .op_timeout(args.op_timeout)
        .connect()
        .await
        .map_err(fail)?;
    let main = lock_loop(
        &client,
        &args.name,
        args.id,
        &args.ledger,
        LockOptions::default().ttl(args.ttl).wait(args.wait),
    );
    let Some(side) = &args.side else {
        return main.await;
    };
    let side = lock_loop(
        &client,
        side,
        args.id + SIDE_ID_OFFSET,
        &args.ledger,
        LockOptions::default().ttl(args.ttl).wait(args.side_wait),
    );
    // Both loops run until the suite stops the process or closes the ledger.
    let (main, side) = tokio::join!(main, side);
    main.and(side)
}

/// Locks `name` in a loop, reporting to the ledger as worker `id`, until the ledger closes.
async fn lock_loop(
    client: &fencelock::Client,
    name: &str,
    id: u32,
    ledger: &str,
    opts: LockOptions,
) -> Result<u8> {
    let ttl = opts.ttl_value();
    let stream = tokio::net::TcpStream::connect(ledger).await?;
    let (read, write) = stream.into_split();
    // The loss reporter below writes to the ledger too, from its own task.
    let write = std::sync::Arc::new(tokio::sync::Mutex::new(write));
    let mut lines = BufReader::new(read).lines();
    send(&write, format!("HELLO {id} {}\n", std::process::id())).await?;
    loop {
        let requested = mono_ns();
        let lease = match client.acquire(name, &opts).await {
            Ok(l) => l,
            Err(e) if e.kind() == fencelock::ErrorKind::InvalidInput => return Err(fail(e)),
            Err(e) => {
                let kind = format!("{:?}", e.kind());
                let took = mono_ns().saturating_sub(requested);
                send(&write, format!("FAIL {id} {kind} {took}\n")).await?;
                continue;
            }
        };
        let acquired = mono_ns();
        let valid_until = mono_of(lease.valid_until());
        let token = lease.token();
        send(
            &write,
            format!("GRANT {id} {token} {requested} {acquired} {valid_until}\n"),
        )
        .await?;
        // While it waits for the go-ahead, the worker reports the moment it learns of a loss,
        // with the validity deadline it believed in then, so the suite can check that the
        // holder knew before its window ended.
        let go = tokio::select! {
            line = lines.next_line() => line?,
            () = lease.lost() => {
                let at = mono_ns();
                let valid = mono_of(lease.valid_until());
                send(&write, format!("LOST {id} {token} {at} {valid}\n")).await?;
                lines.next_line().await?
            }
        };
        match go {
            Some(l) if l == "GO" => {}
            _ => return Ok(0),
        }
        send(&write, format!("WRITE {id} {token}\n")).await?;
        if lines.next_line().await?.is_none() {
            return Ok(0);
        }
        // The believed-valid window ends when the release starts.
        send(&write, format!("RELEASE {id} {token} {}\n", mono_ns())).await?;
        let _ = lease.release().await;
        // A short random rest after each release gives the other workers, and so the victim
        // the suite pauses, their turn: otherwise the releaser usually wins again at once.
        let rest = ttl.mul_f64((mono_ns() % 1000) as f64 / 4000.0);
        tokio::time::sleep(rest).await;
    }
}

async fn send(
    write: &tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>,
    line: String,
) -> std::io::Result<()> {
    write.lock().await.write_all(line.as_bytes()).await
}
