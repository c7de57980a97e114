//! The supervisor: a small single-threaded process, the parent of the command and the child
//! subreaper of everything the command starts. It holds no lease and talks to no engine, so
//! nothing but the kernel can delay it; fencelock tells it the lease's validity deadline and
//! it stops the work before that deadline whenever fencelock cannot (fencelock stopped or
//! killed).

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;

use clap::Args;
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::prctl;
use nix::sys::signal::{kill, killpg, sigprocmask, SigHandler, SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpid, getppid, setpgid, tcsetpgrp, Pid};

use super::procs::{monotonic_ns, signal_all, ToParent, ToWorker};

/// Internal: how fencelock starts its supervisor. Not a user command.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The inherited socket to fencelock.
    #[arg(long)]
    fd: i32,
    /// fencelock's pid: a different parent means fencelock died.
    #[arg(long)]
    parent: i32,
    /// The lease's owner value. Not used here: it is in the arguments so that the runbook's
    /// liveness check, which reads /proc/PID/cmdline (readable by every user), finds this
    /// process at work for the lease after fencelock itself is gone.
    #[arg(long)]
    owner: String,
    #[arg(long)]
    ttl_ms: u64,
    #[arg(long)]
    kill_after_ms: u64,
    /// The lease's validity deadline, CLOCK_MONOTONIC ns.
    #[arg(long)]
    deadline_ns: i64,
    #[arg(long)]
    release_on_exit: bool,
    /// Make the command's process group the terminal's foreground group.
    #[arg(long)]
    foreground: bool,
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// Signals the supervisor takes through its signalfd instead of their default actions: every
/// one fencelock forwards, and these three, so that none can stop or kill it (a group of its
/// own is not proof against `kill -TSTP -PGID` given its pgid); SIGTTOU blocked also lets it
/// write to a terminal with `tostop` set from the background; SIGCHLD to reap.
const HANDLED_TOO: [Signal; 3] = [Signal::SIGCHLD, Signal::SIGTTIN, Signal::SIGTTOU];

const MS: i64 = 1_000_000;

struct Worker {
    me: Pid,
    parent: Pid,
    sock: UnixStream,
    /// The command while it has not been reaped.
    command: Option<Pid>,
    release_on_exit: bool,
    /// Validity deadline of the lease (CLOCK_MONOTONIC ns), as fencelock last reported it.
    deadline: i64,
    /// Before the deadline: how long before it every descendant is dead, and how much
    /// earlier they get SIGTERM.
    margin: i64,
    grace: i64,
    kill_after: i64,
    fired: bool,
    parent_gone: bool,
    term_sent: bool,
    /// When the remaining descendants get SIGKILL, once termination has begun.
    kill_at: Option<i64>,
    inbox: Vec<u8>,
}

