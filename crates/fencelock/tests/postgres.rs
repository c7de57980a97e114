//! What only the PostgreSQL engine does, both modes, against a real server started by the test
//! kit: re-entrant sessions, interop with psql, session loss, server restarts, pooled
//! connections and wake-ups by LISTEN/NOTIFY. What every engine does is in the conformance
//! suite.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use fencelock::{Client, ErrorKind, LockOptions};
use fencelock_testkit::PgServer;
use tokio::time::timeout;

const LIMIT: Duration = Duration::from_secs(20);

fn lease_url(server: &PgServer) -> String {
    format!("{}?mode=lease", server.url())
}

async fn client(url: &str) -> Client {
    timeout(LIMIT, Client::connect(url)).await.unwrap().unwrap()
}

fn query(server: &PgServer, sql: &str) -> String {
    let out = server.psql(sql).unwrap();
    assert!(out.status.success(), "psql failed: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn advisory_key(c: &Client, name: &str) -> i64 {
    let keys = c.keys_for(name).unwrap();
    let (_, k) = keys.iter().find(|(label, _)| *label == "advisory").unwrap();
    k.parse().unwrap()
}

/// Advisory locks are re-entrant per session; two leases of one process (sharing its pooled
/// sessions) must still exclude each other.
#[tokio::test]
async fn two_leases_of_one_client_exclude_each_other() {
    let server = PgServer::start().unwrap();
    let c = client(&server.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(5));
    let first = c.try_acquire("job", &opts).await.unwrap();
    let e = c.try_acquire("job", &opts).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother, "{e}");
    let t1 = first.token();
    first.release().await.unwrap();
    let second = c.try_acquire("job", &opts).await.unwrap();
    assert!(second.token() > t1);
    second.release().await.unwrap();
    // Released means released on the server too: a psql session can take it now.
    let k = advisory_key(&c, "job");
    assert_eq!(
        query(&server, &format!("SELECT pg_try_advisory_lock({k})")),
        "t"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_and_fencelock_exclude_each_other_on_the_printed_key() {
    let server = PgServer::start().unwrap();
    let c = client(&server.url()).await;
    let k = advisory_key(&c, "nightly-invoices");
    let opts = LockOptions::default().ttl(Duration::from_secs(5));

    // fencelock holds: psql's try fails.
    let lease = c.try_acquire("nightly-invoices", &opts).await.unwrap();
    assert_eq!(
        query(&server, &format!("SELECT pg_try_advisory_lock({k})")),
        "f"
    );
    lease.release().await.unwrap();

    // psql holds: fencelock is refused and names the psql backend; once that session ends,
    // a waiting acquire gets it.
    let mut psql = server
        .psql_session(&format!("SELECT pg_advisory_lock({k}), pg_sleep(60)"))
        .unwrap();
    let held_by_psql = format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
         WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = 'psql' \
         AND ((l.classid::bigint << 32) | l.objid::bigint) = {k}"
    );
    assert!(fencelock_testkit::wait_until(LIMIT, || query(
        &server,
        &held_by_psql
    ) == "1"));
    let e = c.try_acquire("nightly-invoices", &opts).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother, "{e}");
    let holder = c
        .inspect("nightly-invoices")
        .await
        .unwrap()
        .expect("held by psql");
    assert!(holder.owner.starts_with("postgres backend "), "{holder:?}");
    assert_eq!(holder.client.as_deref(), Some("psql"));

    let waiter = {
        let c = c.clone();
        let opts = opts.clone().wait(Duration::from_secs(15));
        tokio::spawn(async move { c.acquire("nightly-invoices", &opts).await })
    };
    // The runbook's forced release ends the psql session, the only way to take a session
    // lock away from its holder.
    let request = fencelock::ForceRelease::new("psql session left open").holder_is_dead(true);
    let record = c
        .force_release("nightly-invoices", &request)
        .await
        .unwrap()
        .expect("released");
    assert!(record.holder.owner.starts_with("postgres backend "));
    let lease = timeout(LIMIT, waiter).await.unwrap().unwrap().unwrap();
    assert!(lease.token() > record.counter);
    lease.release().await.unwrap();
    let _ = psql.kill();
    let _ = psql.wait();
}

