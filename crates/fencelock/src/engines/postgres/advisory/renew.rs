//! Renewal, which for a lock without expiry on the server is a liveness check: one query per
//! session for all the leases on it. And the TTL the server does not have, enforced here: a
//! lease neither renewed nor released in time is unlocked by its session.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::time::Instant;

use super::session::{lock, Held, Op, Session};
use super::AdvisoryEngine;
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::Result;
use crate::engines::postgres::{advisory_key, bounded};

/// The advisory locks this session holds, and the prefix's `max-ttl` (ms) if one is set: a
/// renewal beyond it is refused, as the grant would be.
pub(super) const MINE: &str = "SELECT ARRAY(SELECT (classid::bigint << 32) | objid::bigint
    FROM pg_locks
    WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = pg_backend_pid()),
    (SELECT max_ttl_ms FROM fencelock_limits WHERE prefix = $1 AND max_ttl_ms > 0)";

impl AdvisoryEngine {
    /// Extends the leases of `batch` whose session still holds their key: one check per
    /// session, however many leases it carries.
    pub(super) async fn renew(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
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
                .bounded(s.client.query_one(&s.mine, &[&s.prefix]))
                .await
                .map(|row| {
                    let keys: Vec<i64> = row.try_get(0).unwrap_or_default();
                    let cap: Option<i64> = row.try_get(1).unwrap_or(None);
                    (keys.into_iter().collect::<HashSet<i64>>(), cap)
                });
            (members, Some((s, held)))
        });
        let mut out = vec![Renewed::NotHolder; batch.len()];
        for (members, check) in join_all(checks).await {
            let Some((s, held_on_server)) = check else {
                continue;
            };
            let (on_server, cap) = match held_on_server {
                Ok(answer) => answer,
                Err(e) => {
                    for i in members {
                        out[i] = Renewed::Failed(e.to_string());
                    }
                    continue;
                }
            };
            let mut mine = lock(&s.held);
            let cap = cap
                .and_then(|ms| u64::try_from(ms).ok())
                .map(Duration::from_millis);
            for i in members {
                if let Some(max) = cap.filter(|max| batch[i].ttl > *max) {
                    out[i] = Renewed::OverLimit(max);
                    continue;
                }
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
}

/// How often a session looks for leases past their TTL.
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// Takes the leases of this session whose TTL passed without renewal or release (and that no
/// statement is working on), marking them pending until their unlock is confirmed and their
/// keys busy until it finished.
pub(super) fn take_expired(
    s: &Session,
    busy: &mut HashMap<i64, VecDeque<Op>>,
) -> (Vec<i64>, Vec<String>) {
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
                busy.insert(k, VecDeque::new());
                Some((k, name))
            }
            _ => None,
        })
        .unzip()
}

/// Unlocks expired leases and wakes their waiters: one statement for all of them.
pub(super) async fn unlock_expired(
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
