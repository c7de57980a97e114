//! The compare-and-delete every engine's forced release must be, checked on the engines
//! directly: the public API only ever passes the owner it has just inspected, so the race it
//! guards against cannot be staged through it. One line per engine. And the limits stored in
//! the engine, refused by the engine itself for a grant that skips every check of the client.

use std::time::{Duration, SystemTime};

use super::open;
use crate::core::engine::{AcquireRequest, Attempt, Engine, EngineConfig, Renewal, Renewed};
use crate::core::error::ErrorKind;
use crate::core::holder::{Holder, HolderMeta};
use crate::core::limits::Limits;
use crate::core::records::AuditRecord;
use crate::core::token::FencingToken;

fn config() -> EngineConfig {
    EngineConfig {
        prefix: "t:".into(),
        op_timeout: Duration::from_secs(5),
        max_ttl: Duration::from_secs(3600),
        holder_id: "tests".into(),
    }
}

fn draft(name: &str) -> AuditRecord {
    AuditRecord {
        id: "0123456789abcdef".into(),
        resource: name.into(),
        at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
        user: "u".into(),
        host: "h".into(),
        reason: "r".into(),
        holder_declared_dead: true,
        assessment: "a".into(),
        holder: Holder::bare("o".into()),
        counter: FencingToken::new(0),
        not_released_on: Vec::new(),
        ended_with: Vec::new(),
    }
}

async fn grant(engine: &dyn Engine, name: &str, owner: &str) -> FencingToken {
    let req = AcquireRequest {
        name: name.into(),
        owner: owner.into(),
        ttl: Duration::from_secs(60),
        meta: HolderMeta::current("holder".into()),
        waits: false,
    };
    match engine.try_acquire(&req).await.unwrap() {
        Attempt::Granted(t) => t,
        Attempt::Held { .. } | Attempt::OverQuota { .. } => unreachable!("{name} is held"),
    }
}

