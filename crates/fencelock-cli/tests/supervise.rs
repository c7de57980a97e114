//! `fencelock run` never lets work outlive its lease (DESIGN invariant 7): each of the ways a
//! first holder's command used to keep running beside a second holder, on SQLite and on one
//! Redis node. The first holder's command appends timestamps to `A`, the second's to `B`; no
//! timestamp of `A` may come after the first of `B`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{
    poll_until, stop_group_outside_write_lock, stop_outside_write_lock, wait_for_line, BinCommand,
    Sandbox, FINISH,
};
use fencelock_testkit::RedisServer;
use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

/// Appends a timestamp to FILE every 20 ms, forever.
fn writer(file: &str) -> String {
    format!("while :; do date +%s%N >> {file}; sleep 0.02; done")
}

/// The second holder: waits for the lock, then writes ten timestamps to `B`.
fn second(sb: &Sandbox, url: &str) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.args(["run", "--backend", url, "--wait", "20s", "shared", "--"])
        .args(["sh", "-c"])
        .arg("i=0; while [ $i -lt 10 ]; do date +%s%N >> B; sleep 0.02; i=$((i+1)); done");
    cmd
}

fn first(sb: &Sandbox, url: &str, opts: &[&str], script: &str) -> BinCommand {
    first_with(sb, url, "1s", "200ms", opts, script)
}

fn first_with(
    sb: &Sandbox,
    url: &str,
    ttl: &str,
    kill_after: &str,
    opts: &[&str],
    script: &str,
) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.args([
        "run",
        "--backend",
        url,
        "--ttl",
        ttl,
        "--kill-after",
        kill_after,
    ])
    .args(opts)
    .args(["shared", "--", "sh", "-c", script]);
    cmd
}

/// A writer that records its pid in `pid` and ignores SIGTERM, as do the `sleep`s it starts
/// (an ignored signal stays ignored across exec).
fn stubborn_writer() -> String {
    format!("trap '' TERM; echo $$ > pid; {}", writer("A"))
}

/// The first holder as a shell job: fencelock leads a process group of its own. Returns it
/// once its command writes, with the command's pid (the command's own group).
fn first_as_job(sb: &Sandbox, url: &str, script: &str) -> (common::Proc, Pid) {
    let mut cmd = first(sb, url, &[], &format!("echo $$ > pid; {script}"));
    cmd.own_group();
    let mut holder = sb.spawn(cmd);
    let job = holder.pid();
    holder.adopt_group(job);
    wait_for_line(&sb.path("A"), FINISH);
    let command = Pid::from_raw(wait_for_line(&sb.path("pid"), FINISH).parse().unwrap());
    holder.adopt_group(command);
    (holder, command)
}

fn stamps(path: &Path) -> Vec<u128> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The two holders' timestamps never interleave: every one of `A` precedes every one of `B`.
fn assert_no_overlap(sb: &Sandbox, what: &str) {
    let (a, b) = (stamps(&sb.path("A")), stamps(&sb.path("B")));
    assert!(!a.is_empty() && b.len() == 10, "{what}: A {a:?}, B {b:?}");
    let (last_a, first_b) = (a.iter().max().unwrap(), b.iter().min().unwrap());
    assert!(
        last_a < first_b,
        "{what}: the first holder's command wrote at {last_a}, after the second holder began \
         at {first_b}"
    );
    // Shown with --nocapture: how much room the switch left.
    eprintln!(
        "{what}: the first command's last write came {:.1} ms before the second's first",
        (first_b - last_a) as f64 / 1e6
    );
}

/// SIGHUP to fencelock reaches the command (which dies of it) instead of killing fencelock
/// and leaving the command running unlocked; fencelock exits 128+1 once it is gone.
fn sighup(url: &str) {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(first(&sb, url, &[], &writer("A")));
    wait_for_line(&sb.path("A"), FINISH);
    let mut waiter = sb.spawn(second(&sb, url));
    kill(holder.pid(), Signal::SIGHUP).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(129), "{out:?}");
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_no_overlap(&sb, "SIGHUP");
}

/// SIGKILL of fencelock: its supervisor stops the command at once; the lease, never released,
/// lapses after its TTL, and only then does the second holder run.
fn sigkill(url: &str) {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(first(&sb, url, &[], &writer("A")));
    wait_for_line(&sb.path("A"), FINISH);
    let mut waiter = sb.spawn(second(&sb, url));
    kill(holder.pid(), Signal::SIGKILL).unwrap();
    holder.wait(FINISH).unwrap();
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_no_overlap(&sb, "SIGKILL");
}

