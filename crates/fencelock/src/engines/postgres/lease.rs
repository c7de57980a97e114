//! Lease-table mode (`?mode=lease`): one row per resource with owner, token and an expiry by
//! the database's clock. Every operation is one statement in its own transaction, sent as an
//! unnamed statement, so no state lives in the session and a transaction pooler may hand each
//! statement to another server connection. Where no pooler stands in between, `?prepare=true`
//! prepares the acquire, extend and release statements once per connection instead, which
//! spares the server their planning on every call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Statement};

use super::Shared;
use crate::core::engine::{AcquireRequest, Attempt, Engine, Renewal, Renewed};
use crate::core::error::Result;
use crate::core::holder::{duration_from_millis, millis_of, unix_millis, Holder};
use crate::core::limits::{ttl_refused, Limits, StoredLimits};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::sql::{self, SqlRow, AUDIT_COLUMNS, HOLDER_COLUMNS};
use crate::core::token::FencingToken;

/// Checks the prefix's limits, then takes a free or expired row, or re-grants to the same
/// owner (keeping its token); a fresh grant advances the token. `refused` is -1 for a TTL
/// above `max-ttl` and, for a client holding `max-held-per-client` leases under the prefix,
/// the milliseconds until its first one expires (`fencelock_lease_quota`); the row is then left
/// alone. No token is returned when refused or when another owner's lease is live.
pub(super) const ACQUIRE: &str = "
WITH q AS MATERIALIZED (
    SELECT CASE WHEN lim.max_ttl_ms > 0 AND $3 > lim.max_ttl_ms THEN -1
                WHEN lim.max_held > 0 THEN fencelock_lease_quota($8, $9, $1, lim.max_held)
                ELSE 0 END AS refused,
           lim.max_ttl_ms, lim.max_held
    FROM (SELECT 1) AS one LEFT JOIN fencelock_limits lim ON lim.prefix = $8
),
g AS (
    INSERT INTO fencelock_leases AS l
        (key, token, owner, expires_at, ttl_ms, host, pid, client, acquired_at, renewed_at,
         holder_id)
    SELECT $1, 1, $2, clock_timestamp() + $3 * interval '1 millisecond', $3, $4, $5, $6, $7, $7,
           $9
    FROM q WHERE q.refused = 0
    ON CONFLICT (key) DO UPDATE SET
        token = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > clock_timestamp()
                     THEN l.token ELSE l.token + 1 END,
        acquired_at = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > clock_timestamp()
                     THEN l.acquired_at ELSE EXCLUDED.acquired_at END,
        owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at, ttl_ms = EXCLUDED.ttl_ms,
        host = EXCLUDED.host, pid = EXCLUDED.pid, client = EXCLUDED.client,
        renewed_at = EXCLUDED.renewed_at, holder_id = EXCLUDED.holder_id
    WHERE l.owner IS NULL OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp()
        OR l.owner = EXCLUDED.owner
    RETURNING token
)
SELECT (SELECT token FROM g), q.refused, q.max_ttl_ms, q.max_held FROM q";

/// What the parameters of [`ACQUIRE`] carry, in order.
pub(super) const ACQUIRE_PARAMS: &[&str] = &[
    "row",
    "owner",
    "ttl_ms",
    "host",
    "pid",
    "client",
    "acquired_at",
    "prefix",
    "holder_id",
];

/// The time a live lease has left (ms), read after the [`HOLDER_COLUMNS`] by [`holder_from`].
const TTL_LEFT: &str =
    "GREATEST(0, extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint";
const LIVE: &str = "owner IS NOT NULL AND expires_at > clock_timestamp()";

/// Renews many leases in one statement; returns the ones still held by their owner, and a
/// last row with the prefix's `max-ttl` when one is set: a renewal beyond it is refused.
const EXTEND: &str = "
WITH cap AS (SELECT max_ttl_ms FROM fencelock_limits WHERE prefix = $5 AND max_ttl_ms > 0),
u AS (
    UPDATE fencelock_leases l
    SET expires_at = clock_timestamp() + b.ttl * interval '1 millisecond', ttl_ms = b.ttl,
        renewed_at = $4
    FROM unnest($1::text[], $2::text[], $3::bigint[]) AS b(key, owner, ttl)
    WHERE l.key = b.key AND l.owner = b.owner AND l.expires_at > clock_timestamp()
      AND NOT EXISTS (SELECT 1 FROM cap WHERE b.ttl > cap.max_ttl_ms)
    RETURNING l.key, l.owner
)
SELECT key, owner, NULL::bigint FROM u
UNION ALL SELECT NULL, NULL, max_ttl_ms FROM cap";

