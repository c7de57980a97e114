//! What only the etcd engine does, against a real 3-member etcd cluster on loopback: FIFO
//! waiters, interop with `etcdctl lock`, key layout, members dying, lost quorum and mutual TLS.
//! What every engine does is in the conformance suite.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::connect;

use fencelock::{Client, ErrorKind, LockOptions};
use fencelock_testkit::{wait_until, EtcdCluster, EtcdTls};
use tokio::time::{timeout, Instant};

fn cluster() -> EtcdCluster {
    EtcdCluster::start(3).unwrap()
}

/// Every key under the default etcd prefix, in key order.
fn keys(c: &EtcdCluster) -> Vec<String> {
    let out = c
        .ctl(&["get", "/fencelock/v1/", "--prefix", "--keys-only"])
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

fn waiter_keys(c: &EtcdCluster, name: &str) -> Vec<String> {
    let pfx = format!("/fencelock/v1/{name}/");
    keys(c)
        .into_iter()
        .filter(|k| k.starts_with(&pfx))
        .collect()
}

/// The first line a child prints on stdout, read on a thread, within `limit`.
fn first_line(child: &mut Child, limit: Duration) -> Option<String> {
    let stdout = child.stdout.take()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || read_first_line(stdout, &tx));
    rx.recv_timeout(limit)
        .ok()
        .filter(|l| !l.is_empty())
        .map(|l| l.trim().to_owned())
}

/// Sends the first line of `stdout`, then reads the rest until the process ends. A pipe whose
/// reader is gone kills etcdctl with SIGPIPE at its next write (it writes after the key it
/// printed), and a killed etcdctl leaves its lock behind for its lease's 60 s.
fn read_first_line(stdout: std::process::ChildStdout, tx: &std::sync::mpsc::Sender<String>) {
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    let _ = reader.read_line(&mut line);
    let _ = tx.send(line);
    let _ = std::io::copy(&mut reader, &mut std::io::sink());
}

fn end(mut child: Child) {
    // SIGTERM lets etcdctl close its session (revoking its lease) as an operator's Ctrl-C would.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_are_granted_in_fifo_order() {
    let c = cluster();
    let holder = connect(&c.url()).await;
    let first = holder
        .try_acquire("q", &LockOptions::default())
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..5 {
        let client = connect(&c.url()).await;
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let opts = LockOptions::default().wait(Duration::from_secs(20));
            let lease = client.acquire("q", &opts).await.unwrap();
            order.lock().unwrap().push((i, lease.token().get()));
            lease.release().await.unwrap();
        }));
        // The next waiter starts only once this one is in the queue.
        assert!(wait_until(Duration::from_secs(5), || waiter_keys(&c, "q")
            .len()
            == i + 2));
    }
    let first_token = first.token().get();
    first.release().await.unwrap();
    for t in tasks {
        timeout(Duration::from_secs(20), t).await.unwrap().unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4],
        "{order:?}"
    );
    assert!(order.windows(2).all(|w| w[0].1 < w[1].1), "{order:?}");
    assert!(order[0].1 > first_token);
}

#[tokio::test]
async fn names_map_to_disjoint_prefixes_and_key_prints_them() {
    let c = cluster();
    let client = connect(&c.url()).await;
    let keys_for = client.keys_for("a/b").unwrap();
    assert_eq!(keys_for[0].1, "/fencelock/v1/a%2Fb");
    // `a` and `a/b` are different locks, both holdable at once.
    let a = client
        .try_acquire("a", &LockOptions::default())
        .await
        .unwrap();
    let ab = client
        .try_acquire("a/b", &LockOptions::default())
        .await
        .unwrap();
    assert_eq!(waiter_keys(&c, "a").len(), 1);
    a.release().await.unwrap();
    ab.release().await.unwrap();
    let custom = Client::builder(c.url())
        .prefix("/app/locks/")
        .connect()
        .await
        .unwrap();
    assert_eq!(custom.keys_for("x").unwrap()[0].1, "/app/locks/x");
}

