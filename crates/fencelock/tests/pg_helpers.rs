//! The lock-free helpers (job claiming, optimistic updates, idempotency keys) against a real
//! PostgreSQL.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencelock::pg::{Idempotency, JobQueue, Outcome, VersionedTable};
use fencelock::ErrorKind;
use fencelock_testkit::PgServer;
use tokio::time::{timeout, Instant};
use tokio_postgres::{Client, NoTls};

const LIMIT: Duration = Duration::from_secs(30);

async fn connect(server: &PgServer) -> Client {
    let (client, connection) = tokio_postgres::connect(&server.url(), NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_workers_never_hold_one_job_at_once_and_finish_each_once() {
    let server = PgServer::start().unwrap();
    let admin = connect(&server).await;
    let queue = JobQueue::new("jobs").unwrap();
    queue.install(&admin).await.unwrap();
    for i in 0..200 {
        queue.push(&admin, &format!("job {i}")).await.unwrap();
    }
    let running = Arc::new(Mutex::new(HashSet::new()));
    let done = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for w in 0..8 {
        let client = connect(&server).await;
        let (queue, running, done) = (queue.clone(), running.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let name = format!("worker-{w}");
            loop {
                let jobs = queue.claim(&client, &name, 3).await.unwrap();
                if jobs.is_empty() {
                    return;
                }
                for job in jobs {
                    assert!(
                        running.lock().unwrap().insert(job.id),
                        "job {} handed to two workers at once",
                        job.id
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    running.lock().unwrap().remove(&job.id);
                    assert!(queue.complete(&client, &job).await.unwrap());
                    done.lock().unwrap().push(job.id);
                }
            }
        }));
    }
    for w in workers {
        timeout(LIMIT, w).await.unwrap().unwrap();
    }
    let mut done = done.lock().unwrap().clone();
    done.sort_unstable();
    assert_eq!(done, (1..=200).collect::<Vec<i64>>());
    let states = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'done' AND attempts = 1) FROM jobs",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(states.get::<_, i64>(0), 200);
}

