//! The stuck-lock runbook as real processes: `inspect`, `list`, `release --force` and `audit`
//! against holders that are `fencelock run` processes, on SQLite, one Redis node and Redlock.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{poll_until, wait_for_line, BinCommand, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock::fence::MemoryFence;
use fencelock::{ErrorKind, FencingToken};
use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

const HELD: i32 = 75;
const USAGE: i32 = 64;
const LEASE_LOST: i32 = 79;

/// `fencelock SUB --backend URL ARGS...`, run in the sandbox.
fn on(sb: &Sandbox, url: &str, sub: &str, args: &[&str]) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.arg(sub).arg("--backend").arg(url).args(args);
    cmd
}

/// `fencelock run --backend URL OPTS... NAME -- sh -c SCRIPT`.
fn run_on(sb: &Sandbox, url: &str, opts: &[&str], name: &str, script: &str) -> BinCommand {
    let mut cmd = on(sb, url, "run", opts);
    cmd.arg(name).args(["--", "sh", "-c", script]);
    cmd
}

/// Runs a command that must exit 0, and returns its stdout.
fn ok(sb: &Sandbox, cmd: BinCommand) -> String {
    let out = sb.run(cmd);
    assert_eq!(out.code(), Some(0), "{out:?}");
    out.stdout
}

fn number(s: &str) -> u64 {
    let n = s.trim().parse::<u64>();
    assert!(n.is_ok(), "{s:?} is not a number");
    n.unwrap()
}

/// The raw text of `key`'s value in a flat JSON object (the first occurrence): a string's
/// content without quotes, else the literal. Enough for the CLI's own output.
fn field<'a>(json: &'a str, key: &str) -> &'a str {
    let pat = format!("\"{key}\":");
    let start = json.find(&pat).map(|i| i + pat.len());
    assert!(start.is_some(), "no {key:?} in {json}");
    let rest = &json[start.unwrap()..];
    if let Some(s) = rest.strip_prefix('"') {
        &s[..s.find('"').unwrap()]
    } else {
        &rest[..rest.find([',', '}']).unwrap()]
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}

/// A `fencelock run` holding `name` with a command that waits for the `release` file; returns
/// it with the token it got and its command's process group (killed with it on drop).
fn hold(sb: &Sandbox, url: &str, opts: &[&str], name: &str, tag: &str) -> (common::Proc, u64, Pid) {
    let script =
        format!("echo $FENCELOCK_TOKEN > tok-{tag}; echo $$ > pid-{tag}; {WAIT_FOR_RELEASE}");
    let mut holder = sb.spawn(run_on(sb, url, opts, name, &script));
    let token = number(&wait_for_line(&sb.path(&format!("tok-{tag}")), FINISH));
    let command = number(&wait_for_line(&sb.path(&format!("pid-{tag}")), FINISH));
    let command = Pid::from_raw(i32::try_from(command).unwrap());
    holder.adopt_group(command);
    (holder, token, command)
}

/// SIGKILL to a holder and its command: nothing is left to release the lock. The holder is
/// reaped, so its pid is gone rather than a zombie, and so is the command's supervisor, which
/// the liveness check would otherwise find still at work under the lease.
fn kill_holder(holder: &mut common::Proc, command: Pid) {
    let supervisor = parent_of(command);
    kill(holder.pid(), Signal::SIGKILL).unwrap();
    let _ = killpg(command, Signal::SIGKILL);
    holder.wait(FINISH).unwrap();
    if let Some(supervisor) = supervisor {
        let gone = poll_until(FINISH, || {
            parent_of(supervisor).is_none() || zombie(supervisor)
        });
        assert!(gone, "the supervisor {supervisor} outlived its command");
    }
}

fn stat_fields(pid: Pid) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

fn parent_of(pid: Pid) -> Option<Pid> {
    let ppid = stat_fields(pid)?.get(1)?.parse().ok()?;
    Some(Pid::from_raw(ppid))
}