#[tokio::test]
async fn etcdctl_lock_and_fencelock_exclude_each_other() {
    let c = cluster();
    let client = connect(&c.url()).await;
    let name = client.keys_for("shared").unwrap()[0].1.clone();

    // etcdctl holds: fencelock is refused, names the holder by its lease, and gets the lock
    // once etcdctl lets go.
    let mut ctl = c.ctl_command(&["lock", &name]).spawn().unwrap();
    let key = first_line(&mut ctl, Duration::from_secs(10)).expect("etcdctl lock printed its key");
    assert!(key.starts_with(&format!("{name}/")), "{key}");
    let e = client
        .try_acquire("shared", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert!(e.holder().unwrap().owner.starts_with("etcd lease "), "{e}");
    let waiting = tokio::spawn({
        let client = client.clone();
        async move {
            client
                .acquire(
                    "shared",
                    &LockOptions::default().wait(Duration::from_secs(15)),
                )
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiting.is_finished(),
        "granted while etcdctl held the lock"
    );
    end(ctl);
    let lease = timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();

    // fencelock holds: etcdctl waits until the release.
    let mut ctl = c.ctl_command(&["lock", &name]).spawn().unwrap();
    let stdout = ctl.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || read_first_line(stdout, &tx));
    assert!(
        rx.recv_timeout(Duration::from_millis(700)).is_err(),
        "etcdctl lock got the lock while fencelock held it"
    );
    let released = Instant::now();
    lease.release().await.unwrap();
    let line = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(line.starts_with(&format!("{name}/")), "{line}");
    assert!(released.elapsed() < Duration::from_secs(5));
    end(ctl);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn locking_continues_when_members_die_and_tokens_keep_rising() {
    let mut c = cluster();
    let url = c.url();
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let client = Client::builder(url.clone())
            .op_timeout(Duration::from_secs(2))
            .connect()
            .await
            .unwrap();
        let tokens = tokens.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let opts = LockOptions::default()
                .ttl(Duration::from_secs(3))
                .wait(Duration::from_secs(10));
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match client.acquire("k", &opts).await {
                    Ok(lease) => {
                        tokens.lock().unwrap().push(lease.token().get());
                        // A release caught by the crash may go unanswered; the session then
                        // expires on its own.
                        let _ = lease.release().await;
                    }
                    // A call caught by the crash fails with a clear engine error; the next
                    // one goes to a live member.
                    Err(e) => assert_eq!(e.kind(), ErrorKind::Engine, "{e}"),
                }
            }
        }));
    }
    let count = || tokens.lock().unwrap().len();
    assert!(wait_until(Duration::from_secs(10), || count() >= 20));
    let leader = c.leader().unwrap();
    c.kill(leader);
    let at_kill = count();
    assert!(
        wait_until(Duration::from_secs(20), || count() >= at_kill + 30),
        "locking stalled after the leader died: {} grants",
        count() - at_kill
    );
    c.restart(leader).unwrap();
    let other = (leader + 1) % 3;
    c.kill(other);
    let at_kill = count();
    assert!(wait_until(Duration::from_secs(20), || count() >= at_kill + 30));
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for t in tasks {
        timeout(Duration::from_secs(30), t).await.unwrap().unwrap();
    }
    let tokens = tokens.lock().unwrap().clone();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not strictly increasing in grant order"
    );
}

