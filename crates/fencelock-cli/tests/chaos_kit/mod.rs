//! The chaos harness shared by the chaos suite and the partition rows: a ledger that logs
//! every grant, loss and fenced write with CLOCK_MONOTONIC timestamps, `fencelock chaos-worker`
//! processes that race for resources, and the table the rows print.
#![allow(dead_code)]

#[path = "../history/checker.rs"]
pub mod checker;

pub use checker::{check, Grant, Verdict, Write};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{fencelock, Proc};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

pub fn long_form() -> bool {
    std::env::var_os("FENCELOCK_CHAOS_LONG").is_some()
}

pub fn mono_ns() -> u128 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u128 * 1_000_000_000 + t.tv_nsec() as u128)
        .unwrap()
}

/// A tiny xorshift: pauses and victims only need to vary, not to be unpredictable.
pub struct Rng(pub u64);
impl Rng {
    pub fn new() -> Rng {
        Rng(mono_ns() as u64 | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn between(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (self.next() % 10_000) as f64 / 10_000.0 * (hi - lo)
    }
}

/// What the ledger does when a grant arrives, before it lets the worker write.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// Write at once.
    Go,
    /// Worker 0 of each resource is SIGSTOPped for 1-3 TTLs after each grant, then resumed
    /// once a successor has written, and writes with its old token.
    StopVictim,
    /// Worker 0's grants are held while the harness restarts the node (see `restart_cycle`).
    HoldVictim,
    /// Worker 0 of each resource is cut off (by the run's `cut`) after each grant; it gets the
    /// go-ahead, and writes with its old token, once it has reported the loss and a successor
    /// has written (or six TTLs passed), and is reconnected then.
    CutVictim,
}

/// A loss as the worker reported it: when it learnt, and its lease's validity end then, which
/// is the moment the library declared the loss if that came before the deadline
/// (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone)]
pub struct Lost {
    pub worker: u32,
    pub token: u64,
    pub at: u128,
    pub valid_until: u128,
    /// How long the worker's threads sat runnable on a run queue, not running, between the
    /// ledger's receipt of the grant and of the loss (summed over its threads, ns): what the
    /// kernel, not the lock, made it wait.
    pub queued: u128,
}

/// The time the threads of process `pid` have spent runnable but waiting for a CPU, in ns
/// (the second field of `/proc/PID/task/TID/schedstat`), summed over its threads; 0 when the
/// kernel does not say.
pub fn run_queue_wait(pid: u32) -> u128 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u128>().ok())
        .sum()
}

/// Whether this machine lets the suite run a worker under SCHED_FIFO (`chrt`, root or
/// CAP_SYS_NICE).
pub fn realtime_available() -> bool {
    std::process::Command::new("chrt")
        .args(["-f", "1", "true"])
        .status()
        .is_ok_and(|s| s.success())
}

#[derive(Default)]
pub struct State {
    pub pids: HashMap<u32, u32>,
    pub highest: HashMap<usize, u64>,
    pub grants: Vec<Grant>,
    pub writes: Vec<Write>,
    pub lost: Vec<Lost>,
    pub fails: usize,
    /// How long each failed acquisition took, in ns.
    pub fail_ns: Vec<u128>,
    /// When each failed acquisition began (CLOCK_MONOTONIC ns, as received less its length).
    pub fail_at: Vec<u128>,
    pub cycles: usize,
    /// When the ledger applied the cut to a victim's grant (worker, token): a renewal
    /// confirmed before then may have moved the grant's deadline.
    pub cut_at: HashMap<(u32, u64), u128>,
    /// The victim's run-queue wait when the ledger received its grant (worker, token).
    pub queued_at_grant: HashMap<(u32, u64), u128>,
}

pub type Shared = Arc<Mutex<State>>;

/// The worker processes with their ids, each stopped by its guard whatever happens.
pub struct Workers(pub Vec<(u32, Proc)>);

pub type Spawner = Arc<dyn Fn(u32) -> Proc + Send + Sync>;

/// Starts workers during a run: a client started after a node's restart has never seen the
/// node before, so nothing tells it the node lost its data.
pub struct Late {
    spawn: Spawner,
    workers: Arc<Mutex<Workers>>,
}

impl Late {
    pub fn start(&self, id: u32) {
        let child = (self.spawn)(id);
        self.workers.lock().unwrap().0.push((id, child));
    }
}

/// Cuts worker `id` off (`true`) or reconnects it (`false`).
pub type Cutter = Arc<dyn Fn(u32, bool) + Send + Sync>;
/// The backend URL worker `id` uses, for rows that give each worker its own proxies.
pub type UrlFor = Arc<dyn Fn(u32) -> String + Send + Sync>;

