//! `fencelock elect` and `fencelock key` as real processes against a 3-member etcd cluster.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{poll_until, wait_for_line, BinCommand, Proc, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock_testkit::EtcdCluster;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const LEASE_LOST: i32 = 79;
const TTL: Duration = Duration::from_secs(1);
/// How much later than the TTL a successor may take over: etcd checks lease expiry every
/// 500 ms, then the deletion reaches the waiter's watch.
const MARGIN: Duration = Duration::from_millis(1500);

fn elect(sb: &Sandbox, c: &EtcdCluster, name: &str, value: &str, tag: &str) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.args([
        "elect",
        "--backend",
        &c.url(),
        "--ttl",
        "1s",
        "--kill-after",
        "1s",
    ])
    .args(["--value", value, name, "--", "sh", "-c"])
    .arg(format!(
        "echo $$ > {tag}.pid; echo \"$FENCELOCK_TOKEN\" > {tag}.token; {WAIT_FOR_RELEASE}"
    ));
    cmd
}

fn election_keys(c: &EtcdCluster, name: &str) -> usize {
    let out = c
        .ctl(&[
            "get",
            &format!("/fencelock/v1/{name}/"),
            "--prefix",
            "--keys-only",
        ])
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .count()
}

fn number(s: &str) -> u64 {
    s.trim().parse().unwrap()
}

