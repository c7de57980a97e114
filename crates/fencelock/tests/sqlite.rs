//! The SQLite engine and the engine-independent core, against real database files.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use fencelock::{Client, ErrorKind, LockOptions};
use tokio::time::{timeout, Instant};

fn url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}/locks.db", dir.path().display())
}

async fn client(dir: &tempfile::TempDir) -> Client {
    Client::connect(&url(dir)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_and_token_order_under_contention() {
    let dir = tempfile::tempdir().unwrap();
    common::check_mutual_exclusion(&url(&dir), 12, 5).await;
}

#[tokio::test]
async fn tokens_keep_increasing_across_client_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let mut last = 0;
    for _ in 0..3 {
        let c = client(&dir).await;
        let lease = c.try_acquire("job", &LockOptions::default()).await.unwrap();
        assert!(lease.token().get() > last);
        last = lease.token().get();
        lease.release().await.unwrap();
        c.close().await;
    }
}

#[tokio::test]
async fn holder_metadata_is_recorded_and_shown() {
    let dir = tempfile::tempdir().unwrap();
    let c = Client::builder(url(&dir))
        .client_name("invoice-worker")
        .connect()
        .await
        .unwrap();
    let lease = c.try_acquire("job", &LockOptions::default()).await.unwrap();
    let other = client(&dir).await;
    let h = other.inspect("job").await.unwrap().expect("held");
    assert_eq!(h.owner, lease.owner());
    assert_eq!(h.token, Some(lease.token()));
    assert_eq!(h.pid, Some(std::process::id()));
    assert_eq!(h.client.as_deref(), Some("invoice-worker"));
    assert!(h.host.is_some_and(|h| !h.is_empty()));
    assert!(h.acquired_at.is_some() && h.renewed_at.is_some());
    assert!(h.ttl_left.unwrap() <= Duration::from_secs(30));

    let e = other
        .try_acquire("job", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(e.holder().map(|h| h.owner.as_str()), Some(lease.owner()));
    assert!(e.to_string().contains("invoice-worker"), "{e}");

    lease.release().await.unwrap();
    assert!(other.inspect("job").await.unwrap().is_none());
}

#[tokio::test]
async fn stale_owner_cannot_extend_or_release_a_successor() {
    let dir = tempfile::tempdir().unwrap();
    common::check_stale_owner(&url(&dir)).await;
}

#[tokio::test]
async fn lease_without_renewal_is_lost_when_validity_ends() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(&dir).await;
    let ttl = Duration::from_millis(300);
    let lease = c
        .try_acquire("r", &LockOptions::default().ttl(ttl).auto_renew(false))
        .await
        .unwrap();
    let valid_until = lease.valid_until();
    assert!(valid_until <= Instant::now() + ttl);
    let out = timeout(
        Duration::from_secs(3),
        lease.run(std::future::pending::<()>()),
    )
    .await
    .unwrap();
    assert_eq!(out.unwrap_err().kind(), ErrorKind::LeaseLost);
    // Lost no later than the end of validity (plus timer slack), and not much earlier.
    let now = Instant::now();
    assert!(now >= valid_until, "lost before validity ended");
    assert!(now < valid_until + Duration::from_millis(200));
}

#[tokio::test]
async fn watchdog_keeps_a_lease_for_ten_ttls() {
    let dir = tempfile::tempdir().unwrap();
    common::check_watchdog(&url(&dir)).await;
}

#[tokio::test]
async fn renewals_blocked_by_the_engine_mark_the_lease_lost_before_validity_ends() {
    let dir = tempfile::tempdir().unwrap();
    let c = Client::builder(url(&dir))
        .op_timeout(Duration::from_millis(150))
        .connect()
        .await
        .unwrap();
    // Long enough that two failed renewals (each given TTL/6, capped by the 150 ms operation
    // timeout) land well inside the validity window even on a loaded machine.
    let ttl = Duration::from_millis(2400);
    let lease = c
        .try_acquire("r", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    let valid_until = lease.valid_until();
    // Another connection takes the database's write lock and keeps it: every renewal times out.
    let path = dir.path().join("locks.db");
    let blocker = common::hold_write_lock(&path, Duration::from_secs(4));
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    assert!(
        Instant::now() < valid_until,
        "lease reported lost only after its validity ended"
    );
    blocker.join().unwrap();
}

#[tokio::test]
async fn dropping_a_waiting_acquire_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let holder_client = client(&dir).await;
    let waiter_client = client(&dir).await;
    let holder = holder_client
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    let opts = LockOptions::default().wait(Duration::from_secs(30));
    let waiting = waiter_client.acquire("r", &opts);
    assert!(timeout(Duration::from_millis(100), waiting).await.is_err());
    holder.release().await.unwrap();
    waiter_client.close().await;
    assert!(waiter_client.inspect("r").await.unwrap().is_none());
}

/// Polls a future once and drops it, as a `select!` that picks another branch would.
async fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

#[tokio::test]
async fn dropping_an_acquire_in_flight_leaves_nothing_held() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(&dir).await;
    let mut cancelled = 0;
    for i in 0..50 {
        let name = format!("r{i}");
        // Polled once: the attempt is sent to the engine, then the future is dropped. When the
        // engine answers before that first poll ends, the lease is simply granted; only the
        // attempts still in flight exercise the clean-up.
        match poll_once(c.try_acquire(&name, &LockOptions::default())).await {
            Some(granted) => granted.unwrap().release().await.unwrap(),
            None => cancelled += 1,
        }
        c.close().await;
        assert!(
            c.inspect(&name).await.unwrap().is_none(),
            "{name} left held"
        );
    }
    assert!(
        cancelled >= 5,
        "only {cancelled} of 50 attempts were still in flight"
    );
}

