//! `fencelock acl` against real servers: the users it prints are applied as an operator would,
//! then every fencelock command runs as them. On Redis the commands the server counted are
//! compared with the library's list, so a script that starts calling another command fails here.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{fencelock, fencelock_at, poll_until, Proc, FINISH};
use fencelock_testkit::RedisServer;

const PASSWORD: &str = "s3cret-acl-pw";

/// The lines `fencelock acl` prints to run (not its comments), with the password filled in.
fn acl_lines(backend: &str, prefix: &str, user: &str) -> Vec<String> {
    let out = fencelock(&[
        "acl",
        "--backend",
        backend,
        "--prefix",
        prefix,
        "--user",
        user,
    ])
    .run(FINISH)
    .unwrap();
    assert!(out.status.success(), "{}", out.stderr);
    assert!(!out.stdout.contains(PASSWORD));
    out.stdout
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with("--"))
        .map(|l| l.replace(fencelock::PASSWORD_PLACEHOLDER, PASSWORD))
        .collect()
}

fn redis_cli() -> String {
    std::env::var("FENCELOCK_REDIS_CLI").unwrap_or_else(|_| "redis-cli".into())
}

/// Runs `lines` through `redis-cli` on its standard input, as the default (administrator)
/// user: the passwords they hold never appear in an argument list.
fn apply_redis(server: &RedisServer, lines: &[String]) {
    let mut child = Command::new(redis_cli())
        .args(["-h", "127.0.0.1", "-p", &server.port().to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.join("\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.lines().filter(|l| *l == "OK").count(),
        lines.len(),
        "applying {lines:?}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `redis-cli --user USER` (password in `REDISCLI_AUTH`) running `args`; its output.
fn cli_as(server: &RedisServer, user: &str, args: &[&str]) -> String {
    let out = Command::new(redis_cli())
        .args(["-h", "127.0.0.1", "-p", &server.port().to_string()])
        .args(["--user", user, "--no-auth-warning"])
        .args(args)
        .env("REDISCLI_AUTH", PASSWORD)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn url_as(server: &RedisServer, user: &str) -> String {
    format!("redis://{user}:{PASSWORD}@127.0.0.1:{}", server.port())
}

fn admin(server: &RedisServer, args: &[&str]) -> String {
    String::from_utf8_lossy(&server.cli(args).unwrap().stdout).into_owned()
}

fn ok(cmd: &mut common::BinCommand) -> String {
    let out = cmd.run(FINISH).unwrap();
    assert!(out.status.success(), "{}{}", out.stdout, out.stderr);
    out.stdout
}

/// `fencelock run NAME` holding the lock until the file `release` appears in `dir`.
fn holder(url: &str, prefix: &str, dir: &std::path::Path, opts: &[&str], name: &str) -> Proc {
    let ready = dir.join(format!("ready-{name}"));
    let script = format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.02; done",
        ready.display(),
        dir.join(format!("release-{name}")).display()
    );
    let mut args = vec!["run", "--prefix", prefix];
    args.extend(opts);
    args.extend([name, "--", "sh", "-c", &script]);
    let p = fencelock_at(url, &args).spawn().unwrap();
    assert!(poll_until(Duration::from_secs(10), || ready.exists()));
    p
}

/// Waits until a fair waiter stands in the queue of `name`. `TYPE` is a command fencelock
/// never runs, so the polling stays out of the measured set.
fn await_queued(server: &RedisServer, prefix: &str, name: &str) {
    let key = format!("{prefix}queue:{name}");
    assert!(poll_until(Duration::from_secs(10), || admin(
        server,
        &["TYPE", &key]
    )
    .trim()
        == "zset"));
}

/// Every fencelock operation, run as the user `fencelock acl` printed, on a fresh server: the
/// commands the server counted (`INFO commandstats` counts those a script calls too) are
/// exactly `fencelock::REDIS_COMMANDS`, and none was refused.
#[test]
fn redis_user_runs_every_command_and_the_list_is_what_they_use() {
    let server = RedisServer::start().unwrap();
    let prefix = "svc:";
    apply_redis(&server, &acl_lines(&server.url(), prefix, "svc"));
    admin(&server, &["CONFIG", "RESETSTAT"]);
    let url = url_as(&server, "svc");
    let dir = tempfile::tempdir().unwrap();
    let at = |args: &[&str]| {
        let mut c = fencelock_at(&url, args);
        c.env("FENCELOCK_PREFIX", prefix);
        c
    };

    ok(&mut at(&["run", "a", "--", "true"]));
    ok(&mut at(&["key", "a"]));
    // Contended, plain: a refused attempt, then the holder's release wakes the waiter.
    let mut h = holder(&url, prefix, dir.path(), &[], "b");
    let mut w = at(&["run", "--wait", "20s", "b", "--", "true"])
        .spawn()
        .unwrap();
    // The waiter raised the holder's wait flag, the byte after the 32-digit owner and its
    // newline (`GETRANGE`, like `TYPE`, is a command fencelock never runs).
    assert!(poll_until(Duration::from_secs(10), || admin(
        &server,
        &["GETRANGE", "svc:lock:b", "33", "33"]
    )
    .trim()
        == "1"));
    std::fs::write(dir.path().join("release-b"), "").unwrap();
    assert!(h.wait(FINISH).unwrap().status.success());
    let out = w.wait(FINISH).unwrap();
    assert!(out.status.success(), "{}", out.stderr);
    // Fair: a queued waiter, handed the lock by the release.
    let mut h = holder(&url, prefix, dir.path(), &["--fair"], "f");
    // A handed-over lease comes with what is left of the queue entry; `run` renews it before
    // its supervisor starts, so the default --kill-after does not stop the command at once.
    let mut w = at(&["run", "--fair", "--wait", "20s", "f", "--", "true"])
        .spawn()
        .unwrap();
    await_queued(&server, prefix, "f");
    std::fs::write(dir.path().join("release-f"), "").unwrap();
    assert!(h.wait(FINISH).unwrap().status.success());
    let out = w.wait(FINISH).unwrap();
    assert!(out.status.success(), "{}", out.stderr);
    // Fair, the holder dies: its lease lapses and the head of the queue takes the lock.
    let mut h = holder(&url, prefix, dir.path(), &["--ttl", "1s"], "g");
    let mut w = at(&["run", "--fair", "--wait", "20s", "g", "--", "true"])
        .spawn()
        .unwrap();
    await_queued(&server, prefix, "g");
    nix::sys::signal::kill(h.pid(), nix::sys::signal::Signal::SIGKILL).unwrap();
    let _ = h.wait(FINISH);
    let out = w.wait(FINISH).unwrap();
    assert!(out.status.success(), "{}", out.stderr);
    // The runbook, on a held lock.
    let mut h = holder(&url, prefix, dir.path(), &[], "r");
    assert!(ok(&mut at(&["inspect", "r"])).contains("held by"));
    assert!(ok(&mut at(&["list"])).contains('r'));
    ok(&mut at(&[
        "release",
        "--force",
        "--reason",
        "acl test",
        "--holder-is-dead",
        "r",
    ]));
    std::fs::write(dir.path().join("release-r"), "").unwrap();
    let _ = h.wait(FINISH);
    assert!(ok(&mut at(&["audit"])).contains("acl test"));
    ok(&mut at(&["elect", "e", "--", "true"]));
    // The stored limits, and a grant, an extension and a release under a quota (its own
    // commands, which run only while a quota is set).
    ok(&mut at(&[
        "limits",
        "set",
        "--max-ttl",
        "1h",
        "--max-held-per-client",
        "10",
    ]));
    assert!(ok(&mut at(&["limits", "show"])).contains("10"));
    ok(&mut at(&["run", "--ttl", "1s", "q", "--", "sleep", "0.5"]));
    ok(&mut at(&["limits", "clear"]));

    let stats = admin(&server, &["INFO", "commandstats"]);
    // The test's own commands: its administrator's, and AUTH, which every user may run.
    let own = ["auth", "config|resetstat", "getrange", "info", "type"];
    let mut measured = BTreeSet::new();
    for line in stats.lines() {
        let Some((cmd, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        assert!(
            rest.contains("rejected_calls=0,"),
            "the acl user was refused {cmd}: {line}"
        );
        if !own.contains(&cmd) {
            measured.insert(cmd.to_owned());
        }
    }
    let listed: BTreeSet<String> = fencelock::REDIS_COMMANDS
        .iter()
        .map(|c| (*c).to_owned())
        .collect();
    assert_eq!(
        measured,
        listed,
        "run but not in REDIS_COMMANDS: {:?}; in REDIS_COMMANDS but not run: {:?}",
        measured.difference(&listed).collect::<Vec<_>>(),
        listed.difference(&measured).collect::<Vec<_>>()
    );
}

/// The user is confined to its prefix: `redis-cli` as that user cannot read or delete
/// another prefix's keys, and fencelock under another prefix is refused. The read-only user
/// inspects and lists, and cannot acquire.
#[test]
fn redis_users_are_confined_to_their_prefix_and_the_read_only_one_cannot_lock() {
    let server = RedisServer::start().unwrap();
    apply_redis(&server, &acl_lines(&server.url(), "svc:", "svc"));
    admin(&server, &["SET", "other:lock:x", "theirs"]);
    for args in [["GET", "other:lock:x"], ["DEL", "other:lock:x"]] {
        let out = cli_as(&server, "svc", &args);
        assert!(out.contains("NOPERM"), "{args:?}: {out}");
    }
    assert_eq!(admin(&server, &["GET", "other:lock:x"]).trim(), "theirs");
    let out = cli_as(&server, "svc", &["SET", "svc:lock:x", "mine"]);
    assert!(out.contains("OK"), "{out}");

    doctor_reports_the_acl_users(&server);

    let url = url_as(&server, "svc");
    let other = fencelock_at(&url, &["run", "--prefix", "other:", "x", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(other.code(), Some(69), "{}", other.stderr);
    assert!(
        other.stderr.contains("no permissions") && other.stderr.contains("fencelock acl"),
        "{}",
        other.stderr
    );

    let dir = tempfile::tempdir().unwrap();
    let mut h = holder(&url, "svc:", dir.path(), &[], "held");
    let ro = url_as(&server, "svc-ro");
    let inspect = ok(&mut fencelock_at(
        &ro,
        &["inspect", "--prefix", "svc:", "held"],
    ));
    assert!(inspect.contains("held by"), "{inspect}");
    assert!(ok(&mut fencelock_at(&ro, &["list", "--prefix", "svc:"])).contains("held"));
    ok(&mut fencelock_at(&ro, &["audit", "--prefix", "svc:"]));
    let refused = fencelock_at(&ro, &["run", "--prefix", "svc:", "y", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(refused.code(), Some(69), "{}", refused.stderr);
    assert!(
        refused
            .stderr
            .contains("this user may not run EVALSHA (the server's ACL)"),
        "{}",
        refused.stderr
    );
    let out = cli_as(&server, "svc-ro", &["SET", "svc:lock:z", "x"]);
    assert!(out.contains("NOPERM"), "{out}");
    std::fs::write(dir.path().join("release-held"), "").unwrap();
    assert!(h.wait(FINISH).unwrap().status.success());
}

/// A one-member etcd over TLS with `auth enable`, a root user and the users `fencelock acl`
/// prints for the prefix `/svc/`; returns it with a function giving a user's URL.
fn etcd_with_auth(
    dir: &std::path::Path,
    tls: bool,
) -> (fencelock_testkit::EtcdCluster, impl Fn(&str) -> String) {
    let cluster = if tls {
        let tls = fencelock_testkit::TestTls::generate(dir).unwrap();
        fencelock_testkit::EtcdCluster::start_tls(1, &tls).unwrap()
    } else {
        fencelock_testkit::EtcdCluster::start(1).unwrap()
    };
    let etcdctl = |args: &[&str], stdin: Option<&str>| {
        let mut cmd = cluster.ctl_command(args);
        cmd.env("ETCDCTL_USER", "root:root-pw");
        if stdin.is_some() {
            cmd.stdin(Stdio::piped());
        }
        let mut child = cmd.spawn().unwrap();
        if let Some(text) = stdin {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(text.as_bytes())
                .unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let mut bare = cluster.ctl_command(&["user", "add", "root", "--interactive=false"]);
    bare.stdin(Stdio::piped());
    let mut child = bare.spawn().unwrap();
    child.stdin.take().unwrap().write_all(b"root-pw\n").unwrap();
    assert!(child.wait_with_output().unwrap().status.success());
    etcdctl(&["auth", "enable"], None);
    for line in acl_lines(&cluster.url(), "/svc/", "svc") {
        assert!(!line.contains('\''), "{line}");
        let argv: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(argv[0], "etcdctl", "{line}");
        if argv[1..3] == ["user", "add"] {
            let mut args = argv[1..].to_vec();
            args.push("--interactive=false");
            etcdctl(&args, Some(&format!("{PASSWORD}\n")));
        } else {
            etcdctl(&argv[1..], None);
        }
    }
    let url = cluster.url();
    let as_user = move |user: &str| {
        let (scheme, rest) = url.split_once("://").unwrap();
        format!("{scheme}://{user}:{PASSWORD}@{rest}")
    };
    (cluster, as_user)
}

/// etcd with client certificates and `auth enable`: the roles `fencelock acl` printed, applied
/// with `etcdctl` as root, let the user lock under its prefix and nowhere else, and the
/// read-only user inspect and list but not lock.
#[test]
fn etcd_roles_confine_the_user_to_its_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let (_cluster, as_user) = etcd_with_auth(dir.path(), true);
    let url = as_user("svc");
    let token = ok(&mut fencelock_at(
        &url,
        &[
            "run",
            "--prefix",
            "/svc/",
            "job",
            "--",
            "sh",
            "-c",
            "echo $FENCELOCK_TOKEN",
        ],
    ));
    assert!(token.trim().parse::<u64>().is_ok(), "{token}");
    let refused = fencelock_at(&url, &["run", "--prefix", "/other/", "job", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(refused.code(), Some(69), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("permission denied") && refused.stderr.contains("fencelock acl"),
        "{}",
        refused.stderr
    );

    let mut h = holder(&url, "/svc/", dir.path(), &[], "held");
    let ro = as_user("svc-ro");
    let inspect = ok(&mut fencelock_at(
        &ro,
        &["inspect", "--prefix", "/svc/", "held"],
    ));
    assert!(inspect.contains("held by"), "{inspect}");
    assert!(ok(&mut fencelock_at(&ro, &["list", "--prefix", "/svc/"])).contains("held"));
    let refused = fencelock_at(&ro, &["run", "--prefix", "/svc/", "other", "--", "true"])
        .run(FINISH)
        .unwrap();
    assert_eq!(refused.code(), Some(69), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("permission denied"),
        "{}",
        refused.stderr
    );
    std::fs::write(dir.path().join("release-held"), "").unwrap();
    assert!(h.wait(FINISH).unwrap().status.success());
}

/// PostgreSQL: a role created from the printed statements (tables created by their owner
/// first, as the plan says) runs both modes and the runbook under its prefix, cannot write a
/// row of another prefix, and the read-only role inspects, lists and reads the audit log but
/// cannot lock.
#[test]
fn postgres_roles_confine_the_user_to_its_prefix() {
    let server = fencelock_testkit::PgServer::start().unwrap();
    let lines = acl_lines(&server.url(), "svc:", "svc");
    // `\password` asks at a terminal; the test kit's server trusts loopback logins instead.
    let sql: Vec<String> = lines.into_iter().filter(|l| !l.starts_with('\\')).collect();
    let out = server.psql(&sql.join("\n")).unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let base = format!("postgres://{{}}@127.0.0.1:{}/postgres", server.port());
    let as_role = |role: &str, query: &str| format!("{}{query}", base.replace("{}", role));
    let dir = tempfile::tempdir().unwrap();
    for mode in ["", "?mode=lease"] {
        let url = as_role("svc", mode);
        let at = |args: &[&str]| {
            let mut c = fencelock_at(&url, args);
            c.env("FENCELOCK_PREFIX", "svc:");
            c
        };
        ok(&mut at(&["run", "job", "--", "true"]));
        let name = format!("held{}", mode.len());
        let mut h = holder(&url, "svc:", dir.path(), &[], &name);
        assert!(ok(&mut at(&["inspect", &name])).contains("held by"));
        let ro = as_role("svc-ro", mode);
        let ro_at = |args: &[&str]| {
            let mut c = fencelock_at(&ro, args);
            c.env("FENCELOCK_PREFIX", "svc:");
            c
        };
        assert!(ok(&mut ro_at(&["inspect", &name])).contains("held by"));
        assert!(ok(&mut ro_at(&["list"])).contains(&name));
        let refused = ro_at(&["run", "other", "--", "true"]).run(FINISH).unwrap();
        assert_eq!(refused.code(), Some(69), "{mode}: {}", refused.stderr);
        assert!(
            refused.stderr.contains("permission denied"),
            "{mode}: {}",
            refused.stderr
        );
        ok(&mut at(&[
            "release",
            "--force",
            "--reason",
            "acl test",
            "--holder-is-dead",
            &name,
        ]));
        // The holder learns of the loss at its next renewal; its command need not wait.
        std::fs::write(dir.path().join(format!("release-{name}")), "").unwrap();
        let _ = h.wait(FINISH);
        assert!(ok(&mut at(&["audit"])).contains("acl test"));
        assert!(ok(&mut ro_at(&["audit"])).contains("acl test"));
        let other = fencelock_at(&url, &["run", "--prefix", "other:", "job", "--", "true"])
            .run(FINISH)
            .unwrap();
        assert_eq!(other.code(), Some(69), "{mode}: {}", other.stderr);
        assert!(
            other.stderr.contains("row-level security"),
            "{mode}: {}",
            other.stderr
        );
    }
}

/// `fencelock doctor`'s ACL lines (the rest of its report is not this test's business).
fn doctor_acl(url: &str) -> String {
    let out = fencelock(&["doctor", "--backend", url, "--prefix", "svc:"])
        .run(FINISH)
        .unwrap();
    out.stdout
        .lines()
        .skip_while(|l| !l.starts_with("ACL user"))
        .take_while(|l| *l != "TTL")
        .collect::<Vec<_>>()
        .join("\n")
}

fn doctor_reports_the_acl_users(server: &RedisServer) {
    let fit = doctor_acl(&url_as(server, "svc"));
    assert!(!fit.contains("WARN"), "{fit}");
    assert!(fit.contains("no key outside the prefix"), "{fit}");
    let admin_user = doctor_acl(&server.url());
    assert!(
        admin_user.contains("WARN") && admin_user.contains("@all"),
        "{admin_user}"
    );
    // The printed user without XADD: forced releases would be refused.
    let line = acl_lines(&server.url(), "svc:", "svc-noxadd")[0].replace(" +xadd", "");
    apply_redis(server, &[line]);
    let lacking = doctor_acl(&url_as(server, "svc-noxadd"));
    assert!(
        lacking.contains("WARN") && lacking.contains("XADD svc:audit"),
        "{lacking}"
    );
    let ro = doctor_acl(&url_as(server, "svc-ro"));
    assert!(
        ro.contains("ACL not checked") && ro.contains("EVALSHA"),
        "{ro}"
    );
    assert!(!format!("{fit}{admin_user}{lacking}{ro}").contains(PASSWORD));
}

/// `redis://user@host?password_file=F` sent the user name as the password and never read the
/// file (so did `$FENCELOCK_PASSWORD_FILE` and `$FENCELOCK_PASSWORD` beside `user@host`): the
/// spelling docs/cli.md gives for the user `fencelock acl` creates was refused by the server.
#[test]
fn a_user_in_the_url_with_the_password_elsewhere_is_the_user() {
    let server = RedisServer::start().unwrap();
    apply_redis(&server, &acl_lines(&server.url(), "svc:", "svc"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pw");
    std::fs::write(&file, format!("{PASSWORD}\n")).unwrap();
    let bare = format!("redis://svc@127.0.0.1:{}", server.port());
    let run = |url: &str, env: &[(&str, &str)]| {
        let mut cmd = fencelock_at(url, &["run", "--prefix", "svc:", "job", "--", "true"]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.run(FINISH).unwrap();
        assert!(out.status.success(), "{url} {env:?}: {}", out.stderr);
    };
    run(&format!("{bare}?password_file={}", file.display()), &[]);
    run(
        &bare,
        &[("FENCELOCK_PASSWORD_FILE", &file.display().to_string())],
    );
    run(&bare, &[("FENCELOCK_PASSWORD", PASSWORD)]);
    // Redis' password-only spelling still works when nothing else gives a password.
    admin(&server, &["CONFIG", "SET", "requirepass", "only-pw"]);
    run(&format!("redis://only-pw@127.0.0.1:{}", server.port()), &[]);
}

/// `fencelock doctor` as the least-privilege user `fencelock acl` prints reported every node
/// unreachable (INFO is denied to that user) and exited 69.
#[test]
fn doctor_works_as_the_least_privilege_user() {
    let servers: Vec<RedisServer> = (0..3).map(|_| RedisServer::start().unwrap()).collect();
    for s in &servers {
        apply_redis(s, &acl_lines(&s.url(), "svc:", "svc"));
    }
    let one = fencelock(&[
        "doctor",
        "--prefix",
        "svc:",
        "--backend",
        &url_as(&servers[0], "svc"),
    ])
    .run(FINISH)
    .unwrap();
    assert!(one.status.success(), "{}{}", one.stdout, one.stderr);
    assert!(
        one.stdout.contains("reachable, Redis version unknown"),
        "{}",
        one.stdout
    );
    assert!(!one.stdout.contains("unreachable"), "{}", one.stdout);
    let nodes: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    let quorum = format!("redlock://svc:{PASSWORD}@{}", nodes.join(","));
    let q = fencelock(&["doctor", "--prefix", "svc:", "--backend", &quorum])
        .run(FINISH)
        .unwrap();
    assert!(q.status.success(), "{}{}", q.stdout, q.stderr);
    assert!(q.stdout.contains("was not checked"), "{}", q.stdout);
    assert!(!q.stdout.contains(PASSWORD));
}

/// The etcd client pinged every second, under etcd's 5 s minimum (`--grpc-keepalive-min-time`):
/// a server serving gRPC itself (plain HTTP; over TLS etcd 3.4 serves it through Go's HTTP/2
/// server, which does not police pings) answered GOAWAY `too_many_pings` while a lease was
/// held, and calls in flight then, releases among them, failed with broken pipes.
#[test]
fn an_etcd_client_holding_a_lock_a_while_is_not_sent_away_for_its_pings() {
    let dir = tempfile::tempdir().unwrap();
    let (cluster, as_user) = etcd_with_auth(dir.path(), false);
    let url = as_user("svc");
    for name in ["a", "b"] {
        let out = fencelock_at(
            &url,
            &[
                "run", "--prefix", "/svc/", "--ttl", "30s", name, "--", "sleep", "12",
            ],
        )
        // The HTTP/2 layer says when the server sends the connection away.
        .env("FENCELOCK_LOG", "h2=debug")
        .run(FINISH)
        .unwrap();
        assert!(out.status.success(), "{}", out.stderr);
        assert!(!out.stderr.contains("warning"), "{}", out.stderr);
        assert!(
            !out.stderr.contains("too_many_pings"),
            "the server sent the client away for its pings: {}",
            out.stderr
                .lines()
                .filter(|l| l.contains("GoAway"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let log = cluster.log(0);
    assert!(
        !log.contains("too_many_pings") && !log.contains("too many pings"),
        "{log}"
    );
}
