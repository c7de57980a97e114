//! The sidecar's HTTP surface as a browser or a careless client meets it, through a real
//! `fencelock serve` and requests written by hand: the `Host`, `Origin` and `Content-Type`
//! checks that keep web pages out, bodies read strictly, the bearer scheme, Dapr's error body
//! and integer strings, names that display reversed, a routed sidecar's health, the start-up
//! checks, and what the OpenAPI document promises. The same attacks from a real browser are
//! in `dashboard.rs`.
#![allow(clippy::unwrap_used)]

mod sidecar;

use std::time::Duration;

use fencelock_testkit::RedisServer;
use serde_json::{json, Value};
use sidecar::{fencelock_in, sqlite_url, tempdir, Sidecar};

const JSON: (&str, &str) = ("Content-Type", "application/json");

fn acquire_body(resource: &str) -> Vec<u8> {
    json!({"resource": resource, "ttl_ms": 60_000})
        .to_string()
        .into_bytes()
}

/// DNS rebinding reached the sidecar: a request naming a host it does not serve was obeyed.
#[test]
fn a_host_the_sidecar_does_not_serve_is_refused() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let port = sc.port();
    let other = port.wrapping_add(1).max(1024);
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_owned(),
        format!("127.0.0.1.nip.io:{port}"),
        format!("localhost:{other}"),
        format!("127.0.0.1:{other}"),
        "127.0.0.1".to_owned(),
    ] {
        let (status, err) = sc.raw(
            "POST",
            "/v1/acquire",
            &[("Host", &host), JSON],
            Some(&acquire_body("rebound")),
        );
        assert_eq!(
            (status, err["error"].as_str()),
            (421, Some("misdirected")),
            "Host {host}: {err}"
        );
        assert!(
            err["message"].as_str().unwrap().contains("--public-url"),
            "the refusal says how to serve another name: {err}"
        );
        let (status, err) = sc.raw("GET", "/v1/locks", &[("Host", &host)], None);
        assert_eq!(status, 421, "reading through Host {host}: {err}");
    }
    assert!(!sc.held("rebound"));
    let (status, err) = sc.raw_without_host("GET", "/v1/locks");
    assert_eq!(
        (status, err["field"].as_str()),
        (400, Some("Host")),
        "{err}"
    );
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
        format!("[::1]:{port}"),
    ] {
        let (status, body) = sc.raw("GET", "/healthz", &[("Host", &host)], None);
        assert_eq!(status, 200, "Host {host}: {body}");
    }

    // A name the sidecar is reached by, given with --public-url, is served.
    let named = Sidecar::start(
        dir.path(),
        &sqlite_url(dir.path()),
        &["--public-url", "https://locks.example.com"],
    );
    for host in ["locks.example.com", "locks.example.com:443"] {
        let (status, body) = named.raw(
            "POST",
            "/v1/acquire",
            &[
                ("Host", host),
                ("Origin", "https://locks.example.com"),
                JSON,
            ],
            Some(&acquire_body(&format!("via {host}"))),
        );
        assert_eq!(status, 200, "Host {host}: {body}");
    }
    let (status, _) = named.raw(
        "GET",
        "/healthz",
        &[("Host", "locks.example.com:8443")],
        None,
    );
    assert_eq!(status, 421, "only the port of the public URL");
}

/// A page on another origin took and released locks: a foreign `Origin` was obeyed.
#[test]
fn a_request_from_another_origin_is_refused() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let port = sc.port();
    let victim = sc.acquire("victim", 60_000, 0);
    let force = json!({"resource": "victim", "reason": "csrf", "holder_is_dead": true})
        .to_string()
        .into_bytes();
    for origin in [
        format!("http://127.0.0.1:{}", port.wrapping_add(1).max(1024)),
        format!("http://localhost:{}", port.wrapping_add(1).max(1024)),
        format!("https://127.0.0.1:{port}"),
        "http://evil.example".to_owned(),
        "null".to_owned(),
        format!("http://127.0.0.1:{port}/path"),
    ] {
        for (path, body) in [
            ("/v1/force-release", force.clone()),
            ("/v1/acquire", acquire_body("taken")),
        ] {
            let (status, err) = sc.raw("POST", path, &[("Origin", &origin), JSON], Some(&body));
            assert_eq!(
                (status, err["error"].as_str()),
                (403, Some("cross_origin")),
                "{path} from {origin}: {err}"
            );
        }
        let (status, _) = sc.raw("GET", "/v1/locks", &[("Origin", &origin)], None);
        assert_eq!(status, 403, "a read from {origin}");
    }
    assert!(sc.held("victim"), "the lock was not released");
    assert!(!sc.held("taken"), "nor another taken");
    // The sidecar's own origin, by any of its names: the dashboard's requests.
    for origin in [
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    ] {
        let resource = format!("own {origin}");
        let (status, body) = sc.raw(
            "POST",
            "/v1/acquire",
            &[("Origin", &origin), JSON],
            Some(&acquire_body(&resource)),
        );
        assert_eq!(status, 200, "from {origin}: {body}");
    }
    let _ = victim;
}

