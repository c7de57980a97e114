//! The ZooKeeper engine against real three-server ensembles: interop with Apache Curator
//! (a Java peer compiled here with `javac`), tokens across leader changes and full restarts, a
//! holder stopped past its session, a lost quorum, digest authentication with ACLs, and
//! election failover seen by Curator's `LeaderLatch`. Tests that leave the ensemble whole share
//! one; those that kill servers start their own.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{poll_until, wait_for_line, BinCommand, Sandbox, FINISH, WAIT_FOR_RELEASE};
use fencelock::{Client, ErrorKind, ForceRelease, LockOptions};
use fencelock_testkit::{curator_classpath, java_bin, ZkEnsemble, SMALL_JVM};
use nix::sys::signal::{kill, Signal};

const HELD: i32 = 75;
const LEASE_LOST: i32 = 79;

/// Compiles the Curator peer into `dir`.
fn compile_peer(dir: &std::path::Path) {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/zookeeper/Peer.java");
    let out = Command::new("javac")
        .args(["-cp", &curator_classpath(), "-d"])
        .arg(dir)
        .arg(&src)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "javac: {out:?}");
}

/// The scenarios that leave the ensemble whole, one after the other on one ensemble (a
/// three-JVM start costs seconds); the Curator peer is compiled once for them.
#[test]
fn on_one_ensemble() {
    let zk = ZkEnsemble::start(3).unwrap();
    let classes = tempfile::tempdir().unwrap();
    compile_peer(classes.path());
    let classes = classes.path();
    curator_and_fencelock_share_one_lock_and_one_queue(&zk, classes);
    a_holder_stopped_past_its_session_loses_the_lock(&zk);
    other_credentials_cannot_delete_the_holders_node(&zk);
    election_fails_over_and_curator_sees_the_same_leader(&zk, classes);
    observers_see_leaders_and_proclaimed_values(&zk, classes);
}

