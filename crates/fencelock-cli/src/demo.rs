//! `fencelock demo`: the nightly-invoice story, end to end, on the embedded default.
//!
//! Ten workers race for the nightly invoice job. The winner starts, then stalls past its TTL
//! (as a long GC pause or a stopped VM would make it), and its lease expires. Another worker
//! takes the job with a larger token and bills the customers. When the stalled worker wakes up
//! it still believes it holds the lock and tries to bill again: the fenced ledger refuses its
//! stale token, so every customer is billed once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use fencelock::fence::MemoryFence;
use fencelock::{ErrorKind, FencingToken, LockOptions};
use tokio::time::Instant;

use crate::{connect, fail, BackendArg};

#[derive(Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Lease TTL of the workers (the stalled one sleeps twice as long).
    #[arg(long, default_value = "600ms", value_parser = crate::parse_duration)]
    ttl: Duration,
}

const WORKERS: usize = 10;
const CUSTOMERS: [&str; 3] = ["acme", "globex", "initech"];

struct Timeline {
    start: Instant,
}

impl Timeline {
    fn log(&self, what: String) {
        let at = self.start.elapsed();
        outln!("{:>7.1} ms  {what}", at.as_secs_f64() * 1000.0);
    }
}

/// The protected resource: the invoice ledger, fenced by token.
struct Ledger {
    fence: MemoryFence,
    billed: Mutex<Vec<(String, u64)>>,
}

impl Ledger {
    fn bill(&self, customer: &str, token: FencingToken) -> fencelock::Result<()> {
        self.fence.write("ledger", token, || {
            self.billed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((customer.to_owned(), token.get()));
        })
    }
}

pub async fn demo(args: DemoArgs) -> Result<u8> {
    let client = connect(&args.backend, "fencelock-demo").await?;
    // A fresh name per run keeps the demo independent of earlier runs on the same database.
    let job = format!("nightly-invoices-demo-{:08x}", rand_u32());
    let ttl = args.ttl;
    let tl = Timeline {
        start: Instant::now(),
    };
    let ledger = Arc::new(Ledger {
        fence: MemoryFence::new(),
        billed: Mutex::new(Vec::new()),
    });
    outln!(
        "fencelock demo: {WORKERS} workers race for {job:?} on {} (TTL {})",
        client.url(),
        crate::human_duration(ttl)
    );

    // Round 1: everyone tries once; exactly one wins. The winner's renewals are off to stand
    // for a process that is paused: a paused process renews nothing.
    let opts = LockOptions::default().ttl(ttl).auto_renew(false);
    let mut tries = Vec::new();
    for w in 1..=WORKERS {
        let client = client.clone();
        let job = job.clone();
        let opts = opts.clone();
        tries.push(tokio::spawn(async move {
            (w, client.try_acquire(&job, &opts).await)
        }));
    }
    let mut winner = None;
    let mut held = 0;
    for t in tries {
        let (w, r) = t.await?;
        match r {
            Ok(lease) => winner = Some((w, lease)),
            Err(e) if e.kind() == ErrorKind::HeldByAnother => held += 1,
            Err(e) => return Err(fail(e)),
        }
    }
    let Some((first, stalled)) = winner else {
        anyhow::bail!("no worker won the first round");
    };
    tl.log(format!(
        "worker {first} wins the job with token {}; {held} others find it held and stand by",
        stalled.token()
    ));
    tl.log(format!(
        "worker {first} prepares the invoices and stalls (a long pause: no renewals, no progress)"
    ));

    // While it stalls, the lease expires and a waiting worker takes over.
    let second = if first == 1 { 2 } else { 1 };
    let takeover = client
        .acquire(&job, &LockOptions::default().ttl(ttl).wait(ttl * 4))
        .await
        .map_err(fail)?;
    tl.log(format!(
        "the lease of worker {first} expired; worker {second} takes over with token {}",
        takeover.token()
    ));
    for c in CUSTOMERS {
        match ledger.bill(c, takeover.token()) {
            Ok(()) => tl.log(format!("worker {second} bills {c}: accepted")),
            Err(e) => tl.log(format!("worker {second} bills {c}: {e}")),
        }
    }

    // The stalled worker wakes up, unaware, and carries on where it stopped.
    let pause_left = (ttl * 2).saturating_sub(tl.start.elapsed());
    tokio::time::sleep(pause_left).await;
    tl.log(format!(
        "worker {first} wakes up after {} and carries on (it still thinks it holds the job)",
        crate::human_duration(ttl * 2)
    ));
    let mut rejected = 0;
    for c in CUSTOMERS {
        match ledger.bill(c, stalled.token()) {
            Ok(()) => tl.log(format!(
                "worker {first} bills {c}: ACCEPTED (double billing!)"
            )),
            Err(e) => {
                rejected += 1;
                let (presented, highest) = e
                    .stale_tokens()
                    .unwrap_or((stalled.token(), takeover.token()));
                tl.log(format!(
                    "worker {first} bills {c}: refused, token {presented} is stale (ledger has seen {highest})"
                ))
            }
        }
    }
    let lost = stalled.is_lost();
    tl.log(format!(
        "worker {first} checks its lease: {}",
        if lost {
            "lost, it stops"
        } else {
            "still valid"
        }
    ));
    let _ = stalled.release().await;
    takeover.release().await.map_err(fail)?;
    client.close().await;

    let billed = ledger
        .billed
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut per_customer: Vec<(String, usize)> = CUSTOMERS
        .iter()
        .map(|c| (c.to_string(), billed.iter().filter(|(b, _)| b == c).count()))
        .collect();
    per_customer.sort();
    outln!();
    outln!("outcome:");
    for (c, n) in &per_customer {
        outln!("  {c:<8} billed {n} time(s)");
    }
    outln!("  stale writes refused by the ledger: {rejected}");
    if per_customer.iter().any(|(_, n)| *n != 1) || rejected != CUSTOMERS.len() {
        outln!("  FAILED: the fence let a stale write through");
        return Ok(1);
    }
    outln!(
        "  every customer was billed exactly once, although two workers believed they held the job"
    );
    Ok(0)
}

fn rand_u32() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16)
}
