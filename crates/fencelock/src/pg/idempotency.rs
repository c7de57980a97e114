//! An idempotency-key guard on a unique constraint.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;

use super::{pg_error, table_ident};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::millis_of;

/// Runs a side effect at most once per idempotency key, whatever the number of callers.
///
/// The first caller to insert the key (the table's primary key decides, atomically) runs the
/// effect and stores its result; every other caller with the same key waits for that result
/// and gets it, without running the effect. If the effect fails, the key is deleted so a later
/// call can try again. A key claimed by a caller that then died is taken over once its claim
/// is older than the takeover time (default 5 minutes): set it above the longest time the
/// effect may take.
///
/// The table (created by [`Idempotency::install`]) holds `key`, `state` (`running`, `done`),
/// `result`, `claim`, `claimed_at`, `finished_at`.
///
/// ```no_run
/// # async fn demo(client: &tokio_postgres::Client) -> fencelock::Result<()> {
/// let guard = fencelock::pg::Idempotency::new("payment_requests")?;
/// guard.install(client).await?;
/// let outcome = guard
///     .run(client, "refund-7f3a", || async { Ok::<_, String>("refunded 12.00".to_owned()) })
///     .await?
///     .expect("the refund failed");
/// println!("{} (executed here: {})", outcome.value(), outcome.executed());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Idempotency {
    table: String,
    wait: Duration,
    takeover_after: Duration,
}

/// What [`Idempotency::run`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This call ran the effect; its result.
    Executed(String),
    /// Another call ran it (or is recorded as having run it); its stored result.
    Replayed(String),
}

impl Outcome {
    /// The effect's result, whoever ran it.
    pub fn value(&self) -> &str {
        match self {
            Outcome::Executed(v) | Outcome::Replayed(v) => v,
        }
    }

    /// Whether this call ran the effect.
    pub fn executed(&self) -> bool {
        matches!(self, Outcome::Executed(_))
    }
}

impl Idempotency {
    /// A guard keeping its keys in `table` (a plain identifier, optionally `schema.table`).
    pub fn new(table: &str) -> Result<Idempotency> {
        Ok(Idempotency {
            table: table_ident(table)?,
            wait: Duration::from_secs(30),
            takeover_after: Duration::from_secs(300),
        })
    }

    /// How long a second caller waits for the first caller's result before failing with
    /// [`ErrorKind::TimedOut`]. Default 30 s.
    pub fn wait(mut self, wait: Duration) -> Idempotency {
        self.wait = wait;
        self
    }

    /// How old a claim must be before another caller presumes its owner dead and runs the
    /// effect itself. Default 5 minutes.
    pub fn takeover_after(mut self, after: Duration) -> Idempotency {
        self.takeover_after = after;
        self
    }

    /// Creates the table if it does not exist.
    pub async fn install(&self, client: &Client) -> Result<()> {
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {} (
                     key         text PRIMARY KEY,
                     state       text NOT NULL,
                     result      text,
                     claim       text NOT NULL,
                     claimed_at  timestamptz NOT NULL,
                     finished_at timestamptz
                 )",
                self.table
            ))
            .await
            .map_err(|e| pg_error("creating the idempotency table", e))
    }

    /// Runs `effect` if no call with `key` ran (or is running) it, and returns its result;
    /// otherwise waits for the first call's result and returns that.
    ///
    /// The outer `Result` is the guard's: [`ErrorKind::Engine`] when the database fails,
    /// [`ErrorKind::TimedOut`] when the call that claimed the key did not finish within the
    /// wait. The inner one is the effect's: when the effect fails, its error is returned as
    /// is and the key is freed, so a later call runs the effect again.
    ///
    /// Cancel safety: dropping the future while the effect runs leaves the key claimed; other
    /// callers wait, and the key is taken over after the takeover time.
    pub async fn run<F, Fut, E>(
        &self,
        client: &Client,
        key: &str,
        effect: F,
    ) -> Result<std::result::Result<Outcome, E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<String, E>>,
    {
        let claim = format!("{:032x}", rand::random::<u128>());
        let t = &self.table;
        let deadline = Instant::now() + self.wait;
        let mut pause = Duration::from_millis(5);
        loop {
            // Insert the key, or take over a claim old enough to be presumed dead; one
            // statement, so exactly one caller wins either way.
            let won = client
                .query_opt(
                    &format!(
                        "INSERT INTO {t} AS i (key, state, claim, claimed_at)
                         VALUES ($1, 'running', $2, clock_timestamp())
                         ON CONFLICT (key) DO UPDATE SET claim = EXCLUDED.claim,
                             claimed_at = EXCLUDED.claimed_at
                         WHERE i.state = 'running'
                           AND i.claimed_at < clock_timestamp() - $3::bigint * interval '1 millisecond'
                         RETURNING key"
                    ),
                    &[&key, &claim, &millis_of(self.takeover_after)],
                )
                .await
                .map_err(|e| pg_error("claiming an idempotency key", e))?
                .is_some();
            if won {
                return self.execute(client, key, &claim, effect).await;
            }
            let row = client
                .query_opt(
                    &format!("SELECT state, result FROM {t} WHERE key = $1"),
                    &[&key],
                )
                .await
                .map_err(|e| pg_error("reading an idempotency key", e))?;
            if let Some(r) = row {
                let state: String = r
                    .try_get(0)
                    .map_err(|e| pg_error("reading an idempotency key", e))?;
                if state == "done" {
                    let result: Option<String> = r
                        .try_get(1)
                        .map_err(|e| pg_error("reading an idempotency key", e))?;
                    return Ok(Ok(Outcome::Replayed(result.unwrap_or_default())));
                }
            }
            // Running elsewhere (or just freed after a failure: the next round claims it).
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!(
                        "the call that claimed idempotency key {key:?} did not finish within {}",
                        crate::core::options::display_duration(self.wait)
                    ),
                )
                .with_engine(super::ENGINE));
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    async fn execute<F, Fut, E>(
        &self,
        client: &Client,
        key: &str,
        claim: &str,
        effect: F,
    ) -> Result<std::result::Result<Outcome, E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<String, E>>,
    {
        let t = &self.table;
        match effect().await {
            Ok(result) => {
                client
                    .execute(
                        &format!(
                            "UPDATE {t} SET state = 'done', result = $3,
                                 finished_at = clock_timestamp()
                             WHERE key = $1 AND claim = $2"
                        ),
                        &[&key, &claim, &result],
                    )
                    .await
                    .map_err(|e| pg_error("storing an idempotent result", e))?;
                Ok(Ok(Outcome::Executed(result)))
            }
            Err(e) => {
                client
                    .execute(
                        &format!("DELETE FROM {t} WHERE key = $1 AND claim = $2"),
                        &[&key, &claim],
                    )
                    .await
                    .map_err(|e| pg_error("freeing a failed idempotency key", e))?;
                Ok(Err(e))
            }
        }
    }
}
