//! The PostgreSQL engine (`postgres://`), in two modes.
//!
//! **Advisory mode** (the default) takes session advisory locks, `pg_try_advisory_lock(k)`:
//!
//! - **The key.** `k` is the first 8 bytes, big-endian, of the SHA-256 of the prefix followed
//!   by the resource name (`fencelock:v1:nightly-invoices`), read as a signed 64-bit integer.
//!   `fencelock key NAME --backend postgres://...` prints it, so that `SELECT
//!   pg_advisory_lock(<k>)` in `psql` takes the very same lock. It is a hash: two names collide
//!   with probability 2^-64, and among `n` names in use some pair collides with probability
//!   about `n² / 2^65` (one in 37 million for a million names). A collision makes two names
//!   exclude each other, never lets two holders in.
//! - **Few connections, many locks.** A client keeps at most `pool - 1` sessions for its locks
//!   (`?pool=N`, default 4, at most 10) and one for notifications; a resource always maps to
//!   the same session. Advisory locks are re-entrant per session, so the engine remembers which
//!   keys each session holds and for which owner, and never asks the server for a key its own
//!   session already holds: a second lease of this process on the same name is refused
//!   locally, as one from another process would be. Statements of one session run one after
//!   another in the order they were asked, so a release always follows the grant it undoes.
//! - **Token in the same round trip.** One statement tries the lock and, only if granted,
//!   advances the resource's durable counter in `fencelock_tokens`, returning it.
//! - **Loss.** Advisory locks have no expiry on the server: a lock lives as long as its
//!   session. When a session ends (its backend terminated, the server restarted, the network
//!   cut), every lease taken on it is reported lost at once, not at its next renewal. The
//!   lease TTL still bounds how long the client trusts a session it cannot hear from: each
//!   renewal is one liveness check per session (which advisory locks does this backend hold?)
//!   for all the leases on it.
//! - **Wake-ups.** Release runs `pg_notify` on a channel named after the prefix with the
//!   resource name as payload; one session per client listens, while the client has waiters
//!   (see [`listen`]), and wakes them. A lock
//!   released by someone else (`psql`) sends no notification: waiters then retry after their
//!   backoff.
//! - **Forced release** (the stuck-lock runbook) can only end the holder's session:
//!   `pg_terminate_backend`, which also drops every other lock that session holds (their
//!   holders learn it at once). It needs the right to signal that backend (superuser, the
//!   same role, or `pg_signal_backend`).
//!
//! **Lease-table mode** (`?mode=lease`) keeps rows in `fencelock_leases` with owner, token and
//! an expiry by the database's clock (`clock_timestamp()`). Each operation is one statement in
//! its own transaction with unnamed statements, so it works through a transaction pooler where
//! session locks and prepared statements do not; `?prepare=true` prepares the hot statements
//! once per connection instead, for direct connections. The two modes keep separate tables and do not
//! exclude each other: every client of one resource must use the same mode.
//!
//! Both modes create their tables on first use, record forced releases in `fencelock_audit`,
//! and advance the counter there at the same time.

pub(crate) mod acl;
mod advisory;
mod lease;
mod listen;
pub(crate) mod privileges;
mod statements;
mod tls;
pub(crate) mod url;