fn zombie(pid: Pid) -> bool {
    stat_fields(pid).is_some_and(|f| f[0] == "Z" || f[0] == "X")
}

/// Refused against a live holder; after the holder is SIGKILLed (its lock still has most of a
/// 60 s TTL), released, recorded, and the old token is stale behind the next holder's.
fn forced_release_of_a_killed_holder(url: &str) {
    let sb = Sandbox::new();
    let name = "billing/nightly run";
    let (mut holder, old_token, command) = hold(
        &sb,
        url,
        &["--ttl", "60s", "--client-name", "billing-worker"],
        name,
        "a",
    );
    let holder_pid = holder.pid();

    let out = sb.run(on(
        &sb,
        url,
        "release",
        &["--force", name, "--reason", "looks stuck"],
    ));
    assert_eq!(out.code(), Some(HELD), "{out:?}");
    assert!(out.stderr.contains("looks alive"), "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("pid {holder_pid} is running on this host")),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--holder-is-dead"), "{}", out.stderr);
    let inspected = ok(&sb, on(&sb, url, "inspect", &[name]));
    assert!(inspected.contains("healthy"), "{inspected}");
    assert_eq!(
        ok(&sb, on(&sb, url, "audit", &[])).trim(),
        "no forced releases recorded"
    );

    kill_holder(&mut holder, command);
    let inspected = ok(&sb, on(&sb, url, "inspect", &[name]));
    assert!(
        inspected.starts_with(&format!("{name}: held by pid {holder_pid}")),
        "{inspected}"
    );
    assert!(inspected.contains("suspect"), "{inspected}");
    assert!(
        inspected.contains(&format!("pid {holder_pid} is no longer running")),
        "{inspected}"
    );
    let json = ok(&sb, on(&sb, url, "inspect", &["--json", name]));
    assert_eq!(field(&json, "held"), "true", "{json}");
    assert_eq!(field(&json, "verdict"), "suspect", "{json}");
    assert_eq!(field(&json, "process"), "gone", "{json}");
    assert_eq!(field(&json, "looks_alive"), "false", "{json}");
    assert_eq!(number(field(&json, "token")), old_token);
    assert_eq!(field(&json, "ttl_ms"), "60000", "{json}");
    let listed = ok(&sb, on(&sb, url, "list", &[]));
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with(name) && l.contains("suspect")),
        "{listed}"
    );

    let mut force = on(
        &sb,
        url,
        "release",
        &[
            "--force",
            name,
            "--reason",
            "worker killed during deploy",
            "--json",
        ],
    );
    force.env("USER", "alice");
    let record = ok(&sb, force);
    let counter = number(field(&record, "counter"));
    assert!(counter > old_token, "{record}");
    assert_eq!(field(&record, "user"), "alice", "{record}");
    assert_eq!(field(&record, "host"), hostname(), "{record}");
    assert_eq!(
        field(&record, "reason"),
        "worker killed during deploy",
        "{record}"
    );
    assert_eq!(field(&record, "holder_declared_dead"), "false", "{record}");
    assert_eq!(number(field(&record, "token")), old_token, "{record}");
    assert_eq!(field(&record, "pid"), holder_pid.to_string(), "{record}");
    assert_eq!(field(&record, "client"), "billing-worker", "{record}");
    assert_eq!(
        ok(&sb, on(&sb, url, "inspect", &[name])).trim(),
        format!("{name}: free")
    );
    assert_eq!(ok(&sb, on(&sb, url, "list", &[])).trim(), "no held locks");

    // The log, as JSON and as text, says the same.
    let log = ok(&sb, on(&sb, url, "audit", &["--json", name]));
    assert!(
        log.starts_with('[') && log.trim_end().ends_with(']'),
        "{log}"
    );
    assert_eq!(log.matches("\"id\":").count(), 1, "{log}");
    assert_eq!(number(field(&log, "counter")), counter);
    assert_eq!(field(&log, "user"), "alice");
    assert_eq!(field(&log, "owner"), field(&record, "owner"));
    assert!(
        field(&log, "assessment").contains("no longer running"),
        "{log}"
    );
    let text = ok(&sb, on(&sb, url, "audit", &[]));
    assert!(
        text.contains(&format!("forced by alice@{}", hostname())),
        "{text}"
    );
    assert!(text.contains("worker killed during deploy"), "{text}");
    assert!(text.contains(&format!("token {old_token}")), "{text}");
    assert!(text.contains(&format!("counter now {counter}")), "{text}");
    assert_eq!(
        ok(&sb, on(&sb, url, "audit", &["other"])).trim(),
        "no forced releases recorded"
    );

    // The next holder's token is above the mark, so a fence that has seen it refuses the old.
    let next = ok(&sb, run_on(&sb, url, &[], name, "echo $FENCELOCK_TOKEN"));
    let next = number(&next);
    assert!(next > counter, "{next} <= {counter}");
    let fence = MemoryFence::new();
    fence.admit(name, FencingToken::new(next)).unwrap();
    let stale = fence.admit(name, FencingToken::new(old_token)).unwrap_err();
    assert_eq!(stale.kind(), ErrorKind::StaleToken);

    // Nothing left to force.
    assert_eq!(
        ok(
            &sb,
            on(&sb, url, "release", &["--force", name, "--reason", "again"])
        )
        .trim(),
        format!("{name}: free; nothing to release")
    );
}

