//! What the stuck-lock runbook asks of advisory mode: who holds a key as the server sees it
//! (`pg_locks`, with fencelock's token row when that backend took it through fencelock), and
//! the forced release: an unlock on this client's own session when the lock lives there,
//! else the end of the holder's session and of every lease on it.

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

use super::session::Session;
use super::AdvisoryEngine;
use crate::core::error::{Error, Result};
use crate::core::holder::{duration_from_millis, from_unix_millis, Holder};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::token::FencingToken;
use crate::engines::postgres::{advisory_key, insert_audit};

/// Who holds one key, as `holder_of` reads it: the backend, and fencelock's row when that
/// backend is the one that took it through fencelock.
const HOLDER_COLUMNS: &str = "l.pid, t.owner, t.counter, t.host, t.pid, t.client, t.acquired_at, \
     t.ttl_ms, t.backend_pid, a.application_name, host(a.client_addr)";
const ADVISORY_HELD: &str = "l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";
const LOCK_KEY: &str = "((l.classid::bigint << 32) | l.objid::bigint)";

impl AdvisoryEngine {
    /// The holder of `key` as the server sees it, read with `client`.
    async fn holder_of(&self, client: &Client, key: i64, row: &str) -> Result<Option<Holder>> {
        let rows = self
            .shared
            .bounded(client.query(&holder_sql(), &[&key, &row]))
            .await?;
        rows.first()
            .map(|r| holder_from(r, 0))
            .transpose()
            .map_err(|e| self.shared.error("reading the holder", e))
    }

    /// The holder of `name`, read on any live session.
    pub(super) async fn holder_named(&self, name: &str) -> Result<Option<Holder>> {
        let s = self.any_session().await?;
        let key = advisory_key(&self.shared.prefix, name);
        self.holder_of(&s.client, key, &self.shared.key(name)).await
    }

    /// The locks under `prefix` that some backend holds.
    pub(super) async fn held_under(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let s = self.any_session().await?;
        let sql = format!(
            "SELECT t.key, {HOLDER_COLUMNS} FROM fencelock_tokens t
             JOIN pg_locks l ON {ADVISORY_HELD} AND {LOCK_KEY} = t.lock_key
             LEFT JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE starts_with(t.key, $1)"
        );
        let rows = self
            .shared
            .bounded(s.client.query(&sql, &[&self.shared.key(prefix)]))
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let read = || -> std::result::Result<HeldLock, tokio_postgres::Error> {
                let key: String = r.try_get(0)?;
                Ok(HeldLock::new(
                    self.shared.name_of(&key).to_owned(),
                    holder_from(r, 1)?,
                ))
            };
            out.push(read().map_err(|e| self.shared.error("listing locks", e))?);
        }
        Ok(out)
    }

    /// Records the release and raises the counter to the mark, then frees the lock: on this
    /// client's own session when that is where it lives (an owner-checked unlock there, which
    /// ends that lease alone), else by ending the holder's session, the only way to free
    /// another process's session lock, which ends every lease on it: each is recorded and
    /// returned in [`AuditRecord::ended_with`]. The transaction commits only once the lock is
    /// sure to be freed: before the unlock on an own session (which holds it meanwhile, so no
    /// grant can slip under the mark), after the backend is gone otherwise.
    pub(super) async fn force(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let key = advisory_key(&self.shared.prefix, name);
        let row = self.shared.key(name);
        let own = self.live_sessions().await;
        // A session of its own: the transaction must not interleave with pooled statements.
        let mut client = self.shared.connect().await?;
        let steps = async {
            let tx = client.transaction().await?;
            // The counter row first: a grant racing with this release waits here for its
            // token, so the mark below stays under every later grant's.
            tx.execute(
                "SELECT 1 FROM fencelock_tokens WHERE key = $1 FOR UPDATE",
                &[&row],
            )
            .await?;
            let rows = tx.query(&holder_sql(), &[&key, &row]).await?;
            let Some(r) = rows.first() else {
                return Ok(None);
            };
            let pid: i32 = r.try_get(0)?;
            let holder = holder_from(r, 0)?;
            if expected_owner.is_some_and(|e| e != holder.owner) {
                return Ok(None);
            }
            let mut record = marked(&tx, &row, key, holder, draft).await?;
            if let Some(s) = own
                .iter()
                .find(|s| s.backend_pid == pid && s.holds(key, &record.holder.owner))
            {
                tx.commit().await?;
                return Ok(Some(Forced::Own(s.clone(), record)));
            }
            let sql = format!(
                "SELECT t.key, t.lock_key, {HOLDER_COLUMNS} FROM pg_locks l
                 JOIN fencelock_tokens t ON {LOCK_KEY} = t.lock_key AND t.backend_pid = l.pid
                 LEFT JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE {ADVISORY_HELD} AND l.pid = $1 AND t.key <> $2
                 ORDER BY t.key"
            );
            for other in tx.query(&sql, &[&pid, &row]).await? {
                let (other_row, other_key): (String, i64) = (other.try_get(0)?, other.try_get(1)?);
                let mut also = draft.clone();
                also.id = format!("{:016x}", rand::random::<u64>());
                self.shared
                    .name_of(&other_row)
                    .clone_into(&mut also.resource);
                also.reason = format!(
                    "ended with PostgreSQL backend {pid}, whose session held it, by the forced \
                     release of {name:?}: {}",
                    draft.reason
                );
                let holder = holder_from(&other, 2)?;
                record
                    .ended_with
                    .push(marked(&tx, &other_row, other_key, holder, &also).await?);
            }
            // Waits up to 5 s for the backend to exit, so the lock is free on return.
            let ended: bool = tx
                .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
                .await?
                .try_get(0)?;
            if ended {
                tx.commit().await?;
            }
            Ok::<_, tokio_postgres::Error>(Some(Forced::Ended(ended, record)))
        };
        let limit = self.shared.op_timeout + Duration::from_secs(5);
        let forced = match tokio::time::timeout(limit, steps).await {
            Ok(Ok(Some(v))) => v,
            Ok(Ok(None)) => return Ok(None),
            Ok(Err(e)) => return Err(self.shared.error("forced release", e)),
            Err(_) => {
                return Err(Error::engine_failure(
                    self.shared.kind,
                    "the forced release got no answer in time",
                ))
            }
        };
        match forced {
            Forced::Own(session, record) => {
                // `Ok(false)`: released by its holder meanwhile, so free all the same.
                self.release_on(&session, key, name, &record.holder.owner)
                    .await
                    .map_err(|e| {
                        Error::engine_failure(
                            self.shared.kind,
                            format!(
                                "the forced release is recorded, but unlocking on this \
                                 client's session failed ({e}); the lock is freed when that \
                                 session ends or at the lease's TTL"
                            ),
                        )
                    })?;
                // Its holder, in this client, learns it now rather than at its next renewal.
                let _ = self.loss_tx.send(record.holder.owner.clone());
                Ok(Some(record))
            }
            Forced::Ended(true, record) => Ok(Some(record)),
            Forced::Ended(false, _) => Err(Error::engine_failure(
                self.shared.kind,
                "the holder's PostgreSQL backend did not exit within 5 s; nothing was released",
            )),
        }
    }

    /// The audit log, shared with lease mode.
    pub(super) async fn audit_log(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let s = self.any_session().await?;
        self.shared.audit(&s.client, name).await
    }
}

