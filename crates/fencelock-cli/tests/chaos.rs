//! The chaos suite: real lock clients (`fencelock chaos-worker` processes) race for resources
//! while the suite pauses them, skews their clocks and kills or restarts Redis nodes. Every
//! grant and every write decision of the fenced ledger is logged with a CLOCK_MONOTONIC
//! timestamp, and the history checker counts what went wrong. Stale writes accepted must be 0.
//!
//! Short form (run by `scripts/test`): `cargo test -p fencelock-cli --test chaos`.
//! Long form: `FENCELOCK_CHAOS_LONG=1 cargo test -p fencelock-cli --test chaos -- --nocapture`.
#![allow(clippy::unwrap_used)]

mod chaos_kit;
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chaos_kit::*;
use fencelock_testkit::{backend_url, redlock_url, start_redis_nodes, RedisServer};

/// Each engine under test, started fresh: (name, URL, servers to keep alive).
fn engines(dir: &tempfile::TempDir) -> Vec<(&'static str, String, Vec<RedisServer>)> {
    let single = RedisServer::start().unwrap();
    let quorum = start_redis_nodes(3).unwrap();
    vec![
        (
            "sqlite",
            format!("sqlite://{}/chaos.db", dir.path().display()),
            vec![],
        ),
        ("redis", single.url(), vec![single]),
        ("redlock", redlock_url(&quorum), quorum),
    ]
}