/// `--holder-is-dead` overrides the check; a holder that was in fact alive finds out at its
/// next renewal, terminates its command and exits 79.
fn holder_declared_dead_loses_its_lease(url: &str) {
    let sb = Sandbox::new();
    let (mut holder, _, _) = hold(&sb, url, &["--ttl", "3s"], "declared", "a");
    let record = ok(
        &sb,
        on(
            &sb,
            url,
            "release",
            &[
                "--force",
                "declared",
                "--reason",
                "operator knows best",
                "--holder-is-dead",
                "--json",
            ],
        ),
    );
    assert_eq!(field(&record, "holder_declared_dead"), "true", "{record}");
    assert!(
        field(&record, "assessment").contains("is running on this host"),
        "{record}"
    );
    let out = holder.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(out.code(), Some(LEASE_LOST), "{out:?}");
    assert!(out.stderr.contains("force-released"), "{}", out.stderr);
}

/// `inspect` and `list` on a held, an expired and a force-released lock.
fn inspect_and_list_held_expired_and_force_released(url: &str) {
    let sb = Sandbox::new();
    let (mut held, held_token, _) = hold(&sb, url, &["--ttl", "60s"], "jobs/held", "h");
    let (_other, _, _) = hold(&sb, url, &["--ttl", "60s"], "other/held", "o");
    let (mut expired, _, expired_cmd) = hold(&sb, url, &["--ttl", "1s"], "jobs/expired", "e");
    let (mut forced, _, forced_cmd) = hold(&sb, url, &["--ttl", "60s"], "jobs/forced", "f");
    kill_holder(&mut expired, expired_cmd);
    kill_holder(&mut forced, forced_cmd);
    ok(
        &sb,
        on(
            &sb,
            url,
            "release",
            &["--force", "jobs/forced", "--reason", "killed"],
        ),
    );
    let free = poll_until(Duration::from_secs(10), || {
        sb.run(on(&sb, url, "inspect", &["jobs/expired"])).stdout == "jobs/expired: free\n"
    });
    assert!(free, "the 1 s lock of a killed holder did not expire");

    let table = ok(&sb, on(&sb, url, "list", &["jobs/"]));
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert!(lines[0].starts_with("RESOURCE"), "{table}");
    assert!(lines[1].starts_with("jobs/held "), "{table}");
    assert!(lines[1].contains(&held_token.to_string()), "{table}");
    assert!(lines[1].ends_with("healthy"), "{table}");
    assert!(lines[1].contains(&held.pid().to_string()), "{table}");

    let all = ok(&sb, on(&sb, url, "list", &["--json"]));
    assert_eq!(all.matches("\"resource\":").count(), 2, "{all}");
    assert!(all.contains("\"resource\":\"jobs/held\""), "{all}");
    assert!(all.contains("\"resource\":\"other/held\""), "{all}");
    assert_eq!(
        ok(&sb, on(&sb, url, "list", &["--json", "nothing/"])).trim(),
        "[]"
    );

    let json = ok(&sb, on(&sb, url, "inspect", &["--json", "jobs/held"]));
    assert_eq!(field(&json, "verdict"), "healthy", "{json}");
    assert_eq!(field(&json, "process"), "running", "{json}");
    assert_eq!(field(&json, "client"), "fencelock-run", "{json}");
    assert_eq!(field(&json, "host"), hostname(), "{json}");
    assert!(number(field(&json, "ttl_left_ms")) <= 60_000, "{json}");
    for name in ["jobs/expired", "jobs/forced"] {
        let json = ok(&sb, on(&sb, url, "inspect", &["--json", name]));
        assert!(
            json.starts_with(&format!("{{\"resource\":\"{name}\",")),
            "{json}"
        );
        assert_eq!(field(&json, "held"), "false", "{json}");
        assert_eq!(
            ok(&sb, on(&sb, url, "inspect", &[name])).trim(),
            format!("{name}: free")
        );
    }

    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(held.wait(FINISH).unwrap().code(), Some(0));
}