pub use statements::PgPairStatements;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use crate::core::engine::{EngineConfig, Opened};
use crate::core::error::{Error, Result};
use crate::core::limits::{Limits, StoredLimits};
use crate::core::records::AuditRecord;
use crate::core::sql::{
    audit_insert_sql, audit_record, audit_select_sql, audit_values, SqlRow, SqlValue,
};
use crate::core::url::redact_url;
use crate::core::wake::WakeRx;
use crate::core::wake::Wakers;
use url::{PgMode, PostgresUrl};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fencelock_tokens (
    key         text PRIMARY KEY,
    lock_key    bigint NOT NULL,
    counter     bigint NOT NULL,
    owner       text,
    backend_pid integer,
    host        text,
    pid         bigint,
    client      text,
    acquired_at bigint,
    ttl_ms      bigint
);
CREATE INDEX IF NOT EXISTS fencelock_tokens_by_lock_key ON fencelock_tokens (lock_key);
CREATE TABLE IF NOT EXISTS fencelock_leases (
    key         text PRIMARY KEY,
    token       bigint NOT NULL,
    owner       text,
    expires_at  timestamptz,
    ttl_ms      bigint,
    host        text,
    pid         bigint,
    client      text,
    acquired_at bigint,
    renewed_at  bigint
);
CREATE TABLE IF NOT EXISTS fencelock_audit (
    id            bigserial PRIMARY KEY,
    record_id     text NOT NULL,
    key           text NOT NULL,
    at            bigint NOT NULL,
    by_user       text NOT NULL,
    by_host       text NOT NULL,
    reason        text NOT NULL,
    declared_dead boolean NOT NULL,
    assessment    text NOT NULL,
    owner         text NOT NULL,
    token         bigint,
    host          text,
    pid           bigint,
    client        text,
    acquired_at   bigint,
    renewed_at    bigint,
    ttl_ms        bigint,
    counter       bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS fencelock_audit_by_key ON fencelock_audit (key, id);
CREATE TABLE IF NOT EXISTS fencelock_limits (
    prefix      text PRIMARY KEY,
    max_ttl_ms  bigint NOT NULL,
    max_held    bigint NOT NULL
);
";

/// What was added after the first release, to databases created without it, checked before it
/// is changed so that a role that does not own the tables can still open them once they are
/// up to date: the `holder_id` columns, and the functions that count a client's leases for
/// the `max-held-per-client` limit.
///
/// The functions serialise the grants of one client under one prefix on a transaction
/// advisory lock (in the two-key space, apart from the locks' own keys) and only then count,
/// in a statement of their own: PL/pgSQL's volatile functions take a new snapshot per
/// statement, so the count sees every grant committed by whoever held that lock before. A
/// count in the grant statement itself would see only its snapshot, and two grants of one
/// client racing on two names could both pass. They answer 0 within the quota; otherwise the
/// milliseconds until the client's first lease expires (lease table), or 1.
pub(super) const MIGRATIONS: &str = r#"
DO $m$ BEGIN
IF NOT EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_name = 'fencelock_tokens' AND column_name = 'holder_id'
                 AND table_schema = current_schema()) THEN
    ALTER TABLE fencelock_tokens ADD COLUMN holder_id text;
END IF;
IF NOT EXISTS (SELECT 1 FROM information_schema.columns
               WHERE table_name = 'fencelock_leases' AND column_name = 'holder_id'
                 AND table_schema = current_schema()) THEN
    ALTER TABLE fencelock_leases ADD COLUMN holder_id text;
END IF;
IF to_regprocedure('fencelock_advisory_quota(text,text,text,bigint)') IS NULL THEN
    CREATE FUNCTION fencelock_advisory_quota(p text, h text, k text, m bigint) RETURNS bigint
    LANGUAGE plpgsql VOLATILE AS $f$
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('fencelock-quota'), hashtext(p || h));
        RETURN CASE WHEN (
            SELECT count(*) FROM fencelock_tokens t JOIN pg_locks l
              ON l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
             AND l.pid = t.backend_pid
             AND ((l.classid::bigint << 32) | l.objid::bigint) = t.lock_key
            WHERE t.holder_id = h AND left(t.key, length(p)) = p AND t.key <> k) >= m
        THEN 1 ELSE 0 END;
    END $f$;
END IF;
IF to_regprocedure('fencelock_lease_quota(text,text,text,bigint)') IS NULL THEN
    CREATE FUNCTION fencelock_lease_quota(p text, h text, k text, m bigint) RETURNS bigint
    LANGUAGE plpgsql VOLATILE AS $f$
    DECLARE n bigint; first timestamptz;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtext('fencelock-quota'), hashtext(p || h));
        SELECT count(*), min(expires_at) INTO n, first FROM fencelock_leases
        WHERE holder_id = h AND left(key, length(p)) = p AND key <> k
          AND owner IS NOT NULL AND expires_at > clock_timestamp();
        IF n < m THEN RETURN 0; END IF;
        RETURN GREATEST(1, extract(epoch FROM first - clock_timestamp()) * 1000)::bigint;
    END $f$;
