//! The library over TLS against TLS-only servers: locks and fences on Redis with client
//! certificates, and PostgreSQL with `hostssl` lines only under each `sslmode`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use fencelock::fence::{PgFence, RedisFence};
use fencelock::{Client, ErrorKind, FencingToken, LockOptions};
use fencelock_testkit::{PgServer, RedisServer, TestTls};

const TIMEOUT: Duration = Duration::from_secs(5);

fn certs(dir: &tempfile::TempDir, name: &str, names: &str) -> TestTls {
    TestTls::generate_for(&dir.path().join(name), names).unwrap()
}

#[tokio::test]
async fn redis_lock_and_fence_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let tls = certs(&dir, "ca", "IP:127.0.0.1,DNS:localhost");
    let server = RedisServer::start_tls(&tls, &[]).unwrap();
    let client = Client::connect(&server.tls_url()).await.unwrap();
    let lease = client
        .try_acquire("ledger", &LockOptions::default())
        .await
        .unwrap();

    let fence = RedisFence::connect(&server.tls_url(), "fencelock:v1:")
        .await
        .unwrap();
    fence
        .set("ledger", lease.token(), "balance", "100")
        .await
        .unwrap();
    let stale = FencingToken::new(lease.token().get() - 1);
    let e = fence
        .set("ledger", stale, "balance", "0")
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::StaleToken);
    let out = server.cli(&["GET", "balance"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100");
    lease.release().await.unwrap();
}

#[tokio::test]
async fn redis_names_are_checked_and_files_never_quoted() {
    let dir = tempfile::tempdir().unwrap();
    // The certificate names localhost only: 127.0.0.1 in the URL does not match it.
    let tls = certs(&dir, "ca", "DNS:localhost");
    let server = RedisServer::start_tls(&tls, &[]).unwrap();
    let query = format!(
        "?ca={}&cert={}&key={}",
        tls.ca.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    );
    let ok = format!("rediss://localhost:{}{query}", server.port());
    Client::connect(&ok).await.unwrap();
    let wrong = format!("rediss://127.0.0.1:{}{query}", server.port());
    let refused = tokio::time::timeout(Duration::from_secs(20), Client::connect(&wrong))
        .await
        .expect("a refused handshake must not hang");
    let Err(e) = refused else {
        unreachable!("a certificate for another name must be refused")
    };
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");

    // A key file that is not a key: the message names the option, not the contents.
    let bogus = dir.path().join("bogus.key");
    std::fs::write(&bogus, "SECRET-MARKER-4711\n").unwrap();
    let bad = format!(
        "rediss://localhost:{}?ca={}&cert={}&key={}",
        server.port(),
        tls.ca.display(),
        tls.client_cert.display(),
        bogus.display()
    );
    let e = Client::connect(&bad).await.err().unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(!format!("{e} {e:?}").contains("SECRET-MARKER"), "{e:?}");
    let e = RedisFence::connect(&bad, "p:").await.err().unwrap();
    assert!(!format!("{e} {e:?}").contains("SECRET-MARKER"), "{e:?}");
}

/// Whether the session of `client` runs over TLS, by the server's own account.
async fn session_uses_tls(client: &tokio_postgres::Client) -> bool {
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn postgres_over_tls_with_libpq_sslmodes() {
    let dir = tempfile::tempdir().unwrap();
    let tls = certs(&dir, "ca", "DNS:localhost");
    let server = PgServer::start_tls(&tls).unwrap();
    let ca = tls.ca.display();
    let at = |host: &str, query: &str| {
        format!(
            "postgres://postgres@{host}:{}/postgres?{query}",
            server.port()
        )
    };
    let full = at(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );

    // Both modes lock over verify-full, and the fence writes in its own TLS session.
    for url in [full.clone(), format!("{full}&mode=lease")] {
        let client = Client::connect(&url).await.unwrap();
        let lease = client
            .try_acquire("ledger", &LockOptions::default())
            .await
            .unwrap();
        let mut pg = PgFence::connect(&url, TIMEOUT).await.unwrap();
        assert!(session_uses_tls(&pg).await);
        let fence = PgFence::new();
        fence.install(&pg).await.unwrap();
        let tx = pg.transaction().await.unwrap();
        fence.admit(&tx, "ledger", lease.token()).await.unwrap();
        tx.commit().await.unwrap();
        lease.release().await.unwrap();
        client.close().await;
    }

    // prefer tries TLS first, and the server accepts it.
    let prefer = PgFence::connect(&at("127.0.0.1", "sslmode=prefer"), TIMEOUT)
        .await
        .unwrap();
    assert!(session_uses_tls(&prefer).await);
    // require without a CA encrypts without verifying (libpq's meaning).
    let require = PgFence::connect(&at("127.0.0.1", "sslmode=require"), TIMEOUT)
        .await
        .unwrap();
    assert!(session_uses_tls(&require).await);
    // verify-ca checks the chain, not the name: 127.0.0.1 is not in the certificate.
    let ca_only = at("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}"));
    PgFence::connect(&ca_only, TIMEOUT).await.unwrap();

    // verify-full with a name the certificate does not hold fails.
    let wrong_name = at(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    let e = PgFence::connect(&wrong_name, TIMEOUT).await.err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Engine);
    assert!(e.to_string().contains("not valid for name"), "{e}");
    let e = Client::connect(&wrong_name).await.err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");

    // A chain from another CA fails verify-ca (and so require with that sslrootcert).
    let other = certs(&dir, "other", "DNS:localhost");
    for mode in ["verify-ca", "require"] {
        let url = at(
            "localhost",
            &format!("sslmode={mode}&sslrootcert={}", other.ca.display()),
        );
        let e = PgFence::connect(&url, TIMEOUT).await.err().unwrap();
        assert_eq!(e.kind(), ErrorKind::Engine, "{mode}: {e}");
    }

    // disable: the server refuses, in its own words.
    let e = Client::connect(&at("127.0.0.1", "sslmode=disable"))
        .await
        .err()
        .unwrap();
    let text = format!("{e} {:?}", std::error::Error::source(&e));
    assert!(text.contains("no encryption"), "{text}");
}