#[test]
fn forced_release_of_a_killed_holder_sqlite() {
    let sb = Sandbox::new();
    forced_release_of_a_killed_holder(&format!("sqlite://{}", sb.path("ops.db").display()));
}

#[test]
fn forced_release_of_a_killed_holder_one_redis_node() {
    let server = RedisServer::start().unwrap();
    forced_release_of_a_killed_holder(&server.url());
}

#[test]
fn forced_release_of_a_killed_holder_redlock() {
    let nodes = start_redis_nodes(3).unwrap();
    forced_release_of_a_killed_holder(&redlock_url(&nodes));
}

#[test]
fn holder_declared_dead_loses_its_lease_sqlite() {
    let sb = Sandbox::new();
    holder_declared_dead_loses_its_lease(&format!("sqlite://{}", sb.path("ops.db").display()));
}

#[test]
fn holder_declared_dead_loses_its_lease_redis() {
    let server = RedisServer::start().unwrap();
    holder_declared_dead_loses_its_lease(&server.url());
}

#[test]
fn holder_declared_dead_loses_its_lease_redlock() {
    let nodes = start_redis_nodes(3).unwrap();
    holder_declared_dead_loses_its_lease(&redlock_url(&nodes));
}

#[test]
fn inspect_and_list_sqlite() {
    let sb = Sandbox::new();
    inspect_and_list_held_expired_and_force_released(&format!(
        "sqlite://{}",
        sb.path("ops.db").display()
    ));
}

#[test]
fn inspect_and_list_one_redis_node() {
    let server = RedisServer::start().unwrap();
    inspect_and_list_held_expired_and_force_released(&server.url());
}

#[test]
fn inspect_and_list_redlock() {
    let nodes = start_redis_nodes(3).unwrap();
    inspect_and_list_held_expired_and_force_released(&redlock_url(&nodes));
}

