//! Claiming jobs from a table with `FOR UPDATE SKIP LOCKED`.

use std::time::Duration;

use tokio_postgres::Client;

use super::{index_name, pg_error, table_ident};
use crate::core::error::Result;
use crate::core::holder::millis_of;

/// A job queue in one table: workers claim batches of ready jobs, complete them or fail them.
///
/// - **Never one job to two workers at once.** A claim marks the rows it picked, in one
///   statement whose row locks (`FOR UPDATE SKIP LOCKED`) make concurrent claims pick
///   disjoint rows without waiting for each other.
/// - **Visibility timeout.** A claimed job is invisible to other claims for the visibility
///   timeout (default 30 s; [`JobQueue::keep_alive`] pushes it out). A worker that crashed
///   never completes its job, so it becomes claimable again once that time has passed, with
///   its attempt count raised.
/// - **Claims are owner-checked.** Each claim carries a random value; completing or failing a
///   job whose claim was taken over after its timeout answers `false` and changes nothing,
///   so a slow worker cannot mark a job done that another worker is running.
/// - **Failures are retried.** [`JobQueue::fail`] makes the job claimable again after the
///   retry delay (by default the visibility timeout), until it has been attempted
///   `max_attempts` times (default 5); then it stays `failed` with its last error.
///
/// The table (created by [`JobQueue::install`]) has the columns `id bigserial`, `payload
/// text`, `state` (`ready`, `running`, `done`, `failed`), `attempts`, `run_after`,
/// `locked_until`, `claim`, `worker`, `last_error`, `created_at`, `finished_at`.
///
/// ```no_run
/// # async fn demo(client: &tokio_postgres::Client) -> fencelock::Result<()> {
/// use std::time::Duration;
/// let queue = fencelock::pg::JobQueue::new("emails")?.visibility_timeout(Duration::from_secs(60));
/// queue.install(client).await?;
/// queue.push(client, "send invoice 42").await?;
/// for job in queue.claim(client, "worker-1", 10).await? {
///     // ... do the work ...
///     queue.complete(client, &job).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JobQueue {
    table: String,
    raw: String,
    visibility: Duration,
    retry_after: Option<Duration>,
    max_attempts: i32,
}

/// One claimed job.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Job {
    /// The job's id in the table.
    pub id: i64,
    /// What the producer pushed.
    pub payload: String,
    /// How many times it has been claimed, this claim included.
    pub attempts: i32,
    claim: String,
}

impl JobQueue {
    /// A queue in `table` (a plain identifier, optionally `schema.table`). Fails with
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for any other name.
    pub fn new(table: &str) -> Result<JobQueue> {
        Ok(JobQueue {
            table: table_ident(table)?,
            raw: table.to_owned(),
            visibility: Duration::from_secs(30),
            retry_after: None,
            max_attempts: 5,
        })
    }

    /// How long a claimed job stays invisible to other claims. Default 30 s.
    pub fn visibility_timeout(mut self, timeout: Duration) -> JobQueue {
        self.visibility = timeout;
        self
    }

    /// How long a failed job waits before it can be claimed again. Default: the visibility
    /// timeout.
    pub fn retry_after(mut self, delay: Duration) -> JobQueue {
        self.retry_after = Some(delay);
        self
    }

    /// How many attempts a job gets before a failure leaves it `failed`. Default 5.
    pub fn max_attempts(mut self, attempts: u32) -> JobQueue {
        self.max_attempts = i32::try_from(attempts.max(1)).unwrap_or(i32::MAX);
        self
    }

    /// Creates the table and its index if they do not exist. Safe to run from many processes
    /// at once.
    pub async fn install(&self, client: &Client) -> Result<()> {
        let t = &self.table;
        let idx = index_name(&self.raw, "claimable");
        let lock = crate::engines::postgres::advisory_key("fencelock:", "pg-helpers-install");
        // One DO statement: atomic and serialised without a transaction on the caller's
        // client, which may be shared.
        client
            .batch_execute(&format!(
                "DO $$ BEGIN
                 PERFORM pg_advisory_xact_lock({lock});
                 CREATE TABLE IF NOT EXISTS {t} (
                     id           bigserial PRIMARY KEY,
                     payload      text NOT NULL,
                     state        text NOT NULL DEFAULT 'ready',
                     attempts     integer NOT NULL DEFAULT 0,
                     run_after    timestamptz NOT NULL DEFAULT clock_timestamp(),
                     locked_until timestamptz,
                     claim        text,
                     worker       text,
                     last_error   text,
                     created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
                     finished_at  timestamptz
                 );
                 CREATE INDEX IF NOT EXISTS {idx} ON {t} (id) WHERE state IN ('ready', 'running');
                 END $$"
            ))
            .await
            .map_err(|e| pg_error(&format!("creating the job table {}", self.raw), e))
    }