/// Clears the owner (the row keeps the token) and, if the lease was live, wakes the waiters.
pub(super) const RELEASE: &str = "
WITH old AS (
    SELECT expires_at > clock_timestamp() AS live FROM fencelock_leases
    WHERE key = $1 AND owner = $2 FOR UPDATE
),
u AS (
    UPDATE fencelock_leases SET owner = NULL, expires_at = NULL
    WHERE key = $1 AND owner = $2 RETURNING 1
),
n AS (SELECT pg_notify($3, $4) FROM old WHERE old.live)
SELECT old.live, (SELECT count(*) FROM u), (SELECT count(*) FROM n) FROM old";

/// What the parameters of [`RELEASE`] carry, in order.
pub(super) const RELEASE_PARAMS: &[&str] = &["row", "owner", "channel", "name"];

/// Deletes the live lease (of the expected owner, if given), advances the token to the mark
/// and appends the audit record, in one statement. The old holder's row is copied into the
/// log as the table has it: [`HOLDER_COLUMNS`] are the audit record's holder columns.
fn force_sql() -> String {
    format!(
        "
WITH old AS (
    SELECT {HOLDER_COLUMNS}
    FROM fencelock_leases
    WHERE key = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()
      AND ($2::text IS NULL OR owner = $2)
    FOR UPDATE
),
u AS (
    UPDATE fencelock_leases l SET token = l.token + 1, owner = NULL, expires_at = NULL
    FROM old WHERE l.key = $1 RETURNING l.token
),
a AS (
    INSERT INTO fencelock_audit ({AUDIT_COLUMNS})
    SELECT $3, $1, $4, $5, $6, $7, $8, $9, old.*, (SELECT token FROM u)
    FROM old
    RETURNING counter
)
SELECT old.*, (SELECT counter FROM a) FROM old"
    )
}

pub(crate) struct LeaseEngine {
    shared: Shared,
    clients: Vec<tokio::sync::Mutex<Option<Arc<Conn>>>>,
    next: AtomicUsize,
    /// `?prepare=true`: the hot statements are prepared once per connection.
    prepare: bool,
}

/// One connection, and with `?prepare=true` its prepared statements: a connection made after
/// the old one closed (a server restart) prepares them again.
struct Conn {
    client: Client,
    prepared: Option<Prepared>,
}

struct Prepared {
    acquire: Statement,
    extend: Statement,
    release: Statement,
}

/// The statements that may be prepared, so that each call names its own.
#[derive(Clone, Copy)]
enum Hot {
    Acquire,
    Extend,
    Release,
}

impl Hot {
    fn sql(self) -> &'static str {
        match self {
            Hot::Acquire => ACQUIRE,
            Hot::Extend => EXTEND,
            Hot::Release => RELEASE,
        }
    }
}

impl LeaseEngine {
    pub(super) async fn open(
        shared: Shared,
        sessions: usize,
        first: Client,
        prepare: bool,
    ) -> Result<LeaseEngine> {
        let clients: Vec<_> = (0..sessions.max(1))
            .map(|_| tokio::sync::Mutex::new(None))
            .collect();
        let engine = LeaseEngine {
            shared,
            clients,
            next: AtomicUsize::new(0),
            prepare,
        };
        let first = engine.conn(first).await?;
        if let Ok(mut slot) = engine.clients[0].try_lock() {
            *slot = Some(Arc::new(first));
        }
        Ok(engine)
    }

    /// `client` with its statements prepared when the URL asks for it.
    async fn conn(&self, client: Client) -> Result<Conn> {
        let prepared = if self.prepare {
            let prepare = async {
                Ok::<_, tokio_postgres::Error>(Prepared {
                    acquire: client.prepare(ACQUIRE).await?,
                    extend: client.prepare(EXTEND).await?,
                    release: client.prepare(RELEASE).await?,
                })
            };
            Some(self.shared.bounded(prepare).await?)
        } else {
            None
        };
        Ok(Conn { client, prepared })
    }

