//! `fencelock run`: hold a lock while a command runs.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use fencelock::{metrics, ErrorKind, LockOptions};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::supervise::{supervise, Supervision};
use crate::{connect, exit, fail, Exit, IfHeld, RunArgs};

pub async fn run(args: RunArgs) -> Result<u8> {
    // Check the name before connecting so a bad name never costs a round trip.
    fencelock::validate_name(&args.name).map_err(fail)?;
    // Before connecting, so that the acquisition is recorded and a busy port fails fast.
    if let Some(addr) = &args.metrics_addr {
        serve_metrics(addr).await?;
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
/// `addr` is `IP:PORT` or `NAME:PORT`; `localhost` means the loopback addresses whatever the
/// resolver says. Port 0 takes a free port, and the address bound is printed on stderr.
/// Histograms get buckets, not summaries, so quantiles can be aggregated across processes.
pub async fn serve_metrics(addr: &str) -> Result<()> {
    let refuse = |why: String| -> anyhow::Error {
        eprintln!("fencelock: cannot serve metrics on {addr} (--metrics-addr): {why}");
        Exit(exit::USAGE).into()
    };
    let candidates = metrics_addrs(addr).map_err(refuse)?;
    let mut last = String::new();
    let mut bound = None;
    for candidate in candidates {
        match tokio::net::TcpListener::bind(candidate).await {
            Ok(l) => {
                bound = Some(l);
                break;
            }
            Err(e) => last = e.to_string(),
        }
    }
    let listener = bound.ok_or_else(|| refuse(last))?;
    let local = listener.local_addr().map_err(|e| refuse(e.to_string()))?;
    let handle = PrometheusBuilder::new()
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
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| refuse(e.to_string()))?;
    metrics::describe();
    if addr.ends_with(":0") {
        eprintln!("fencelock: serving metrics on http://{local}/metrics");
    }
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handle = handle.clone();
            tokio::spawn(scrape(stream, handle));
        }
    });
    Ok(())
}

/// The addresses `addr` names, loopback first for `localhost`.
fn metrics_addrs(addr: &str) -> std::result::Result<Vec<SocketAddr>, String> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("write it as IP:PORT or localhost:PORT".into());
    };
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{port:?} is not a port number"))?;
    if host.eq_ignore_ascii_case("localhost") {
        // Resolvers may map localhost elsewhere; a metrics endpoint asked for on localhost
        // must never listen beyond this machine.
        return Ok(vec![
            SocketAddr::from(([127, 0, 0, 1], port)),
            SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
        ]);
    }
    use std::net::ToSocketAddrs;
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    if addrs.is_empty() {
        return Err(format!("{host:?} resolves to no address"));
    }
    Ok(addrs)
}

/// Answers one scrape: reads the request head (bounded in size and time) and writes the text
/// exposition, whatever the path.
async fn scrape(mut stream: tokio::net::TcpStream, handle: PrometheusHandle) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut head = Vec::with_capacity(1024);
    let read = async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    };
    if !matches!(
        tokio::time::timeout(Duration::from_secs(5), read).await,
        Ok(true)
    ) {
        return;
    }
    handle.run_upkeep();
    let body = handle.render();
    let response = format!(
        "HTTP/1.0 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        stream.write_all(response.as_bytes()),
    )
    .await;
    let _ = stream.shutdown().await;
}
