//! Every metric moves as it should. One Prometheus recorder is installed for the whole test
//! binary (the watchdog records from its own task, out of reach of a thread-local recorder),
//! so each test uses resource names of its own and reads only their series.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use fencelock::fence::MemoryFence;
use fencelock::metrics as m;
use fencelock::{Client, ErrorKind, FencingToken, LockOptions};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::time::timeout;

fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full(m::ACQUIRE_DURATION.into()),
                m::ACQUIRE_DURATION_BUCKETS,
            )
            .unwrap()
            .set_buckets_for_metric(
                Matcher::Full(m::HOLD_DURATION.into()),
                m::HOLD_DURATION_BUCKETS,
            )
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(recorder).unwrap();
        handle
    })
}

/// The value of the sample `name` whose labels include all of `labels`, summed over the
/// samples that match (0 when none does), read from a fresh scrape.
fn sample(name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = recorder().render();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(parse_line)
        .filter(|(n, ls, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

type Labels = Vec<(String, String)>;

/// `name{k="v",...} value` (label values here never hold quotes or commas).
fn parse_line(line: &str) -> Option<(String, Labels, f64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let value = value.parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((n, rest)) => (n, rest.strip_suffix('}')?),
        None => (series, ""),
    };
    let labels = labels
        .split(',')
        .filter(|l| !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            Some((k.to_owned(), v.trim_matches('"').to_owned()))
        })
        .collect();
    Some((name.to_owned(), labels, value))
}

fn count(name: &str, labels: &[(&str, &str)]) -> u64 {
    sample(name, labels) as u64
}

async fn sqlite(dir: &tempfile::TempDir) -> Client {
    recorder();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    Client::connect(&url).await.unwrap()
}

/// Polls the scrape until `cond` holds; metrics have no event to await.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let ok = timeout(Duration::from_secs(10), async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        ok.is_ok(),
        "{what} did not happen:\n{}",
        recorder().render()
    );
}

const ACQUIRES: &str = "fencelock_acquire_duration_seconds_count";
const HOLDS: &str = "fencelock_hold_duration_seconds_count";

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_and_its_release_are_timed() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    let r = [("engine", "sqlite"), ("resource", "m-grant")];
    let opts = LockOptions::default().ttl(Duration::from_secs(5));
    let lease = c.acquire("m-grant", &opts).await.unwrap();
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "acquired")]), 1);
    assert_eq!(sample(m::LEASE_TTL, &r), 5.0);
    assert_eq!(count(HOLDS, &r), 0, "the hold has not ended yet");
    // Every failure reason's series exists, at zero, from the first attempt on.
    for reason in ["held", "timed_out", "engine", "invalid", "limit"] {
        let text = recorder().render();
        assert!(
            text.contains(&format!(
                "{}{{engine=\"sqlite\",backend=\"default\",resource=\"m-grant\",reason=\"{reason}\"}} 0",
                m::ACQUIRE_FAILURES
            )),
            "no zero series for {reason}:\n{text}"
        );
    }
    lease.release().await.unwrap();
    assert_eq!(count(HOLDS, &r), 1);
    assert_eq!(count(m::ACQUIRE_FAILURES, &r), 0);
    assert_eq!(count(m::LEASES_LOST, &r), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_by_a_stored_limit_counts_as_limit() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    c.set_limits(&fencelock::Limits::default().with_max_ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    let r = [("engine", "sqlite"), ("resource", "m-limit")];
    let long = LockOptions::default().ttl(Duration::from_secs(300));
    let e = c.try_acquire("m-limit", &long).await.unwrap_err();
    assert_eq!(e.kind(), fencelock::ErrorKind::LimitExceeded);
    assert_eq!(
        count(m::ACQUIRE_FAILURES, &[r[0], r[1], ("reason", "limit")]),
        1
    );
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "limit")]), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_and_timeouts_are_failures_with_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let holder = sqlite(&dir).await;
    let other = sqlite(&dir).await;
    let r = [("engine", "sqlite"), ("resource", "m-contended")];
    let lease = holder
        .try_acquire("m-contended", &LockOptions::default())
        .await
        .unwrap();

    let e = other
        .try_acquire("m-contended", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(
        count(m::ACQUIRE_FAILURES, &[r[0], r[1], ("reason", "held")]),
        1
    );
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "held")]), 1);

    let waiting = LockOptions::default().wait(Duration::from_millis(100));
    let e = other.acquire("m-contended", &waiting).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut);
    assert_eq!(
        count(m::ACQUIRE_FAILURES, &[r[0], r[1], ("reason", "timed_out")]),
        1
    );
    let timed_out = [r[0], r[1], ("outcome", "timed_out")];
    assert_eq!(count(ACQUIRES, &timed_out), 1);
    assert!(
        sample("fencelock_acquire_duration_seconds_sum", &timed_out) >= 0.1,
        "the wait is part of the acquire duration"
    );
    assert_eq!(count(m::ACQUIRE_FAILURES, &r), 2);
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "acquired")]), 1);
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_input_is_a_failure_and_bad_names_are_never_labels() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    let bad_name = "m-bad\nname";
    let e = c
        .try_acquire(bad_name, &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let other = [("resource", "other"), ("reason", "invalid")];
    assert!(count(m::ACQUIRE_FAILURES, &other) >= 1);
    assert!(!recorder().render().contains("m-bad"));

    let too_short = LockOptions::default().ttl(Duration::from_millis(1));
    let e = c.try_acquire("m-invalid", &too_short).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let r = [("resource", "m-invalid"), ("reason", "invalid")];
    assert_eq!(count(m::ACQUIRE_FAILURES, &r), 1);
    assert_eq!(
        count(
            ACQUIRES,
            &[("resource", "m-invalid"), ("outcome", "invalid")]
        ),
        1
    );
}