/// Kills the command a leader started (its own process group), which outlives a killed
/// fencelock.
fn kill_command(sb: &Sandbox, tag: &str) {
    if let Ok(pid) = std::fs::read_to_string(sb.path(&format!("{tag}.pid"))) {
        if let Ok(pid) = pid.trim().parse::<i32>() {
            let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// A leader killed, then a leader frozen: each time the next candidate leads within the TTL
/// plus a margin, with a larger token; the frozen one, thawed, stops its command and exits 79.
#[test]
fn failover_when_the_leader_is_killed_or_stopped() {
    let c = EtcdCluster::start(3).unwrap();
    let sb = Sandbox::new();
    let mut a = sb.spawn(elect(&sb, &c, "svc", "a", "a"));
    let a_token = number(&wait_for_line(&sb.path("a.token"), FINISH));
    let mut b = sb.spawn(elect(&sb, &c, "svc", "b", "b"));
    assert!(poll_until(FINISH, || election_keys(&c, "svc") == 2));
    assert!(!sb.path("b.token").exists(), "b ran while a led");

    kill(a.pid(), Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    let b_token = number(&wait_for_line(&sb.path("b.token"), FINISH));
    let took = killed.elapsed();
    assert!(took <= TTL + MARGIN, "failover after a kill took {took:?}");
    assert!(b_token > a_token);
    a.wait(FINISH).unwrap();
    kill_command(&sb, "a");

    let mut d = sb.spawn(elect(&sb, &c, "svc", "d", "d"));
    assert!(poll_until(FINISH, || election_keys(&c, "svc") == 2));
    kill(b.pid(), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let d_token = number(&wait_for_line(&sb.path("d.token"), FINISH));
    let took = stopped.elapsed();
    assert!(took <= TTL + MARGIN, "failover after a stop took {took:?}");
    assert!(d_token > b_token);
    kill(b.pid(), Signal::SIGCONT).unwrap();
    let out = b.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(LEASE_LOST), "{out:?}");
    assert!(
        out.stderr.contains("terminating the command"),
        "{}",
        out.stderr
    );

    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(d.wait(FINISH).unwrap().code(), Some(0));
    assert_eq!(election_keys(&c, "svc"), 0);
}

fn first_lines(p: &Proc, path: &std::path::Path, n: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let ok = poll_until(FINISH, || {
        lines = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        lines.len() >= n
    });
    assert!(
        ok,
        "fewer than {n} lines in {}: {lines:?}; {}",
        path.display(),
        p.stderr()
    );
    lines
}

/// etcdctl elect and fencelock elect on the same name: each sees the other's leader, waits
/// behind it, and takes over when it resigns.
#[test]
fn interoperates_with_etcdctl_elect() {
    let c = EtcdCluster::start(3).unwrap();
    let sb = Sandbox::new();
    let key = sb.run({
        let mut cmd = sb.bare();
        cmd.args(["key", "--backend", &c.url(), "jobs/primary"]);
        cmd
    });
    assert_eq!(key.code(), Some(0), "{key:?}");
    let name = key
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("etcdctl lock/elect name\t"))
        .unwrap()
        .to_owned();
    assert_eq!(name, "/fencelock/v1/jobs%2Fprimary");

    // etcdctl leads; fencelock's listener sees its value; fencelock's candidate waits.
    let ctl = sb.spawn(c.ctl_command(&["elect", &name, "from-etcdctl"]));
    assert!(poll_until(FINISH, || election_keys(&c, "jobs%2Fprimary") == 1));
    let listener = sb.spawn({
        let mut cmd = sb.bare();
        cmd.args(["elect", "--backend", &c.url(), "--listen", "jobs/primary"]);
        cmd
    });
    let listen_out = sb.path("proc-2.out");
    let lines = first_lines(&listener, &listen_out, 1);
    assert!(lines[0].starts_with("from-etcdctl\t"), "{lines:?}");
    let mut ours = sb.spawn(elect(&sb, &c, "jobs/primary", "from-fencelock", "f"));
    assert!(poll_until(FINISH, || election_keys(&c, "jobs%2Fprimary") == 2));
    assert!(
        !sb.path("f.token").exists(),
        "fencelock led while etcdctl did"
    );

    // etcdctl resigns (SIGTERM): fencelock leads, and both observers say so.
    drop(ctl);
    let token = number(&wait_for_line(&sb.path("f.token"), FINISH));
    let lines = first_lines(&listener, &listen_out, 2);
    assert!(
        lines
            .iter()
            .any(|l| *l == format!("from-fencelock\t{token}")),
        "{lines:?}"
    );
    let ctl_listen = sb.spawn(c.ctl_command(&["elect", "-l", &name]));
    let out = sb.path("proc-4.out");
    let ctl_lines = first_lines(&ctl_listen, &out, 2);
    assert_eq!(ctl_lines[1], "from-fencelock", "{ctl_lines:?}");

    // An etcdctl candidate waits behind fencelock and leads once it resigns.
    let ctl_next = sb.spawn(c.ctl_command(&["elect", &name, "ctl-next"]));
    assert!(poll_until(FINISH, || election_keys(&c, "jobs%2Fprimary") == 2));
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(ours.wait(FINISH).unwrap().code(), Some(0));
    let out = sb.path("proc-5.out");
    let lines = first_lines(&ctl_next, &out, 2);
    assert_eq!(lines[1], "ctl-next");
    drop(ctl_listen);
    drop(listener);
}

/// A resource name `fencelock key` prints is the one etcdctl lock takes: they exclude each other.
#[test]
fn fencelock_run_and_etcdctl_lock_share_a_name() {
    let c = EtcdCluster::start(3).unwrap();
    let sb = Sandbox::new();
    let mut run = sb.spawn({
        let mut cmd = sb.bare();
        cmd.args([
            "run",
            "--backend",
            &c.url(),
            "--ttl",
            "2s",
            "shared",
            "--",
            "sh",
            "-c",
        ])
        .arg(format!(
            "echo \"$FENCELOCK_TOKEN\" > run.token; {WAIT_FOR_RELEASE}"
        ));
        cmd
    });
    let token = number(&wait_for_line(&sb.path("run.token"), FINISH));
    let ctl = sb.spawn(c.ctl_command(&["lock", "/fencelock/v1/shared"]));
    assert!(poll_until(FINISH, || election_keys(&c, "shared") == 2));
    let out = sb.path("proc-1.out");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        std::fs::read_to_string(&out).unwrap_or_default().is_empty(),
        "etcdctl lock got the lock while fencelock run held it"
    );
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(run.wait(FINISH).unwrap().code(), Some(0));
    let lines = first_lines(&ctl, &out, 1);
    assert!(lines[0].starts_with("/fencelock/v1/shared/"), "{lines:?}");
    assert!(token > 0);
}

/// On SQLite an election is a renewed lease whose holder records the value: the command runs
/// while leading, and `--listen` shows the value and token of whoever leads.
#[test]
fn elect_on_sqlite_runs_the_command_and_listen_shows_the_leader() {
    let sb = Sandbox::new();
    let mut leader = sb.spawn({
        let mut cmd = sb.fencelock("elect", &["--ttl", "2s", "--value", "node-1", "job"]);
        cmd.args(["--", "sh", "-c"]).arg(format!(
            "echo \"$FENCELOCK_TOKEN\" > token; {WAIT_FOR_RELEASE}"
        ));
        cmd
    });
    let token = wait_for_line(&sb.path("token"), FINISH);
    let listener = sb.spawn(sb.fencelock("elect", &["--listen", "job"]));
    let out = sb.path("proc-1.out");
    let lines = first_lines(&listener, &out, 1);
    assert_eq!(lines[0], format!("node-1\t{token}"));
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(leader.wait(FINISH).unwrap().code(), Some(0));
    let lines = first_lines(&listener, &out, 2);
    assert_eq!(lines[1], "-\t-");
    drop(listener);
}
