//! Advisory mode: session advisory locks on a few pooled sessions. See the module docs of
//! [`super`] for the design.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use async_trait::async_trait;
use futures_util::future::{join_all, BoxFuture};
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use super::{advisory_key, bounded, insert_audit, Shared};
use crate::core::engine::{AcquireRequest, Attempt, Engine, LossFeed, Renewal, Renewed};
use crate::core::error::{Error, Result};
use crate::core::holder::{duration_from_millis, from_unix_millis, millis_of, unix_millis, Holder};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::token::FencingToken;

/// Tries the lock and, only when granted, advances the durable counter: one round trip. The
/// lock CTE is materialised, so the lock function runs exactly once.
const GRANT: &str = "
WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok),
t AS (
    INSERT INTO fencelock_tokens AS t
        (key, lock_key, counter, owner, backend_pid, host, pid, client, acquired_at, ttl_ms)
    SELECT $2, $1, 1, $3, pg_backend_pid(), $4, $5, $6, $7, $8 FROM l WHERE l.ok
    ON CONFLICT (key) DO UPDATE SET
        counter = t.counter + 1, owner = EXCLUDED.owner, backend_pid = EXCLUDED.backend_pid,
        host = EXCLUDED.host, pid = EXCLUDED.pid, client = EXCLUDED.client,
        acquired_at = EXCLUDED.acquired_at, ttl_ms = EXCLUDED.ttl_ms
    RETURNING counter
)
SELECT l.ok, (SELECT counter FROM t) FROM l";

/// Unlocks and, only if this session held the lock, notifies the waiters.
const RELEASE: &str = "
WITH u AS MATERIALIZED (SELECT pg_advisory_unlock($1) AS ok)
SELECT u.ok, (SELECT count(*) FROM (SELECT pg_notify($2, $3) FROM u WHERE u.ok) n) FROM u";

/// Undoes a grant whose answer was lost (a timed-out or failed attempt). Unlocking a key the
/// session does not hold only raises a warning.
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// The advisory locks this session holds.
const MINE: &str = "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = pg_backend_pid()";

/// Who holds one key, as `holder_of` reads it: the backend, and fencelock's row when that
/// backend is the one that took it through fencelock.
const HOLDER_COLUMNS: &str = "l.pid, t.owner, t.counter, t.host, t.pid, t.client, t.acquired_at, \
     t.ttl_ms, t.backend_pid, a.application_name, host(a.client_addr)";
const ADVISORY_HELD: &str = "l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted \
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())";
const LOCK_KEY: &str = "((l.classid::bigint << 32) | l.objid::bigint)";

pub(crate) struct AdvisoryEngine {
    shared: Shared,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Session>>>>,
    loss_tx: mpsc::UnboundedSender<String>,
}

/// What this process knows a session holds, per advisory key.
enum Held {
    /// An attempt whose answer never came: the session may or may not hold the key. Nobody
    /// was handed a lease for it, so the next attempt unlocks it first.
    Pending,
    Granted {
        owner: String,
        name: String,
        holder: Box<Holder>,
        /// The TTL enforced here, since the server has none: a lease neither renewed nor
        /// released by then (dropped, or its process's renewals stalled) is unlocked.
        expires: Instant,
    },
}

struct Session {
    client: Client,
    grant: Statement,
    release: Statement,
    unlock: Statement,
    mine: Statement,
    held: Arc<Mutex<HashMap<i64, Held>>>,
    ended: CancellationToken,
    ops: mpsc::UnboundedSender<Op>,
}

enum Op {
    Acquire {
        key: i64,
        row: String,
        req: AcquireRequest,
        reply: oneshot::Sender<Result<Attempt>>,
    },
    Release {
        key: i64,
        owner: String,
        channel: String,
        name: String,
        reply: oneshot::Sender<Result<bool>>,
    },
}

fn lock(held: &Mutex<HashMap<i64, Held>>) -> MutexGuard<'_, HashMap<i64, Held>> {
    held.lock().unwrap_or_else(|p| p.into_inner())
}

