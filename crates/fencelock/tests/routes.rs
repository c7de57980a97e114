//! Routes by prefix against real servers: two independent redis-server processes and a SQLite
//! file for the default route. Every call about a name lands on its route's backend (checked
//! with redis-cli on both servers), each backend renews its own leases, and a backend frozen
//! by SIGSTOP (the kernel still accepts connections: a blackhole) fails only its own names,
//! within their wait, naming it, while the other route's throughput stays as it was. A backend
//! killed before the client starts, or while it runs, fails only its own names too: the
//! client starts, the listings answer with the other backends' locks and name it, and its next
//! use after it is back opens it.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencelock::{Client, ErrorKind, ForceRelease, LockOptions, Routes};
use fencelock_testkit::RedisServer;
use tokio::time::Instant;

/// The tests of this file run one at a time: the throughput comparison must not share the
/// machine with the other tests' servers.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn exists(server: &RedisServer, key: &str) -> bool {
    let out = server.cli(&["EXISTS", key]).unwrap();
    String::from_utf8_lossy(&out.stdout).trim() == "1"
}

/// The engine key of `name`'s lock, as `fencelock key` prints it.
fn lock_key(client: &Client, name: &str) -> String {
    let keys = client.keys_for(name).unwrap();
    keys.into_iter().find(|(l, _)| *l == "lock").unwrap().1
}

