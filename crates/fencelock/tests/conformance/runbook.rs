//! The stuck-lock runbook: inspect, list, forced release and its audit log.

use std::time::Duration;

use fencelock::fence::MemoryFence;
use fencelock::{ErrorKind, ForceRelease, HeldLock, LockOptions, ProcessState, Verdict};
use tokio::time::timeout;

use super::harness::Harness;
use super::{gone_within, Engine, SLACK};

fn long() -> LockOptions {
    LockOptions::default().ttl(Duration::from_secs(60))
}

fn names(locks: Vec<HeldLock>) -> Vec<String> {
    locks.into_iter().map(|l| l.resource).collect()
}

/// `inspect` and `list` on held locks (with the holder's metadata), on expired ones (lapsed,
/// and dropped without release) and on force-released ones; list prefixes are plain strings,
/// also when they hold glob characters.
pub async fn inspect_and_list<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let worker = engine.named("worker").await;
    let ops = engine.client().await;
    let a = worker.try_acquire("jobs/a", &long()).await.unwrap();
    let b = worker.try_acquire("jobs/b", &long()).await.unwrap();
    let other = worker.try_acquire("other", &long()).await.unwrap();
    let glob = worker.try_acquire("g*[x]", &long()).await.unwrap();
    let plain = worker.try_acquire("gZ[x]", &long()).await.unwrap();
    let ttl = H::QUIRKS.short_ttl;
    let lapsing = LockOptions::default().ttl(ttl).auto_renew(false);
    let lapsed = worker.try_acquire("jobs/lapsed", &lapsing).await.unwrap();
    let renewing = LockOptions::default().ttl(ttl);
    let dropped = worker.try_acquire("jobs/dropped", &renewing).await.unwrap();

    let h = ops.inspect("jobs/a").await.unwrap().expect("held");
    assert_eq!(h.owner, a.owner());
    assert_eq!(h.token, Some(a.token()));
    assert_eq!(h.ttl, Some(Duration::from_secs(60)));
    assert!(h.ttl_left <= Some(Duration::from_secs(60)));
    assert_eq!(h.ttl_left.is_some(), H::QUIRKS.ttl_left_known, "{h:?}");
    assert_eq!(h.client.as_deref(), Some("worker"));
    assert_eq!(h.pid, Some(std::process::id()));
    assert!(h.host.as_ref().is_some_and(|h| !h.is_empty()), "{h:?}");
    assert!(h.acquired_at.is_some(), "{h:?}");
    assert_eq!(h.renewed_at.is_some(), H::QUIRKS.renewals_recorded, "{h:?}");
    let verdict = h.assess();
    assert_eq!(verdict.verdict, Verdict::Healthy, "{verdict:?}");
    // The holder is this very process.
    assert_eq!(verdict.process, ProcessState::Running);
    assert!(verdict.looks_alive);
    // Told by the engine's clock (TTL less time left) or by the recorded renewal.
    let knows_renewal = H::QUIRKS.ttl_left_known || H::QUIRKS.renewals_recorded;
    assert_eq!(
        verdict.since_renewal.is_some(),
        knows_renewal,
        "{verdict:?}"
    );
    assert!(verdict.since_renewal < Some(Duration::from_secs(10)));

    let e = ops.try_acquire("jobs/a", &long()).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(e.holder().map(|h| h.owner.as_str()), Some(a.owner()));
    assert!(e.to_string().contains("worker"), "{e}");

    timeout(ttl + SLACK * 4, lapsed.lost()).await.unwrap();
    drop(dropped);
    let lag = ttl + H::QUIRKS.expiry_lag + SLACK;
    for name in ["jobs/lapsed", "jobs/dropped"] {
        assert!(gone_within(&ops, name, lag).await, "{name} is still held");
    }

    let jobs = ops.list("jobs/").await.unwrap();
    assert_eq!(jobs[0].holder.token, Some(a.token()));
    assert_eq!(jobs[1].holder.owner, b.owner());
    assert_eq!(jobs[1].holder.client.as_deref(), Some("worker"));
    assert_eq!(names(jobs), ["jobs/a", "jobs/b"]);
    assert_eq!(
        names(ops.list("").await.unwrap()),
        ["g*[x]", "gZ[x]", "jobs/a", "jobs/b", "other"]
    );
    assert_eq!(names(ops.list("g*").await.unwrap()), ["g*[x]"]);
    assert_eq!(names(ops.list("g*[x]").await.unwrap()), ["g*[x]"]);
    assert!(ops.list("nothing").await.unwrap().is_empty());

    let dead = ForceRelease::new("test").holder_is_dead(true);
    assert!(ops.force_release("jobs/a", &dead).await.unwrap().is_some());
    assert!(ops.inspect("jobs/a").await.unwrap().is_none());
    assert_eq!(names(ops.list("jobs/").await.unwrap()), ["jobs/b"]);

    for lease in [b, other, glob] {
        lease.release().await.unwrap();
    }
    assert_eq!(names(ops.list("").await.unwrap()), ["gZ[x]"]);
    plain.release().await.unwrap();
    assert!(ops.list("").await.unwrap().is_empty());
    assert_eq!(
        ops.list("a\nb").await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
}