impl AdvisoryEngine {
    /// The engine and its feed of leases lost with a session that ended.
    pub(super) fn new(shared: Shared, sessions: usize) -> (AdvisoryEngine, LossFeed) {
        let (loss_tx, loss_rx) = mpsc::unbounded_channel();
        let engine = AdvisoryEngine {
            shared,
            slots: (0..sessions.max(1))
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            loss_tx,
        };
        (engine, loss_rx)
    }

    fn slot_of(&self, key: i64) -> usize {
        // Every lease of one resource uses the same session, so re-entrance is seen locally.
        (key as u64 % self.slots.len() as u64) as usize
    }

    /// The slot's live session, connecting one if there is none.
    async fn session(&self, slot: usize) -> Result<Arc<Session>> {
        let mut current = self.slots[slot].lock().await;
        if let Some(s) = current.as_ref().filter(|s| !s.ended.is_cancelled()) {
            return Ok(s.clone());
        }
        let s = self.open_session().await?;
        *current = Some(s.clone());
        Ok(s)
    }

    /// The slot's session if it is alive; never connects (a new session holds nothing).
    async fn live_session(&self, slot: usize) -> Option<Arc<Session>> {
        let current = self.slots[slot].lock().await;
        current
            .as_ref()
            .filter(|s| !s.ended.is_cancelled())
            .cloned()
    }

    async fn any_session(&self) -> Result<Arc<Session>> {
        for slot in 0..self.slots.len() {
            if let Some(s) = self.live_session(slot).await {
                return Ok(s);
            }
        }
        self.session(0).await
    }

    async fn open_session(&self) -> Result<Arc<Session>> {
        let held: Arc<Mutex<HashMap<i64, Held>>> = Arc::default();
        let ended = CancellationToken::new();
        let (h, e, losses) = (held.clone(), ended.clone(), self.loss_tx.clone());
        let client = self
            .shared
            .connect_with(move || {
                // Cancelled before the map is drained: a grant recorded after the drain sees
                // the session ended and is withdrawn (see `grant`).
                e.cancel();
                let drained = std::mem::take(&mut *lock(&h));
                for held in drained.into_values() {
                    if let Held::Granted { owner, .. } = held {
                        let _ = losses.send(owner);
                    }
                }
            })
            .await?;
        let prepare = async {
            Ok::<_, tokio_postgres::Error>((
                client.prepare(GRANT).await?,
                client.prepare(RELEASE).await?,
                client.prepare(UNLOCK).await?,
                client.prepare(MINE).await?,
            ))
        };
        let (grant, release, unlock, mine) = self.shared.bounded(prepare).await?;
        let (ops, queue) = mpsc::unbounded_channel();
        let session = Arc::new(Session {
            client,
            grant,
            release,
            unlock,
            mine,
            held,
            ended,
            ops,
        });
        tokio::spawn(work(
            session.clone(),
            queue,
            self.shared.channel.clone(),
            self.shared.shutdown.clone(),
            self.shared.kind,
            self.shared.op_timeout,
        ));
        Ok(session)
    }

    fn gone(&self) -> Error {
        Error::engine_failure(
            self.shared.kind,
            "the PostgreSQL session ended before answering (server restarted or unreachable?)",
        )
    }

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

/// Runs one session's grants and releases: those of different keys concurrently (pipelined
/// on the connection), those of one key one after another in the order they were asked, and
/// whether or not the caller still waits for the answer.
async fn work(
    s: Arc<Session>,
    mut queue: mpsc::UnboundedReceiver<Op>,
    channel: String,
    shutdown: CancellationToken,
    kind: &'static str,
    limit: Duration,
) {
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Keys with a statement in flight, and what waits behind it.
    let mut busy: HashMap<i64, VecDeque<Op>> = HashMap::new();
    let mut running: FuturesUnordered<BoxFuture<'static, Vec<i64>>> = FuturesUnordered::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = s.ended.cancelled() => return,
            _ = sweep.tick() => {
                let (keys, names) = take_expired(&s, &busy);
                if !keys.is_empty() {
                    for k in &keys {
                        busy.insert(*k, VecDeque::new());
                    }
                    let (s, channel) = (s.clone(), channel.clone());
                    running.push(Box::pin(async move {
                        unlock_expired(&s, keys, names, &channel, kind, limit).await
                    }));
                }
            }
            op = queue.recv() => {
                let Some(op) = op else { return };
                let key = op.key();
                match busy.get_mut(&key) {
                    Some(behind) => behind.push_back(op),
                    None => {
                        busy.insert(key, VecDeque::new());
                        running.push(run(s.clone(), op, kind, limit));
                    }
                }
            }
            Some(done) = running.next(), if !running.is_empty() => {
                for key in done {
                    let next = busy.get_mut(&key).and_then(VecDeque::pop_front);
                    match next {
                        Some(op) => running.push(run(s.clone(), op, kind, limit)),
                        None => {
                            busy.remove(&key);
                        }
                    }
                }
            }
        }
    }
}