/// `release` without `--force` or without a reason, and bad names or prefixes, exit 64 with a
/// message and touch nothing.
#[test]
fn release_needs_force_and_a_reason() {
    let sb = Sandbox::new();
    let (mut holder, _, _) = hold(&sb, sb.url(), &[], "kept", "k");
    let cases: [&[&str]; 5] = [
        &["kept", "--reason", "no force"],
        &["--force", "kept"],
        &["--force", "kept", "--reason", " "],
        &["--force", "kept", "--reason", "a\nb"],
        &["--force", "", "--reason", "empty name"],
    ];
    for args in cases {
        let out = sb.run(sb.fencelock("release", args));
        assert_eq!(out.code(), Some(USAGE), "{args:?}: {out:?}");
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
    let out = sb.run(sb.fencelock("list", &["a\nb"]));
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
    assert!(sb.inspect("kept").starts_with("kept: held by"));
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(holder.wait(FINISH).unwrap().code(), Some(0));
}

/// Bad input of every kind exits 64 with a message, before any lock is taken: overflowing
/// durations a parser cannot represent, a Redlock URL naming one node twice (spelled alike or
/// resolving alike), a client name with a control character, an empty prefix (flag or
/// environment), and a `sqlite://` URL with a query or a fragment.
#[test]
fn bad_input_exits_64_and_holds_nothing() {
    let sb = Sandbox::new();
    let url = sb.url().to_owned();
    let cases: [(&[&str], &str); 9] = [
        (&["--wait", "99999999999999999999999s"], "is not a duration"),
        (
            &["--kill-after", "99999999999999999999999y"],
            "is not a duration",
        ),
        (&["--client-name", "a\nb"], "control characters"),
        (&["--client-name", "\u{1b}[2J"], "control characters"),
        (&["--prefix", ""], "prefix is empty"),
        (
            &[
                "--backend",
                "redlock://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7001",
            ],
            "twice",
        ),
        (
            &[
                "--backend",
                "redlock://127.0.0.1:7001,localhost:7001,127.0.0.2:7001",
            ],
            "same server",
        ),
        (&["--backend", "sqlite:///tmp/q.db?foo=bar"], "query"),
        (&["--backend", "sqlite:///tmp/q.db#frag"], "fragment"),
    ];
    for (opts, says) in cases {
        let mut cmd = sb.bare();
        cmd.arg("run");
        if !opts.contains(&"--backend") {
            cmd.arg("--backend").arg(&url);
        }
        cmd.args(opts).args(["x", "--", "touch", "ran"]);
        let out = sb.run(cmd);
        assert_eq!(out.code(), Some(USAGE), "{opts:?}: {out:?}");
        assert!(out.stderr.contains(says), "{opts:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{opts:?}: {}", out.stderr);
        assert!(!sb.path("ran").exists(), "{opts:?} ran the command");
    }
    assert!(!std::path::Path::new("/tmp/q.db?foo=bar").exists());
    let mut cmd = sb.bare();
    cmd.env("FENCELOCK_PREFIX", "").args(["key", "x"]);
    let out = sb.run(cmd);
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
    assert_eq!(sb.inspect("x"), "x: free");
}

/// Durations beyond any deadline (`300000000000y`, `u64::MAX` seconds) are taken as "wait for
/// ever" and "never kill early": the command runs and the lock is released, without a panic.
#[test]
fn huge_durations_saturate_without_a_panic() {
    let sb = Sandbox::new();
    for opts in [
        ["--wait", "300000000000y"],
        ["--wait", "18446744073709551615s"],
        ["--kill-after", "300000000000y"],
        ["--kill-after", "18446744073709551615s"],
    ] {
        let out = sb.run(run_on(&sb, sb.url(), &opts, "huge", "true"));
        assert_eq!(out.code(), Some(0), "{opts:?}: {out:?}");
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
    let out = sb.run(run_on(
        &sb,
        sb.url(),
        &["--ttl", "18446744073709551615s"],
        "huge",
        "true",
    ));
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
    assert_eq!(sb.inspect("huge"), "huge: free");
}

/// A lock taken by another client with `SET key value NX PX` and a value holding a newline and
/// a terminal escape is shown escaped by `inspect`, `list` and the "held by" message, so it
/// cannot forge a line of output or drive the terminal.
#[test]
fn holder_fields_written_by_others_are_escaped() {
    let sb = Sandbox::new();
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let keys = ok(&sb, on(&sb, &url, "key", &["forged"]));
    let lock_key = keys
        .lines()
        .find_map(|l| l.strip_prefix("lock\t"))
        .unwrap()
        .to_owned();
    let value = "evil\nforged: free\u{1b}[2J";
    let set = server
        .cli(&["SET", &lock_key, value, "NX", "PX", "60000"])
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let shown = ok(&sb, on(&sb, &url, "inspect", &["forged"]));
    let listed = ok(&sb, on(&sb, &url, "list", &[]));
    let held = sb.run(run_on(&sb, &url, &[], "forged", "true"));
    assert_eq!(held.code(), Some(HELD), "{held:?}");
    for text in [&shown, &listed, &held.stderr] {
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(
            !text.lines().any(|l| l.starts_with("forged: free")),
            "{text:?}"
        );
    }
    assert!(
        shown.contains("evil\\u{a}forged: free\\u{1b}[2J"),
        "{shown}"
    );
}

/// `--metrics-addr localhost:0` listens on loopback, prints the port it took, and serves the
/// metrics there while the command runs.
#[test]
fn metrics_on_localhost_port_zero_prints_the_address() {
    let sb = Sandbox::new();
    let mut holder = sb.spawn(run_on(
        &sb,
        sb.url(),
        &["--metrics-addr", "localhost:0"],
        "metered",
        &format!("touch started; {WAIT_FOR_RELEASE}"),
    ));
    let mut line = String::new();
    let printed = poll_until(FINISH, || {
        line = holder
            .stderr()
            .lines()
            .find(|l| l.contains("serving metrics on http://127.0.0.1:"))
            .unwrap_or_default()
            .to_owned();
        !line.is_empty()
    });
    assert!(printed, "{}", holder.stderr());
    // The acquisition is recorded before the command starts.
    assert!(poll_until(FINISH, || sb.path("started").exists()));
    let addr = line
        .split("http://")
        .nth(1)
        .and_then(|r| r.strip_suffix("/metrics"))
        .unwrap()
        .to_owned();
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    use std::io::{Read, Write};
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.0 200"), "{body}");
    assert!(body.contains("fencelock_"), "{body}");
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(holder.wait(FINISH).unwrap().code(), Some(0));
}

/// `fencelock key` computes keys from the URL alone: it answers for engines that are down,
/// and what it prints for a live Redis is what the connected client uses.
#[test]
fn key_answers_without_connecting() {
    let sb = Sandbox::new();
    let server = RedisServer::start().unwrap();
    let live = ok(&sb, on(&sb, &server.url(), "key", &["invoices"]));
    let down = ok(&sb, on(&sb, "redis://127.0.0.1:1", "key", &["invoices"]));
    assert_eq!(live, down);
    assert!(live.lines().any(|l| l.starts_with("lock\t")), "{live}");
    let pg = ok(
        &sb,
        on(&sb, "postgres://u@127.0.0.1:1/db", "key", &["invoices"]),
    );
    assert!(pg.lines().any(|l| l.starts_with("advisory\t")), "{pg}");
    let lease = ok(
        &sb,
        on(
            &sb,
            "postgres://u@127.0.0.1:1/db?mode=lease",
            "key",
            &["invoices"],
        ),
    );
    assert_eq!(lease, "row\tfencelock_leases.key = fencelock:v1:invoices\n");
    let out = sb.run(on(&sb, "redis://127.0.0.1:1", "key", &["a\nb"]));
    assert_eq!(out.code(), Some(USAGE), "{out:?}");
}

/// The default state directory is created 0700 and its SQLite file 0600; a file named by the
/// URL gets the mode the user's umask gives any new file.
#[test]
fn default_state_is_private_and_a_named_file_keeps_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let sb = Sandbox::new();
    let mut cmd = sb.bare();
    cmd.args(["run", "x", "--", "true"]);
    assert_eq!(sb.run(cmd).code(), Some(0));
    let dir = sb.path("state/fencelock");
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&dir.join("locks.db")), 0o600);
    for side in ["locks.db-wal", "locks.db-shm"] {
        if dir.join(side).exists() {
            assert_eq!(mode(&dir.join(side)) & 0o077, 0, "{side}");
        }
    }

    let out = sb.run(run_on(&sb, sb.url(), &[], "x", "true"));
    assert_eq!(out.code(), Some(0), "{out:?}");
    std::fs::write(sb.path("plain"), "").unwrap();
    assert_eq!(mode(&sb.path("locks.db")), mode(&sb.path("plain")));
}