END IF;
END $m$;
"#;

/// Opens a client's connections: in advisory mode the lock and the feed of leases lost with a
/// session; in lease-table mode the lock alone.
pub(crate) async fn open(url: PostgresUrl, cfg: &EngineConfig) -> Result<Opened> {
    let kind = url.engine();
    let (config, tls) = driver_config(&url, cfg.op_timeout)?;
    let PostgresUrl {
        mode,
        pool,
        prepare,
        ..
    } = url;
    let shared = Shared {
        kind,
        config,
        tls,
        prefix: cfg.prefix.clone(),
        holder_id: cfg.holder_id.clone(),
        op_timeout: cfg.op_timeout,
        channel: channel_name(&cfg.prefix),
        wakers: Arc::new(Wakers::default()),
        demand: Arc::default(),
        shutdown: CancellationToken::new(),
    };
    // Fails early, with a clear error, when the server cannot be reached, and creates the
    // tables before any lease needs them.
    let first = shared.connect().await?;
    shared.bounded(create_schema(&first)).await?;
    tokio::spawn(listen::listen_for_wakeups(
        shared.config.clone(),
        shared.tls.clone(),
        shared.channel.clone(),
        shared.wakers.clone(),
        shared.demand.clone(),
        shared.shutdown.clone(),
    ));
    let sessions = pool - 1;
    match mode {
        PgMode::Advisory => {
            let (engine, losses) = advisory::AdvisoryEngine::new(shared, sessions);
            Ok(Opened {
                losses: Some(losses),
                // Session locks: the server frees them when the connection closes.
                ends_with_process: true,
                ..Opened::lock(Arc::new(engine))
            })
        }
        PgMode::Lease => Ok(Opened::lock(Arc::new(
            lease::LeaseEngine::open(shared, sessions, first, prepare).await?,
        ))),
    }
}

/// The driver's configuration and the TLS connector of a URL.
fn driver_config(url: &PostgresUrl, timeout: Duration) -> Result<(Config, MakeRustlsConnect)> {
    let mut config = Config::from_str(&url.url).map_err(|e| {
        Error::invalid(format!(
            "the PostgreSQL URL {} is not valid: {e}",
            redact_url(&url.url)
        ))
    })?;
    if config.get_application_name().is_none() {
        config.application_name("fencelock");
    }
    config.connect_timeout(timeout);
    Ok((config, tls::connector(&url.tls)?))
}

impl PostgresUrl {
    /// One session to the server, with the URL's TLS settings (`sslmode`, `sslrootcert`,
    /// `sslcert`, `sslkey`) as the engine applies them, its connection driven by a task of
    /// its own: for a [`PgFence`](crate::fence::PgFence) and tools that run their own
    /// statements. fencelock's own parameters (`mode`, `pool`, `prepare`) play no part.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for a URL the driver
    /// refuses or TLS files that cannot be read;
    /// [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the server cannot be reached within
    /// `timeout`, refuses the session or fails the TLS handshake.
    pub async fn connect(&self, timeout: Duration) -> Result<Client> {
        let (config, tls) = driver_config(self, timeout)?;
        connect_session(self.engine(), &config, tls, timeout, || {}).await
    }
}

/// A new session whose connection runs in a task of its own; `on_end` runs when it ends.
async fn connect_session(
    kind: &'static str,
    config: &Config,
    tls: MakeRustlsConnect,
    limit: Duration,
    on_end: impl FnOnce() + Send + 'static,
) -> Result<Client> {
    let (client, connection) = match tokio::time::timeout(limit, config.connect(tls)).await {
        Ok(Ok(pair)) => pair,
        Ok(Err(e)) => {
            let what = format!(
                "cannot connect to PostgreSQL; check that the server is up and the URL, user, \
                 password and TLS settings (sslmode, sslrootcert, sslcert, sslkey) are \
                 right{}",
                causes(&e)
            );
            return Err(pg_error(kind, &what, e));
        }
        Err(_) => {
            return Err(Error::engine_failure(
                kind,
                format!(
                    "cannot connect to PostgreSQL within {}; check that the server is up",
                    crate::core::options::display_duration(limit)
                ),
            ))
        }
    };
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "PostgreSQL session ended");
        }
        on_end();
    });
    Ok(client)
}

