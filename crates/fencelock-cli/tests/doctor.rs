//! `fencelock doctor` against real Redis servers and a SQLite file.
#![allow(clippy::unwrap_used)]

mod common;

use common::{fencelock, Finished, FINISH};
use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};

fn doctor(args: &[&str]) -> (Finished, String) {
    let out = fencelock(&["doctor"]).args(args).run(FINISH).unwrap();
    let text = out.stdout.clone();
    (out, text)
}

#[test]
fn a_node_without_fsync_always_is_flagged_and_one_with_it_is_not() {
    let plain = RedisServer::start().unwrap();
    let (out, text) = doctor(&["--backend", &plain.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("WARN  appendonly no"), "{text}");
    assert!(text.contains("reachable, Redis"), "{text}");
    assert!(text.contains("clock offset"), "{text}");

    let durable =
        RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]).unwrap();
    let (out, text) = doctor(&["--backend", &durable.url()]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("ok    appendonly yes, appendfsync always"),
        "{text}"
    );
    // The one problem left: the default user may run everything (see tests/acl.rs).
    assert!(
        text.contains("@all") && text.contains("1 problem(s)"),
        "{text}"
    );
}

#[test]
fn redlock_with_a_dead_node_reports_it_and_exits_69() {
    let mut nodes = start_redis_nodes(3).unwrap();
    nodes[1].kill();
    let (out, text) = doctor(&["--backend", &redlock_url(&nodes)]);
    assert_eq!(out.status.code(), Some(69), "{text}");
    assert!(
        text.contains(&format!("node {}\n  WARN  unreachable", nodes[1].addr())),
        "{text}"
    );
    assert!(text.contains("clocks within"), "{text}");
    assert!(text.contains("1 node(s) unreachable"), "{text}");
}

#[test]
fn ttl_advice_is_three_times_the_hold_p99() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/l.db", dir.path().display());
    let (out, text) = doctor(&["--backend", &url, "--hold-p99", "2s", "--ttl", "5s"]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(
        text.contains("a TTL of at least 6s (3 x p99); the TTL in use, 5s, is shorter"),
        "{text}"
    );
    let (_, text) = doctor(&["--backend", &url, "--hold-p99", "2s", "--ttl", "6s"]);
    assert!(
        text.contains("ok    hold p99 2s: a TTL of at least 6s"),
        "{text}"
    );
}

#[test]
fn bad_urls_exit_64() {
    let (out, _) = doctor(&["--backend", "ftp://x"]);
    assert_eq!(out.status.code(), Some(64));
}