/// Renewals are counted per lease even though the watchdog sends them in one batch; an
/// explicit extend counts too.
#[tokio::test(flavor = "multi_thread")]
async fn renewals_are_counted_per_lease() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    // Renewal calls get half a cadence (here 250 ms), ample for SQLite even on a busy machine.
    let opts = LockOptions::default().ttl(Duration::from_millis(1500));
    let a = c.try_acquire("m-renew-a", &opts).await.unwrap();
    let b = c.try_acquire("m-renew-b", &opts).await.unwrap();
    let ra = [("resource", "m-renew-a")];
    let rb = [("resource", "m-renew-b")];
    eventually("two renewals of each lease", || {
        count(m::RENEWALS, &ra) >= 2 && count(m::RENEWALS, &rb) >= 2
    })
    .await;
    let before = count(m::RENEWALS, &ra);
    a.extend().await.unwrap();
    assert!(count(m::RENEWALS, &ra) > before);
    assert_eq!(count(m::RENEWAL_FAILURES, &ra), 0);
    assert_eq!(count(m::RENEWAL_FAILURES, &rb), 0);
    a.release().await.unwrap();
    b.release().await.unwrap();
    assert_eq!(count(m::LEASES_LOST, &ra), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_left_to_expire_is_lost_as_expired() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    let r = [("engine", "sqlite"), ("resource", "m-expire")];
    let opts = LockOptions::default()
        .ttl(Duration::from_millis(200))
        .auto_renew(false);
    let lease = c.try_acquire("m-expire", &opts).await.unwrap();
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    assert_eq!(
        count(m::LEASES_LOST, &[r[0], r[1], ("reason", "expired")]),
        1
    );
    assert_eq!(count(m::LEASES_LOST, &r), 1);
    assert_eq!(count(HOLDS, &r), 1, "the hold ends when the lease is lost");
    drop(lease);
    assert_eq!(count(HOLDS, &r), 1, "a hold ends once");
    assert_eq!(count(m::RENEWALS, &r), 0);
}

/// A stuck writer holds the SQLite database's write lock: every renewal times out, and after
/// two in a row the lease is lost.
#[tokio::test(flavor = "multi_thread")]
async fn failed_renewals_are_counted_and_lose_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    let r = [("engine", "sqlite"), ("resource", "m-stuck")];
    // Long enough that the second failed renewal (at 5/6 of the TTL) comes well before the
    // validity ends, even on a loaded machine.
    let ttl = Duration::from_secs(2);
    let lease = c
        .try_acquire("m-stuck", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    let blocker = common::hold_write_lock(&dir.path().join("locks.db"), Duration::from_secs(3));
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    assert_eq!(
        count(m::LEASES_LOST, &[r[0], r[1], ("reason", "renewals_failed")]),
        1,
        "{:?}",
        lease.run(async {}).await
    );
    assert_eq!(count(m::RENEWAL_FAILURES, &r), 2);
    // Attempts include the failures, and any renewal that got in before the blocker did.
    assert!(count(m::RENEWALS, &r) >= 2);
    assert_eq!(count(HOLDS, &r), 1);
    drop(lease);
    c.close().await;
    blocker.join().unwrap();
}

