//! `fencelock run`: hold a lock while a command runs.

use std::net::SocketAddr;

use anyhow::Result;
use fencelock::{metrics, ErrorKind, LockOptions};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::supervise::{supervise, Supervision};
use crate::{connect, exit, fail, Exit, IfHeld, RunArgs};

pub async fn run(args: RunArgs) -> Result<u8> {
    // Check the name before connecting so a bad name never costs a round trip.
    fencelock::validate_name(&args.name).map_err(fail)?;
    // Before connecting, so that the acquisition is recorded and a busy port fails fast.
    if let Some(addr) = args.metrics_addr {
        serve_metrics(addr)?;
    }
    let client = connect(&args.backend, &args.client_name).await?;
    let opts = LockOptions::default()
        .ttl(args.ttl)
        .wait(args.wait)
        .fair(args.fair);
    let lease = match client.acquire(&args.name, &opts).await {
        Ok(lease) => lease,
        Err(e)
            if args.if_held == IfHeld::Skip
                && matches!(e.kind(), ErrorKind::HeldByAnother | ErrorKind::TimedOut) =>
        {
            eprintln!("fencelock: skipped: {e}");
            return Ok(0);
        }
        Err(e) => return Err(fail(e)),
    };

    let opts = Supervision {
        kill_after: args.kill_after,
        release_on_exit: args.release_on_exit,
        pass_env: args.pass_env,
    };
    supervise(client, lease, &args.command, &opts).await
}

/// Serves the process's metrics in Prometheus text format on `addr` (any path) until exit.
/// Histograms get buckets, not summaries, so quantiles can be aggregated across processes.
pub fn serve_metrics(addr: SocketAddr) -> Result<()> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full(metrics::ACQUIRE_DURATION.into()),
            metrics::ACQUIRE_DURATION_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(metrics::HOLD_DURATION.into()),
                metrics::HOLD_DURATION_BUCKETS,
            )
        })
        .and_then(PrometheusBuilder::install)
        .map_err(|e| {
            eprintln!("fencelock: cannot serve metrics on {addr}: {e}");
            anyhow::Error::from(Exit(exit::USAGE))
        })?;
    metrics::describe();
    Ok(())
}
