//! The limits an operator stores in the engine under a prefix: a TTL cap and a per-client
//! quota, refused with their own error kind, for grants and renewals alike.

use std::time::Duration;

use fencelock::{ErrorKind, Limits, LockOptions};

use super::harness::Harness;
use super::{Engine, SLACK};

/// With `max-ttl 1m` and `max-held-per-client 2` stored: a 5-minute TTL is refused by the
/// engine even for a client whose own cap would allow it, and so is the renewal of a lease
/// granted with a longer TTL before the cap; a client's third lease is refused (at once for
/// one attempt, after the wait for a waiter), a waiter gets it once one of the two is
/// released, and another client is not held back. Every node stores the limits; clearing them
/// lifts the refusals.
pub async fn stored_limits_refuse_long_ttls_and_hoarders<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let year = Duration::from_secs(300 * 24 * 3600);
    // Its own cap is far above the engine's: only the engine can refuse it.
    let c = engine
        .builder()
        .client_name("hoarder")
        .max_ttl(year)
        .connect()
        .await
        .unwrap();
    let nodes = c.limits().await.unwrap();
    assert!(!nodes.is_empty());
    assert!(nodes.iter().all(|n| n.limits == Ok(None)), "{nodes:?}");

    let minutes = |m: u64| LockOptions::default().ttl(Duration::from_secs(60 * m));
    let before = c.try_acquire("granted-before", &minutes(2)).await.unwrap();
    let limits = Limits::default()
        .with_max_ttl(Duration::from_secs(60))
        .with_max_held_per_client(2);
    c.set_limits(&limits).await.unwrap();
    let nodes = c.limits().await.unwrap();
    assert!(
        nodes.iter().all(|n| n.limits == Ok(Some(limits))),
        "{nodes:?}"
    );

    let e = c.try_acquire("long", &minutes(5)).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max-ttl = 1m"), "{e}");
    assert!(c.inspect("long").await.unwrap().is_none());
    // Waiting does not help a TTL above the cap: refused at once.
    let e = c
        .acquire("long", &minutes(5).wait(Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");

    // A renewal cannot push a lease granted before the cap past it: refused, not cut short,
    // and the lease keeps the validity it had.
    let e = before.extend().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max-ttl = 1m"), "{e}");
    assert!(!before.is_lost());
    before.release().await.unwrap();

    let ttl = LockOptions::default().ttl(Duration::from_secs(30));
    let first = c.try_acquire("q1", &ttl).await.unwrap();
    let _second = c.try_acquire("q2", &ttl).await.unwrap();
    let e = c.try_acquire("q3", &ttl).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    assert!(e.to_string().contains("max-held-per-client = 2"), "{e}");
    assert!(c.inspect("q3").await.unwrap().is_none());
    let other = engine.named("someone-else").await;
    let theirs = other.try_acquire("q3", &ttl).await.unwrap();
    theirs.release().await.unwrap();
    let same_name = engine.named("hoarder").await;
    let r = same_name.try_acquire("q4", &ttl).await;
    if H::QUIRKS.quota_shared_by_name {
        let e = r.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    } else {
        r.unwrap().release().await.unwrap();
    }

    // A waiter waits for its quota as for a held lock, and gets it once one lease ends.
    let waiter = {
        let c = c.clone();
        let opts = ttl.clone().wait(Duration::from_secs(20));
        tokio::spawn(async move { c.acquire("q3", &opts).await })
    };
    tokio::time::sleep(SLACK).await;
    assert!(!waiter.is_finished(), "the waiter did not wait");
    first.release().await.unwrap();
    let third = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter was not granted after a release")
        .unwrap()
        .unwrap();
    third.release().await.unwrap();

    c.set_limits(&Limits::default()).await.unwrap();
    let nodes = c.limits().await.unwrap();
    assert!(nodes.iter().all(|n| n.limits == Ok(None)), "{nodes:?}");
    // etcd's and ZooKeeper's clients read the limits again at most once a second. Two
    // minutes is above the cleared cap and within the session this client already holds its
    // ZooKeeper leases with (`_second` is still held; the test kit's servers allow 2 min).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    c.try_acquire("long", &minutes(2))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}
