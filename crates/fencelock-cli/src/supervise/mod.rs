//! Running a command under a lease so that nothing it started outlives the lease
//! (invariant 7), shared by `fencelock run` and `fencelock elect`.
//!
//! Two processes share the job, because no process can clean up after its own SIGKILL:
//!
//! - fencelock itself holds the lease, renews it, receives the user's signals and owns the
//!   terminal's job control;
//! - a supervisor (this binary re-executed, [`worker`]), single-threaded and free of any engine,
//!   is a child subreaper and the command's parent, so that every descendant, orphaned or not,
//!   stays below it. It reaps with its own `waitpid(-1)` loop and reports when the last one is
//!   gone; fencelock releases the lease only then.
//!
//! They watch each other over a socket. fencelock reports each new validity deadline; the
//! supervisor kills every descendant shortly before the last reported one if no newer one
//! came, which covers fencelock being stopped (job control, SIGSTOP, a debugger) or killed.
//! Should the supervisor die, the command dies of its parent-death signal (SIGKILL) and
//! fencelock, a subreaper too, kills whatever was reparented to it.
//!
//! Three process groups, so that no one stop freezes both watchers: fencelock's (the shell's
//! job, which `kill -STOP %1` stops as a whole), the supervisor's own, and the command's
//! (which the terminal's Ctrl-C and Ctrl-Z reach). A stopped fencelock leaves the supervisor's
//! switch running; a stopped supervisor is continued by fencelock, which sees it stop through
//! SIGCHLD. Both stopped at once, by pid or by two group signals, is the one case left: nothing
//! then runs to stop the command (see docs/cli.md).
//!
//! The supervisor carries the lease's owner in its arguments (`--owner`), and the command and
//! its descendants in `FENCELOCK_OWNER`, so that the runbook's liveness check still finds the
//! work of a fencelock that was killed (`Holder::assess`).

mod procs;
mod worker;

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::time::{Duration, Instant};

use anyhow::Result;
use fencelock::{Client, Lease};
use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, FdFlag};
use nix::sys::prctl;
use nix::sys::signal::{kill, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpgrp, getpid, getppid, isatty, setpgid, tcgetpgrp, tcsetpgrp, Pid};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::signal::unix::{signal, SignalKind};

use crate::exit;
use procs::{instant_ns, signal_all, state_of, ToParent, ToWorker};
pub use worker::{worker, WorkerArgs};

/// How a command is supervised: the options `run` and `elect` share.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// After lease loss (or, with `release_on_exit`, the command's exit), how long
    /// descendants get between SIGTERM and SIGKILL.
    pub kill_after: Duration,
    /// Release when the command itself exits, terminating what it left behind, instead of
    /// holding the lease until every descendant has exited.
    pub release_on_exit: bool,
    /// Pass fencelock's backend URL and password variables on to the command.
    pub pass_env: bool,
}

/// Signals that fencelock passes on to the command instead of acting on them.
pub(super) const FORWARDED: [Signal; 9] = [
    Signal::SIGHUP,
    Signal::SIGINT,
    Signal::SIGQUIT,
    Signal::SIGTERM,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGALRM,
    Signal::SIGWINCH,
    Signal::SIGTSTP,
];

/// Variables fencelock reads its backend and secrets from: the command does not get them
/// unless `--pass-env` says so, since a command that may print its environment (a CI log, a
/// crash report) would otherwise leak the lock server's credentials.
fn is_fencelock_secret(name: &str) -> bool {
    name == "FENCELOCK_URL"
        || (name.starts_with("FENCELOCK_")
            && (name.ends_with("_PASSWORD") || name.ends_with("_PASSWORD_FILE")))
}