/// A forced release is refused while the holder looks alive; declared dead, it deletes the
/// lock, advances the counter past the old token, records who, why and the old holder in the
/// audit log, and the old token is refused by a fence once the next holder has written; the
/// old holder learns of the loss at its next renewal. The log is per prefix.
pub async fn forced_release_is_refused_then_audited_and_fenced<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let worker = engine.named("ledger-writer").await;
    let ops = engine.client().await;
    let ttl = Duration::from_secs(2);
    let old = worker
        .try_acquire("ledger", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    let fence = MemoryFence::new();
    fence.admit("ledger", old.token()).unwrap();

    let refused = ops
        .force_release("ledger", &ForceRelease::new("stuck?"))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::HeldByAnother);
    let msg = refused.to_string();
    assert!(msg.contains("looks alive"), "{msg}");
    assert!(msg.contains("running on this host"), "{msg}");
    assert_eq!(
        refused.holder().map(|h| h.owner.as_str()),
        Some(old.owner())
    );
    assert!(ops.inspect("ledger").await.unwrap().is_some());
    assert!(ops.audit(None).await.unwrap().is_empty());
    assert!(!old.is_lost());

    let request = ForceRelease::new("worker hung on NFS")
        .user("alice")
        .host("ops-box")
        .holder_is_dead(true);
    let old_token = old.token();
    let record = ops
        .force_release("ledger", &request)
        .await
        .unwrap()
        .expect("released");
    assert_eq!(record.resource, "ledger");
    assert_eq!(record.user, "alice");
    assert_eq!(record.host, "ops-box");
    assert_eq!(record.reason, "worker hung on NFS");
    assert!(record.holder_declared_dead);
    assert!(
        record.assessment.contains("running"),
        "{}",
        record.assessment
    );
    assert_eq!(record.holder.owner, old.owner());
    assert_eq!(record.holder.token, Some(old_token));
    assert_eq!(record.holder.pid, Some(std::process::id()));
    assert_eq!(record.holder.client.as_deref(), Some("ledger-writer"));
    assert!(record.holder.host.is_some());
    assert!(record.counter > old_token);
    assert!(ops.inspect("ledger").await.unwrap().is_none());

    // Within one renewal interval (TTL/3) and its call.
    timeout(ttl, old.lost()).await.expect("old holder told");
    assert_eq!(old.extend().await.unwrap_err().kind(), ErrorKind::LeaseLost);

    let next = worker.try_acquire("ledger", &long()).await.unwrap();
    assert!(next.token() > record.counter);
    fence.admit("ledger", next.token()).unwrap();
    let stale = fence.admit("ledger", old_token).unwrap_err();
    assert_eq!(stale.kind(), ErrorKind::StaleToken);
    let e = old.release().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotHolder, "{e}");

    assert_eq!(
        ops.audit(Some("ledger")).await.unwrap(),
        vec![record.clone()]
    );
    assert!(ops.audit(Some("other")).await.unwrap().is_empty());
    let elsewhere = engine
        .builder()
        .prefix("elsewhere:")
        .connect()
        .await
        .unwrap();
    assert!(elsewhere.audit(None).await.unwrap().is_empty());

    // Nothing to release on a free lock; a second release is listed first.
    next.release().await.unwrap();
    assert!(ops
        .force_release("ledger", &request)
        .await
        .unwrap()
        .is_none());
    let again = worker.try_acquire("ledger", &long()).await.unwrap();
    let second = ops
        .force_release("ledger", &request.clone().user("bob"))
        .await
        .unwrap()
        .unwrap();
    assert!(second.counter > again.token());
    let log = ops.audit(None).await.unwrap();
    assert_eq!(
        log.iter().map(|r| r.user.as_str()).collect::<Vec<_>>(),
        ["bob", "alice"]
    );
    assert_eq!(
        ops.force_release("ledger", &ForceRelease::new(""))
            .await
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
    let last = worker.try_acquire("ledger", &long()).await.unwrap();
    assert!(last.token() > second.counter);
    last.release().await.unwrap();
}
