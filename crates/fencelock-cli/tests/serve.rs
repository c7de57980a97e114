//! `fencelock serve` as a real process, through HTTP, against SQLite and a real Redis server:
//! blocking acquire, mutual exclusion and token order under many applications, leases that
//! end with their application, forced release and the fence, Dapr's API, auth, TLS, the
//! OpenAPI document and the shutdown.
#![allow(clippy::unwrap_used)]

mod sidecar;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fencelock_testkit::{wait_until, RedisServer};
use nix::sys::signal::{kill, Signal};
use serde_json::{json, Value};
use sidecar::{fencelock_in, next_event, sqlite_url, tempdir, Sidecar};

/// The two races, on one backend: a blocked waiter gets the lock at release with a larger
/// token; 16 applications never overlap and their tokens increase in grant order.
fn races(url: &str, extra: &[&str]) {
    let dir = tempdir();
    let sc = Arc::new(Sidecar::start(dir.path(), url, extra));

    // Two applications race for one lock: one wins, the other blocks until it is released.
    let first = sc.acquire("race", 5000, 0);
    let (status, refused) = sc.post("/v1/acquire", json!({"resource": "race", "ttl_ms": 5000}));
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"], "held");
    assert_eq!(
        refused["holder"]["token"], first["token"],
        "the refusal names the holder: {refused}"
    );
    let waiter = {
        let sc = sc.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            (sc.acquire("race", 5000, 20_000), started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let released_at = Instant::now();
    assert_eq!(sc.release(&first).0, 200);
    let (second, waited) = waiter.join().unwrap();
    assert!(
        waited >= Duration::from_millis(300),
        "the waiter blocked: {waited:?}"
    );
    assert!(
        released_at.elapsed() < Duration::from_secs(2),
        "woken at release, not by polling late"
    );
    assert!(
        second["token"].as_u64() > first["token"].as_u64(),
        "{first} then {second}"
    );
    sc.release(&second);

    // A wait that runs out is told apart from a refusal, and names the holder too.
    let holder = sc.acquire("race", 5000, 0);
    let (status, out) = sc.post("/v1/acquire", json!({"resource": "race", "wait_ms": 200}));
    assert_eq!(
        (status, out["error"].as_str()),
        (409, Some("timed_out")),
        "{out}"
    );
    assert_eq!(out["holder"]["owner"], holder["owner"]);
    sc.release(&holder);

    // 16 applications at once, each holding briefly: no two holds overlap, and the tokens
    // increase in the order the grants were made.
    let holds = Arc::new(Mutex::new(Vec::new()));
    let apps: Vec<_> = (0..16)
        .map(|_| {
            let (sc, holds) = (sc.clone(), holds.clone());
            std::thread::spawn(move || {
                let lease = sc.acquire("sixteen", 5000, 30_000);
                let granted = Instant::now();
                std::thread::sleep(Duration::from_millis(15));
                let released = Instant::now();
                assert_eq!(sc.release(&lease).0, 200);
                holds
                    .lock()
                    .unwrap()
                    .push((granted, released, lease["token"].as_u64().unwrap()));
            })
        })
        .collect();
    for app in apps {
        app.join().unwrap();
    }
    let mut holds = holds.lock().unwrap().clone();
    holds.sort_by_key(|h| h.0);
    assert_eq!(holds.len(), 16);
    for pair in holds.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "two holds overlap: {pair:?}");
        assert!(pair[0].2 < pair[1].2, "tokens not in grant order: {pair:?}");
    }

    // The fence the sidecar was given (memory, or the Redis one) refuses a lower token.
    let highest = holds[15].2;
    let (status, ok) = sc.post(
        "/v1/fence",
        json!({"resource": "sixteen", "token": highest}),
    );
    assert_eq!(status, 200, "{ok}");
    let (status, stale) = sc.post(
        "/v1/fence",
        json!({"resource": "sixteen", "token": holds[0].2}),
    );
    assert_eq!(
        (status, stale["highest"].as_u64()),
        (409, Some(highest)),
        "{stale}"
    );
    let fence = if extra.is_empty() { "memory" } else { "redis" };
    assert_eq!(stale["fence"], fence);
}

#[test]
fn applications_race_and_wait_on_sqlite() {
    races(&sqlite_url(tempdir().path()), &[]);
}

#[test]
fn applications_race_and_wait_on_redis() {
    let redis = RedisServer::start().unwrap();
    races(&redis.url(), &["--fence", &redis.url()]);
}

/// How long after the application's death the lock may stay held: one TTL, plus what it
/// takes the test to notice (its polling and a loaded machine's scheduling).
const NOTICE: Duration = Duration::from_millis(400);

