//! The chaos suite: real lock clients (`fencelock chaos-worker` processes) race for resources
//! while the suite pauses them, skews their clocks and kills or restarts Redis nodes. Every
//! grant and every write decision of the fenced ledger is logged with a CLOCK_MONOTONIC
//! timestamp, and the history checker counts what went wrong. Stale writes accepted must be 0.
//!
//! Short form (run by `scripts/test`): `cargo test -p fencelock-cli --test chaos`.
//! Long form: `FENCELOCK_CHAOS_LONG=1 cargo test -p fencelock-cli --test chaos -- --nocapture`.
#![allow(clippy::unwrap_used)]

#[path = "history/checker.rs"]
mod checker;
mod common;

use checker::{check, Grant, Verdict, Write};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fencelock, Proc};
use fencelock_testkit::{backend_url, redlock_url, start_redis_nodes, RedisServer};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

fn long_form() -> bool {
    std::env::var_os("FENCELOCK_CHAOS_LONG").is_some()
}

fn mono_ns() -> u128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128)
        .unwrap()
}

/// A tiny xorshift: pauses and victims only need to vary, not to be unpredictable.
struct Rng(u64);
impl Rng {
    fn new() -> Rng {
        Rng(mono_ns() as u64 | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn between(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (self.next() % 10_000) as f64 / 10_000.0 * (hi - lo)
    }
}

/// What the ledger does when a grant arrives, before it lets the worker write.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// Write at once.
    Go,
    /// Worker 0 of each resource is SIGSTOPped for 1-3 TTLs after each grant, then resumed
    /// once a successor has written, and writes with its old token.
    StopVictim,
    /// Worker 0's grants are held while the harness restarts the node (see `restart_cycle`).
    HoldVictim,
}

#[derive(Default)]
struct State {
    pids: HashMap<u32, u32>,
    highest: HashMap<usize, u64>,
    grants: Vec<Grant>,
    writes: Vec<Write>,
    fails: usize,
    cycles: usize,
}

type Shared = Arc<Mutex<State>>;

/// The worker processes, each stopped by its guard whatever happens.
struct Workers(Vec<Proc>);

type Spawner = Arc<dyn Fn(u32) -> Proc + Send + Sync>;

/// Starts workers during a run: a client started after a node's restart has never seen the
/// node before, so nothing tells it the node lost its data.
struct Late {
    spawn: Spawner,
    workers: Arc<Mutex<Workers>>,
}

impl Late {
    fn start(&self, id: u32) {
        let child = (self.spawn)(id);
        self.workers.lock().unwrap().0.push(child);
    }
}

struct Run {
    url: String,
    ttl: Duration,
    resources: usize,
    per_resource: u32,
    policy: Policy,
    max_ttl: Duration,
    /// Environment for worker 0 of each resource (the clock-skew scenario).
    victim_env: Vec<(String, String)>,
}

fn resource_of(id: u32) -> usize {
    (id / 10) as usize
}

async fn handle(
    stream: tokio::net::TcpStream,
    state: Shared,
    policy: Policy,
    ttl: Duration,
    hold: Arc<tokio::sync::Notify>,
) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let mut rng = Rng::new();
    while let Ok(Some(line)) = lines.next_line().await {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["HELLO", id, pid] => {
                state
                    .lock()
                    .unwrap()
                    .pids
                    .insert(id.parse().unwrap(), pid.parse().unwrap());
            }
            ["FAIL", ..] => state.lock().unwrap().fails += 1,
            ["RELEASE", id, token, at] => {
                let (id, token): (u32, u64) = (id.parse().unwrap(), token.parse().unwrap());
                let mut s = state.lock().unwrap();
                if let Some(g) = s
                    .grants
                    .iter_mut()
                    .rev()
                    .find(|g| g.worker == id && g.token == token)
                {
                    g.released = Some(at.parse().unwrap());
                }
            }
            ["GRANT", id, token, req, acq, valid] => {
                let id: u32 = id.parse().unwrap();
                let g = Grant {
                    resource: resource_of(id),
                    worker: id,
                    token: token.parse().unwrap(),
                    requested: req.parse().unwrap(),
                    acquired: acq.parse().unwrap(),
                    valid_until: valid.parse().unwrap(),
                    released: None,
                };
                state.lock().unwrap().grants.push(g.clone());
                let victim = id % 10 == 0;
                if victim && policy == Policy::StopVictim {
                    let pid = Pid::from_raw(state.lock().unwrap().pids[&id] as i32);
                    let _ = kill(pid, Signal::SIGSTOP);
                    tokio::time::sleep(ttl.mul_f64(rng.between(1.0, 3.0))).await;
                    // Resume once a successor has written (or a few TTLs passed), so the
                    // zombie's write comes after a newer token reached the ledger.
                    let until = tokio::time::Instant::now() + ttl * 6;
                    while tokio::time::Instant::now() < until {
                        let written = state.lock().unwrap().highest.get(&g.resource).copied();
                        if written.is_some_and(|h| h > g.token) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    let _ = kill(pid, Signal::SIGCONT);
                    state.lock().unwrap().cycles += 1;
                } else if victim && policy == Policy::HoldVictim {
                    hold.notified().await;
                }
                if write.write_all(b"GO\n").await.is_err() {
                    return;
                }
            }
            ["WRITE", id, token] => {
                let id: u32 = id.parse().unwrap();
                let token: u64 = token.parse().unwrap();
                let resource = resource_of(id);
                let accepted = {
                    let mut s = state.lock().unwrap();
                    let highest = s.highest.entry(resource).or_insert(0);
                    let ok = token >= *highest;
                    if ok {
                        *highest = token;
                    }
                    s.writes.push(Write {
                        resource,
                        worker: id,
                        token,
                        at: mono_ns(),
                        accepted: ok,
                    });
                    ok
                };
                let reply: &[u8] = if accepted { b"OK\n" } else { b"STALE\n" };
                if write.write_all(reply).await.is_err() {
                    return;
                }
            }
            _ => {}
        }
    }
}