/// A running Curator peer (see `tests/zookeeper/Peer.java`), killed on drop.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Peer {
    fn start(connect: &str, classes: &std::path::Path) -> Peer {
        let cp = format!("{}:{}", curator_classpath(), classes.display());
        let mut child = Command::new(java_bin())
            .args(SMALL_JVM)
            .args(["-cp", &cp, "Peer", connect])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut peer = Peer {
            child,
            stdin,
            lines,
        };
        peer.expect("ready");
        peer
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// The next line, which must start with `prefix`.
    fn expect(&mut self, prefix: &str) -> String {
        let line = self
            .lines
            .recv_timeout(FINISH)
            .map_err(|e| format!("no {prefix:?} from the Curator peer: {e}"))
            .unwrap();
        assert!(line.starts_with(prefix), "wanted {prefix:?}, got {line:?}");
        line
    }

    /// Whether a line arrived within `d` (it is consumed).
    fn quiet_for(&mut self, d: Duration) -> Option<String> {
        self.lines.recv_timeout(d).ok()
    }

    fn ask(&mut self, line: &str, prefix: &str) -> String {
        self.send(line);
        self.expect(prefix)[prefix.len()..].trim().to_owned()
    }

    fn children(&mut self, path: &str) -> usize {
        self.ask(&format!("children {path}"), "children")
            .parse()
            .unwrap()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `fencelock ARGS` against `url`, in the sandbox.
fn fl(sb: &Sandbox, url: &str, sub: &str, args: &[&str]) -> BinCommand {
    let mut cmd = sb.bare();
    cmd.arg(sub).arg("--backend").arg(url).args(args);
    cmd
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Curator holds: `fencelock run --if-held fail` exits 75. fencelock holds: Curator's
/// `acquire(1, SECONDS)` is false. A queue of Curator and fencelock waiters is served in the
/// order they joined it. `fencelock key` names the path Curator was given.
fn curator_and_fencelock_share_one_lock_and_one_queue(zk: &ZkEnsemble, classes: &std::path::Path) {
    let sb = Sandbox::new();
    let url = zk.url();
    let out = sb.run(fl(&sb, &url, "key", &["jobs/nightly"]));
    assert!(
        out.stdout.contains("/fencelock/v1/jobs%2Fnightly\n"),
        "{}",
        out.stdout
    );
    let out = sb.run(fl(&sb, &url, "doctor", &[]));
    assert_eq!(out.code(), Some(0), "{out:?}");
    assert!(
        out.stdout.contains("ensemble opened a session"),
        "{}",
        out.stdout
    );
    let path = "/fencelock/v1/jobs%2Fnightly";
    let mut peer = Peer::start(&zk.connect_string(), classes);

    peer.send(&format!("lock c0 {path}"));
    peer.expect("granted c0");
    let out = sb.run(fl(
        &sb,
        &url,
        "run",
        &["--if-held", "fail", "jobs/nightly", "--", "true"],
    ));
    assert_eq!(out.code(), Some(HELD), "{out:?}");
    // The holder is shown as Curator stores it: its address.
    assert!(out.stderr.contains("holder: host "), "{}", out.stderr);
    peer.send("release c0");
    peer.expect("released c0");

    let rt = rt();
    let client = rt.block_on(Client::connect(&url)).unwrap();
    let lease = rt
        .block_on(client.try_acquire("jobs/nightly", &LockOptions::default()))
        .unwrap();
    assert_eq!(peer.ask(&format!("try {path}"), "try"), "false");

    // The queue: fencelock holds; then Curator c1, fencelock f1, Curator c2 join in turn.
    peer.send(&format!("lock c1 {path}"));
    assert!(poll_until(FINISH, || peer.children(path) == 2));
    let waiter = rt.block_on(Client::connect(&url)).unwrap();
    let wait = LockOptions::default().wait(FINISH);
    let f1 = rt.spawn(async move { waiter.acquire("jobs/nightly", &wait).await });
    assert!(poll_until(FINISH, || peer.children(path) == 3));
    peer.send(&format!("lock c2 {path}"));
    assert!(poll_until(FINISH, || peer.children(path) == 4));

    rt.block_on(lease.release()).unwrap();
    peer.expect("granted c1");
    assert!(!f1.is_finished(), "f1 was granted while c1 held");
    peer.send("release c1");
    peer.expect("released c1");
    let f1 = rt.block_on(f1).unwrap().unwrap();
    assert_eq!(peer.quiet_for(Duration::from_millis(200)), None);
    rt.block_on(f1.release()).unwrap();
    peer.expect("granted c2");
    peer.send("release c2");
    peer.expect("released c2");
    assert_eq!(peer.children(path), 0);
}

/// Tokens grow in grant order across a leader kill and a full restart of the ensemble; with a
/// quorum gone, a held lease is reported lost within its validity and an acquisition fails
/// within its wait with an error that says what to check.
#[test]
fn tokens_grow_across_leader_changes_and_a_lost_quorum_is_reported() {
    let mut zk = ZkEnsemble::start(3).unwrap();
    let url = zk.url();
    let rt = rt();
    let opts = LockOptions::default()
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(20));
    let take = |c: &Client| {
        rt.block_on(async {
            let l = c.acquire("t", &opts).await.unwrap();
            let t = l.token();
            l.release().await.unwrap();
            t
        })
    };
    let c = rt.block_on(Client::connect(&url)).unwrap();
    let t1 = take(&c);
    let leader = zk.leader().unwrap();
    zk.kill(leader);
    zk.wait_leader(FINISH).unwrap();
    let t2 = take(&c);
    assert!(t2 > t1, "{t2} after {t1} across a leader kill");
    // A new epoch: the zxid's high half.
    assert!(
        t2.get() >> 32 > t1.get() >> 32,
        "{:x} {:x}",
        t1.get(),
        t2.get()
    );
    zk.restart(leader).unwrap();

    for i in 0..zk.len() {
        zk.kill(i);
    }
    for i in 0..zk.len() {
        zk.relaunch(i).unwrap();
    }
    for i in 0..zk.len() {
        zk.wait_serving(i).unwrap();
    }
    let fresh = rt.block_on(Client::connect(&url)).unwrap();
    let t3 = take(&fresh);
    assert!(t3 > t2, "{t3} after {t2} across a full restart");

    // Two of three servers gone.
    let ttl = Duration::from_secs(2);
    let lease = rt
        .block_on(fresh.try_acquire("q", &LockOptions::default().ttl(ttl)))
        .unwrap();
    zk.kill(0);
    zk.kill(1);
    let slack = Duration::from_millis(500);
    rt.block_on(async { tokio::time::timeout(ttl + slack, lease.lost()).await })
        .expect("the lease outlived the quorum");
    let late = Instant::now().saturating_duration_since(lease.valid_until().into_std());
    assert!(late <= slack, "lost {late:?} after its validity");

    let wait = Duration::from_secs(2);
    let op_timeout = Duration::from_secs(1);
    let started = Instant::now();
    let e = rt
        .block_on(async {
            let other = Client::builder(&url)
                .op_timeout(op_timeout)
                .connect()
                .await?;
            other
                .acquire("q2", &LockOptions::default().ttl(ttl).wait(wait))
                .await
        })
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        took <= wait + op_timeout * 3 + slack,
        "failed after {took:?}"
    );
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");
    assert!(e.to_string().contains("majority"), "{e}");
}

/// `fencelock run` stopped (SIGSTOP) past its session timeout: its node is gone, the next
/// holder's token is larger, and once resumed it reports the lease lost and exits 79.
fn a_holder_stopped_past_its_session_loses_the_lock(zk: &ZkEnsemble) {
    let sb = Sandbox::new();
    let url = zk.url();
    let script = format!("echo \"$FENCELOCK_TOKEN\" > token; {WAIT_FOR_RELEASE}");
    let mut holder = sb.spawn(fl(
        &sb,
        &url,
        "run",
        &[
            "--ttl",
            "1s",
            "--kill-after",
            "1s",
            "frozen",
            "--",
            "sh",
            "-c",
            &script,
        ],
    ));
    let old: u64 = wait_for_line(&sb.path("token"), FINISH).parse().unwrap();
    kill(holder.pid(), Signal::SIGSTOP).unwrap();
    let stopped = Instant::now();
    let rt = rt();
    let next = rt
        .block_on(async {
            let c = Client::connect(&url).await?;
            c.acquire("frozen", &LockOptions::default().wait(FINISH))
                .await
        })
        .unwrap();
    // The session (1 s) expires on the servers' next check, at most a tick later.
    let took = stopped.elapsed();
    assert!(took < Duration::from_secs(3), "took over after {took:?}");
    assert!(next.token().get() > old);
    kill(holder.pid(), Signal::SIGCONT).unwrap();
    let out = holder.wait(FINISH).unwrap();
    assert_eq!(out.code(), Some(LEASE_LOST), "{out:?}");
    assert!(out.stderr.contains("lost"), "{}", out.stderr);
    rt.block_on(next.release()).unwrap();
}

/// With digest credentials, the nodes fencelock creates belong to that identity: another
/// identity (or none) can read who holds the lock but can neither delete the holder's node
/// nor queue behind it.
fn other_credentials_cannot_delete_the_holders_node(zk: &ZkEnsemble) {
    let hosts = zk.connect_string();
    let rt = rt();
    rt.block_on(async {
        let alice = Client::connect(&format!("zk://alice:secret@{hosts}"))
            .await
            .unwrap();
        let lease = alice
            .try_acquire("vault", &LockOptions::default().ttl(Duration::from_secs(2)))
            .await
            .unwrap();
        let dead = ForceRelease::new("takeover").holder_is_dead(true);
        for url in [format!("zk://bob:other@{hosts}"), format!("zk://{hosts}")] {
            let c = Client::connect(&url).await.unwrap();
            let h = c.inspect("vault").await.unwrap().expect("readable");
            assert_eq!(h.owner, lease.owner());
            let e = c.force_release("vault", &dead).await.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Engine, "{url}: {e}");
            assert!(e.to_string().contains("not authorized"), "{url}: {e}");
            let e = c
                .try_acquire("vault", &LockOptions::default())
                .await
                .unwrap_err();
            assert!(e.to_string().contains("not authorized"), "{url}: {e}");
        }
        assert!(!lease.is_lost());
        lease.extend().await.unwrap();
        // The same identity in another process may.
        let ops = Client::connect(&format!("zk://alice:secret@{hosts}"))
            .await
            .unwrap();
        assert!(ops.force_release("vault", &dead).await.unwrap().is_some());
        tokio::time::timeout(Duration::from_secs(2), lease.lost())
            .await
            .expect("the holder was told");
    });
}