#[test]
fn a_killed_application_loses_its_lock_within_one_ttl() {
    let redis = RedisServer::start().unwrap();
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &redis.url(), &[]);
    let ttl = Duration::from_millis(1500);

    // The application is a real process: the Python example, with its keep-alives and its
    // event stream.
    let app = sidecar::python_app(dir.path(), &sc, "crash", 100_000, 1500, "crash");
    assert!(
        wait_until(Duration::from_secs(20), || app
            .stdout()
            .contains("write 1 accepted")),
        "{}",
        app.stderr()
    );
    let token = sidecar::granted_token(&app).unwrap();
    // Its keep-alives keep the lease past its TTL.
    std::thread::sleep(ttl + Duration::from_millis(300));
    assert!(sc.held("crash"), "held while the application lives");
    let lock = sc.get("/v1/lock?name=crash").1;
    assert!(lock["sidecar"]["renewals"].as_u64() > Some(0), "{lock}");

    kill(app.pid(), Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    assert!(
        wait_until(ttl + NOTICE, || !sc.held("crash")),
        "still held {:?} after the kill",
        killed.elapsed()
    );
    let next = sc.acquire("crash", 1500, 0);
    assert!(next["token"].as_u64().unwrap() > token);
    drop(app);

    // An application that sends keep-alives keeps its lease past the TTL, and loses it
    // within one TTL of its last one.
    sc.release(&next);
    let lease = sc.acquire("quiet", 1000, 0);
    let path = format!(
        "/v1/leases/{}/keepalive",
        lease["lease_id"].as_str().unwrap()
    );
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(300));
        let (status, body) = sc.post(&path, Value::Null);
        assert_eq!(status, 200, "{body}");
    }
    assert!(sc.held("quiet"), "held past its TTL through keep-alives");
    let last = Instant::now();
    assert!(
        wait_until(Duration::from_millis(1000) + NOTICE, || !sc.held("quiet")),
        "held {:?} after the last keep-alive",
        last.elapsed()
    );
    assert!(
        last.elapsed() >= Duration::from_millis(900),
        "released before the TTL ran out"
    );
    let (status, body) = sc.post(&path, Value::Null);
    assert_eq!(status, 404, "a keep-alive for an ended lease: {body}");
    sc.acquire("quiet", 1000, 0);
}

/// An open event stream kept a SIGSTOPped application's lease alive for ever: the kernel
/// keeps a stopped process's connection open, so only keep-alives count as signs of life.
#[test]
fn a_stopped_application_with_an_open_stream_loses_its_lease_within_one_ttl() {
    let redis = RedisServer::start().unwrap();
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &redis.url(), &[]);
    let ttl = Duration::from_millis(1000);
    let app = sidecar::python_app(dir.path(), &sc, "frozen", 100_000, 1000, "frozen");
    assert!(
        wait_until(Duration::from_secs(20), || app
            .stdout()
            .contains("write 3 accepted")),
        "{}",
        app.stderr()
    );
    let lock = sc.get("/v1/lock?name=frozen").1;
    assert_eq!(lock["sidecar"]["streams"], 1, "the stream is open: {lock}");

    kill(app.pid(), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let (status, next) = sc.post(
        "/v1/acquire",
        json!({"resource": "frozen", "ttl_ms": 1000, "wait_ms": 10_000}),
    );
    let waited = stopped.elapsed();
    kill(app.pid(), Signal::SIGKILL).unwrap();
    assert_eq!(status, 200, "{next}");
    assert!(
        waited <= ttl + NOTICE,
        "the stopped application kept its lease {waited:?} (TTL {ttl:?})"
    );
}

#[test]
fn a_forced_release_ends_the_stream_at_once_and_the_fence_refuses_the_old_token() {
    let dir = tempdir();
    let url = sqlite_url(dir.path());
    let sc = Sidecar::start(dir.path(), &url, &[]);
    let old = sc.acquire("ledger", 2000, 0);
    let _alive = sc.keep_alive(&old);
    let events = sc.events(&old);
    next_event(&events, "granted", Duration::from_secs(5));
    let t_old = old["token"].as_u64().unwrap();
    let (status, ok) = sc.post("/v1/fence", json!({"resource": "ledger", "token": t_old}));
    assert_eq!((status, &ok["accepted"]), (200, &json!(true)), "{ok}");

    // The holder is the sidecar's process, alive: refused without the confirmation.
    let (status, refused) = sc.post(
        "/v1/force-release",
        json!({"resource": "ledger", "reason": "stuck"}),
    );
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"], "holder_alive");
    assert!(sc.held("ledger"));
    let (status, bad) = sc.post(
        "/v1/force-release",
        json!({"resource": "ledger", "reason": " "}),
    );
    assert_eq!(
        (status, bad["field"].as_str()),
        (400, Some("reason")),
        "{bad}"
    );

    let forced = Instant::now();
    let (status, done) = sc.post(
        "/v1/force-release",
        json!({"resource": "ledger", "reason": "worker VM deleted", "holder_is_dead": true}),
    );
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["record"]["holder"]["token"], old["token"]);
    let lost = next_event(&events, "lost", Duration::from_millis(500));
    assert!(
        forced.elapsed() < Duration::from_millis(500),
        "reported at once"
    );
    assert_eq!(lost["reason"], "force_released", "{lost}");
    assert!(
        events.recv_timeout(Duration::from_secs(2)).is_err(),
        "the stream closes after lost"
    );

    // The next holder writes; the old holder's later write is refused with both tokens.
    let new = sc.acquire("ledger", 2000, 0);
    let t_new = new["token"].as_u64().unwrap();
    assert!(t_new > t_old);
    assert_eq!(
        sc.post("/v1/fence", json!({"resource": "ledger", "token": t_new}))
            .0,
        200
    );
    let (status, stale) = sc.post("/v1/fence", json!({"resource": "ledger", "token": t_old}));
    assert_eq!(status, 409, "{stale}");
    assert_eq!(
        stale,
        json!({"accepted": false, "resource": "ledger", "token": t_old, "highest": t_new, "fence": "memory"})
    );
    let (_, audit) = sc.get("/v1/audit?name=ledger");
    assert_eq!(
        audit["records"][0]["reason"], "worker VM deleted",
        "{audit}"
    );
    assert_eq!(audit["failed_backends"], json!([]), "{audit}");

    // A forced release from the command line reaches the stream at the next renewal.
    let _alive = sc.keep_alive(&new);
    let events = sc.events(&new);
    next_event(&events, "granted", Duration::from_secs(5));
    let out = fencelock_in(
        dir.path(),
        "force",
        &[
            "release",
            "--backend",
            &url,
            "--force",
            "--reason",
            "cli",
            "--holder-is-dead",
            "ledger",
        ],
    )
    .spawn()
    .unwrap()
    .wait(Duration::from_secs(20))
    .unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    let lost = next_event(&events, "lost", Duration::from_millis(2000));
    assert_eq!(lost["reason"], "not_holder", "{lost}");
}

