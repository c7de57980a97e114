//! The embedded default engine: a lease table in one SQLite file, shared by every process on
//! one machine.
//!
//! Design decisions:
//! - Every write runs in an `IMMEDIATE` transaction, so the check (is it held?) and the grant
//!   (take it, advance the token) are one atomic step across processes. A busy timeout bounds
//!   the wait for the file lock.
//! - Expiry is kept on `CLOCK_BOOTTIME`, which all processes of one machine share and which
//!   neither wall-clock jumps nor `settimeofday` move. A lease row remembers the boot it was
//!   written in; a row from an earlier boot is expired whatever its numbers say.
//! - One row per resource lives forever: releasing clears the owner but keeps the token, so
//!   tokens keep increasing across releases, process restarts and reboots.
//! - `synchronous=FULL`: a token counter rolled back by a power cut would hand out a token twice.
//! - A forced release (the stuck-lock runbook) clears the owner, advances the row's token to the
//!   mark and appends to `fencelock_audit`, all in one transaction, so the log never misses a
//!   release and the next grant (`mark + 1`) is above the mark. The log is never trimmed:
//!   forced releases are rare, and an audit trail that forgets is not one.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

pub(crate) mod url;

use crate::core::engine::{
    AcquireRequest, Attempt, Engine, EngineConfig, Opened, Renewal, Renewed,
};
use crate::core::error::{Error, Result};
use crate::core::holder::{duration_from_millis, from_unix_millis, millis_of, unix_millis, Holder};
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::sql::{
    audit_insert_sql, audit_record, audit_select_sql, audit_values, SqlRow, SqlValue,
};
use crate::core::token::FencingToken;

/// Opens the SQLite file of `url`: the lock, and no other capability.
pub(crate) async fn open(url: url::SqliteUrl, cfg: &EngineConfig) -> Result<Opened> {
    let engine = SqliteEngine::open(url.path, cfg).await?;
    Ok(Opened::lock(Arc::new(engine)))
}

const ENGINE: &str = "sqlite";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fencelock_locks (
    key         TEXT PRIMARY KEY,
    token       INTEGER NOT NULL,
    owner       TEXT,
    boot_id     TEXT,
    expires_at  INTEGER,
    ttl_ms      INTEGER,
    host        TEXT,
    pid         INTEGER,
    client      TEXT,
    acquired_at INTEGER,
    renewed_at  INTEGER
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS fencelock_audit (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    record_id       TEXT NOT NULL,
    key             TEXT NOT NULL,
    at              INTEGER NOT NULL,
    by_user         TEXT NOT NULL,
    by_host         TEXT NOT NULL,
    reason          TEXT NOT NULL,
    declared_dead   INTEGER NOT NULL,
    assessment      TEXT NOT NULL,
    owner           TEXT NOT NULL,
    token           INTEGER,
    host            TEXT,
    pid             INTEGER,
    client          TEXT,
    acquired_at     INTEGER,
    renewed_at      INTEGER,
    ttl_ms          INTEGER,
    counter         INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS fencelock_audit_by_key ON fencelock_audit (key, id);
CREATE TABLE IF NOT EXISTS fencelock_limits (
    prefix      TEXT PRIMARY KEY,
    max_ttl_ms  INTEGER NOT NULL,
    max_held    INTEGER NOT NULL
) WITHOUT ROWID;
";

/// Columns added after the first release, to files that were created without them: who holds
/// each lease for the `max-held-per-client` limit.
const MIGRATIONS: &[(&str, &str)] = &[(
    "holder_id",
    "ALTER TABLE fencelock_locks ADD COLUMN holder_id TEXT",
)];

/// The columns [`LockRow::from_row`] reads, in its order.
const LOCK_COLUMNS: &str =
    "key, token, owner, boot_id, expires_at, ttl_ms, host, pid, client, acquired_at, renewed_at";

pub(crate) struct SqliteEngine {
    jobs: std::sync::mpsc::Sender<Job>,
    path: Arc<PathBuf>,
    prefix: String,
    holder_id: String,
}

type Job = Box<dyn FnOnce(&mut Connection, &str) + Send>;

/// Milliseconds on `CLOCK_BOOTTIME`: machine-wide, monotonic, counting suspend.
fn boot_millis() -> i64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) {
        Ok(ts) => ts.tv_sec() * 1000 + ts.tv_nsec() / 1_000_000,
        // Every Linux since 2.6.39 has CLOCK_BOOTTIME; the fallback keeps other kernels usable.
        Err(_) => {
            let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
                .unwrap_or(nix::sys::time::TimeSpec::new(0, 0));
            ts.tv_sec() * 1000 + ts.tv_nsec() / 1_000_000
        }
    }
}