/// Browsers send `text/plain` and form bodies without asking first, and they were read as
/// JSON: a page could post an acquire, a forced release or a fence admission.
#[test]
fn a_body_not_declared_json_is_refused_with_415() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let lease = sc.acquire("kept", 60_000, 0);
    let id = lease["lease_id"].as_str().unwrap();
    let routes: [(&str, Vec<u8>); 4] = [
        ("/v1/acquire", acquire_body("plain")),
        (
            "/v1/force-release",
            json!({"resource": "kept", "reason": "r", "holder_is_dead": true})
                .to_string()
                .into_bytes(),
        ),
        (
            "/v1/fence",
            json!({"resource": "kept", "token": 1u64 << 50})
                .to_string()
                .into_bytes(),
        ),
        (
            "/v1.0-alpha1/lock/store",
            json!({"resourceId": "dapr-plain", "lockOwner": "o", "expiryInSeconds": 60})
                .to_string()
                .into_bytes(),
        ),
    ];
    for content_type in [
        Some("text/plain"),
        Some("text/plain;charset=UTF-8"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        Some("text/json"),
        None,
    ] {
        for (path, body) in &routes {
            let headers: Vec<(&str, &str)> = content_type
                .map(|c| ("Content-Type", c))
                .into_iter()
                .collect();
            let (status, err) = sc.raw("POST", path, &headers, Some(body));
            assert_eq!(status, 415, "{path} as {content_type:?}: {err}");
            if path.starts_with("/v1.0") {
                assert_eq!(err["errorCode"], "ERR_MALFORMED_REQUEST", "{err}");
            } else {
                assert_eq!(err["error"], "content_type", "{err}");
                assert!(
                    err["message"]
                        .as_str()
                        .unwrap()
                        .contains("Content-Type: application/json"),
                    "{err}"
                );
            }
        }
        // Even an empty form post to a route that takes no body.
        if let Some(c) = content_type {
            let path = format!("/v1/leases/{id}/release");
            let (status, err) = sc.raw("POST", &path, &[("Content-Type", c)], Some(b""));
            assert_eq!(status, 415, "release as {c}: {err}");
        }
    }
    assert!(sc.held("kept"));
    assert!(!sc.held("plain"));
    assert!(!sc.held("dapr-plain"));
    let (status, fence) = sc.post(
        "/v1/fence",
        json!({"resource": "kept", "token": lease["token"]}),
    );
    assert_eq!(status, 200, "the fence was not raised: {fence}");

    // The JSON type with parameters or in other cases, and a bodiless POST without a type.
    for (i, content_type) in ["application/json; charset=utf-8", "Application/JSON"]
        .iter()
        .enumerate()
    {
        let (status, body) = sc.raw(
            "POST",
            "/v1/acquire",
            &[("Content-Type", content_type)],
            Some(&acquire_body(&format!("typed-{i}"))),
        );
        assert_eq!(status, 200, "{content_type}: {body}");
    }
    let (status, body) = sc.raw("POST", &format!("/v1/leases/{id}/keepalive"), &[], None);
    assert_eq!(status, 200, "{body}");
}

/// `{"resource":"x"} junk` was accepted as if the junk were not there.
#[test]
fn trailing_garbage_after_the_json_body_is_refused() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    for body in [
        &br#"{"resource": "junk"} junk"#[..],
        br#"{"resource": "junk"}{"resource": "junk"}"#,
        br#"{"resource": "junk"} 1"#,
    ] {
        let (status, err) = sc.raw("POST", "/v1/acquire", &[JSON], Some(body));
        assert_eq!(
            (status, err["field"].as_str()),
            (400, Some("body")),
            "{}: {err}",
            String::from_utf8_lossy(body)
        );
        assert!(
            err["message"].as_str().unwrap().contains("trailing"),
            "{err}"
        );
    }
    assert!(!sc.held("junk"));
    let (status, err) = sc.raw(
        "POST",
        "/v1.0-alpha1/lock/store",
        &[JSON],
        Some(br#"{"resourceId": "junk", "lockOwner": "o", "expiryInSeconds": 5} x"#),
    );
    assert_eq!(
        (status, err["errorCode"].as_str()),
        (400, Some("ERR_MALFORMED_REQUEST")),
        "{err}"
    );
    assert!(!sc.held("junk"));
    // Whitespace after the value is not garbage.
    let (status, body) = sc.raw(
        "POST",
        "/v1/acquire",
        &[JSON],
        Some(b"{\"resource\": \"junk\"} \n\t "),
    );
    assert_eq!(status, 200, "{body}");
}