    /// A live connection, round robin, reconnecting a closed one.
    async fn client(&self) -> Result<Arc<Conn>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.clients.len();
        self.client_at(i).await
    }

    /// The connection every grant and release of `name` goes through: statements on one
    /// connection run in the order they were sent, so the release that cleans up after a
    /// cancelled acquisition always runs after it, never overtakes it on another connection.
    async fn client_for(&self, name: &str) -> Result<Arc<Conn>> {
        let key = super::advisory_key(&self.shared.prefix, name) as u64;
        self.client_at((key % self.clients.len() as u64) as usize)
            .await
    }

    async fn client_at(&self, i: usize) -> Result<Arc<Conn>> {
        let mut slot = self.clients[i].lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.client.is_closed()) {
            return Ok(c.clone());
        }
        let c = Arc::new(self.conn(self.shared.connect().await?).await?);
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn query(&self, sql: &str, params: &[(&(dyn ToSql + Sync), Type)]) -> Result<Vec<Row>> {
        let conn = self.client().await?;
        self.shared
            .bounded(conn.client.query_typed(sql, params))
            .await
    }

    /// One of the statements `?prepare=true` prepares, on `conn`: the prepared one if it
    /// was, else unnamed with the parameters' types given.
    async fn hot(
        &self,
        conn: &Conn,
        which: Hot,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>> {
        let prepared = conn.prepared.as_ref().map(|p| match which {
            Hot::Acquire => &p.acquire,
            Hot::Extend => &p.extend,
            Hot::Release => &p.release,
        });
        match prepared {
            Some(statement) => {
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                self.shared
                    .bounded(conn.client.query(statement, &values))
                    .await
            }
            None => {
                self.shared
                    .bounded(conn.client.query_typed(which.sql(), params))
                    .await
            }
        }
    }

    fn read<T>(&self, r: std::result::Result<T, tokio_postgres::Error>) -> Result<T> {
        r.map_err(|e| self.shared.error("unexpected answer", e))
    }
}

/// Reads [`HOLDER_COLUMNS`] from column `at`, and [`TTL_LEFT`] after them when the row has it.
fn holder_from(r: &Row, at: usize) -> std::result::Result<Holder, tokio_postgres::Error> {
    let mut h = sql::holder_from(r, at)?;
    if r.len() > at + 8 {
        h.ttl_left = r.maybe_int(at + 8)?.map(duration_from_millis);
    }
    Ok(h)
}

