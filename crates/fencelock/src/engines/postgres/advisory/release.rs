//! The owner's release, through the session that holds the lock, and the undoing of a grant
//! whose answer was lost.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::session::{lock, Held, Op, Session};
use super::AdvisoryEngine;
use crate::core::error::Result;
use crate::engines::postgres::{advisory_key, bounded};

/// Unlocks and, only if this session held the lock, notifies the waiters.
pub(in crate::engines::postgres) const RELEASE: &str = "
WITH u AS MATERIALIZED (SELECT pg_advisory_unlock($1) AS ok)
SELECT u.ok, (SELECT count(*) FROM (SELECT pg_notify($2, $3) FROM u WHERE u.ok) n) FROM u";

/// What the parameters of [`RELEASE`] carry, in order.
pub(in crate::engines::postgres) const RELEASE_PARAMS: &[&str] = &["key", "channel", "name"];

/// Undoes a grant whose answer was lost (a timed-out or failed attempt). Unlocking a key the
/// session does not hold only raises a warning.
pub(super) const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

impl AdvisoryEngine {
    /// The owner's release, after the key's earlier statements.
    pub(super) async fn release_held(&self, name: &str, owner: &str) -> Result<bool> {
        let key = advisory_key(&self.shared.prefix, name);
        // The lock lives on the session that took it; if that one ended, so did the lock.
        let Some(session) = self.live_session(self.slot_of(key)).await else {
            return Ok(false);
        };
        self.release_on(&session, key, name, owner).await
    }

    /// The owner's release through `session`, after the key's earlier statements there.
    pub(super) async fn release_on(
        &self,
        session: &Arc<Session>,
        key: i64,
        name: &str,
        owner: &str,
    ) -> Result<bool> {
        let (reply, answer) = oneshot::channel();
        session
            .submit(Op::Release {
                key,
                owner: owner.to_owned(),
                channel: self.shared.channel.clone(),
                name: name.to_owned(),
                reply,
            })
            .await
            .map_err(|_| self.gone())?;
        answer.await.map_err(|_| self.gone())?
    }
}

pub(super) async fn release(
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