pub struct Run {
    pub url: String,
    pub ttl: Duration,
    pub resources: usize,
    pub per_resource: u32,
    pub policy: Policy,
    pub max_ttl: Duration,
    /// Environment for worker 0 of each resource (the clock-skew scenario).
    pub victim_env: Vec<(String, String)>,
    /// Per-worker URLs instead of `url`.
    pub url_for: Option<UrlFor>,
    /// What `Policy::CutVictim` does to a victim.
    pub cut: Option<Cutter>,
    /// Extra `chaos-worker` arguments (`--wait`, `--op-timeout`).
    pub worker_args: Vec<String>,
    /// Runs worker 0 of each resource under SCHED_FIFO (`chrt -f 1`), for rows that measure
    /// when the holder learnt of its loss: on a shared machine an ordinary process waits on
    /// the run queue for tens of milliseconds at a time, and would measure the neighbours'
    /// load rather than the library (see `check_losses` in `partitions.rs`).
    pub victim_realtime: bool,
    /// Resource names are `{names}{run tag}-{resource}`.
    pub names: String,
    /// A second name each worker's client locks in a loop of its own, `{prefix}{run tag}-{resource}`
    /// (reported as worker `id + 1000`, so under resource `100 + resource`), with this wait.
    pub side: Option<(String, Duration)>,
    /// A routing configuration the workers open (`--config`) instead of `url`.
    pub config: Option<std::path::PathBuf>,
}

/// The ledger id of worker `id`'s side loop (`chaos-worker --side`).
pub const SIDE_ID_OFFSET: u32 = 1000;

impl Run {
    /// A run of `resources` x `per_resource` workers on `url` with the defaults of the suite.
    pub fn new(
        url: &str,
        ttl: Duration,
        resources: usize,
        per_resource: u32,
        policy: Policy,
    ) -> Run {
        Run {
            url: url.to_string(),
            ttl,
            resources,
            per_resource,
            policy,
            max_ttl: ttl * 5,
            victim_env: vec![],
            url_for: None,
            cut: None,
            worker_args: vec![],
            victim_realtime: false,
            names: "chaos-".into(),
            side: None,
            config: None,
        }
    }
}

pub fn resource_of(id: u32) -> usize {
    (id / 10) as usize
}