#[test]
fn dapr_bodies_work_unchanged_and_carry_the_token() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let (status, got) = sc.post(
        "/v1.0-alpha1/lock/lockstore",
        json!({"resourceId": "lock1", "lockOwner": "vader", "expiryInSeconds": 60}),
    );
    assert_eq!(status, 200);
    assert_eq!(got["success"], true, "{got}");
    let token = got["fencingToken"].as_u64().unwrap();
    assert_eq!(got, json!({"success": true, "fencingToken": token}));
    let (_, again) = sc.post(
        "/v1.0-alpha1/lock/lockstore",
        json!({"resourceId": "lock1", "lockOwner": "luke", "expiryInSeconds": 60}),
    );
    assert_eq!(again, json!({"success": false}));
    let unlock = |owner: &str, resource: &str| {
        sc.post(
            "/v1.0-alpha1/unlock/lockstore",
            json!({"resourceId": resource, "lockOwner": owner}),
        )
    };
    assert_eq!(
        unlock("luke", "lock1"),
        (200, json!({"status": 2})),
        "another owner's lock"
    );
    assert_eq!(unlock("vader", "lock1"), (200, json!({"status": 0})));
    assert_eq!(
        unlock("vader", "lock1"),
        (200, json!({"status": 1})),
        "already released"
    );
    assert_eq!(unlock("vader", "never-locked"), (200, json!({"status": 1})));
    let (_, relock) = sc.post(
        "/v1.0-alpha1/lock/lockstore",
        json!({"resourceId": "lock1", "lockOwner": "luke", "expiryInSeconds": 1}),
    );
    assert!(relock["fencingToken"].as_u64().unwrap() > token, "{relock}");
    // Held for expiryInSeconds, not renewed.
    assert!(wait_until(Duration::from_millis(1500), || !sc.held("lock1")));
    let (status, bad) = sc.post(
        "/v1.0-alpha1/lock/lockstore",
        json!({"resourceId": "x", "lockOwner": "v"}),
    );
    assert_eq!(status, 400);
    assert_eq!(bad["errorCode"], "ERR_MALFORMED_REQUEST", "{bad}");
}

#[test]
fn bad_input_is_refused_naming_the_field() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    for (body, field) in [
        (json!({"resource": "", "ttl_ms": 1000}), "resource"),
        (json!({"resource": "a\nb"}), "resource"),
        (json!({"resource": "a", "ttl_ms": 5}), "ttl_ms"),
        (json!({"resource": "a", "ttl_ms": "soon"}), "ttl_ms"),
        (json!({"resource": "a", "wait_ms": -1}), "wait_ms"),
        (json!({"ttl_ms": 1000}), "resource"),
        (json!({"resource": "a", "colour": "red"}), "colour"),
        (json!({"resource": "a", "fair": true}), "fair"),
    ] {
        let (status, err) = sc.post("/v1/acquire", body.clone());
        assert_eq!(status, 400, "{body} -> {err}");
        assert_eq!(err["error"], "invalid_input");
        assert!(
            err["field"].as_str().unwrap_or("").contains(field),
            "{body} -> {err}"
        );
    }
    let (status, err) = sc.call_as(None, "POST", "/v1/acquire", None);
    assert_eq!(
        (status, err["field"].as_str()),
        (400, Some("body")),
        "{err}"
    );
    let huge = json!({"resource": "a", "client": "x".repeat(100_000)});
    let (status, err) = sc.post("/v1/acquire", huge);
    assert_eq!(
        (status, err["error"].as_str()),
        (413, Some("too_large")),
        "{err}"
    );
    let (status, err) = sc.get("/v1/lock");
    assert_eq!(
        (status, err["field"].as_str()),
        (400, Some("query")),
        "{err}"
    );
    assert_eq!(sc.get("/v1/leases/nope").0, 404);
    assert_eq!(sc.get("/no/such/route").0, 404);
}

