//! The lock itself: exclusion, tokens, owner checks, renewal, loss and cancellation.

use std::time::Duration;

use fencelock::{ErrorKind, LockOptions};
use tokio::time::{timeout, Instant};

use super::harness::Harness;
use super::{common, poll_once, Engine, SLACK};

/// Eight clients, five holds each, all wanting one name: no two holds overlap, and tokens rise
/// in the order of the grants.
pub async fn mutual_exclusion<H: Harness>() {
    let engine = Engine::<H>::start().await;
    common::check_mutual_exclusion(&engine.url, 8, 5).await;
}

/// A new client on the same URL (a restarted process) gets a token above every earlier one,
/// whether the earlier lease was released or abandoned to expire.
pub async fn tokens_increase_across_client_restarts<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let mut last = None;
    for round in 0..4 {
        let c = engine.client().await;
        let ttl = H::QUIRKS.short_ttl;
        let opts = LockOptions::default()
            .ttl(ttl)
            .wait(ttl + H::QUIRKS.expiry_lag + SLACK * 4);
        let lease = c.acquire("tokens", &opts).await.unwrap();
        assert!(
            Some(lease.token()) > last,
            "round {round}: token {} after {last:?}",
            lease.token()
        );
        last = Some(lease.token());
        if round % 2 == 0 {
            lease.release().await.unwrap();
        } else {
            drop(lease);
        }
        c.close().await;
    }
}

/// A holder whose lease lapsed (renewal off) is told so when its validity ends, not before and
/// not much later; it can then neither extend nor release its successor's lease, which stays
/// held and renewable.
pub async fn stale_owner_cannot_touch_a_successor<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let a = engine.client().await;
    let b = engine.client().await;
    let ttl = H::QUIRKS.short_ttl;
    let short = LockOptions::default().ttl(ttl).auto_renew(false);
    let old = a.try_acquire("stale", &short).await.unwrap();
    let valid_until = old.valid_until();
    assert!(valid_until <= Instant::now() + ttl);
    let out = timeout(ttl + SLACK * 4, old.run(std::future::pending::<()>()))
        .await
        .expect("the lapsed lease was never reported lost");
    assert_eq!(out.unwrap_err().kind(), ErrorKind::LeaseLost);
    let now = Instant::now();
    // The watchdog gives up one drift allowance (1 % of the TTL + 2 ms) before the deadline,
    // so that a timer woken late still reports the loss inside the window.
    let early = ttl / 100 + Duration::from_millis(2);
    assert!(now + early >= valid_until, "lost before its validity ended");
    assert!(
        now <= valid_until + SLACK,
        "lost {:?} late",
        now - valid_until
    );
    assert!(old.is_lost());

    let wait = ttl + H::QUIRKS.expiry_lag + SLACK * 4;
    let successor = b
        .acquire("stale", &LockOptions::default().wait(wait))
        .await
        .unwrap();
    assert!(successor.token() > old.token());
    assert_eq!(old.extend().await.unwrap_err().kind(), ErrorKind::LeaseLost);
    let e = old.release().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotHolder, "{e}");

    let h = a.inspect("stale").await.unwrap().expect("successor holds");
    assert_eq!(h.owner, successor.owner());
    assert_eq!(h.token, Some(successor.token()));
    successor.extend().await.unwrap();
    successor.release().await.unwrap();
    assert!(a.inspect("stale").await.unwrap().is_none());
}

/// Work lasting ten TTLs runs to the end under a renewing lease, which another client still
/// sees held by the same owner and token.
pub async fn watchdog_keeps_a_lease_for_ten_ttls<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let c = engine.client().await;
    let other = engine.client().await;
    let ttl = H::QUIRKS.short_ttl;
    let lease = c
        .try_acquire("renewed", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    let out = lease.run(tokio::time::sleep(ttl * 10)).await;
    assert!(out.is_ok(), "lease lost while renewing: {out:?}");
    assert!(!lease.is_lost());
    let h = other.inspect("renewed").await.unwrap().expect("held");
    assert_eq!(h.owner, lease.owner());
    assert_eq!(h.token, Some(lease.token()));
    lease.release().await.unwrap();
}

