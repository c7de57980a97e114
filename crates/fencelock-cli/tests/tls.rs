//! Every fencelock command over TLS against TLS-only servers (Redis with client certificates,
//! PostgreSQL with `hostssl` lines only), and the refusals of clients that cannot prove
//! themselves: a clear message and exit 69 within a bounded time, never a hang, and never a
//! byte of a private key in the output.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::Sandbox;
use fencelock_testkit::{PgServer, RedisServer, TestTls};

const UNAVAILABLE: i32 = 69;
/// A refused client must give up well within this: the commands' own timeouts are seconds.
const REFUSED_WITHIN: Duration = Duration::from_secs(20);

/// The base64 lines of a PEM private key: none may appear in anything fencelock prints.
fn key_lines(key: &Path) -> Vec<String> {
    std::fs::read_to_string(key)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("-----") && l.len() > 16)
        .map(str::to_owned)
        .collect()
}

fn assert_no_key_in(what: &str, text: &str, keys: &[&Path]) {
    for key in keys {
        for line in key_lines(key) {
            assert!(!text.contains(&line), "{what}: key material in the output");
        }
    }
}

/// `fencelock run` holding a lock on `url`: its command sees the token.
fn run_prints_token(sb: &Sandbox, url: &str) -> common::Finished {
    let mut cmd = sb.bare();
    cmd.args(["run", "--backend", url, "--ttl", "5s", "job", "--"])
        .args(["sh", "-c", "echo token=$FENCELOCK_TOKEN"]);
    sb.run(cmd)
}

#[test]
fn redis_and_redlock_over_mutual_tls_and_every_refusal_is_clear() {
    let sb = Sandbox::new();
    let tls = TestTls::generate(&sb.path("ca")).unwrap();
    let other = TestTls::generate(&sb.path("other-ca")).unwrap();
    let server = RedisServer::start_tls(&tls, &[]).unwrap();
    let keys = [tls.client_key.as_path(), other.client_key.as_path()];

    let url = server.tls_url();
    let out = run_prints_token(&sb, &url);
    assert_eq!(out.code(), Some(0), "run over rediss://: {out:?}");
    assert!(out.stdout.contains("token="), "{out:?}");
    // The lock really is on the TLS server: its key is there, read over TLS by redis-cli.
    let keys_on_server = server.cli(&["--scan"]).unwrap();
    assert!(
        String::from_utf8_lossy(&keys_on_server.stdout).contains("job"),
        "{keys_on_server:?}"
    );
    for sub in ["inspect", "list", "audit"] {
        let mut cmd = sb.bare();
        cmd.args([sub, "--backend", &url]);
        if sub == "inspect" {
            cmd.arg("job");
        }
        let out = sb.run(cmd);
        assert_eq!(out.code(), Some(0), "{sub} over rediss://: {out:?}");
    }
    let mut doctor = sb.bare();
    doctor.args(["doctor", "--backend", &url]);
    let out = sb.run(doctor);
    assert!(out.stdout.contains("reachable, Redis"), "doctor: {out:?}");
    assert!(
        out.stdout.contains("ok    TLS 1.3 (")
            && out.stdout.contains(&format!(
                "); server certificate verified: chain against ca={}, name 127.0.0.1",
                tls.ca.display()
            )),
        "doctor: {out:?}"
    );
    assert_no_key_in("doctor", &format!("{}{}", out.stdout, out.stderr), &keys);

    // Redlock over three TLS nodes.
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| RedisServer::start_tls(&tls, &[]).unwrap())
        .collect();
    let redlocks = format!(
        "redlocks://{}?ca={}&cert={}&key={}",
        nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect::<Vec<_>>()
            .join(","),
        tls.ca.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    );
    let out = run_prints_token(&sb, &redlocks);
    assert_eq!(out.code(), Some(0), "run over redlocks://: {out:?}");
    let mut doctor = sb.bare();
    doctor.args(["doctor", "--backend", &redlocks]);
    let out = sb.run(doctor);
    assert_eq!(
        out.stdout.matches("); server certificate verified").count(),
        3,
        "doctor on redlocks://: {out:?}"
    );
    // Every node ran fencelock's scripts, and a node has no other port than its TLS one.
    for node in &nodes {
        let stats = node.cli(&["INFO", "commandstats"]).unwrap();
        let stats = String::from_utf8_lossy(&stats.stdout).into_owned();
        assert!(stats.contains("cmdstat_eval"), "{}: {stats}", node.port());
    }

    let port = server.port();
    let refused = [
        (
            "plain redis:// on the TLS port",
            format!("redis://127.0.0.1:{port}"),
        ),
        (
            "no client certificate",
            format!("rediss://127.0.0.1:{port}?ca={}", tls.ca.display()),
        ),
        (
            "a client certificate from another CA",
            format!(
                "rediss://127.0.0.1:{port}?ca={}&cert={}&key={}",
                tls.ca.display(),
                other.client_cert.display(),
                other.client_key.display()
            ),
        ),
        (
            "a server certificate from an unknown CA",
            format!(
                "rediss://127.0.0.1:{port}?ca={}&cert={}&key={}",
                other.ca.display(),
                tls.client_cert.display(),
                tls.client_key.display()
            ),
        ),
    ];
    for (what, url) in refused {
        let started = Instant::now();
        let out = run_prints_token(&sb, &url);
        assert_eq!(out.code(), Some(UNAVAILABLE), "{what}: {out:?}");
        assert!(
            started.elapsed() < REFUSED_WITHIN,
            "{what}: {:?}",
            started.elapsed()
        );
        assert!(!out.stdout.contains("token="), "{what}: the command ran");
        assert!(
            out.stderr.starts_with("fencelock: "),
            "{what}: {}",
            out.stderr
        );
        assert!(!out.stderr.contains("panicked"), "{what}: {}", out.stderr);
        assert_no_key_in(what, &format!("{}{}", out.stdout, out.stderr), &keys);
    }
}

