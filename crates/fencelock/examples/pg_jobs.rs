//! Job claiming with `FOR UPDATE SKIP LOCKED`: four workers share a queue without a lock, and
//! a job whose worker "crashes" is claimed again after the visibility timeout.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run -p fencelock --features postgres --example pg_jobs
//! ```
use std::time::Duration;

use fencelock::pg::JobQueue;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL to a PostgreSQL URL, e.g. postgres://user@host/db")?;
    let connect = || async {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
        tokio::spawn(connection);
        Ok::<_, tokio_postgres::Error>(client)
    };
    let admin = connect().await?;
    let queue = JobQueue::new("fencelock_example_jobs")?
        .visibility_timeout(Duration::from_secs(1))
        .retry_after(Duration::from_millis(200));
    queue.install(&admin).await?;
    for i in 0..20 {
        queue.push(&admin, &format!("thumbnail {i}")).await?;
    }

    // One worker claims a job and crashes: no complete, no fail.
    let crashed = queue.claim(&admin, "crashing-worker", 1).await?;
    println!(
        "crashing-worker claimed {:?} and died",
        crashed.first().map(|j| j.id)
    );

    let mut workers = Vec::new();
    for w in 0..4 {
        let client = connect().await?;
        let queue = queue.clone();
        workers.push(tokio::spawn(async move {
            let name = format!("worker-{w}");
            let mut idle_rounds = 0;
            while idle_rounds < 15 {
                let jobs = queue.claim(&client, &name, 2).await?;
                if jobs.is_empty() {
                    idle_rounds += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                idle_rounds = 0;
                for job in jobs {
                    if job.payload.ends_with(" 7") && job.attempts == 1 {
                        // A transient failure: retried after the delay.
                        queue.fail(&client, &job, "transient error").await?;
                        println!("{name}: job {} failed, will be retried", job.id);
                        continue;
                    }
                    queue.complete(&client, &job).await?;
                    println!(
                        "{name}: job {} ({}) done on attempt {}",
                        job.id, job.payload, job.attempts
                    );
                }
            }
            Ok::<_, fencelock::Error>(())
        }));
    }
    for w in workers {
        w.await??;
    }
    let left = admin
        .query_one(
            "SELECT count(*) FROM fencelock_example_jobs WHERE state <> 'done'",
            &[],
        )
        .await?
        .get::<_, i64>(0);
    println!("jobs not done: {left}");
    admin
        .batch_execute("DROP TABLE fencelock_example_jobs")
        .await?;
    Ok(())
}