#[test]
fn tokens_map_to_prefixes_and_the_file_is_reread_on_sighup() {
    let dir = tempdir();
    let auth = dir.path().join("auth");
    let billing = "billing-token-0123456789abcdef";
    let ops = "ops-token-0123456789abcdef0123";
    std::fs::write(
        &auth,
        format!("# token client prefixes\n{billing} billing billing/\n{ops} ops *\n"),
    )
    .unwrap();
    let sc = Sidecar::start(
        dir.path(),
        &sqlite_url(dir.path()),
        &["--auth-file", auth.to_str().unwrap()],
    );
    let acquire = |token: Option<&str>, name: &str| {
        sc.call_as(
            token,
            "POST",
            "/v1/acquire",
            Some(json!({"resource": name})),
        )
    };
    assert_eq!(acquire(None, "billing/run").0, 401);
    assert_eq!(
        acquire(Some("billing-token-0123456789abcdeX"), "billing/run").0,
        401
    );
    let (status, err) = acquire(Some(billing), "jobs/run");
    assert_eq!(
        (status, err["error"].as_str()),
        (403, Some("forbidden")),
        "{err}"
    );
    let (status, lease) = acquire(Some(billing), "billing/run");
    assert_eq!(status, 200, "{lease}");
    assert_eq!(
        lease["client"], "billing",
        "the token's client name is recorded"
    );
    let (_, lock) = sc.call_as(Some(billing), "GET", "/v1/lock?name=billing/run", None);
    assert_eq!(
        lock["holder"]["client"], "billing",
        "and the engine has it: {lock}"
    );
    assert_eq!(acquire(Some(ops), "jobs/run").0, 200);
    let (_, seen) = sc.call_as(Some(billing), "GET", "/v1/locks", None);
    let names: Vec<&str> = seen["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["resource"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["billing/run"], "a client sees only its prefixes");
    // Another client's lease id is not found, whatever it is.
    let path = format!("/v1/leases/{}/release", lease["lease_id"].as_str().unwrap());
    assert_eq!(sc.call_as(Some(ops), "POST", &path, None).0, 404);
    assert_eq!(sc.get("/healthz").0, 200, "health needs no token");

    let rotated = "billing-token-rotated-0123456789";
    std::fs::write(
        &auth,
        format!("{rotated} billing billing/ invoices/\n{ops} ops *\n"),
    )
    .unwrap();
    kill(sc.proc.pid(), Signal::SIGHUP).unwrap();
    assert!(wait_until(Duration::from_secs(5), || sc
        .proc
        .stderr()
        .contains("re-read")));
    assert_eq!(
        acquire(Some(billing), "billing/other").0,
        401,
        "the old token is gone"
    );
    assert_eq!(acquire(Some(rotated), "invoices/x").0, 200);
    // A file that no longer parses leaves the previous one in force.
    std::fs::write(&auth, "broken\n").unwrap();
    kill(sc.proc.pid(), Signal::SIGHUP).unwrap();
    assert!(wait_until(Duration::from_secs(5), || sc
        .proc
        .stderr()
        .contains("keeping the previous")));
    assert_eq!(acquire(Some(rotated), "invoices/y").0, 200);
}

/// A token revoked by re-reading the auth file on SIGHUP left its open streams running and
/// its leases renewed.
#[test]
fn revoking_a_token_on_sighup_ends_its_leases_and_their_streams() {
    let dir = tempdir();
    let auth = dir.path().join("auth");
    let billing = "billing-token-0123456789abcdef";
    let ops = "ops-token-0123456789abcdef0123";
    std::fs::write(&auth, format!("{billing} billing billing/\n{ops} ops *\n")).unwrap();
    let sc = Sidecar::start(
        dir.path(),
        &sqlite_url(dir.path()),
        &["--auth-file", auth.to_str().unwrap()],
    );
    let acquire = |token: &str, name: &str, wait_ms: u64| {
        sc.call_as(
            Some(token),
            "POST",
            "/v1/acquire",
            Some(json!({"resource": name, "ttl_ms": 10_000, "wait_ms": wait_ms})),
        )
    };
    let held = |token: &str, name: &str| {
        let (status, lease) = acquire(token, name, 0);
        assert_eq!(status, 200, "{name}: {lease}");
        let alive = sc.keep_alive_as(Some(token), &lease);
        let events = sc.events_as(Some(token), &lease);
        next_event(&events, "granted", Duration::from_secs(5));
        (lease, alive, events)
    };
    // billing's token goes; ops keeps its token but loses every prefix but `jobs/`.
    let (_, _a, revoked) = held(billing, "billing/a");
    let (_, _b, narrowed) = held(ops, "other/b");
    let (kept, _c, untouched) = held(ops, "jobs/c");
    std::fs::write(&auth, format!("{ops} ops jobs/\n")).unwrap();
    kill(sc.proc.pid(), Signal::SIGHUP).unwrap();

    for (name, events) in [("billing/a", &revoked), ("other/b", &narrowed)] {
        let lost = next_event(events, "lost", Duration::from_secs(2));
        assert_eq!(lost["reason"], "revoked", "{name}: {lost}");
    }
    // Told (their streams closed after `lost`): released, so another client gets them now.
    let admin = "admin-token-0123456789abcdef01";
    std::fs::write(&auth, format!("{ops} ops jobs/\n{admin} admin *\n")).unwrap();
    kill(sc.proc.pid(), Signal::SIGHUP).unwrap();
    assert!(wait_until(Duration::from_secs(5), || sc
        .proc
        .stderr()
        .matches("re-read")
        .count()
        == 2));
    for name in ["billing/a", "other/b"] {
        let (status, lease) = acquire(admin, name, 0);
        assert_eq!(status, 200, "{name} was not released: {lease}");
    }
    // The lease the new file still allows is untouched.
    assert!(untouched.recv_timeout(Duration::from_millis(300)).is_err());
    let (_, lock) = sc.call_as(Some(ops), "GET", "/v1/lock?name=jobs/c", None);
    assert_eq!(lock["holder"]["token"], kept["token"], "{lock}");
}

#[test]
fn without_an_auth_file_only_loopback_is_served() {
    let dir = tempdir();
    let out = fencelock_in(
        dir.path(),
        "open",
        &[
            "serve",
            "--backend",
            &sqlite_url(dir.path()),
            "--listen",
            "0.0.0.0:0",
        ],
    )
    .spawn()
    .unwrap()
    .wait(Duration::from_secs(20))
    .unwrap();
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(out.stderr.contains("without --auth-file"), "{}", out.stderr);
}

#[test]
fn a_fence_that_is_not_one_is_refused_as_usage() {
    let dir = tempdir();
    let url = sqlite_url(dir.path());
    let args = ["serve", "--backend", &url, "--fence", "mysql://x"];
    let out = fencelock_in(dir.path(), "fence", &args)
        .run(Duration::from_secs(20))
        .unwrap();
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(out.stderr.contains("--fence"), "{}", out.stderr);
}

#[test]
fn https_with_the_given_certificate() {
    let dir = tempdir();
    let tls = fencelock_testkit::TestTls::generate(&dir.path().join("tls")).unwrap();
    let sc = Sidecar::start(
        dir.path(),
        &sqlite_url(dir.path()),
        &[
            "--tls-cert",
            tls.server_cert.to_str().unwrap(),
            "--tls-key",
            tls.server_key.to_str().unwrap(),
        ],
    );
    let https = sc.base.replace("http://", "https://");
    let out = fencelock_testkit::BinCommand::new("curl")
        .args([
            "-sS",
            "--cacert",
            tls.ca.to_str().unwrap(),
            &format!("{https}/healthz"),
        ])
        .run(Duration::from_secs(20))
        .unwrap();
    assert!(out.stdout.contains("\"status\":\"ok\""), "{out:?}");
    // A broken key file is refused, without a line of it in the message.
    let bad = dir.path().join("bad.key");
    std::fs::write(
        &bad,
        "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1tYXRlcmlhbA%%\n",
    )
    .unwrap();
    let url = sqlite_url(dir.path());
    let cert = tls.server_cert.to_str().unwrap();
    let args = [
        "serve",
        "--backend",
        &url,
        "--tls-cert",
        cert,
        "--tls-key",
        bad.to_str().unwrap(),
    ];
    let out = fencelock_in(dir.path(), "badkey", &args)
        .run(Duration::from_secs(20))
        .unwrap();
    assert_eq!(out.code(), Some(64), "{out:?}");
    assert!(
        out.stderr.contains("--tls-key") && !out.stderr.contains("c2VjcmV0"),
        "{}",
        out.stderr
    );
    // Plain HTTP on the TLS port gets no answer.
    let plain = fencelock_testkit::BinCommand::new("curl")
        .args(["-sS", "-m", "5", &format!("{}/healthz", sc.base)])
        .run(Duration::from_secs(20))
        .unwrap();
    assert!(!plain.stdout.contains("ok"), "{plain:?}");
}

#[test]
fn the_openapi_document_validates_and_lists_every_route() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let (status, doc) = sc.get("/openapi.json");
    assert_eq!(status, 200);
    let parsed = serde_json::from_value::<openapiv3::OpenAPI>(doc.clone());
    assert!(
        parsed.is_ok(),
        "not a valid OpenAPI document: {:?}\n{doc}",
        parsed.err()
    );
    let parsed = parsed.unwrap();
    let mut paths: Vec<(String, Vec<&str>)> = parsed
        .paths
        .iter()
        .map(|(p, item)| {
            let item = item.as_item().unwrap();
            let mut methods = Vec::new();
            if item.get.is_some() {
                methods.push("GET");
            }
            if item.post.is_some() {
                methods.push("POST");
            }
            (p.clone(), methods)
        })
        .collect();
    paths.sort();
    let expected = [
        ("/", "GET"),
        ("/healthz", "GET"),
        ("/metrics", "GET"),
        ("/openapi.json", "GET"),
        ("/v1.0-alpha1/lock/{store}", "POST"),
        ("/v1.0-alpha1/unlock/{store}", "POST"),
        ("/v1/acquire", "POST"),
        ("/v1/audit", "GET"),
        ("/v1/fence", "POST"),
        ("/v1/force-release", "POST"),
        ("/v1/leases/{lease_id}", "GET"),
        ("/v1/leases/{lease_id}/events", "GET"),
        ("/v1/leases/{lease_id}/extend", "POST"),
        ("/v1/leases/{lease_id}/keepalive", "POST"),
        ("/v1/leases/{lease_id}/release", "POST"),
        ("/v1/lock", "GET"),
        ("/v1/locks", "GET"),
    ];
    let expected: Vec<(String, Vec<&str>)> = expected
        .iter()
        .map(|(p, m)| (p.to_string(), vec![*m]))
        .collect();
    assert_eq!(paths, expected);
    let inspect = parsed.paths.paths["/v1/lock"]
        .as_item()
        .unwrap()
        .get
        .as_ref()
        .unwrap();
    let param = inspect.parameters[0].as_item().unwrap();
    assert!(
        matches!(param, openapiv3::Parameter::Query { .. }),
        "{param:?}"
    );
    // Every documented route is served (a route the server lacks answers 404).
    let lease = sc.acquire("doc", 1000, 0);
    let id = lease["lease_id"].as_str().unwrap();
    for (path, methods) in &paths {
        let concrete = path.replace("{lease_id}", id).replace("{store}", "s");
        if concrete.ends_with("/events") || concrete.ends_with("/release") {
            continue;
        }
        let (status, body) = sc.call_as(None, methods[0], &concrete, Some(json!({})));
        assert_ne!(status, 404, "{} {concrete}: {body}", methods[0]);
    }
    // The metrics carry the library's series and the requests by route.
    let text = ureq_text(&sc.url("/metrics"));
    assert!(
        text.contains("fencelock_acquire_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains("fencelock_sidecar_requests_total{route=\"/v1/acquire\""),
        "{text}"
    );
    assert!(
        text.contains("fencelock_sidecar_request_duration_seconds_bucket"),
        "{text}"
    );
}

fn ureq_text(url: &str) -> String {
    sidecar::agent()
        .get(url)
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap()
}

#[test]
fn sigterm_releases_the_leases_whose_application_was_told_and_leaves_the_others() {
    let dir = tempdir();
    let url = sqlite_url(dir.path());
    let mut sc = Sidecar::start(dir.path(), &url, &[]);
    let streamed = sc.acquire("streamed", 30_000, 0);
    let quiet = sc.acquire("quiet", 30_000, 0);
    let events = sc.events(&streamed);
    next_event(&events, "granted", Duration::from_secs(5));
    kill(sc.proc.pid(), Signal::SIGTERM).unwrap();
    let lost = next_event(&events, "lost", Duration::from_secs(5));
    assert_eq!(lost["reason"], "shutdown", "{lost}");
    let out = sc.proc.wait(Duration::from_secs(20)).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stderr.contains("1 leases released") && out.stderr.contains("1 left held"),
        "{}",
        out.stderr
    );
    let inspect = |name: &str| {
        fencelock_in(dir.path(), name, &["inspect", "--backend", &url, name])
            .run(Duration::from_secs(20))
            .unwrap()
    };
    // The streamed application read `lost` and closed its stream: told, so released.
    let out = inspect("streamed");
    assert!(out.stdout.contains("free"), "released at shutdown: {out:?}");
    // The other one could not be told: held on the engine until its TTL ends.
    let out = inspect("quiet");
    assert!(
        out.stdout.contains(&quiet["token"].to_string()),
        "left held: {out:?}"
    );
}

