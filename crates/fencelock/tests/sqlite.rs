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