fn routes(payments: &RedisServer, jobs: &RedisServer, db: &std::path::Path) -> Routes {
    Routes::new()
        .backend("payments", payments.url())
        .backend("jobs", jobs.url())
        .backend("local", format!("sqlite://{}", db.display()))
        .route("payments/", "payments")
        .route("jobs/", "jobs")
        .default_backend("local")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_call_goes_to_the_backend_of_its_route() {
    let _serial = SERIAL.lock().await;
    let (payments, jobs) = (RedisServer::start().unwrap(), RedisServer::start().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let client = Client::routed(routes(&payments, &jobs, &dir.path().join("l.db")))
        .connect()
        .await
        .unwrap();
    assert_eq!(
        client.backend_for("payments/7").await.unwrap().backend(),
        "payments"
    );
    assert_eq!(
        client.backend_for("jobs/nightly").await.unwrap().engine(),
        "redis"
    );
    assert_eq!(client.backend_for("misc").await.unwrap().engine(), "sqlite");

    // Short TTLs: the leases live through several renewals of their own backend's watchdog.
    let ttl = LockOptions::default().ttl(Duration::from_millis(600));
    let pay = client
        .acquire(
            "payments/7",
            &ttl.clone().fair(true).wait(Duration::from_secs(2)),
        )
        .await
        .unwrap();
    let job = client
        .acquire("jobs/nightly", &ttl.clone().wait(Duration::from_secs(2)))
        .await
        .unwrap();
    let misc = client.try_acquire("misc", &ttl).await.unwrap();
    let (pk, jk) = (
        lock_key(&client, "payments/7"),
        lock_key(&client, "jobs/nightly"),
    );
    assert!(
        exists(&payments, &pk) && !exists(&jobs, &pk),
        "payments/7 is on payments only"
    );
    assert!(
        exists(&jobs, &jk) && !exists(&payments, &jk),
        "jobs/nightly is on jobs only"
    );
    // The key "misc" would have on a Redis backend is on neither.
    let as_redis = lock_key(&client.backend_for("jobs/").await.unwrap(), "misc");
    assert!(!exists(&payments, &as_redis) && !exists(&jobs, &as_redis));

    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !pay.is_lost() && !job.is_lost() && !misc.is_lost(),
        "renewals kept all alive"
    );
    assert!(exists(&payments, &pk) && exists(&jobs, &jk));

    let holder = client.inspect("jobs/nightly").await.unwrap().unwrap();
    assert_eq!(holder.token, Some(job.token()));
    let listed = client.list("").await.unwrap();
    let rows: Vec<(&str, &str)> = listed
        .iter()
        .map(|l| (l.resource.as_str(), l.backend.as_str()))
        .collect();
    assert_eq!(
        rows,
        [
            ("jobs/nightly", "jobs"),
            ("misc", "local"),
            ("payments/7", "payments")
        ]
    );
    let only_jobs = client.list("jobs/").await.unwrap();
    assert_eq!(only_jobs.len(), 1);

    // A forced release deletes the key on its own backend and is audited there.
    let record = client
        .force_release(
            "jobs/nightly",
            &ForceRelease::new("test").holder_is_dead(true),
        )
        .await
        .unwrap()
        .unwrap();
    assert!(!exists(&jobs, &jk));
    assert!(
        exists(&payments, &pk),
        "the other backend's lock is untouched"
    );
    let audited = client.audit(None).await.unwrap();
    assert_eq!(audited.len(), 1);
    assert_eq!(audited[0].id, record.id);
    assert_eq!(client.audit(Some("payments/7")).await.unwrap().len(), 0);
    assert_eq!(client.audit(Some("jobs/nightly")).await.unwrap().len(), 1);

    pay.release().await.unwrap();
    misc.release().await.unwrap();
    assert!(!exists(&payments, &pk));
    let lost = job.release().await.unwrap_err();
    assert_eq!(lost.kind(), ErrorKind::NotHolder);
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_with_no_route_and_no_default_is_refused() {
    let _serial = SERIAL.lock().await;
    let server = RedisServer::start().unwrap();
    let client = Client::routed(Routes::new().backend("a", server.url()).route("a/", "a"))
        .connect()
        .await
        .unwrap();
    let e = client
        .try_acquire("b/1", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("no route matches \"b/1\""), "{e}");
    let e = Client::routed(
        Routes::new()
            .backend("a", "redis://h:0")
            .default_backend("a"),
    )
    .connect()
    .await
    .unwrap_err();
    assert!(e.to_string().contains("backends.a"), "{e}");
}

/// What broke: a routed client opened every backend when it started, so with the payments
/// backend down the whole client failed, names routed to healthy backends included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_down_at_start_fails_only_the_names_routed_to_it() {
    let _serial = SERIAL.lock().await;
    let (mut payments, jobs) = (RedisServer::start().unwrap(), RedisServer::start().unwrap());
    let dir = tempfile::tempdir().unwrap();
    payments.kill();
    let started = Instant::now();
    let client = Client::routed(routes(&payments, &jobs, &dir.path().join("l.db")))
        .connect()
        .await
        .expect("a client starts with one backend down");
    let ttl = LockOptions::default().ttl(Duration::from_secs(5));
    let job = client.try_acquire("jobs/nightly", &ttl).await.unwrap();
    let misc = client.try_acquire("misc", &ttl).await.unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "the healthy routes took {took:?}"
    );
    let e = client.try_acquire("payments/7", &ttl).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");
    assert_eq!(e.backend(), Some("payments"), "{e}");
    assert_eq!(e.resource(), Some("payments/7"), "{e}");
    // Names, keys and the routing table need no backend open.
    assert!(lock_key(&client, "payments/7").contains("payments/7"));
    assert_eq!(client.route_of("payments/7").unwrap(), "payments");
    assert_eq!(
        client.backends(),
        [
            ("jobs", "redis"),
            ("local", "sqlite"),
            ("payments", "redis")
        ]
    );
    assert!(client.inspect("jobs/nightly").await.unwrap().is_some());
    assert!(client.inspect("payments/7").await.is_err());
    // A backend that failed to open is tried again on its next use.
    payments.restart().unwrap();
    let pay = client.try_acquire("payments/7", &ttl).await.unwrap();
    assert_eq!(client.list("").await.unwrap().len(), 3);
    pay.release().await.unwrap();
    client.close().await;
    job.release().await.unwrap();
    misc.release().await.unwrap();
}

