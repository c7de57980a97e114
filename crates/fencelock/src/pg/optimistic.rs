//! Optimistic concurrency: `UPDATE ... WHERE version = $v`, retried from a fresh read.

use std::time::Duration;

use rand::Rng;
use tokio_postgres::Client;

use super::{pg_error, table_ident};
use crate::core::error::{Error, ErrorKind, Result};

/// A table of versioned values (`key text PRIMARY KEY, version bigint, value text`) updated
/// without locks: a writer reads the value and its version, computes the new value, and
/// writes it only if the version is still the one it read (`UPDATE ... WHERE version = $v`),
/// advancing the version. A writer that lost the race reads again and recomputes, so no
/// update is ever lost and nobody waits on a lock held by a stalled process.
///
/// Store JSON (or anything else) as text in `value`; the same pattern applies to any table
/// with a version column.
///
/// ```no_run
/// # async fn demo(client: &tokio_postgres::Client) -> fencelock::Result<()> {
/// let accounts = fencelock::pg::VersionedTable::new("balances")?;
/// accounts.install(client).await?;
/// accounts.insert(client, "alice", "100").await?;
/// let after = accounts
///     .update(client, "alice", 10, |v| (v.parse::<i64>().unwrap_or(0) - 30).to_string())
///     .await?;
/// println!("balance {} at version {}", after.value, after.version);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct VersionedTable {
    table: String,
}

/// A value and the version it was read or written at.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Versioned {
    /// The row's key.
    pub key: String,
    /// Starts at 1; every successful update adds one.
    pub version: i64,
    /// The value at that version.
    pub value: String,
}

impl VersionedTable {
    /// A versioned table named `table` (a plain identifier, optionally `schema.table`).
    pub fn new(table: &str) -> Result<VersionedTable> {
        Ok(VersionedTable {
            table: table_ident(table)?,
        })
    }

    /// Creates the table if it does not exist.
    pub async fn install(&self, client: &Client) -> Result<()> {
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (
                     key     text PRIMARY KEY,
                     version bigint NOT NULL,
                     value   text NOT NULL
                 )",
                self.table
            ))
            .await
            .map_err(|e| pg_error("creating the versioned table", e))
    }

    /// Inserts `key` at version 1; `false` (and no change) if it exists.
    pub async fn insert(&self, client: &Client, key: &str, value: &str) -> Result<bool> {
        let n = client
            .execute(
                &format!(
                    "INSERT INTO {} (key, version, value) VALUES ($1, 1, $2)
                     ON CONFLICT (key) DO NOTHING",
                    self.table
                ),
                &[&key, &value],
            )
            .await
            .map_err(|e| pg_error("inserting a versioned row", e))?;
        Ok(n == 1)
    }

    /// The current value and version of `key`.
    pub async fn get(&self, client: &Client, key: &str) -> Result<Option<Versioned>> {
        let row = client
            .query_opt(
                &format!("SELECT version, value FROM {} WHERE key = $1", self.table),
                &[&key],
            )
            .await
            .map_err(|e| pg_error("reading a versioned row", e))?;
        row.map(|r| {
            Ok(Versioned {
                key: key.to_owned(),
                version: r.try_get(0)?,
                value: r.try_get(1)?,
            })
        })
        .transpose()
        .map_err(|e: tokio_postgres::Error| pg_error("reading a versioned row", e))
    }

    /// The compare-and-set itself: writes `value` only if `key` is still at `expected`
    /// version. `Some` with the new version when it was written, `None` when another writer
    /// changed it first (or it does not exist).
    pub async fn update_if(
        &self,
        client: &Client,
        key: &str,
        expected: i64,
        value: &str,
    ) -> Result<Option<Versioned>> {
        let row = client
            .query_opt(
                &format!(
                    "UPDATE {} SET value = $3, version = version + 1
                     WHERE key = $1 AND version = $2 RETURNING version",
                    self.table
                ),
                &[&key, &expected, &value],
            )
            .await
            .map_err(|e| pg_error("updating a versioned row", e))?;
        row.map(|r| {
            Ok(Versioned {
                key: key.to_owned(),
                version: r.try_get(0)?,
                value: value.to_owned(),
            })
        })
        .transpose()
        .map_err(|e: tokio_postgres::Error| pg_error("updating a versioned row", e))
    }

    /// Reads `key`, applies `change` to its value and writes the result if nobody changed it
    /// in between; otherwise reads again and retries, with a short jittered pause, up to
    /// `max_attempts` times. `change` may therefore run several times and must not have side
    /// effects. Fails with [`ErrorKind::InvalidInput`] when there is no such key and with
    /// [`ErrorKind::TimedOut`] (worth retrying later) when every attempt lost the race.
    pub async fn update(
        &self,
        client: &Client,
        key: &str,
        max_attempts: u32,
        mut change: impl FnMut(&str) -> String,
    ) -> Result<Versioned> {
        let attempts = max_attempts.max(1);
        for attempt in 0..attempts {
            let Some(current) = self.get(client, key).await? else {
                return Err(Error::invalid(format!("no versioned row with key {key:?}")));
            };
            let next = change(&current.value);
            if let Some(done) = self.update_if(client, key, current.version, &next).await? {
                return Ok(done);
            }
            // Writers that collided retry at different moments rather than in lock step.
            let cap = 1u64 << attempt.min(6);
            let pause = rand::thread_rng().gen_range(0..=cap);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        Err(Error::new(
            ErrorKind::TimedOut,
            format!(
                "gave up updating {key:?} after {attempts} attempts: other writers kept changing \
                 it first; retry later or allow more attempts"
            ),
        )
        .with_engine(super::ENGINE))
    }
}