/// The backend of the holder's session is terminated: the lease is reported lost within a
/// second or so, long before its TTL (30 s) could tell, and the lock is free for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_backend_means_lost_leases_at_once() {
    let server = PgServer::start().unwrap();
    let c = client(&server.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    let lease = c.try_acquire("job", &opts).await.unwrap();
    let other = c.try_acquire("other", &opts).await.unwrap();
    let k = advisory_key(&c, "job");
    let killed = query(
        &server,
        &format!(
            "SELECT pg_terminate_backend(pid) FROM pg_locks l WHERE l.locktype = 'advisory' \
             AND ((l.classid::bigint << 32) | l.objid::bigint) = {k}"
        ),
    );
    assert_eq!(killed, "t");
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    let e = lease.extend().await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LeaseLost, "{e}");
    // A lease on another session is untouched (it may share the terminated one: then it is
    // lost too, and says so).
    if !other.is_lost() {
        other.extend().await.unwrap();
    }
    // The server sends the session its termination before the backend has exited and let go
    // of its locks: the client hears of the loss first, so the next acquisition may wait a
    // moment for the lock (a busy machine showed it held right after the loss).
    let again = c
        .acquire("job", &opts.clone().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(again.token() > lease.token());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_means_lost_leases_and_tokens_survive() {
    let mut server = PgServer::start().unwrap();
    for url in [server.url(), lease_url(&server)] {
        let lease_mode = url.contains("mode=lease");
        let c = client(&url).await;
        let ttl = Duration::from_secs(if lease_mode { 10 } else { 2 });
        let opts = LockOptions::default().ttl(ttl);
        let lease = c.try_acquire("job", &opts).await.unwrap();
        let first = lease.token();
        tokio::task::block_in_place(|| server.restart().unwrap());
        if lease_mode {
            // The row survives the restart: once the client has reconnected, the lease
            // renews as before.
            timeout(Duration::from_secs(5), async {
                while lease.extend().await.is_err() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await
            .unwrap();
            assert!(!lease.is_lost());
            lease.release().await.unwrap();
        } else {
            // The session ended with the server: the lease is reported lost at once.
            timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
        }
        let c = client(&url).await;
        let next = timeout(
            LIMIT,
            c.acquire("job", &opts.clone().wait(Duration::from_secs(5))),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(next.token() > first, "{first} then {}", next.token());
        next.release().await.unwrap();
    }
}

/// Prepared statements live and die with their connection: after the server restarts, the
/// same client prepares them again on its new connections and locks as before (advisory
/// mode always prepares; the lease table with `?prepare=true`), limits checked as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_are_prepared_again_after_a_server_restart() {
    let mut server = PgServer::start().unwrap();
    let clients = [
        client(&server.url()).await,
        client(&format!("{}?mode=lease&prepare=true", server.url())).await,
    ];
    let opts = LockOptions::default().ttl(Duration::from_secs(10));
    let mut before = Vec::new();
    for c in &clients {
        let lease = c.try_acquire("job", &opts).await.unwrap();
        before.push(lease.token());
        lease.release().await.unwrap();
    }
    tokio::task::block_in_place(|| server.restart().unwrap());
    for (c, first) in clients.iter().zip(before) {
        // The first attempts may meet the connection the restart closed: they fail as engine
        // errors, which a waiting acquire retries, and the next one connects anew.
        let waiting = opts.clone().wait(Duration::from_secs(10));
        let lease = timeout(LIMIT, c.acquire("job", &waiting))
            .await
            .unwrap()
            .unwrap();
        assert!(lease.token() > first, "{first} then {}", lease.token());
        lease.extend().await.unwrap();
        lease.release().await.unwrap();
        c.set_limits(&fencelock::Limits::default().with_max_ttl(Duration::from_secs(5)))
            .await
            .unwrap();
        let e = c.try_acquire("job", &opts).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::LimitExceeded, "{} {e}", c.engine());
        c.set_limits(&fencelock::Limits::default()).await.unwrap();
    }
}

/// 10,000 leases held at once by one client, on at most 10 connections, all renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_leases_share_at_most_ten_connections() {
    let server = PgServer::start().unwrap();
    let c = Client::builder(format!("{}?pool=10", server.url()))
        .client_name("many")
        .connect()
        .await
        .unwrap();
    let opts = LockOptions::default().ttl(Duration::from_secs(12));
    let mut tasks = tokio::task::JoinSet::new();
    // 64 acquisitions in flight at a time, as a busy service would have.
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let started = std::time::Instant::now();
    for i in 0..10_000 {
        let (c, opts, permits) = (c.clone(), opts.clone(), permits.clone());
        tasks.spawn(async move {
            let _permit = permits.acquire().await.unwrap();
            c.try_acquire(&format!("item-{i}"), &opts).await
        });
    }
    let mut leases = Vec::new();
    while let Some(r) = timeout(LIMIT, tasks.join_next()).await.unwrap() {
        leases.push(r.unwrap().unwrap());
    }
    assert_eq!(leases.len(), 10_000);
    eprintln!("10,000 leases acquired in {:?}", started.elapsed());
    let held = query(
        &server,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted",
    );
    assert_eq!(held, "10000");
    let connections = query(
        &server,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fencelock'",
    );
    let n: usize = connections.parse().unwrap();
    assert!((1..=10).contains(&n), "{n} connections");
    // A renewal round (every TTL/3) goes by and every lease is still valid.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert!(leases.iter().all(|l| !l.is_lost()));
    let mut tasks = tokio::task::JoinSet::new();
    for l in leases {
        tasks.spawn(l.release());
    }
    while let Some(r) = timeout(LIMIT, tasks.join_next()).await.unwrap() {
        r.unwrap().unwrap();
    }
    assert_eq!(
        query(
            &server,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        ),
        "0"
    );
}

/// A release wakes a waiter through LISTEN/NOTIFY, well before its backoff would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_wakes_waiters_in_both_modes() {
    let server = PgServer::start().unwrap();
    for url in [server.url(), lease_url(&server)] {
        let holder = client(&url).await;
        let waiter = client(&url).await;
        let lease = holder
            .try_acquire("job", &LockOptions::default())
            .await
            .unwrap();
        let opts = LockOptions::default()
            .wait(Duration::from_secs(20))
            .backoff(Duration::from_secs(10), Duration::from_secs(10));
        // The sessions whose last statement ended an attempt (the holder's, so far); the
        // waiter's refused attempt shows as a new one. In lease mode a refusal ends by reading
        // the holder.
        let attempt = if url.contains("mode=lease") {
            "SELECT owner, token, host"
        } else {
            "pg_try_advisory_lock"
        };
        let sessions = format!(
            "SELECT pid FROM pg_stat_activity WHERE query LIKE '%{attempt}%' \
             AND state = 'idle' AND pid <> pg_backend_pid() ORDER BY pid"
        );
        let before = query(&server, &sessions);
        // Nobody has waited yet, so no session listens: a client that only takes free locks
        // has no notification delivered to it (the first round has the server to itself).
        // The last statement of a session that listened is its LISTEN, or its UNLISTEN once
        // nobody waits any more.
        let listening =
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%LISTEN fencelock_%' \
             AND pid <> pg_backend_pid()";
        let first_round = !url.contains("mode=lease");
        if first_round {
            assert_eq!(query(&server, listening), "0");
        }
        // Kept, so that the waiter's sessions stay until they are counted.
        let _waiter = waiter.clone();
        let task = tokio::spawn(async move { waiter.acquire("job", &opts).await });
        // The waiter made its first attempt, was refused and sits in its 10 s backoff.
        assert!(fencelock_testkit::wait_until(LIMIT, || {
            query(&server, &sessions)
                .lines()
                .any(|pid| !before.lines().any(|b| b == pid))
        }));
        if first_round {
            // Refused, the waiter's client starts listening. Awaited here rather than read
            // once after the grant: by then a listening session that dropped and reconnected
            // would rightly no longer listen, and its last statement would not show it.
            let listened =
                fencelock_testkit::wait_until(LIMIT, || query(&server, listening) == "1");
            assert!(
                listened,
                "the waiter's client did not listen: {}",
                query(
                    &server,
                    "SELECT pid, state, query FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                )
            );
        }
        let released = tokio::time::Instant::now();
        lease.release().await.unwrap();
        let got = timeout(LIMIT, task).await.unwrap().unwrap().unwrap();
        assert!(
            released.elapsed() < Duration::from_secs(3),
            "{url}: woken after {:?}",
            released.elapsed()
        );
        got.release().await.unwrap();
    }
}

/// A forced release can take an advisory lock from another process only by ending the
/// holder's session: the holder learns of the loss at once, long before its next renewal
/// against a 30 s TTL (10 s away) could tell it, and every other lease of that session, which
/// ends too, is named and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_ends_the_advisory_holders_session_at_once() {
    let server = PgServer::start().unwrap();
    // One session holds every lease of `c`.
    let c = client(&format!("{}?pool=2", server.url())).await;
    let ops = client(&server.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    let lease = c.try_acquire("stuck", &opts).await.unwrap();
    let mut beside = Vec::new();
    for name in ["a", "b", "c"] {
        beside.push(c.try_acquire(name, &opts).await.unwrap());
    }
    let request = fencelock::ForceRelease::new("test").holder_is_dead(true);
    let record = ops
        .force_release("stuck", &request)
        .await
        .unwrap()
        .expect("released");
    assert_eq!(record.holder.owner, lease.owner());
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    let ended: Vec<(&str, &str)> = record
        .ended_with
        .iter()
        .map(|r| (r.resource.as_str(), r.holder.owner.as_str()))
        .collect();
    let expected: Vec<(&str, &str)> = beside.iter().map(|l| (l.resource(), l.owner())).collect();
    assert_eq!(
        ended, expected,
        "every lease that ended with the session is named"
    );
    for l in &beside {
        timeout(Duration::from_secs(5), l.lost()).await.unwrap();
    }
    let audit = ops.audit(None).await.unwrap();
    for r in &record.ended_with {
        assert!(audit.iter().any(|a| a.id == r.id), "{r:?} not recorded");
        assert!(r.counter > r.holder.token.unwrap());
    }
    let next = c.try_acquire("stuck", &opts).await.unwrap();
    assert!(next.token() > record.counter);
    next.release().await.unwrap();
}

/// A forced release of a lock held on the releasing client's own session terminated that
/// session, ending every other lease on it: it now unlocks the one key there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_on_the_clients_own_session_ends_that_lease_alone() {
    let server = PgServer::start().unwrap();
    let c = client(&format!("{}?pool=2", server.url())).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    let lease = c.try_acquire("stuck", &opts).await.unwrap();
    let others: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| c.try_acquire(n, &opts))
        .collect();
    let mut beside = Vec::new();
    for o in others {
        beside.push(o.await.unwrap());
    }
    let request = fencelock::ForceRelease::new("test").holder_is_dead(true);
    let record = c
        .force_release("stuck", &request)
        .await
        .unwrap()
        .expect("released");
    assert_eq!(record.holder.owner, lease.owner());
    assert!(record.ended_with.is_empty(), "{record:?}");
    timeout(Duration::from_secs(5), lease.lost()).await.unwrap();
    let next = client(&server.url())
        .await
        .try_acquire("stuck", &opts)
        .await
        .unwrap();
    assert!(next.token() > record.counter);
    for l in &beside {
        assert!(!l.is_lost(), "{} ended with it", l.resource());
        let holder = c.inspect(l.resource()).await.unwrap().unwrap();
        assert_eq!(holder.owner, l.owner());
        l.extend().await.unwrap();
    }
}

