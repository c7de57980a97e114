//! `fencelock limits set|show|clear`: the limits stored in the engine under a prefix, which
//! the engine checks inside every grant and renewal (the client, on etcd).

use std::time::Duration;

use anyhow::Result;
use clap::{Args, Subcommand};
use fencelock::Limits;

use crate::{connect, exit, fail, json, parse_duration, BackendArg};

#[derive(Args, Debug)]
pub struct LimitsArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(Subcommand, Debug)]
enum Action {
    /// Store the limits of the prefix, replacing any stored before (on every Redlock node).
    Set(SetArgs),
    /// Show the limits as each node (or the database) stores them; exits 69 when a node
    /// cannot be read or the nodes disagree.
    Show(ShowArgs),
    /// Remove the limits of the prefix (on every node).
    Clear(ClearArgs),
}

#[derive(Args, Debug)]
struct SetArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Refuse grants and renewals with a longer TTL.
    #[arg(long, value_parser = parse_duration)]
    max_ttl: Option<Duration>,
    /// Refuse a client (by client name, or its own random id without one) a lease beyond this
    /// many held under the prefix; it waits, within its --wait, for one to end.
    #[arg(long)]
    max_held_per_client: Option<u32>,
}

#[derive(Args, Debug)]
struct ShowArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Print a JSON array, one object per node, instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ClearArgs {
    #[command(flatten)]
    backend: BackendArg,
}

pub async fn limits(args: LimitsArgs) -> Result<u8> {
    match args.action {
        Action::Set(a) => {
            let mut limits = Limits::default();
            if let Some(t) = a.max_ttl {
                limits = limits.with_max_ttl(t);
            }
            if let Some(n) = a.max_held_per_client {
                limits = limits.with_max_held_per_client(n);
            }
            if limits.is_empty() {
                eprintln!(
                    "fencelock: give --max-ttl, --max-held-per-client or both (fencelock limits \
                     clear removes the limits)"
                );
                return Ok(exit::USAGE);
            }
            let client = connect(&a.backend, "fencelock-limits").await?;
            client.set_limits(&limits).await.map_err(fail)?;
            outln!("limits of {:?}: {limits}", a.backend.prefix);
            client.close().await;
            Ok(0)
        }
        Action::Clear(a) => {
            let client = connect(&a.backend, "fencelock-limits").await?;
            client.set_limits(&Limits::default()).await.map_err(fail)?;
            outln!("limits of {:?}: none", a.backend.prefix);
            client.close().await;
            Ok(0)
        }
        Action::Show(a) => show(a).await,
    }
}

async fn show(a: ShowArgs) -> Result<u8> {
    let client = connect(&a.backend, "fencelock-limits").await?;
    let nodes = client.limits().await.map_err(fail)?;
    client.close().await;
    let readings: Vec<Option<&Option<Limits>>> =
        nodes.iter().map(|n| n.limits.as_ref().ok()).collect();
    let unreadable = readings.iter().any(Option::is_none);
    let first = readings.iter().flatten().next().copied();
    let disagree = readings.iter().flatten().any(|l| Some(*l) != first);
    if a.json {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "null".to_owned());
        let out: Vec<String> = nodes
            .iter()
            .map(|n| match &n.limits {
                Ok(l) => format!(
                    "{{\"node\":{},\"max_ttl_ms\":{},\"max_held_per_client\":{}}}",
                    json::string(&n.node),
                    opt(l
                        .and_then(|l| l.max_ttl())
                        .map(|d| d.as_millis().to_string())),
                    opt(l
                        .and_then(|l| l.max_held_per_client())
                        .map(|n| n.to_string())),
                ),
                Err(e) => format!(
                    "{{\"node\":{},\"error\":{}}}",
                    json::string(&n.node),
                    json::string(e)
                ),
            })
            .collect();
        outln!("[{}]", out.join(","));
    } else {
        for n in &nodes {
            match &n.limits {
                Ok(Some(l)) => outln!("{}\t{l}", n.node),
                Ok(None) => outln!("{}\tno limits", n.node),
                Err(e) => outln!("{}\tunreadable: {e}", n.node),
            }
        }
    }
    if disagree {
        eprintln!(
            "fencelock: the nodes store different limits, so a grant may pass on some nodes and \
             not others; run fencelock limits set (or clear) again"
        );
    }
    if unreadable {
        eprintln!("fencelock: some nodes could not be read");
    }
    Ok(if disagree || unreadable {
        exit::UNAVAILABLE
    } else {
        0
    })
}
