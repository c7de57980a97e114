//! `fencelock-bench pairs`: a fixed number of sequential acquire+release pairs through one
//! library, fencelock or rslock, and nothing else, so that a tool counting the client's
//! instructions (`scripts/client-cost` runs it under callgrind twice and takes the
//! difference) sees only what one pair costs the client. Timings are printed but are not the
//! point: under an instruction counter they mean nothing.

use std::time::Duration;

use anyhow::Result;
use clap::{Args, ValueEnum};
use fencelock::LockOptions;
use tokio::time::Instant;

use super::rslock::{Retry, Rslock};
use super::{TTL, WAIT};
use crate::cli::{connect, exit, fail, BackendArg, Exit};
use crate::harness::{Fencelock, LockLib};
use crate::plumbing::run_id;
use crate::servers::Servers;
use crate::CLIENT_NAME;

#[derive(Args, Debug)]
pub(crate) struct PairsArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// The library that runs the pairs.
    #[arg(long, value_enum)]
    lib: Lib,
    /// How many pairs, each on a name of its own.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    count: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Lib {
    Fencelock,
    Rslock,
}

pub(crate) async fn run(args: PairsArgs) -> Result<u8> {
    let url = args.backend.url()?;
    let target = match crate::engine::Engine::parse(&url) {
        Ok(crate::engine::Engine::Redis(t)) => t,
        _ => {
            eprintln!("fencelock-bench pairs: give a Redis backend (redis://, redlock://)");
            return Err(Exit(exit::USAGE).into());
        }
    };
    let servers = Servers::open(target).await?;
    let base = format!("fencelock-bench-{}", run_id());
    let started = Instant::now();
    let outcome = match args.lib {
        Lib::Fencelock => {
            let client = connect(&args.backend, CLIENT_NAME).await?;
            let lib = Fencelock {
                client: client.clone(),
                opts: LockOptions::default().ttl(TTL).wait(WAIT),
            };
            let done = pairs(&lib, &base, args.count).await.map_err(fail);
            client.close().await;
            done
        }
        Lib::Rslock => {
            let retry = Retry {
                count: 1,
                delay: Duration::from_millis(1),
            };
            let lib = Rslock::new(&url, TTL, WAIT, retry).map_err(|e| {
                eprintln!("fencelock-bench pairs: rslock: {e}");
                Exit(exit::USAGE)
            })?;
            pairs(&lib, &base, args.count).await.map_err(|e| {
                eprintln!("fencelock-bench pairs: rslock: {e}");
                Exit(exit::UNAVAILABLE).into()
            })
        }
    };
    let elapsed = started.elapsed();
    // Every key of the run goes, whatever happened above.
    let cleaned = servers.unlink_matching(&format!("*{base}-*")).await;
    outcome?;
    println!(
        "{} pairs in {:.3} s; clean-up: {}",
        args.count,
        elapsed.as_secs_f64(),
        match cleaned {
            Ok(n) => format!("deleted {n} keys"),
            Err(e) => format!("incomplete: {e}"),
        }
    );
    Ok(0)
}

async fn pairs<L: LockLib>(lib: &L, base: &str, count: u64) -> Result<(), L::Error> {
    for i in 0..count {
        let guard = lib.try_acquire(&format!("{base}-{i}")).await?;
        lib.release(guard).await?;
    }
    Ok(())
}