/// How a forced release frees the lock, once recorded.
enum Forced {
    /// Unlock it on this client's own session, which holds it.
    Own(Arc<Session>, AuditRecord),
    /// The holder's backend was ended (or not, within the bound): `true` when it was.
    Ended(bool, AuditRecord),
}

/// Advances the counter of `row` (lock key `key`) to the mark and appends the audit record of
/// `holder`'s release, from `draft`; returns the record.
async fn marked(
    tx: &tokio_postgres::Transaction<'_>,
    row: &str,
    key: i64,
    holder: Holder,
    draft: &AuditRecord,
) -> std::result::Result<AuditRecord, tokio_postgres::Error> {
    let mark: i64 = tx
        .query_one(
            "INSERT INTO fencelock_tokens (key, lock_key, counter) VALUES ($1, $2, 1)
             ON CONFLICT (key) DO UPDATE SET counter = fencelock_tokens.counter + 1,
                 owner = NULL, backend_pid = NULL
             RETURNING counter",
            &[&row, &key],
        )
        .await?
        .try_get(0)?;
    let mut record = draft.clone();
    record.holder = holder;
    record.holder.ttl_left = None;
    record.counter = FencingToken::from_stored(mark);
    insert_audit(tx, row, &record).await?;
    Ok(record)
}

/// Who holds one key (`$1`, its token row `$2`), in [`HOLDER_COLUMNS`].
fn holder_sql() -> String {
    format!(
        "SELECT {HOLDER_COLUMNS} FROM pg_locks l
         LEFT JOIN fencelock_tokens t ON t.key = $2
         LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE {ADVISORY_HELD} AND {LOCK_KEY} = $1"
    )
}

/// Builds a holder from [`HOLDER_COLUMNS`] starting at column `at`. A backend that did not
/// take the lock through fencelock (a `psql` session) is named by its pid and application.
fn holder_from(
    r: &tokio_postgres::Row,
    at: usize,
) -> std::result::Result<Holder, tokio_postgres::Error> {
    let backend: i32 = r.try_get(at)?;
    let owner: Option<String> = r.try_get(at + 1)?;
    let recorded_backend: Option<i32> = r.try_get(at + 8)?;
    match owner {
        Some(owner) if recorded_backend == Some(backend) => {
            let mut h = Holder::bare(owner);
            h.token = r
                .try_get::<_, Option<i64>>(at + 2)?
                .map(FencingToken::from_stored);
            h.host = r.try_get(at + 3)?;
            h.pid = r
                .try_get::<_, Option<i64>>(at + 4)?
                .and_then(|p| u32::try_from(p).ok());
            h.client = r.try_get(at + 5)?;
            h.acquired_at = r.try_get::<_, Option<i64>>(at + 6)?.map(from_unix_millis);
            h.ttl = r
                .try_get::<_, Option<i64>>(at + 7)?
                .map(duration_from_millis);
            Ok(h)
        }
        _ => {
            let mut h = Holder::bare(format!("postgres backend {backend}"));
            h.client = r.try_get(at + 9)?;
            h.host = r.try_get(at + 10)?;
            Ok(h)
        }
    }
}