const TTL: Duration = Duration::from_millis(200);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_suite() {
    let dir = tempfile::tempdir().unwrap();
    let cycles = if long_form() { 1000 } else { 200 };
    let mut rows = Vec::new();

    let only_restarts = std::env::var_os("FENCELOCK_CHAOS_ONLY_RESTARTS").is_some();
    for (engine, url, servers) in engines(&dir).into_iter().filter(|_| !only_restarts) {
        // 1. A holder SIGSTOPped for 1-3 TTLs, resumed, and writing with its old token.
        let run = Run {
            url: url.clone(),
            ttl: TTL,
            resources: 8,
            per_resource: 2,
            policy: Policy::StopVictim,
            max_ttl: TTL * 5,
            victim_env: vec![],
            url_for: None,
            cut: None,
            worker_args: vec![],
            victim_realtime: false,
            names: "chaos-".into(),
            side: None,
            config: None,
        };
        let o = execute(
            run,
            Duration::from_secs(240),
            |s| s.cycles >= cycles,
            |_, _, _| std::future::pending(),
        )
        .await;
        let row = Row::of(engine, "SIGSTOP holder 1-3 x TTL", &o);
        assert_safe(&row);
        assert!(row.cycles >= cycles, "{} cycles", row.cycles);
        assert!(
            row.v.writes_refused > 0,
            "no zombie write was ever refused: {:?}",
            row.v
        );
        assert_eq!(row.v.double_grants, 0, "{engine}: {:?}", row.v);
        rows.push(row);

        // 2. A holder whose wall clock jumps 2 TTLs ahead mid-run (libfaketime; the monotonic
        // clock, which leases use, is left alone as a real clock step would).
        let stamp = dir.path().join(format!("faketime-{engine}"));
        std::fs::write(&stamp, "+0").unwrap();
        let lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
        assert!(
            std::path::Path::new(lib).exists(),
            "faketime is not installed ({lib})"
        );
        let run = Run {
            url: url.clone(),
            ttl: TTL,
            resources: 4,
            per_resource: 2,
            policy: Policy::Go,
            max_ttl: TTL * 5,
            victim_env: vec![
                ("LD_PRELOAD".into(), lib.into()),
                (
                    "FAKETIME_TIMESTAMP_FILE".into(),
                    stamp.display().to_string(),
                ),
                ("FAKETIME_NO_CACHE".into(), "1".into()),
                ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
            ],
            url_for: None,
            cut: None,
            worker_args: vec![],
            victim_realtime: false,
            names: "chaos-".into(),
            side: None,
            config: None,
        };
        let jump = stamp.clone();
        let secs_total = if long_form() { 20 } else { 4 };
        let o = execute(
            run,
            Duration::from_secs(secs_total + 10),
            |_| false,
            move |_, _, _| async move {
                tokio::time::sleep(Duration::from_secs(secs_total) / 2).await;
                std::fs::write(&jump, format!("+{:.1}", (TTL * 2).as_secs_f64())).unwrap();
                tokio::time::sleep(Duration::from_secs(secs_total) / 2).await;
            },
        )
        .await;
        let row = Row {
            cycles: 1,
            ..Row::of(engine, "wall clock +2 x TTL (faketime)", &o)
        };
        assert_safe(&row);
        assert_eq!(row.v.double_grants, 0, "{engine}: {:?}", row.v);
        rows.push(row);
        drop(servers);
    }

    // 3. Redlock with a random node SIGKILLed and restarted (empty) during acquisitions.
    if !only_restarts {
        let nodes = Arc::new(Mutex::new(start_redis_nodes(3).unwrap()));
        let run = Run {
            url: redlock_url(&nodes.lock().unwrap()),
            ttl: TTL,
            resources: 4,
            per_resource: 2,
            policy: Policy::Go,
            max_ttl: TTL * 5,
            victim_env: vec![],
            url_for: None,
            cut: None,
            worker_args: vec![],
            victim_realtime: false,
            names: "chaos-".into(),
            side: None,
            config: None,
        };
        let rounds = if long_form() { 40 } else { 8 };
        let n2 = nodes.clone();
        let o = execute(
            run,
            Duration::from_secs(120),
            |_| false,
            move |_, _, _| async move {
                let mut rng = Rng::new();
                for _ in 0..rounds {
                    tokio::time::sleep(TTL * 2).await;
                    let i = (rng.next() % 3) as usize;
                    n2.lock().unwrap()[i].kill();
                    tokio::time::sleep(TTL).await;
                    n2.lock().unwrap()[i].restart().unwrap();
                }
            },
        )
        .await;
        let row = Row {
            cycles: rounds,
            ..Row::of("redlock", "random node SIGKILL + restart", &o)
        };
        assert_safe(&row);
        assert_eq!(row.v.double_grants, 0, "{:?}", row.v);
        rows.push(row);
    }

    // 4. Redis nodes restarted empty while a lease is held: at once (on one node, and on a
    // Redlock majority, the checker must see the double grant this causes; a Redlock minority
    // restarted is outvoted), and after the delayed-restart window (one maximum TTL down),
    // which leaves none. The clients that try after the restart have never seen the nodes
    // before, so nothing warns them.
    for (engine, scenario, nodes, restarted, delayed, double) in [
        ("redis", "node restarted empty at once", 1, 1, false, true),
        ("redis", "node restarted after max TTL", 1, 1, true, false),
        (
            "redlock",
            "1 of 3 restarted empty at once",
            3,
            1,
            false,
            false,
        ),
        (
            "redlock",
            "2 of 3 restarted empty at once",
            3,
            2,
            false,
            true,
        ),
        (
            "redlock",
            "2 of 3 restarted after max TTL",
            3,
            2,
            true,
            false,
        ),
    ] {
        let servers = Arc::new(Mutex::new(start_redis_nodes(nodes).unwrap()));
        let url = backend_url(&servers.lock().unwrap());
        let ttl = Duration::from_millis(1000);
        let run = Run {
            url,
            ttl,
            resources: 1,
            per_resource: 1,
            policy: Policy::HoldVictim,
            max_ttl: ttl,
            victim_env: vec![],
            url_for: None,
            cut: None,
            worker_args: vec![],
            victim_realtime: false,
            names: "chaos-".into(),
            side: None,
            config: None,
        };
        let rounds = 3;
        let s2 = servers.clone();
        let o = execute(
            run,
            Duration::from_secs(60),
            |_| false,
            move |state, hold, late| async move {
                let victim_grants = |s: &State| s.grants.iter().filter(|g| g.worker == 0).count();
                for round in 0..rounds {
                    // Wait for the victim (worker 0) to hold the lock.
                    let before = victim_grants(&state.lock().unwrap());
                    while victim_grants(&state.lock().unwrap()) == before {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    if delayed {
                        for n in s2.lock().unwrap().iter_mut().take(restarted) {
                            n.kill();
                        }
                        tokio::time::sleep(ttl + ttl / 5).await;
                    }
                    for n in s2.lock().unwrap().iter_mut().take(restarted) {
                        n.restart().unwrap();
                    }
                    // A client that never saw the nodes before tries while the victim still
                    // believes it holds the lock.
                    let grants = state.lock().unwrap().grants.len();
                    late.start(1 + round as u32);
                    let until = tokio::time::Instant::now() + ttl * 2;
                    while state.lock().unwrap().grants.len() == grants
                        && tokio::time::Instant::now() < until
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    // A permit, not a broadcast: if the victim's handler has not started
                    // waiting yet, it must still find the go-ahead when it does.
                    hold.notify_one();
                }
            },
        )
        .await;
        let row = Row {
            cycles: rounds,
            ..Row::of(engine, scenario, &o)
        };
        assert_safe(&row);
        if double {
            assert!(
                row.v.double_grants >= 1,
                "{engine} / {scenario}: the checker missed the double grant: {:?}",
                row.v
            );
        } else {
            assert_eq!(row.v.double_grants, 0, "{engine} / {scenario}: {:?}", row.v);
        }
        rows.push(row);
    }
    #[cfg(feature = "zookeeper")]
    if !only_restarts {
        zookeeper_rows(&mut rows).await;
    }
    print_table(&rows);
}

/// ZooKeeper on a three-server ensemble: a holder SIGSTOPped for 1-3 TTLs (its session, as
/// long as the TTL, expires while it is stopped), and the leader SIGKILLed and restarted while
/// the workers acquire. The TTL is the servers' shortest session, two ticks (1 s).
#[cfg(feature = "zookeeper")]
async fn zookeeper_rows(rows: &mut Vec<Row>) {
    use fencelock_testkit::ZkEnsemble;
    let zk = tokio::task::block_in_place(|| ZkEnsemble::start(3)).unwrap();
    let url = zk.url();
    let ttl = Duration::from_secs(1);
    let cycles = if long_form() { 200 } else { 16 };
    let run = Run::new(&url, ttl, 8, 2, Policy::StopVictim);
    let o = execute(
        run,
        Duration::from_secs(240),
        |s| s.cycles >= cycles,
        |_, _, _| std::future::pending(),
    )
    .await;
    let row = Row {
        engine: "zk",
        scenario: "SIGSTOP holder 1-3 x TTL",
        cycles: o.cycles,
        fails: o.fails,
        seconds: o.seconds,
        v: o.verdict,
    };
    assert_safe(&row);
    assert!(row.cycles >= cycles, "{} cycles", row.cycles);
    assert!(
        row.v.writes_refused > 0,
        "no zombie write refused: {:?}",
        row.v
    );
    assert_eq!(row.v.double_grants, 0, "zk: {:?}", row.v);
    rows.push(row);

    let zk = Arc::new(Mutex::new(zk));
    let run = Run::new(&url, ttl, 4, 2, Policy::Go);
    let rounds = if long_form() { 20 } else { 3 };
    let z2 = zk.clone();
    let o = execute(
        run,
        Duration::from_secs(180),
        |_| false,
        move |_, _, _| async move {
            for _ in 0..rounds {
                tokio::time::sleep(ttl * 2).await;
                tokio::task::block_in_place(|| {
                    let mut zk = z2.lock().unwrap();
                    let leader = zk.leader().unwrap();
                    zk.kill(leader);
                    zk.wait_leader(Duration::from_secs(30)).unwrap();
                    zk.restart(leader).unwrap();
                });
            }
        },
    )
    .await;
    let row = Row {
        engine: "zk",
        scenario: "leader SIGKILL + restart",
        cycles: rounds,
        fails: o.fails,
        seconds: o.seconds,
        v: o.verdict,
    };
    assert_safe(&row);
    assert_eq!(row.v.double_grants, 0, "zk: {:?}", row.v);
    rows.push(row);
}
