//! Elections on the engines without elections of their own (SQLite, Redis, Redlock): a
//! renewed lease whose holder metadata carries the campaign value, observed by polling.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

mod common;

use common::{first_leader, FirstLeader};
use fencelock::ErrorKind;
use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};
use tokio::time::timeout;

async fn check_election(url: &str) {
    let FirstLeader {
        second: b,
        observed: election,
        leaders: mut rx,
        first,
        opts,
        ..
    } = first_leader(url, "leader", "node-a").await;
    timeout(Duration::from_secs(5), rx.changed())
        .await
        .unwrap()
        .unwrap();
    let seen = rx.borrow_and_update().clone().unwrap();
    assert_eq!((seen.value.as_str(), seen.token), ("node-a", first.token()));
    // The value is fixed at campaign time here.
    let e = first.proclaim("node-a2").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");

    let eb = b.election("leader").unwrap();
    let mut second = tokio::spawn(async move { eb.campaign("node-b", &opts).await });
    // b must not lead while a does: its campaign does not end within this window.
    assert!(
        timeout(Duration::from_millis(300), &mut second)
            .await
            .is_err(),
        "b led while a did"
    );
    let old = first.token();
    first.resign().await.unwrap();
    let second = timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(second.token() > old);
    let now = timeout(Duration::from_secs(5), async {
        loop {
            rx.changed().await.unwrap();
            if let Some(l) = rx.borrow_and_update().clone() {
                return l;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!((now.value.as_str(), now.token), ("node-b", second.token()));
    second.resign().await.unwrap();
    assert_eq!(election.leader().await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn election_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    check_election(&format!("sqlite://{}", dir.path().join("e.db").display())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn election_on_redis() {
    let server = RedisServer::start().unwrap();
    check_election(&server.url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn election_on_redlock() {
    let nodes = start_redis_nodes(3).unwrap();
    check_election(&redlock_url(&nodes)).await;
}
