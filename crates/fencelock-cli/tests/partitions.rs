//! The chaos suite's network rows: the same workers, ledger and history checker as
//! `tests/chaos.rs`, with a fault-injecting TCP proxy (`fencelock_testkit::FaultProxy`)
//! between the clients and every engine node. Partitions, one-way silence, flapping links and
//! slow links are how most real outages look; stale writes accepted must still be 0.
//!
//! Short form (run by `scripts/test`): `cargo test -p fencelock-cli --test partitions`.
//! Long form: `FENCELOCK_CHAOS_LONG=1 cargo test -p fencelock-cli --test partitions -- --nocapture`.
#![allow(clippy::unwrap_used)]

mod chaos_kit;
mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chaos_kit::*;
#[cfg(feature = "etcd")]
use fencelock_testkit::EtcdCluster;
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
use fencelock_testkit::Lan;
use fencelock_testkit::{start_redis_nodes, Fault, FaultProxy, PgServer};

/// Proxies that every worker shares, one per node: a fault on one is a fault of the node's
/// network as every client sees it.
struct Net {
    proxies: Vec<FaultProxy>,
}

impl Net {
    fn new(ports: &[u16]) -> Net {
        Net {
            proxies: ports
                .iter()
                .map(|p| FaultProxy::to_port(*p).unwrap())
                .collect(),
        }
    }
    fn addrs(&self) -> String {
        let a: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        a.join(",")
    }
}

/// One proxy per worker and node, made when the worker starts: a fault on one cuts that worker
/// alone off from that node, while the others still reach it.
#[derive(Clone)]
struct PerWorker {
    targets: Vec<SocketAddr>,
    /// The namespace the proxies connect from (a test network's hub), if not this one.
    netns: Option<std::path::PathBuf>,
    proxies: Arc<Mutex<HashMap<u32, Vec<FaultProxy>>>>,
}

impl PerWorker {
    fn new(ports: &[u16]) -> PerWorker {
        PerWorker {
            targets: ports
                .iter()
                .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
                .collect(),
            netns: None,
            proxies: Arc::default(),
        }
    }

    /// The worker's own `host:port` list, in node order.
    fn addrs_for(&self, id: u32) -> Vec<String> {
        let mine: Vec<FaultProxy> = self
            .targets
            .iter()
            .map(|t| match &self.netns {
                None => FaultProxy::start(*t).unwrap(),
                Some(ns) => FaultProxy::start_from(*t, ns).unwrap(),
            })
            .collect();
        let addrs = mine.iter().map(|p| p.addr().to_string()).collect();
        self.proxies.lock().unwrap().insert(id, mine);
        addrs
    }

    /// Applies `fault` to worker `id`'s proxies of the nodes `which` selects.
    fn set(&self, id: u32, which: impl Fn(usize) -> bool, fault: Fault) {
        if let Some(ps) = self.proxies.lock().unwrap().get(&id) {
            for (i, p) in ps.iter().enumerate() {
                if which(i) {
                    p.set(fault);
                }
            }
        }
    }
}

const TTL: Duration = Duration::from_millis(200);
/// The workers' wait and per-call deadline in the rows where acquisitions must fail: short, so
/// a phase without a majority shows its failures within a fraction of a second.
const WAIT: Duration = Duration::from_millis(200);
const OP_TIMEOUT: Duration = Duration::from_millis(100);

fn short_deadlines() -> Vec<String> {
    vec![
        "--wait".into(),
        format!("{}ms", WAIT.as_millis()),
        "--op-timeout".into(),
        format!("{}ms", OP_TIMEOUT.as_millis()),
    ]
}

/// The grants reported between two snapshots of the ledger, and the failures.
fn counts(s: &chaos_kit::Shared) -> (usize, usize) {
    let s = s.lock().unwrap();
    (s.grants.len(), s.fails)
}