async fn check_compare_and_delete(url: &str) {
    let engine = open(url, &config()).await.unwrap().engine;
    let token = grant(&*engine, "r", "new-owner").await;
    let wrong = engine
        .force_release("r", Some("judged-owner"), &draft("r"))
        .await
        .unwrap();
    assert!(wrong.is_none(), "deleted a lock that changed hands");
    assert_eq!(
        engine.inspect("r").await.unwrap().map(|h| h.owner),
        Some("new-owner".to_owned())
    );
    assert!(engine.audit(None).await.unwrap().is_empty());

    let done = engine
        .force_release("r", Some("new-owner"), &draft("r"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.holder.owner, "new-owner");
    assert_eq!(done.holder.token, Some(token));
    assert_eq!(done.holder.client.as_deref(), Some("holder"));
    assert_eq!(done.holder.ttl, Some(Duration::from_secs(60)));
    assert!(done.counter > token);
    assert_eq!(engine.audit(Some("r")).await.unwrap(), vec![done.clone()]);
    // Nothing left to delete.
    assert!(engine
        .force_release("r", None, &draft("r"))
        .await
        .unwrap()
        .is_none());
    assert!(grant(&*engine, "r", "next").await > done.counter);
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_deletes_only_the_expected_owner() {
    let dir = tempfile::tempdir().unwrap();
    check_compare_and_delete(&format!("sqlite://{}/l.db", dir.path().display())).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_deletes_only_the_expected_owner() {
    let server = fencelock_testkit::RedisServer::start().unwrap();
    check_compare_and_delete(&server.url()).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redlock_deletes_only_the_expected_owner() {
    let nodes = fencelock_testkit::start_redis_nodes(3).unwrap();
    check_compare_and_delete(&fencelock_testkit::redlock_url(&nodes)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_deletes_only_the_expected_owner() {
    let server = fencelock_testkit::PgServer::start().unwrap();
    check_compare_and_delete(&server.url()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_lease_table_deletes_only_the_expected_owner() {
    let server = fencelock_testkit::PgServer::start().unwrap();
    check_compare_and_delete(&format!("{}?mode=lease", server.url())).await;
}

#[cfg(feature = "etcd")]
#[tokio::test]
async fn etcd_deletes_only_the_expected_owner() {
    let cluster = fencelock_testkit::EtcdCluster::start(1).unwrap();
    check_compare_and_delete(&cluster.url()).await;
}

/// A refused attempt carries a wake-up subscription only when its acquisition may wait: a
/// `try_acquire` would drop it unread, and making it cost the uncontended attempt more client
/// work than anything else the client did around the call.
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn check_only_a_waiting_attempt_subscribes(url: &str) {
    let engine = open(url, &config()).await.unwrap().engine;
    grant(&*engine, "w", "holder").await;
    for waits in [false, true] {
        let req = AcquireRequest {
            name: "w".into(),
            owner: "other".into(),
            ttl: Duration::from_secs(60),
            meta: HolderMeta::current("holder".into()),
            waits,
        };
        match engine.try_acquire(&req).await.unwrap() {
            Attempt::Held { wake, .. } => assert_eq!(wake.is_some(), waits, "waits: {waits}"),
            Attempt::Granted(_) | Attempt::OverQuota { .. } => unreachable!("w is held"),
        }
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_subscribes_only_an_attempt_that_may_wait() {
    let server = fencelock_testkit::RedisServer::start().unwrap();
    check_only_a_waiting_attempt_subscribes(&server.url()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_subscribes_only_an_attempt_that_may_wait() {
    let server = fencelock_testkit::PgServer::start().unwrap();
    check_only_a_waiting_attempt_subscribes(&server.url()).await;
    check_only_a_waiting_attempt_subscribes(&format!("{}?mode=lease", server.url())).await;
}

/// A grant straight to the engine, past every check the client makes (its own TTL cap among
/// them): a 5-minute TTL under a stored `max-ttl` of one minute is refused by the engine
/// itself, and nothing is left held.
async fn check_the_engine_refuses_a_ttl_above_its_cap(url: &str) {
    let cfg = EngineConfig {
        max_ttl: Duration::from_secs(300 * 24 * 3600),
        ..config()
    };
    let engine = open(url, &cfg).await.unwrap().engine;
    engine
        .set_limits(&Limits::default().with_max_ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    let req = AcquireRequest {
        name: "long".into(),
        owner: "bypasser".into(),
        ttl: Duration::from_secs(300),
        meta: HolderMeta::current("holder".into()),
        waits: false,
    };
    let e = engine.try_acquire(&req).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max-ttl = 1m"), "{e}");
    assert!(engine.inspect("long").await.unwrap().is_none());
    // A renewal to the same TTL straight to the engine is refused too.
    let short = AcquireRequest {
        ttl: Duration::from_secs(30),
        ..req
    };
    assert!(matches!(
        engine.try_acquire(&short).await.unwrap(),
        Attempt::Granted(_)
    ));
    let renewal = Renewal {
        name: "long".into(),
        owner: "bypasser".into(),
        ttl: Duration::from_secs(300),
    };
    assert_eq!(
        engine.extend(&[renewal]).await.unwrap(),
        vec![Renewed::OverLimit(Duration::from_secs(60))]
    );
    assert!(engine.release("long", "bypasser").await.unwrap());
}

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_transaction_refuses_a_ttl_above_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    check_the_engine_refuses_a_ttl_above_its_cap(&format!(
        "sqlite://{}/l.db",
        dir.path().display()
    ))
    .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_script_refuses_a_ttl_above_the_cap() {
    let server = fencelock_testkit::RedisServer::start().unwrap();
    check_the_engine_refuses_a_ttl_above_its_cap(&server.url()).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redlock_scripts_refuse_a_ttl_above_the_cap() {
    let nodes = fencelock_testkit::start_redis_nodes(3).unwrap();
    check_the_engine_refuses_a_ttl_above_its_cap(&fencelock_testkit::redlock_url(&nodes)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_statements_refuse_a_ttl_above_the_cap() {
    let server = fencelock_testkit::PgServer::start().unwrap();
    check_the_engine_refuses_a_ttl_above_its_cap(&server.url()).await;
    check_the_engine_refuses_a_ttl_above_its_cap(&format!("{}?mode=lease", server.url())).await;
}

/// A Redis server with `limits` stored under the prefix `t:`, and a connection to it.
#[cfg(feature = "redis")]
async fn redis_with_limits(
    limits: &str,
) -> (
    fencelock_testkit::RedisServer,
    ::redis::aio::MultiplexedConnection,
) {
    let server = fencelock_testkit::RedisServer::start().unwrap();
    let out = server.cli(&["SET", "t:limits", limits]).unwrap();
    assert!(out.status.success());
    let client = ::redis::Client::open(server.url()).unwrap();
    let conn = client.get_multiplexed_async_connection().await.unwrap();
    (server, conn)
}

/// Both acquire scripts as a caller that skips every check of this library would run them on
/// resource `r` under the prefix `t:`, with a TTL of `ttl_ms`: the plain one and the fair one,
/// each with the client's `held` set or without it.
#[cfg(feature = "redis")]
fn acquire_calls(ttl_ms: u64, held: bool) -> Vec<::redis::ScriptInvocation<'static>> {
    let value = format!("owner\n00\n{ttl_ms}\n0\n1\nhost\nme");
    let mut calls = Vec::new();
    for script in [
        &*super::redis::scripts::ACQUIRE,
        &*super::redis::scripts::ACQUIRE_FAIR,
    ] {
        let mut inv = script.prepare_invoke();
        for k in ["lock:r", "fence:r", "node", "limits"] {
            inv.key(format!("t:{k}"));
        }
        if held {
            inv.key("t:held:me");
        }
        inv.arg(&value).arg(ttl_ms).arg("");
        if std::ptr::eq(script, &*super::redis::scripts::ACQUIRE_FAIR) {
            inv.arg(60_000).arg("t:client:x").arg(2);
        }
        calls.push(inv);
    }
    calls
}

/// The acquire scripts run by hand, as a client that skips every check of this library would
/// run them: refused with the cap in the reply, and the lock key never written.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_acquire_script_called_directly_refuses_a_ttl_above_the_cap() {
    let (server, mut conn) = redis_with_limits("60000 0").await;
    for inv in acquire_calls(300_000, true) {
        let reply: Vec<::redis::Value> = inv.invoke_async(&mut conn).await.unwrap();
        assert_eq!(reply.first(), Some(&::redis::Value::Int(2)), "{reply:?}");
        assert_eq!(
            reply.get(3),
            Some(&::redis::Value::Int(60_000)),
            "{reply:?}"
        );
    }
    let exists = server.cli(&["EXISTS", "t:lock:r"]).unwrap();
    assert_eq!(String::from_utf8_lossy(&exists.stdout).trim(), "0");
}

/// The acquire scripts called by hand under a stored quota, without the client's set of held
/// leases (which a client passes only once it knows of a quota): refused with the request for
/// the set, and neither the lock nor the counter written, so no caller skips the quota by
/// leaving the set out.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_acquire_script_without_the_held_set_under_a_quota_writes_nothing() {
    let (server, mut conn) = redis_with_limits("0 2").await;
    for inv in acquire_calls(30_000, false) {
        let reply: Vec<::redis::Value> = inv.invoke_async(&mut conn).await.unwrap();
        assert_eq!(reply.first(), Some(&::redis::Value::Int(4)), "{reply:?}");
    }
    for key in ["t:lock:r", "t:fence:r", "t:queue:r"] {
        let exists = server.cli(&["EXISTS", key]).unwrap();
        assert_eq!(String::from_utf8_lossy(&exists.stdout).trim(), "0", "{key}");
    }
}

/// A file made by a version without the `holder_id` column gets it on first open, and its
/// quota counts from then on.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn sqlite_file_of_an_older_version_gets_the_quota_column() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch(
            "CREATE TABLE fencelock_locks (key TEXT PRIMARY KEY, token INTEGER NOT NULL,
               owner TEXT, boot_id TEXT, expires_at INTEGER, ttl_ms INTEGER, host TEXT,
               pid INTEGER, client TEXT, acquired_at INTEGER, renewed_at INTEGER) WITHOUT ROWID;
             INSERT INTO fencelock_locks (key, token) VALUES ('t:r', 41);",
        )
        .unwrap();
    let engine = open(&format!("sqlite://{}", path.display()), &config())
        .await
        .unwrap()
        .engine;
    engine
        .set_limits(&Limits::default().with_max_held_per_client(1))
        .await
        .unwrap();
    assert_eq!(grant(&*engine, "r", "a").await, FencingToken::new(42));
    let req = AcquireRequest {
        name: "s".into(),
        owner: "b".into(),
        ttl: Duration::from_secs(60),
        meta: HolderMeta::current("holder".into()),
        waits: false,
    };
    assert!(matches!(
        engine.try_acquire(&req).await.unwrap(),
        Attempt::OverQuota { max: 1, .. }
    ));
}