/// SIGTERM released a Dapr lock and a lease kept by keep-alives at once, while their
/// applications, never told, went on working unlocked.
#[test]
fn sigterm_leaves_a_dapr_lock_and_a_keepalive_lease_held_until_their_expiry() {
    let redis = RedisServer::start().unwrap();
    let dir = tempdir();
    let mut sc = Sidecar::start(dir.path(), &redis.url(), &[]);
    let expiry = Duration::from_secs(5);
    let locked = Instant::now();
    let (_, got) = sc.post(
        "/v1.0-alpha1/lock/lockstore",
        json!({"resourceId": "dapr-job", "lockOwner": "vader", "expiryInSeconds": 5}),
    );
    assert_eq!(got["success"], true, "{got}");
    let quiet = sc.acquire("quiet-job", 5000, 0);
    let alive = sc.keep_alive(&quiet);
    std::thread::sleep(Duration::from_millis(300));

    kill(sc.proc.pid(), Signal::SIGTERM).unwrap();
    let stopped = Instant::now();
    let out = sc.proc.wait(Duration::from_secs(20)).unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    drop(alive);

    // Another client, through another sidecar: refused while the leases last.
    let other = Sidecar::start(dir.path(), &redis.url(), &[]);
    for name in ["dapr-job", "quiet-job"] {
        let (status, refused) =
            other.post("/v1/acquire", json!({"resource": name, "ttl_ms": 1000}));
        assert_eq!(status, 409, "{name} was released at shutdown: {refused}");
    }
    // Granted once they have expired: the Dapr lock at its expiry, the other at the end of
    // its last renewal's TTL (at most a third of a TTL before the signal).
    let next = other.acquire("dapr-job", 1000, 10_000);
    let held_for = locked.elapsed();
    assert!(
        held_for >= expiry - Duration::from_millis(100),
        "the Dapr lock was held {held_for:?} of its {expiry:?}"
    );
    assert!(next["token"].as_u64() > got["fencingToken"].as_u64());
    other.acquire("quiet-job", 1000, 10_000);
    let after_signal = stopped.elapsed();
    assert!(
        after_signal >= Duration::from_millis(5000 * 2 / 3 - 100),
        "the keep-alive lease was free {after_signal:?} after the signal"
    );
}