/// Every mask of blackholed nodes (2^n of them, as redsync tests them): acquisitions succeed
/// exactly when a majority is reachable and fail within the wait deadline otherwise.
async fn masks(n: usize, rows: &mut Vec<Row>) {
    let nodes = start_redis_nodes(n).unwrap();
    let ports: Vec<u16> = nodes.iter().map(|s| s.port()).collect();
    let net = Arc::new(Net::new(&ports));
    let mut run = Run::new(&format!("redlock://{}", net.addrs()), TTL, 2, 2, Policy::Go);
    run.worker_args = short_deadlines();
    // Long enough for an acquisition begun under the previous mask to end, and for a lock key
    // written by a request held in the proxy to expire.
    let settle = WAIT + OP_TIMEOUT * 2 + TTL;
    // Longer than a failed acquisition takes, so every worker reports at least one failure in
    // the window of a phase without a majority.
    let window = Duration::from_millis(if long_form() { 1500 } else { 400 });
    let phases: Arc<Mutex<Vec<(u32, usize, usize)>>> = Arc::default();
    let (net2, phases2) = (net.clone(), phases.clone());
    let o = execute(
        run,
        Duration::from_secs(180),
        |_| false,
        move |state, _, _| async move {
            // Let every worker connect before the first fault.
            while counts(&state).0 < 4 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for mask in 0..(1u32 << n) {
                for (i, p) in net2.proxies.iter().enumerate() {
                    p.set(if mask & (1 << i) != 0 {
                        Fault::Blackhole
                    } else {
                        Fault::Pass
                    });
                }
                tokio::time::sleep(settle).await;
                let (g0, f0) = counts(&state);
                tokio::time::sleep(window).await;
                let (g1, f1) = counts(&state);
                phases2.lock().unwrap().push((mask, g1 - g0, f1 - f0));
            }
            for p in &net2.proxies {
                p.heal();
            }
        },
    )
    .await;
    let scenario: &'static str = if n == 3 {
        "every mask of 3 blackholed"
    } else {
        "every mask of 5 blackholed"
    };
    let row = Row {
        cycles: 1 << n,
        ..Row::of("redlock", scenario, &o)
    };
    assert_safe(&row);
    assert_eq!(row.v.double_grants, 0, "{scenario}: {:?}", row.v);
    let phases = phases.lock().unwrap();
    assert_eq!(phases.len(), 1 << n, "every mask ran");
    for &(mask, grants, fails) in phases.iter() {
        let reachable = n - mask.count_ones() as usize;
        if reachable > n / 2 {
            assert!(
                grants > 0,
                "mask {mask:0n$b}: a majority is reachable, no grant"
            );
        } else {
            assert_eq!(grants, 0, "mask {mask:0n$b}: granted without a majority");
            assert!(fails > 0, "mask {mask:0n$b}: no acquisition failed");
        }
    }
    // A failed acquisition gives up at its wait deadline, plus at most the one call that was
    // in flight then (bounded by the per-call deadline).
    let slowest = o.fail_ns.iter().max().copied().unwrap_or(0);
    let bound = (WAIT + OP_TIMEOUT * 2 + Duration::from_millis(100)).as_nanos();
    println!(
        "{scenario}: {} failed acquisitions, slowest {:.0} ms (bound {:.0} ms)",
        o.fail_ns.len(),
        slowest as f64 / 1e6,
        bound as f64 / 1e6
    );
    assert!(slowest <= bound, "a failed acquisition took {slowest} ns");
    rows.push(row);
    drop(nodes);
}

/// The grant pairs whose believed windows overlap, for a failure message.
fn overlaps(o: &Outcome) -> Vec<(Grant, Grant)> {
    let mut out = Vec::new();
    for a in &o.grants {
        for b in &o.grants {
            if a.resource == b.resource && a.token < b.token && b.acquired < a.believed_until() {
                out.push((a.clone(), b.clone()));
            }
        }
    }
    out
}