/// What broke: `list` and `audit` over several backends failed as a whole when one backend
/// was down, hiding the locks the healthy backends hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_answer_what_the_healthy_backends_hold_and_name_the_failed_one() {
    let _serial = SERIAL.lock().await;
    let (mut payments, jobs) = (RedisServer::start().unwrap(), RedisServer::start().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let client = Client::routed(routes(&payments, &jobs, &dir.path().join("l.db")))
        .connect()
        .await
        .unwrap();
    let ttl = LockOptions::default().ttl(Duration::from_secs(5));
    let pay = client.try_acquire("payments/7", &ttl).await.unwrap();
    let job = client.try_acquire("jobs/nightly", &ttl).await.unwrap();
    let misc = client.try_acquire("misc", &ttl).await.unwrap();
    client
        .force_release("misc", &ForceRelease::new("test").holder_is_dead(true))
        .await
        .unwrap();
    drop(misc);
    assert_eq!(client.list("").await.unwrap().len(), 2);

    payments.kill();
    let listing = client.list_partial("", None).await.unwrap();
    let rows: Vec<(&str, &str)> = listing
        .found
        .iter()
        .map(|l| (l.resource.as_str(), l.backend.as_str()))
        .collect();
    assert_eq!(rows, [("jobs/nightly", "jobs")]);
    assert_eq!(listing.answered, ["jobs", "local"]);
    assert!(!listing.is_complete());
    let failed: Vec<&str> = listing.failed.iter().map(|f| f.backend.as_str()).collect();
    assert_eq!(failed, ["payments"]);
    let why = listing.failed[0].error.to_string();
    assert!(why.contains("backend payments"), "{why}");
    // The all-or-nothing call says which backend failed; a prefix routed elsewhere does not
    // ask it at all.
    let e = client.list("").await.unwrap_err();
    assert_eq!(e.backend(), Some("payments"), "{e}");
    assert_eq!(client.list("jobs/").await.unwrap().len(), 1);

    let log = client.audit_partial(None, None).await.unwrap();
    assert_eq!(log.found.len(), 1, "{log:?}");
    assert_eq!(log.found[0].resource, "misc");
    assert_eq!(log.answered, ["jobs", "local"]);
    assert_eq!(log.failed[0].backend, "payments");
    assert!(client.audit(None).await.is_err());
    assert_eq!(client.audit(Some("misc")).await.unwrap().len(), 1);

    payments.restart().unwrap();
    let listing = client.list_partial("", None).await.unwrap();
    assert!(listing.is_complete(), "{:?}", listing.failed);
    drop(pay);
    job.release().await.unwrap();
    client.close().await;
}

/// Calls that find a blackholed backend being opened share that attempt: each fails within
/// about one attempt, not in a queue of attempts one behind the other. A listing given a
/// bound answers with the other backends by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_share_one_attempt_to_open_a_blackholed_backend() {
    let _serial = SERIAL.lock().await;
    let (payments, jobs) = (RedisServer::start().unwrap(), RedisServer::start().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let op_timeout = Duration::from_millis(400);
    payments.pause().unwrap();
    let client = Client::routed(routes(&payments, &jobs, &dir.path().join("l.db")))
        .op_timeout(op_timeout)
        .connect()
        .await
        .unwrap();
    let started = Instant::now();
    let mut calls = Vec::new();
    for i in 0..16 {
        let client = client.clone();
        calls.push(tokio::spawn(async move {
            let opts = LockOptions::default().ttl(Duration::from_secs(5));
            let e = client
                .try_acquire(&format!("payments/{i}"), &opts)
                .await
                .unwrap_err();
            (e.kind(), e.to_string())
        }));
    }
    for call in calls {
        let (kind, message) = call.await.unwrap();
        assert_eq!(kind, ErrorKind::Engine, "{message}");
        assert!(message.contains("backend payments"), "{message}");
    }
    let took = started.elapsed();
    // One attempt is bounded by three operation timeouts; sixteen in a queue would take 16.
    assert!(
        took < op_timeout * 4,
        "16 calls on a blackholed backend took {took:?}"
    );
    let job = client
        .try_acquire("jobs/1", &LockOptions::default())
        .await
        .unwrap();
    let started = Instant::now();
    let within = Duration::from_millis(600);
    let listing = client.list_partial("", Some(within)).await.unwrap();
    let took = started.elapsed();
    assert_eq!(listing.found.len(), 1);
    assert_eq!(listing.failed[0].backend, "payments");
    assert!(
        took < within + Duration::from_millis(400),
        "listing took {took:?}"
    );
    payments.resume().unwrap();
    job.release().await.unwrap();
    client.close().await;
}