#[tokio::test]
async fn a_crashed_workers_job_is_claimed_again_after_the_visibility_timeout() {
    let server = PgServer::start().unwrap();
    let (a, b) = (connect(&server).await, connect(&server).await);
    let queue = JobQueue::new("app_jobs")
        .unwrap()
        .visibility_timeout(Duration::from_millis(500));
    queue.install(&a).await.unwrap();
    let id = queue.push(&a, "resize image").await.unwrap();
    let claimed = Instant::now();
    let crashed = queue.claim(&a, "a", 1).await.unwrap().pop().unwrap();
    assert_eq!((crashed.id, crashed.attempts), (id, 1));
    // Invisible while the claim is fresh.
    assert!(queue.claim(&b, "b", 1).await.unwrap().is_empty());
    let again = timeout(LIMIT, async {
        loop {
            if let Some(job) = queue.claim(&b, "b", 1).await.unwrap().pop() {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    assert!(claimed.elapsed() >= Duration::from_millis(450));
    assert_eq!((again.id, again.attempts), (id, 2));
    // The presumed-dead worker wakes up: its claim is gone, it changes nothing.
    assert!(!queue.complete(&a, &crashed).await.unwrap());
    assert!(!queue.fail(&a, &crashed, "late").await.unwrap());
    assert!(queue.complete(&b, &again).await.unwrap());
    assert_eq!(
        queue.state(&a, id).await.unwrap(),
        Some(("done".to_owned(), 2))
    );
}

#[tokio::test]
async fn a_failed_job_is_retried_after_the_delay_until_attempts_run_out() {
    let server = PgServer::start().unwrap();
    let c = connect(&server).await;
    let queue = JobQueue::new("jobs")
        .unwrap()
        .retry_after(Duration::from_millis(200))
        .max_attempts(2);
    queue.install(&c).await.unwrap();
    let id = queue.push(&c, "flaky").await.unwrap();
    let job = queue.claim(&c, "w", 5).await.unwrap().pop().unwrap();
    assert!(queue.fail(&c, &job, "boom").await.unwrap());
    assert_eq!(queue.state(&c, id).await.unwrap().unwrap().0, "ready");
    assert!(queue.claim(&c, "w", 5).await.unwrap().is_empty());
    let retry = timeout(LIMIT, async {
        loop {
            if let Some(job) = queue.claim(&c, "w", 5).await.unwrap().pop() {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(retry.attempts, 2);
    assert!(queue.fail(&c, &retry, "boom again").await.unwrap());
    assert_eq!(
        queue.state(&c, id).await.unwrap(),
        Some(("failed".to_owned(), 2))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn optimistic_updates_lose_nothing_under_concurrent_writers() {
    let server = PgServer::start().unwrap();
    let admin = connect(&server).await;
    let table = VersionedTable::new("counters").unwrap();
    table.install(&admin).await.unwrap();
    assert!(table.insert(&admin, "hits", "0").await.unwrap());
    assert!(!table.insert(&admin, "hits", "5").await.unwrap());
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let client = connect(&server).await;
        let table = table.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                table
                    .update(&client, "hits", 1000, |v| {
                        (v.parse::<i64>().unwrap() + 1).to_string()
                    })
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        timeout(LIMIT, t).await.unwrap().unwrap();
    }
    let now = table.get(&admin, "hits").await.unwrap().unwrap();
    assert_eq!((now.value.as_str(), now.version), ("80", 81));
    // A write based on a stale read is refused.
    assert!(table
        .update_if(&admin, "hits", 3, "999")
        .await
        .unwrap()
        .is_none());
    let e = table
        .update(&admin, "missing", 3, |v| v.to_owned())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_idempotency_guard_runs_the_effect_once_for_sixteen_callers() {
    let server = PgServer::start().unwrap();
    let admin = connect(&server).await;
    let guard = Idempotency::new("requests").unwrap();
    guard.install(&admin).await.unwrap();
    let effects = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for i in 0..16 {
        let client = connect(&server).await;
        let (guard, effects) = (guard.clone(), effects.clone());
        callers.push(tokio::spawn(async move {
            guard
                .run(&client, "refund-7f3a", || async move {
                    let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok::<_, String>(format!("refund #{n} by caller {i}"))
                })
                .await
                .unwrap()
                .unwrap()
        }));
    }
    let mut outcomes = Vec::new();
    for c in callers {
        outcomes.push(timeout(LIMIT, c).await.unwrap().unwrap());
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1);
    assert_eq!(outcomes.iter().filter(|o| o.executed()).count(), 1);
    let first = outcomes[0].value().to_owned();
    assert!(first.starts_with("refund #1 by caller"), "{first}");
    assert!(outcomes.iter().all(|o| o.value() == first));

    // A failed effect frees its key: the next call runs it.
    let failed = guard
        .run(&admin, "flaky", || async {
            Err::<String, _>("card declined")
        })
        .await
        .unwrap();
    assert_eq!(failed, Err("card declined"));
    let retried = guard
        .run(&admin, "flaky", || async {
            Ok::<_, String>("charged".into())
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(retried, Outcome::Executed("charged".into()));
}

#[tokio::test]
async fn an_abandoned_idempotency_claim_is_taken_over() {
    let server = PgServer::start().unwrap();
    let c = connect(&server).await;
    let guard = Idempotency::new("requests")
        .unwrap()
        .takeover_after(Duration::from_millis(300));
    guard.install(&c).await.unwrap();
    // The first caller claims the key and is cancelled while its effect runs.
    let abandoned = timeout(
        Duration::from_millis(100),
        guard.run(&c, "k", || async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok::<_, String>("never".into())
        }),
    )
    .await;
    assert!(abandoned.is_err());
    let out = timeout(
        LIMIT,
        guard.run(&c, "k", || async { Ok::<_, String>("done".into()) }),
    )
    .await
    .unwrap()
    .unwrap()
    .unwrap();
    assert_eq!(out, Outcome::Executed("done".into()));
}