    /// Adds a ready job; returns its id.
    pub async fn push(&self, client: &Client, payload: &str) -> Result<i64> {
        let row = client
            .query_one(
                &format!(
                    "INSERT INTO {} (payload) VALUES ($1) RETURNING id",
                    self.table
                ),
                &[&payload],
            )
            .await
            .map_err(|e| pg_error("pushing a job", e))?;
        row.try_get(0).map_err(|e| pg_error("pushing a job", e))
    }

    /// Claims up to `n` jobs for `worker` (a name for operators): ready ones, and running ones
    /// whose visibility timeout passed (their worker is presumed dead), oldest first. Returns
    /// fewer, or none, when fewer are claimable; never waits for other workers' claims.
    pub async fn claim(&self, client: &Client, worker: &str, n: usize) -> Result<Vec<Job>> {
        let t = &self.table;
        let claim = format!("{:032x}", rand::random::<u128>());
        let limit = i64::try_from(n).unwrap_or(i64::MAX);
        let rows = client
            .query(
                &format!(
                    "UPDATE {t} j SET state = 'running', attempts = j.attempts + 1,
                         locked_until = clock_timestamp() + $2::bigint * interval '1 millisecond',
                         claim = $3, worker = $4
                     FROM (
                         SELECT id FROM {t}
                         WHERE (state = 'ready' AND run_after <= clock_timestamp())
                            OR (state = 'running' AND locked_until <= clock_timestamp())
                         ORDER BY id
                         LIMIT $1
                         FOR UPDATE SKIP LOCKED
                     ) c
                     WHERE j.id = c.id
                     RETURNING j.id, j.payload, j.attempts"
                ),
                &[&limit, &millis_of(self.visibility), &claim, &worker],
            )
            .await
            .map_err(|e| pg_error("claiming jobs", e))?;
        let mut jobs = rows
            .iter()
            .map(|r| {
                Ok(Job {
                    id: r.try_get(0)?,
                    payload: r.try_get(1)?,
                    attempts: r.try_get(2)?,
                    claim: claim.clone(),
                })
            })
            .collect::<std::result::Result<Vec<_>, tokio_postgres::Error>>()
            .map_err(|e| pg_error("claiming jobs", e))?;
        jobs.sort_by_key(|j| j.id);
        Ok(jobs)
    }

    /// Marks a claimed job done. `false` when the claim is no longer this one (its visibility
    /// timeout passed and another worker claimed it): nothing is changed.
    pub async fn complete(&self, client: &Client, job: &Job) -> Result<bool> {
        let n = client
            .execute(
                &format!(
                    "UPDATE {} SET state = 'done', finished_at = clock_timestamp(),
                         locked_until = NULL
                     WHERE id = $1 AND claim = $2 AND state = 'running'",
                    self.table
                ),
                &[&job.id, &job.claim],
            )
            .await
            .map_err(|e| pg_error("completing a job", e))?;
        Ok(n == 1)
    }

    /// Gives a claimed job back after a failure: claimable again after the retry delay, or
    /// `failed` for good once it had `max_attempts` attempts. `false` when the claim is no
    /// longer this one: nothing is changed.
    pub async fn fail(&self, client: &Client, job: &Job, error: &str) -> Result<bool> {
        let delay = millis_of(self.retry_after.unwrap_or(self.visibility));
        let n = client
            .execute(
                &format!(
                    "UPDATE {} SET
                         state = CASE WHEN attempts >= $4 THEN 'failed' ELSE 'ready' END,
                         finished_at = CASE WHEN attempts >= $4 THEN clock_timestamp() END,
                         run_after = clock_timestamp() + $5::bigint * interval '1 millisecond',
                         claim = NULL, worker = NULL, locked_until = NULL, last_error = $3
                     WHERE id = $1 AND claim = $2 AND state = 'running'",
                    self.table
                ),
                &[&job.id, &job.claim, &error, &self.max_attempts, &delay],
            )
            .await
            .map_err(|e| pg_error("failing a job", e))?;
        Ok(n == 1)
    }

    /// Pushes a claimed job's visibility timeout out by another full timeout, for work that
    /// runs longer. `false` when the claim is no longer this one.
    pub async fn keep_alive(&self, client: &Client, job: &Job) -> Result<bool> {
        let n = client
            .execute(
                &format!(
                    "UPDATE {} SET locked_until = clock_timestamp() + $3::bigint * interval '1 millisecond'
                     WHERE id = $1 AND claim = $2 AND state = 'running'",
                    self.table
                ),
                &[&job.id, &job.claim, &millis_of(self.visibility)],
            )
            .await
            .map_err(|e| pg_error("extending a job's claim", e))?;
        Ok(n == 1)
    }

    /// The state of a job (`ready`, `running`, `done`, `failed`) and its attempts so far, or
    /// `None` if there is no such job.
    pub async fn state(&self, client: &Client, id: i64) -> Result<Option<(String, i32)>> {
        let row = client
            .query_opt(
                &format!("SELECT state, attempts FROM {} WHERE id = $1", self.table),
                &[&id],
            )
            .await
            .map_err(|e| pg_error("reading a job", e))?;
        row.map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .transpose()
            .map_err(|e: tokio_postgres::Error| pg_error("reading a job", e))
    }
}
