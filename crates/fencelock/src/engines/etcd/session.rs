//! Sessions: one etcd lease per client and TTL, shared by every key the client creates, as
//! etcd's `concurrency.Session` is shared by the mutexes built on it.
//!
//! - **One session per TTL**: the keys of all acquisitions whose TTLs round *up* to the same
//!   whole number of seconds (etcd's unit) hang on one lease, granted lazily by the first of
//!   them and reused after. One per TTL rather than one per client keeps each lock's expiry
//!   on the server what its TTL says: a session of the longest TTL would let a dead holder's
//!   short lock outlive its TTL, one of the shortest would need renewals at the shortest
//!   cadence for every lease. An uncontended acquisition is then one transaction and its
//!   release one delete: two raft writes, where a lease per acquisition added a grant and a
//!   revocation.
//! - **Two acquisitions of one name**: the key of a session on a name is
//!   `<lock prefix>/<lease id hex>` (as `etcdctl lock` writes it), so one session can queue
//!   only once on a name. A second concurrent acquisition of the same name by this client
//!   takes a second session of its TTL (granted then, reused after), and queues behind the
//!   first in etcd's FIFO order like any other waiter.
//! - **Validity**: a session's lease expires on the server no earlier than its granted TTL
//!   after the last grant or keep-alive etcd confirmed (counted from when it was sent). A
//!   grant on a reused session counts its validity from that confirmation, less what the
//!   granted TTL has over the lease's, so the holder never trusts a key longer than etcd keeps
//!   it; a session last confirmed more than a third of the TTL ago is kept alive first (a
//!   keep-alive is answered by the leader, not a raft write).
//! - **Loss**: a session whose keep-alive says it is gone, while none of its keys is left, or
//!   that went unconfirmed for its whole TTL, is lost with every lease on it at once: they are
//!   reported on the engine's loss feed and the next acquisition grants a new session.
//!   A session whose keys may hold one whose creation went unanswered is *retired*: it takes
//!   no new key and is revoked once its last lease ends, which removes that key too.

use std::collections::HashMap;
use std::sync::MutexGuard;
use std::time::Duration;

use tokio::time::Instant;

use super::call::{etcd_error, retrying, tries};
use super::hold::{Hold, Kept};
use super::{EtcdEngine, KIND};
use crate::core::error::{Error, Result};
use crate::core::options::renew_interval;

/// One shared etcd lease.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) id: i64,
    /// The TTL asked for, in whole seconds: which acquisitions share this session.
    secs: i64,
    /// The TTL etcd granted (its minimum may raise it above `secs`).
    granted: Duration,
    /// When the last grant or keep-alive etcd confirmed was sent.
    confirmed: Instant,
    /// Takes no new key; revoked once it holds none.
    retired: bool,
}

impl Session {
    /// Whether etcd may have expired it already: unconfirmed for its whole TTL.
    fn may_be_gone(&self, now: Instant) -> bool {
        now >= self.confirmed + self.granted
    }
}

/// The sessions of the client and the keys on them, under one lock so that picking a session
/// for a name and claiming its key on that name are one step.
#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) sessions: Vec<Session>,
    /// Every queued or held acquisition, by owner value.
    pub(super) holds: HashMap<String, Hold>,
}