/// Advisory locks never expire on the server; a lease dropped without release is unlocked by
/// its client once its TTL passes, so the resource does not stay taken while the process lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_advisory_lease_is_unlocked_after_its_ttl() {
    let server = PgServer::start().unwrap();
    let c = client(&server.url()).await;
    let other = client(&server.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_millis(400));
    let lease = c.try_acquire("job", &opts).await.unwrap();
    let token = lease.token();
    let dropped = tokio::time::Instant::now();
    drop(lease);
    let next = timeout(
        LIMIT,
        other.acquire("job", &opts.clone().wait(Duration::from_secs(5))),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(dropped.elapsed() >= Duration::from_millis(300));
    assert!(next.token() > token);
    next.release().await.unwrap();
}

/// PostgreSQL's own words reach the user: a wrong password, an unknown database or role, a
/// missing privilege and a refused connection each say what the server (or the socket) said,
/// not "db error: db error".
#[tokio::test]
async fn engine_errors_carry_the_servers_message() {
    let server = PgServer::start().unwrap();
    let pw_url = server.add_password_role("pw", "right").unwrap();
    let port = server.port();
    let with_password = pw_url.replace("pw@", "pw:wrong@");
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        drop(l);
        p
    };
    let cases = [
        (with_password, "password authentication failed"),
        (
            format!("postgres://postgres@127.0.0.1:{port}/nosuchdb"),
            "database \"nosuchdb\" does not exist",
        ),
        (
            format!("postgres://nosuchrole@127.0.0.1:{port}/postgres"),
            "role \"nosuchrole\" does not exist",
        ),
        (
            format!("postgres://postgres@127.0.0.1:{closed}/postgres"),
            "Connection refused",
        ),
    ];
    for (url, says) in cases {
        let e = timeout(LIMIT, Client::connect(&url)).await.unwrap().err();
        let text = e.as_ref().map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains(says), "{url}: {text}");
        assert!(!text.contains("db error"), "{url}: {text}");
        assert!(!text.contains("wrong"), "the password leaked: {text}");
    }
    // A role that may connect but not create fencelock's tables in the public schema.
    query(&server, "REVOKE CREATE ON SCHEMA public FROM PUBLIC");
    let right = pw_url.replace("pw@", "pw:right@");
    let e = timeout(LIMIT, Client::connect(&right)).await.unwrap().err();
    let text = e.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("permission denied"), "{text}");
}