#[test]
fn stale_tokens_are_counted_per_resource() {
    recorder();
    let fence = MemoryFence::new();
    fence.admit("m-ledger", FencingToken::new(7)).unwrap();
    let r = [("resource", "m-ledger")];
    assert!(
        recorder()
            .render()
            .contains("fencelock_stale_token_rejections_total{resource=\"m-ledger\"} 0"),
        "the series starts at zero when the fence first meets the resource"
    );
    let e = fence.admit("m-ledger", FencingToken::new(6)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleToken);
    assert_eq!(count(m::STALE_TOKEN_REJECTIONS, &r), 1);
    fence.admit("m-ledger", FencingToken::new(7)).unwrap();
    assert_eq!(count(m::STALE_TOKEN_REJECTIONS, &r), 1, "equal tokens pass");
}

/// The engine no longer lists the owner (someone deleted the key): the next renewal finds
/// out and the lease is lost as `not_holder`, under the engine's own label.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_taken_away_is_lost_as_not_holder() {
    recorder();
    let server = fencelock_testkit::RedisServer::start().unwrap();
    let c = Client::connect(&server.url()).await.unwrap();
    let r = [("engine", "redis"), ("resource", "m-taken")];
    let lease = c
        .try_acquire(
            "m-taken",
            &LockOptions::default().ttl(Duration::from_millis(1500)),
        )
        .await
        .unwrap();
    let (_, lock_key) = c
        .keys_for("m-taken")
        .unwrap()
        .into_iter()
        .find(|(label, _)| *label == "lock")
        .unwrap();
    let out = server.cli(&["DEL", &lock_key]).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1");
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    assert_eq!(
        count(m::LEASES_LOST, &[r[0], r[1], ("reason", "not_holder")]),
        1,
        "{:?}",
        lease.run(async {}).await
    );
    assert_eq!(count(m::RENEWAL_FAILURES, &r), 1);
    assert_eq!(count(HOLDS, &r), 1);
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "acquired")]), 1);
}

/// The 3 am case: one Redlock node of three dies. Acquisitions keep succeeding (no acquire
/// failure is counted, so the acquire-failure alert stays silent), while the dead node's
/// `fencelock_node_up` drops to 0 and its call failures count up: the series the node alert
/// fires on. Node labels are host:port, without the URL's password.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_redlock_node_shows_in_its_node_series_and_not_in_acquire_failures() {
    recorder();
    let mut nodes = fencelock_testkit::start_redis_nodes(3).unwrap();
    for n in &nodes {
        n.cli(&["CONFIG", "SET", "requirepass", "s3cret-node"])
            .unwrap();
    }
    let url =
        fencelock_testkit::redlock_url(&nodes).replace("redlock://", "redlock://:s3cret-node@");
    let c = Client::builder(&url)
        .op_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let opts = LockOptions::default().ttl(Duration::from_secs(5));
    // Warm-up under another name: connections opened and scripts loaded on every node. (A
    // Redlock release returns once a quorum released, so a node may keep this name's key
    // until its TTL; another name keeps that out of the count below.)
    c.try_acquire("m-node-warm", &opts)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let dead = nodes[2].addr();
    nodes[2].kill();
    for _ in 0..5 {
        c.try_acquire("m-node", &opts)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let r = [("engine", "redlock"), ("resource", "m-node")];
    for reason in ["timed_out", "engine", "invalid", "held"] {
        assert_eq!(
            count(m::ACQUIRE_FAILURES, &[r[0], r[1], ("reason", reason)]),
            0
        );
    }
    assert_eq!(count(ACQUIRES, &[r[0], r[1], ("outcome", "acquired")]), 5);
    fn node(addr: &str) -> [(&str, &str); 2] {
        [("engine", "redlock"), ("node", addr)]
    }
    assert_eq!(sample(m::NODE_UP, &node(&dead)), 0.0);
    assert!(count(m::NODE_CALL_FAILURES, &node(&dead)) >= 5);
    for up in [nodes[0].addr(), nodes[1].addr()] {
        assert_eq!(sample(m::NODE_UP, &node(&up)), 1.0, "{up}");
        assert_eq!(count(m::NODE_CALL_FAILURES, &node(&up)), 0, "{up}");
    }
    assert!(!recorder().render().contains("s3cret-node"));
    c.close().await;
}