/// Dapr unlock after a restart of the sidecar answered status 2: the new process did not
/// know the lock its predecessor took for the same lockOwner.
#[test]
fn dapr_unlock_by_the_same_lock_owner_works_after_a_restart() {
    let redis = RedisServer::start().unwrap();
    let dir = tempdir();
    let listen = format!("127.0.0.1:{}", fencelock_testkit::free_port());
    let mut sc = Sidecar::start_on(dir.path(), &redis.url(), &listen, &[]);
    let lock = |sc: &Sidecar, resource: &str, owner: &str| {
        sc.post(
            "/v1.0-alpha1/lock/lockstore",
            json!({"resourceId": resource, "lockOwner": owner, "expiryInSeconds": 60}),
        )
        .1
    };
    let unlock = |sc: &Sidecar, owner: &str| {
        sc.post(
            "/v1.0-alpha1/unlock/lockstore",
            json!({"resourceId": "lock1", "lockOwner": owner}),
        )
        .1
    };
    assert_eq!(lock(&sc, "lock1", "vader")["success"], true);
    assert_eq!(lock(&sc, "lock2", "vader")["success"], true);
    kill(sc.proc.pid(), Signal::SIGTERM).unwrap();
    assert_eq!(
        sc.proc.wait(Duration::from_secs(20)).unwrap().code(),
        Some(0)
    );

    let sc = Sidecar::start_on(dir.path(), &redis.url(), &listen, &[]);
    assert_eq!(unlock(&sc, "luke"), json!({"status": 2}), "another owner's");
    assert_eq!(unlock(&sc, "vader"), json!({"status": 0}));
    assert_eq!(
        unlock(&sc, "vader"),
        json!({"status": 1}),
        "already released"
    );
    assert_eq!(
        lock(&sc, "lock1", "luke")["success"],
        true,
        "free for the next"
    );
    assert_eq!(
        lock(&sc, "lock2", "vader"),
        json!({"success": false}),
        "still held for vader, as Dapr's SET NX would say"
    );
}