/// Dapr clients got a plain-text 413 for a body over the limit, and `"expiryInSeconds": "5"`,
/// the string form protojson accepts for integers, was refused.
#[test]
fn dapr_gets_its_error_body_when_too_large_and_integers_as_strings() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let huge = json!({"resourceId": "big", "lockOwner": "x".repeat(100_000), "expiryInSeconds": 5});
    let (status, err) = sc.post("/v1.0-alpha1/lock/store", huge.clone());
    assert_eq!(
        (status, err["errorCode"].as_str()),
        (413, Some("ERR_MALFORMED_REQUEST")),
        "{err}"
    );
    assert!(err["message"].as_str().unwrap().contains("64 KiB"), "{err}");
    let (status, err) = sc.post("/v1.0-alpha1/unlock/store", huge);
    assert_eq!(
        (status, err["errorCode"].as_str()),
        (413, Some("ERR_MALFORMED_REQUEST"))
    );

    let (status, got) = sc.post(
        "/v1.0-alpha1/lock/store",
        json!({"resourceId": "stringly", "lockOwner": "o", "expiryInSeconds": "5"}),
    );
    assert_eq!((status, &got["success"]), (200, &json!(true)), "{got}");
    assert!(sc.held("stringly"));
    for bad in [
        json!("soon"),
        json!("5s"),
        json!(""),
        json!("-5"),
        json!(" 5"),
    ] {
        let (status, err) = sc.post(
            "/v1.0-alpha1/lock/store",
            json!({"resourceId": "stringly2", "lockOwner": "o", "expiryInSeconds": bad}),
        );
        assert_eq!(status, 400, "{bad}: {err}");
        assert_eq!(err["errorCode"], "ERR_MALFORMED_REQUEST", "{err}");
        assert!(
            err["message"].as_str().unwrap().contains("expiryInSeconds"),
            "{bad}: {err}"
        );
    }
    assert!(!sc.held("stringly2"));
}

/// `Authorization: bearer TOKEN` got 401: the scheme is case-insensitive (RFC 9110).
#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let dir = tempdir();
    let auth = dir.path().join("auth");
    let token = "ops-token-0123456789abcdef0123";
    std::fs::write(&auth, format!("{token} ops *\n")).unwrap();
    let sc = Sidecar::start(
        dir.path(),
        &sqlite_url(dir.path()),
        &["--auth-file", auth.to_str().unwrap()],
    );
    for (i, scheme) in ["bearer", "BEARER", "Bearer", "bEaReR"].iter().enumerate() {
        let value = format!("{scheme} {token}");
        let (status, body) = sc.raw(
            "POST",
            "/v1/acquire",
            &[("Authorization", &value), JSON],
            Some(&acquire_body(&format!("case-{i}"))),
        );
        assert_eq!(status, 200, "{value}: {body}");
    }
    for value in [
        format!("Basic {token}"),
        format!("Bearer{token}"),
        format!("Bearer {token}x"),
        format!("Bearer {}", &token[..token.len() - 1]),
        "Bearer".to_owned(),
    ] {
        let (status, body) = sc.raw(
            "POST",
            "/v1/acquire",
            &[("Authorization", &value), JSON],
            Some(&acquire_body("refused")),
        );
        assert_eq!(status, 401, "{value}: {body}");
    }
}

/// A name holding U+202E was accepted, and the dashboard showed it reversed.
#[test]
fn names_with_bidirectional_controls_are_refused() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    for name in [
        "invoice\u{202E}fdp.exe",
        "a\u{2066}b",
        "\u{200F}x",
        "zero\u{200B}width",
    ] {
        let (status, err) = sc.post("/v1/acquire", json!({"resource": name}));
        assert_eq!(
            (status, err["field"].as_str()),
            (400, Some("resource")),
            "{name:?}: {err}"
        );
        assert!(err["message"].as_str().unwrap().contains("U+"), "{err}");
        let (status, err) = sc.post(
            "/v1.0-alpha1/lock/store",
            json!({"resourceId": name, "lockOwner": "o", "expiryInSeconds": 5}),
        );
        assert_eq!(status, 400, "{name:?}: {err}");
    }
}