/// Every command that prints, as `fencelock ARGS --backend URL`.
const PRINTING: [&[&str]; 12] = [
    &["list"],
    &["list", "--json"],
    &["inspect", "held"],
    &["inspect", "--json", "held"],
    &["key", "held"],
    &["audit"],
    &["audit", "--json"],
    &["release", "--force", "--reason", "r", "free"],
    &["acl"],
    &["limits", "show"],
    &["doctor"],
    &["demo"],
];

/// `fencelock ARGS --backend URL` with stdout on `stdout`, run to completion (at most
/// [`FINISH`]) in the sandbox; returns its exit code and stderr.
fn with_stdout(
    sb: &Sandbox,
    url: &str,
    args: &[&str],
    stdout: std::process::Stdio,
) -> (Option<i32>, String) {
    let err = sb.path(&format!("stderr-{}", args.join("-")));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .current_dir(sb.path(""))
        .env("XDG_STATE_HOME", sb.path("state"))
        .env("XDG_CONFIG_HOME", sb.path("config"))
        .env_remove("FENCELOCK_URL")
        .env_remove("FENCELOCK_CONFIG")
        .env_remove("FENCELOCK_PREFIX")
        .args(args)
        .args(["--backend", url])
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut status = None;
    let finished = poll_until(FINISH, || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    if !finished {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(finished, "{args:?} still ran after {FINISH:?}");
    (
        status.and_then(|s| s.code()),
        std::fs::read_to_string(&err).unwrap(),
    )
}

/// What broke: every command that prints panicked (exit 101) when its stdout failed, a pipe
/// whose reader had gone (`| head -1`) or a full disk, and `elect --listen` printed to no one
/// for ever. A closed pipe now ends the output quietly with the command's own status; a full
/// disk is reported, exit 74.
#[test]
fn output_into_a_closed_pipe_or_a_full_disk_does_not_panic() {
    let sb = Sandbox::new();
    let url = sb.url();
    let mut holder = sb.spawn(run_on(
        &sb,
        url,
        &[],
        "held",
        &format!("echo > ready; {WAIT_FOR_RELEASE}"),
    ));
    wait_for_line(&sb.path("ready"), FINISH);
    for args in PRINTING {
        let mut cmd = sb.bare();
        cmd.args(args).args(["--backend", url]);
        let normal = sb.run(cmd);
        assert!(
            !normal.stdout.is_empty(),
            "{args:?} prints nothing: {normal:?}"
        );

        let (read, write) = nix::unistd::pipe().unwrap();
        drop(read);
        let (code, stderr) = with_stdout(&sb, url, args, write.into());
        assert_eq!(code, normal.code(), "{args:?} into a closed pipe: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");

        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let (code, stderr) = with_stdout(&sb, url, args, full.into());
        let expected = if normal.code() == Some(0) {
            Some(74)
        } else {
            normal.code()
        };
        assert_eq!(code, expected, "{args:?} into a full disk: {stderr}");
        assert!(
            stderr.contains("fencelock: cannot write the output: No space left on device"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // `elect --listen` prints until stopped: with no one to print to it stops by itself.
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    let (code, stderr) = with_stdout(&sb, url, &["elect", "--listen", "leader"], write.into());
    assert_eq!(code, Some(0), "{stderr}");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let (code, stderr) = with_stdout(&sb, url, &["elect", "--listen", "leader"], full.into());
    assert_eq!(code, Some(74), "{stderr}");
    // The forced release of a held lock happens whatever becomes of its message.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let (code, _) = with_stdout(
        &sb,
        url,
        &[
            "release",
            "--force",
            "--holder-is-dead",
            "--reason",
            "r",
            "held",
        ],
        full.into(),
    );
    assert_eq!(code, Some(74));
    assert_eq!(sb.inspect("held"), "held: free");
    std::fs::write(sb.path("release"), "").unwrap();
    holder.wait(FINISH).unwrap();
}
