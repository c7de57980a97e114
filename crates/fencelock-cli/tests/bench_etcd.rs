//! `fencelock bench` against a real 3-member etcd cluster.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::process::{Command, Stdio};
use std::time::Duration;

use fencelock_testkit::{wait_until, EtcdCluster};

#[test]
fn bench_on_etcd_reports_the_put_rate_reference_and_leaves_no_key() {
    let c = EtcdCluster::start(3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .args(["bench", "--backend", &c.url(), "--quick", "--seconds", "1"])
        .env_remove("FENCELOCK_URL")
        .stdin(Stdio::null())
        .stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut status = None;
    let done = wait_until(Duration::from_secs(180), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    if !done {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        done,
        "bench still running; stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(0), "{stdout}\n{stderr}");
    for expected in [
        "fencelock bench: engine etcd",
        "sequential, 1 client",
        "64 tasks, 1 shared client",
        "reference: etcd Put rate",
        "1 client  Put",
        "64 tasks  Put",
        "pairs/puts",
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