/// Checks the loss reports of a row whose victims were cut off: every cut-off holder was told
/// of its loss by the end of its validity window (invariant 4, no silent loss: `Lease::lost`
/// completed, its work cancelled; target and assertion 100 %), and that window had ended before
/// a successor was granted the resource.
///
/// "Told" is the moment the library signalled the loss, which the lease itself records: its
/// validity is cut to that instant when it comes before the deadline (a signal at or after the
/// deadline leaves the deadline, and fails the check). When the holder's own thread then ran
/// to see it is the kernel's business; it is measured and printed (the lag, and how many saw it
/// only after the deadline), not asserted. As ordinary processes on this 2-core machine at a
/// load of 9 to 11 from other builds, 8 or 9 of 240 cut-off holders saw the loss 0.4-54 ms after
/// their deadline; each of those had waited 30-94 ms on the run queue during its 200 ms window
/// (/proc schedstat; 10 ms for the median cycle), and in some of them the watchdog's own timer,
/// due 4 ms before the deadline, had not been run in time either. So the victims run under
/// SCHED_FIFO (`Run::victim_realtime`): the library's timer is then run when due, and what the
/// check measures is the library, not the neighbours' builds.
///
/// The deadline is the one the grant reported, unless the ledger applied the cut late enough
/// for a renewal to have been confirmed first (it starts a third of the TTL after the grant):
/// then the renewal's deadline, at most one TTL less the drift after the cut, is allowed.
fn check_losses(o: &Outcome, what: &str, ttl: Duration) {
    let drift = (ttl / 100 + Duration::from_millis(2)).as_nanos();
    let ttl_ns = ttl.as_nanos();
    let victims: Vec<&Grant> = o.grants.iter().filter(|g| g.worker % 10 == 0).collect();
    let (mut cut, mut before_successor, mut late_cuts) = (0, 0, 0);
    let (mut margin_min, mut queued_max, mut lag_max, mut seen_late) = (u128::MAX, 0, 0, 0);
    for v in &victims {
        let successor = o
            .grants
            .iter()
            .filter(|g| g.resource == v.resource && g.token > v.token)
            .min_by_key(|g| g.token);
        let Some(next) = successor else { continue };
        let Some(l) = o
            .lost
            .iter()
            .find(|l| l.worker == v.worker && l.token == v.token)
        else {
            // Released before it was cut off (the last cycle of the run may end so).
            continue;
        };
        cut += 1;
        // A lost lease's validity ends when it was declared lost (the library's own clock), or
        // at its deadline if that came first.
        assert!(
            l.valid_until < next.acquired,
            "{what}: holder {} believed itself valid until {}, after the successor's grant at {} \
             (victim {v:?}, loss {l:?}, successor {next:?})",
            v.worker,
            l.valid_until,
            next.acquired
        );
        let mut deadline = v.valid_until;
        if let Some(&at) = o.cut_at.get(&(v.worker, v.token)) {
            // The first renewal starts a third of the TTL after the grant was registered,
            // which was at least `ttl - drift` before its deadline.
            if at + ttl_ns - drift >= v.valid_until + ttl_ns / 3 {
                late_cuts += 1;
                deadline = deadline.max(at + ttl_ns - drift);
            }
        }
        // Both readings of one unmoved deadline agree within a few microseconds (each is an
        // Instant mapped to CLOCK_MONOTONIC); a loss signalled in time cut it by more.
        let told = l.valid_until;
        assert!(
            told + 100_000 < deadline,
            "{what}: holder {} was not told of its loss before its validity deadline (its \
             thread saw it {:.2} ms after the deadline, having waited {:.1} ms on the run queue \
             since its grant; victim {v:?}, loss {l:?})",
            v.worker,
            (l.at as f64 - deadline as f64) / 1e6,
            l.queued as f64 / 1e6
        );
        margin_min = margin_min.min(deadline - told);
        lag_max = lag_max.max(l.at.saturating_sub(told));
        if l.at > deadline {
            seen_late += 1;
        }
        queued_max = queued_max.max(l.queued);
        if l.at < next.acquired {
            before_successor += 1;
        }
    }
    assert!(cut > 0, "{what}: no victim was cut off");
    println!(
        "{what}: {cut} of {cut} cut-off holders told of the loss by their validity deadline \
         (the closest {:.1} ms before it; {late_cuts} cut after a renewal could have landed); \
         their threads saw it at most {:.1} ms after, {seen_late} of them after the deadline; \
         run-queue wait per window at most {:.1} ms; {before_successor} saw it before the \
         successor's grant, and every validity window ended before it",
        margin_min as f64 / 1e6,
        lag_max as f64 / 1e6,
        queued_max as f64 / 1e6
    );
}

/// The holder cut off from a majority of the Redlock nodes while the other clients are not.
async fn holder_cut(rows: &mut Vec<Row>) {
    let nodes = start_redis_nodes(3).unwrap();
    let ports: Vec<u16> = nodes.iter().map(|s| s.port()).collect();
    let net = PerWorker::new(&ports);
    let mut run = Run::new("", TTL, 4, 2, Policy::CutVictim);
    run.victim_realtime = true;
    let n2 = net.clone();
    run.url_for = Some(Arc::new(move |id| {
        format!("redlock://{}", n2.addrs_for(id).join(","))
    }));
    let n3 = net.clone();
    run.cut = Some(Arc::new(move |id, on| {
        let fault = if on { Fault::Blackhole } else { Fault::Pass };
        n3.set(id, |i| i < 2, fault);
    }));
    run.worker_args = vec!["--op-timeout".into(), "150ms".into()];
    let cycles = if long_form() { 240 } else { 40 };
    let o = execute(
        run,
        Duration::from_secs(300),
        |s| s.cycles >= cycles,
        |_, _, _| std::future::pending(),
    )
    .await;
    let row = Row::of("redlock", "holder cut off from 2 of 3", &o);
    assert_safe(&row);
    assert!(row.cycles >= cycles, "{} cycles", row.cycles);
    assert_eq!(row.v.double_grants, 0, "{:?} {:?}", row.v, overlaps(&o));
    assert!(
        row.v.writes_refused > 0,
        "no cut-off write refused: {:?}",
        row.v
    );
    check_losses(&o, "redlock holder cut off from 2 of 3", TTL);
    rows.push(row);
    drop(nodes);
}