/// The engine goes away under a renewing lease: the lease is reported lost, and work under it
/// cancelled, no later than the end of its last confirmed validity window.
pub async fn loss_is_reported_when_the_engine_goes_away<H: Harness>() {
    let mut engine = Engine::<H>::start().await;
    let c = engine.client().await;
    // Long enough for renewals to be confirmed before the engine goes away.
    let ttl = H::QUIRKS.short_ttl * 2;
    let lease = c
        .try_acquire("doomed", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    engine.take_down();
    // Once lost, `valid_until` is the moment of the loss: the deadline the last confirmed
    // grant or renewal set is the last one read while the lease was not yet lost (read before
    // the check, so that a loss in between cannot slip in).
    let mut valid_until = lease.valid_until();
    let run = lease.run(std::future::pending::<()>());
    tokio::pin!(run);
    let out = timeout(ttl + SLACK * 4, async {
        loop {
            tokio::select! {
                out = &mut run => break out,
                () = tokio::time::sleep(Duration::from_millis(5)) => {
                    let seen = lease.valid_until();
                    if !lease.is_lost() {
                        valid_until = seen;
                    }
                }
            }
        }
    })
    .await
    .expect("the lease outlived its engine");
    assert_eq!(out.unwrap_err().kind(), ErrorKind::LeaseLost);
    let now = Instant::now();
    assert!(
        lease.valid_until() <= now,
        "a lost lease still reports validity"
    );
    let late = now.saturating_duration_since(valid_until);
    assert!(late <= SLACK, "lost {late:?} after its validity ended");
    if H::QUIRKS.loss_before_validity_ends {
        assert!(now < valid_until, "lost only when its validity ended");
    }
    assert!(lease.is_lost());
    assert!(lease.extend().await.is_err());
}

/// Acquires dropped while waiting, at every early point, or in flight on a free lock, and
/// acquires that time out, leave nothing held or queued: once the client's clean-up is done
/// the holder is still the only one, and after its release another client takes the lock at
/// once.
pub async fn cancelled_and_timed_out_acquires_leave_nothing_behind<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let holder = engine.client().await;
    let waiter = engine.client().await;
    let third = engine.client().await;
    let lease = holder
        .try_acquire("busy", &LockOptions::default())
        .await
        .unwrap();

    let long = LockOptions::default().wait(Duration::from_secs(30));
    let waiting = timeout(Duration::from_millis(300), waiter.acquire("busy", &long)).await;
    assert!(waiting.is_err(), "granted while held: {waiting:?}");
    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let e = waiter
        .acquire("busy", &LockOptions::default().wait(wait))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::TimedOut, "{e}");
    assert_eq!(e.holder().map(|h| h.owner.as_str()), Some(lease.owner()));
    assert!(
        started.elapsed() < wait + SLACK * 4,
        "{:?}",
        started.elapsed()
    );
    let e = waiter
        .try_acquire("busy", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother, "{e}");
    for ms in [0, 1, 2, 3, 5, 8, 13] {
        let _ = timeout(Duration::from_millis(ms), waiter.acquire("busy", &long)).await;
    }

    // In flight on free locks: polled once, so sent and then dropped before any answer; then
    // cut at growing delays, before, during and after the engine's answer.
    let opts = LockOptions::default();
    let mut in_flight = 0;
    for i in 0..20 {
        match poll_once(waiter.try_acquire(&format!("flight/{i}"), &opts)).await {
            Some(granted) => granted.unwrap().release().await.unwrap(),
            None => in_flight += 1,
        }
    }
    assert!(
        in_flight >= 5,
        "only {in_flight} of 20 attempts were in flight"
    );
    for i in 0..40u64 {
        let attempt = waiter.try_acquire("flight/again", &opts);
        match timeout(Duration::from_micros(i * 50), attempt).await {
            Ok(Ok(lease)) => lease.release().await.unwrap(),
            // An earlier attempt's grant, whose clean-up has not run yet.
            Ok(Err(e)) => assert_eq!(e.kind(), ErrorKind::HeldByAnother, "{e}"),
            Err(_) => {}
        }
    }
    timeout(Duration::from_secs(10), waiter.close())
        .await
        .expect("clean-up finished");

    let held = third.list("").await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(held[0].resource, "busy");
    assert_eq!(held[0].holder.owner, lease.owner());
    lease.release().await.unwrap();
    let next = third.try_acquire("busy", &opts).await.unwrap();
    assert_eq!(
        third.inspect("busy").await.unwrap().map(|h| h.owner),
        Some(next.owner().to_owned())
    );
    next.release().await.unwrap();
    for i in 0..20 {
        let name = format!("flight/{i}");
        let lease = third.try_acquire(&name, &opts).await.unwrap();
        lease.release().await.unwrap();
    }
    let again = third.try_acquire("flight/again", &opts).await.unwrap();
    again.release().await.unwrap();
    assert!(third.list("").await.unwrap().is_empty());
}
