//! The routing configuration on the command line: where it is found and what wins over it,
//! the errors of a bad one (exit 64, naming the field), `fencelock key` naming the backend,
//! and `run`, `inspect`, `list`, `release --force` and `doctor` against two Redis servers (one
//! with a password read from a file) and a SQLite default.
#![allow(clippy::unwrap_used)]

mod common;

use common::{poll_until, BinCommand, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock_testkit::RedisServer;

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
