//! The routing configuration on the command line: where it is found and what wins over it,
//! the errors of a bad one (exit 64, naming the field), `fencelock key` naming the backend,
//! and `run`, `inspect`, `list`, `release --force` and `doctor` against two Redis servers (one
//! with a password read from a file) and a SQLite default. With one backend stopped or killed,
//! `run` on other names, `list`, `audit` and the sidecar (started with it down, or losing it
//! while running) serve the other backends and name the failed one.
#![allow(clippy::unwrap_used)]

mod common;
mod sidecar;

use std::time::{Duration, Instant};

use common::{poll_until, BinCommand, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock_testkit::RedisServer;
use sidecar::Sidecar;

/// `fencelock SUB --config FILE ARGS...` in the sandbox.
fn with_config(sb: &Sandbox, config: &str, sub: &str, args: &[&str]) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.arg(sub).arg("--config").arg(sb.path(config)).args(args);
    cmd
}

fn ok(sb: &Sandbox, cmd: BinCommand) -> String {
    let out = sb.run(cmd);
    assert_eq!(out.code(), Some(0), "{out:?}");
    out.stdout
}

fn write(sb: &Sandbox, file: &str, text: &str) {
    std::fs::write(sb.path(file), text).unwrap();
}

/// Whether `key` exists on `server` (`auth`: its password, if it has one).
fn exists(server: &RedisServer, auth: Option<&str>, key: &str) -> bool {
    let mut args = Vec::new();
    if let Some(p) = auth {
        args.extend(["-a", p, "--no-auth-warning"]);
    }
    args.extend(["EXISTS", key]);
    let out = server.cli(&args).unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "1"
}

#[test]
fn a_bad_configuration_exits_64_naming_the_field() {
    let sb = Sandbox::new();
    let good = "[backends]\na = \"redis://127.0.0.1:1\"\n";
    for (text, needle) in [
        (
            "[backends]\na = \"redis://127.0.0.1:1\"\n[[route]]\nprefix = \"p/\"\nbackend = \"b\"\n\
             [default]\nbackend = \"a\"\n",
            "route #1 (prefix \"p/\"): backend \"b\" is not in [backends] (known: a)",
        ),
        (
            "[backends]\na = \"redis://127.0.0.1:1\"\n[[route]]\nprefix = \"p/\"\nbackend = \"a\"\n\
             [[route]]\nprefix = \"p/\"\nbackend = \"a\"\n",
            "route #2 (prefix \"p/\"): duplicate prefix",
        ),
        (
            "[backends]\na = \"redis://127.0.0.1:0\"\n[default]\nbackend = \"a\"\n",
            "backends.a = \"redis://127.0.0.1:0\"",
        ),
        (
            "[backends]\na = \"ftp://x\"\n[default]\nbackend = \"a\"\n",
            "unknown backend scheme \"ftp\"",
        ),
        (
            "[backends]\na = \"redis://127.0.0.1:1\"\n[default]\nbackend = \"c\"\n",
            "[default] backend \"c\" is not in [backends]",
        ),
        (good, "neither [[route]] nor [default] names a backend"),
        (
            "[backends]\na = \"redis://127.0.0.1:1\"\n[[routes]]\nprefix = \"p/\"\n",
            "unknown field `routes`",
        ),
        ("[backends]\na = \"redis://127.0.0.1:1\n", "line 2"),
        (
            "[backends]\na = \"redis://127.0.0.1:1?password_file=/nonexistent/pw\"\n\
             [default]\nbackend = \"a\"\n",
            "cannot read the password file",
        ),
    ] {
        write(&sb, "bad.toml", text);
        let out = sb.run(with_config(&sb, "bad.toml", "key", &["p/1"]));
        assert_eq!(out.code(), Some(64), "{text}\n{out:?}");
        assert!(out.stderr.contains("bad.toml"), "{text}\n{}", out.stderr);
        assert!(out.stderr.contains(needle), "{text}\n{}", out.stderr);
    }
    // A name no route matches, without a default.
    write(
        &sb,
        "partial.toml",
        "[backends]\na = \"redis://127.0.0.1:1\"\n[[route]]\nprefix = \"p/\"\nbackend = \"a\"\n",
    );
    let out = sb.run(with_config(&sb, "partial.toml", "key", &["q/1"]));
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(
        out.stderr.contains("no route matches \"q/1\""),
        "{}",
        out.stderr
    );
    let out = sb.run(with_config(&sb, "missing.toml", "list", &[]));
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(out.stderr.contains("missing.toml"), "{}", out.stderr);
    // --backend and --config together are refused rather than one silently ignored.
    let mut both = with_config(&sb, "partial.toml", "list", &[]);
    both.arg("--backend").arg(sb.url());
    let out = sb.run(both);
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(out.stderr.contains("cannot be used with"), "{}", out.stderr);
}

