//! An idempotency-key guard: sixteen concurrent retries of one refund request run the refund
//! once; every caller gets the first result.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run -p fencelock --features postgres --example pg_idempotency
//! ```
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencelock::pg::Idempotency;

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
    let guard = Idempotency::new("fencelock_example_requests")?;
    guard.install(&admin).await?;
    let key = format!("refund-{:08x}", rand_key());
    let refunds = Arc::new(AtomicUsize::new(0));

    let mut callers = Vec::new();
    for i in 0..16 {
        let client = connect().await?;
        let (guard, key, refunds) = (guard.clone(), key.clone(), refunds.clone());
        callers.push(tokio::spawn(async move {
            let outcome = guard
                .run(&client, &key, || async move {
                    refunds.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, String>(format!("refunded 12.00 (by caller {i})"))
                })
                .await??;
            println!(
                "caller {i:2}: {} ({})",
                outcome.value(),
                if outcome.executed() {
                    "executed"
                } else {
                    "replayed"
                }
            );
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        }));
    }
    for c in callers {
        c.await?.map_err(|e| e.to_string())?;
    }
    println!("refunds executed: {}", refunds.load(Ordering::SeqCst));
    admin
        .batch_execute("DROP TABLE fencelock_example_requests")
        .await?;
    Ok(())
}

fn rand_key() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0)
}
