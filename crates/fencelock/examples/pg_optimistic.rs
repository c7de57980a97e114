//! Optimistic concurrency: eight writers add to one balance with `UPDATE ... WHERE version =
//! $v`, retrying when another writer got there first. No lock, no lost update.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run -p fencelock --features postgres --example pg_optimistic
//! ```
use fencelock::pg::VersionedTable;

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
    let balances = VersionedTable::new("fencelock_example_balances")?;
    balances.install(&admin).await?;
    admin
        .execute(
            "DELETE FROM fencelock_example_balances WHERE key = 'alice'",
            &[],
        )
        .await?;
    balances.insert(&admin, "alice", "0").await?;

    let mut writers = Vec::new();
    for w in 0..8 {
        let client = connect().await?;
        let balances = balances.clone();
        writers.push(tokio::spawn(async move {
            for _ in 0..25 {
                balances
                    .update(&client, "alice", 100, |v| {
                        (v.parse::<i64>().unwrap_or(0) + 1).to_string()
                    })
                    .await?;
            }
            println!("writer {w} done");
            Ok::<_, fencelock::Error>(())
        }));
    }
    for w in writers {
        w.await??;
    }
    if let Some(v) = balances.get(&admin, "alice").await? {
        println!(
            "balance {} at version {} (expected 200 at 201)",
            v.value, v.version
        );
    }
    admin
        .batch_execute("DROP TABLE fencelock_example_balances")
        .await?;
    Ok(())
}