/// SIGTSTP without a terminal is passed on to the command, and fencelock keeps renewing; when
/// fencelock itself is then frozen past the TTL, the stopped command is killed before the
/// lease lapses, so resuming it afterwards resumes nothing.
fn sigtstp_then_expiry(url: &str) {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(first(
        &sb,
        url,
        &[],
        &format!("echo $$ > pid; {}", writer("A")),
    ));
    wait_for_line(&sb.path("A"), FINISH);
    let command = wait_for_line(&sb.path("pid"), FINISH)
        .parse::<i32>()
        .unwrap();
    holder.adopt_group(Pid::from_raw(command));
    kill(holder.pid(), Signal::SIGTSTP).unwrap();
    // Its group, not necessarily the shell itself: a child caught between fork and exec
    // stops there, and its shell may be stopped a moment later or never stop at all.
    assert!(
        poll_until(FINISH, || group_stopped(command)),
        "the command was not stopped"
    );
    // Renewing while the command is stopped: the lock stays held past the TTL.
    let out = sb.run({
        let mut cmd = sb.bare();
        cmd.args([
            "run",
            "--backend",
            url,
            "--wait",
            "1500ms",
            "shared",
            "--",
            "true",
        ]);
        cmd
    });
    assert_eq!(out.code(), Some(75), "{out:?}");

    stop_outside_write_lock(holder.pid());
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    // Whatever tries to resume the first command now finds nothing to resume.
    let _ = nix::sys::signal::killpg(Pid::from_raw(command), Signal::SIGCONT);
    kill(holder.pid(), Signal::SIGCONT).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(79), "{out:?}");
    assert_no_overlap(&sb, "SIGTSTP, then expiry");
}

/// fencelock SIGKILLed while its command ignores SIGTERM and `--kill-after` is a minute: the
/// supervisor does not wait out `--kill-after` but kills the command before the lease's
/// validity ends, and the next holder runs only after that.
fn sigkill_while_the_command_ignores_sigterm(url: &str) {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(first_with(&sb, url, "1s", "60s", &[], &stubborn_writer()));
    wait_for_line(&sb.path("A"), FINISH);
    let command = Pid::from_raw(wait_for_line(&sb.path("pid"), FINISH).parse().unwrap());
    holder.adopt_group(command);
    let mut waiter = sb.spawn(second(&sb, url));
    kill(holder.pid(), Signal::SIGKILL).unwrap();
    holder.wait(FINISH).unwrap();
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(
        kill(command, None),
        Err(Errno::ESRCH),
        "the command survived"
    );
    assert_no_overlap(&sb, "SIGKILL, SIGTERM ignored");
}

/// What broke: `release --force` found a SIGKILLed fencelock's pid gone and declared the
/// holder dead while its supervised command, ignoring SIGTERM, still wrote.
fn forced_release_beside_a_live_command(url: &str) {
    let sb = Sandbox::new();
    // Long enough a validity for the command to outlive fencelock by seconds.
    let mut holder = sb.spawn(first_with(&sb, url, "20s", "60s", &[], &stubborn_writer()));
    wait_for_line(&sb.path("A"), FINISH);
    let command = Pid::from_raw(wait_for_line(&sb.path("pid"), FINISH).parse().unwrap());
    holder.adopt_group(command);
    let supervisor = Pid::from_raw(parent_of(command.as_raw()).unwrap());
    kill(holder.pid(), Signal::SIGKILL).unwrap();
    holder.wait(FINISH).unwrap();
    let force = || {
        let mut cmd = sb.bare();
        cmd.args(["release", "--backend", url, "--force", "--reason", "stuck"])
            .arg("shared");
        sb.run(cmd)
    };
    let out = force();
    assert_eq!(
        out.code(),
        Some(75),
        "released beside a live command: {out:?}"
    );
    assert!(
        out.stderr.contains("still runs") && out.stderr.contains(&supervisor.to_string()),
        "{}",
        out.stderr
    );
    let written = stamps(&sb.path("A")).len();
    assert!(
        poll_until(FINISH, || stamps(&sb.path("A")).len() > written),
        "the command was not running when the release was refused"
    );
    // Once the work is gone the holder is dead, and the release goes through.
    killpg(command, Signal::SIGKILL).unwrap();
    assert!(
        poll_until(FINISH, || !running(supervisor)),
        "the supervisor outlived its command"
    );
    let out = force();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stdout.contains("force-released"), "{out:?}");
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_no_overlap(&sb, "forced release");
}

/// What broke: after SIGTSTP and then SIGCONT to fencelock's job without a terminal (what
/// `fg` sends when stdin is not one), the command stayed stopped for ever under a renewed lock.
fn sigtstp_then_sigcont_without_a_terminal(url: &str) {
    let sb = Sandbox::new();
    let (mut holder, command) = first_as_job(&sb, url, &writer("A"));
    let job = holder.pid();
    killpg(job, Signal::SIGTSTP).unwrap();
    assert!(
        poll_until(FINISH, || group_stopped(command.as_raw())),
        "the command was not stopped"
    );
    killpg(job, Signal::SIGCONT).unwrap();
    let written = stamps(&sb.path("A")).len();
    assert!(
        poll_until(FINISH, || stamps(&sb.path("A")).len() > written),
        "the command was not continued"
    );
    kill(job, Signal::SIGTERM).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(128 + 15), "{out:?}");
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_no_overlap(&sb, "SIGTSTP, then SIGCONT");
}