impl Op {
    fn key(&self) -> i64 {
        match self {
            Op::Acquire { key, .. } | Op::Release { key, .. } => *key,
        }
    }
}

/// One grant or release; resolves to the key it concerned.
fn run(
    s: Arc<Session>,
    op: Op,
    kind: &'static str,
    limit: Duration,
) -> BoxFuture<'static, Vec<i64>> {
    Box::pin(async move {
        match op {
            Op::Acquire {
                key,
                row,
                req,
                reply,
            } => {
                let _ = reply.send(grant(&s, key, &row, &req, kind, limit).await);
                vec![key]
            }
            Op::Release {
                key,
                owner,
                channel,
                name,
                reply,
            } => {
                let _ = reply.send(release(&s, key, &owner, &channel, &name, kind, limit).await);
                vec![key]
            }
        }
    })
}

/// How often a session looks for leases past their TTL.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// Takes the leases of this session whose TTL passed without renewal or release (and that no
/// statement is working on), marking them pending until their unlock is confirmed.
fn take_expired(s: &Session, busy: &HashMap<i64, VecDeque<Op>>) -> (Vec<i64>, Vec<String>) {
    let now = Instant::now();
    let mut held = lock(&s.held);
    let expired: Vec<i64> = held
        .iter()
        .filter(|(k, h)| {
            !busy.contains_key(k) && matches!(h, Held::Granted { expires, .. } if *expires <= now)
        })
        .map(|(k, _)| *k)
        .collect();
    expired
        .into_iter()
        .filter_map(|k| match held.remove(&k) {
            Some(Held::Granted { name, .. }) => {
                held.insert(k, Held::Pending);
                Some((k, name))
            }
            _ => None,
        })
        .unzip()
}

/// Unlocks expired leases and wakes their waiters: one statement for all of them.
async fn unlock_expired(
    s: &Session,
    keys: Vec<i64>,
    names: Vec<String>,
    channel: &str,
    kind: &'static str,
    limit: Duration,
) -> Vec<i64> {
    let answer = bounded(
        kind,
        limit,
        s.client.query(
            "SELECT count(*) FROM (SELECT pg_advisory_unlock(k), pg_notify($2, n) \
             FROM unnest($1::bigint[], $3::text[]) AS x(k, n)) done",
            &[&keys, &channel, &names],
        ),
    )
    .await;
    match answer {
        Ok(_) => {
            let mut held = lock(&s.held);
            for k in &keys {
                if matches!(held.get(k), Some(Held::Pending)) {
                    held.remove(k);
                }
            }
        }
        // Left pending: the next attempt on each key unlocks it first.
        Err(e) => tracing::debug!(error = %e, "unlocking expired advisory leases failed"),
    }
    keys
}