#[tokio::test]
async fn lost_quorum_is_a_lost_lease_never_silently_regained() {
    let c = cluster();
    let client = Client::builder(c.url())
        .op_timeout(Duration::from_millis(500))
        .connect()
        .await
        .unwrap();
    let ttl = Duration::from_secs(1);
    let lease = client
        .try_acquire("p", &LockOptions::default().ttl(ttl))
        .await
        .unwrap();
    // Two of three members frozen: no keep-alive can be confirmed any more.
    let leader = c.leader().unwrap();
    let frozen = [leader, (leader + 1) % 3];
    for i in frozen {
        c.pause(i).unwrap();
    }
    let paused = Instant::now();
    timeout(ttl + Duration::from_millis(500), lease.lost())
        .await
        .expect("lease reported lost within its TTL");
    assert!(paused.elapsed() <= ttl + Duration::from_millis(100));
    for i in frozen {
        c.resume(i).unwrap();
    }
    // The cluster is back; the lease stays lost, and extending it says so.
    assert_eq!(
        lease.extend().await.unwrap_err().kind(),
        ErrorKind::LeaseLost
    );
    assert!(lease.is_lost());
    let other = connect(&c.url()).await;
    let next = other
        .acquire("p", &LockOptions::default().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    assert!(next.token() > lease.token());
    assert!(lease.is_lost());
    next.release().await.unwrap();
}

#[tokio::test]
async fn mutual_tls_needs_the_ca_and_a_client_certificate() {
    let certs = tempfile::tempdir().unwrap();
    let tls = EtcdTls::generate(certs.path()).unwrap();
    let c = EtcdCluster::start_tls(1, &tls).unwrap();
    assert!(c.url().starts_with("etcds://"));
    let client = connect(&c.url()).await;
    let lease = client
        .try_acquire("tls", &LockOptions::default())
        .await
        .unwrap();
    lease.release().await.unwrap();

    // No client certificate: the server refuses the handshake.
    let ep = c.endpoints().join(",");
    let no_cert = format!("etcds://{ep}?ca={}", tls.ca.display());
    // A CA that did not sign the server's certificate: the client refuses the server.
    let other = tempfile::tempdir().unwrap();
    let other = EtcdTls::generate(other.path()).unwrap();
    let wrong_ca = format!(
        "etcds://{ep}?ca={}&cert={}&key={}",
        other.ca.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    );
    // A client certificate from another CA: the server refuses it.
    let other_client = format!(
        "etcds://{ep}?ca={}&cert={}&key={}",
        tls.ca.display(),
        other.client_cert.display(),
        other.client_key.display()
    );
    // No line of a private key may reach an error message.
    let key_lines: Vec<String> = [&tls.client_key, &other.client_key]
        .iter()
        .flat_map(|k| {
            std::fs::read_to_string(k)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter(|l| !l.starts_with("-----") && l.len() > 16)
        .collect();
    for url in [no_cert, wrong_ca, other_client, format!("etcd://{ep}")] {
        let client = Client::builder(&url)
            .op_timeout(Duration::from_millis(500))
            .connect()
            .await;
        let e = match client {
            Ok(client) => client
                .try_acquire("tls", &LockOptions::default())
                .await
                .unwrap_err(),
            Err(e) => e,
        };
        assert_eq!(e.kind(), ErrorKind::Engine, "{url}: {e}");
        let text = format!("{e} {e:?}");
        assert!(
            !key_lines.iter().any(|l| text.contains(l)),
            "{url}: key material"
        );
    }
    // A missing file is the caller's mistake.
    let e = Client::connect(&format!("etcds://{ep}?ca=/nonexistent/ca.pem"))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
}

/// A grant that arrives with too little of its TTL left is released and tried again while the
/// wait lasts, as on every other engine; it used to end the whole acquisition with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_slower_than_its_ttl_is_retried_while_the_wait_lasts() {
    let c = EtcdCluster::start(1).unwrap();
    let client = Client::connect(&c.url()).await.unwrap();
    // A first call opens the connection, so the frozen member below delays a grant, not a
    // connect.
    client
        .try_acquire("warm", &LockOptions::default())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let opts = LockOptions::default()
        .ttl(Duration::from_millis(200))
        .wait(Duration::from_secs(20));
    c.pause(0).unwrap();
    let acquiring = tokio::spawn({
        let client = client.clone();
        async move { client.acquire("slow", &opts).await }
    });
    // The member stays frozen for twice the TTL: whatever it grants first is already useless.
    tokio::time::sleep(Duration::from_millis(400)).await;
    c.resume(0).unwrap();
    let lease = timeout(Duration::from_secs(25), acquiring)
        .await
        .expect("the acquisition hung")
        .unwrap()
        .expect("a slow grant ended the acquisition instead of being retried");
    lease.release().await.unwrap();
    client.close().await;
}

/// etcd's count of raft proposals committed, from its `/metrics`.
fn proposals_committed(endpoint: &str) -> u64 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(endpoint).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {endpoint}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix("etcd_server_proposals_committed_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap() as u64
}

/// The session lease id (hex) in the waiter key of each lease, in order.
fn session_of(c: &EtcdCluster, name: &str) -> Vec<String> {
    waiter_keys(c, name)
        .into_iter()
        .map(|k| k.rsplit('/').next().unwrap().to_owned())
        .collect()
}

/// One session per client serves every acquisition: an uncontended acquire+release is the
/// creating transaction and the delete, two raft writes, where a lease per acquisition made it
/// four (grant, transaction, delete, revoke).
#[tokio::test]
async fn an_uncontended_acquire_and_release_is_two_raft_writes() {
    let c = EtcdCluster::start(1).unwrap();
    let client = connect(&c.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    // The first acquisition grants the session.
    client
        .try_acquire("w", &opts)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let ep = &c.endpoints()[0];
    let before = proposals_committed(ep);
    let pairs = 20;
    let mut last = None;
    for _ in 0..pairs {
        let lease = client.try_acquire("w", &opts).await.unwrap();
        assert!(Some(lease.token()) > last, "tokens keep rising");
        last = Some(lease.token());
        lease.release().await.unwrap();
    }
    let writes = proposals_committed(ep) - before;
    assert!(
        (2 * pairs..=2 * pairs + 2).contains(&writes),
        "{writes} raft writes for {pairs} pairs"
    );
}

/// A lease dropped without release has its key deleted by the client at once, not when the
/// session it shares with the client's other leases ends (which is never, while they renew).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_lease_has_its_key_deleted_long_before_the_session_ends() {
    let c = EtcdCluster::start(1).unwrap();
    let client = connect(&c.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    let kept = client.try_acquire("kept", &opts).await.unwrap();
    let dropped = client.try_acquire("dropped", &opts).await.unwrap();
    assert_eq!(session_of(&c, "kept"), session_of(&c, "dropped"));
    drop(dropped);
    assert!(wait_until(Duration::from_secs(3), || waiter_keys(
        &c, "dropped"
    )
    .is_empty()));
    let other = connect(&c.url()).await;
    other
        .try_acquire("dropped", &opts)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(waiter_keys(&c, "kept").len(), 1);
    kept.release().await.unwrap();
}

/// A session that etcd no longer has (revoked here by an operator) takes every lease on it at
/// once, and the next acquisition grants a new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_session_loses_every_lease_on_it_at_once() {
    let c = EtcdCluster::start(1).unwrap();
    let client = connect(&c.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(2));
    let mut leases = Vec::new();
    for name in ["s1", "s2", "s3"] {
        leases.push(client.try_acquire(name, &opts).await.unwrap());
    }
    let session = session_of(&c, "s1");
    assert_eq!(session, session_of(&c, "s3"));
    let out = c.ctl(&["lease", "revoke", &session[0]]).unwrap();
    assert!(out.status.success(), "{out:?}");
    let mut lost_at = Vec::new();
    for l in &leases {
        timeout(Duration::from_secs(2), l.lost())
            .await
            .expect("lease reported lost after its session was revoked");
        lost_at.push(Instant::now());
    }
    let spread = *lost_at.last().unwrap() - lost_at[0];
    assert!(spread < Duration::from_millis(100), "lost {spread:?} apart");
    let next = client.try_acquire("s1", &opts).await.unwrap();
    assert_ne!(session_of(&c, "s1"), session);
    assert!(next.token() > leases[0].token());
    next.release().await.unwrap();
}

/// A cancelled acquisition deletes the key it may have created on the shared session: while
/// queued, and with its creating transaction still in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_acquisition_leaves_no_key_on_the_shared_session() {
    let c = EtcdCluster::start(1).unwrap();
    let holder = connect(&c.url()).await;
    let client = connect(&c.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    // Keeps the client's session alive throughout.
    let kept = client.try_acquire("kept", &opts).await.unwrap();
    let held = holder.try_acquire("c", &opts).await.unwrap();
    let waiting = tokio::spawn({
        let client = client.clone();
        let opts = opts.clone().wait(Duration::from_secs(20));
        async move { client.acquire("c", &opts).await }
    });
    assert!(wait_until(Duration::from_secs(5), || waiter_keys(&c, "c")
        .len()
        == 2));
    waiting.abort();
    assert!(wait_until(Duration::from_secs(3), || waiter_keys(&c, "c")
        .len()
        == 1));
    // Cancelled at every point of an uncontended acquisition, the creation in flight included.
    for i in 0..30u64 {
        let attempt = timeout(
            Duration::from_micros(i * 150),
            client.try_acquire("t", &opts),
        );
        if let Ok(Ok(lease)) = attempt.await {
            lease.release().await.unwrap();
        }
    }
    client.close().await;
    assert!(
        wait_until(Duration::from_secs(3), || waiter_keys(&c, "t").is_empty()),
        "{:?}",
        waiter_keys(&c, "t")
    );
    held.release().await.unwrap();
    kept.release().await.unwrap();
}

/// Two acquisitions of one name by one client cannot share a key: the second takes a second
/// session and queues behind the first, FIFO, like any other waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_acquisitions_of_one_name_by_one_client_queue_on_two_sessions() {
    let c = EtcdCluster::start(1).unwrap();
    let client = connect(&c.url()).await;
    let opts = LockOptions::default().ttl(Duration::from_secs(30));
    let first = client.try_acquire("n", &opts).await.unwrap();
    let second = tokio::spawn({
        let client = client.clone();
        let opts = opts.clone().wait(Duration::from_secs(20));
        async move { client.acquire("n", &opts).await }
    });
    assert!(wait_until(Duration::from_secs(5), || waiter_keys(&c, "n")
        .len()
        == 2));
    let sessions = session_of(&c, "n");
    assert_ne!(sessions[0], sessions[1]);
    assert!(client.try_acquire("n", &opts).await.is_err(), "held twice");
    let first_token = first.token();
    first.release().await.unwrap();
    let second = timeout(Duration::from_secs(10), second)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(second.token() > first_token);
    // Both sessions stay for later acquisitions: a third on another name needs no new one.
    let other = client.try_acquire("m", &opts).await.unwrap();
    assert!(sessions.contains(&session_of(&c, "m")[0]));
    other.release().await.unwrap();
    second.release().await.unwrap();
    assert!(waiter_keys(&c, "n").is_empty());
}