/// `fencelock elect`: the leader's process killed, the next candidate leads within the session
/// timeout and a second, with a larger token; Curator's `LeaderLatch` names the same leader,
/// by the value each campaigned with.
fn election_fails_over_and_curator_sees_the_same_leader(
    zk: &ZkEnsemble,
    classes: &std::path::Path,
) {
    let sb = Sandbox::new();
    let url = zk.url();
    let elect = |value: &str| {
        let script = format!(
            "echo $$ > {value}.pid; echo \"$FENCELOCK_TOKEN\" > {value}.token; {WAIT_FOR_RELEASE}"
        );
        fl(
            &sb,
            &url,
            "elect",
            &[
                "--ttl",
                "1s",
                "--kill-after",
                "1s",
                "--value",
                value,
                "svc",
                "--",
                "sh",
                "-c",
                &script,
            ],
        )
    };
    let mut a = sb.spawn(elect("a"));
    let a_token: u64 = wait_for_line(&sb.path("a.token"), FINISH).parse().unwrap();
    let mut peer = Peer::start(&zk.connect_string(), classes);
    assert_eq!(peer.ask("leader /fencelock/v1/svc", "leader"), "a");
    let mut b = sb.spawn(elect("b"));
    assert!(poll_until(FINISH, || peer.children("/fencelock/v1/svc") == 2));

    kill(a.pid(), Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    let b_token: u64 = wait_for_line(&sb.path("b.token"), FINISH).parse().unwrap();
    let took = killed.elapsed();
    assert!(
        took <= Duration::from_secs(2) + Duration::from_millis(500),
        "{took:?}"
    );
    assert!(b_token > a_token);
    assert_eq!(peer.ask("leader /fencelock/v1/svc", "leader"), "b");
    let _ = a.wait(FINISH);
    if let Ok(pid) = std::fs::read_to_string(sb.path("a.pid")) {
        let pid = nix::unistd::Pid::from_raw(pid.trim().parse().unwrap());
        let _ = nix::sys::signal::killpg(pid, Signal::SIGKILL);
    }
    std::fs::write(sb.path("release"), "").unwrap();
    assert_eq!(b.wait(FINISH).unwrap().code(), Some(0));
}

/// An observer (fed by watches) sees each leader and each proclaimed value; a proclaim is
/// what Curator's `LeaderLatch` reads as the leader's id too.
fn observers_see_leaders_and_proclaimed_values(zk: &ZkEnsemble, classes: &std::path::Path) {
    let mut peer = Peer::start(&zk.connect_string(), classes);
    let rt = rt();
    let client = rt.block_on(Client::connect(&zk.url())).unwrap();
    let election = client.election("obs").unwrap();
    let mut seen = rt.block_on(election.observe()).unwrap();
    let next = |seen: &mut tokio::sync::watch::Receiver<Option<fencelock::Leader>>,
                want: Option<&str>| {
        rt.block_on(async {
            let changed = seen.wait_for(|l| l.as_ref().map(|l| l.value.as_str()) == want);
            tokio::time::timeout(Duration::from_secs(3), changed)
                .await
                .map_err(|_| format!("the observer never saw {want:?}"))
                .unwrap()
                .unwrap()
                .clone()
        })
    };
    let opts = LockOptions::default().ttl(Duration::from_secs(2));
    let lead = rt.block_on(election.campaign("v1", &opts)).unwrap();
    let first = next(&mut seen, Some("v1")).unwrap();
    assert_eq!(first.token, lead.token());
    rt.block_on(lead.proclaim("v2")).unwrap();
    next(&mut seen, Some("v2"));
    assert_eq!(peer.ask("leader /fencelock/v1/obs", "leader"), "v2");
    rt.block_on(lead.resign()).unwrap();
    next(&mut seen, None);
}

/// `zks://` against a server whose client port requires TLS and a client certificate signed by
/// a private CA: a lease over TLS, and the refusals of clients that cannot prove themselves,
/// each a clear message and exit 69 in bounded time without a byte of a key; unreadable or
/// non-PEM TLS files are bad input (exit 64).
#[test]
fn zks_over_mutual_tls_and_every_refusal_is_clear() {
    const BAD_INPUT: i32 = 64;
    const UNAVAILABLE: i32 = 69;
    let sb = Sandbox::new();
    let tls = fencelock_testkit::TestTls::generate(&sb.path("ca")).unwrap();
    let other = fencelock_testkit::TestTls::generate(&sb.path("other-ca")).unwrap();
    let zk = ZkEnsemble::start_tls(1, &tls).unwrap();
    let key_lines: Vec<String> = [&tls.client_key, &other.client_key]
        .iter()
        .flat_map(|k| {
            std::fs::read_to_string(k)
                .unwrap()
                .lines()
                .filter(|l| !l.starts_with("-----") && l.len() > 16)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let run = |url: &str| {
        let mut cmd = fl(&sb, url, "run", &["--ttl", "5s", "job", "--"]);
        cmd.args(["sh", "-c", "echo token=$FENCELOCK_TOKEN"]);
        let started = Instant::now();
        let out = sb.run(cmd);
        let text = format!("{}{}", out.stdout, out.stderr);
        for line in &key_lines {
            assert!(!text.contains(line), "{url}: key material in the output");
        }
        assert!(!out.stderr.contains("panicked"), "{url}: {}", out.stderr);
        (out, started.elapsed())
    };

    let url = zk.tls_url().unwrap();
    let (out, _) = run(&url);
    assert_eq!(out.code(), Some(0), "run over zks://: {out:?}");
    assert!(out.stdout.contains("token="), "{out:?}");
    // While a holder runs, `inspect` over TLS names it.
    let up = sb.path("up");
    let mut held = fl(&sb, &url, "run", &["--ttl", "5s", "job", "--"]);
    held.args(["sh", "-c", &format!("echo up > {}; sleep 30", up.display())]);
    let holder = sb.spawn(held);
    common::wait_for_line(&up, Duration::from_secs(20));
    let out = sb.run(fl(&sb, &url, "inspect", &["job"]));
    assert!(
        out.stdout.starts_with("job: held by pid"),
        "inspect over zks://: {out:?}"
    );
    drop(holder);

    let port = zk.secure_endpoints()[0].clone();
    let refused = [
        (
            "no client certificate",
            format!("zks://{port}?ca={}", tls.ca.display()),
        ),
        (
            "a client certificate from another CA",
            format!(
                "zks://{port}?ca={}&cert={}&key={}",
                tls.ca.display(),
                other.client_cert.display(),
                other.client_key.display()
            ),
        ),
        (
            "a server certificate from an unknown CA",
            format!(
                "zks://{port}?ca={}&cert={}&key={}",
                other.ca.display(),
                tls.client_cert.display(),
                tls.client_key.display()
            ),
        ),
        ("plain zk:// on the TLS port", format!("zk://{port}")),
    ];
    for (what, url) in refused {
        let (out, took) = run(&url);
        assert_eq!(out.code(), Some(UNAVAILABLE), "{what}: {out:?}");
        assert!(took < Duration::from_secs(20), "{what}: {took:?}");
        assert!(!out.stdout.contains("token="), "{what}: the command ran");
        assert!(
            out.stderr.starts_with("fencelock: "),
            "{what}: {}",
            out.stderr
        );
    }
    // The unknown CA is named as the likely cause.
    let (out, _) = run(&format!(
        "zks://{port}?ca={}&cert={}&key={}",
        other.ca.display(),
        tls.client_cert.display(),
        tls.client_key.display()
    ));
    assert!(
        out.stderr.contains("TLS") && out.stderr.contains("ca="),
        "{}",
        out.stderr
    );

    let not_pem = sb.path("not-a-cert.pem");
    std::fs::write(&not_pem, "not a certificate\n").unwrap();
    let bad = [
        (
            "ca= not a certificate",
            format!("zks://{port}?ca={}", not_pem.display()),
        ),
        (
            "ca= missing",
            format!("zks://{port}?ca={}", sb.path("missing.pem").display()),
        ),
        (
            "key= not a key",
            format!(
                "zks://{port}?ca={}&cert={}&key={}",
                tls.ca.display(),
                tls.client_cert.display(),
                not_pem.display()
            ),
        ),
        ("zks:// without ca=", format!("zks://{port}")),
    ];
    for (what, url) in bad {
        let (out, _) = run(&url);
        assert_eq!(out.code(), Some(BAD_INPUT), "{what}: {out:?}");
        assert!(
            out.stderr.contains("ca=") || out.stderr.contains("key="),
            "{what}: {}",
            out.stderr
        );
    }
}