/// One round: `workers` tasks lock and release `jobs/*` names for `span`; two more try
/// `payments/*` names with a wait of `pay_wait`. Returns the jobs acquisitions per second and
/// each payments failure with how long it took.
async fn round(
    client: &Client,
    workers: usize,
    span: Duration,
    pay_wait: Duration,
) -> (f64, Vec<(Duration, String)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (client, stop, done) = (client.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let opts = LockOptions::default().ttl(Duration::from_secs(5));
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let lease = client.acquire(&format!("jobs/{w}-{}", k % 4), &opts).await;
                lease.unwrap().release().await.unwrap();
                done.fetch_add(1, Ordering::Relaxed);
                k += 1;
            }
        }));
    }
    let mut payers = Vec::new();
    for p in 0..2 {
        let (client, stop) = (client.clone(), stop.clone());
        payers.push(tokio::spawn(async move {
            let opts = LockOptions::default()
                .ttl(Duration::from_secs(5))
                .wait(pay_wait);
            let mut failed = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                match client.acquire(&format!("payments/{p}"), &opts).await {
                    Ok(lease) => lease.release().await.unwrap(),
                    Err(e) => failed.push((started.elapsed(), e.to_string())),
                }
            }
            failed
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(span).await;
    stop.store(true, Ordering::Relaxed);
    let count = done.load(Ordering::Relaxed);
    let rate = count as f64 / started.elapsed().as_secs_f64();
    for t in tasks {
        t.await.unwrap();
    }
    let mut failures = Vec::new();
    for p in payers {
        failures.extend(p.await.unwrap());
    }
    (rate, failures)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (v[(n - 1) / 2] + v[n / 2]) / 2.0
}

/// The shards row of the chaos table: the payments backend blackholed while 16 workers lock
/// `jobs/*` names. Disturbed and undisturbed rounds alternate, so that load from the rest of
/// a shared machine falls on both alike, and their medians are compared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_backend_does_not_slow_the_other_route() {
    let _serial = SERIAL.lock().await;
    let (payments, jobs) = (RedisServer::start().unwrap(), RedisServer::start().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let op_timeout = Duration::from_millis(300);
    let client = Client::routed(routes(&payments, &jobs, &dir.path().join("l.db")))
        .op_timeout(op_timeout)
        .connect()
        .await
        .unwrap();
    let (span, pay_wait) = (Duration::from_millis(800), Duration::from_millis(500));
    // Warm-up: connections opened, scripts loaded on both servers.
    round(&client, 16, Duration::from_millis(300), pay_wait).await;
    let (mut calm, mut cut) = (Vec::new(), Vec::new());
    let mut pay_failures = Vec::new();
    // Pairs in alternating order (calm, cut, cut, calm, ...): a machine getting busier or
    // quieter during the test weighs on both kinds of round alike.
    for pair in 0..4 {
        for blackholed in [pair % 2 == 1, pair % 2 == 0] {
            if !blackholed {
                let (rate, failed) = round(&client, 16, span, pay_wait).await;
                assert!(failed.is_empty(), "payments failed while up: {failed:?}");
                calm.push(rate);
                continue;
            }
            payments.pause().unwrap();
            let (rate, failed) = round(&client, 16, span, pay_wait).await;
            payments.resume().unwrap();
            // Attempts sent into the blackhole are answered on resume, and their
            // owner-checked releases right behind them: the next round starts with payments
            // free.
            for p in ["payments/0", "payments/1"] {
                let free = fencelock_testkit::wait_until(Duration::from_secs(6), || {
                    !exists(&payments, &lock_key(&client, p))
                });
                assert!(free, "{p} stayed held after the resume");
            }
            cut.push(rate);
            assert!(
                !failed.is_empty(),
                "no payments call failed while it was blackholed"
            );
            pay_failures.extend(failed);
        }
    }
    let (calm_m, cut_m) = (median(&calm), median(&cut));
    println!(
        "shards: jobs acquisitions/s undisturbed {calm:.0?} (median {calm_m:.0}), payments \
         blackholed {cut:.0?} (median {cut_m:.0}), ratio {:.3}; {} payments calls failed, \
         slowest after {:?}",
        cut_m / calm_m,
        pay_failures.len(),
        pay_failures.iter().map(|f| f.0).max().unwrap()
    );
    assert!(
        cut_m >= 0.9 * calm_m,
        "jobs throughput fell by more than 10% while payments was blackholed"
    );
    for (took, message) in &pay_failures {
        assert!(message.contains("backend payments"), "{message}");
        // The wait, plus at most the one attempt under way when it ran out.
        assert!(
            *took <= pay_wait + op_timeout + Duration::from_millis(300),
            "a payments call took {took:?}: {message}"
        );
    }
    client.close().await;
}