/// What broke: `kill -STOP` to fencelock's job (its process group) froze the supervisor with
/// it, so the deadline switch never fired and the command wrote beside the next holder.
fn stopped_job_group(url: &str) {
    let sb = Sandbox::new();
    let (mut holder, command) = first_as_job(&sb, url, &writer("A"));
    let job = holder.pid();
    stop_group_outside_write_lock(job);
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(
        kill(command, None),
        Err(Errno::ESRCH),
        "the command survived"
    );
    killpg(job, Signal::SIGCONT).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(79), "{out:?}");
    assert_no_overlap(&sb, "job stopped");
}

/// The command's group and fencelock's job both stopped, then continued after the next
/// holder ran: the command was killed before the validity ended, so nothing resumes.
fn stopped_job_and_command_groups(url: &str) {
    let sb = Sandbox::new();
    let (mut holder, command) = first_as_job(&sb, url, &writer("A"));
    let job = holder.pid();
    killpg(command, Signal::SIGSTOP).unwrap();
    stop_group_outside_write_lock(job);
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(
        kill(command, None),
        Err(Errno::ESRCH),
        "the command survived"
    );
    let _ = killpg(command, Signal::SIGCONT);
    killpg(job, Signal::SIGCONT).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(79), "{out:?}");
    assert_no_overlap(&sb, "job and command stopped");
}

/// What broke: a supervisor stopped by itself stayed stopped, so a later stop of fencelock
/// left no one to kill the command in time. fencelock continues it; then a stopped job is
/// handled as above.
fn stopped_supervisor(url: &str) {
    let sb = Sandbox::new();
    let (mut holder, command) = first_as_job(&sb, url, &writer("A"));
    let job = holder.pid();
    let supervisor = Pid::from_raw(parent_of(command.as_raw()).unwrap());
    kill(supervisor, Signal::SIGSTOP).unwrap();
    assert!(
        poll_until(FINISH, || holder
            .stderr()
            .contains("supervisor was stopped")),
        "the supervisor was left stopped: {}",
        holder.stderr()
    );
    assert!(
        poll_until(FINISH, || state_of(supervisor) != Some('T')),
        "the supervisor is still stopped"
    );
    stop_group_outside_write_lock(job);
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    killpg(job, Signal::SIGCONT).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(79), "{out:?}");
    assert_no_overlap(&sb, "supervisor stopped");
}

/// A shell that leaves a background writer behind: the lock is held until the writer is done
/// too, and fencelock exits with the shell's status.
fn background_child(url: &str) {
    let sb = Sandbox::new();
    let script = "(i=0; while [ $i -lt 25 ]; do date +%s%N >> A; sleep 0.02; i=$((i+1)); done) & \
                  exit 0";
    let mut holder = sb.spawn(first(&sb, url, &[], script));
    wait_for_line(&sb.path("A"), FINISH);
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(holder.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(stamps(&sb.path("A")).len(), 25, "the writer was cut short");
    assert_no_overlap(&sb, "background child");
}

/// `--release-on-exit`: the lease goes with the shell; the background writer is terminated
/// first, so the next holder still never runs beside it.
fn release_on_exit(url: &str) {
    let sb = Sandbox::new();
    let script = format!("({}) & sleep 0.2; exit 0", writer("A"));
    let mut holder = sb.spawn(first(&sb, url, &["--release-on-exit"], &script));
    wait_for_line(&sb.path("A"), FINISH);
    let mut waiter = sb.spawn(second(&sb, url));
    assert_eq!(holder.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(waiter.wait(FINISH).unwrap().code(), Some(0));
    assert_no_overlap(&sb, "--release-on-exit");
}

/// Whether a process of group `pgid` is stopped (state `T` in /proc/PID/stat).
fn group_stopped(pgid: i32) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return false;
    };
    dir.flatten().any(|e| {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        // state ppid pgrp ...
        fields.len() > 2 && fields[0] == "T" && fields[2] == pgid.to_string()
    })
}

/// Every case, once on SQLite and once on one Redis node, each as a test of its own.
macro_rules! on_every_engine {
    ($($case:ident),* $(,)?) => {
        mod on_sqlite {
            $(
                #[test]
                fn $case() {
                    let sb = super::Sandbox::new();
                    super::$case(sb.url());
                }
            )*
        }
        mod on_redis {
            $(
                #[test]
                fn $case() {
                    let server = super::RedisServer::start().unwrap();
                    super::$case(&server.url());
                }
            )*
        }
    };
}

