//! Helpers for driving the real `fencelock` binary. Every test starts it through [`fencelock`]:
//! the test kit's [`BinCommand`] pointed at this build's binary, so each invocation gets the
//! same clean environment, output captured in files and a [`Proc`] guard that stops it when
//! the test ends. Around it: a sandbox directory with its own SQLite file, a `fencelock run`
//! holder on any backend, and polling with deadlines.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

pub use fencelock_testkit::wait_until as poll_until;
pub use fencelock_testkit::{BinCommand, Finished, Proc};

/// `fencelock ARGS`, with stdin from `/dev/null` and no `FENCELOCK_*` variable inherited from
/// the test's own environment.
pub fn fencelock(args: &[&str]) -> BinCommand {
    let mut cmd = BinCommand::new(env!("CARGO_BIN_EXE_fencelock"));
    cmd.args(args);
    cmd
}

/// `fencelock ARGS` with `FENCELOCK_URL=url`.
pub fn fencelock_at(url: &str, args: &[&str]) -> BinCommand {
    let mut cmd = fencelock(args);
    cmd.env("FENCELOCK_URL", url);
    cmd
}

/// Upper bound for a fencelock invocation that is expected to finish on its own.
pub const FINISH: Duration = Duration::from_secs(30);

/// A shell fragment that waits for the file `release` to appear, giving up (exit 99) after
/// about a minute so that a failed test never leaves a command running for long.
pub const WAIT_FOR_RELEASE: &str = "i=0; while [ ! -e release ]; do i=$((i+1)); \
     if [ $i -gt 1200 ]; then exit 99; fi; sleep 0.05; done";

/// A temporary directory holding the lock database, the commands' files and the captured
/// output of every process started from it. Commands run with it as their working directory.
pub struct Sandbox {
    dir: TempDir,
    url: String,
    seq: AtomicUsize,
}

