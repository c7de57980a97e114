//! Checks every engine must pass, shared by the engine test files.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::{Client, Election, Leader, Leadership, LockOptions};
use tokio::sync::watch;
use tokio::time::{timeout, Instant};

pub async fn connect(url: &str) -> Client {
    Client::connect(url).await.unwrap()
}

/// Many clients (separate connections, as separate processes would have), one name: never two
/// holders at once, tokens strictly increasing in the order the grants happened.
pub async fn check_mutual_exclusion(url: &str, clients: usize, rounds: usize) {
    let opts = LockOptions::default()
        .ttl(Duration::from_secs(5))
        .wait(Duration::from_secs(30));
    check_mutual_exclusion_with(url, clients, rounds, opts).await;
}

/// [`check_mutual_exclusion`] with the given lock options (fair mode, say).
///
/// Each hold is recorded as an interval on the process's monotonic clock, from the moment the
/// acquire returned to the moment the release was sent: every such interval lies inside the
/// engine's own hold, so two that overlap are two holders at once, whatever the interleaving.
pub async fn check_mutual_exclusion_with(
    url: &str,
    clients: usize,
    rounds: usize,
    opts: LockOptions,
) {
    let inside = Arc::new(AtomicUsize::new(0));
    let holds = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let c = connect(url).await;
        let inside = inside.clone();
        let holds = holds.clone();
        let opts = opts.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let lease = c.acquire("shared", &opts).await.unwrap();
                let from = Instant::now();
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                // Stay inside long enough for another task to run, so an overlap can show.
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                let to = Instant::now();
                holds.lock().unwrap().push((from, to, lease.token().get()));
                lease.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
    }
    let mut holds = holds.lock().unwrap().clone();
    assert_eq!(holds.len(), clients * rounds);
    holds.sort_by_key(|(from, _, _)| *from);
    for w in holds.windows(2) {
        let ((_, end, t0), (next, _, t1)) = (w[0], w[1]);
        assert!(end <= next, "holds with tokens {t0} and {t1} overlap");
        assert!(t0 < t1, "token {t1} granted after {t0}");
    }
}

/// Holds an exclusive transaction on the database file for `hold`, as a stuck writer would;
/// returns once the lock is taken.
pub fn hold_write_lock(path: &std::path::Path, hold: Duration) -> std::thread::JoinHandle<()> {
    let (taken, ready) = std::sync::mpsc::channel();
    let path = path.to_owned();
    let handle = std::thread::spawn(move || {
        let conn = rusqlite::Connection::open(path).unwrap();
        conn.busy_timeout(Duration::from_secs(10)).unwrap();
        conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
        taken.send(()).unwrap();
        std::thread::sleep(hold);
        conn.execute_batch("ROLLBACK").unwrap();
    });
    ready.recv().unwrap();
    handle
}

/// An election `name` at `url` with its first leader: an observer that saw nobody lead, then a
/// first campaigner elected with `value`, and a second client ready to campaign.
pub struct FirstLeader {
    pub second: Client,
    /// The observer's own client, free for operator actions.
    pub observer: Client,
    pub observed: Election,
    pub leaders: watch::Receiver<Option<Leader>>,
    pub first: Leadership,
    /// The campaign options both campaigners use: a short TTL, a long wait.
    pub opts: LockOptions,
}

pub async fn first_leader(url: &str, name: &str, value: &str) -> FirstLeader {
    let first_client = connect(url).await;
    let second = connect(url).await;
    let observer = connect(url).await;
    let observed = observer.election(name).unwrap();
    let mut leaders = observed.observe().await.unwrap();
    assert_eq!(*leaders.borrow_and_update(), None);
    let opts = LockOptions::default()
        .ttl(Duration::from_secs(2))
        .wait(Duration::from_secs(20));
    let first = first_client
        .election(name)
        .unwrap()
        .campaign(value, &opts)
        .await
        .unwrap();
    FirstLeader {
        second,
        observer,
        observed,
        leaders,
        first,
        opts,
    }
}