/// What the driver's message leaves out: a failed TLS handshake says why (an unknown CA, a
/// name the certificate does not hold) only in the errors under it.
fn causes(e: &tokio_postgres::Error) -> String {
    let top = e.to_string();
    let mut out = String::new();
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if !top.contains(&text) && !out.contains(&text) {
            out.push_str(" (");
            out.push_str(&text);
            out.push(')');
        }
        next = cause.source();
    }
    out
}

/// The advisory lock key of a resource: the first 8 bytes of SHA-256(prefix ‖ name) as a
/// big-endian signed integer.
/// The labelled keys of `name` under `prefix` in `mode`, as [`Engine::keys`] gives them,
/// without a connection.
pub(crate) fn labelled_keys(mode: PgMode, prefix: &str, name: &str) -> Vec<(&'static str, String)> {
    match mode {
        PgMode::Advisory => vec![
            ("advisory", advisory_key(prefix, name).to_string()),
            (
                "token row",
                format!("fencelock_tokens.key = {prefix}{name}"),
            ),
        ],
        PgMode::Lease => vec![("row", format!("fencelock_leases.key = {prefix}{name}"))],
    }
}

pub(crate) fn advisory_key(prefix: &str, name: &str) -> i64 {
    let digest = Sha256::new()
        .chain_update(prefix.as_bytes())
        .chain_update(name.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// The notification channel of a prefix: an identifier that needs no quoting, whatever the
/// prefix holds.
fn channel_name(prefix: &str) -> String {
    let digest = Sha256::digest(prefix.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("fencelock_{hex}")
}

/// What both modes share: how to connect, the namespace, the wake-ups.
pub(crate) struct Shared {
    kind: &'static str,
    config: Config,
    tls: MakeRustlsConnect,
    prefix: String,
    /// Who this client is for the `max-held-per-client` limit.
    holder_id: String,
    op_timeout: Duration,
    channel: String,
    wakers: Arc<Wakers>,
    /// Refused attempts, which make the listening session listen.
    demand: Arc<listen::Demand>,
    shutdown: CancellationToken,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Shared {
    /// The row key of a resource: the prefix followed by the name, which is injective.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn name_of<'a>(&self, key: &'a str) -> &'a str {
        key.strip_prefix(&self.prefix).unwrap_or(key)
    }

    fn error(&self, what: &str, e: tokio_postgres::Error) -> Error {
        pg_error(self.kind, what, e)
    }

    /// Waits for `fut` at most one operation timeout.
    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
    ) -> Result<T> {
        bounded(self.kind, self.op_timeout, fut).await
    }

    /// A new session whose connection runs in a task of its own; `on_end` runs when it ends.
    async fn connect_with(&self, on_end: impl FnOnce() + Send + 'static) -> Result<Client> {
        connect_session(
            self.kind,
            &self.config,
            self.tls.clone(),
            self.op_timeout,
            on_end,
        )
        .await
    }

    async fn connect(&self) -> Result<Client> {
        self.connect_with(|| {}).await
    }

    /// The limits stored for this prefix (an unnamed statement, as in [`Shared::write_limits`]).
    async fn read_limits(&self, client: &Client) -> Result<Vec<StoredLimits>> {
        let rows = self
            .bounded(client.query_typed(
                "SELECT max_ttl_ms, max_held FROM fencelock_limits WHERE prefix = $1",
                &[(&self.prefix, Type::TEXT)],
            ))
            .await?;
        let limits = match rows.first() {
            Some(r) => {
                let (t, h): (i64, i64) = (
                    r.try_get(0)
                        .map_err(|e| self.error("unexpected answer", e))?,
                    r.try_get(1)
                        .map_err(|e| self.error("unexpected answer", e))?,
                );
                Some(Limits::from_stored(t, h)).filter(|l| !l.is_empty())
            }
            None => None,
        };
        let node = format!(
            "database {}",
            self.config.get_dbname().unwrap_or("postgres")
        );
        Ok(vec![StoredLimits {
            node,
            limits: Ok(limits),
        }])
    }

    /// Stores (or, empty, deletes) the limits of this prefix. Unnamed statements with their
    /// types given, parsed and run in one round trip: a named statement prepared first may
    /// reach another server connection than its execution through a transaction pooler, which
    /// then answers that it does not exist.
    async fn write_limits(&self, client: &Client, limits: &Limits) -> Result<()> {
        let (prefix, ttl, held) = (&self.prefix, limits.max_ttl_ms(), limits.max_held_value());
        let empty = limits.is_empty();
        self.bounded(async move {
            if empty {
                client
                    .query_typed(
                        "DELETE FROM fencelock_limits WHERE prefix = $1",
                        &[(prefix, Type::TEXT)],
                    )
                    .await
            } else {
                client
                    .query_typed(
                        "INSERT INTO fencelock_limits (prefix, max_ttl_ms, max_held)
                         VALUES ($1, $2, $3)
                         ON CONFLICT (prefix) DO UPDATE SET
                           max_ttl_ms = EXCLUDED.max_ttl_ms, max_held = EXCLUDED.max_held",
                        &[
                            (prefix, Type::TEXT),
                            (&ttl, Type::INT8),
                            (&held, Type::INT8),
                        ],
                    )
                    .await
            }
        })
        .await
        .map(|_| ())
    }

    fn subscribe(&self, name: &str) -> WakeRx {
        self.wakers.subscribe(name)
    }

    /// An attempt on `name` was refused and its waiter will want the release's wake-up.
    fn refused(&self, name: &str) {
        self.demand.refused(name);
    }

    /// The audit log of one resource, or of every resource under the prefix, newest first.
    async fn audit(&self, client: &Client, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let (filter, arg) = match name {
            Some(n) => ("key = $1", self.key(n)),
            None => ("starts_with(key, $1)", self.prefix.clone()),
        };
        // Unnamed statements: this also runs through transaction poolers (lease mode).
        let rows = self
            .bounded(client.query_typed(&audit_select_sql(filter), &[(&arg, Type::TEXT)]))
            .await?;
        rows.iter()
            .map(|r| audit_record(r, &self.prefix))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| self.error("reading fencelock_audit", e))
    }
}

/// `what` failed, as an engine error; says so when the connection closed under it.
fn pg_error(kind: &'static str, what: &str, e: tokio_postgres::Error) -> Error {
    let hint = if e.is_closed() {
        "; the connection was closed (server restarted or unreachable?)"
    } else {
        ""
    };
    Error::engine_failure(kind, format!("{what}{hint}: {}", server_says(&e)))
}

/// What the server (or the socket) said. `tokio_postgres::Error` displays as "db error" for
/// every server error and keeps the message in its source, so the message, SQLSTATE, detail
/// and hint are taken from there; other errors are shown with their chain of causes
/// ("error connecting to server: Connection refused").
fn server_says(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut out = format!(
            "{} {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
        if let Some(detail) = db.detail() {
            out.push_str(&format!("; {detail}"));
        }
        if let Some(hint) = db.hint() {
            out.push_str(&format!("; hint: {hint}"));
        }
        return out;
    }
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(&format!(": {text}"));
        }
        source = s.source();
    }
    out
}