/// Runs the supervisor; returns its exit status (fencelock reads the outcome from the socket).
pub fn worker(args: WorkerArgs) -> u8 {
    // SAFETY: fencelock passed this descriptor for this process alone; nothing else owns it.
    let sock = unsafe { UnixStream::from_raw_fd(args.fd) };
    // The command must not inherit it: its end of the wire would keep fencelock from seeing
    // this process die.
    let _ = fcntl(args.fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
    if sock.set_nonblocking(true).is_err() || prctl::set_child_subreaper(true).is_err() {
        eprintln!("fencelock: the supervisor cannot set itself up");
        return 70;
    }
    let mut mask = SigSet::empty();
    for s in super::FORWARDED.into_iter().chain(HANDLED_TOO) {
        mask.add(s);
    }
    if mask.thread_block().is_err() {
        return 70;
    }
    let Ok(sfd) = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
    else {
        return 70;
    };
    let ttl = i64::try_from(args.ttl_ms).unwrap_or(i64::MAX / MS) * MS;
    let kill_after = i64::try_from(args.kill_after_ms)
        .unwrap_or(i64::MAX / MS)
        .saturating_mul(MS);
    let mut w = Worker {
        me: getpid(),
        parent: Pid::from_raw(args.parent),
        sock,
        command: None,
        release_on_exit: args.release_on_exit,
        deadline: args.deadline_ns,
        margin: (ttl / 20).clamp(10 * MS, 500 * MS),
        grace: kill_after.min(ttl / 5),
        kill_after,
        fired: false,
        parent_gone: false,
        term_sent: false,
        kill_at: None,
        inbox: Vec::new(),
    };
    if getppid() != w.parent {
        // fencelock died while starting this process: nothing to supervise.
        return 70;
    }
    match w.spawn(&args.command, args.foreground) {
        Ok(pid) => {
            w.command = Some(pid);
            w.send(&ToParent::Started(pid.as_raw()));
        }
        Err(e) => {
            eprintln!("fencelock: cannot start {:?}: {e}", args.command[0]);
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            w.send(&ToParent::NotStarted(code));
            w.send(&ToParent::AllGone);
            return 0;
        }
    }
    w.run(&sfd)
}

impl Worker {
    fn spawn(&self, command: &[String], foreground: bool) -> std::io::Result<Pid> {
        let me = self.me;
        let mut cmd = std::process::Command::new(&command[0]);
        cmd.args(&command[1..]);
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (setpgid, prctl, getppid, signal, sigprocmask, tcsetpgrp).
        unsafe {
            cmd.pre_exec(move || {
                setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                // Should this supervisor die (SIGKILL, a crash), the command dies with it
                // rather than run on unsupervised; checked after setting it, since the
                // supervisor may have died before.
                prctl::set_pdeathsig(Signal::SIGKILL)?;
                if getppid() != me {
                    return Err(std::io::Error::other("the supervisor is gone"));
                }
                // fencelock ignores the terminal's stop signals for itself; the command gets
                // the usual actions.
                for s in [Signal::SIGTTIN, Signal::SIGTTOU, Signal::SIGTSTP] {
                    let _ = nix::sys::signal::signal(s, SigHandler::SigDfl);
                }
                if foreground {
                    // Take the terminal before exec, so that the command never reads it from
                    // the background (shells do the same, in parent and child, for the race).
                    let mut ttou = SigSet::empty();
                    ttou.add(Signal::SIGTTOU);
                    let _ = sigprocmask(SigmaskHow::SIG_BLOCK, Some(&ttou), None);
                    let _ = tcsetpgrp(BorrowedFd::borrow_raw(0), Pid::this());
                }
                sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        // Reaped by the waitpid(-1) loop, never through `Child`.
        Ok(Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX)))
    }

    fn send(&self, msg: &ToParent) {
        // fencelock gone: it cannot be told anything, and `parent_gone` handles the rest.
        let _ = (&self.sock).write_all(msg.encode().as_bytes());
    }

    fn run(&mut self, sfd: &SignalFd) -> u8 {
        loop {
            if self.reap() {
                self.send(&ToParent::AllGone);
                return 0;
            }
            let now = monotonic_ns();
            let term_time = self.deadline - self.margin - self.grace;
            if !self.fired && !self.parent_gone && now >= term_time {
                // fencelock has not reported a renewal in time: it is stopped or stuck, and
                // another holder may be granted the lock at the deadline.
                self.fired = true;
                eprintln!(
                    "fencelock: the lease was not renewed in time (was fencelock stopped?); \
                     stopping the command before its validity ends"
                );
                self.send(&ToParent::DeadlineFired);
                self.terminate(self.deadline - self.margin);
            }
            let mut next: Option<i64> = None;
            if !self.fired && !self.parent_gone {
                next = Some(term_time);
            }
            if let Some(k) = self.kill_at {
                if now >= k {
                    signal_all(self.me, Signal::SIGKILL);
                    // Again soon: a process may have forked between the listing and the kill.
                    next = Some(now + 10 * MS);
                } else {
                    next = Some(next.map_or(k, |n| n.min(k)));
                }
            }
            let timeout = match next {
                None => PollTimeout::NONE,
                Some(n) => {
                    let ms = ((n - now).max(0) / MS + 1).min(60_000);
                    PollTimeout::try_from(u64::try_from(ms).unwrap_or(1))
                        .unwrap_or(PollTimeout::MAX)
                }
            };
            let mut fds = vec![PollFd::new(sfd.as_fd(), PollFlags::POLLIN)];
            if !self.parent_gone {
                fds.push(PollFd::new(self.sock.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(_) => return 70,
            }
            drop(fds);
            self.read_signals(sfd);
            if !self.parent_gone {
                self.read_socket();
            }
        }
    }

    /// Reaps every child that has changed state; true once none is left (ECHILD).
    fn reap(&mut self) -> bool {
        let flags = WaitPidFlag::WNOHANG | WaitPidFlag::WUNTRACED | WaitPidFlag::WCONTINUED;
        loop {
            let (pid, code) = match waitpid(Pid::from_raw(-1), Some(flags)) {
                Ok(WaitStatus::StillAlive) => return false,
                Ok(WaitStatus::Exited(pid, code)) => (pid, u8::try_from(code).unwrap_or(1)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => {
                    (pid, u8::try_from(128 + sig as i32).unwrap_or(255))
                }
                Ok(WaitStatus::Stopped(pid, sig)) => {
                    if Some(pid) == self.command {
                        self.send(&ToParent::Stopped(sig as i32));
                    }
                    continue;
                }
                Ok(_) | Err(Errno::EINTR) => continue,
                Err(Errno::ECHILD) => return true,
                Err(_) => return false,
            };
            if Some(pid) == self.command {
                self.command = None;
                self.send(&ToParent::Exited(code));
                if self.release_on_exit {
                    self.terminate(monotonic_ns().saturating_add(self.kill_after));
                }
            }
        }
    }

    /// SIGTERM and SIGCONT to every descendant now (once), SIGKILL to those left at `kill_at`
    /// (the earliest of the times asked for).
    fn terminate(&mut self, kill_at: i64) {
        if !self.term_sent {
            self.term_sent = true;
            signal_all(self.me, Signal::SIGTERM);
            signal_all(self.me, Signal::SIGCONT);
        }
        self.kill_at = Some(self.kill_at.map_or(kill_at, |k| k.min(kill_at)));
    }

    fn parent_died(&mut self) {
        if self.parent_gone {
            return;
        }
        self.parent_gone = true;
        eprintln!(
            "fencelock: fencelock (pid {}) is gone; stopping the command",
            self.parent
        );
        // Its lease was not released and lapses at the deadline: everything must be gone by
        // then, kill-after or not.
        let by = monotonic_ns()
            .saturating_add(self.kill_after)
            .min(self.deadline - self.margin);
        self.terminate(by);
    }

    fn read_signals(&mut self, sfd: &SignalFd) {
        while let Ok(Some(info)) = sfd.read_signal() {
            let signo = i32::try_from(info.ssi_signo).unwrap_or(0);
            // SIGCHLD: the reaping loop handles it. Any other signal reaching this process
            // directly is ignored (fencelock forwards what the command should get), unless it
            // is the parent-death signal.
            if signo != Signal::SIGCHLD as i32 && getppid() != self.parent {
                self.parent_died();
            }
        }
    }

    fn read_socket(&mut self) {
        let mut buf = [0u8; 512];
        loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => {
                    self.parent_died();
                    return;
                }
                Ok(n) => self.inbox.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.parent_died();
                    return;
                }
            }
        }
        while let Some(end) = self.inbox.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.inbox.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..end]).into_owned();
            match ToWorker::decode(&line) {
                Some(ToWorker::Deadline(ns)) if !self.fired => self.deadline = ns,
                Some(ToWorker::Signal(s)) => self.forward(s),
                Some(ToWorker::Terminate) => {
                    // fencelock saw the loss and acts on it: the command gets the full
                    // --kill-after, and the switch, there for a fencelock that cannot act,
                    // stands down.
                    self.fired = true;
                    self.terminate(monotonic_ns().saturating_add(self.kill_after));
                }
                _ => {}
            }
        }
    }

    /// To the command's process group while the command lives; after that, to what it left
    /// behind.
    fn forward(&self, signo: i32) {
        let Ok(sig) = Signal::try_from(signo) else {
            return;
        };
        match self.command {
            Some(pgid) => {
                if killpg(pgid, sig).is_err() {
                    let _ = kill(pgid, sig);
                }
            }
            None => {
                signal_all(self.me, sig);
            }
        }
    }
}
