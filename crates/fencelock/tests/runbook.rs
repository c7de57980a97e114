//! The stuck-lock runbook (inspect verdicts, list, forced release, audit) against real engines:
//! a SQLite file, one redis-server and Redlock over three.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::connect;
use fencelock::fence::MemoryFence;
use fencelock::{Client, ErrorKind, ForceRelease, LockOptions, ProcessState, Verdict};
use tokio::time::timeout;

fn long() -> LockOptions {
    LockOptions::default().ttl(Duration::from_secs(60))
}

async fn named(url: &str, client_name: &str) -> Client {
    Client::builder(url)
        .client_name(client_name)
        .connect()
        .await
        .unwrap()
}

/// `list` and `inspect` on held, expired and force-released locks; list prefixes are plain
/// strings, also when they hold glob characters.
async fn check_inspect_and_list(url: &str) {
    let worker = named(url, "worker").await;
    let ops = connect(url).await;
    let a = worker.try_acquire("jobs/a", &long()).await.unwrap();
    let b = worker.try_acquire("jobs/b", &long()).await.unwrap();
    let other = worker.try_acquire("other", &long()).await.unwrap();
    let glob = worker.try_acquire("g*[x]", &long()).await.unwrap();
    let _plain = worker.try_acquire("gZ[x]", &long()).await.unwrap();
    let short = LockOptions::default()
        .ttl(Duration::from_millis(200))
        .auto_renew(false);
    let expired = worker.try_acquire("jobs/expired", &short).await.unwrap();

    let h = ops.inspect("jobs/a").await.unwrap().expect("held");
    assert_eq!(h.owner, a.owner());
    assert_eq!(h.token, Some(a.token()));
    assert_eq!(h.ttl, Some(Duration::from_secs(60)));
    assert_eq!(h.client.as_deref(), Some("worker"));
    let verdict = h.assess();
    assert_eq!(verdict.verdict, Verdict::Healthy, "{verdict:?}");
    // The holder is this very process.
    assert_eq!(verdict.process, ProcessState::Running);
    assert!(verdict.looks_alive);
    assert!(verdict.since_renewal.unwrap() < Duration::from_secs(10));

    timeout(Duration::from_secs(3), expired.lost())
        .await
        .unwrap();
    // The key may outlive the lease's validity by the drift allowance.
    let gone = timeout(Duration::from_secs(3), async {
        while ops.inspect("jobs/expired").await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(gone.is_ok(), "the expired lock is still held");

    let names = |locks: Vec<fencelock::HeldLock>| -> Vec<String> {
        locks.into_iter().map(|l| l.resource).collect()
    };
    let jobs = ops.list("jobs/").await.unwrap();
    assert_eq!(jobs[0].holder.token, Some(a.token()));
    assert_eq!(jobs[1].holder.owner, b.owner());
    assert_eq!(names(jobs), ["jobs/a", "jobs/b"]);
    assert_eq!(
        names(ops.list("").await.unwrap()),
        ["g*[x]", "gZ[x]", "jobs/a", "jobs/b", "other"]
    );
    assert_eq!(names(ops.list("g*").await.unwrap()), ["g*[x]"]);
    assert_eq!(names(ops.list("g*[x]").await.unwrap()), ["g*[x]"]);
    assert!(ops.list("nothing").await.unwrap().is_empty());

    let forced = ops
        .force_release("jobs/a", &ForceRelease::new("test").holder_is_dead(true))
        .await
        .unwrap();
    assert!(forced.is_some());
    assert!(ops.inspect("jobs/a").await.unwrap().is_none());
    assert_eq!(names(ops.list("jobs/").await.unwrap()), ["jobs/b"]);

    for lease in [b, other, glob] {
        lease.release().await.unwrap();
    }
    assert_eq!(names(ops.list("").await.unwrap()), ["gZ[x]"]);
    assert_eq!(
        ops.list("a\nb").await.unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
}

/// A forced release is refused while the holder looks alive, then (declared dead) deletes the
/// lock, advances the counter past the old token, records who, why and the old holder, and
/// makes the old token stale at a fence; the old holder learns at its next renewal.
async fn check_forced_release(url: &str) {
    let worker = named(url, "ledger-writer").await;
    let ops = connect(url).await;
    let old = worker
        .try_acquire(
            "ledger",
            &LockOptions::default().ttl(Duration::from_secs(2)),
        )
        .await
        .unwrap();

    let refused = ops
        .force_release("ledger", &ForceRelease::new("stuck?"))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::HeldByAnother);
    assert!(refused.to_string().contains("looks alive"), "{refused}");
    assert!(
        refused.to_string().contains("running on this host"),
        "{refused}"
    );
    assert_eq!(
        refused.holder().map(|h| h.owner.as_str()),
        Some(old.owner())
    );
    assert!(ops.inspect("ledger").await.unwrap().is_some());
    assert!(ops.audit(None).await.unwrap().is_empty());

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
    assert_eq!(record.holder.token, Some(old.token()));
    assert_eq!(record.holder.pid, Some(std::process::id()));
    assert_eq!(record.holder.client.as_deref(), Some("ledger-writer"));
    assert!(record.holder.host.is_some());
    assert!(record.counter > old.token());
    assert!(ops.inspect("ledger").await.unwrap().is_none());

    // The old holder's next renewal (TTL/3) finds the key gone.
    timeout(Duration::from_secs(3), old.lost()).await.unwrap();
    assert_eq!(old.extend().await.unwrap_err().kind(), ErrorKind::LeaseLost);
    assert_eq!(
        old.release().await.unwrap_err().kind(),
        ErrorKind::NotHolder
    );

    let next = worker.try_acquire("ledger", &long()).await.unwrap();
    assert!(
        next.token() > record.counter,
        "{} <= {}",
        next.token(),
        record.counter
    );
    let fence = MemoryFence::new();
    fence.admit("ledger", next.token()).unwrap();
    let stale = fence.admit("ledger", old_token).unwrap_err();
    assert_eq!(stale.kind(), ErrorKind::StaleToken);

    let log = ops.audit(Some("ledger")).await.unwrap();
    assert_eq!(log, vec![record.clone()]);
    assert!(ops.audit(Some("other")).await.unwrap().is_empty());

    // A second one, newest first; nothing to release on a free lock.
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
}

mod sqlite {
    use super::*;

    fn url(dir: &tempfile::TempDir) -> String {
        format!("sqlite://{}/locks.db", dir.path().display())
    }

    #[tokio::test]
    async fn inspect_and_list() {
        let dir = tempfile::tempdir().unwrap();
        check_inspect_and_list(&url(&dir)).await;
    }

    #[tokio::test]
    async fn forced_release() {
        let dir = tempfile::tempdir().unwrap();
        check_forced_release(&url(&dir)).await;
    }

    /// Audit records stay with their prefix, like the locks.
    #[tokio::test]
    async fn audit_is_per_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let a = Client::builder(url(&dir))
            .prefix("a:")
            .connect()
            .await
            .unwrap();
        let b = Client::builder(url(&dir))
            .prefix("b:")
            .connect()
            .await
            .unwrap();
        let lease = a.try_acquire("x", &long()).await.unwrap();
        a.force_release("x", &ForceRelease::new("t").holder_is_dead(true))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.audit(None).await.unwrap().len(), 1);
        assert!(b.audit(None).await.unwrap().is_empty());
        assert!(b.audit(Some("x")).await.unwrap().is_empty());
        drop(lease);
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};

    fn cli(server: &RedisServer, args: &[&str]) -> String {
        let out = server.cli(args).unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    #[tokio::test]
    async fn inspect_and_list_one_node() {
        let server = RedisServer::start().unwrap();
        check_inspect_and_list(&server.url()).await;
    }

    #[tokio::test]
    async fn inspect_and_list_redlock() {
        let nodes = start_redis_nodes(3).unwrap();
        check_inspect_and_list(&redlock_url(&nodes)).await;
    }

    #[tokio::test]
    async fn forced_release_one_node() {
        let server = RedisServer::start().unwrap();
        check_forced_release(&server.url()).await;
    }

    #[tokio::test]
    async fn forced_release_redlock() {
        let nodes = start_redis_nodes(3).unwrap();
        check_forced_release(&redlock_url(&nodes)).await;
    }

    /// A lock held on a minority of nodes is not a lock: `list` leaves it out, as `inspect`
    /// does.
    #[tokio::test]
    async fn redlock_list_counts_only_majority_holds() {
        let nodes = start_redis_nodes(3).unwrap();
        let c = connect(&redlock_url(&nodes)).await;
        let key = c.keys_for("minor").unwrap()[0].1.clone();
        assert_eq!(cli(&nodes[0], &["SET", &key, "x", "PX", "60000"]), "OK");
        let held = c.try_acquire("major", &long()).await.unwrap();
        let listed: Vec<String> = c
            .list("")
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.resource)
            .collect();
        assert_eq!(listed, ["major"]);
        held.release().await.unwrap();
    }

    /// With one node of three down, the forced release still reaches a majority; with two
    /// down it fails clearly, leaving the lock to a later attempt.
    #[tokio::test]
    async fn redlock_forced_release_needs_a_majority() {
        let mut nodes = start_redis_nodes(3).unwrap();
        let url = redlock_url(&nodes);
        let worker = connect(&url).await;
        let ops = Client::builder(&url)
            .op_timeout(Duration::from_millis(500))
            .connect()
            .await
            .unwrap();
        let dead = ForceRelease::new("node maintenance").holder_is_dead(true);
        let old = worker.try_acquire("r", &long()).await.unwrap();
        nodes[2].kill();
        let record = ops.force_release("r", &dead).await.unwrap().unwrap();
        assert!(record.counter > old.token());
        let next = worker.try_acquire("r", &long()).await.unwrap();
        assert!(next.token() > record.counter);
        assert_eq!(ops.audit(Some("r")).await.unwrap(), vec![record]);

        nodes[1].kill();
        let e = ops.force_release("r", &dead).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Engine, "{e}");
    }

    /// Nodes whose counters disagree (one ahead, as after a clock step): the forced release
    /// raises the others to the highest mark, so the next grant is above it, and the audit log
    /// reports that mark once.
    #[tokio::test]
    async fn redlock_forced_release_raises_the_mark_on_a_majority() {
        let nodes = start_redis_nodes(3).unwrap();
        let url = redlock_url(&nodes);
        let c = connect(&url).await;
        let old = c.try_acquire("r", &long()).await.unwrap();
        let fence_key = c
            .keys_for("r")
            .unwrap()
            .into_iter()
            .find(|(label, _)| *label == "fence")
            .unwrap()
            .1;
        let ahead = old.token().get() + 10_000_000_000_000;
        assert_eq!(
            cli(&nodes[0], &["SET", &fence_key, &ahead.to_string()]),
            "OK"
        );
        let record = c
            .force_release("r", &ForceRelease::new("t").holder_is_dead(true))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(record.counter.get(), ahead + 1);
        for n in &nodes {
            let counter: u64 = cli(n, &["GET", &fence_key]).parse().unwrap();
            assert!(counter > ahead, "a node was left below the mark: {counter}");
        }
        assert_eq!(c.audit(None).await.unwrap(), vec![record.clone()]);
        let next = c.try_acquire("r", &long()).await.unwrap();
        assert!(next.token() > record.counter);
    }
}
