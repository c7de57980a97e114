//! `fencelock run` against real Redis servers: one node and a Redlock quorum.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{assert_lost_within, fencelock_at, hold, FINISH};
use fencelock_testkit::{backend_url, redlock_url, start_redis_nodes, wait_until, RedisServer};

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn runs_and_hands_out_increasing_tokens(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut tokens = Vec::new();
    for i in 0..3 {
        let out_file = dir.path().join(format!("t{i}"));
        let script = format!("echo $FENCELOCK_TOKEN > {}", out_file.display());
        let out = fencelock_at(url, &["run", "job", "--", "sh", "-c", &script])
            .run(FINISH)
            .unwrap();
        assert!(out.status.success(), "{}", out.stderr);
        tokens.push(read(&out_file).parse::<u64>().unwrap());
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");

    // Held by a running invocation: a second one exits 75 naming the holder.
    let ready = dir.path().join("ready");
    let release = dir.path().join("release");
    let script = format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.02; done",
        ready.display(),
        release.display()
    );
    let holder = fencelock_at(url, &["run", "job", "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    let out = fencelock_at(url, &["run", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(out.status.code(), Some(75));
    let stderr = &out.stderr;
    assert!(
        stderr.contains("fencelock-run") && stderr.contains("pid"),
        "{stderr}"
    );
    std::fs::write(&release, "").unwrap();
    let mut holder = holder;
    let status = holder.wait(FINISH).unwrap().status;
    assert!(status.success());
}

#[test]
fn run_on_one_redis_node() {
    let server = RedisServer::start().unwrap();
    runs_and_hands_out_increasing_tokens(&server.url());
}

#[test]
fn run_on_redlock() {
    let nodes = start_redis_nodes(3).unwrap();
    runs_and_hands_out_increasing_tokens(&redlock_url(&nodes));
}

#[test]
fn key_prints_the_lock_key_for_redis_cli() {
    let server = RedisServer::start().unwrap();
    let out = fencelock_at(&server.url(), &["key", "{a}:b"])
        .run(FINISH)
        .unwrap();
    assert!(out.status.success());
    let text = &out.stdout;
    assert!(text.contains("lock\tfencelock:v1:lock:{a}:b"), "{text}");
    assert!(text.contains("fence\tfencelock:v1:fence:{a}:b"), "{text}");
    let out = fencelock_at(&server.url(), &["key", "--prefix", "billing:", "x"])
        .run(FINISH)
        .unwrap();
    let text = &out.stdout;
    assert!(text.contains("lock\tbilling:lock:x"), "{text}");
}

#[test]
fn run_terminates_its_command_when_every_node_dies() {
    for n in [1, 3] {
        let mut nodes = start_redis_nodes(n).unwrap();
        let url = backend_url(&nodes);
        let dir = tempfile::tempdir().unwrap();
        let mut child = hold(&url, "1s", &dir);
        for node in &mut nodes {
            node.kill();
        }
        assert_lost_within(&mut child, Duration::from_secs(2), &format!("{n} node(s)"));
    }
}

/// A forced release by an ACL user that may not `XADD` (so cannot write the audit record)
/// deletes nothing, and the message names the refused command; the lock stays with its holder.
#[test]
fn a_forced_release_that_cannot_write_its_audit_record_deletes_nothing() {
    let server = RedisServer::start().unwrap();
    let acl = server
        .cli(&[
            "ACL", "SETUSER", "ops", "on", ">opspw", "~*", "&*", "+@all", "-xadd",
        ])
        .unwrap();
    assert!(acl.status.success(), "{acl:?}");
    let dir = tempfile::tempdir().unwrap();
    let holder = hold(&server.url(), "30s", &dir);
    let as_ops = format!("redis://ops:opspw@{}", server.addr());
    let out = fencelock_at(
        &as_ops,
        &[
            "release",
            "--force",
            "--holder-is-dead",
            "--reason",
            "test",
            "job",
        ],
    )
    .run(FINISH)
    .unwrap();
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    assert!(out.stderr.contains("XADD"), "{}", out.stderr);
    assert!(
        out.stderr.contains("nothing was released"),
        "{}",
        out.stderr
    );
    let shown = fencelock_at(&server.url(), &["inspect", "job"])
        .run(FINISH)
        .unwrap();
    assert!(shown.stdout.starts_with("job: held by"), "{shown:?}");
    let audit = server.cli(&["XLEN", "fencelock:v1:audit"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&audit.stdout).trim(), "0");
    assert!(!holder.exited(), "the holder lost its lock");
}