/// Runs `command` under `lease` (`FENCELOCK_TOKEN`, `FENCELOCK_RESOURCE`, `FENCELOCK_OWNER`
/// set) until it and every process it started have exited, then releases the lease and
/// returns the command's status. On lease loss every descendant gets SIGTERM and SIGCONT,
/// SIGKILL after `kill_after`, and the result is 79 once they are all gone.
pub async fn supervise(
    client: Client,
    lease: Lease,
    command: &[String],
    opts: &Supervision,
) -> Result<u8> {
    // A lock handed over by a fair release comes with only what was left of the waiter's
    // queue entry, renewed to the full TTL at a third of that. The supervisor stops the
    // command `--kill-after` before the deadline it is given, so a short one would stop it at
    // once: renew first. A refusal here is a loss, which the session reports as any other.
    if lease.time_left() < lease.ttl() / 2 {
        let _ = lease.extend().await;
    }
    let outcome = match Session::start(&lease, command, opts) {
        Ok(session) => session.run(&lease).await,
        Err(e) => {
            eprintln!("fencelock: cannot start the command's supervisor: {e}");
            Outcome {
                code: exit::SUPERVISOR,
                lost: false,
            }
        }
    };
    match lease.release().await {
        Ok(()) => {}
        // Lost already: the loss was reported, and that it cannot be released says nothing new.
        Err(_) if outcome.lost => {}
        Err(e) => eprintln!("fencelock: warning: {e}"),
    }
    client.close().await;
    Ok(outcome.code)
}

struct Outcome {
    code: u8,
    lost: bool,
}

/// The terminal fencelock runs in the foreground of, if it does.
#[derive(Clone, Copy)]
struct Terminal;

impl Terminal {
    /// In the foreground of a terminal: stdin is one and its foreground group is ours.
    fn detect() -> Option<Terminal> {
        let fd = stdin();
        (isatty(0).unwrap_or(false) && tcgetpgrp(fd).ok() == Some(getpgrp())).then_some(Terminal)
    }

    fn in_foreground(self) -> bool {
        tcgetpgrp(stdin()).ok() == Some(getpgrp())
    }

    fn give_to(self, pgid: Pid) {
        let _ = tcsetpgrp(stdin(), pgid);
    }

    /// Takes the terminal back from the command's group, but not from the shell: after `bg`
    /// the shell has it and keeps it.
    fn take_back(self, command: Option<Pid>) {
        let Ok(fg) = tcgetpgrp(stdin()) else {
            return;
        };
        let ours = getpgrp();
        let orphaned = fg.as_raw() <= 0 || kill(Pid::from_raw(-fg.as_raw()), None).is_err();
        if fg != ours && (Some(fg) == command || orphaned) {
            let _ = tcsetpgrp(stdin(), ours);
        }
    }
}

fn stdin() -> BorrowedFd<'static> {
    // SAFETY: descriptor 0 stays open for the life of the process.
    unsafe { BorrowedFd::borrow_raw(0) }
}

struct Session {
    child: std::process::Child,
    sock: tokio::net::UnixStream,
    signals: tokio::sync::mpsc::UnboundedReceiver<Signal>,
    /// SIGCHLD, which also comes when the supervisor is stopped.
    children: tokio::signal::unix::Signal,
    tty: Option<Terminal>,
    kill_after: Duration,
}