impl Sandbox {
    pub fn new() -> Sandbox {
        let dir = tempfile::Builder::new()
            .prefix("fencelock-cli-")
            .tempdir()
            .expect("create a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("locks.db").display());
        Sandbox {
            dir,
            url,
            seq: AtomicUsize::new(0),
        }
    }

    /// The backend URL of this sandbox's SQLite file.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// `fencelock` with no arguments, run in the sandbox, with an environment that cannot
    /// reach any lock database or routing configuration outside it.
    pub fn bare(&self) -> BinCommand {
        let mut cmd = fencelock(&[]);
        cmd.current_dir(self.dir.path())
            .env("XDG_STATE_HOME", self.path("state"))
            .env("XDG_CONFIG_HOME", self.path("config"));
        cmd
    }

    /// `fencelock SUB --backend <sandbox db> ARGS...`.
    pub fn fencelock(&self, sub: &str, args: &[&str]) -> BinCommand {
        let mut cmd = self.bare();
        cmd.arg(sub).arg("--backend").arg(&self.url).args(args);
        cmd
    }

    /// `fencelock run --backend <sandbox db> OPTS... NAME -- sh -c SCRIPT`.
    pub fn run_sh(&self, opts: &[&str], name: &str, script: &str) -> BinCommand {
        let mut cmd = self.fencelock("run", opts);
        cmd.arg(name).args(["--", "sh", "-c", script]);
        cmd
    }

    /// Starts a process whose stdout and stderr go to `proc-N.out` and `proc-N.err` in the
    /// sandbox, N counting the processes started from it.
    pub fn spawn(&self, cmd: impl Into<BinCommand>) -> Proc {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let mut cmd = cmd.into();
        cmd.output_to(
            self.path(&format!("proc-{n}.out")),
            self.path(&format!("proc-{n}.err")),
        );
        cmd.spawn().unwrap()
    }

    /// Runs a process to completion (at most [`FINISH`]).
    pub fn run(&self, cmd: impl Into<BinCommand>) -> Finished {
        self.spawn(cmd).wait(FINISH).unwrap()
    }

    /// `fencelock inspect NAME` on the sandbox database; returns its stdout, trimmed.
    pub fn inspect(&self, name: &str) -> String {
        let out = self.run(self.fencelock("inspect", &[name]));
        assert_eq!(out.code(), Some(0), "inspect failed: {out:?}");
        out.stdout.trim_end().to_owned()
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Waits (up to `limit`) for a file that a command writes with `echo ... > file` to hold a
/// complete line, and returns its content trimmed.
pub fn wait_for_line(path: &Path, limit: Duration) -> String {
    let mut content = String::new();
    let ok = poll_until(limit, || {
        content = read(path);
        content.ends_with('\n')
    });
    assert!(ok, "{} did not appear within {limit:?}", path.display());
    content.trim().to_owned()
}

/// Stops `pid` with SIGSTOP at a moment when it holds no write lock on any file (so a stopped
/// holder cannot block other SQLite clients through the database's write lock), and returns
/// once every one of its threads is stopped.
pub fn stop_outside_write_lock(pid: Pid) {
    stop_cleanly(pid, |sig| kill(pid, sig));
}

/// As [`stop_outside_write_lock`], for the process group whose leader is `leader` (a job that
/// a shell's `kill -STOP %1` stops as a whole): SIGSTOP to the group, at a moment when its
/// leader holds no write lock.
pub fn stop_group_outside_write_lock(leader: Pid) {
    stop_cleanly(leader, |sig| nix::sys::signal::killpg(leader, sig));
}

fn stop_cleanly(pid: Pid, send: impl Fn(Signal) -> nix::Result<()>) {
    let stopped_cleanly = (0..200).any(|_| {
        send(Signal::SIGSTOP).expect("SIGSTOP");
        let stopped = poll_until(Duration::from_secs(5), || all_threads_stopped(pid));
        assert!(stopped, "process {pid} did not stop");
        if !holds_write_lock(pid) {
            return true;
        }
        send(Signal::SIGCONT).expect("SIGCONT");
        std::thread::sleep(Duration::from_millis(7));
        false
    });
    assert!(
        stopped_cleanly,
        "process {pid} held a write lock every time it was stopped"
    );
}

fn all_threads_stopped(pid: Pid) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        let stat = read(&t.path().join("stat"));
        // The state is the first field after the parenthesised command name.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "T" || state == "t")
    })
}

/// Whether /proc/locks lists a POSIX write lock owned by `pid` (SQLite takes one on the
/// WAL index for every write transaction).
fn holds_write_lock(pid: Pid) -> bool {
    let pid = pid.to_string();
    read(Path::new("/proc/locks")).lines().any(|line| {
        let fields: Vec<&str> = line.split_whitespace().filter(|f| *f != "->").collect();
        // "1: POSIX  ADVISORY  WRITE 12345 fe:00:123 120 120"
        fields.len() >= 5 && fields[3] == "WRITE" && fields[4] == pid
    })
}

/// Starts `fencelock run --ttl TTL job` on `url`, holding the lock until stopped; returns once
/// the command runs (it touches a file in `dir`).
pub fn hold(url: &str, ttl: &str, dir: &TempDir) -> Proc {
    let ready = dir.path().join("ready");
    let script = format!("touch {}; exec sleep 100", ready.display());
    let child = fencelock_at(
        url,
        &["run", "--ttl", ttl, "job", "--", "sh", "-c", &script],
    )
    .spawn()
    .unwrap();
    assert!(poll_until(Duration::from_secs(10), || ready.exists()));
    child
}

/// Waits for `fencelock run` to exit; it must exit 79 (lease lost) within `limit`, saying so.
/// `what` names the case in failure messages.
pub fn assert_lost_within(child: &mut Proc, limit: Duration, what: &str) {
    let since = Instant::now();
    let out = child.wait(Duration::from_secs(10));
    assert!(out.is_ok(), "{what}: {out:?}");
    let out = out.unwrap();
    assert_eq!(out.code(), Some(79), "{what}");
    assert!(since.elapsed() < limit, "{what}: {:?}", since.elapsed());
    assert!(out.stderr.contains("lost"), "{what}: {}", out.stderr);
}
