//! `fencelock limits set|show|clear` and the refusals they bring: exit 77 from `run`, on
//! SQLite, one Redis node and a Redlock whose every node stores (and checks) the limits.
#![allow(clippy::unwrap_used)]

mod common;

use common::{fencelock_at, Sandbox, FINISH};
use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};

/// What every engine shows: limits stored and shown, `run --ttl 5m` refused with exit 77 by
/// the engine (the CLI has no cap of its own below a day), a TTL within the cap granted, and
/// the refusal gone once the limits are cleared.
fn refuses_a_ttl_above_the_stored_cap(url: &str) {
    let set = fencelock_at(
        url,
        &[
            "limits",
            "set",
            "--max-ttl",
            "1m",
            "--max-held-per-client",
            "2",
        ],
    )
    .run(FINISH)
    .unwrap();
    assert!(set.status.success(), "{}", set.stderr);
    let show = fencelock_at(url, &["limits", "show"]).run(FINISH).unwrap();
    assert!(show.status.success(), "{}", show.stderr);
    assert!(
        show.stdout.contains("max-ttl 1m, max-held-per-client 2"),
        "{}",
        show.stdout
    );

    let refused = fencelock_at(url, &["run", "--ttl", "5m", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(refused.status.code(), Some(77), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("max-ttl = 1m"),
        "{}",
        refused.stderr
    );
    let within = fencelock_at(url, &["run", "--ttl", "30s", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert!(within.status.success(), "{}", within.stderr);

    let clear = fencelock_at(url, &["limits", "clear"]).run(FINISH).unwrap();
    assert!(clear.status.success(), "{}", clear.stderr);
    let show = fencelock_at(url, &["limits", "show", "--json"])
        .run(FINISH)
        .unwrap();
    assert!(
        show.stdout.contains("\"max_ttl_ms\":null"),
        "{}",
        show.stdout
    );
    let granted = fencelock_at(url, &["run", "--ttl", "5m", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert!(granted.status.success(), "{}", granted.stderr);
}

#[test]
fn sqlite_refuses_a_ttl_above_the_stored_cap() {
    let sandbox = Sandbox::new();
    refuses_a_ttl_above_the_stored_cap(sandbox.url());
}

#[test]
fn redis_refuses_a_ttl_above_the_stored_cap() {
    let server = RedisServer::start().unwrap();
    refuses_a_ttl_above_the_stored_cap(&server.url());
}

fn get_limits(node: &RedisServer) -> String {
    let out = node.cli(&["GET", "fencelock:v1:limits"]).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// On Redlock the limits go to every node, each node's scripts check its own copy, and `show`
/// reads every node and says when they disagree.
#[test]
fn redlock_stores_limits_on_every_node_and_shows_disagreement() {
    let nodes = start_redis_nodes(3).unwrap();
    let url = redlock_url(&nodes);
    refuses_a_ttl_above_the_stored_cap(&url);

    let set = fencelock_at(&url, &["limits", "set", "--max-ttl", "1m"])
        .run(FINISH)
        .unwrap();
    assert!(set.status.success(), "{}", set.stderr);
    for node in &nodes {
        assert_eq!(get_limits(node), "60000 0", "{}", node.addr());
    }
    // One node changed behind fencelock's back.
    node_set(&nodes[2], "120000 0");
    let show = fencelock_at(&url, &["limits", "show"]).run(FINISH).unwrap();
    assert_eq!(show.status.code(), Some(69), "{}", show.stdout);
    assert!(show.stderr.contains("different limits"), "{}", show.stderr);
    assert!(show.stdout.contains("max-ttl 2m"), "{}", show.stdout);
    // The two nodes that keep the 1m cap refuse a 90 s TTL, so no quorum grants it, and the
    // grant of the third is rolled back.
    let refused = fencelock_at(&url, &["run", "--ttl", "90s", "other", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(refused.status.code(), Some(77), "{}", refused.stderr);
    for node in &nodes {
        let out = node.cli(&["EXISTS", "fencelock:v1:lock:other"]).unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0");
    }

    let clear = fencelock_at(&url, &["limits", "clear"])
        .run(FINISH)
        .unwrap();
    assert!(clear.status.success(), "{}", clear.stderr);
    for node in &nodes {
        assert_eq!(get_limits(node), "", "{}", node.addr());
    }
}

fn node_set(node: &RedisServer, value: &str) {
    let out = node.cli(&["SET", "fencelock:v1:limits", value]).unwrap();
    assert!(out.status.success());
}