#[test]
fn key_names_the_backend_and_the_configuration_is_found_by_precedence() {
    let sb = Sandbox::new();
    std::fs::write(sb.path("pw"), "hunter2\n").unwrap();
    let config = format!(
        "[backends]\npayments = \"redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3?password_file={}\"\n\
         jobs = \"redis://127.0.0.1:4\"\n[[route]]\nprefix = \"payments/\"\nbackend = \"payments\"\n\
         [[route]]\nprefix = \"payments/batch/\"\nbackend = \"jobs\"\n[default]\nbackend = \"jobs\"\n",
        sb.path("pw").display()
    );
    write(&sb, "routes.toml", &config);
    // Answered from the file alone: no backend is up.
    let out = ok(&sb, with_config(&sb, "routes.toml", "key", &["payments/7"]));
    let first = out.lines().next().unwrap();
    assert!(
        first.starts_with("backend\tpayments\tredlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"),
        "{out}"
    );
    assert!(!out.contains("hunter2"), "{out}");
    assert!(
        out.contains("\nlock\tfencelock:v1:lock:payments/7\n"),
        "{out}"
    );
    let out = ok(
        &sb,
        with_config(&sb, "routes.toml", "key", &["payments/batch/1"]),
    );
    assert!(
        out.starts_with("backend\tjobs\tredis://127.0.0.1:4\n"),
        "{out}"
    );
    let out = ok(&sb, with_config(&sb, "routes.toml", "key", &["nightly"]));
    assert!(out.starts_with("backend\tjobs\t"), "{out}");

    // $FENCELOCK_CONFIG, then $XDG_CONFIG_HOME/fencelock/config.toml.
    let mut env = sb.bare();
    env.env("FENCELOCK_CONFIG", sb.path("routes.toml"))
        .args(["key", "payments/7"]);
    assert!(ok(&sb, env).starts_with("backend\tpayments\t"));
    std::fs::create_dir_all(sb.path("xdg/fencelock")).unwrap();
    std::fs::write(sb.path("xdg/fencelock/config.toml"), &config).unwrap();
    let mut xdg = sb.bare();
    xdg.env("XDG_CONFIG_HOME", sb.path("xdg"))
        .args(["key", "payments/7"]);
    assert!(ok(&sb, xdg).starts_with("backend\tpayments\t"));
    // --backend wins over every configuration; $FENCELOCK_URL over the ambient ones but not
    // over --config.
    let mut flag = sb.bare();
    flag.env("FENCELOCK_CONFIG", sb.path("routes.toml")).args([
        "key",
        "--backend",
        "redis://127.0.0.1:9",
        "payments/7",
    ]);
    assert!(!ok(&sb, flag).contains("backend\t"));
    let mut url = sb.bare();
    url.env("FENCELOCK_CONFIG", sb.path("routes.toml"))
        .env("XDG_CONFIG_HOME", sb.path("xdg"))
        .env("FENCELOCK_URL", "redis://127.0.0.1:9")
        .args(["key", "payments/7"]);
    assert!(!ok(&sb, url).contains("backend\t"));
    let mut url = with_config(&sb, "routes.toml", "key", &["payments/7"]);
    url.env("FENCELOCK_URL", "redis://127.0.0.1:9");
    assert!(ok(&sb, url).starts_with("backend\tpayments\t"));
}