/// Waits for `fut` at most `limit`, so that no statement of either mode outlives its
/// deadline: a server that stops answering becomes an engine error, not a hang.
async fn bounded<T>(
    kind: &'static str,
    limit: Duration,
    fut: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(pg_error(kind, "PostgreSQL", e)),
        Err(_) => Err(Error::engine_failure(
            kind,
            format!(
                "PostgreSQL gave no answer within {}",
                crate::core::options::display_duration(limit)
            ),
        )),
    }
}

/// Appends a forced release to the audit log, inside the caller's transaction.
async fn insert_audit(
    tx: &tokio_postgres::Transaction<'_>,
    key: &str,
    record: &AuditRecord,
) -> std::result::Result<(), tokio_postgres::Error> {
    let values = audit_values(key, record);
    let params: Vec<&(dyn ToSql + Sync)> = values.iter().map(param).collect();
    tx.execute(&audit_insert_sql('$'), &params)
        .await
        .map(|_| ())
}

impl SqlRow for tokio_postgres::Row {
    type Error = tokio_postgres::Error;
    fn text(&self, i: usize) -> std::result::Result<String, tokio_postgres::Error> {
        self.try_get(i)
    }
    fn maybe_text(&self, i: usize) -> std::result::Result<Option<String>, tokio_postgres::Error> {
        self.try_get(i)
    }
    fn int(&self, i: usize) -> std::result::Result<i64, tokio_postgres::Error> {
        self.try_get(i)
    }
    fn maybe_int(&self, i: usize) -> std::result::Result<Option<i64>, tokio_postgres::Error> {
        self.try_get(i)
    }
    fn flag(&self, i: usize) -> std::result::Result<bool, tokio_postgres::Error> {
        self.try_get(i)
    }
}