/// One node's link cut and restored every few hundred milliseconds.
async fn flapping(rows: &mut Vec<Row>) {
    let nodes = start_redis_nodes(3).unwrap();
    let ports: Vec<u16> = nodes.iter().map(|s| s.port()).collect();
    let net = Arc::new(Net::new(&ports));
    let mut run = Run::new(&format!("redlock://{}", net.addrs()), TTL, 4, 2, Policy::Go);
    run.worker_args = vec!["--op-timeout".into(), "150ms".into()];
    let target = if long_form() { 2000 } else { 400 };
    let net2 = net.clone();
    let o = execute(
        run,
        Duration::from_secs(240),
        move |s| s.grants.len() >= target,
        move |_, _, _| async move {
            let mut rng = Rng::new();
            loop {
                net2.proxies[0].set(Fault::Blackhole);
                tokio::time::sleep(Duration::from_millis(rng.between(200.0, 400.0) as u64)).await;
                net2.proxies[0].heal();
                tokio::time::sleep(Duration::from_millis(rng.between(200.0, 400.0) as u64)).await;
            }
        },
    )
    .await;
    let row = Row::of("redlock", "1 of 3 flapping 200-400 ms", &o);
    assert_safe(&row);
    assert_eq!(row.v.double_grants, 0, "{:?}", row.v);
    assert!(row.v.grants >= target, "{:?}", row.v);
    println!(
        "redlock flapping node: {} grants, {} failed acquisitions (availability {:.3})",
        row.v.grants,
        row.fails,
        row.v.grants as f64 / (row.v.grants + row.fails) as f64
    );
    rows.push(row);
    drop(nodes);
}

