//! How close the client crate itself lets a lock built on server-side scripts come to the
//! reference: the same connection type fencelock uses (the `redis` crate's multiplexed
//! connection), first sending SET and a no-op EVALSHA (the reference's pair, through this
//! crate instead of redis-benchmark's C client), then two no-op scripts carrying exactly the
//! keys and arguments of fencelock's acquire and release. The second rate is what fencelock
//! could reach if its scripts cost nothing on the server and its client path nothing at all.

use std::time::Duration;

use anyhow::anyhow;
use tokio::time::Instant;

use crate::plumbing::Stop;
use crate::reference::REFERENCE_SET_KEY;
use crate::servers::{open_node, NodeConn, NODE_TIMEOUT};
use crate::{runtime, PHASE_SLACK};

/// Pairs per second of both kinds, measured in alternating rounds.
pub(crate) struct Floor {
    pub reference: f64,
    pub shaped: f64,
}

const ROUND: u32 = 200;

/// [`measure`] on a thread of its own with a single-threaded runtime, over a connection opened
/// there, so that it stays comparable with the sequential run measured the same way.
pub(crate) async fn measure_on_own_thread(
    url: &str,
    dur: Duration,
    stop: &Stop,
) -> anyhow::Result<Floor> {
    let (url, stop) = (url.to_owned(), stop.clone());
    runtime::on_own_thread("fencelock-bench-floor", move || async move {
        // A multiplexed connection drives its socket from a task on the runtime that opened it.
        let conn = tokio::time::timeout(NODE_TIMEOUT, open_node(&url))
            .await
            .map_err(|_| anyhow!("no answer from the node within 5s"))??;
        tokio::time::timeout(dur + PHASE_SLACK, measure(&conn, dur, &stop))
            .await
            .map_err(|_| {
                anyhow!(
                    "did not finish within {}",
                    crate::plumbing::dur(dur + PHASE_SLACK)
                )
            })?
            .map_err(Into::into)
    })
    .await
}

async fn measure(conn: &NodeConn, dur: Duration, stop: &Stop) -> redis::RedisResult<Floor> {
    let mut conn = conn.clone();
    let noop = redis::Script::new("return 1");
    let acquire_keys: Vec<String> = (0..9)
        .map(|i| format!("fencelock-bench-floor:{i}"))
        .collect();
    let release_keys = &acquire_keys[..7];
    // Any 32 hex digits: the size of an owner value is what counts here.
    let owner = format!("{:032x}", u128::from(std::process::id()));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let channel = "fencelock:v1:client:0123456789abcdef";
    let wake = "fencelock:v1:wake:fencelock-bench-floor";
    let acquire = |inv: &mut redis::ScriptInvocation<'_>| {
        for k in &acquire_keys {
            inv.key(k);
        }
        inv.arg(&owner)
            .arg(30_000)
            .arg(0)
            .arg("0123456789abcdef")
            .arg(now.to_string())
            .arg(format!(
                "{}\nbench-host\nfencelock-bench",
                std::process::id()
            ))
            .arg(0)
            .arg(channel);
    };
    let (mut ref_time, mut ref_pairs) = (Duration::ZERO, 0u32);
    let (mut shaped_time, mut shaped_pairs) = (Duration::ZERO, 0u32);
    let end = Instant::now() + dur;
    while Instant::now() < end && !stop.is_set() {
        let t = Instant::now();
        for _ in 0..ROUND {
            redis::cmd("SET")
                .arg(REFERENCE_SET_KEY)
                .arg("x")
                .query_async::<()>(&mut conn)
                .await?;
            noop.prepare_invoke().invoke_async::<i64>(&mut conn).await?;
        }
        ref_time += t.elapsed();
        ref_pairs += ROUND;
        let t = Instant::now();
        for _ in 0..ROUND {
            let mut inv = noop.prepare_invoke();
            acquire(&mut inv);
            inv.invoke_async::<i64>(&mut conn).await?;
            let mut inv = noop.prepare_invoke();
            for k in release_keys {
                inv.key(k);
            }
            inv.arg(&owner).arg(wake).arg(1);
            inv.invoke_async::<i64>(&mut conn).await?;
        }
        shaped_time += t.elapsed();
        shaped_pairs += ROUND;
    }
    let per_s = |pairs: u32, time: Duration| f64::from(pairs) / time.as_secs_f64().max(1e-9);
    Ok(Floor {
        reference: per_s(ref_pairs, ref_time),
        shaped: per_s(shaped_pairs, shaped_time),
    })
}
