//! A binary under test as a child process: one way for every test to start it, so that each
//! gets the same clean environment, the same capture of what it prints, and the same guard that
//! stops it when the test ends, whether the test passed or not.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

use crate::proc::as_pid;
use crate::wait_until;

/// Variables through which a test's own environment would reach the binary: a lock database,
/// a routing configuration, a key prefix or a log level outside the test.
const INHERITED: [&str; 4] = [
    "FENCELOCK_URL",
    "FENCELOCK_CONFIG",
    "FENCELOCK_PREFIX",
    "FENCELOCK_LOG",
];

/// How long a process gets between SIGTERM and SIGKILL when its guard is dropped.
const TERM_GRACE: Duration = Duration::from_secs(2);

/// A command line for a binary under test, built like [`std::process::Command`].
///
/// [`BinCommand::new`] starts from no arguments, stdin from `/dev/null` and none of the
/// `FENCELOCK_URL`, `FENCELOCK_CONFIG`, `FENCELOCK_PREFIX` and `FENCELOCK_LOG` variables. Stdout and stderr go to
/// files, never pipes, so that reading them cannot block on a grandchild that inherited them:
/// the files given to [`BinCommand::output_to`], else two files in a temporary directory that
/// lives as long as the [`Proc`].
#[derive(Debug)]
pub struct BinCommand {
    cmd: Command,
    output: Output,
}

#[derive(Debug)]
enum Output {
    Temporary,
    Files(PathBuf, PathBuf),
    Discarded,
}

impl BinCommand {
    /// `program` with no arguments, stdin from `/dev/null` and a clean `FENCELOCK_*`
    /// environment (see the type's documentation).
    pub fn new(program: impl AsRef<OsStr>) -> BinCommand {
        let mut cmd = Command::new(program);
        for var in INHERITED {
            cmd.env_remove(var);
        }
        cmd.stdin(Stdio::null());
        BinCommand {
            cmd,
            output: Output::Temporary,
        }
    }

    /// Adds an argument.
    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut BinCommand {
        self.cmd.arg(arg);
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(&mut self, args: I) -> &mut BinCommand
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.cmd.args(args);
        self
    }

    /// Sets an environment variable.
    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut BinCommand {
        self.cmd.env(key, value);
        self
    }

    /// Sets environment variables.
    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut BinCommand
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        self.cmd.envs(vars);
        self
    }

    /// Removes an environment variable.
    pub fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut BinCommand {
        self.cmd.env_remove(key);
        self
    }

    /// Sets the working directory.
    pub fn current_dir(&mut self, dir: impl AsRef<Path>) -> &mut BinCommand {
        self.cmd.current_dir(dir);
        self
    }

    /// Writes stdout and stderr to these files (created or truncated at spawn).
    pub fn output_to(
        &mut self,
        stdout: impl Into<PathBuf>,
        stderr: impl Into<PathBuf>,
    ) -> &mut BinCommand {
        self.output = Output::Files(stdout.into(), stderr.into());
        self
    }

    /// Starts the process as the leader of a new process group in the test's session, as a
    /// shell starts a job, so that a test can signal the job as a whole (`kill -STOP -PGID`).
    /// The group is the process's pid; hand it to [`Proc::adopt_group`] for cleanup.
    pub fn own_group(&mut self) -> &mut BinCommand {
        std::os::unix::process::CommandExt::process_group(&mut self.cmd, 0);
        self
    }

    /// Sends stdout and stderr to `/dev/null`, for processes started by the dozen whose output
    /// no test reads.
    pub fn discard_output(&mut self) -> &mut BinCommand {
        self.output = Output::Discarded;
        self
    }

    /// Starts the process.
    ///
    /// # Errors
    ///
    /// The output files or the temporary directory cannot be created, or the program cannot
    /// be started.
    pub fn spawn(&mut self) -> Result<Proc, ProcError> {
        self.try_spawn()
            .map_err(|e| ProcError(format!("cannot start {:?}: {e}", self.cmd)))
    }

    fn try_spawn(&mut self) -> io::Result<Proc> {
        let (dir, files) = match &self.output {
            Output::Temporary => {
                let dir = tempfile::Builder::new()
                    .prefix("fencelock-proc-")
                    .tempdir()?;
                let files = (dir.path().join("stdout"), dir.path().join("stderr"));
                (Some(dir), Some(files))
            }
            Output::Files(out, err) => (None, Some((out.clone(), err.clone()))),
            Output::Discarded => (None, None),
        };
        match &files {
            Some((out, err)) => self
                .cmd
                .stdout(File::create(out)?)
                .stderr(File::create(err)?),
            None => self.cmd.stdout(Stdio::null()).stderr(Stdio::null()),
        };
        let child = self.cmd.spawn()?;
        Ok(Proc {
            child,
            what: format!("{:?}", self.cmd),
            files,
            groups: Vec::new(),
            status: None,
            _dir: dir,
        })
    }

    /// Starts the process and waits up to `limit` for it to exit.
    ///
    /// # Errors
    ///
    /// As [`BinCommand::spawn`] and [`Proc::wait`]; a process still running at the limit is
    /// stopped as the dropped [`Proc`] stops it.
    pub fn run(&mut self, limit: Duration) -> Result<Finished, ProcError> {
        self.spawn()?.wait(limit)
    }
}