/// A forced release by a role that may not INSERT into `fencelock_audit` deletes nothing: the
/// audit record and the release are one transaction, and the message says what was refused.
#[tokio::test]
async fn a_forced_release_that_cannot_write_its_audit_record_deletes_nothing() {
    let server = PgServer::start().unwrap();
    let holder = client(&server.url()).await;
    let lease = holder
        .try_acquire("job", &LockOptions::default())
        .await
        .unwrap();
    let ops_url = server.add_password_role("ops", "opspw").unwrap();
    query(
        &server,
        "DO $$ DECLARE t text; BEGIN FOR t IN SELECT tablename FROM pg_tables \
         WHERE tablename LIKE 'fencelock%' LOOP EXECUTE format('ALTER TABLE %I OWNER TO ops', t); \
         END LOOP; END $$; GRANT ALL ON SCHEMA public TO ops; GRANT pg_signal_backend TO ops; \
         REVOKE INSERT ON fencelock_audit FROM ops",
    );
    let ops = client(&ops_url.replace("ops@", "ops:opspw@")).await;
    let request = fencelock::ForceRelease::new("test").holder_is_dead(true);
    let e = timeout(LIMIT, ops.force_release("job", &request))
        .await
        .unwrap()
        .err();
    let text = e.as_ref().map(ToString::to_string).unwrap_or_default();
    assert!(
        text.contains("permission denied for table fencelock_audit"),
        "{text}"
    );
    assert!(ops.inspect("job").await.unwrap().is_some());
    assert!(!lease.is_lost());
    assert_eq!(query(&server, "SELECT count(*) FROM fencelock_audit"), "0");
    lease.release().await.unwrap();
}
