//! What only the SQLite engine does, against real database files: a database whose write lock
//! another connection keeps. What every engine does is in the conformance suite.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use fencelock::{Client, LockOptions};
use tokio::time::{timeout, Instant};

fn url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}/locks.db", dir.path().display())
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