/// A command for another program (a server's own client, say) that a test starts beside the
/// binary under test, to be captured and stopped the same way. Its environment and stdin are
/// left as the command has them.
impl From<Command> for BinCommand {
    fn from(cmd: Command) -> BinCommand {
        BinCommand {
            cmd,
            output: Output::Temporary,
        }
    }
}

/// A started process. Dropping it while the process still runs (a failing test) stops it:
/// SIGCONT and SIGTERM first, so that a binary that supervises commands can pass the signal
/// on, then SIGKILL after two seconds. Process groups handed to [`Proc::adopt_group`] are
/// SIGKILLed as well.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    what: String,
    files: Option<(PathBuf, PathBuf)>,
    groups: Vec<Pid>,
    status: Option<ExitStatus>,
    /// Holds the output files of a command given none of its own.
    _dir: Option<TempDir>,
}

impl Proc {
    /// The process id.
    pub fn pid(&self) -> Pid {
        as_pid(self.child.id())
    }

    /// Kills this process group too when the guard is dropped: what the process started in a
    /// group of its own outlives it otherwise.
    pub fn adopt_group(&mut self, pgid: Pid) {
        self.groups.push(pgid);
    }

    /// The exit status, if the process has exited (reaping it). A process that cannot be
    /// asked counts as still running, so that a waiting test reports it at its deadline.
    pub fn try_finish(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Whether [`Proc::try_finish`] has seen the process exit; it does not ask the process
    /// itself (call `try_finish` for that).
    pub fn exited(&self) -> bool {
        self.status.is_some()
    }

    /// Waits up to `limit` for the process to exit and returns what it printed.
    ///
    /// # Errors
    ///
    /// It still runs at `limit`: the error gives the command line and what it has printed so
    /// far.
    pub fn wait(&mut self, limit: Duration) -> Result<Finished, ProcError> {
        let exited = wait_until(limit, || self.try_finish().is_some());
        match self.status {
            Some(status) if exited => Ok(Finished {
                status,
                stdout: self.stdout(),
                stderr: self.stderr(),
            }),
            _ => Err(ProcError(format!(
                "still running after {limit:?}: {}\nstdout so far: {}\nstderr so far: {}",
                self.what,
                self.stdout(),
                self.stderr()
            ))),
        }
    }

    /// What the process has written to stdout so far; empty if its output is discarded.
    pub fn stdout(&self) -> String {
        self.files
            .as_ref()
            .map(|(out, _)| read(out))
            .unwrap_or_default()
    }

    /// What the process has written to stderr so far; empty if its output is discarded.
    pub fn stderr(&self) -> String {
        self.files
            .as_ref()
            .map(|(_, err)| read(err))
            .unwrap_or_default()
    }

    /// Whether the process is still running. A process that cannot be asked may have been
    /// reaped already, and its pid reused: it is not signalled.
    fn running(&mut self) -> bool {
        if self.status.is_none() {
            match self.child.try_wait() {
                Ok(status) => self.status = status,
                Err(_) => return false,
            }
        }
        self.status.is_none()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.running() {
            let pid = self.pid();
            let _ = kill(pid, Signal::SIGCONT);
            let _ = kill(pid, Signal::SIGTERM);
            if !wait_until(TERM_GRACE, || !self.running()) {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        for &g in &self.groups {
            let _ = killpg(g, Signal::SIGKILL);
        }
    }
}

/// A process that could not be started, or did not exit in time. Its `Debug` form is its
/// message as written, so that a test's `unwrap()` prints the command line and the output on
/// lines of their own rather than as one escaped string.
pub struct ProcError(String);

impl std::fmt::Debug for ProcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for ProcError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProcError {}

/// A process that has exited, with its output.
#[derive(Debug)]
pub struct Finished {
    /// How it exited.
    pub status: ExitStatus,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl Finished {
    /// The exit code; `None` if a signal ended the process.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> BinCommand {
        let mut cmd = BinCommand::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[test]
    fn output_and_status_are_captured() {
        let out = sh("echo out; echo err >&2; exit 3")
            .run(Duration::from_secs(10))
            .unwrap();
        assert_eq!(out.code(), Some(3));
        assert_eq!(
            (out.stdout.as_str(), out.stderr.as_str()),
            ("out\n", "err\n")
        );

        let quiet = sh("echo out").discard_output().run(Duration::from_secs(10));
        assert_eq!(quiet.unwrap().stdout, "");
    }

    #[test]
    fn a_process_past_its_limit_is_reported_then_stopped_by_the_guard() {
        let mut p = sh("echo started; exec sleep 100").spawn().unwrap();
        let pid = p.pid();
        let err = p.wait(Duration::from_millis(200)).unwrap_err().to_string();
        assert!(err.starts_with("still running after 200ms"), "{err}");
        assert!(err.contains("stdout so far: started"), "{err}");
        drop(p);
        // Reaped by the guard: the pid names no process any more.
        assert!(kill(pid, None).is_err());
    }
}
