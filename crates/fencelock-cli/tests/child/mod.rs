//! The `fencelock` binary as a child process pointed at one backend, killed when a test ends.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fencelock_testkit::wait_until;

pub const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// A child process killed by pid when the test ends, whatever happened.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fencelock ARGS` with `FENCELOCK_URL=url`, no stdin, output captured.
pub fn fencelock(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env("FENCELOCK_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Starts `fencelock run --ttl TTL job` holding the lock until killed; returns once the command
/// runs (it touches a file in `dir`).
pub fn hold(url: &str, ttl: &str, dir: &tempfile::TempDir) -> Proc {
    let ready = dir.path().join("ready");
    let script = format!("touch {}; exec sleep 100", ready.display());
    let child = Proc(
        fencelock(
            url,
            &["run", "--ttl", ttl, "job", "--", "sh", "-c", &script],
        )
        .spawn()
        .unwrap(),
    );
    assert!(wait_until(Duration::from_secs(10), || ready.exists()));
    child
}

/// Waits for `fencelock run` to exit; it must exit 79 (lease lost) within `limit`, saying so.
/// `what` names the case in failure messages.
pub fn assert_lost_within(child: &mut Proc, limit: Duration, what: &str) {
    let since = Instant::now();
    let mut status = None;
    assert!(wait_until(Duration::from_secs(10), || {
        status = child.0.try_wait().unwrap();
        status.is_some()
    }));
    assert_eq!(status.unwrap().code(), Some(79), "{what}");
    assert!(since.elapsed() < limit, "{what}: {:?}", since.elapsed());
    let mut err = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("lost"), "{what}: {err}");
}