/// Runs workers against `run.url` until `done` says so (or the deadline), while `chaos` does
/// its damage; returns the checker's verdict and the ledger state.
async fn execute<F, Fut>(
    run: Run,
    deadline: Duration,
    done: impl Fn(&State) -> bool,
    chaos: F,
) -> (Verdict, usize, usize, f64)
where
    F: FnOnce(Shared, Arc<tokio::sync::Notify>, Late) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ledger = listener.local_addr().unwrap().to_string();
    let state: Shared = Arc::default();
    let hold = Arc::new(tokio::sync::Notify::new());
    {
        let state = state.clone();
        let (policy, ttl, hold) = (run.policy, run.ttl, hold.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(handle(s, state.clone(), policy, ttl, hold.clone()));
            }
        });
    }
    let tag = format!("{:x}", mono_ns() as u64);
    let (url, ttl, max_ttl, victim_env) = (
        run.url.clone(),
        run.ttl,
        run.max_ttl,
        run.victim_env.clone(),
    );
    let spawn: Spawner = Arc::new(move |id: u32| {
        let mut cmd = fencelock(&["chaos-worker", "--backend", &url, "--ttl"]);
        cmd.arg(format!("{}ms", ttl.as_millis()))
            .arg("--max-ttl")
            .arg(format!("{}ms", max_ttl.as_millis()))
            .args([
                "--name",
                &format!("chaos-{tag}-{}", resource_of(id)),
                "--ledger",
                &ledger,
            ])
            .args(["--id", &id.to_string()])
            .discard_output();
        if id % 10 == 0 {
            cmd.envs(victim_env.iter().cloned());
        }
        cmd.spawn().unwrap()
    });
    let workers = Arc::new(Mutex::new(Workers(Vec::new())));
    for r in 0..run.resources {
        for k in 0..run.per_resource {
            let child = spawn((r as u32) * 10 + k);
            workers.lock().unwrap().0.push(child);
        }
    }
    let late = Late {
        spawn,
        workers: workers.clone(),
    };
    let started = std::time::Instant::now();
    let watch = {
        let state = state.clone();
        async move {
            while started.elapsed() < deadline && !done(&state.lock().unwrap()) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    tokio::select! {
        _ = watch => {}
        _ = chaos(state.clone(), hold.clone(), late) => {
            // The chaos ran its course; let the workers finish the cycle in flight.
            tokio::time::sleep(run.ttl * 2).await;
        }
    }
    hold.notify_waiters();
    let stopped = std::mem::take(&mut workers.lock().unwrap().0);
    drop(Workers(stopped));
    let elapsed = started.elapsed().as_secs_f64();
    let s = state.lock().unwrap();
    (check(&s.grants, &s.writes), s.cycles, s.fails, elapsed)
}

struct Row {
    engine: &'static str,
    scenario: &'static str,
    cycles: usize,
    fails: usize,
    seconds: f64,
    v: Verdict,
}

fn print_table(rows: &[Row]) {
    println!(
        "\n{:<8} {:<30} {:>6} {:>6} {:>7} {:>7} {:>6} {:>7} {:>7} {:>6} {:>6}",
        "engine",
        "scenario",
        "cycles",
        "grants",
        "w.ok",
        "w.refus",
        "zombie",
        "STALE",
        "t.order",
        "double",
        "fails"
    );
    for r in rows {
        println!(
            "{:<8} {:<30} {:>6} {:>6} {:>7} {:>7} {:>6} {:>7} {:>7} {:>6} {:>6}  ({:.0} s, {:.1} grants/s)",
            r.engine,
            r.scenario,
            r.cycles,
            r.v.grants,
            r.v.writes_accepted,
            r.v.writes_refused,
            r.v.zombie_writes,
            r.v.stale_accepted + r.v.accepted_order_violations,
            r.v.token_order_violations,
            r.v.double_grants,
            r.fails,
            r.seconds,
            r.v.grants as f64 / r.seconds.max(0.001)
        );
    }
    println!("STALE: stale writes accepted plus accepted tokens out of order (must be 0)");
}

fn assert_safe(r: &Row) {
    let what = format!("{} / {}: {:?}", r.engine, r.scenario, r.v);
    assert_eq!(r.v.stale_accepted, 0, "{what}");
    assert_eq!(r.v.accepted_order_violations, 0, "{what}");
    assert!(r.v.grants > 0, "{what}");
}

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
        };
        let (v, c, fails, secs) = execute(
            run,
            Duration::from_secs(240),
            |s| s.cycles >= cycles,
            |_, _, _| std::future::pending(),
        )
        .await;
        let row = Row {
            engine,
            scenario: "SIGSTOP holder 1-3 x TTL",
            cycles: c,
            fails,
            seconds: secs,
            v,
        };
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
        };
        let jump = stamp.clone();
        let secs_total = if long_form() { 20 } else { 4 };
        let (v, _, fails, secs) = execute(
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
            engine,
            scenario: "wall clock +2 x TTL (faketime)",
            cycles: 1,
            fails,
            seconds: secs,
            v,
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
        };
        let rounds = if long_form() { 40 } else { 8 };
        let n2 = nodes.clone();
        let (v, _, fails, secs) = execute(
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
            engine: "redlock",
            scenario: "random node SIGKILL + restart",
            cycles: rounds,
            fails,
            seconds: secs,
            v,
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
        };
        let rounds = 3;
        let s2 = servers.clone();
        let (v, _, fails, secs) = execute(
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
            engine,
            scenario,
            cycles: rounds,
            fails,
            seconds: secs,
            v,
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
    print_table(&rows);
}