#[async_trait]
impl Engine for LeaseEngine {
    fn kind(&self) -> &'static str {
        self.shared.kind
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        super::labelled_keys(super::url::PgMode::Lease, &self.shared.prefix, name)
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = self.shared.key(&req.name);
        let wake = req.waits.then(|| self.shared.subscribe(&req.name));
        let now = unix_millis(SystemTime::now());
        let conn = self.client_for(&req.name).await?;
        let rows = self
            .hot(
                &conn,
                Hot::Acquire,
                &[
                    (&key, Type::TEXT),
                    (&req.owner, Type::TEXT),
                    (&millis_of(req.ttl), Type::INT8),
                    (&req.meta.host, Type::TEXT),
                    (&i64::from(req.meta.pid), Type::INT8),
                    (&req.meta.client, Type::TEXT),
                    (&now, Type::INT8),
                    (&self.shared.prefix, Type::TEXT),
                    (&self.shared.holder_id, Type::TEXT),
                ],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Err(crate::core::error::Error::engine_failure(
                self.shared.kind,
                "the grant statement answered no row",
            ));
        };
        if let Some(token) = self.read(r.try_get::<_, Option<i64>>(0))? {
            return Ok(Attempt::Granted(FencingToken::from_stored(token)));
        }
        let refused: i64 = self.read(r.try_get(1))?;
        if refused != 0 {
            let limits = Limits::from_stored(
                self.read(r.try_get::<_, Option<i64>>(2))?.unwrap_or(0),
                self.read(r.try_get::<_, Option<i64>>(3))?.unwrap_or(0),
            );
            return match (refused < 0, limits.max_ttl(), limits.max_held_per_client()) {
                (true, Some(max), _) => Err(ttl_refused(max, req.ttl)
                    .with_resource(&req.name)
                    .with_engine(self.shared.kind)),
                (_, _, Some(max)) => Ok(Attempt::OverQuota {
                    max,
                    retry_in: u64::try_from(refused).ok().map(Duration::from_millis),
                }),
                _ => Err(crate::core::error::Error::engine_failure(
                    self.shared.kind,
                    "unexpected grant answer",
                )),
            };
        }
        self.shared.refused(&req.name);
        let holder = self.inspect(&req.name).await?;
        Ok(Attempt::Held {
            retry_in: holder.as_ref().and_then(|h| h.ttl_left),
            holder,
            wake: wake.map(Box::new),
        })
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let keys: Vec<String> = batch.iter().map(|r| self.shared.key(&r.name)).collect();
        let owners: Vec<String> = batch.iter().map(|r| r.owner.clone()).collect();
        let ttls: Vec<i64> = batch.iter().map(|r| millis_of(r.ttl)).collect();
        let now = unix_millis(SystemTime::now());
        let conn = self.client().await?;
        let rows = self
            .hot(
                &conn,
                Hot::Extend,
                &[
                    (&keys, Type::TEXT_ARRAY),
                    (&owners, Type::TEXT_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&now, Type::INT8),
                    (&self.shared.prefix, Type::TEXT),
                ],
            )
            .await?;
        let mut extended = std::collections::HashSet::with_capacity(rows.len());
        let mut cap = None;
        for r in &rows {
            match self.read(r.try_get::<_, Option<i64>>(2))? {
                Some(ms) => cap = u64::try_from(ms).ok().map(Duration::from_millis),
                None => {
                    let key: String = self.read(r.try_get(0))?;
                    let owner: String = self.read(r.try_get(1))?;
                    extended.insert((key, owner));
                }
            }
        }
        Ok(keys
            .into_iter()
            .zip(owners)
            .zip(batch)
            .map(|(pair, r)| match cap.filter(|max| r.ttl > *max) {
                Some(max) => Renewed::OverLimit(max),
                None if extended.contains(&pair) => Renewed::Extended,
                None => Renewed::NotHolder,
            })
            .collect())
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        let key = self.shared.key(name);
        let owner = owner.to_owned();
        let name = name.to_owned();
        let conn = self.client_for(&name).await?;
        let rows = self
            .hot(
                &conn,
                Hot::Release,
                &[
                    (&key, Type::TEXT),
                    (&owner, Type::TEXT),
                    (&self.shared.channel, Type::TEXT),
                    (&name, Type::TEXT),
                ],
            )
            .await?;
        match rows.first() {
            Some(r) => Ok(self.read(r.try_get::<_, Option<bool>>(0))?.unwrap_or(false)),
            None => Ok(false),
        }
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        let key = self.shared.key(name);
        let rows = self
            .query(
                &format!("SELECT {HOLDER_COLUMNS}, {TTL_LEFT} FROM fencelock_leases WHERE key = $1 AND {LIVE}"),
                &[(&key, Type::TEXT)],
            )
            .await?;
        rows.first()
            .map(|r| self.read(holder_from(r, 0)))
            .transpose()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let start = self.shared.key(prefix);
        let rows = self
            .query(
                &format!(
                    "SELECT key, {HOLDER_COLUMNS}, {TTL_LEFT} FROM fencelock_leases \
                     WHERE starts_with(key, $1) AND {LIVE}"
                ),
                &[(&start, Type::TEXT)],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let key: String = self.read(r.try_get(0))?;
                Ok(HeldLock::new(
                    self.shared.name_of(&key).to_owned(),
                    self.read(holder_from(r, 1))?,
                ))
            })
            .collect()
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let key = self.shared.key(name);
        let expected = expected_owner.map(str::to_owned);
        let at = unix_millis(draft.at);
        let rows = self
            .query(
                &force_sql(),
                &[
                    (&key, Type::TEXT),
                    (&expected, Type::TEXT),
                    (&draft.id, Type::TEXT),
                    (&at, Type::INT8),
                    (&draft.user, Type::TEXT),
                    (&draft.host, Type::TEXT),
                    (&draft.reason, Type::TEXT),
                    (&draft.holder_declared_dead, Type::BOOL),
                    (&draft.assessment, Type::TEXT),
                ],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let mut record = draft.clone();
        record.holder = self.read(holder_from(r, 0))?;
        // The log keeps what the holder recorded, not how long it had left.
        record.holder.ttl_left = None;
        record.counter = FencingToken::from_stored(self.read(r.try_get(8))?);
        Ok(Some(record))
    }

    async fn limits(&self) -> Result<Vec<StoredLimits>> {
        let conn = self.client().await?;
        self.shared.read_limits(&conn.client).await
    }

    async fn set_limits(&self, limits: &Limits) -> Result<()> {
        let conn = self.client().await?;
        self.shared.write_limits(&conn.client, limits).await
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let conn = self.client().await?;
        self.shared.audit(&conn.client, name).await
    }
}