/// The whole seconds etcd is asked for: the TTL rounded up, at least 1.
pub(super) fn ttl_secs(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// Grants, kept alive or revoked more than this many times in one acquisition means etcd keeps
/// losing the sessions as fast as they are granted.
const MAX_SESSION_TRIES: usize = 8;

impl EtcdEngine {
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Picks (granting or keeping alive as needed) a session for `owner`'s acquisition of
    /// `name` and claims its key there. Returns the session's id and the key.
    pub(super) async fn session_for(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<(i64, String)> {
        let secs = ttl_secs(ttl);
        for _ in 0..MAX_SESSION_TRIES {
            let picked = self.pick(name, owner, secs, ttl);
            if let Some((id, key, fresh)) = picked {
                if fresh {
                    return Ok((id, key));
                }
                let sent = Instant::now();
                match self.keep_alive(id).await {
                    Ok(()) => {
                        self.confirm(id, sent);
                        return Ok((id, key));
                    }
                    Err(e) => {
                        self.forget_hold(owner);
                        if lease_gone(&e)
                            && self.session_gone_or_lagging(id, String::new()).await == Kept::Lost
                        {
                            continue;
                        }
                        return Err(etcd_error("keep the session alive", e));
                    }
                }
            }
            // Grants are made one at a time: acquisitions that start together share the first.
            let _one = self.granting.lock().await;
            if self.has_session_for(name, secs) {
                continue;
            }
            self.grant(secs).await?;
        }
        Err(Error::engine_failure(
            KIND,
            "etcd lost the client's session lease as fast as it was granted",
        )
        .with_resource(name))
    }

    /// Claims for `owner` the key on `name` of the first usable session of `secs`; also whether
    /// that session is fresh enough to use without a keep-alive.
    fn pick(
        &self,
        name: &str,
        owner: &str,
        secs: i64,
        ttl: Duration,
    ) -> Option<(i64, String, bool)> {
        let now = Instant::now();
        let mut st = self.state();
        let gone: Vec<i64> = st
            .sessions
            .iter()
            .filter(|s| s.may_be_gone(now))
            .map(|s| s.id)
            .collect();
        for id in gone {
            self.end_session(&mut st, id);
        }
        let id = usable(&st, name, secs)?;
        let s = st.sessions.iter().find(|s| s.id == id)?;
        let fresh = now.saturating_duration_since(s.confirmed) <= renew_interval(ttl);
        let key = self.keys.waiter(name, id);
        st.holds
            .insert(owner.to_owned(), Hold::picked(name, id, key.clone()));
        Some((id, key, fresh))
    }

    fn has_session_for(&self, name: &str, secs: i64) -> bool {
        usable(&self.state(), name, secs).is_some()
    }

    /// Grants a new session of `secs` seconds.
    async fn grant(&self, secs: i64) -> Result<()> {
        // The id is chosen by the client (etcd accepts any unused positive id), so a key name
        // is known before its session is granted.
        let id = (rand::random::<u64>() >> 2) as i64 | 1;
        let opts = etcd_client::LeaseGrantOptions::new().with_id(id);
        let sent = Instant::now();
        let resp = self
            .bounded("grant the session lease", |mut c| {
                let opts = opts.clone();
                async move { c.lease_grant(secs, Some(opts)).await }
            })
            .await?;
        let granted = u64::try_from(resp.ttl().max(secs)).unwrap_or(1);
        self.state().sessions.push(Session {
            id,
            secs,
            granted: Duration::from_secs(granted),
            confirmed: sent,
            retired: false,
        });
        Ok(())
    }

    /// Records a keep-alive of session `id` sent at `sent` and confirmed.
    pub(super) fn confirm(&self, id: i64, sent: Instant) {
        if let Some(s) = self.state().sessions.iter_mut().find(|s| s.id == id) {
            s.confirmed = s.confirmed.max(sent);
        }
    }

    /// The instant a grant of a lease of `ttl` on session `id` counts its validity from: its
    /// last confirmation, less what the granted TTL has over `ttl`, and never later than now.
    /// `None` once the session is no longer the client's.
    pub(super) fn valid_since(&self, id: i64, ttl: Duration) -> Option<Instant> {
        let st = self.state();
        let s = st.sessions.iter().find(|s| s.id == id)?;
        Some((s.confirmed + s.granted.saturating_sub(ttl)).min(Instant::now()))
    }

    /// One keep-alive round trip for session `id`.
    pub(super) async fn keep_alive(&self, id: i64) -> std::result::Result<(), etcd_client::Error> {
        tries(&self.client, self.op_timeout, |mut c| async move {
            c.lease_keep_alive(id).await
        })
        .await
        .map(|_| ())
        .map_err(|e| {
            e.unwrap_or_else(|| {
                etcd_client::Error::LeaseKeepAliveError("no answer in time".to_owned())
            })
        })
    }

    /// Session `id` is gone: every lease on it is lost, reported at once.
    pub(super) fn session_lost(&self, id: i64) {
        let mut st = self.state();
        self.end_session(&mut st, id);
    }

    /// Forgets session `id` and reports every lease queued or held on it lost; the session is
    /// revoked in the background in case etcd still has it, so its keys go now.
    fn end_session(&self, st: &mut State, id: i64) {
        let Some(at) = st.sessions.iter().position(|s| s.id == id) else {
            return;
        };
        st.sessions.swap_remove(at);
        let lost: Vec<String> = st
            .holds
            .iter()
            .filter(|(_, h)| h.session == id && !h.enqueuing())
            .map(|(o, _)| o.clone())
            .collect();
        // A session with no key left on it expired or is about to: revoking it frees nothing.
        let had_keys = st.holds.values().any(|h| h.session == id);
        for owner in lost {
            st.holds.remove(&owner);
            let _ = self.losses.send(owner);
        }
        if had_keys {
            self.revoke_in_background(id);
        }
    }

    /// Stops session `id` from taking new keys: a key on it may appear whose creation went
    /// unanswered. It is revoked when its last lease ends.
    pub(super) fn retire(&self, id: i64) {
        let mut st = self.state();
        if let Some(s) = st.sessions.iter_mut().find(|s| s.id == id) {
            s.retired = true;
        }
        self.revoke_if_done(&mut st, id);
    }

    /// Removes `owner`'s acquisition, revoking its session if that was retired and is now empty.
    pub(super) fn forget_hold(&self, owner: &str) {
        let mut st = self.state();
        if let Some(h) = st.holds.remove(owner) {
            self.revoke_if_done(&mut st, h.session);
        }
    }

    fn revoke_if_done(&self, st: &mut State, id: i64) {
        let retired = st.sessions.iter().any(|s| s.id == id && s.retired);
        if retired && !st.holds.values().any(|h| h.session == id) {
            st.sessions.retain(|s| s.id != id);
            self.revoke_in_background(id);
        }
    }

    fn revoke_in_background(&self, id: i64) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (client, limit, endpoints) =
            (self.client.clone(), self.op_timeout, self.endpoints.clone());
        rt.spawn(async move {
            let revoked = retrying(
                &client,
                &endpoints,
                limit,
                "revoke the session lease",
                |mut c| async move { c.lease_revoke(id).await },
            );
            match revoked.await {
                Ok(_) => {}
                Err(e) if lease_gone(&e) => {}
                Err(e) => tracing::debug!(error = %e, "lease revoke failed; it expires on its own"),
            }
        });
    }

    /// Keeps a queued acquisition's session alive every TTL/3 while it waits (the watchdog
    /// renews held leases only). Returns the error that ended it: the session is gone, or no
    /// keep-alive was confirmed for a whole TTL.
    pub(super) async fn keep_queued_alive(&self, id: i64, ttl: Duration) -> Error {
        let mut confirmed = Instant::now();
        loop {
            tokio::time::sleep(renew_interval(ttl)).await;
            let sent = Instant::now();
            match self.keep_alive(id).await {
                Ok(()) => {
                    self.confirm(id, sent);
                    confirmed = sent;
                }
                Err(e)
                    if lease_gone(&e)
                        && self.session_gone_or_lagging(id, String::new()).await == Kept::Lost =>
                {
                    return session_expired();
                }
                Err(e) if confirmed.elapsed() >= ttl => {
                    return etcd_error("keep the session alive", e)
                }
                Err(_) => {}
            }
        }
    }
}

/// The first session of `secs` that takes new keys and has none on `name`.
fn usable(st: &State, name: &str, secs: i64) -> Option<i64> {
    st.sessions
        .iter()
        .filter(|s| s.secs == secs && !s.retired)
        .find(|s| {
            !st.holds
                .values()
                .any(|h| h.session == s.id && h.name == name)
        })
        .map(|s| s.id)
}

/// Whether an error says the lease does not exist (expired or revoked).
pub(super) fn lease_gone(e: &dyn std::fmt::Display) -> bool {
    e.to_string().contains("lease not found")
}

pub(super) fn session_expired() -> Error {
    Error::engine_failure(
        KIND,
        "the session lease of this waiter expired while it waited in the queue; the lock was \
         not acquired",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_millis(1)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ttl_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ttl_secs(Duration::ZERO), 1);
        assert_eq!(ttl_secs(Duration::MAX), i64::MAX);
    }
}