#[tokio::test]
async fn dropping_a_lease_stops_renewal_and_lets_it_expire() {
    let dir = tempfile::tempdir().unwrap();
    let a = client(&dir).await;
    let b = client(&dir).await;
    let ttl = Duration::from_millis(200);
    let lease = a
        .try_acquire("r", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    drop(lease);
    let started = Instant::now();
    let next = b
        .acquire("r", &LockOptions::default().wait(Duration::from_secs(3)))
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
    next.release().await.unwrap();
}

#[tokio::test]
async fn invalid_input_is_rejected_before_io() {
    let dir = tempfile::tempdir().unwrap();
    let c = client(&dir).await;
    for name in ["", "a\nb", &"x".repeat(300)] {
        let e = c
            .try_acquire(name, &LockOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
    }
    let e = c
        .try_acquire("ok", &LockOptions::default().ttl(Duration::ZERO))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    for bad in ["ftp://x", "sqlite://relative", "nonsense"] {
        let e = Client::connect(bad).await.err().unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad}");
    }
}

#[tokio::test]
async fn unwritable_database_is_an_engine_error() {
    let e = Client::connect("sqlite:///proc/fencelock-cannot-write/locks.db")
        .await
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::Engine);
    assert!(
        e.to_string().contains("/proc/fencelock-cannot-write"),
        "{e}"
    );
}

/// Pins the audit log's stored format: other tools read `fencelock_audit`, so its columns
/// keep their names and SQLite types (integers for times, flags and tokens).
#[tokio::test]
async fn forced_release_keeps_the_audit_row_format() {
    let dir = tempfile::tempdir().unwrap();
    let c = Client::builder(url(&dir))
        .client_name("ledger-writer")
        .connect()
        .await
        .unwrap();
    let lease = c
        .try_acquire("ledger", &LockOptions::default())
        .await
        .unwrap();
    let request = fencelock::ForceRelease::new("pinned")
        .user("alice")
        .host("ops-box")
        .holder_is_dead(true);
    let record = c
        .force_release("ledger", &request)
        .await
        .unwrap()
        .expect("released");

    let db = rusqlite::Connection::open(dir.path().join("locks.db")).unwrap();
    let row = db
        .query_row(
            "SELECT record_id, key, at, typeof(at), by_user, by_host, reason, declared_dead,
                    typeof(declared_dead), owner, token, pid, client, typeof(acquired_at),
                    typeof(renewed_at), ttl_ms, counter
             FROM fencelock_audit",
            [],
            |r| {
                Ok((
                    (
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, String>(3)?,
                        r.get::<_, String>(4)?,
                        r.get::<_, String>(5)?,
                        r.get::<_, String>(6)?,
                    ),
                    (
                        r.get::<_, i64>(7)?,
                        r.get::<_, String>(8)?,
                        r.get::<_, String>(9)?,
                        r.get::<_, i64>(10)?,
                        r.get::<_, i64>(11)?,
                        r.get::<_, String>(12)?,
                    ),
                    (
                        r.get::<_, String>(13)?,
                        r.get::<_, String>(14)?,
                        r.get::<_, i64>(15)?,
                        r.get::<_, i64>(16)?,
                    ),
                ))
            },
        )
        .unwrap();
    let at = record
        .at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    assert_eq!(
        row.0,
        (
            record.id.clone(),
            format!("{}ledger", fencelock::DEFAULT_PREFIX),
            at,
            "integer".to_owned(),
            "alice".to_owned(),
            "ops-box".to_owned(),
            "pinned".to_owned(),
        )
    );
    assert_eq!(
        row.1,
        (
            1,
            "integer".to_owned(),
            lease.owner().to_owned(),
            lease.token().get() as i64,
            i64::from(std::process::id()),
            "ledger-writer".to_owned(),
        )
    );
    assert_eq!(
        row.2,
        (
            "integer".to_owned(),
            "integer".to_owned(),
            LockOptions::default().ttl_value().as_millis() as i64,
            record.counter.get() as i64,
        )
    );
}
