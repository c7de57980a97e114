//! `fencelock run` and `fencelock inspect` as real processes on a SQLite file.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    poll_until, stop_outside_write_lock, wait_for_line, Sandbox, FINISH, WAIT_FOR_RELEASE,
};
use nix::errno::Errno;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

const HELD: i32 = 75;
const USAGE: i32 = 64;
const UNAVAILABLE: i32 = 69;
const LEASE_LOST: i32 = 79;

fn parse_number(s: &str) -> u64 {
    let n = s.trim().parse::<u64>();
    assert!(n.is_ok(), "{s:?} is not a number");
    n.unwrap()
}

/// Ten runs started together on one name: exactly one runs its command, and it keeps the lock
/// until the other nine have given up, so no timing can let two run one after another.
#[test]
fn one_of_ten_concurrent_runs_gets_the_lock() {
    let sb = Sandbox::new();
    let script = format!("echo $$ >> ran; {WAIT_FOR_RELEASE}");
    let mut procs: Vec<_> = (0..10)
        .map(|_| sb.spawn(sb.run_sh(&["--if-held", "fail"], "contended", &script)))
        .collect();

    let nine_done = poll_until(FINISH, || {
        procs.iter_mut().filter_map(|p| p.try_finish()).count() >= 9
    });
    assert!(nine_done, "nine of the ten runs did not give up in time");
    let (mut running, finished): (Vec<_>, Vec<_>) = procs.into_iter().partition(|p| !p.exited());
    assert_eq!(running.len(), 1, "exactly one run must still hold the lock");
    let holder_pid = running[0].pid();

    // The holder's command may start after the others have given up; once they all have, no
    // other command can start, so its line is the only one there will ever be.
    wait_for_line(&sb.path("ran"), FINISH);
    let ran = std::fs::read_to_string(sb.path("ran")).unwrap();
    assert_eq!(ran.lines().count(), 1, "commands that ran: {ran:?}");

    for mut p in finished {
        let out = p.wait(FINISH).unwrap();
        assert_eq!(out.code(), Some(HELD), "{out:?}");
        assert!(
            out.stderr.contains(&format!("pid {holder_pid}")),
            "the message must name the holder (pid {holder_pid}): {}",
            out.stderr
        );
        assert!(out.stderr.contains("token"), "{}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
    assert!(
        sb.inspect("contended")
            .contains(&format!("pid {holder_pid}")),
        "inspect must name the holder"
    );

    std::fs::write(sb.path("release"), "").unwrap();
    let out = running[0].wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(sb.inspect("contended"), "contended: free");
}

/// Six waiting runs: every one runs, never two at once, with tokens increasing in the order
/// they ran; a later run gets a greater token still.
#[test]
fn waiting_runs_take_turns_with_increasing_tokens() {
    let sb = Sandbox::new();
    let script =
        r#"s=$(date +%s%N); sleep 0.2; e=$(date +%s%N); echo "$FENCELOCK_TOKEN $s $e" >> log"#;
    let mut procs: Vec<_> = (0..6)
        .map(|_| sb.spawn(sb.run_sh(&["--wait", "60s"], "turns", script)))
        .collect();
    for p in &mut procs {
        let out = p.wait(Duration::from_secs(60)).unwrap();
        assert_eq!(out.code(), Some(0), "{out:?}");
    }

    let log = std::fs::read_to_string(sb.path("log")).unwrap();
    let mut runs: Vec<(u64, u64, u64)> = log
        .lines()
        .map(|line| {
            let f: Vec<u64> = line.split(' ').map(parse_number).collect();
            assert_eq!(f.len(), 3, "bad log line {line:?}");
            (f[1], f[2], f[0])
        })
        .collect();
    assert_eq!(
        runs.len(),
        6,
        "every run must have run its command once: {log}"
    );
    runs.sort_unstable();
    for pair in runs.windows(2) {
        let ((_, end, token), (next_start, _, next_token)) = (pair[0], pair[1]);
        assert!(
            end < next_start,
            "runs overlapped (token {token} ended at {end}, token {next_token} started at \
             {next_start}):\n{log}"
        );
        assert!(
            token < next_token,
            "tokens must increase in the order the commands ran:\n{log}"
        );
    }

    let highest = runs.iter().map(|r| r.2).max().unwrap();
    let later = sb.run(sb.run_sh(&[], "turns", "echo $FENCELOCK_TOKEN"));
    assert_eq!(later.code(), Some(0), "{later:?}");
    let token = parse_number(&later.stdout);
    assert!(token > highest, "later token {token} <= {highest}");
}

/// A holder frozen (with its command) past its TTL: its supervisor kills the command before
/// the lease's validity ends, so that another run gets a greater token with nothing of the
/// first still alive; once resumed, the first exits 79.
#[test]
fn stopped_holder_is_fenced_and_its_command_killed_before_expiry() {
    let sb = Sandbox::new();
    let mut first = sb.spawn(sb.run_sh(
        &["--ttl", "1s"],
        "frozen",
        "echo $$ > pidfile; echo $FENCELOCK_TOKEN > tok1; exec sleep 1000",
    ));
    let tok1 = parse_number(&wait_for_line(&sb.path("tok1"), FINISH));
    let command = wait_for_line(&sb.path("pidfile"), FINISH);
    let command = Pid::from_raw(i32::try_from(parse_number(&command)).unwrap());
    // fencelock starts the command as the leader of its own process group.
    first.adopt_group(command);
    assert_eq!(nix::unistd::getpgid(Some(command)), Ok(command));
    assert!(
        first.try_finish().is_none(),
        "the holder exited early: {}",
        first.stderr()
    );

    stop_outside_write_lock(first.pid());
    killpg(command, Signal::SIGSTOP).unwrap();

    let second = sb.run(sb.run_sh(&["--wait", "10s"], "frozen", "echo $FENCELOCK_TOKEN > tok2"));
    assert_eq!(second.code(), Some(0), "{second:?}");
    let tok2 = parse_number(&std::fs::read_to_string(sb.path("tok2")).unwrap());
    assert!(tok2 > tok1, "token {tok2} after expiry is not above {tok1}");
    assert_eq!(
        kill(command, None),
        Err(Errno::ESRCH),
        "the first command was alive when the second run got the lock"
    );

    let resumed = Instant::now();
    kill(first.pid(), Signal::SIGCONT).unwrap();
    let out = first.wait(Duration::from_secs(5)).unwrap();
    assert_eq!(out.code(), Some(LEASE_LOST), "{out:?}");
    assert!(out.stderr.contains("lost"), "{}", out.stderr);
    assert!(
        resumed.elapsed() < Duration::from_secs(5),
        "took {:?}",
        resumed.elapsed()
    );
    assert_eq!(sb.inspect("frozen"), "frozen: free");
}

/// On lease loss (here a forced release while fencelock runs), a command that ignores
/// SIGTERM is killed with SIGKILL once `--kill-after` has passed, and fencelock still exits 79.
#[test]
fn command_ignoring_sigterm_is_killed_after_the_grace_period() {
    let sb = Sandbox::new();
    let mut first = sb.spawn(sb.run_sh(
        &["--ttl", "1s", "--kill-after", "1s"],
        "stubborn",
        // An ignored signal stays ignored across exec: sleep ignores SIGTERM too.
        "trap '' TERM; echo $$ > pidfile; exec sleep 1000",
    ));
    let command = wait_for_line(&sb.path("pidfile"), FINISH);
    let command = Pid::from_raw(i32::try_from(parse_number(&command)).unwrap());
    first.adopt_group(command);

    let forced = Instant::now();
    let out = sb.run(sb.fencelock(
        "release",
        &[
            "--force",
            "stubborn",
            "--reason",
            "test",
            "--holder-is-dead",
        ],
    ));
    assert_eq!(out.code(), Some(0), "{out:?}");
    let out = first.wait(Duration::from_secs(6)).unwrap();
    assert_eq!(out.code(), Some(LEASE_LOST), "{out:?}");
    assert!(
        forced.elapsed() >= Duration::from_secs(1),
        "SIGKILL came before the grace period ended: {:?}",
        forced.elapsed()
    );
    assert_eq!(
        kill(command, None),
        Err(Errno::ESRCH),
        "the command survived"
    );
}

/// Bad names, durations and URLs exit 64, an unusable database 69; each with a readable message
/// on stderr, no panic, and the command never runs.
#[test]
fn bad_input_exits_64_or_69_without_panicking() {
    let sb = Sandbox::new();
    let url = sb.url().to_owned();
    let long = "x".repeat(300);
    let cases: Vec<(&str, Vec<&str>, i32)> = vec![
        ("empty name", vec!["--backend", &url, ""], USAGE),
        ("300-byte name", vec!["--backend", &url, &long], USAGE),
        ("newline in name", vec!["--backend", &url, "a\nb"], USAGE),
        ("BEL in name", vec!["--backend", &url, "\x07"], USAGE),
        ("--ttl 0", vec!["--backend", &url, "--ttl", "0", "n"], USAGE),
        (
            "--ttl -1s",
            vec!["--backend", &url, "--ttl", "-1s", "n"],
            USAGE,
        ),
        (
            "--ttl=-1s",
            vec!["--backend", &url, "--ttl=-1s", "n"],
            USAGE,
        ),
        (
            "--wait abc",
            vec!["--backend", &url, "--wait", "abc", "n"],
            USAGE,
        ),
        ("unknown scheme", vec!["--backend", "ftp://x", "n"], USAGE),
        (
            "unwritable SQLite path",
            vec!["--backend", "sqlite:///proc/nope/locks.db", "n"],
            UNAVAILABLE,
        ),
    ];
    for (what, args, code) in cases {
        let mut cmd = sb.bare();
        cmd.arg("run").args(&args).args(["--", "touch", "ran"]);
        check_rejected(what, sb.run(cmd), code);
    }

    let mut no_command = sb.bare();
    no_command.args(["run", "--backend", &url, "n", "--"]);
    check_rejected("missing command after --", sb.run(no_command), USAGE);
    let mut no_separator = sb.bare();
    no_separator.args(["run", "--backend", &url, "n"]);
    check_rejected("no command at all", sb.run(no_separator), USAGE);

    assert!(!sb.path("ran").exists(), "a rejected run ran its command");
}

fn check_rejected(what: &str, out: common::Finished, code: i32) {
    assert_eq!(out.code(), Some(code), "{what}: {out:?}");
    assert!(!out.stderr.contains("panicked"), "{what}: {}", out.stderr);
    let first = out.stderr.lines().next().unwrap_or("");
    assert!(
        first.starts_with("fencelock: ") || first.starts_with("error: "),
        "{what}: stderr must start with a readable message: {:?}",
        out.stderr
    );
    assert!(first.len() > "fencelock: ".len() + 10, "{what}: {first:?}");
}

#[test]
fn exit_status_of_the_command_is_passed_through() {
    let sb = Sandbox::new();
    let out = sb.run(sb.run_sh(&[], "status", "exit 3"));
    assert_eq!(out.code(), Some(3), "{out:?}");
    // Killed by a signal: 128 + the signal, as a shell reports it.
    let out = sb.run(sb.run_sh(&[], "status", "kill -KILL $$"));
    assert_eq!(out.code(), Some(128 + 9), "{out:?}");
    assert_eq!(sb.inspect("status"), "status: free");
}

#[test]
fn command_not_found_exits_127_and_releases() {
    let sb = Sandbox::new();
    let out = sb.run(sb.fencelock(
        "run",
        &["missing", "--", "/nonexistent/fencelock-test-command"],
    ));
    assert_eq!(out.code(), Some(127), "{out:?}");
    assert!(out.stderr.contains("cannot start"), "{}", out.stderr);
    assert_eq!(sb.inspect("missing"), "missing: free");
}

#[test]
fn command_sees_token_resource_and_owner() {
    let sb = Sandbox::new();
    let name = "jobs/nightly report €";
    let out = sb.run(sb.run_sh(
        &[],
        name,
        r#"printf '%s|%s|%s\n' "$FENCELOCK_TOKEN" "$FENCELOCK_RESOURCE" "$FENCELOCK_OWNER""#,
    ));
    assert_eq!(out.code(), Some(0), "{out:?}");
    let line = out.stdout.trim_end_matches('\n');
    let fields: Vec<&str> = line.split('|').collect();
    assert_eq!(fields.len(), 3, "{line:?}");
    assert!(parse_number(fields[0]) > 0, "{line:?}");
    assert_eq!(fields[1], name);
    assert_eq!(fields[2].len(), 32, "owner {:?}", fields[2]);
    assert!(
        fields[2].chars().all(|c| c.is_ascii_hexdigit()),
        "owner {:?}",
        fields[2]
    );
}

#[test]
fn fencelock_url_selects_the_backend_without_flag() {
    let sb = Sandbox::new();
    let env_url = format!("sqlite://{}", sb.path("from-env.db").display());
    let mut cmd = sb.bare();
    cmd.env("FENCELOCK_URL", &env_url).args([
        "run",
        "envurl",
        "--",
        "sh",
        "-c",
        &format!("echo ready > ready; {WAIT_FOR_RELEASE}"),
    ]);
    let mut holder = sb.spawn(cmd);
    wait_for_line(&sb.path("ready"), FINISH);

    let mut inspect_env = sb.bare();
    inspect_env.args(["inspect", "--backend", &env_url, "envurl"]);
    let out = sb.run(inspect_env);
    assert!(
        out.stdout.starts_with("envurl: held by"),
        "the lock must be in the FENCELOCK_URL database: {out:?}"
    );
    assert_eq!(sb.inspect("envurl"), "envurl: free");
    assert!(!sb.path("state").exists(), "the default database was used");

    std::fs::write(sb.path("release"), "").unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
}

/// SIGTERM to fencelock reaches the command's group; fencelock exits with the command's own
/// status and the lock is free afterwards.
#[test]
fn sigterm_is_forwarded_and_the_lock_released() {
    let sb = Sandbox::new();
    let mut p = sb.spawn(sb.run_sh(
        &[],
        "term",
        r#"trap "echo got-term > f; exit 7" TERM; echo ready > r;
           i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; exit 99"#,
    ));
    wait_for_line(&sb.path("r"), FINISH);
    kill(p.pid(), Signal::SIGTERM).unwrap();
    let out = p.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(7), "{out:?}");
    assert_eq!(
        std::fs::read_to_string(sb.path("f")).unwrap().trim(),
        "got-term"
    );
    assert_eq!(sb.inspect("term"), "term: free");
}

#[test]
fn if_held_skip_exits_0_without_running() {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(sb.run_sh(
        &[],
        "skipme",
        &format!("echo ready > ready; {WAIT_FOR_RELEASE}"),
    ));
    wait_for_line(&sb.path("ready"), FINISH);

    let out = sb.run(sb.run_sh(&["--if-held", "skip"], "skipme", "touch ran"));
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(out.stderr.contains("skipped"), "{}", out.stderr);
    assert!(
        out.stderr.contains(&format!("pid {}", holder.pid())),
        "{}",
        out.stderr
    );
    assert!(!sb.path("ran").exists(), "the skipped command ran");

    std::fs::write(sb.path("release"), "").unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert_eq!(sb.inspect("skipme"), "skipme: free");
}