/// A sidecar on PostgreSQL advisory locks, whose locks end with its sessions, stays up after
/// SIGTERM until the lease it could not hand back has expired, not releasing it by exiting.
#[test]
fn sigterm_on_session_locks_keeps_the_process_up_until_left_leases_expire() {
    let pg = fencelock_testkit::PgServer::start().unwrap();
    let dir = tempdir();
    let mut sc = Sidecar::start(dir.path(), &pg.url(), &[]);
    let quiet = sc.acquire("pg-quiet", 3000, 0);
    let alive = sc.keep_alive(&quiet);
    std::thread::sleep(Duration::from_millis(300));
    kill(sc.proc.pid(), Signal::SIGTERM).unwrap();
    let stopped = Instant::now();
    drop(alive);
    let inspect = || {
        fencelock_in(
            dir.path(),
            "inspect",
            &["inspect", "--backend", &pg.url(), "pg-quiet"],
        )
        .run(Duration::from_secs(20))
        .unwrap()
    };
    assert!(wait_until(Duration::from_secs(10), || sc
        .proc
        .stderr()
        .contains("keeping the process up")
        || sc.proc.stderr().contains("stopped")));
    let out = inspect();
    assert!(
        out.stdout.contains(&quiet["token"].to_string()),
        "held after the signal: {out:?}"
    );
    let out = sc.proc.wait(Duration::from_secs(20)).unwrap();
    let lived = stopped.elapsed();
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        lived >= Duration::from_millis(3000 * 2 / 3 - 100),
        "exited {lived:?} after the signal"
    );
    assert!(inspect().stdout.contains("free"));
}

fn example(name: &str) -> String {
    format!(
        "{}/../../examples/sidecar/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn the_python_and_shell_examples_wait_write_stop_on_loss_and_release() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let python = |resource: &str, steps: &str, out: &str| {
        let mut cmd = fencelock_testkit::BinCommand::new("python3");
        cmd.args([
            &example("client.py"),
            "--sidecar",
            &sc.base,
            "--resource",
            resource,
            "--steps",
            steps,
            "--step-seconds",
            "0.1",
            "--ttl-ms",
            "2000",
        ])
        .output_to(
            dir.path().join(format!("{out}.out")),
            dir.path().join(format!("{out}.err")),
        );
        cmd.spawn().unwrap()
    };
    // It waits while the lock is held, and gets it at release with a larger token.
    let holder = sc.acquire("py", 5000, 0);
    let mut py = python("py", "3", "py-wait");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!py.stdout().contains("granted"), "{}", py.stdout());
    sc.release(&holder);
    let done = py.wait(Duration::from_secs(30)).unwrap();
    assert_eq!(done.code(), Some(0), "{done:?}");
    let token: u64 = done
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("granted py token "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(token > holder["token"].as_u64().unwrap(), "{}", done.stdout);
    assert!(
        done.stdout.contains("write 2 accepted") && done.stdout.ends_with("released\n"),
        "{}",
        done.stdout
    );

    // It stops its work when the stream reports the lease lost.
    let mut py = python("py", "1000", "py-lost");
    assert!(
        wait_until(Duration::from_secs(20), || py
            .stdout()
            .contains("write 1 accepted")),
        "{}",
        py.stderr()
    );
    let (status, _) = sc.post(
        "/v1/force-release",
        json!({"resource": "py", "reason": "test", "holder_is_dead": true}),
    );
    assert_eq!(status, 200);
    let done = py.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(done.code(), Some(3), "{done:?}");
    assert!(
        done.stdout
            .contains("lost: force_released; stopped the work"),
        "{}",
        done.stdout
    );

    // The shell client: the same with keep-alives.
    let shell = |steps: &str, out: &str| {
        let mut cmd = fencelock_testkit::BinCommand::new("sh");
        cmd.args([&example("client.sh"), "sh-lock", steps])
            .env("SIDECAR", &sc.base)
            .output_to(
                dir.path().join(format!("{out}.out")),
                dir.path().join(format!("{out}.err")),
            );
        cmd.spawn().unwrap()
    };
    let done = shell("3", "sh-ok").wait(Duration::from_secs(30)).unwrap();
    assert_eq!(done.code(), Some(0), "{done:?}");
    assert!(
        done.stdout.contains("write 2 accepted") && done.stdout.ends_with("released\n"),
        "{}",
        done.stdout
    );
    let mut sh = shell("1000", "sh-lost");
    assert!(
        wait_until(Duration::from_secs(20), || sh
            .stdout()
            .contains("write 1 accepted")),
        "{}",
        sh.stderr()
    );
    sc.post(
        "/v1/force-release",
        json!({"resource": "sh-lock", "reason": "test", "holder_is_dead": true}),
    );
    let done = sh.wait(Duration::from_secs(10)).unwrap();
    assert_eq!(done.code(), Some(3), "{done:?}");
    assert!(
        done.stdout.contains("lost: the lease has ended"),
        "{}",
        done.stdout
    );
}

