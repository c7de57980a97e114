//! The compare-and-delete every engine's forced release must be, checked on the engines
//! directly: the public API only ever passes the owner it has just inspected, so the race it
//! guards against cannot be staged through it. One line per engine.

use std::time::{Duration, SystemTime};

use super::open;
use crate::core::engine::{AcquireRequest, Attempt, Engine, EngineConfig};
use crate::core::holder::{Holder, HolderMeta};
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
    }
}

async fn grant(engine: &dyn Engine, name: &str, owner: &str) -> FencingToken {
    let req = AcquireRequest {
        name: name.into(),
        owner: owner.into(),
        ttl: Duration::from_secs(60),
        meta: HolderMeta::current("holder".into()),
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