fn current_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown-boot".to_owned())
}

/// The labelled keys of `name` under `prefix`, as the engine gives them, without opening the
/// file.
pub(crate) fn labelled_keys(prefix: &str, name: &str) -> Vec<(&'static str, String)> {
    vec![("row", format!("{prefix}{name}"))]
}

impl SqlRow for rusqlite::Row<'_> {
    type Error = rusqlite::Error;
    fn text(&self, i: usize) -> rusqlite::Result<String> {
        self.get(i)
    }
    fn maybe_text(&self, i: usize) -> rusqlite::Result<Option<String>> {
        self.get(i)
    }
    fn int(&self, i: usize) -> rusqlite::Result<i64> {
        self.get(i)
    }
    fn maybe_int(&self, i: usize) -> rusqlite::Result<Option<i64>> {
        self.get(i)
    }
    fn flag(&self, i: usize) -> rusqlite::Result<bool> {
        // Stored as INTEGER 0 or 1, as rusqlite binds a bool.
        self.get(i)
    }
}

/// A value as a SQLite parameter.
fn param(v: &SqlValue) -> &dyn rusqlite::ToSql {
    match v {
        SqlValue::Text(s) => s,
        SqlValue::MaybeText(s) => s,
        SqlValue::Int(n) => n,
        SqlValue::MaybeInt(n) => n,
        SqlValue::Bool(b) => b,
    }
}

fn sql_error(path: &Path, e: rusqlite::Error) -> Error {
    Error::engine_failure(ENGINE, format!("{}", path.display())).with_source(e)
}

struct LockRow {
    key: String,
    token: i64,
    owner: Option<String>,
    boot_id: Option<String>,
    expires_at: Option<i64>,
    ttl_ms: Option<i64>,
    host: Option<String>,
    pid: Option<i64>,
    client: Option<String>,
    acquired_at: Option<i64>,
    renewed_at: Option<i64>,
}

impl LockRow {
    fn read(conn: &Connection, key: &str) -> rusqlite::Result<Option<LockRow>> {
        conn.query_row(
            &format!("SELECT {LOCK_COLUMNS} FROM fencelock_locks WHERE key = ?1"),
            [key],
            LockRow::from_row,
        )
        .optional()
    }

    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<LockRow> {
        Ok(LockRow {
            key: r.get(0)?,
            token: r.get(1)?,
            owner: r.get(2)?,
            boot_id: r.get(3)?,
            expires_at: r.get(4)?,
            ttl_ms: r.get(5)?,
            host: r.get(6)?,
            pid: r.get(7)?,
            client: r.get(8)?,
            acquired_at: r.get(9)?,
            renewed_at: r.get(10)?,
        })
    }

    /// The live holder's owner value, if the row is held in this boot and not expired.
    fn live_owner(&self, now: i64, boot: &str) -> Option<&str> {
        let live =
            self.boot_id.as_deref() == Some(boot) && self.expires_at.is_some_and(|e| e > now);
        self.owner.as_deref().filter(|_| live)
    }

