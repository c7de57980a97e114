//! Section 3, renewal load (Redis engines only): ten thousand leases held at once with
//! auto-renewal on, to show what keeping them alive costs the servers. The figure is requests
//! per second as the nodes count them (their command statistics), not as the client thinks it
//! sent them. Renewals run every TTL/3, so one request per lease would be 1,000/s at a 30 s TTL;
//! the target of 50/s holds only if renewals are batched.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use fencelock::{Client, Lease, LockOptions};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cli::fail;
use crate::plumbing::{dur, rate, rate2, Stop};
use crate::servers::{CommandStats, Servers};
use crate::Bench;

const RENEWAL_LEASES: usize = 10_000;
const RENEWAL_IN_FLIGHT: usize = 256;

const TARGET_RENEWAL_CALLS: f64 = 50.0;
const TARGET_RENEWAL_TTL: Duration = Duration::from_secs(30);

impl Bench<'_> {
    pub(crate) async fn renewal(&mut self, quick: bool, servers: Option<&Servers>) -> Result<()> {
        let (ttl, window) = if quick {
            (Duration::from_secs(3), Duration::from_secs(6))
        } else {
            (TARGET_RENEWAL_TTL, Duration::from_secs(25))
        };
        self.out.line(String::new());
        self.out.line(format!(
            "== 3. renewal load: {} leases, TTL {}, auto-renew, window {} ==",
            rate(RENEWAL_LEASES as f64),
            dur(ttl),
            dur(window)
        ));
        let Some(servers) = servers else {
            self.out.line(format!(
                "skipped: Redis engines only (engine {})",
                self.engine_name
            ));
            return Ok(());
        };
        let names: Vec<String> = (0..RENEWAL_LEASES)
            .map(|i| self.names.take(&format!("renew-{i}")))
            .collect();
        let opts = LockOptions::default().ttl(ttl);
        let started = Instant::now();
        let leases = acquire_many(self.client, names, &opts, self.stop).await?;
        let took = started.elapsed();
        self.out.line(format!(
            "acquired {} in {} ({}/s, {RENEWAL_IN_FLIGHT} in flight)",
            rate(leases.len() as f64),
            dur(took),
            rate(leases.len() as f64 / took.as_secs_f64())
        ));

        let before = servers.commandstats().await;
        let window_start = Instant::now();
        tokio::select! {
            _ = tokio::time::sleep(window) => {}
            _ = self.stop.wait() => {}
        }
        let after = servers.commandstats().await;
        let elapsed = window_start.elapsed();
        let lost = leases.iter().filter(|l| l.is_lost()).count();

        let started = Instant::now();
        let (released, failed) = release_many(leases).await;
        let release_took = started.elapsed();

        match (before, after) {
            (Ok(before), Ok(after)) => {
                self.renewal_calls(servers, &before, &after, elapsed, ttl)
                    .await;
            }
            (Err(e), _) | (_, Err(e)) => {
                self.out
                    .line(format!("server call counts unavailable: {e}"));
            }
        }
        self.out.line(format!(
            "leases lost during the window: {lost}; released {} in {}{}",
            rate(released as f64),
            dur(release_took),
            if failed.is_empty() {
                String::new()
            } else {
                format!(" ({} failed, first: {})", failed.len(), failed[0])
            }
        ));
        self.out.num("renewal.lost", lost as f64);
        self.out
            .num("renewal.release_failures", failed.len() as f64);
        Ok(())
    }

    async fn renewal_calls(
        &mut self,
        servers: &Servers,
        before: &[CommandStats],
        after: &[CommandStats],
        elapsed: Duration,
        ttl: Duration,
    ) {
        let secs = elapsed.as_secs_f64();
        let (mut all, mut requests) = (0u64, Some(0u64));
        for (node, ((addr, b), a)) in servers.addrs.iter().zip(before).zip(after).enumerate() {
            let d = CommandStats::delta(b, a);
            // The window's opening INFO is counted once it has been answered, so it falls
            // inside the delta; the closing one does not.
            let calls = d.total().saturating_sub(1);
            all += calls;
            let req = servers.requests(node, &d).await;
            let req_text = match &req {
                Ok(r) => format!("{} requests/s, ", rate2(*r as f64 / secs)),
                Err(e) => format!("requests unknown ({e}), "),
            };
            requests = requests.zip(req.ok()).map(|(t, r)| t + r);
            self.out.line(format!(
                "  node {addr}: {req_text}{} commands/s ({calls} commands: {})",
                rate2(calls as f64 / secs),
                d.top(5, "info", 1)
            ));
            self.out.num(
                &format!("renewal.node.{addr}.commands_per_s"),
                calls as f64 / secs,
            );
        }
        let all_per_s = all as f64 / secs;
        self.out.line(format!(
            "all commands (every cmdstat_*, including those run inside scripts) over {} \
             node(s): {all} = {}/s",
            servers.addrs.len(),
            rate2(all_per_s)
        ));
        self.out.num("renewal.commands_per_s", all_per_s);
        let Some(requests) = requests else {
            return;
        };
        let per_s = requests as f64 / secs;
        self.out.line(format!(
            "requests (calls of commands no script can run: EVALSHA, EVAL, SCRIPT, ...): \
             {requests} = {}/s",
            rate2(per_s)
        ));
        self.out.num("renewal.requests_per_s", per_s);
        if ttl == TARGET_RENEWAL_TTL {
            self.out.target(
                "renewal.requests_per_s",
                &format!(
                    "renewal requests <= {TARGET_RENEWAL_CALLS:.0}/s ({} leases, TTL {})",
                    rate(RENEWAL_LEASES as f64),
                    dur(TARGET_RENEWAL_TTL)
                ),
                &rate2(per_s),
                Some(per_s <= TARGET_RENEWAL_CALLS),
            );
        } else {
            // Renewals run every TTL/3, so the request rate scales with 1/TTL.
            let scaled = per_s * ttl.as_secs_f64() / TARGET_RENEWAL_TTL.as_secs_f64();
            self.out.target(
                "renewal.requests_per_s",
                &format!(
                    "renewal requests <= {TARGET_RENEWAL_CALLS:.0}/s at TTL {} (scaled from {})",
                    dur(TARGET_RENEWAL_TTL),
                    dur(ttl)
                ),
                &format!("~{}", rate2(scaled)),
                None,
            );
        }
    }
}