#[test]
fn postgres_over_tls_with_verify_full_and_disable_refused_by_the_server() {
    let sb = Sandbox::new();
    let tls = TestTls::generate(&sb.path("ca")).unwrap();
    let server = PgServer::start_tls(&tls).unwrap();
    let base = format!("postgres://postgres@localhost:{}/postgres", server.port());
    let full = format!(
        "{base}?sslmode=verify-full&sslrootcert={}",
        tls.ca.display()
    );
    for url in [full.clone(), format!("{full}&mode=lease")] {
        let out = run_prints_token(&sb, &url);
        assert_eq!(out.code(), Some(0), "run on {url}: {out:?}");
        assert!(out.stdout.contains("token="), "{out:?}");
        let mut inspect = sb.bare();
        inspect.args(["inspect", "--backend", &url, "job"]);
        assert_eq!(sb.run(inspect).code(), Some(0), "inspect on {url}");
    }
    // The doctor reports the version the session negotiated and how the server was verified.
    let mut doctor = sb.bare();
    doctor.args(["doctor", "--backend", &full]);
    let out = sb.run(doctor);
    assert_eq!(out.code(), Some(0), "doctor: {out:?}");
    assert!(
        out.stdout.contains("ok    TLS 1.3 (")
            && out.stdout.contains(&format!(
                "); server certificate verified: chain against sslrootcert={}, host name \
                 (sslmode=verify-full)",
                tls.ca.display()
            )),
        "doctor: {out:?}"
    );
    let mut doctor = sb.bare();
    doctor.args(["doctor", "--backend", &format!("{base}?sslmode=require")]);
    let out = sb.run(doctor);
    assert!(
        out.stdout
            .contains("note  server certificate NOT verified (sslmode=prefer or require"),
        "doctor: {out:?}"
    );
    let started = Instant::now();
    let out = run_prints_token(&sb, &format!("{base}?sslmode=disable"));
    assert_eq!(out.code(), Some(UNAVAILABLE), "sslmode=disable: {out:?}");
    assert!(started.elapsed() < REFUSED_WITHIN);
    // The server's own words: no pg_hba.conf line lets a session in without encryption.
    assert!(out.stderr.contains("pg_hba.conf"), "{}", out.stderr);
    assert!(out.stderr.contains("no encryption"), "{}", out.stderr);
    assert_no_key_in("postgres", &out.stderr, &[tls.server_key.as_path()]);
}

/// `etcds://...?ca=F` naming a file that is not a certificate exited 69 (the cluster looked
/// unreachable) where Redis and PostgreSQL exit 64: tonic found the file unusable only while
/// connecting. Every engine now says which option names a file that holds no PEM of its kind.
#[test]
fn a_tls_file_that_is_not_pem_is_bad_input_on_every_engine() {
    let sb = Sandbox::new();
    let dir = tempfile::tempdir().unwrap();
    let tls = TestTls::generate(dir.path()).unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    let (ca, cert, key) = (
        tls.ca.display().to_string(),
        tls.client_cert.display().to_string(),
        tls.client_key.display().to_string(),
    );
    let junk = junk.display().to_string();
    // Nothing listens on port 1: the files are refused before any connection is tried.
    for scheme in ["etcds", "rediss", "redlocks"] {
        let hosts = if scheme == "redlocks" {
            "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
        } else {
            "127.0.0.1:1"
        };
        for (option, url) in [
            ("ca", format!("{scheme}://{hosts}?ca={junk}")),
            (
                "cert",
                format!("{scheme}://{hosts}?ca={ca}&cert={junk}&key={key}"),
            ),
            (
                "key",
                format!("{scheme}://{hosts}?ca={ca}&cert={cert}&key={junk}"),
            ),
        ] {
            let out = run_prints_token(&sb, &url);
            assert_eq!(out.code(), Some(64), "{url}: {out:?}");
            assert!(
                out.stderr.contains(&format!("{option}=")) && out.stderr.contains("junk.pem"),
                "{url}: {}",
                out.stderr
            );
        }
    }
}