    fn holder(&self, now: i64) -> Holder {
        let mut h = Holder::bare(self.owner.clone().unwrap_or_default());
        h.token = Some(FencingToken::from_stored(self.token));
        h.host = self.host.clone();
        h.pid = self.pid.and_then(|p| u32::try_from(p).ok());
        h.client = self.client.clone();
        h.acquired_at = self.acquired_at.map(from_unix_millis);
        h.renewed_at = self.renewed_at.map(from_unix_millis);
        h.ttl = self.ttl_ms.map(duration_from_millis);
        h.ttl_left = self
            .expires_at
            .map(|e| duration_from_millis(e.saturating_sub(now)));
        h
    }
}

impl SqliteEngine {
    /// Opens the database on a worker thread that then runs every statement of this engine.
    ///
    /// One thread, one connection and a FIFO queue keep calls in the order they were made: an
    /// owner-checked release sent after an abandoned acquisition always runs after it, so a
    /// cancelled acquire can never leave a lock behind by overtaking.
    pub(crate) async fn open(path: PathBuf, cfg: &EngineConfig) -> Result<SqliteEngine> {
        let op_timeout = cfg.op_timeout;
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let p = path.clone();
        // The default file is this user's own: its directory is created 0700, as the XDG
        // base-directory spec asks, and the file 0600. A file the URL names keeps the user's
        // umask, so a group can share it (docs/sqlite.md).
        let private = url::default_sqlite_path().ok().as_deref() == Some(path.as_path());
        std::thread::Builder::new()
            .name("fencelock-sqlite".into())
            .spawn(move || {
                let mut conn = match open_blocking(&p, op_timeout, private) {
                    Ok(c) => {
                        let _ = ready_tx.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let boot = current_boot_id();
                // Ends when the engine, the only sender, is dropped.
                while let Ok(job) = queue.recv() {
                    job(&mut conn, &boot);
                }
            })
            .map_err(|e| {
                Error::engine_failure(ENGINE, format!("cannot start the SQLite thread: {e}"))
            })?;
        ready.await.map_err(|_| {
            Error::engine_failure(ENGINE, format!("opening {} failed", path.display()))
        })??;
        Ok(SqliteEngine {
            jobs,
            path: Arc::new(path),
            prefix: cfg.prefix.clone(),
            holder_id: cfg.holder_id.clone(),
        })
    }

    /// The row key of a resource: the prefix followed by the name, which is injective.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Queues `f` on the engine's connection thread. The job is queued during the first poll,
    /// so it runs even if the caller's future is dropped afterwards.
    async fn with_conn<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection, &str) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let path = self.path.clone();
        let job: Job = Box::new(move |conn, boot| {
            let _ = tx.send(f(conn, boot).map_err(|e| sql_error(&path, e)));
        });
        self.jobs.send(job).map_err(|_| {
            Error::engine_failure(
                ENGINE,
                format!("{}: the SQLite thread has stopped", self.path.display()),
            )
        })?;
        rx.await.map_err(|_| {
            Error::engine_failure(
                ENGINE,
                format!("{}: the SQLite thread has stopped", self.path.display()),
            )
        })?
    }
}

fn open_blocking(path: &Path, op_timeout: Duration, private: bool) -> Result<Connection> {
    if let Some(dir) = path.parent() {
        use std::os::unix::fs::DirBuilderExt;
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        if private {
            builder.mode(0o700);
        }
        builder.create(dir).map_err(|e| {
            Error::engine_failure(
                ENGINE,
                format!(
                    "cannot create the directory {} for the lock database: {e}; choose a \
                     writable path with --backend sqlite:///path/locks.db",
                    dir.display()
                ),
            )
        })?;
    }
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        // Created here, before SQLite would create it with the umask's mode; SQLite gives its
        // -wal and -shm files the database file's mode.
        let created = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path);
        if let Err(e) = created {
            return Err(Error::engine_failure(
                ENGINE,
                format!("cannot create the lock database {}: {e}", path.display()),
            ));
        }
    }
    let started = std::time::Instant::now();
    loop {
        match try_open(path, op_timeout) {
            Ok(c) => return Ok(c),
            // Several processes creating the file at once can see SQLITE_BUSY while one of them
            // switches it to WAL; that is worth retrying within the operation deadline.
            Err(rusqlite::Error::SqliteFailure(f, _))
                if f.code == rusqlite::ErrorCode::DatabaseBusy
                    && started.elapsed() < op_timeout =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                let hint = match &e {
                    rusqlite::Error::SqliteFailure(f, _)
                        if f.code == rusqlite::ErrorCode::DatabaseBusy =>
                    {
                        "another process holds its write lock and did not let go (a stopped or \
                         hung process?)"
                    }
                    _ => "check that the path is writable",
                };
                return Err(Error::engine_failure(
                    ENGINE,
                    format!("cannot open the lock database {}; {hint}", path.display()),
                )
                .with_source(e));
            }
        }
    }
}