async fn handle(
    stream: tokio::net::TcpStream,
    state: Shared,
    policy: Policy,
    ttl: Duration,
    hold: Arc<tokio::sync::Notify>,
    cut: Option<Cutter>,
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
            ["FAIL", _, _, took] => {
                let mut s = state.lock().unwrap();
                let took: u128 = took.parse().unwrap();
                s.fails += 1;
                s.fail_ns.push(took);
                s.fail_at.push(mono_ns().saturating_sub(took));
            }
            ["FAIL", ..] => state.lock().unwrap().fails += 1,
            ["LOST", id, token, at, valid] => {
                let mut l = Lost {
                    worker: id.parse().unwrap(),
                    token: token.parse().unwrap(),
                    at: at.parse().unwrap(),
                    valid_until: valid.parse().unwrap(),
                    queued: 0,
                };
                let mut s = state.lock().unwrap();
                if let (Some(pid), Some(before)) = (
                    s.pids.get(&l.worker),
                    s.queued_at_grant.get(&(l.worker, l.token)),
                ) {
                    l.queued = run_queue_wait(*pid).saturating_sub(*before);
                }
                if let Some(g) = s
                    .grants
                    .iter_mut()
                    .rev()
                    .find(|g| g.worker == l.worker && g.token == l.token)
                {
                    // When the library declared the loss (or the deadline, if earlier), not when
                    // the worker got round to noticing: others may act on the release that
                    // follows a loss at once.
                    g.lost = Some(l.valid_until.min(l.at));
                }
                s.lost.push(l);
            }
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
                    lost: None,
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
                } else if victim && policy == Policy::CutVictim {
                    {
                        let mut s = state.lock().unwrap();
                        let queued = s.pids.get(&id).map_or(0, |p| run_queue_wait(*p));
                        s.queued_at_grant.insert((id, g.token), queued);
                    }
                    if let Some(cut) = &cut {
                        cut(id, true);
                    }
                    state
                        .lock()
                        .unwrap()
                        .cut_at
                        .insert((id, g.token), mono_ns());
                    let until = tokio::time::Instant::now() + ttl * 6;
                    while tokio::time::Instant::now() < until {
                        let (lost, succeeded) = {
                            let s = state.lock().unwrap();
                            (
                                s.lost.iter().any(|l| l.worker == id && l.token == g.token),
                                s.highest.get(&g.resource).is_some_and(|h| *h > g.token),
                            )
                        };
                        if lost && succeeded {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    if let Some(cut) = &cut {
                        cut(id, false);
                    }
                    state.lock().unwrap().cycles += 1;
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
pub async fn execute<F, Fut>(
    run: Run,
    deadline: Duration,
    done: impl Fn(&State) -> bool,
    chaos: F,
) -> Outcome
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
        let (policy, ttl, hold, cut) = (run.policy, run.ttl, hold.clone(), run.cut.clone());
        tokio::spawn(async move {
            while let Ok((s, _)) = listener.accept().await {
                tokio::spawn(handle(
                    s,
                    state.clone(),
                    policy,
                    ttl,
                    hold.clone(),
                    cut.clone(),
                ));
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
    let (url_for, extra) = (run.url_for.clone(), run.worker_args.clone());
    let realtime = run.victim_realtime;
    let (names, side, config) = (run.names.clone(), run.side.clone(), run.config.clone());
    if realtime {
        assert!(
            realtime_available(),
            "this row runs its cut-off holders under SCHED_FIFO: it needs chrt (util-linux) \
             and root or CAP_SYS_NICE"
        );
    }
    let spawn: Spawner = Arc::new(move |id: u32| {
        let url = url_for.as_ref().map_or_else(|| url.clone(), |f| f(id));
        let (flag, target) = match &config {
            Some(path) => ("--config", path.display().to_string()),
            None => ("--backend", url),
        };
        let worker = ["chaos-worker", flag, &target, "--ttl"];
        let mut cmd = if realtime && id % 10 == 0 {
            // chrt execs the worker: same pid, every thread of it under SCHED_FIFO.
            let mut cmd = crate::common::BinCommand::new("chrt");
            cmd.args(["-f", "1", env!("CARGO_BIN_EXE_fencelock")])
                .args(worker);
            cmd
        } else {
            fencelock(&worker)
        };
        cmd.arg(format!("{}ms", ttl.as_millis()))
            .arg("--max-ttl")
            .arg(format!("{}ms", max_ttl.as_millis()))
            .args([
                "--name",
                &format!("{names}{tag}-{}", resource_of(id)),
                "--ledger",
                &ledger,
            ])
            .args(["--id", &id.to_string()])
            .args(&extra)
            .discard_output();
        if let Some((prefix, wait)) = &side {
            cmd.arg("--side")
                .arg(format!("{prefix}{tag}-{}", resource_of(id)))
                .arg("--side-wait")
                .arg(format!("{}ms", wait.as_millis()));
        }
        if id % 10 == 0 {
            cmd.envs(victim_env.iter().cloned());
        }
        cmd.spawn().unwrap()
    });
    let workers = Arc::new(Mutex::new(Workers(Vec::new())));
    for r in 0..run.resources {
        for k in 0..run.per_resource {
            let id = (r as u32) * 10 + k;
            let child = spawn(id);
            workers.lock().unwrap().0.push((id, child));
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
    // Stopped one by one: a worker killed while it holds a lock reports neither a release nor
    // a loss, and where the lock dies with its session (PostgreSQL's advisory locks) a worker
    // still running is granted it at once. A dead process holds and writes nothing, so its
    // window ends when it was reaped, not at its validity deadline.
    let mut reaped = HashMap::new();
    for (id, proc) in stopped {
        drop(proc);
        reaped.insert(id, mono_ns());
    }
    let elapsed = started.elapsed().as_secs_f64();
    let mut s = state.lock().unwrap();
    for g in s.grants.iter_mut() {
        if let Some(&at) = reaped.get(&g.worker) {
            if g.released.is_none() && g.lost.is_none() && at < g.valid_until {
                g.released = Some(at);
            }
        }
    }
    Outcome {
        verdict: check(&s.grants, &s.writes),
        cycles: s.cycles,
        fails: s.fails,
        seconds: elapsed,
        grants: s.grants.clone(),
        lost: s.lost.clone(),
        fail_ns: s.fail_ns.clone(),
        fail_at: s.fail_at.clone(),
        cut_at: s.cut_at.clone(),
    }
}

/// What a run left: the checker's verdict and the raw history for row-specific checks.
pub struct Outcome {
    pub verdict: Verdict,
    pub cycles: usize,
    pub fails: usize,
    pub seconds: f64,
    pub grants: Vec<Grant>,
    pub lost: Vec<Lost>,
    pub fail_ns: Vec<u128>,
    pub fail_at: Vec<u128>,
    pub cut_at: HashMap<(u32, u64), u128>,
}

pub struct Row {
    pub engine: &'static str,
    pub scenario: &'static str,
    pub cycles: usize,
    pub fails: usize,
    pub seconds: f64,
    pub v: Verdict,
}

impl Row {
    pub fn of(engine: &'static str, scenario: &'static str, o: &Outcome) -> Row {
        Row {
            engine,
            scenario,
            cycles: o.cycles,
            fails: o.fails,
            seconds: o.seconds,
            v: o.verdict.clone(),
        }
    }
}

pub fn print_table(rows: &[Row]) {
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

pub fn assert_safe(r: &Row) {
    let what = format!("{} / {}: {:?}", r.engine, r.scenario, r.v);
    assert_eq!(r.v.stale_accepted, 0, "{what}");
    assert_eq!(r.v.accepted_order_violations, 0, "{what}");
    assert!(r.v.grants > 0, "{what}");
}
