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
    let mut holder = hold(&server.url(), "30s", &dir);
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
    assert!(holder.try_finish().is_none(), "the holder lost its lock");
}

/// `fencelock run --ttl 30s NAME` on `url`, holding the lock until stopped.
fn hold_name(url: &str, name: &str, dir: &tempfile::TempDir) -> fencelock_testkit::Proc {
    let ready = dir.path().join(format!("{name}.ready"));
    let script = format!("touch {}; exec sleep 100", ready.display());
    let child = fencelock_at(
        url,
        &["run", "--ttl", "30s", name, "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    child
}

fn cli_text(node: &RedisServer, args: &[&str]) -> String {
    let out = node.cli(args).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Redlock: nodes whose ACL refuses the audit write (`XADD`) release nothing; the others
/// release and record together. With a majority left the lock is free and the refusing node
/// is named; with a majority refusing the lock stays held and the error names every node.
#[test]
fn a_redlock_forced_release_refused_by_some_nodes_names_them() {
    let nodes = start_redis_nodes(3).unwrap();
    let url = redlock_url(&nodes);
    let dir = tempfile::tempdir().unwrap();
    let _a = hold_name(&url, "a", &dir);
    let _b = hold_name(&url, "b", &dir);
    let _c = hold_name(&url, "c", &dir);
    for node in &nodes[1..] {
        let acl = node.cli(&["ACL", "SETUSER", "default", "-xadd"]).unwrap();
        assert!(acl.status.success(), "{acl:?}");
    }
    let release = |name: &str| {
        fencelock_at(
            &url,
            &[
                "release",
                "--force",
                "--holder-is-dead",
                "--reason",
                "test",
                name,
            ],
        )
        .run(FINISH)
        .unwrap()
    };

    // Two of three nodes refuse: one released and recorded, the lock still held.
    let out = release("a");
    assert_eq!(out.status.code(), Some(69), "{out:?}");
    let said = &out.stderr;
    assert!(said.contains("done on too few nodes"), "{said}");
    assert!(
        said.contains(&format!(
            "released and recorded on {} only",
            nodes[0].addr()
        )),
        "{said}"
    );
    for node in &nodes[1..] {
        assert!(said.contains(&format!("{}: NoPerm", node.addr())), "{said}");
    }
    assert!(said.contains("XADD"), "{said}");
    let shown = fencelock_at(&url, &["inspect", "a"]).run(FINISH).unwrap();
    assert!(shown.stdout.starts_with("a: held by"), "{shown:?}");
    let lock = "fencelock:v1:lock:a";
    assert_eq!(cli_text(&nodes[0], &["EXISTS", lock]), "0");
    for node in &nodes[1..] {
        assert_eq!(cli_text(node, &["EXISTS", lock]), "1", "{}", node.addr());
        assert_eq!(cli_text(node, &["XLEN", "fencelock:v1:audit"]), "0");
    }
    assert_eq!(cli_text(&nodes[0], &["XLEN", "fencelock:v1:audit"]), "1");

    // One node refuses: a majority released and recorded it, and the refusing node is named.
    let ok = nodes[2]
        .cli(&["ACL", "SETUSER", "default", "+xadd"])
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
    let out = release("b");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains("b: force-released"), "{out:?}");
    assert!(
        out.stderr
            .contains("NOT released nor recorded on 1 node(s)"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains(&format!("  {}: NoPerm", nodes[1].addr())),
        "{}",
        out.stderr
    );
    let shown = fencelock_at(&url, &["inspect", "b"]).run(FINISH).unwrap();
    assert!(shown.stdout.starts_with("b: free"), "{shown:?}");
    let lock = "fencelock:v1:lock:b";
    assert_eq!(cli_text(&nodes[1], &["EXISTS", lock]), "1");
    assert_eq!(cli_text(&nodes[1], &["XLEN", "fencelock:v1:audit"]), "0");
    for node in [&nodes[0], &nodes[2]] {
        assert_eq!(cli_text(node, &["EXISTS", lock]), "0", "{}", node.addr());
    }
    assert_eq!(cli_text(&nodes[2], &["XLEN", "fencelock:v1:audit"]), "1");
    let out = fencelock_at(
        &url,
        &[
            "release",
            "--force",
            "--holder-is-dead",
            "--reason",
            "t",
            "--json",
            "c",
        ],
    )
    .run(FINISH)
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(
        out.stdout.contains(&format!(
            "\"not_released_on\":[\"{}: NoPerm",
            nodes[1].addr()
        )),
        "{out:?}"
    );
}
