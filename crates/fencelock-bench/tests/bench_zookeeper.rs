//! `fencelock-bench` against a real 3-server ZooKeeper ensemble.
#![allow(clippy::unwrap_used)]

mod common;

use common::bench;
use fencelock_testkit::ZkEnsemble;

#[test]
fn bench_on_zookeeper_reports_the_create_delete_reference_and_leaves_no_node() {
    let zk = ZkEnsemble::start(3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = bench(
        dir.path(),
        &["--backend", &zk.url(), "--quick", "--seconds", "1"],
    );
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert_eq!(out.code(), Some(0), "{stdout}\n{stderr}");
    for expected in [
        "fencelock bench: engine zookeeper",
        "sequential, 1 client",
        "64 tasks, 1 shared client",
        "reference: ZooKeeper create+delete",
        "1 client  create+delete",
        "64 tasks  create+delete",
        "pairs/reference",
        "== 2. contention: 16 workers",
        "clean-up: released every lease; the ZooKeeper engine leaves only empty containers",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    // What the lock held is gone: no waiter node under any lock path.
    let stat = zk.four_letters(zk.leader().unwrap(), "mntr").unwrap();
    let ephemerals = stat
        .lines()
        .find_map(|l| l.strip_prefix("zk_ephemerals_count"))
        .map(|v| v.trim().parse::<u64>().unwrap());
    assert_eq!(ephemerals, Some(0), "{stat}");
}
