//! What only the Redis and Redlock engines do, against real redis-server processes: interop
//! with plain `SET NX PX`, fair queues and handoffs, wake-ups, node loss, hangs and restarts,
//! and the runbook where a Redlock majority matters. What every engine does is in the
//! conformance suite.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{check_mutual_exclusion, check_mutual_exclusion_with, connect};

use fencelock::{Client, ErrorKind, ForceRelease, LockOptions};
use fencelock_testkit::{backend_url, redlock_url, start_redis_nodes, wait_until, RedisServer};
use tokio::time::{timeout, Instant};

fn cli(server: &RedisServer, args: &[&str]) -> String {
    let out = server.cli(args).unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Fair mode, where releases hand the lock over on one node; a TTL above the queue entry's
/// life (6 s here) makes every handed-over grant a cut one that renews early.
fn fair_contention() -> LockOptions {
    LockOptions::default()
        .fair(true)
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(30))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_one_node_fair() {
    let server = RedisServer::start().unwrap();
    check_mutual_exclusion_with(&server.url(), 12, 10, fair_contention()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_redlock_three_nodes_fair() {
    let nodes = start_redis_nodes(3).unwrap();
    check_mutual_exclusion_with(&redlock_url(&nodes), 8, 6, fair_contention()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_exclusion_redlock_five_nodes() {
    let nodes = start_redis_nodes(5).unwrap();
    check_mutual_exclusion(&redlock_url(&nodes), 8, 6).await;
}

#[tokio::test]
async fn minority_grant_is_rolled_back_on_every_node() {
    let nodes = start_redis_nodes(3).unwrap();
    let c = connect(&redlock_url(&nodes)).await;
    let key = c.keys_for("r").unwrap()[0].1.clone();
    // Another owner holds the key on two nodes: this client can only win the third.
    for n in &nodes[..2] {
        assert_eq!(cli(n, &["SET", &key, "other", "NX", "PX", "10000"]), "OK");
    }
    let e = c
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(e.holder().map(|h| h.owner.as_str()), Some("other"));
    assert_eq!(
        cli(&nodes[2], &["EXISTS", &key]),
        "0",
        "minority grant left behind"
    );
    for n in &nodes[..2] {
        assert_eq!(cli(n, &["GET", &key]), "other");
    }
}

#[tokio::test]
async fn redlock_survives_one_dead_node_and_fails_clearly_without_quorum() {
    let mut nodes = start_redis_nodes(3).unwrap();
    let c = connect(&redlock_url(&nodes)).await;
    nodes[0].kill();
    let mut last = 0;
    for _ in 0..5 {
        let lease = c.try_acquire("r", &LockOptions::default()).await.unwrap();
        assert!(lease.token().get() > last);
        last = lease.token().get();
        lease.release().await.unwrap();
    }
    nodes[1].kill();
    let wait = Duration::from_millis(700);
    let started = Instant::now();
    let e = c
        .acquire("r", &LockOptions::default().wait(wait))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Engine);
    assert!(e.to_string().contains("only 1 of 3 nodes granted"), "{e}");
    // Fails at its wait deadline, bounded by one more per-node timeout, not later.
    assert!(
        started.elapsed() < wait + Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_hung_node_does_not_stall_acquire_past_its_node_timeout() {
    let nodes = start_redis_nodes(3).unwrap();
    let c = connect(&redlock_url(&nodes)).await;
    // Warm the connections so the pause hits requests, not connection set-up.
    c.try_acquire("warm", &LockOptions::default())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    nodes[2].pause().unwrap();
    let ttl = Duration::from_secs(2);
    let started = Instant::now();
    let lease = c
        .try_acquire("r", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    let took = started.elapsed();
    // Per-node timeout for a 2 s TTL is 100 ms (TTL / 20); allow scheduling slack.
    assert!(took < Duration::from_millis(600), "acquire took {took:?}");
    assert!(lease.time_left() > ttl / 2);
    nodes[2].resume().unwrap();
    lease.release().await.unwrap();
}

/// A release with one node stopped (SIGSTOP) returns once the majority released, not after the
/// hung node's operation timeout. The lock is free at once (a majority no longer holds it);
/// the stopped node, which was not waited for, keeps its copy until the TTL ends.
#[tokio::test]
async fn a_hung_node_does_not_hold_up_a_release() {
    let nodes = start_redis_nodes(3).unwrap();
    let c = Client::builder(redlock_url(&nodes))
        .op_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap();
    let lease = c
        .try_acquire("r", &LockOptions::default().ttl(Duration::from_secs(30)))
        .await
        .unwrap();
    nodes[2].pause().unwrap();
    let started = Instant::now();
    lease.release().await.unwrap();
    let took = started.elapsed();
    nodes[2].resume().unwrap();
    assert!(took < Duration::from_secs(2), "release took {took:?}");
    let key = c.keys_for("r").unwrap()[0].1.clone();
    let pttl: i64 = cli(&nodes[2], &["PTTL", &key]).parse().unwrap();
    assert!(
        pttl <= 30_000,
        "the stopped node's copy must expire, PTTL {pttl}"
    );
    assert!(c.inspect("r").await.unwrap().is_none());
    let next = c.try_acquire("r", &LockOptions::default()).await.unwrap();
    next.release().await.unwrap();
}

#[tokio::test]
async fn tokens_increase_across_a_restart_without_persistence_one_node() {
    let mut server = RedisServer::start().unwrap();
    let c = connect(&server.url()).await;
    let first = c.try_acquire("r", &LockOptions::default()).await.unwrap();
    let t1 = first.token();
    first.release().await.unwrap();
    server.restart().unwrap();
    let after = connect(&server.url()).await;
    let second = after
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    assert!(second.token() > t1, "{} <= {t1}", second.token());
    second.release().await.unwrap();
}

#[tokio::test]
async fn tokens_increase_across_restarts_of_every_node_redlock() {
    let mut nodes = start_redis_nodes(3).unwrap();
    let url = redlock_url(&nodes);
    let c = connect(&url).await;
    let first = c.try_acquire("r", &LockOptions::default()).await.unwrap();
    let t1 = first.token();
    first.release().await.unwrap();
    for n in &mut nodes {
        n.restart().unwrap();
    }
    // A fresh client has not seen the old node ids, so nothing sits out.
    let after = connect(&url).await;
    let second = after
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    assert!(second.token() > t1, "{} <= {t1}", second.token());
    second.release().await.unwrap();
}

#[tokio::test]
async fn a_restarted_node_sits_out_for_one_maximum_ttl() {
    let mut nodes = start_redis_nodes(3).unwrap();
    let max_ttl = Duration::from_secs(2);
    let c = Client::builder(redlock_url(&nodes))
        .max_ttl(max_ttl)
        .connect()
        .await
        .unwrap();
    let opts = LockOptions::default().ttl(Duration::from_secs(1));
    c.try_acquire("r", &opts)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    nodes[2].restart().unwrap();
    nodes[0].kill();
    // Node 1 grants, the restarted node 2 grants but must not count: no quorum.
    let detected = Instant::now();
    let e = c.try_acquire("r", &opts).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");
    let lease = c
        .acquire("r", &opts.clone().wait(Duration::from_secs(6)))
        .await
        .unwrap();
    assert!(
        detected.elapsed() >= max_ttl - Duration::from_millis(100),
        "the restarted node voted after {:?}",
        detected.elapsed()
    );
    lease.release().await.unwrap();
}

#[tokio::test]
async fn plain_set_nx_px_and_fencelock_exclude_each_other() {
    let server = RedisServer::start().unwrap();
    let c = connect(&server.url()).await;
    let key = c.keys_for("job").unwrap()[0].1.clone();
    assert_eq!(key, "fencelock:v1:lock:job");

    assert_eq!(
        cli(&server, &["SET", &key, "php-worker-7", "NX", "PX", "5000"]),
        "OK"
    );
    let e = c
        .try_acquire("job", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(e.holder().unwrap().owner, "php-worker-7");
    assert!(e.holder().unwrap().ttl_left.unwrap() <= Duration::from_secs(5));
    // The refusal left the other client's value as it wrote it: it still releases by it.
    assert_eq!(cli(&server, &["GET", &key]), "php-worker-7");
    assert_eq!(cli(&server, &["DEL", &key]), "1");

    let lease = c.try_acquire("job", &LockOptions::default()).await.unwrap();
    // The value's first line is the owner; the rest is the holder's metadata.
    let value = cli(&server, &["GET", &key]);
    assert_eq!(value.lines().next(), Some(lease.owner()));
    assert_eq!(
        cli(&server, &["SET", &key, "php-worker-7", "NX", "PX", "5000"]),
        ""
    );
    lease.release().await.unwrap();
    assert_eq!(
        cli(&server, &["SET", &key, "php-worker-7", "NX", "PX", "5000"]),
        "OK"
    );
}

#[tokio::test]
async fn lookalike_names_never_interfere() {
    let server = RedisServer::start().unwrap();
    let c = connect(&server.url()).await;
    let names = ["a", "a:fence", "{a}", "a}", "fence:a", "a:meta"];
    let mut leases = Vec::new();
    for n in names {
        leases.push(c.try_acquire(n, &LockOptions::default()).await.unwrap());
    }
    for (n, l) in names.iter().zip(&leases) {
        let h = c.inspect(n).await.unwrap().unwrap();
        assert_eq!(h.owner, l.owner(), "{n}");
        assert_eq!(h.token, Some(l.token()), "{n}");
    }
    let a = leases.remove(0);
    a.release().await.unwrap();
    for (n, l) in names[1..].iter().zip(&leases) {
        assert_eq!(c.inspect(n).await.unwrap().unwrap().owner, l.owner(), "{n}");
    }
    for l in leases {
        l.release().await.unwrap();
    }
}

#[tokio::test]
async fn release_wakes_a_waiter_without_waiting_out_its_backoff() {
    let server = RedisServer::start().unwrap();
    let holder = connect(&server.url()).await;
    let waiter = connect(&server.url()).await;
    let lease = holder
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    // Without wake-ups this waiter would sleep 3 s between attempts.
    let opts = LockOptions::default()
        .wait(Duration::from_secs(10))
        .backoff(Duration::from_secs(3), Duration::from_secs(3));
    let waiting = tokio::spawn(async move {
        let l = waiter.acquire("r", &opts).await.unwrap();
        let at = Instant::now();
        l.release().await.unwrap();
        at
    });
    // Let the waiter make its first attempt and start sleeping.
    let key = holder.keys_for("r").unwrap()[0].1.clone();
    let srv = &server;
    assert!(wait_until(Duration::from_secs(5), || {
        cli(srv, &["INFO", "commandstats"]).contains("cmdstat_evalsha:calls=2")
    }));
    let released = Instant::now();
    lease.release().await.unwrap();
    let acquired = timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap();
    assert!(
        acquired - released < Duration::from_secs(1),
        "waiter took {:?} after the release",
        acquired - released
    );
    assert_eq!(cli(&server, &["EXISTS", &key]), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fair_mode_grants_in_arrival_order() {
    fair_order_on(&start_redis_nodes(1).unwrap()).await;
}

/// Redlock: every node must order the waiters alike, or nodes with different queue heads split
/// their votes and a waiter that won on a minority would start again at the back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fair_mode_grants_in_arrival_order_on_redlock() {
    fair_order_on(&start_redis_nodes(3).unwrap()).await;
}

/// A release returns once a quorum released, and the node that answers last still gets it: here
/// a node that forgot the scripts (as after a restart with its data kept), whose release takes
/// three round trips (the refused digest, the load, the call) where the others take one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_reaches_the_node_that_answers_last() {
    let nodes = start_redis_nodes(3).unwrap();
    let c = connect(&backend_url(&nodes)).await;
    let key = c.keys_for("late").unwrap()[0].1.clone();
    for _ in 0..5 {
        let lease = c
            .try_acquire("late", &LockOptions::default())
            .await
            .unwrap();
        assert_eq!(cli(&nodes[2], &["SCRIPT", "FLUSH"]), "OK");
        lease.release().await.unwrap();
        // Without it, the node would hold the lock for its 30 s TTL.
        assert!(wait_until(Duration::from_secs(5), || cli(
            &nodes[2],
            &["EXISTS", &key]
        ) == "0"));
    }
}

async fn fair_order_on(nodes: &[RedisServer]) {
    let url = backend_url(nodes);
    let holder = connect(&url).await;
    let lease = holder
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    let queue = holder.keys_for("r").unwrap()[2].1.clone();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let c = connect(&url).await;
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let opts = LockOptions::default()
                .fair(true)
                .wait(Duration::from_secs(20));
            let l = c.acquire("r", &opts).await.unwrap();
            order.lock().unwrap().push(i);
            l.release().await.unwrap();
        }));
        // The next waiter arrives only once this one is queued on every node.
        let q = queue.clone();
        assert!(wait_until(Duration::from_secs(5), || {
            nodes
                .iter()
                .all(|n| cli(n, &["ZCARD", &q]) == (i + 1).to_string())
        }));
    }
    lease.release().await.unwrap();
    for t in tasks {
        timeout(Duration::from_secs(20), t).await.unwrap().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
    // A release returns once a quorum released; the last node's part may still be on its way
    // (it is not abandoned: see `a_release_reaches_the_node_that_answers_last`).
    for n in nodes {
        assert!(wait_until(Duration::from_secs(5), || cli(
            n,
            &["ZCARD", &queue]
        ) == "0"));
    }
}

/// Script calls (EVALSHA and EVAL) the server has run so far.
fn script_calls(server: &RedisServer) -> u64 {
    cli(server, &["INFO", "commandstats"])
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Waits until `n` waiters stand in the FIFO queue key `queue`.
fn await_queued(server: &RedisServer, queue: &str, n: usize) {
    assert!(
        wait_until(Duration::from_secs(5), || cli(server, &["ZCARD", queue])
            == n.to_string()),
        "{n} waiters never stood in {queue}"
    );
}

/// A client holding `r`, after one acquire and release that loaded the scripts, so that counting
/// calls afterwards counts no first NOSCRIPT try.
async fn warm_holder_of_r(server: &RedisServer) -> (Client, fencelock::Lease) {
    let holder = connect(&server.url()).await;
    let warm = holder.try_acquire("warm", &LockOptions::default()).await;
    warm.unwrap().release().await.unwrap();
    let lease = holder
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    (holder, lease)
}

/// A fair waiter's options whose own retries come 4 s apart: only a handoff grants it sooner.
/// Its queue entry lives 4 backoffs plus the test clients' operation timeout (5 s): 21 s.
fn slow_fair_waiter() -> LockOptions {
    LockOptions::default()
        .fair(true)
        .wait(Duration::from_secs(30))
        .backoff(Duration::from_secs(4), Duration::from_secs(4))
}

/// `waiter` waiting for `r` with `opts` in a task of its own, which keeps the client alive
/// with the lease.
fn spawn_waiter(
    waiter: Client,
    opts: LockOptions,
) -> tokio::task::JoinHandle<fencelock::Result<(fencelock::Lease, Client)>> {
    spawn_named_waiter(waiter, "r", opts)
}

/// [`spawn_waiter`] on `name`.
fn spawn_named_waiter(
    waiter: Client,
    name: &'static str,
    opts: LockOptions,
) -> tokio::task::JoinHandle<fencelock::Result<(fencelock::Lease, Client)>> {
    tokio::spawn(async move { waiter.acquire(name, &opts).await.map(|l| (l, waiter)) })
}

/// The lease and client of a `spawn_waiter` task, which must have been handed the lock within
/// `within`.
async fn handed(
    waiting: tokio::task::JoinHandle<fencelock::Result<(fencelock::Lease, Client)>>,
    within: Duration,
) -> (fencelock::Lease, Client) {
    timeout(within, waiting)
        .await
        .expect("the waiter was handed the lock")
        .unwrap()
        .unwrap()
}

/// A waiter that died while queued is passed over by the handoff: its entry, at the head of the
/// queue and expired, is pruned and the lock goes to the live waiter behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_passes_over_an_expired_queue_head() {
    let server = RedisServer::start().unwrap();
    let (holder, first) = warm_holder_of_r(&server).await;
    let keys = holder.keys_for("r").unwrap();
    let label = |l: &str| keys.iter().find(|(k, _)| *k == l).unwrap().1.clone();
    let (queue, qexp) = (label("queue"), label("qexp"));
    let waiting = spawn_waiter(connect(&server.url()).await, slow_fair_waiter());
    await_queued(&server, &queue, 1);
    // Then a dead waiter ahead of it (place 0), whose entry expired long ago: a queued attempt
    // would have pruned it, and the live waiter makes none before the release.
    let dead = "0".repeat(32);
    assert_eq!(cli(&server, &["ZADD", &queue, "0", &dead]), "1");
    assert_eq!(cli(&server, &["ZADD", &qexp, "1", &dead]), "1");
    first.release().await.unwrap();
    let (second, _waiter) = handed(waiting, Duration::from_secs(3)).await;
    assert_eq!(
        holder.inspect("r").await.unwrap().map(|h| h.owner),
        Some(second.owner().to_owned())
    );
    assert_eq!(cli(&server, &["ZCARD", &queue]), "0");
    assert_eq!(cli(&server, &["ZSCORE", &qexp, &dead]), "");
    second.release().await.unwrap();
}

/// On Redlock a release wakes its own client's oldest fair waiter as it is sent, without
/// waiting for the nodes' announcements. That early retry never takes the lock from the head of
/// the queue: here another client's waiter queued first, and is granted first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redlock_release_wakes_its_own_fair_waiter_never_ahead_of_the_queue() {
    let nodes = start_redis_nodes(3).unwrap();
    let url = backend_url(&nodes);
    let holder = connect(&url).await;
    let queue = holder.keys_for("r").unwrap()[2].1.clone();
    let queued = |n: usize| {
        let counts = || {
            nodes
                .iter()
                .map(|s| cli(s, &["ZCARD", &queue]))
                .collect::<Vec<_>>()
        };
        assert!(
            wait_until(Duration::from_secs(5), || counts()
                .iter()
                .all(|c| *c == n.to_string())),
            "{n} waiters never stood in every node's queue: {:?}",
            counts()
        );
    };
    let lease = holder
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    let other = spawn_waiter(connect(&url).await, slow_fair_waiter());
    queued(1);
    let own = spawn_waiter(holder.clone(), slow_fair_waiter());
    queued(2);
    lease.release().await.unwrap();
    // Both waiters retry only every 4 s on their own: the announcements wake the head.
    let (first, _other) = handed(other, Duration::from_secs(3)).await;
    assert!(!own.is_finished());
    let first_token = first.token();
    first.release().await.unwrap();
    let (second, _holder) = handed(own, Duration::from_secs(3)).await;
    assert!(second.token() > first_token);
    second.release().await.unwrap();
    // A node whose part of a release came after a waiter's grant on the others still lists
    // that waiter until its own release takes it out.
    queued(0);
}

/// Every key of a FIFO queue expires on its own, within three entry windows, also when the
/// queue emptied and its keys were made again beside a sequence that outlived them: the queue's
/// keys are extended together, when the expiry set's time left runs low.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_queue_keys_always_expire() {
    let server = RedisServer::start().unwrap();
    let (holder, mut lease) = warm_holder_of_r(&server).await;
    let keys = holder.keys_for("r").unwrap();
    let label = |l: &str| keys.iter().find(|(k, _)| *k == l).unwrap().1.clone();
    let queued = ["queue", "qexp", "qseq", "qinfo"].map(label);
    // The entry window of a `slow_fair_waiter`.
    let window_ms = 21_000;
    for round in 0..2 {
        let waiting = spawn_waiter(connect(&server.url()).await, slow_fair_waiter());
        await_queued(&server, &queued[0], 1);
        for key in &queued {
            let pttl: i64 = cli(&server, &["PTTL", key]).parse().unwrap();
            assert!(
                pttl > 0 && pttl <= 3 * window_ms,
                "round {round}: {key} has PTTL {pttl}"
            );
        }
        lease.release().await.unwrap();
        let (next, waiter) = handed(waiting, Duration::from_secs(5)).await;
        // The queue emptied: its keys are gone but the sequence, which lives on its TTL.
        assert_eq!(
            cli(&server, &["EXISTS", &queued[0], &queued[1], &queued[3]]),
            "0"
        );
        next.release().await.unwrap();
        drop(waiter);
        lease = holder
            .try_acquire("r", &LockOptions::default())
            .await
            .unwrap();
    }
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_the_fair_queue_head_without_another_attempt() {
    let server = RedisServer::start().unwrap();
    let (holder, first) = warm_holder_of_r(&server).await;
    let waiter = connect(&server.url()).await;
    let keys = holder.keys_for("r").unwrap();
    let (lock, queue) = (keys[0].1.clone(), keys[2].1.clone());
    // The waiter's next attempt would come seconds later; its queue entry lives 4 backoffs
    // plus the operation timeout (21 s), less than the TTL, so the grant's expiry is cut.
    let ttl = Duration::from_secs(60);
    let opts = LockOptions::default()
        .ttl(ttl)
        .fair(true)
        .wait(Duration::from_secs(60))
        .backoff(Duration::from_secs(4), Duration::from_secs(4));
    let waiting = tokio::spawn(async move {
        let lease = waiter.acquire("r", &opts).await.unwrap();
        (lease, waiter)
    });
    await_queued(&server, &queue, 1);
    let before = script_calls(&server);
    let first_token = first.token();
    first.release().await.unwrap();
    let (second, _waiter) = timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap();
    // The release granted it: the waiter sent nothing between the release and its lease.
    assert_eq!(script_calls(&server) - before, 1);
    assert!(second.token() > first_token);
    assert_eq!(
        cli(&server, &["GET", &lock]).lines().next(),
        Some(second.owner())
    );
    assert_eq!(cli(&server, &["ZCARD", &queue]), "0");
    let holder_now = holder.inspect("r").await.unwrap().unwrap();
    assert_eq!(holder_now.token, Some(second.token()));
    // The grant's expiry was cut to the waiter's queue entry; the watchdog renews it to the
    // full TTL well before the cut runs out.
    let pttl = |s: &RedisServer| cli(s, &["PTTL", &lock]).parse::<u64>().unwrap();
    assert!(pttl(&server) <= 21_000, "grant expiry {} ms", pttl(&server));
    assert!(second.time_left() < ttl / 2);
    assert!(wait_until(Duration::from_secs(10), || pttl(&server) > 50_000));
    assert!(wait_until(Duration::from_secs(5), || second.time_left() > ttl / 2));
    second.release().await.unwrap();
    assert_eq!(cli(&server, &["EXISTS", &lock]), "0");
}

/// Calls of one command the server has run so far, those inside scripts included.
fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:calls=");
    cli(server, &["INFO", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoffs_chain_through_every_queued_fair_waiter() {
    let server = RedisServer::start().unwrap();
    let (holder, first) = warm_holder_of_r(&server).await;
    let keys = holder.keys_for("r").unwrap();
    let queue = keys[2].1.clone();
    // Only handoffs can finish the chain within the 3 s allowed below.
    let opts = slow_fair_waiter();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..3 {
        let c = connect(&server.url()).await;
        let (opts, order) = (opts.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let l = c.acquire("r", &opts).await.unwrap();
            order.lock().unwrap().push(i);
            l.release().await.unwrap();
        }));
        await_queued(&server, &queue, i + 1);
    }
    let before = script_calls(&server);
    first.release().await.unwrap();
    timeout(Duration::from_secs(3), async {
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await
    .expect("every waiter got the lock by handoff, without its own retry");
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
    // Four releases and nothing else: each release handed the lock to the next waiter.
    assert_eq!(script_calls(&server) - before, 4);
    assert_eq!(cli(&server, &["ZCARD", &queue]), "0");
    assert!(holder.inspect("r").await.unwrap().is_none());
}

#[tokio::test]
async fn a_release_publishes_only_when_someone_waits() {
    let server = RedisServer::start().unwrap();
    let a = connect(&server.url()).await;
    let b = connect(&server.url()).await;
    for _ in 0..20 {
        let l = a.try_acquire("r", &LockOptions::default()).await.unwrap();
        l.release().await.unwrap();
    }
    assert_eq!(command_calls(&server, "publish"), 0);
    let l = a.try_acquire("r", &LockOptions::default()).await.unwrap();
    let refused = b.try_acquire("r", &LockOptions::default()).await;
    assert_eq!(refused.unwrap_err().kind(), ErrorKind::HeldByAnother);
    l.release().await.unwrap();
    assert_eq!(command_calls(&server, "publish"), 1);
    // The refused attempt's flag went with that release: the next holder's release is quiet.
    let l = b.try_acquire("r", &LockOptions::default()).await.unwrap();
    l.release().await.unwrap();
    assert_eq!(command_calls(&server, "publish"), 1);
}

#[tokio::test]
async fn a_cancelled_fair_waiter_leaves_no_queue_entry() {
    let server = RedisServer::start().unwrap();
    let holder = connect(&server.url()).await;
    let waiter = connect(&server.url()).await;
    let lease = holder
        .try_acquire("r", &LockOptions::default())
        .await
        .unwrap();
    let queue = holder.keys_for("r").unwrap()[2].1.clone();
    let opts = LockOptions::default()
        .fair(true)
        .wait(Duration::from_secs(30));
    let waiting = waiter.acquire("r", &opts);
    assert!(timeout(Duration::from_millis(300), waiting).await.is_err());
    waiter.close().await;
    assert_eq!(cli(&server, &["ZCARD", &queue]), "0");
    lease.release().await.unwrap();
    assert!(holder.inspect("r").await.unwrap().is_none());
}

#[tokio::test]
async fn renewals_are_batched_into_one_call_per_tick() {
    let server = RedisServer::start().unwrap();
    let c = connect(&server.url()).await;
    let ttl = Duration::from_millis(600);
    let mut leases = Vec::new();
    for i in 0..300 {
        leases.push(
            c.try_acquire(&format!("r{i}"), &LockOptions::default().ttl(ttl))
                .await
                .unwrap(),
        );
    }
    let before = script_calls(&server);
    tokio::time::sleep(ttl * 4).await;
    let during = script_calls(&server) - before;
    // Four TTLs are twelve renewal ticks; one call per lease would be 3,600.
    assert!(during <= 40, "{during} script calls renewing 300 leases");
    for l in &leases {
        assert!(!l.is_lost());
    }
    for l in leases {
        l.release().await.unwrap();
    }
}

#[tokio::test]
async fn acl_user_and_password_from_the_url() {
    let server =
        RedisServer::start_with(&["--user", "locker", "on", ">s3cr:et", "~*", "&*", "+@all"])
            .unwrap();
    let port = server.port();
    let good = format!("redis://locker:s3cr%3Aet@127.0.0.1:{port}");
    let c = connect(&good).await;
    let lease = c.try_acquire("r", &LockOptions::default()).await.unwrap();
    lease.release().await.unwrap();

    let bad = format!("redis://locker:wrong@127.0.0.1:{port}");
    let e = Client::connect(&bad).await.err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Engine);
    assert!(!e.to_string().contains("wrong"), "password leaked: {e}");
    assert!(e.to_string().contains("authentication failed"), "{e}");
}

/// A long lease, as a stuck holder's would be.
fn long() -> LockOptions {
    LockOptions::default().ttl(Duration::from_secs(60))
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
    // The record says where the release could not go; the log keeps what every node wrote.
    assert_eq!(record.not_released_on.len(), 1, "{record:?}");
    assert!(
        record.not_released_on[0].contains(&nodes[2].addr()),
        "{record:?}"
    );
    let mut logged = record.clone();
    logged.not_released_on.clear();
    assert_eq!(ops.audit(Some("r")).await.unwrap(), vec![logged]);

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

/// A Redlock node that refuses the client's credentials is reported as an authentication
/// failure naming that node, when connecting, not as a node that gives no answer.
#[tokio::test]
async fn a_redlock_node_refusing_auth_is_an_authentication_failure() {
    let nodes = start_redis_nodes(3).unwrap();
    assert_eq!(
        cli(&nodes[2], &["CONFIG", "SET", "requirepass", "s3cret"]),
        "OK"
    );
    let e = timeout(
        Duration::from_secs(10),
        Client::connect(&redlock_url(&nodes)),
    )
    .await
    .unwrap()
    .err();
    let text = e.as_ref().map(ToString::to_string).unwrap_or_default();
    assert_eq!(e.map(|e| e.kind()), Some(ErrorKind::Engine), "{text}");
    assert!(text.contains("authentication failed"), "{text}");
    assert!(text.contains(&nodes[2].addr()), "{text}");
    assert!(!text.contains("no answer"), "{text}");
}

/// A fair waiter queued while within its client's quota, whose client then takes its last
/// allowed lease elsewhere, is not handed the lock by the release (the handoff checks the
/// limits as the waiter's own attempt would); it keeps waiting and is granted once its client
/// releases the other lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_respects_the_waiters_quota() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let holder = Client::builder(&url)
        .client_name("holder")
        .connect()
        .await
        .unwrap();
    let waiter = Client::builder(&url)
        .client_name("waiter")
        .connect()
        .await
        .unwrap();
    holder
        .set_limits(&fencelock::Limits::default().with_max_held_per_client(1))
        .await
        .unwrap();
    let opts = LockOptions::default()
        .fair(true)
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(20));
    let held = holder.try_acquire("y", &opts).await.unwrap();
    let queued = {
        let (c, opts) = (waiter.clone(), opts.clone());
        tokio::spawn(async move { c.acquire("y", &opts).await })
    };
    assert!(wait_until(Duration::from_secs(5), || {
        cli(&server, &["ZCARD", "fencelock:v1:queue:y"]) == "1"
    }));
    let other = waiter.try_acquire("x", &opts).await.unwrap();
    held.release().await.unwrap();
    // Not handed over: the waiter's client holds its one lease.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!queued.is_finished());
    assert!(waiter.inspect("y").await.unwrap().is_none());
    other.release().await.unwrap();
    let granted = timeout(Duration::from_secs(10), queued)
        .await
        .expect("the waiter was not granted once its quota allowed")
        .unwrap()
        .unwrap();
    granted.release().await.unwrap();
}

/// A fair waiter within its client's quota is handed the lock by the release, and the grant is
/// counted in its client's `held` set as its own attempt would count it: flagged in the lock's
/// value, removed from the set by its release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_within_the_quota_counts_the_grant() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let holder = connect(&url).await;
    let waiter = Client::builder(&url)
        .client_name("counted")
        .connect()
        .await
        .unwrap();
    holder
        .set_limits(&fencelock::Limits::default().with_max_held_per_client(2))
        .await
        .unwrap();
    let held = holder
        .try_acquire("y", &LockOptions::default())
        .await
        .unwrap();
    let waiting = spawn_named_waiter(waiter, "y", slow_fair_waiter());
    await_queued(&server, "fencelock:v1:queue:y", 1);
    held.release().await.unwrap();
    // The waiter retries only every 4 s on its own: within 3 s, only the handoff grants it.
    let (lease, _waiter) = handed(waiting, Duration::from_secs(3)).await;
    let value = cli(&server, &["GET", "fencelock:v1:lock:y"]);
    assert_eq!(value.lines().next(), Some(lease.owner()));
    assert_eq!(value.lines().nth(1), Some("01"), "{value:?}");
    let set = "fencelock:v1:held:counted";
    assert_eq!(cli(&server, &["ZRANGE", set, "0", "-1"]), lease.owner());
    lease.release().await.unwrap();
    assert_eq!(cli(&server, &["ZCARD", set]), "0");
}

/// A quota stored after a lease was granted: the renewal counts the lease in its client's
/// `held` set, and the release, from a client that never heard of the quota (so sent without
/// that set, which the script needs only under a quota), is answered with a request for it and
/// sent again. The lease leaves the set, so the quota stops counting it at once, not when its
/// TTL would have ended.
#[tokio::test]
async fn a_release_under_a_quota_its_client_never_saw_leaves_the_held_set() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    let c = Client::builder(&url)
        .client_name("unaware")
        .connect()
        .await
        .unwrap();
    let lease = c
        .try_acquire("counted", &LockOptions::default())
        .await
        .unwrap();
    let admin = connect(&url).await;
    admin
        .set_limits(&fencelock::Limits::default().with_max_held_per_client(5))
        .await
        .unwrap();
    lease.extend().await.unwrap();
    assert_eq!(cli(&server, &["ZCARD", "fencelock:v1:held:unaware"]), "1");
    lease.release().await.unwrap();
    assert_eq!(cli(&server, &["ZCARD", "fencelock:v1:held:unaware"]), "0");
    assert!(c.inspect("counted").await.unwrap().is_none());
}

/// What the per-client quota promises on Redlock, where each node counts a client's leases and a
/// grant needs a majority of nodes that let it through: a node that misses grants (hung, cut
/// off) lets a client gather up to ⌊N·Q/M⌋ leases (4 for a quota of 3 on 3 nodes; seen as
/// "4 leases with a quota of 3" while nodes flapped), never more, and Q while every node sees
/// every grant. docs/security.md states this bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_redlock_quota_keeps_its_stated_bound_while_nodes_flap() {
    let nodes = start_redis_nodes(3).unwrap();
    let url = redlock_url(&nodes);
    let admin = connect(&url).await;
    admin
        .set_limits(&fencelock::Limits::default().with_max_held_per_client(3))
        .await
        .unwrap();
    let c = Client::builder(&url)
        .client_name("flapping")
        .connect()
        .await
        .unwrap();
    let opts = LockOptions::default().ttl(Duration::from_secs(60));
    let bound = 3 * 3 / 2;
    let mut held = Vec::new();
    for i in 0..9 {
        let down = &nodes[i % 3];
        down.pause().unwrap();
        let got = c.try_acquire(&format!("job-{i}"), &opts).await;
        down.resume().unwrap();
        match got {
            Ok(lease) => held.push(lease),
            Err(e) => assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}"),
        }
        assert!(held.len() <= bound, "{} leases past the bound", held.len());
    }
    // With every node up, each counts what it granted: no grant beyond the quota's bound.
    let e = c.try_acquire("all-up", &opts).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    for lease in held {
        lease.release().await.unwrap();
    }
    // And once released, the quota is whole again: three leases, the fourth refused.
    let mut again = Vec::new();
    for i in 0..3 {
        again.push(c.try_acquire(&format!("again-{i}"), &opts).await.unwrap());
    }
    let e = c.try_acquire("again-3", &opts).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{e}");
    for lease in again {
        lease.release().await.unwrap();
    }
}