#[test]
fn commands_with_a_configuration_reach_each_name_s_backend() {
    let sb = Sandbox::new();
    let payments = RedisServer::start().unwrap();
    let jobs = RedisServer::start().unwrap();
    let set = jobs
        .cli(&["CONFIG", "SET", "requirepass", "hunter2"])
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&set.stdout).trim(), "OK");
    std::fs::write(sb.path("pw"), "hunter2\n").unwrap();
    write(
        &sb,
        "routes.toml",
        &format!(
            "[backends]\npayments = \"{}\"\njobs = \"{}?password_file={}\"\nlocal = \"{}\"\n\
             [[route]]\nprefix = \"payments/\"\nbackend = \"payments\"\n\
             [[route]]\nprefix = \"jobs/\"\nbackend = \"jobs\"\n[default]\nbackend = \"local\"\n",
            payments.url(),
            jobs.url(),
            sb.path("pw").display(),
            sb.url()
        ),
    );
    let key = |name: &str| format!("fencelock:v1:lock:{name}");
    let script = format!("echo $FENCELOCK_TOKEN > $0.started; {WAIT_FOR_RELEASE}");
    let mut holders = Vec::new();
    for name in ["payments/inv", "jobs/nightly", "misc"] {
        let mut cmd = with_config(&sb, "routes.toml", "run", &["--ttl", "1s", name]);
        cmd.args(["--", "sh", "-c", &script, name.replace('/', "-").as_str()]);
        holders.push(sb.spawn(cmd));
    }
    for file in ["payments-inv", "jobs-nightly", "misc"] {
        let path = sb.path(&format!("{file}.started"));
        assert!(
            poll_until(FINISH, || std::fs::read_to_string(&path)
                .is_ok_and(|s| s.ends_with('\n'))),
            "{file} did not start"
        );
    }
    assert!(exists(&payments, None, &key("payments/inv")));
    assert!(!exists(&payments, None, &key("jobs/nightly")));
    assert!(exists(&jobs, Some("hunter2"), &key("jobs/nightly")));
    assert!(!exists(&jobs, Some("hunter2"), &key("payments/inv")));
    assert!(!exists(&payments, None, &key("misc")));

    let table = ok(&sb, with_config(&sb, "routes.toml", "list", &[]));
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("RESOURCE      BACKEND"), "{table}");
    for (name, backend) in [
        ("jobs/nightly", "jobs"),
        ("misc", "local"),
        ("payments/inv", "payments"),
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(name) && l.split_whitespace().nth(1) == Some(backend)),
            "{name} on {backend}: {table}"
        );
    }
    let json = ok(
        &sb,
        with_config(&sb, "routes.toml", "list", &["--json", "jobs/"]),
    );
    assert!(json.contains("\"backend\":\"jobs\""), "{json}");
    assert!(!json.contains("payments"), "{json}");
    let inspected = ok(
        &sb,
        with_config(&sb, "routes.toml", "inspect", &["--json", "payments/inv"]),
    );
    assert!(
        inspected.contains("\"backend\":\"payments\""),
        "{inspected}"
    );
    let token = std::fs::read_to_string(sb.path("payments-inv.started")).unwrap();
    assert!(
        inspected.contains(&format!("\"token\":{}", token.trim())),
        "{inspected}"
    );

    let doctor = sb.run(with_config(&sb, "routes.toml", "doctor", &[]));
    for backend in [
        "backend jobs: redis",
        "backend local: sqlite",
        "backend payments: redis",
    ] {
        assert!(doctor.stdout.contains(backend), "{doctor:?}");
    }
    assert!(!doctor.stdout.contains("hunter2"), "{doctor:?}");
    assert_eq!(doctor.code(), Some(0), "{doctor:?}");

    std::fs::write(sb.path("release"), "").unwrap();
    for mut h in holders {
        let out = h.wait(FINISH).unwrap();
        assert_eq!(out.code(), Some(0), "{out:?}");
    }
    assert!(!exists(&payments, None, &key("payments/inv")));
    assert!(!exists(&jobs, Some("hunter2"), &key("jobs/nightly")));
    assert_eq!(
        ok(&sb, with_config(&sb, "routes.toml", "list", &[])).trim(),
        "no held locks"
    );
}