impl Session {
    fn start(lease: &Lease, command: &[String], opts: &Supervision) -> Result<Session> {
        // Should the supervisor die, what the command started is reparented here, not to init.
        prctl::set_child_subreaper(true)?;
        let tty = Terminal::detect();
        if tty.is_some() {
            // Once the command has the terminal, fencelock is a background process that still
            // takes the terminal back and may print; SIGTTOU would stop it for either.
            // SAFETY: setting a signal to SIG_IGN installs no handler.
            unsafe {
                nix::sys::signal::signal(Signal::SIGTTOU, SigHandler::SigIgn)?;
                nix::sys::signal::signal(Signal::SIGTTIN, SigHandler::SigIgn)?;
            }
        }
        // Before the supervisor starts, so that no signal sent to fencelock from then on can
        // take its default action.
        let (tx, signals) = tokio::sync::mpsc::unbounded_channel();
        // SIGCONT too: without a terminal, a job stopped with SIGTSTP (forwarded) is resumed
        // with SIGCONT to fencelock's group, which the command's group does not share.
        for sig in FORWARDED.into_iter().chain([Signal::SIGCONT]) {
            let mut stream = signal(SignalKind::from_raw(sig as i32))?;
            let tx = tx.clone();
            tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        break;
                    }
                }
            });
        }
        let children = signal(SignalKind::child())?;

        let (ours, theirs) = UnixStream::pair()?;
        let fd = theirs.as_raw_fd();
        let parent = getpid();
        let exe = std::env::current_exe()?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("supervisor")
            .args(["--fd", &fd.to_string()])
            .args(["--parent", &parent.to_string()])
            .args(["--owner", lease.owner()])
            .args(["--ttl-ms", &millis(lease.ttl()).to_string()])
            .args(["--kill-after-ms", &millis(opts.kill_after).to_string()])
            .args([
                "--deadline-ns",
                &instant_ns(lease.valid_until()).to_string(),
            ]);
        if opts.release_on_exit {
            cmd.arg("--release-on-exit");
        }
        if tty.is_some() {
            cmd.arg("--foreground");
        }
        cmd.arg("--").args(command);
        cmd.env("FENCELOCK_TOKEN", lease.token().to_string())
            .env("FENCELOCK_RESOURCE", lease.resource())
            .env("FENCELOCK_OWNER", lease.owner());
        if !opts.pass_env {
            for (name, _) in std::env::vars_os() {
                if name.to_str().is_some_and(is_fencelock_secret) {
                    cmd.env_remove(name);
                }
            }
        }
        // SAFETY: runs in the forked child before exec; setpgid, fcntl, prctl and getppid are
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // A group of its own: a stop sent to fencelock's job must leave the switch
                // that kills the command running. It never reads the terminal, and its
                // signalfd blocks SIGTTOU, so it may still write to one from the background.
                setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))?;
                // The supervisor also watches the socket; the signal makes it look at once.
                prctl::set_pdeathsig(Signal::SIGTERM)?;
                if getppid() != parent {
                    return Err(std::io::Error::other("fencelock is gone"));
                }
                Ok(())
            });
        }
        // This runs on the thread that drives the command's future (`block_on`'s), which lives
        // as long as the process: the parent-death signal follows the thread that forked.
        let child = cmd.spawn()?;
        drop(theirs);
        ours.set_nonblocking(true)?;
        Ok(Session {
            child,
            sock: tokio::net::UnixStream::from_std(ours)?,
            signals,
            children,
            tty,
            kill_after: opts.kill_after,
        })
    }

    async fn run(self, lease: &Lease) -> Outcome {
        let Session {
            mut child,
            sock,
            mut signals,
            mut children,
            tty,
            kill_after,
        } = self;
        let supervisor = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        let (rd, mut wr) = sock.into_split();
        let mut lines = BufReader::new(rd).lines();
        let mut status: Option<u8> = None;
        let mut lost = false;
        let mut terminating = false;
        let mut command: Option<Pid> = None;
        let mut reported = lease.valid_until();
        let mut tick = tokio::time::interval((lease.ttl() / 10).max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            let mut out: Vec<ToWorker> = Vec::new();
            tokio::select! {
                line = lines.next_line() => match line.ok().flatten().as_deref().map(ToParent::decode) {
                    Some(Some(ToParent::Started(pid))) => command = Some(Pid::from_raw(pid)),
                    Some(Some(ToParent::NotStarted(code))) => status = Some(code),
                    Some(Some(ToParent::Exited(code))) => {
                        status = Some(code);
                        if let Some(t) = tty {
                            t.take_back(command);
                        }
                    }
                    Some(Some(ToParent::Stopped(_))) => {
                        if let (Some(t), false) = (tty, terminating) {
                            if Session::job_stop(t, lease, command, &mut out).await {
                                reported = lease.valid_until();
                            } else {
                                lost = true;
                                terminating = true;
                            }
                        }
                    }
                    Some(Some(ToParent::DeadlineFired)) => {
                        if !terminating {
                            report_loss(lease).await;
                        }
                        lost = true;
                        terminating = true;
                    }
                    Some(Some(ToParent::AllGone)) => break,
                    Some(None) => {}
                    None => {
                        supervisor_died(tty, kill_after, command);
                        return Outcome { code: exit::SUPERVISOR, lost };
                    }
                },
                Some(sig) = signals.recv() => {
                    out.push(ToWorker::Signal(sig as i32));
                    if ![Signal::SIGWINCH, Signal::SIGTSTP, Signal::SIGCONT].contains(&sig) {
                        // A stopped command acts on a terminating signal only once continued.
                        out.push(ToWorker::Signal(Signal::SIGCONT as i32));
                    }
                }
                Some(()) = children.recv() => continue_if_stopped(supervisor),
                _ = lease.lost(), if !terminating => {
                    report_loss(lease).await;
                    lost = true;
                    terminating = true;
                    out.push(ToWorker::Terminate);
                }
                _ = tick.tick() => {
                    // SIGCHLD may have been merged with another child's: look again.
                    continue_if_stopped(supervisor);
                    let v = lease.valid_until();
                    if v != reported && !terminating {
                        reported = v;
                        out.push(ToWorker::Deadline(instant_ns(v)));
                    }
                }
            }
            for msg in out {
                // A supervisor that is gone shows as the end of its messages.
                let _ = wr.write_all(msg.encode().as_bytes()).await;
            }
        }
        let _ = child.wait();
        if let Some(t) = tty {
            t.take_back(command);
        }
        if lost {
            return Outcome {
                code: exit::LEASE_LOST,
                lost,
            };
        }
        Outcome {
            code: status.unwrap_or(exit::SUPERVISOR),
            lost,
        }
    }

    /// The command stopped while fencelock owns the terminal (Ctrl-Z, or SIGTTIN after `bg`):
    /// fencelock stops too, as a shell job does, so that the shell gets its prompt back. The
    /// supervisor kills the command shortly before the lease's validity ends unless fencelock
    /// resumes first; on resume fencelock renews and continues the command, giving it the
    /// terminal again if fencelock is in the foreground (`fg`, not `bg`). Returns false when
    /// the lease did not survive the stop.
    async fn job_stop(
        tty: Terminal,
        lease: &Lease,
        command: Option<Pid>,
        out: &mut Vec<ToWorker>,
    ) -> bool {
        tty.take_back(command);
        // Returns once continued.
        let _ = kill(getpid(), Signal::SIGSTOP);
        let renewed = !lease.is_lost()
            && !lease.time_left().is_zero()
            && lease.extend().await.is_ok()
            && !lease.is_lost();
        if !renewed {
            eprintln!(
                "fencelock: the lease of {:?} ended while the command was stopped; \
                 it was killed before that",
                lease.resource()
            );
            out.push(ToWorker::Terminate);
            return false;
        }
        out.push(ToWorker::Deadline(instant_ns(lease.valid_until())));
        if let (Some(pgid), true) = (command, tty.in_foreground()) {
            tty.give_to(pgid);
        }
        out.push(ToWorker::Signal(Signal::SIGCONT as i32));
        true
    }
}

