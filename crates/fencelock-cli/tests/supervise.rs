//! `fencelock run` never lets work outlive its lease (DESIGN invariant 7): each of the ways a
//! first holder's command used to keep running beside a second holder, on SQLite and on one
//! Redis node. The first holder's command appends timestamps to `A`, the second's to `B`; no
//! timestamp of `A` may come after the first of `B`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::{poll_until, stop_outside_write_lock, wait_for_line, BinCommand, Sandbox, FINISH};
use fencelock_testkit::RedisServer;
use nix::sys::signal::{kill, Signal};
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
    let mut cmd = sb.bare();
    cmd.args([
        "run",
        "--backend",
        url,
        "--ttl",
        "1s",
        "--kill-after",
        "200ms",
    ])
    .args(opts)
    .args(["shared", "--", "sh", "-c", script]);
    cmd
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

fn every_case(url: &str) {
    sighup(url);
    sigkill(url);
    sigtstp_then_expiry(url);
    background_child(url);
    release_on_exit(url);
}

#[test]
fn work_never_outlives_the_lease_on_sqlite() {
    let sb = Sandbox::new();
    every_case(sb.url());
}

#[test]
fn work_never_outlives_the_lease_on_redis() {
    let server = RedisServer::start().unwrap();
    every_case(&server.url());
}

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

fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