/// `routes.toml` in the sandbox: payments on one Redis server, jobs on another, the rest on
/// the sandbox's SQLite file.
fn two_redis_routes(sb: &Sandbox, payments: &RedisServer, jobs: &RedisServer) {
    write(
        sb,
        "routes.toml",
        &format!(
            "[backends]\npayments = \"{}\"\njobs = \"{}\"\nlocal = \"{}\"\n\
             [[route]]\nprefix = \"payments/\"\nbackend = \"payments\"\n\
             [[route]]\nprefix = \"jobs/\"\nbackend = \"jobs\"\n[default]\nbackend = \"local\"\n",
            payments.url(),
            jobs.url(),
            sb.url()
        ),
    );
}

/// `fencelock run --config routes.toml NAME -- true`: its exit and how long it took.
fn run_true(sb: &Sandbox, name: &str) -> (Option<i32>, Duration, String) {
    let started = Instant::now();
    let out = sb.run(with_config(sb, "routes.toml", "run", &[name, "--", "true"]));
    (out.code(), started.elapsed(), out.stderr)
}

/// What broke: with the payments backend stopped, every new process with the routing
/// configuration (`run`, `list`, `audit` on names routed elsewhere) waited and exited 69.
#[test]
fn a_stopped_backend_fails_only_its_own_names_in_run_list_and_audit() {
    let sb = Sandbox::new();
    let mut payments = RedisServer::start().unwrap();
    let jobs = RedisServer::start().unwrap();
    two_redis_routes(&sb, &payments, &jobs);
    // A lock held on jobs, one on the SQLite default, and a forced release audited on jobs.
    let mut holders = Vec::new();
    for name in ["jobs/held", "misc", "jobs/forced"] {
        let script = format!(
            "echo started > {}.started; {WAIT_FOR_RELEASE}",
            name.replace('/', "-")
        );
        let mut cmd = with_config(&sb, "routes.toml", "run", &["--ttl", "30s", name]);
        cmd.args(["--", "sh", "-c", &script]);
        holders.push(sb.spawn(cmd));
    }
    for file in ["jobs-held", "misc", "jobs-forced"] {
        let path = sb.path(&format!("{file}.started"));
        assert!(
            poll_until(FINISH, || std::fs::read_to_string(&path)
                .is_ok_and(|s| s.ends_with('\n'))),
            "{file} did not start"
        );
    }
    ok(
        &sb,
        with_config(
            &sb,
            "routes.toml",
            "release",
            &[
                "--force",
                "--reason",
                "vm deleted",
                "--holder-is-dead",
                "jobs/forced",
            ],
        ),
    );

    // Frozen (the kernel still accepts its connections), then killed.
    payments.pause().unwrap();
    let (code, took, err) = run_true(&sb, "jobs/nightly");
    assert_eq!(code, Some(0), "{err}");
    assert!(took < Duration::from_secs(2), "run on jobs took {took:?}");
    println!("run on jobs with payments frozen: {took:?}");
    payments.resume().unwrap();
    payments.kill();
    for name in ["jobs/nightly", "other"] {
        let (code, took, err) = run_true(&sb, name);
        assert_eq!(code, Some(0), "{name}: {err}");
        assert!(took < Duration::from_secs(2), "run {name} took {took:?}");
        println!("run {name} with payments killed: {took:?}");
    }
    let (code, _, err) = run_true(&sb, "payments/7");
    assert_eq!(code, Some(69), "{err}");
    assert!(err.contains("backend payments"), "{err}");

    // list and audit print what the healthy backends hold, name payments on stderr, exit 80.
    let out = sb.run(with_config(&sb, "routes.toml", "list", &[]));
    assert_eq!(out.code(), Some(80), "{out:?}");
    let rows: Vec<(&str, &str)> = out
        .stdout
        .lines()
        .skip(1)
        .map(|l| {
            let mut cells = l.split_whitespace();
            (cells.next().unwrap(), cells.next().unwrap())
        })
        .collect();
    assert_eq!(rows, [("jobs/held", "jobs"), ("misc", "local")], "{out:?}");
    assert!(
        out.stderr.contains("backend payments (redis)"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("partial answer: the locks of backend(s) payments are not shown"),
        "{}",
        out.stderr
    );
    let out = sb.run(with_config(&sb, "routes.toml", "list", &["--json"]));
    assert_eq!(out.code(), Some(80), "{out:?}");
    assert!(out.stdout.contains("\"resource\":\"jobs/held\""), "{out:?}");
    // A prefix routed elsewhere does not ask payments at all.
    let out = ok(&sb, with_config(&sb, "routes.toml", "list", &["jobs/"]));
    assert!(out.contains("jobs/held"), "{out}");
    let out = sb.run(with_config(&sb, "routes.toml", "audit", &[]));
    assert_eq!(out.code(), Some(80), "{out:?}");
    assert!(out.stdout.contains("jobs/forced: forced by"), "{out:?}");
    assert!(out.stdout.contains("vm deleted"), "{out:?}");
    assert!(out.stderr.contains("backend payments"), "{out:?}");
    let out = ok(
        &sb,
        with_config(&sb, "routes.toml", "audit", &["jobs/forced"]),
    );
    assert!(out.contains("vm deleted"), "{out}");
    let out = ok(
        &sb,
        with_config(&sb, "routes.toml", "inspect", &["jobs/held"]),
    );
    assert!(out.starts_with("jobs/held: held by"), "{out}");

    // With no backend answering there is nothing partial about it: exit 69, as on one URL.
    write(
        &sb,
        "down.toml",
        &format!(
            "[backends]\npayments = \"{}\"\n[default]\nbackend = \"payments\"\n",
            payments.url()
        ),
    );
    let out = sb.run(with_config(&sb, "down.toml", "list", &[]));
    assert_eq!(out.code(), Some(69), "{out:?}");
    assert!(out.stderr.contains("backend payments"), "{out:?}");

    std::fs::write(sb.path("release"), "").unwrap();
    for mut h in holders {
        h.wait(FINISH).unwrap();
    }
}

/// The sidecar's JSON for `GET path`, retried until `ok` holds (the sidecar's client notices a
/// dead backend on its next call) or `limit` passes.
fn get_until(
    sc: &Sidecar,
    path: &str,
    limit: Duration,
    ok: impl Fn(u16, &serde_json::Value) -> bool,
) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + limit;
    loop {
        let (status, body) = sc.get(path);
        if ok(status, &body) || Instant::now() >= deadline {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn resources(list: &serde_json::Value) -> Vec<(String, String)> {
    list["locks"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|l| {
            (
                l["resource"].as_str().unwrap_or("").to_owned(),
                l["backend"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn failed(list: &serde_json::Value) -> Vec<String> {
    list["failed_backends"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|f| f["backend"].as_str().unwrap_or("").to_owned())
        .collect()
}

/// What broke: `fencelock serve` with one backend of its routing configuration down did not
/// start (exit 69), so it served none of the others.
#[test]
fn a_sidecar_started_with_a_backend_down_serves_the_others() {
    let sb = Sandbox::new();
    let mut payments = RedisServer::start().unwrap();
    let jobs = RedisServer::start().unwrap();
    two_redis_routes(&sb, &payments, &jobs);
    payments.kill();
    let config = sb.path("routes.toml");
    let sc = Sidecar::start_with(
        sb.path("").as_path(),
        &["--config", config.to_str().unwrap()],
    );
    let lease = sc.acquire("jobs/nightly", 30_000, 0);
    assert!(lease["token"].as_u64().is_some(), "{lease}");
    let (status, refused) = sc.post(
        "/v1/acquire",
        serde_json::json!({"resource": "payments/7", "ttl_ms": 30000}),
    );
    assert_eq!(status, 503, "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("backend payments"),
        "{refused}"
    );
    let (status, list) = sc.get("/v1/locks");
    assert_eq!(status, 200, "{list}");
    assert_eq!(
        resources(&list),
        [("jobs/nightly".to_owned(), "jobs".to_owned())],
        "{list}"
    );
    assert_eq!(failed(&list), ["payments"], "{list}");
    let (status, log) = sc.get("/v1/audit");
    assert_eq!(status, 200, "{log}");
    assert_eq!(log["records"], serde_json::json!([]), "{log}");
    assert_eq!(failed(&log), ["payments"], "{log}");
    // The payments backend is opened on its first use once it is back.
    payments.restart().unwrap();
    let paid = sc.acquire("payments/7", 30_000, 0);
    assert!(paid["token"].as_u64().is_some(), "{paid}");
    let (status, list) = sc.get("/v1/locks");
    assert_eq!(status, 200, "{list}");
    assert_eq!(resources(&list).len(), 2, "{list}");
    assert!(failed(&list).is_empty(), "{list}");
}

/// What broke: a running sidecar answered `/v1/locks` and `/v1/audit` with 503 as a whole when
/// one backend died or stopped answering, hiding the locks the healthy backends hold.
#[test]
fn a_running_sidecar_lists_the_healthy_backends_after_one_dies() {
    let sb = Sandbox::new();
    let mut payments = RedisServer::start().unwrap();
    let jobs = RedisServer::start().unwrap();
    two_redis_routes(&sb, &payments, &jobs);
    let config = sb.path("routes.toml");
    let sc = Sidecar::start_with(
        sb.path("").as_path(),
        &[
            "--config",
            config.to_str().unwrap(),
            "--request-timeout",
            "2s",
        ],
    );
    sc.acquire("payments/7", 30_000, 0);
    sc.acquire("jobs/nightly", 30_000, 0);
    let (status, list) = sc.get("/v1/locks");
    assert_eq!(status, 200, "{list}");
    for name in ["\"payments/7\"", "\"jobs/nightly\""] {
        assert!(list.to_string().contains(name), "{list}");
    }

    // Frozen: the listing gives up on payments before the request's deadline.
    payments.pause().unwrap();
    let started = Instant::now();
    let (status, list) = sc.get("/v1/locks");
    let took = started.elapsed();
    assert_eq!(status, 200, "{list}");
    assert!(took < Duration::from_secs(2), "took {took:?}");
    println!("/v1/locks with payments frozen: {took:?}");
    assert_eq!(
        resources(&list),
        [("jobs/nightly".to_owned(), "jobs".to_owned())],
        "{list}"
    );
    assert_eq!(failed(&list), ["payments"], "{list}");
    let why = list["failed_backends"][0]["message"].as_str().unwrap();
    assert!(why.contains("no answer within 1.5s"), "{why}");
    payments.resume().unwrap();
    assert_eq!(resources(&sc.get("/v1/locks").1).len(), 2);

    // Killed.
    payments.kill();
    let (status, list) = get_until(&sc, "/v1/locks", Duration::from_secs(10), |s, l| {
        s == 200 && failed(l) == ["payments"]
    });
    assert_eq!(status, 200, "{list}");
    assert_eq!(failed(&list), ["payments"], "{list}");
    assert_eq!(
        resources(&list),
        [("jobs/nightly".to_owned(), "jobs".to_owned())],
        "{list}"
    );
    let (status, log) = sc.get("/v1/audit");
    assert_eq!(status, 200, "{log}");
    assert_eq!(failed(&log), ["payments"], "{log}");
}
