//! Helpers for driving the real `fencelock` binary: a sandbox directory with its own SQLite
//! file, processes that are killed when a test fails, and polling with deadlines.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

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
    /// reach any lock database outside it.
    pub fn bare(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fencelock"));
        cmd.current_dir(self.dir.path())
            .env_remove("FENCELOCK_URL")
            .env_remove("FENCELOCK_LOG")
            .env("XDG_STATE_HOME", self.path("state"))
            .stdin(Stdio::null());
        cmd
    }

    /// `fencelock SUB --backend <sandbox db> ARGS...`.
    pub fn fencelock(&self, sub: &str, args: &[&str]) -> Command {
        let mut cmd = self.bare();
        cmd.arg(sub).arg("--backend").arg(&self.url).args(args);
        cmd
    }

    /// `fencelock run --backend <sandbox db> OPTS... NAME -- sh -c SCRIPT`.
    pub fn run_sh(&self, opts: &[&str], name: &str, script: &str) -> Command {
        let mut cmd = self.fencelock("run", opts);
        cmd.arg(name).args(["--", "sh", "-c", script]);
        cmd
    }

    /// Starts a process whose stdout and stderr go to files in the sandbox (never pipes, so
    /// that reading them cannot block on a grandchild that inherited them).
    pub fn spawn(&self, mut cmd: Command) -> Proc {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        let stdout = self.path(&format!("proc-{n}.out"));
        let stderr = self.path(&format!("proc-{n}.err"));
        cmd.stdout(File::create(&stdout).expect("create stdout file"))
            .stderr(File::create(&stderr).expect("create stderr file"));
        let child = cmd.spawn().expect("start fencelock");
        Proc {
            child,
            what: format!("{cmd:?}"),
            stdout,
            stderr,
            groups: Vec::new(),
            status: None,
        }
    }

    /// Runs a process to completion (at most [`FINISH`]).
    pub fn run(&self, cmd: Command) -> Finished {
        self.spawn(cmd).wait(FINISH)
    }

    /// `fencelock inspect NAME` on the sandbox database; returns its stdout, trimmed.
    pub fn inspect(&self, name: &str) -> String {
        let out = self.run(self.fencelock("inspect", &[name]));
        assert_eq!(out.code(), Some(0), "inspect failed: {out:?}");
        out.stdout.trim_end().to_owned()
    }
}

/// A started process. Dropping it while the process still runs (a failing test) stops it:
/// SIGCONT and SIGTERM first, so fencelock can forward the signal to its command, then SIGKILL.
/// Process groups handed to [`Proc::adopt_group`] are killed as well.
pub struct Proc {
    child: Child,
    what: String,
    stdout: PathBuf,
    stderr: PathBuf,
    groups: Vec<Pid>,
    status: Option<ExitStatus>,
}

impl Proc {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pid fits in i32"))
    }

    /// Kill this process group too when the guard is dropped.
    pub fn adopt_group(&mut self, pgid: Pid) {
        self.groups.push(pgid);
    }

    /// The exit status, if the process has exited (reaping it).
    pub fn try_finish(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    /// Whether [`Proc::try_finish`] has seen the process exit.
    pub fn exited(&self) -> bool {
        self.status.is_some()
    }

    /// Waits up to `limit` for the process to exit and returns what it printed.
    pub fn wait(&mut self, limit: Duration) -> Finished {
        let exited = poll_until(limit, || self.try_finish().is_some());
        assert!(
            exited,
            "still running after {limit:?}: {}\nstderr so far: {}",
            self.what,
            self.stderr()
        );
        Finished {
            status: self.status.expect("exited"),
            stdout: read(&self.stdout),
            stderr: read(&self.stderr),
        }
    }

    pub fn stderr(&self) -> String {
        read(&self.stderr)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.try_finish_quietly() {
            let pid = self.pid();
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGTERM);
            if !poll_until(Duration::from_secs(2), || !self.try_finish_quietly()) {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        for &g in &self.groups {
            let _ = killpg(g, Signal::SIGKILL);
        }
    }
}

impl Proc {
    /// Whether the process is still running; never panics (used from `Drop`).
    fn try_finish_quietly(&mut self) -> bool {
        if self.status.is_none() {
            match self.child.try_wait() {
                Ok(s) => self.status = s,
                Err(_) => return false,
            }
        }
        self.status.is_none()
    }
}

/// A process that has exited, with its output.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

pub use fencelock_testkit::wait_until as poll_until;

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
    let stopped_cleanly = (0..200).any(|_| {
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
        let stopped = poll_until(Duration::from_secs(5), || all_threads_stopped(pid));
        assert!(stopped, "process {pid} did not stop");
        if !holds_write_lock(pid) {
            return true;
        }
        kill(pid, Signal::SIGCONT).expect("SIGCONT");
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