/// Nodes whose links are slowed by 50-200 ms each way: a grant's validity is counted from
/// before its first request, so the slow answers are taken off it.
async fn latency(slow: usize, rows: &mut Vec<Row>) {
    let nodes = start_redis_nodes(3).unwrap();
    let ports: Vec<u16> = nodes.iter().map(|s| s.port()).collect();
    let net = Arc::new(Net::new(&ports));
    // A TTL whose per-node deadline (TTL/20, at most 500 ms) is longer than the slowest round
    // trip, so slow nodes still vote and their slowness is taken off the validity; with a
    // shorter TTL they would simply be outvoted as not answering in time.
    let ttl = Duration::from_secs(10);
    // One worker per resource, so that no acquisition waits for another holder and the grant's
    // validity can be compared with the moment its one attempt began.
    let run = Run::new(&format!("redlock://{}", net.addrs()), ttl, 4, 1, Policy::Go);
    let target = if long_form() { 150 } else { 20 };
    let net2 = net.clone();
    let o = execute(
        run,
        Duration::from_secs(120),
        move |s| s.grants.len() >= target,
        move |_, _, _| async move {
            let mut rng = Rng::new();
            loop {
                for p in net2.proxies.iter().take(slow) {
                    let d = Duration::from_millis(rng.between(50.0, 200.0) as u64);
                    p.set(Fault::Latency(d));
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        },
    )
    .await;
    let scenario: &'static str = if slow == 1 {
        "1 of 3 +50-200 ms each way"
    } else {
        "2 of 3 +50-200 ms each way"
    };
    let row = Row::of("redlock", scenario, &o);
    assert_safe(&row);
    assert_eq!(row.v.double_grants, 0, "{:?}", row.v);
    assert!(row.v.grants >= target, "{:?}", row.v);
    let drift = ttl.mul_f64(0.01) + Duration::from_millis(2);
    // Validity on return is the TTL less the drift and less the time the granting attempt
    // took. With a slow majority that attempt waited for at least one slow node: two crossings
    // of at least 50 ms each.
    let floor = if slow > 1 {
        Duration::from_millis(100)
    } else {
        Duration::ZERO
    };
    let (mut shortest, mut longest) = (u128::MAX, 0);
    for g in &o.grants {
        assert!(
            g.valid_until > g.acquired,
            "{scenario}: a grant came back already expired"
        );
        let validity = g.valid_until - g.acquired;
        assert!(
            validity <= (ttl - drift - floor).as_nanos(),
            "{scenario}: a grant came back with {validity} ns of validity, more than the TTL \
             less the drift and the slow round trip allow"
        );
        shortest = shortest.min(validity);
        longest = longest.max(validity);
    }
    println!(
        "{scenario}: {} grants, validity on return {:.0}-{:.0} ms of a {} ms TTL",
        o.grants.len(),
        shortest as f64 / 1e6,
        longest as f64 / 1e6,
        ttl.as_millis()
    );
    rows.push(row);
    drop(nodes);
}

#[cfg(feature = "etcd")]
/// An etcd holder cut off from every member while the other clients are not.
async fn etcd_holder_cut(rows: &mut Vec<Row>) {
    let cluster = EtcdCluster::start(3).unwrap();
    // etcd leases are whole seconds.
    let (row, _) = cut_off_from_all(
        ("etcd", "holder cut off from the cluster"),
        |a| format!("etcd://{}", a.join(",")),
        &cluster.endpoints(),
        Duration::from_secs(1),
    )
    .await;
    rows.push(row);
    drop(cluster);
}

/// A holder cut off from every node of its engine (all its proxies blackholed) after
/// each grant, while the other clients are not: it learns of the loss, its window ends before
/// the successor's grant, and its write with the old token is refused.
async fn cut_off_from_all(
    (engine, scenario): (&'static str, &'static str),
    url: fn(&[String]) -> String,
    endpoints: &[String],
    ttl: Duration,
) -> (Row, Outcome) {
    let ports: Vec<u16> = endpoints
        .iter()
        .map(|e| e.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    let net = PerWorker::new(&ports);
    let mut run = Run::new("", ttl, 2, 2, Policy::CutVictim);
    run.victim_realtime = true;
    let n2 = net.clone();
    run.url_for = Some(Arc::new(move |id| url(&n2.addrs_for(id))));
    let n3 = net.clone();
    run.cut = Some(Arc::new(move |id, on| {
        let fault = if on { Fault::Blackhole } else { Fault::Pass };
        n3.set(id, |_| true, fault);
    }));
    run.worker_args = vec!["--op-timeout".into(), "300ms".into()];
    let cycles = if long_form() { 40 } else { 4 };
    let o = execute(
        run,
        // A cycle takes a few seconds here (a TTL, then a session timeout or an idle one).
        Duration::from_secs(if long_form() { 480 } else { 120 }),
        |s| s.cycles >= cycles,
        |_, _, _| std::future::pending(),
    )
    .await;
    let row = Row::of(engine, scenario, &o);
    assert_safe(&row);
    assert!(row.cycles >= cycles, "{} cycles", row.cycles);
    assert_eq!(row.v.double_grants, 0, "{:?} {:?}", row.v, overlaps(&o));
    assert!(
        row.v.writes_refused > 0,
        "no cut-off write refused: {:?}",
        row.v
    );
    check_losses(&o, &format!("{engine} {scenario}"), ttl);
    (row, o)
}

#[cfg(feature = "zookeeper")]
/// A ZooKeeper holder cut off from every server past its session timeout while the other
/// clients are not: its session expires on the ensemble, which deletes its node, and the next
/// waiter is granted the lock with a larger czxid; the holder, disconnected, has declared the
/// lease lost by then.
async fn zk_holder_cut(rows: &mut Vec<Row>) {
    let ensemble = fencelock_testkit::ZkEnsemble::start(3).unwrap();
    // The session timeout follows the TTL (the servers' tickTime is 500 ms: 1 to 10 s).
    let (row, _) = cut_off_from_all(
        ("zk", "holder cut off past its session"),
        |a| format!("zk://{}", a.join(",")),
        &ensemble.endpoints(),
        Duration::from_secs(1),
    )
    .await;
    rows.push(row);
    drop(ensemble);
}

#[cfg(feature = "zookeeper")]
/// What broke: a holder connected to a follower cut off from the leader kept renewing (reads
/// answered by the follower alone) past the successor's grant.
///
/// A ZooKeeper follower cut off from its peers (its host's link taken down in a network of the
/// test's own) each time a holder connected to it alone has just been granted a lock, while the
/// holder's own connection to it stays up; the other clients reach the two other servers. The
/// follower answers reads from its own copy until it gives up on the leader (syncLimit x
/// tickTime, 2.5 s here), while the leader expires the holder's session after its timeout and
/// grants the lock to the next waiter: the holder must count its lease lost by then, since no
/// renewal of its can be confirmed by the quorum.
async fn zk_follower_isolated(rows: &mut Vec<Row>) {
    let lan = Arc::new(
        Lan::new(3).expect("the follower-partition row needs root and iproute2 (ip netns)"),
    );
    let ensemble = tokio::task::block_in_place(|| {
        fencelock_testkit::ZkEnsemble::start_on(lan.clone()).unwrap()
    });
    let leader = tokio::task::block_in_place(|| ensemble.leader().unwrap());
    let follower = (leader + 1) % 3;
    let addrs: Vec<SocketAddr> = (0..3).map(|i| ensemble.addr(i)).collect();
    let proxies: Arc<Mutex<Vec<FaultProxy>>> = Arc::default();
    // A TTL of one session at the servers' shortest: 2 ticks, the leader's ping period
    // (tickTime/2) then as long against it as the servers allow.
    let ttl = Duration::from_secs(1);
    let mut run = Run::new("", ttl, 1, 2, Policy::CutVictim);
    run.victim_realtime = true;
    let (p2, l2) = (proxies.clone(), lan.clone());
    run.url_for = Some(Arc::new(move |id| {
        let mut mine = Vec::new();
        if id % 10 == 0 {
            // From the follower's own host: isolating it leaves this connection up.
            mine.push(FaultProxy::start_from(addrs[follower], &l2.host_path(follower)).unwrap());
        } else {
            for (_, a) in addrs.iter().enumerate().filter(|(i, _)| *i != follower) {
                mine.push(FaultProxy::start_from(*a, &l2.hub_path()).unwrap());
            }
        }
        let url = mine
            .iter()
            .map(|p| p.addr().to_string())
            .collect::<Vec<_>>();
        p2.lock().unwrap().extend(mine);
        format!("zk://{}", url.join(","))
    }));
    let l3 = lan.clone();
    run.cut = Some(Arc::new(move |_, on| {
        if on {
            l3.isolate(follower).unwrap();
        } else {
            l3.rejoin(follower).unwrap();
        }
    }));
    run.worker_args = vec!["--op-timeout".into(), "500ms".into()];
    let cycles = if long_form() { 20 } else { 3 };
    let o = execute(
        run,
        // A cycle takes several seconds: a session timeout, then the follower rejoining.
        Duration::from_secs(if long_form() { 600 } else { 180 }),
        |s| s.cycles >= cycles,
        |_, _, _| std::future::pending(),
    )
    .await;
    let row = Row::of("zk", "follower isolated (own network)", &o);
    assert_safe(&row);
    assert!(row.cycles >= cycles, "{} cycles", row.cycles);
    assert_eq!(row.v.double_grants, 0, "{:?} {:?}", row.v, overlaps(&o));
    assert!(
        row.v.writes_refused > 0,
        "no cut-off write refused: {:?}",
        row.v
    );
    check_losses(&o, "zk follower isolated", ttl);
    // How long before the successor's grant each cut-off holder's validity had ended.
    let margins: Vec<f64> = o
        .lost
        .iter()
        .filter_map(|l| {
            let next = o
                .grants
                .iter()
                .filter(|g| g.resource == 0 && g.token > l.token)
                .min_by_key(|g| g.token)?;
            Some((next.acquired as f64 - l.valid_until as f64) / 1e6)
        })
        .collect();
    println!(
        "zk follower isolated: each holder's validity ended {:.0} to {:.0} ms before the \
         successor's grant",
        margins.iter().copied().fold(f64::INFINITY, f64::min),
        margins.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    );
    rows.push(row);
    drop(proxies);
    // The servers go before their network does.
    drop(ensemble);
    drop(lan);
}

#[cfg(feature = "etcd")]
/// The raft leader partitioned from the other members and from every client (its host's link
/// taken down in a network of the test's own), each time a holder has just been granted a
/// lock: the others elect a new leader, the holder's client moves to them, and whether its
/// lease survives the election or not, no stale write is accepted.
async fn etcd_leader_isolated(rows: &mut Vec<Row>) {
    let lan =
        Arc::new(Lan::new(3).expect("the leader-partition row needs root and iproute2 (ip netns)"));
    let cluster = Arc::new(Mutex::new(EtcdCluster::start_on(lan.clone()).unwrap()));
    let targets: Vec<SocketAddr> = cluster
        .lock()
        .unwrap()
        .endpoints()
        .iter()
        .map(|e| e.parse().unwrap())
        .collect();
    let net = PerWorker {
        targets,
        netns: Some(lan.hub_path()),
        proxies: Arc::default(),
    };
    let ttl = Duration::from_secs(1);
    let mut run = Run::new("", ttl, 2, 2, Policy::CutVictim);
    let n2 = net.clone();
    run.url_for = Some(Arc::new(move |id| {
        format!("etcd://{}", n2.addrs_for(id).join(","))
    }));
    let isolated: Arc<Mutex<Option<usize>>> = Arc::default();
    let (c2, l2, i2) = (cluster.clone(), lan.clone(), isolated.clone());
    run.cut = Some(Arc::new(move |_, on| {
        let mut isolated = i2.lock().unwrap();
        if on && isolated.is_none() {
            if let Ok(leader) = c2.lock().unwrap().leader() {
                l2.isolate(leader).unwrap();
                *isolated = Some(leader);
            }
        } else if !on {
            if let Some(i) = isolated.take() {
                l2.rejoin(i).unwrap();
            }
        }
    }));
    run.worker_args = vec!["--op-timeout".into(), "500ms".into()];
    let cycles = if long_form() { 20 } else { 2 };
    let o = execute(
        run,
        // A cycle takes a few seconds here (a TTL, then a session timeout or an idle one).
        Duration::from_secs(if long_form() { 480 } else { 120 }),
        |s| s.cycles >= cycles,
        |_, _, _| std::future::pending(),
    )
    .await;
    let row = Row::of("etcd", "leader isolated (own network)", &o);
    assert_safe(&row);
    assert!(row.cycles >= cycles, "{} cycles", row.cycles);
    assert_eq!(row.v.double_grants, 0, "{:?}", row.v);
    println!(
        "etcd leader isolated: {} cycles, {} holders lost their lease during the election",
        row.cycles,
        o.lost.len()
    );
    rows.push(row);
    // The members go before their network does.
    drop(cluster);
    drop(lan);
}

/// A PostgreSQL holder whose connection goes silent (blackholed: no reset, no close). It
/// learns of the loss by its renewal deadline; the server, which still sees a healthy TCP
/// peer (the proxy), ends the silent session after its `idle_session_timeout`, and only then
/// can another client take the advisory lock.
async fn pg_holder_cut(rows: &mut Vec<Row>) {
    let server = PgServer::start().unwrap();
    let idle = Duration::from_secs(2);
    let out = server
        .psql(&format!(
            "ALTER SYSTEM SET idle_session_timeout = '{}ms'",
            idle.as_millis()
        ))
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = server.psql("SELECT pg_reload_conf()").unwrap();
    assert!(out.status.success(), "{out:?}");
    let ttl = Duration::from_secs(1);
    let (row, o) = cut_off_from_all(
        ("postgres", "holder's connection blackholed"),
        |a| format!("postgres://postgres@{}/postgres", a[0]),
        &[format!("127.0.0.1:{}", server.port())],
        ttl,
    )
    .await;
    // The successor waited for the server to end the silent session: the idle timeout after
    // the victim's last renewal, which was at most one TTL before its validity deadline.
    let mut gaps = Vec::new();
    for l in &o.lost {
        let next = o
            .grants
            .iter()
            .filter(|g| g.resource == resource_of(l.worker) && g.token > l.token)
            .min_by_key(|g| g.token);
        if let Some(next) = next {
            let gap = next.acquired.saturating_sub(l.valid_until);
            assert!(
                gap + 100_000_000 >= (idle - ttl).as_nanos(),
                "a successor was granted {gap} ns after the silent holder's validity ended, \
                 before the server could have ended its session: {next:?} {l:?}"
            );
            gaps.push(gap as f64 / 1e6);
        }
    }
    println!("postgres: successor granted {gaps:.0?} ms after the silent holder's validity ended");
    rows.push(row);
    drop(server);
}

/// Jobs grants, payments grants and failed acquisitions (all payments') so far.
fn shard_counts(s: &chaos_kit::Shared) -> (usize, usize, usize) {
    let s = s.lock().unwrap();
    // The side loops (payments) report under resources from `SIDE_ID_OFFSET / 10` on.
    let side = (chaos_kit::SIDE_ID_OFFSET / 10) as usize;
    let jobs = s.grants.iter().filter(|g| g.resource < side).count();
    (jobs, s.grants.len() - jobs, s.fails)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

/// The shards row (routes by prefix, docs/routing.md): every worker's client routes `jobs/*`
/// to one Redis server and `payments/*` to a Redlock of three others behind fault proxies.
/// Sixteen workers lock `jobs/*` names, and the same sixteen clients lock `payments/*` names
/// in a second loop each (`chaos-worker --side`), so a payments call hangs in the process whose
/// jobs throughput is measured. With payments blackholed, jobs must keep at least 90 % of its
/// undisturbed throughput, and every payments call must fail within its wait plus the call
/// under way.
///
/// The comparison has to hold on a 2-core machine that other builds share, whose load swings
/// by several times within seconds. Undisturbed and disturbed windows of the same length
/// alternate in pairs, undisturbed first, in the order calm-cut, cut-calm, calm-cut, ...: the two
/// windows of a pair are a second apart and see nearly the same load, the alternating order
/// cancels a load that rises or falls steadily, and the median of the pairs' ratios ignores a
/// pair that a neighbour's burst hit on one side only.
async fn shards(rows: &mut Vec<Row>) {
    let nodes = start_redis_nodes(4).unwrap();
    let ports: Vec<u16> = nodes.iter().map(|s| s.port()).collect();
    let net = Arc::new(Net::new(&ports[..3]));
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.toml");
    std::fs::write(
        &config,
        format!(
            "[backends]\npayments = \"redlock://{}\"\njobs = \"redis://127.0.0.1:{}\"\n\n\
             [[route]]\nprefix = \"payments/\"\nbackend = \"payments\"\n\n\
             [[route]]\nprefix = \"jobs/\"\nbackend = \"jobs\"\n",
            net.addrs(),
            ports[3]
        ),
    )
    .unwrap();
    let mut run = Run::new("", TTL, 8, 2, Policy::Go);
    run.config = Some(config);
    run.names = "jobs/".into();
    run.side = Some(("payments/".into(), WAIT));
    run.worker_args = vec![
        "--op-timeout".into(),
        format!("{}ms", OP_TIMEOUT.as_millis()),
    ];
    let (pairs, window) = if long_form() {
        (20, Duration::from_millis(2000))
    } else {
        (6, Duration::from_millis(700))
    };
    // After a switch: long enough for a payments grant answered before the cut to reach the
    // ledger, and for a lock taken by a request held in the blackhole to expire after the heal.
    let settle = TTL;
    // (cut, jobs grants/s, payments grants, failed acquisitions, start and end) per window.
    type Window = (bool, f64, usize, usize, u128, u128);
    let windows: Arc<Mutex<Vec<Window>>> = Arc::default();
    let (net2, windows2) = (net.clone(), windows.clone());
    let o = execute(
        run,
        Duration::from_secs(if long_form() { 240 } else { 60 }),
        |_| false,
        move |state, _, _| async move {
            // Every worker connected, and both routes warm (connections open, scripts loaded).
            while shard_counts(&state).0 < 32 || shard_counts(&state).1 < 8 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for pair in 0..pairs {
                for cut in [pair % 2 == 1, pair % 2 == 0] {
                    for p in &net2.proxies {
                        p.set(if cut { Fault::Blackhole } else { Fault::Pass });
                    }
                    tokio::time::sleep(settle).await;
                    let (j0, p0, f0) = shard_counts(&state);
                    let (started, from) = (std::time::Instant::now(), mono_ns());
                    tokio::time::sleep(window).await;
                    let (j1, p1, f1) = shard_counts(&state);
                    let rate = (j1 - j0) as f64 / started.elapsed().as_secs_f64();
                    let w = (cut, rate, p1 - p0, f1 - f0, from, mono_ns());
                    windows2.lock().unwrap().push(w);
                }
            }
            for p in &net2.proxies {
                p.heal();
            }
        },
    )
    .await;
    let row = Row {
        cycles: pairs,
        ..Row::of("routes", "payments cut, 16 on jobs", &o)
    };
    assert_safe(&row);
    assert_eq!(row.v.double_grants, 0, "{:?} {:?}", row.v, overlaps(&o));
    let windows = windows.lock().unwrap();
    assert_eq!(windows.len(), 2 * pairs, "every window ran");
    let (mut calm, mut cut, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for w in windows.chunks(2) {
        let (c, d) = if w[0].0 {
            (&w[1], &w[0])
        } else {
            (&w[0], &w[1])
        };
        assert!(
            c.2 > 0,
            "no payments grant while payments was reachable: {c:?}"
        );
        assert_eq!(d.2, 0, "a payments grant while it was blackholed: {d:?}");
        assert!(
            d.3 > 0,
            "no payments call failed while it was blackholed: {d:?}"
        );
        calm.push(c.1);
        cut.push(d.1);
        ratios.push(d.1 / c.1);
    }
    let ratio = median(&ratios);
    // A payments call begun while payments was blackholed gives up at its wait, plus at most
    // the one call in flight then. (One begun before a cut can take longer: a lock it found
    // held is released, and its holder looked up, through the blackhole.)
    let in_cut = |at: u128| windows.iter().any(|w| w.0 && w.4 <= at && at <= w.5);
    let cut_fails: Vec<u128> = (o.fail_at.iter().zip(&o.fail_ns))
        .filter(|(at, _)| in_cut(**at))
        .map(|(_, took)| *took)
        .collect();
    assert!(
        !cut_fails.is_empty(),
        "no payments call began and failed in a cut window"
    );
    let slowest = cut_fails.iter().max().copied().unwrap_or(0);
    let bound = (WAIT + OP_TIMEOUT * 2 + Duration::from_millis(100)).as_nanos();
    println!(
        "shards: jobs grants/s undisturbed {calm:.0?} (median {:.0}), payments blackholed \
         {cut:.0?} (median {:.0}); median ratio of the pairs {ratio:.3} (each {ratios:.2?}); \
         {} payments calls begun in a cut window failed, the slowest in {:.0} ms (bound \
         {:.0} ms)",
        median(&calm),
        median(&cut),
        cut_fails.len(),
        slowest as f64 / 1e6,
        bound as f64 / 1e6
    );
    assert!(
        ratio >= 0.9,
        "jobs throughput fell by more than 10% while payments was blackholed: {ratios:?}"
    );
    assert!(
        slowest <= bound,
        "a payments call took {slowest} ns to fail"
    );
    rows.push(row);
    drop(nodes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions() {
    let mut rows = Vec::new();
    // FENCELOCK_CHAOS_ONLY=ROW[,ROW...] runs only the rows of those function names.
    let only = std::env::var("FENCELOCK_CHAOS_ONLY").unwrap_or_default();
    let wanted = |row: &str| only.is_empty() || only.split(',').any(|w| w.trim() == row);
    if wanted("masks") {
        masks(3, &mut rows).await;
        masks(5, &mut rows).await;
    }
    if wanted("holder_cut") {
        holder_cut(&mut rows).await;
    }
    if wanted("shards") {
        shards(&mut rows).await;
    }
    if wanted("flapping") {
        flapping(&mut rows).await;
    }
    if wanted("latency") {
        latency(1, &mut rows).await;
        latency(2, &mut rows).await;
    }
    if wanted("pg_holder_cut") {
        pg_holder_cut(&mut rows).await;
    }
    #[cfg(feature = "etcd")]
    if wanted("etcd_holder_cut") {
        etcd_holder_cut(&mut rows).await;
    }
    #[cfg(feature = "zookeeper")]
    if wanted("zk_holder_cut") {
        zk_holder_cut(&mut rows).await;
    }
    #[cfg(feature = "etcd")]
    if wanted("etcd_leader_isolated") {
        etcd_leader_isolated(&mut rows).await;
    }
    #[cfg(feature = "zookeeper")]
    if wanted("zk_follower_isolated") {
        zk_follower_isolated(&mut rows).await;
    }
    print_table(&rows);
}