/// A value as a PostgreSQL parameter (`text`, `bigint` or `boolean`).
fn param(v: &SqlValue) -> &(dyn ToSql + Sync) {
    match v {
        SqlValue::Text(s) => s,
        SqlValue::MaybeText(s) => s,
        SqlValue::Int(n) => n,
        SqlValue::MaybeInt(n) => n,
        SqlValue::Bool(b) => b,
    }
}

/// Creates the tables once; concurrent first clients wait for each other on a transaction
/// advisory lock rather than race on the catalog.
///
/// When every table and index already exists, nothing is created: a role confined by `fencelock
/// acl` has no CREATE privilege, and `CREATE ... IF NOT EXISTS` checks the privilege before it
/// looks for the table.
async fn create_schema(client: &Client) -> std::result::Result<(), tokio_postgres::Error> {
    let names: Vec<&str> = SCHEMA
        .split(';')
        .filter_map(|s| {
            let s = s.trim();
            s.strip_prefix("CREATE TABLE IF NOT EXISTS ")
                .or_else(|| s.strip_prefix("CREATE INDEX IF NOT EXISTS "))
        })
        .filter_map(|rest| rest.split_whitespace().next())
        .collect();
    // Unnamed, as every statement that may pass through a transaction pooler. The later
    // additions count too: tables made before them still need the migrations. The catalog,
    // not information_schema, which hides the columns of tables the role may not use.
    let rows = client
        .query_typed(
            "SELECT bool_and(to_regclass(n) IS NOT NULL)
                    AND to_regprocedure('fencelock_advisory_quota(text,text,text,bigint)') IS NOT NULL
                    AND to_regprocedure('fencelock_lease_quota(text,text,text,bigint)') IS NOT NULL
                    AND (SELECT count(*) = 2 FROM pg_attribute
                         WHERE attname = 'holder_id' AND NOT attisdropped
                           AND attrelid IN (to_regclass('fencelock_tokens'),
                                            to_regclass('fencelock_leases')))
             FROM unnest($1::text[]) n",
            &[(&names, Type::TEXT_ARRAY)],
        )
        .await?;
    let present = match rows.first() {
        Some(r) => r.try_get::<_, Option<bool>>(0)?.unwrap_or(false),
        None => false,
    };
    if present {
        return Ok(());
    }
    let lock = advisory_key("fencelock:", "schema");
    client
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({lock}); {SCHEMA} {MIGRATIONS} COMMIT;"
        ))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advisory_key_is_documented_hash() {
        // SHA-256("fencelock:v1:nightly-invoices"), first 8 bytes, big-endian, signed.
        let digest = Sha256::digest(b"fencelock:v1:nightly-invoices");
        let expected = i64::from_be_bytes(digest[..8].try_into().unwrap());
        assert_eq!(advisory_key("fencelock:v1:", "nightly-invoices"), expected);
        assert_ne!(
            advisory_key("fencelock:v1:", "a"),
            advisory_key("fencelock:v1:", "b")
        );
        // Pinned: psql scripts and other clients rely on this value never changing.
        assert_eq!(advisory_key("fencelock:v1:", "job"), 2125831629337770132);
    }

    #[test]
    fn channel_names_are_plain_identifiers() {
        let c = channel_name("odd \"prefix\"; DROP TABLE x");
        assert!(c.len() < 63);
        assert!(c
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
    }
}
