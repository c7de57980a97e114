//! `fencelock-bench` against a real 3-member etcd cluster.
#![allow(clippy::unwrap_used)]

mod common;

use common::bench;
use fencelock_testkit::EtcdCluster;

#[test]
fn bench_on_etcd_reports_the_put_rate_reference_and_leaves_no_key() {
    let c = EtcdCluster::start(3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = bench(
        dir.path(),
        &["--backend", &c.url(), "--quick", "--seconds", "1"],
    );
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert_eq!(out.code(), Some(0), "{stdout}\n{stderr}");
    for expected in [
        "fencelock bench: engine etcd",
        "sequential, 1 client",
        "64 tasks, 1 shared client",
        "raft writes per acquire+release, counted over 50 sequential pairs",
        "reference: etcd Put rate",
        "1 client  Put",
        "64 tasks  Put",
        "pairs/puts",
        "driver    the engine's two requests through the bare client",
        "fencelock/driver",
        "writes    a Put on the session lease and a Delete, nothing else",
        "driver/writes",
        "== 2. contention: 16 workers",
        "clean-up: released every lease; the etcd engine leaves no key",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    let keys = c.ctl(&["get", "/", "--prefix", "--keys-only"]).unwrap();
    let keys = String::from_utf8_lossy(&keys.stdout);
    assert!(keys.trim().is_empty(), "keys left behind: {keys}");
}