async fn acquire_many(
    client: &Client,
    names: Vec<String>,
    opts: &LockOptions,
    stop: &Stop,
) -> Result<Vec<Lease>> {
    let names = Arc::new(names);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..RENEWAL_IN_FLIGHT {
        let (client, names, next, opts, stop) = (
            client.clone(),
            names.clone(),
            next.clone(),
            opts.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let mut held = Vec::new();
            while !stop.is_set() {
                let Some(name) = names.get(next.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                match client.try_acquire(name, &opts).await {
                    Ok(lease) => held.push(lease),
                    Err(e) => return (held, Some(e)),
                }
            }
            (held, None)
        });
    }
    let mut leases = Vec::with_capacity(names.len());
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((held, err)) => {
                leases.extend(held);
                if first_error.is_none() {
                    first_error = err;
                }
            }
            Err(e) => return Err(anyhow::anyhow!("an acquiring task failed: {e}")),
        }
    }
    if let Some(e) = first_error {
        let _ = release_many(leases).await;
        return Err(fail(e));
    }
    Ok(leases)
}

/// Releases every lease, `RENEWAL_IN_FLIGHT` at a time. Returns how many were released and the
/// errors of those that were not.
async fn release_many(leases: Vec<Lease>) -> (usize, Vec<String>) {
    let mut shares: Vec<Vec<Lease>> = (0..RENEWAL_IN_FLIGHT).map(|_| Vec::new()).collect();
    for (i, lease) in leases.into_iter().enumerate() {
        shares[i % RENEWAL_IN_FLIGHT].push(lease);
    }
    let mut tasks = JoinSet::new();
    for share in shares {
        tasks.spawn(async move {
            let mut ok = 0;
            let mut errors = Vec::new();
            for lease in share {
                match lease.release().await {
                    Ok(()) => ok += 1,
                    Err(e) => errors.push(e.to_string()),
                }
            }
            (ok, errors)
        });
    }
    let (mut released, mut failed) = (0, Vec::new());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((ok, errors)) => {
                released += ok;
                failed.extend(errors);
            }
            Err(e) => failed.push(format!("a releasing task failed: {e}")),
        }
    }
    (released, failed)
}