fn try_open(path: &Path, op_timeout: Duration) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(op_timeout)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        tracing::debug!(path = %path.display(), mode, "SQLite kept its journal mode");
    }
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(SCHEMA)?;
    migrate(&conn)?;
    Ok(conn)
}

/// Adds the [`MIGRATIONS`] columns a file lacks, in one immediate transaction, so that two
/// processes opening an old file at once do not both add them.
fn migrate(conn: &Connection) -> rusqlite::Result<()> {
    let has = |conn: &Connection, column: &str| -> rusqlite::Result<bool> {
        conn.query_row(
            "SELECT count(*) FROM pragma_table_info('fencelock_locks') WHERE name = ?1",
            [column],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n > 0)
    };
    if MIGRATIONS.iter().try_fold(true, |all, (c, _)| {
        Ok::<_, rusqlite::Error>(all && has(conn, c)?)
    })? {
        return Ok(());
    }
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let added = MIGRATIONS.iter().try_for_each(|(column, sql)| {
        if has(conn, column)? {
            Ok(())
        } else {
            conn.execute_batch(sql)
        }
    });
    match added {
        Ok(()) => conn.execute_batch("COMMIT"),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

/// The limits of `prefix` as stored in `fencelock_limits` (none: empty limits).
fn read_limits(conn: &Connection, prefix: &str) -> rusqlite::Result<Limits> {
    let mut stmt =
        conn.prepare_cached("SELECT max_ttl_ms, max_held FROM fencelock_limits WHERE prefix = ?1")?;
    Ok(stmt
        .query_row([prefix], |r| Ok(Limits::from_stored(r.get(0)?, r.get(1)?)))
        .optional()?
        .unwrap_or_default())
}

#[async_trait]
impl Engine for SqliteEngine {
    fn kind(&self) -> &'static str {
        ENGINE
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        labelled_keys(&self.prefix, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = self.key(&req.name);
        let req = req.clone();
        let (prefix, holder_id) = (self.prefix.clone(), self.holder_id.clone());
        let answer = self.with_conn(move |conn, boot| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            // The limits are read in the grant's transaction: a client cannot slip past them
            // between the check and the grant.
            let limits = read_limits(&tx, &prefix)?;
            if let Some(refused) = limits.check_ttl(req.ttl) {
                return Ok(Err(refused));
            }
            // Read the clock only once the write lock is ours, so "now" is never earlier than
            // the commit of the previous holder.
            let now = boot_millis();
            let wall = unix_millis(SystemTime::now());
            let row = LockRow::read(&tx, &key)?;
            let expires = now.saturating_add(millis_of(req.ttl));
            if let Some(row) = &row {
                match row.live_owner(now, boot) {
                    Some(owner) if owner == req.owner => {
                        tx.execute(
                            "UPDATE fencelock_locks SET expires_at = ?2, renewed_at = ?3 WHERE key = ?1",
                            params![key, expires, wall],
                        )?;
                        tx.commit()?;
                        return Ok(Ok(Attempt::Granted(FencingToken::from_stored(row.token))));
                    }
                    Some(_) => {
                        let holder = row.holder(now);
                        return Ok(Ok(Attempt::Held {
                            retry_in: holder.ttl_left,
                            holder: Some(holder),
                            wake: None,
                        }));
                    }
                    None => {}
                }
            }
            if let Some(max) = limits.max_held_per_client() {
                let (held, first): (i64, Option<i64>) = tx.query_row(
                    "SELECT count(*), min(expires_at) FROM fencelock_locks
                     WHERE holder_id = ?1 AND substr(key, 1, length(?2)) = ?2 AND key <> ?3
                       AND owner IS NOT NULL AND boot_id = ?4 AND expires_at > ?5",
                    params![holder_id, prefix, key, boot, now],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )?;
                if held >= i64::from(max) {
                    return Ok(Ok(Attempt::OverQuota {
                        max,
                        retry_in: first.map(|e| duration_from_millis(e.saturating_sub(now))),
                    }));
                }
            }
            let token = row.map_or(0, |r| r.token).saturating_add(1);
            tx.execute(
                "INSERT INTO fencelock_locks
                   (key, token, owner, boot_id, expires_at, ttl_ms, host, pid, client, acquired_at, renewed_at, holder_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?10, ?11)
                 ON CONFLICT(key) DO UPDATE SET
                   token = excluded.token, owner = excluded.owner, boot_id = excluded.boot_id,
                   expires_at = excluded.expires_at, ttl_ms = excluded.ttl_ms, host = excluded.host,
                   pid = excluded.pid, client = excluded.client, acquired_at = excluded.acquired_at,
                   renewed_at = excluded.renewed_at, holder_id = excluded.holder_id",
                params![
                    key,
                    token,
                    req.owner,
                    boot,
                    expires,
                    millis_of(req.ttl),
                    req.meta.host,
                    req.meta.pid,
                    req.meta.client,
                    wall,
                    holder_id
                ],
            )?;
            tx.commit()?;
            Ok(Ok(Attempt::Granted(FencingToken::from_stored(token))))
        })
        .await?;
        answer.map_err(|e| e.with_resource(&req.name).with_engine(ENGINE))
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let batch: Vec<(String, Renewal)> = batch
            .iter()
            .map(|r| (self.key(&r.name), r.clone()))
            .collect();
        let prefix = self.prefix.clone();
        self.with_conn(move |conn, boot| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let cap = read_limits(&tx, &prefix)?.max_ttl();
            let now = boot_millis();
            let wall = unix_millis(SystemTime::now());
            let mut out = Vec::with_capacity(batch.len());
            {
                let mut stmt = tx.prepare_cached(
                    "UPDATE fencelock_locks SET expires_at = ?4, ttl_ms = ?5, renewed_at = ?6
                     WHERE key = ?1 AND owner = ?2 AND boot_id = ?3 AND expires_at > ?7",
                )?;
                for (key, r) in &batch {
                    if let Some(max) = cap.filter(|max| r.ttl > *max) {
                        out.push(Renewed::OverLimit(max));
                        continue;
                    }
                    let ttl = millis_of(r.ttl);
                    let n = stmt.execute(params![
                        key,
                        r.owner,
                        boot,
                        now.saturating_add(ttl),
                        ttl,
                        wall,
                        now
                    ])?;
                    out.push(if n == 1 {
                        Renewed::Extended
                    } else {
                        Renewed::NotHolder
                    });
                }
            }
            tx.commit()?;
            Ok(out)
        })
        .await
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        let key = self.key(name);
        let owner = owner.to_owned();
        self.with_conn(move |conn, boot| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let now = boot_millis();
            let Some(row) = LockRow::read(&tx, &key)? else {
                return Ok(false);
            };
            if row.owner.as_deref() != Some(owner.as_str()) {
                return Ok(false);
            }
            let was_live = row.live_owner(now, boot).is_some();
            tx.execute(
                "UPDATE fencelock_locks SET owner = NULL, boot_id = NULL, expires_at = NULL
                 WHERE key = ?1 AND owner = ?2",
                params![key, owner],
            )?;
            tx.commit()?;
            Ok(was_live)
        })
        .await
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        let key = self.key(name);
        self.with_conn(move |conn, boot| {
            let now = boot_millis();
            let row = LockRow::read(conn, &key)?;
            Ok(row.and_then(|r| r.live_owner(now, boot).is_some().then(|| r.holder(now))))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let engine_prefix = self.prefix.clone();
        let start = self.key(prefix);
        self.with_conn(move |conn, boot| {
            let now = boot_millis();
            // `substr` and `length` both count characters, so this is an exact prefix test
            // whatever the name holds (`%` and `_` included, unlike LIKE).
            let mut stmt = conn.prepare_cached(&format!(
                "SELECT {LOCK_COLUMNS} FROM fencelock_locks
                 WHERE owner IS NOT NULL AND substr(key, 1, length(?1)) = ?1"
            ))?;
            let rows = stmt.query_map([&start], LockRow::from_row)?;
            let mut out = Vec::new();
            for row in rows {
                let row = row?;
                if row.live_owner(now, boot).is_none() {
                    continue;
                }
                if let Some(name) = row.key.strip_prefix(&engine_prefix) {
                    out.push(HeldLock::new(name.to_owned(), row.holder(now)));
                }
            }
            Ok(out)
        })
        .await
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let key = self.key(name);
        let expected = expected_owner.map(str::to_owned);
        let mut record = draft.clone();
        self.with_conn(move |conn, boot| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let now = boot_millis();
            let Some(row) = LockRow::read(&tx, &key)? else {
                return Ok(None);
            };
            let Some(owner) = row.live_owner(now, boot) else {
                return Ok(None);
            };
            if expected.as_deref().is_some_and(|e| e != owner) {
                return Ok(None);
            }
            // The row keeps the counter: the next grant takes `mark + 1`.
            let mark = row.token.saturating_add(1);
            tx.execute(
                "UPDATE fencelock_locks SET token = ?2, owner = NULL, boot_id = NULL, expires_at = NULL
                 WHERE key = ?1",
                params![key, mark],
            )?;
            record.holder = row.holder(now);
            record.holder.ttl_left = None;
            record.counter = FencingToken::from_stored(mark);
            let values = audit_values(&key, &record);
            tx.execute(
                &audit_insert_sql('?'),
                rusqlite::params_from_iter(values.iter().map(param)),
            )?;
            tx.commit()?;
            Ok(Some(record))
        })
        .await
    }

    async fn limits(&self) -> Result<Vec<StoredLimits>> {
        let prefix = self.prefix.clone();
        let limits = self
            .with_conn(move |conn, _| read_limits(conn, &prefix))
            .await?;
        Ok(vec![StoredLimits {
            node: self.path.display().to_string(),
            limits: Ok((!limits.is_empty()).then_some(limits)),
        }])
    }

    async fn set_limits(&self, limits: &Limits) -> Result<()> {
        let prefix = self.prefix.clone();
        let limits = *limits;
        self.with_conn(move |conn, _| {
            if limits.is_empty() {
                conn.execute("DELETE FROM fencelock_limits WHERE prefix = ?1", [&prefix])?;
            } else {
                conn.execute(
                    "INSERT INTO fencelock_limits (prefix, max_ttl_ms, max_held) VALUES (?1, ?2, ?3)
                     ON CONFLICT(prefix) DO UPDATE SET
                       max_ttl_ms = excluded.max_ttl_ms, max_held = excluded.max_held",
                    params![prefix, limits.max_ttl_ms(), limits.max_held_value()],
                )?;
            }
            Ok(())
        })
        .await
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let prefix = self.prefix.clone();
        let key = name.map(|n| self.key(n));
        self.with_conn(move |conn, _| {
            let (filter, arg) = match &key {
                Some(k) => ("key = ?1", k.as_str()),
                None => ("substr(key, 1, length(?1)) = ?1", prefix.as_str()),
            };
            let mut stmt = conn.prepare_cached(&audit_select_sql(filter))?;
            let rows = stmt.query_map([arg], |r| audit_record(r, &prefix))?;
            rows.collect()
        })
        .await
    }
}
