//! Leader election on a real 3-member etcd cluster.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{first_leader, FirstLeader};
use fencelock::{Client, ErrorKind, Leader, LockOptions};
use fencelock_testkit::EtcdCluster;
use tokio::sync::watch;
use tokio::time::timeout;

async fn next_leader(rx: &mut watch::Receiver<Option<Leader>>) -> Option<Leader> {
    timeout(Duration::from_secs(10), rx.changed())
        .await
        .expect("a leader change within 10 s")
        .unwrap();
    rx.borrow_and_update().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn campaign_observe_proclaim_resign() {
    let c = EtcdCluster::start(3).unwrap();
    let FirstLeader {
        second: b,
        observer: watcher,
        observed: election,
        leaders: mut rx,
        first,
        opts,
    } = first_leader(&c.url(), "primary", "a").await;
    let seen = next_leader(&mut rx).await.unwrap();
    assert_eq!((seen.value.as_str(), seen.token), ("a", first.token()));

    // b queues behind a.
    let eb = b.election("primary").unwrap();
    let second = tokio::spawn(async move { eb.campaign("b", &opts).await });
    first.proclaim("a2").await.unwrap();
    assert_eq!(next_leader(&mut rx).await.unwrap().value, "a2");
    assert_eq!(first.value(), "a2");
    assert!(!second.is_finished());
    assert_eq!(election.leader().await.unwrap().unwrap().value, "a2");

    let old_token = first.token();
    first.resign().await.unwrap();
    let second = timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(second.token() > old_token);
    let mut last = next_leader(&mut rx).await;
    // The observer may see the moment between resignation and the next leader.
    if last.is_none() {
        last = next_leader(&mut rx).await;
    }
    let last = last.unwrap();
    assert_eq!((last.value.as_str(), last.token), ("b", second.token()));
    assert_eq!(election.leader().await.unwrap(), Some(last));

    // A lost leadership cannot proclaim.
    let c2 = second;
    c2.lease().extend().await.unwrap();
    let record = watcher
        .force_release(
            "primary",
            &fencelock::ForceRelease::new("test").holder_is_dead(true),
        )
        .await
        .unwrap();
    assert!(record.is_some());
    timeout(Duration::from_secs(3), c2.lost()).await.unwrap();
    assert_eq!(
        c2.proclaim("x").await.unwrap_err().kind(),
        ErrorKind::NotHolder
    );
}

#[tokio::test]
async fn withdrawn_campaigns_leave_no_keys() {
    let c = EtcdCluster::start(3).unwrap();
    let a = Client::connect(&c.url()).await.unwrap();
    let b = Client::connect(&c.url()).await.unwrap();
    let opts = LockOptions::default().wait(Duration::from_secs(30));
    let leader = a.election("e").unwrap().campaign("a", &opts).await.unwrap();
    let eb = b.election("e").unwrap();
    assert!(timeout(Duration::from_millis(400), eb.campaign("b", &opts))
        .await
        .is_err());
    timeout(Duration::from_secs(10), b.close()).await.unwrap();
    let out = c
        .ctl(&["get", "/fencelock/v1/e/", "--prefix", "--keys-only"])
        .unwrap();
    let keys: Vec<_> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    leader.resign().await.unwrap();
}
