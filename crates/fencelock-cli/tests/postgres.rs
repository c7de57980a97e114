//! `fencelock key` and `fencelock run` against a real PostgreSQL: the printed key is the lock
//! `psql` takes, and a holder whose session ends has its command terminated.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{assert_lost_within, fencelock_at, hold, FINISH};
use fencelock_testkit::{wait_until, PgServer};

fn query(server: &PgServer, sql: &str) -> String {
    let out = server.psql(sql).unwrap();
    assert!(out.status.success(), "psql failed: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn advisory_key(url: &str, name: &str) -> i64 {
    let out = fencelock_at(url, &["key", name]).run(FINISH).unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = out.stdout;
    let line = text.lines().find(|l| l.starts_with("advisory\t"));
    assert!(line.is_some(), "{text}");
    line.unwrap()["advisory\t".len()..].parse().unwrap()
}

#[test]
fn key_is_the_advisory_lock_psql_takes() {
    let server = PgServer::start().unwrap();
    let url = server.url();
    let k = advisory_key(&url, "job");
    let dir = tempfile::tempdir().unwrap();
    let holder = hold(&url, "30s", &dir);
    assert_eq!(
        query(&server, &format!("SELECT pg_try_advisory_lock({k})")),
        "f"
    );
    let out = fencelock_at(&url, &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    drop(holder);
    // The run's session ended with it: the lock is free at once.
    assert!(wait_until(Duration::from_secs(10), || {
        query(&server, &format!("SELECT pg_try_advisory_lock({k})")) == "t"
    }));
    let out = fencelock_at(&format!("{url}?mode=lease"), &["key", "job"])
        .run(FINISH)
        .unwrap();
    let text = &out.stdout;
    assert!(
        text.contains("row\tfencelock_leases.key = fencelock:v1:job"),
        "{text}"
    );
}

#[test]
fn run_is_terminated_when_its_backend_is() {
    let server = PgServer::start().unwrap();
    let url = server.url();
    let k = advisory_key(&url, "job");
    let dir = tempfile::tempdir().unwrap();
    let mut holder = hold(&url, "30s", &dir);
    let ended = query(
        &server,
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_locks l WHERE l.locktype = 'advisory' \
             AND ((l.classid::bigint << 32) | l.objid::bigint) = {k}"
        ),
    );
    assert_eq!(ended, "t");
    // Far sooner than the 30 s TTL would tell.
    assert_lost_within(&mut holder, Duration::from_secs(5), &url);
}

#[test]
fn run_is_terminated_when_the_server_restarts() {
    let mut server = PgServer::start().unwrap();
    let url = server.url();
    let dir = tempfile::tempdir().unwrap();
    let mut holder = hold(&url, "30s", &dir);
    server.restart().unwrap();
    assert_lost_within(&mut holder, Duration::from_secs(5), &url);
}