/// A stopped supervisor cannot kill the command when the lease ends, should fencelock be
/// stopped or killed later: it is continued at once. Only SIGSTOP stops it (its signalfd takes
/// the terminal's stop signals), and nothing in fencelock's design ever sends it one.
fn continue_if_stopped(supervisor: Pid) {
    if state_of(supervisor) == Some('T') {
        eprintln!(
            "fencelock: the command's supervisor was stopped (pid {supervisor}); continuing it, \
             since it must be free to stop the command when the lease ends"
        );
        let _ = kill(supervisor, Signal::SIGCONT);
    }
}

/// The supervisor died (it was killed): the command died with it of its parent-death
/// signal, and what the command started was reparented to fencelock, which kills it.
fn supervisor_died(tty: Option<Terminal>, kill_after: Duration, command: Option<Pid>) {
    {
        eprintln!("fencelock: the command's supervisor died; killing what is left of the command");
        let until = Instant::now() + kill_after.max(Duration::from_secs(5));
        let me = getpid();
        loop {
            signal_all(me, Signal::SIGKILL);
            let gone = loop {
                match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) => break false,
                    Ok(_) | Err(Errno::EINTR) => {}
                    Err(_) => break true,
                }
            };
            if gone || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if let Some(t) = tty {
            t.take_back(command);
        }
    }
}

async fn report_loss(lease: &Lease) {
    let why = if lease.is_lost() {
        lease.run(std::future::pending::<()>()).await.err()
    } else {
        None
    };
    eprintln!(
        "fencelock: {}; terminating the command",
        why.map(|e| e.to_string()).unwrap_or_else(|| format!(
            "lease of {:?} not renewed before its validity ended",
            lease.resource()
        ))
    );
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::is_fencelock_secret;

    #[test]
    fn backend_and_password_variables_are_secrets() {
        for name in [
            "FENCELOCK_URL",
            "FENCELOCK_PASSWORD",
            "FENCELOCK_PASSWORD_FILE",
            "FENCELOCK_PG_PASSWORD",
        ] {
            assert!(is_fencelock_secret(name), "{name}");
        }
        for name in [
            "FENCELOCK_PREFIX",
            "FENCELOCK_LOG",
            "PASSWORD",
            "PGPASSWORD",
        ] {
            assert!(!is_fencelock_secret(name), "{name}");
        }
    }
}
