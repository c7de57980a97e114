//! One grant: the lock and, only when granted, the next token, in one round trip; answered
//! locally when this process's session holds the key already.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::session::{lock, Held, Op, Session};
use super::AdvisoryEngine;
use crate::core::engine::{AcquireRequest, Attempt};
use crate::core::error::{Error, Result};
use crate::core::holder::{from_unix_millis, millis_of, unix_millis, Holder};
use crate::core::limits::{ttl_refused, Limits};
use crate::core::token::FencingToken;
use crate::engines::postgres::{advisory_key, bounded};

/// Checks the prefix's limits, tries the lock and, only when granted, advances the durable
/// counter: one round trip. Each step is a materialised CTE that reads the one before it, so
/// the lock function runs exactly once, and only when the limits let it: a TTL above
/// `max-ttl` (`refused` = -1) or a client holding `max-held-per-client` locks under the prefix
/// (`refused` > 0, counted by `fencelock_advisory_quota`) never reaches the lock.
pub(in crate::engines::postgres) const GRANT: &str = "
WITH q AS MATERIALIZED (
    SELECT CASE WHEN lim.max_ttl_ms > 0 AND $8 > lim.max_ttl_ms THEN -1
                WHEN lim.max_held > 0 THEN fencelock_advisory_quota($9, $10, $2, lim.max_held)
                ELSE 0 END AS refused,
           lim.max_ttl_ms, lim.max_held
    FROM (SELECT 1) AS one LEFT JOIN fencelock_limits lim ON lim.prefix = $9
),
l AS MATERIALIZED (SELECT pg_try_advisory_lock($1) AS ok FROM q WHERE q.refused = 0),
t AS (
    INSERT INTO fencelock_tokens AS t
        (key, lock_key, counter, owner, backend_pid, host, pid, client, acquired_at, ttl_ms,
         holder_id)
    SELECT $2, $1, 1, $3, pg_backend_pid(), $4, $5, $6, $7, $8, $10 FROM l WHERE l.ok
    ON CONFLICT (key) DO UPDATE SET
        counter = t.counter + 1, owner = EXCLUDED.owner, backend_pid = EXCLUDED.backend_pid,
        host = EXCLUDED.host, pid = EXCLUDED.pid, client = EXCLUDED.client,
        acquired_at = EXCLUDED.acquired_at, ttl_ms = EXCLUDED.ttl_ms,
        holder_id = EXCLUDED.holder_id
    RETURNING counter
)
SELECT (SELECT ok FROM l), (SELECT counter FROM t), q.refused, q.max_ttl_ms, q.max_held
FROM q";

/// What the parameters of [`GRANT`] carry, in order.
pub(in crate::engines::postgres) const GRANT_PARAMS: &[&str] = &[
    "key",
    "row",
    "owner",
    "host",
    "pid",
    "client",
    "acquired_at",
    "ttl_ms",
    "prefix",
    "holder_id",
];

impl AdvisoryEngine {
    /// One attempt, on the session of the key's slot, after the key's earlier statements.
    pub(super) async fn attempt(&self, req: &AcquireRequest) -> Result<Attempt> {
        let key = advisory_key(&self.shared.prefix, &req.name);
        // Subscribed before the attempt, so a release right after the refusal is not missed.
        let wake = req.waits.then(|| self.shared.subscribe(&req.name));
        let session = self.session(self.slot_of(key)).await?;
        let (reply, answer) = oneshot::channel();
        session
            .submit(Op::Acquire {
                key,
                row: self.shared.key(&req.name),
                req: req.clone(),
                reply,
            })
            .await
            .map_err(|_| self.gone())?;
        match answer.await.map_err(|_| self.gone())?? {
            Attempt::Held { holder, .. } => {
                self.shared.refused(&req.name);
                Ok(Attempt::Held {
                    holder,
                    retry_in: None,
                    wake: wake.map(Box::new),
                })
            }
            granted => Ok(granted),
        }
    }
}

pub(super) async fn grant(
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
                &s.prefix,
                &s.holder_id,
            ],
        ),
    )
    .await?;
    let unexpected = |e| Error::engine_failure(kind, "unexpected grant answer").with_source(e);
    let ok: Option<bool> = answer.try_get(0).map_err(unexpected)?;
    let refused: i64 = answer.try_get(2).map_err(unexpected)?;
    let mut held = lock(&s.held);
    if refused != 0 {
        held.remove(&key);
        let max_ttl: Option<i64> = answer.try_get(3).map_err(unexpected)?;
        let max_held: Option<i64> = answer.try_get(4).map_err(unexpected)?;
        let limits = Limits::from_stored(max_ttl.unwrap_or(0), max_held.unwrap_or(0));
        return match (refused < 0, limits.max_ttl(), limits.max_held_per_client()) {
            (true, Some(max), _) => Err(ttl_refused(max, req.ttl)
                .with_resource(&req.name)
                .with_engine(kind)),
            (_, _, Some(max)) => Ok(Attempt::OverQuota {
                max,
                retry_in: None,
            }),
            _ => Err(Error::engine_failure(kind, "unexpected grant answer")),
        };
    }
    if ok != Some(true) {
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