async fn grant(
    s: &Session,
    key: i64,
    row: &str,
    req: &AcquireRequest,
    kind: &'static str,
    limit: Duration,
) -> Result<Attempt> {
    let unsure = {
        let mut held = lock(&s.held);
        match held.get(&key) {
            Some(Held::Granted { owner, holder, .. }) => {
                // The session holds it already: asking the server again would succeed
                // (advisory locks are re-entrant), so the answer is given here.
                return Ok(if *owner == req.owner {
                    Attempt::Granted(holder.token.unwrap_or(FencingToken::new(0)))
                } else {
                    Attempt::Held {
                        holder: Some(Holder::clone(holder)),
                        retry_in: None,
                        wake: None,
                    }
                });
            }
            Some(Held::Pending) => true,
            None => {
                held.insert(key, Held::Pending);
                false
            }
        }
    };
    if unsure {
        bounded(kind, limit, s.client.query(&s.unlock, &[&key])).await?;
    }
    let meta = &req.meta;
    let started = Instant::now();
    let acquired_at = unix_millis(std::time::SystemTime::now());
    let answer = bounded(
        kind,
        limit,
        s.client.query_one(
            &s.grant,
            &[
                &key,
                &row,
                &req.owner,
                &meta.host,
                &i64::from(meta.pid),
                &meta.client,
                &acquired_at,
                &millis_of(req.ttl),
            ],
        ),
    )
    .await?;
    let ok: bool = answer
        .try_get(0)
        .map_err(|e| Error::engine_failure(kind, "unexpected grant answer").with_source(e))?;
    let mut held = lock(&s.held);
    if !ok {
        held.remove(&key);
        return Ok(Attempt::Held {
            holder: None,
            retry_in: None,
            wake: None,
        });
    }
    let counter: Option<i64> = answer.try_get(1).unwrap_or(None);
    let token = FencingToken::from_stored(counter.unwrap_or(0));
    if s.ended.is_cancelled() {
        // The session ended after the server granted: the lock is gone with it.
        held.remove(&key);
        return Err(Error::engine_failure(
            kind,
            "the PostgreSQL session ended right after the grant",
        ));
    }
    let mut holder = Holder::bare(req.owner.clone());
    holder.token = Some(token);
    holder.host = Some(meta.host.clone());
    holder.pid = Some(meta.pid);
    holder.client = Some(meta.client.clone());
    holder.acquired_at = Some(from_unix_millis(acquired_at));
    holder.ttl = Some(req.ttl);
    held.insert(
        key,
        Held::Granted {
            owner: req.owner.clone(),
            name: req.name.clone(),
            holder: Box::new(holder),
            expires: started + req.ttl,
        },
    );
    Ok(Attempt::Granted(token))
}

async fn release(
    s: &Session,
    key: i64,
    owner: &str,
    channel: &str,
    name: &str,
    kind: &'static str,
    limit: Duration,
) -> Result<bool> {
    let pending = match lock(&s.held).get(&key) {
        Some(Held::Granted { owner: o, .. }) if o == owner => false,
        Some(Held::Pending) => true,
        _ => return Ok(false),
    };
    if pending {
        // An attempt whose answer was lost (this owner's, typically, cancelled mid-flight):
        // no lease was handed out for it, so whatever the session holds is undone now rather
        // than at the next attempt on this key, which may never come.
        bounded(kind, limit, s.client.query(&s.unlock, &[&key])).await?;
        let mut held = lock(&s.held);
        if matches!(held.get(&key), Some(Held::Pending)) {
            held.remove(&key);
        }
        return Ok(false);
    }
    let answer = bounded(
        kind,
        limit,
        s.client.query_one(&s.release, &[&key, &channel, &name]),
    )
    .await;
    let mut held = lock(&s.held);
    match answer {
        Ok(row) => {
            held.remove(&key);
            Ok(row.try_get::<_, bool>(0).unwrap_or(false))
        }
        Err(e) => {
            // Unknown whether it was unlocked: nobody holds a lease on it any more, so the
            // next attempt unlocks it again before asking.
            held.insert(key, Held::Pending);
            Err(e)
        }
    }
}