/// A routed sidecar said "engine sqlite", its default backend's, as if it had no other.
#[test]
fn a_routed_sidecar_names_its_backends() {
    let redis = RedisServer::start().unwrap();
    let dir = tempdir();
    let config = dir.path().join("routes.toml");
    std::fs::write(
        &config,
        format!(
            "[backends]\njobs = \"{}\"\nlocal = \"{}\"\n\n[[route]]\nprefix = \"jobs/\"\n\
             backend = \"jobs\"\n\n[default]\nbackend = \"local\"\n",
            redis.url(),
            sqlite_url(dir.path())
        ),
    )
    .unwrap();
    let sc = Sidecar::start_with(dir.path(), &["--config", config.to_str().unwrap()]);
    let (status, health) = sc.get("/healthz");
    assert_eq!(status, 200);
    assert_eq!(health["engine"], "routed", "{health}");
    assert_eq!(
        health["backends"],
        json!([{"name": "jobs", "engine": "redis"}, {"name": "local", "engine": "sqlite"}]),
        "{health}"
    );
    sc.acquire("jobs/a", 5000, 0);
    sc.acquire("other", 5000, 0);
    assert_eq!(sc.get("/v1/lock?name=jobs/a").1["engine"], "redis");
    assert_eq!(sc.get("/v1/lock?name=other").1["engine"], "sqlite");

    // One backend: its engine, and itself as the one backend.
    let single = Sidecar::start(dir.path(), &redis.url(), &[]);
    let (_, health) = single.get("/healthz");
    assert_eq!(health["engine"], "redis", "{health}");
    assert_eq!(
        health["backends"],
        json!([{"name": "default", "engine": "redis"}])
    );
}

/// `serve --request-timeout 0s` started, then answered every acquire 503.
#[test]
fn a_zero_request_timeout_is_refused_at_start() {
    let dir = tempdir();
    let url = sqlite_url(dir.path());
    for timeout in ["0s", "0ms", "50ms"] {
        let args = [
            "serve",
            "--backend",
            &url,
            "--listen",
            "127.0.0.1:0",
            "--request-timeout",
            timeout,
        ];
        let out = fencelock_in(dir.path(), &format!("timeout-{timeout}"), &args)
            .run(Duration::from_secs(20));
        assert!(out.is_ok(), "{timeout} was accepted: {:?}", out.err());
        let out = out.unwrap();
        assert_eq!(out.code(), Some(64), "{timeout}: {out:?}");
        assert!(
            out.stderr.contains("--request-timeout") && out.stderr.contains("100ms"),
            "{}",
            out.stderr
        );
    }
}

/// The OpenAPI document said `/healthz`, `/` and `/openapi.json` need a bearer token, listed
/// 401 on one route only, left out 413, 415, 403, 421 and 503, said `ttl_ms` may be 0, and
/// left `limit` out of the error codes.
#[test]
fn the_openapi_document_states_who_needs_a_token_and_every_refusal() {
    let dir = tempdir();
    let sc = Sidecar::start(dir.path(), &sqlite_url(dir.path()), &[]);
    let (status, doc) = sc.get("/openapi.json");
    assert_eq!(status, 200);
    let public = ["/", "/healthz", "/openapi.json"];
    let global = doc.get("security").cloned().unwrap_or(Value::Null);
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let what = format!("{method} {path}");
            let security = op.get("security").cloned().unwrap_or(global.clone());
            let responses = op["responses"].as_object().unwrap();
            let has = |code: &str| responses.contains_key(code);
            let needs_token = security
                .as_array()
                .is_some_and(|a| a.iter().any(|r| r.get("bearer").is_some()));
            if public.contains(&path.as_str()) {
                assert!(!needs_token, "{what} is public: {security}");
                assert!(!has("401"), "{what}");
            } else {
                assert!(needs_token, "{what} needs the token: {security}");
                assert!(has("401"), "{what} lists 401");
                // The event stream has no deadline: it lasts as long as its lease.
                if !path.ends_with("/events") {
                    assert!(has("503"), "{what} lists 503");
                }
            }
            assert!(has("421"), "{what} lists 421 (Host)");
            assert!(has("403"), "{what} lists 403 (Origin)");
            if method == "post" {
                assert!(has("415"), "{what} lists 415");
            }
            if op.get("requestBody").is_some() {
                assert!(has("413"), "{what} lists 413");
            }
            let schema = if path.starts_with("/v1.0-alpha1") {
                "DaprError"
            } else {
                "ErrorBody"
            };
            for code in ["403", "415", "421"] {
                if let Some(r) = responses.get(code) {
                    let text = r.to_string();
                    assert!(text.contains(schema), "{what} {code}: {text}");
                }
            }
        }
    }
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        schemas["AcquireRequest"]["properties"]["ttl_ms"]["minimum"], 100,
        "{}",
        schemas["AcquireRequest"]
    );
    let codes: Vec<&str> = schemas["ErrorCode"]["enum"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for code in [
        "invalid_input",
        "limit",
        "too_large",
        "content_type",
        "cross_origin",
        "misdirected",
        "unauthorized",
        "forbidden",
        "holder_alive",
        "shutting_down",
    ] {
        assert!(codes.contains(&code), "{code} in {codes:?}");
    }
    assert!(
        schemas["ErrorBody"]["properties"]["error"]
            .to_string()
            .contains("ErrorCode"),
        "{}",
        schemas["ErrorBody"]
    );
}