on_every_engine!(
    sighup,
    sigkill,
    sigkill_while_the_command_ignores_sigterm,
    forced_release_beside_a_live_command,
    sigtstp_then_expiry,
    sigtstp_then_sigcont_without_a_terminal,
    stopped_job_group,
    stopped_job_and_command_groups,
    stopped_supervisor,
    background_child,
    release_on_exit,
);

/// The command gets the lease's variables but not fencelock's backend URL or password unless
/// `--pass-env` is given.
#[test]
fn backend_url_and_passwords_reach_the_command_only_with_pass_env() {
    let sb = Sandbox::new();
    let script =
        r#"echo "url=${FENCELOCK_URL:-} pw=${FENCELOCK_PASSWORD:-} token=${FENCELOCK_TOKEN:+set}""#;
    let run = |extra: &[&str]| {
        let mut cmd = sb.bare();
        cmd.env("FENCELOCK_URL", sb.url())
            .env("FENCELOCK_PASSWORD", "s3cret")
            .arg("run")
            .args(extra)
            .args(["env", "--", "sh", "-c", script]);
        sb.run(cmd)
    };
    let out = run(&[]);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(out.stdout.trim(), "url= pw= token=set");
    let out = run(&["--pass-env"]);
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(
        out.stdout.trim(),
        format!("url={} pw=s3cret token=set", sb.url())
    );
}

/// Every signal fencelock forwards reaches the command, and none of them ends fencelock: the
/// command traps each and records it, then exits on SIGTERM with its own status.
#[test]
fn forwarded_signals_reach_the_command_and_spare_fencelock() {
    let sb = Sandbox::new();
    let names = ["HUP", "QUIT", "USR1", "USR2", "ALRM", "WINCH", "INT"];
    let traps: String = names
        .iter()
        .map(|n| format!("trap 'echo {n} >> got' {n}; "))
        .collect();
    let script = format!(
        "{traps} trap 'exit 7' TERM; echo ready > ready; \
         i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; exit 99"
    );
    let mut holder = sb.spawn(sb.run_sh(&[], "signals", &script));
    wait_for_line(&sb.path("ready"), FINISH);
    let signals = [
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGALRM,
        Signal::SIGWINCH,
        Signal::SIGINT,
    ];
    for (n, sig) in signals.into_iter().enumerate() {
        kill(holder.pid(), sig).unwrap();
        // One at a time: the shell runs a trap between two commands, and the next signal
        // of the same kind could otherwise be merged into a pending one.
        let seen = poll_until(FINISH, || {
            std::fs::read_to_string(sb.path("got"))
                .unwrap_or_default()
                .lines()
                .count()
                > n
        });
        assert!(seen, "{sig} did not reach the command");
        assert!(holder.try_finish().is_none(), "{sig} ended fencelock");
    }
    let got = std::fs::read_to_string(sb.path("got")).unwrap();
    assert_eq!(got.lines().collect::<Vec<_>>(), names);
    kill(holder.pid(), Signal::SIGTERM).unwrap();
    assert_eq!(holder.wait(FINISH).unwrap().code(), Some(7));
    assert_eq!(sb.inspect("signals"), "signals: free");
}

/// The supervisor SIGKILLed: the command dies of its parent-death signal, the background
/// child it started is reparented to fencelock, which kills it, and fencelock exits 70.
#[test]
fn killed_supervisor_takes_the_command_and_its_children_along() {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(sb.run_sh(
        &[],
        "orphans",
        "sleep 1000 & echo $! > child; echo $$ > pid; exec sleep 1000",
    ));
    let child = wait_for_line(&sb.path("child"), FINISH)
        .parse::<i32>()
        .unwrap();
    let command = wait_for_line(&sb.path("pid"), FINISH)
        .parse::<i32>()
        .unwrap();
    holder.adopt_group(Pid::from_raw(command));
    let supervisor = parent_of(command).unwrap();
    assert_eq!(parent_of(supervisor), Some(holder.pid().as_raw()));
    kill(Pid::from_raw(supervisor), Signal::SIGKILL).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(70), "{out:?}");
    for pid in [command, child] {
        assert_eq!(
            kill(Pid::from_raw(pid), None),
            Err(nix::errno::Errno::ESRCH),
            "process {pid} survived"
        );
    }
}

/// The state letter of `pid` in /proc/PID/stat (`S` sleeping, `T` stopped, `Z` zombie...).
fn state_of(pid: Pid) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether `pid` names a process that has not exited (a zombie has).
fn running(pid: Pid) -> bool {
    !matches!(state_of(pid), None | Some('Z' | 'X'))
}

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