#[async_trait]
impl Engine for AdvisoryEngine {
    fn kind(&self) -> &'static str {
        self.shared.kind
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        vec![
            (
                "advisory",
                advisory_key(&self.shared.prefix, name).to_string(),
            ),
            (
                "token row",
                format!("fencelock_tokens.key = {}", self.shared.key(name)),
            ),
        ]
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = advisory_key(&self.shared.prefix, &req.name);
        // Subscribed before the attempt, so a release right after the refusal is not missed.
        let wake = self.shared.subscribe(&req.name);
        let session = self.session(self.slot_of(key)).await?;
        let (reply, answer) = oneshot::channel();
        session
            .ops
            .send(Op::Acquire {
                key,
                row: self.shared.key(&req.name),
                req: req.clone(),
                reply,
            })
            .map_err(|_| self.gone())?;
        match answer.await.map_err(|_| self.gone())?? {
            Attempt::Held { holder, .. } => Ok(Attempt::Held {
                holder,
                retry_in: None,
                wake: Some(wake),
            }),
            granted => Ok(granted),
        }
    }

    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let started = Instant::now();
        let mut by_slot: HashMap<usize, Vec<usize>> = HashMap::new();
        let keys: Vec<i64> = batch
            .iter()
            .map(|r| advisory_key(&self.shared.prefix, &r.name))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            by_slot.entry(self.slot_of(*key)).or_default().push(i);
        }
        let checks = by_slot.into_iter().map(|(slot, members)| async move {
            let Some(s) = self.live_session(slot).await else {
                return (members, None);
            };
            let held = self
                .shared
                .bounded(s.client.query(&s.mine, &[]))
                .await
                .map(|rows| {
                    rows.iter()
                        .filter_map(|r| r.try_get::<_, i64>(0).ok())
                        .collect::<HashSet<i64>>()
                });
            (members, Some((s, held)))
        });
        let mut out = vec![Renewed::NotHolder; batch.len()];
        for (members, check) in join_all(checks).await {
            let Some((s, held_on_server)) = check else {
                continue;
            };
            let on_server = match held_on_server {
                Ok(on_server) => on_server,
                Err(e) => {
                    for i in members {
                        out[i] = Renewed::Failed(e.to_string());
                    }
                    continue;
                }
            };
            let mut mine = lock(&s.held);
            for i in members {
                if let Some(Held::Granted { owner, expires, .. }) = mine.get_mut(&keys[i]) {
                    if *owner == batch[i].owner
                        && on_server.contains(&keys[i])
                        && !s.ended.is_cancelled()
                    {
                        *expires = (started + batch[i].ttl).max(*expires);
                        out[i] = Renewed::Extended;
                    }
                }
            }
        }
        Ok(out)
    }

    async fn release(&self, name: &str, owner: &str) -> Result<bool> {
        let key = advisory_key(&self.shared.prefix, name);
        // The lock lives on the session that took it; if that one ended, so did the lock.
        let Some(session) = self.live_session(self.slot_of(key)).await else {
            return Ok(false);
        };
        let (reply, answer) = oneshot::channel();
        session
            .ops
            .send(Op::Release {
                key,
                owner: owner.to_owned(),
                channel: self.shared.channel.clone(),
                name: name.to_owned(),
                reply,
            })
            .map_err(|_| self.gone())?;
        answer.await.map_err(|_| self.gone())?
    }

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        let s = self.any_session().await?;
        let key = advisory_key(&self.shared.prefix, name);
        self.holder_of(&s.client, key, &self.shared.key(name)).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
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
                Ok(HeldLock {
                    resource: self.shared.name_of(&key).to_owned(),
                    holder: holder_from(r, 1)?,
                })
            };
            out.push(read().map_err(|e| self.shared.error("listing locks", e))?);
        }
        Ok(out)
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let key = advisory_key(&self.shared.prefix, name);
        let row = self.shared.key(name);
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
            insert_audit(&tx, &row, &record).await?;
            // Waits up to 5 s for the backend to exit, so the lock is free on return.
            let ended: bool = tx
                .query_one("SELECT pg_terminate_backend($1, 5000)", &[&pid])
                .await?
                .try_get(0)?;
            if ended {
                tx.commit().await?;
            }
            Ok::<_, tokio_postgres::Error>(Some((ended, record)))
        };
        let limit = self.shared.op_timeout + Duration::from_secs(5);
        let (ended, record) = match tokio::time::timeout(limit, steps).await {
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
        if !ended {
            return Err(Error::engine_failure(
                self.shared.kind,
                "the holder's PostgreSQL backend did not exit within 5 s; nothing was released",
            ));
        }
        Ok(Some(record))
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let s = self.any_session().await?;
        self.shared.audit(&s.client, name).await
    }
}