#[test]
fn the_fence_endpoint_on_postgres_and_locks_on_postgres() {
    let pg = fencelock_testkit::PgServer::start().unwrap();
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &pg.url(), &["--fence", &pg.url()]);
    let first = sc.acquire("pg-ledger", 2000, 0);
    sc.release(&first);
    let second = sc.acquire("pg-ledger", 2000, 0);
    let (t1, t2) = (
        first["token"].as_u64().unwrap(),
        second["token"].as_u64().unwrap(),
    );
    assert!(t2 > t1);
    let (status, ok) = sc.post("/v1/fence", json!({"resource": "pg-ledger", "token": t2}));
    assert_eq!((status, &ok["fence"]), (200, &json!("postgres")), "{ok}");
    let (status, stale) = sc.post("/v1/fence", json!({"resource": "pg-ledger", "token": t1}));
    assert_eq!(status, 409, "{stale}");
    assert_eq!(
        (stale["token"].as_u64(), stale["highest"].as_u64()),
        (Some(t1), Some(t2))
    );
    // The fence's table is the library's PgFence one, readable with psql.
    let out = pg.psql("select count(*) from fencelock_fence").unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1", "{out:?}");
}

/// Fails if a `lost` event comes on `events` within `limit` (other events are skipped).
fn no_loss(name: &str, events: &std::sync::mpsc::Receiver<(String, Value)>, limit: Duration) {
    let deadline = Instant::now() + limit;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let got = events.recv_timeout(left);
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = got {
            return;
        }
        assert!(got.is_ok(), "{name}: the stream ended");
        let (event, data) = got.unwrap();
        assert_ne!(event, "lost", "{name}: {data}");
    }
}

/// A forced release through a sidecar on PostgreSQL advisory locks terminated the session
/// holding many applications' leases: three unrelated leases ended with it, and the forced
/// one reported `expired`.
#[test]
fn a_forced_release_on_postgres_advisory_ends_only_the_named_lease() {
    let pg = fencelock_testkit::PgServer::start().unwrap();
    let dir = tempdir();
    // One session for every lease, as many applications share few sessions.
    let url = format!("{}?pool=2", pg.url());
    let sc = Sidecar::start(dir.path(), &url, &[]);
    let apps: Vec<_> = ["pg/a", "pg/b", "pg/c", "pg/d"]
        .iter()
        .map(|name| {
            let lease = sc.acquire(name, 10_000, 0);
            let alive = sc.keep_alive(&lease);
            let events = sc.events(&lease);
            next_event(&events, "granted", Duration::from_secs(5));
            (*name, lease, alive, events)
        })
        .collect();

    let (status, done) = sc.post(
        "/v1/force-release",
        json!({"resource": "pg/a", "reason": "stuck", "holder_is_dead": true}),
    );
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["record"]["holder"]["token"], apps[0].1["token"]);
    assert!(
        done.get("ended_with").is_none(),
        "nothing else ended: {done}"
    );
    let lost = next_event(&apps[0].3, "lost", Duration::from_secs(2));
    assert_eq!(lost["reason"], "force_released", "{lost}");
    for (name, lease, _, events) in &apps[1..] {
        no_loss(name, events, Duration::from_secs(1));
        let (_, lock) = sc.get(&format!("/v1/lock?name={name}"));
        assert_eq!(lock["holder"]["token"], lease["token"], "{name}: {lock}");
    }
    let next = sc.acquire("pg/a", 10_000, 0);
    assert!(next["token"].as_u64() > done["record"]["counter"].as_u64());
    sc.release(&next);

    // From another process, ending the sidecar's session is the only way: every lease that
    // goes with it is named and recorded, and the sidecar's streams say so at once.
    let out = fencelock_in(
        dir.path(),
        "force",
        &[
            "release",
            "--backend",
            &url,
            "--force",
            "--reason",
            "cli",
            "--holder-is-dead",
            "pg/b",
        ],
    )
    .run(Duration::from_secs(30))
    .unwrap();
    assert_eq!(out.code(), Some(0), "{out:?}");
    for name in ["pg/c", "pg/d"] {
        assert!(
            out.stdout.contains(name),
            "{name} not named: {}",
            out.stdout
        );
    }
    for (name, _, _, events) in &apps[1..] {
        let lost = next_event(events, "lost", Duration::from_secs(2));
        assert_eq!(lost["reason"], "not_holder", "{name}: {lost}");
    }
    let (_, audit) = sc.get("/v1/audit");
    let recorded: Vec<&str> = audit["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["resource"].as_str().unwrap())
        .collect();
    for name in ["pg/a", "pg/b", "pg/c", "pg/d"] {
        assert!(
            recorded.contains(&name),
            "{name} not in the audit log: {audit}"
        );
    }
}
