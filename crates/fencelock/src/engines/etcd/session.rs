//! Sessions: the etcd lease of one acquisition, granted, kept alive and revoked.
//!
//! - **Session**: every acquisition gets its own etcd lease (a session, as `etcdctl lock`
//!   opens one per lock) with the lease's TTL rounded *up* to whole seconds, etcd's unit; the
//!   server may raise it further to its minimum (1.5 election timeouts). The lease's validity
//!   is still computed from the TTL the caller asked for, so rounding up only makes the lock
//!   outlive a dead holder a little longer, never makes the holder trust it longer. A lease
//!   per acquisition (rather than one per client) keeps fencelock's contract that a dropped
//!   [`Lease`](crate::Lease) stops being renewed and expires on its own.
//! - **Renewal**: a keep-alive of the session lease, then a read of the waiter key. A lease
//!   that is gone (TTL 0), or a key that was deleted (a forced release), is a lost lease,
//!   never re-acquired behind the holder's back.
//! - **Release**: an owner-checked delete (compare on the key's create revision) and the
//!   revocation of the session lease. Revoking the lease also removes a key whose creation
//!   the caller never saw answered, so a cancelled acquisition leaves no key.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp};
use tokio::time::Instant;

use super::call::{etcd_error, retrying, tries};
use super::{EtcdEngine, KIND};
use crate::core::engine::{AcquireRequest, Renewal, Renewed};
use crate::core::error::{Error, Result};
use crate::core::options::renew_interval;

/// One queued or held acquisition: its session lease and waiter key.
#[derive(Debug, Clone)]
pub(super) struct Session {
    pub(super) name: String,
    pub(super) lease: i64,
    pub(super) key: String,
    /// The key's create revision once known; 0 while the enqueue is unanswered.
    pub(super) rev: i64,
    ttl: Duration,
    /// When the session was last granted or kept alive: an entry whose lease has surely
    /// expired (a lease dropped without release, or lost by expiry) is forgotten.
    seen: Instant,
}

impl Session {
    fn forgotten(&self, op_timeout: Duration) -> bool {
        self.seen.elapsed() > self.ttl * 2 + op_timeout
    }

    /// Holds while the session's key is still the one it created.
    pub(super) fn key_unchanged(&self) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, self.rev)
    }
}

impl EtcdEngine {
    pub(super) fn sessions(&self) -> MutexGuard<'_, HashMap<String, Session>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self, owner: &str) {
        if let Some(s) = self.sessions().get_mut(owner) {
            s.seen = Instant::now();
        }
    }

    /// Registers a session for `req`'s owner and grants its lease.
    pub(super) async fn open_session(
        &self,
        req: &AcquireRequest,
        started: Instant,
    ) -> Result<Session> {
        // The lease id is chosen here, not by the server, and registered before the grant is
        // sent: a release after a cancelled grant can then revoke it (and any key on it).
        let lease = (rand::random::<u64>() >> 2) as i64 | 1;
        let session = Session {
            name: req.name.clone(),
            lease,
            key: self.keys.waiter(&req.name, lease),
            rev: 0,
            ttl: req.ttl,
            seen: started,
        };
        {
            let mut sessions = self.sessions();
            sessions.retain(|_, s| !s.forgotten(self.op_timeout));
            sessions.insert(req.owner.clone(), session.clone());
        }
        let secs = i64::try_from(req.ttl.as_millis().div_ceil(1000)).unwrap_or(i64::MAX);
        let opts = etcd_client::LeaseGrantOptions::new().with_id(lease);
        self.bounded("grant the session lease", |mut c| {
            let opts = opts.clone();
            async move { c.lease_grant(secs, Some(opts)).await }
        })
        .await?;
        Ok(session)
    }

    /// Keeps a queued session's lease alive every TTL/3. Returns the error that ended it: the
    /// lease is gone, or no keep-alive was confirmed for a whole TTL.
    pub(super) async fn keep_queued_alive(
        &self,
        owner: &str,
        lease: i64,
        key: &str,
        ttl: Duration,
        confirmed_at: &Mutex<Instant>,
    ) -> Error {
        loop {
            tokio::time::sleep(renew_interval(ttl)).await;
            let sent = Instant::now();
            let confirmed = *confirmed_at.lock().unwrap_or_else(|p| p.into_inner());
            match self.keep_alive(lease).await {
                Ok(()) => {
                    *confirmed_at.lock().unwrap_or_else(|p| p.into_inner()) = sent;
                    self.touch(owner);
                }
                Err(e) if lease_gone(&e) && !self.key_exists(key).await => {
                    return session_expired()
                }
                Err(e) if confirmed.elapsed() >= ttl => {
                    return etcd_error("keep the session alive", e)
                }
                Err(_) => {}
            }
        }
    }

    /// One keep-alive round trip for `lease`.
    async fn keep_alive(&self, lease: i64) -> std::result::Result<(), etcd_client::Error> {
        tries(&self.client, self.op_timeout, |mut c| async move {
            c.lease_keep_alive(lease).await
        })
        .await
        .map(|_| ())
        .map_err(|e| {
            e.unwrap_or_else(|| {
                etcd_client::Error::LeaseKeepAliveError("no answer in time".to_owned())
            })
        })
    }

    /// Whether `s`'s key still exists with the revision it was created at.
    pub(super) async fn key_is_mine(&self, s: &Session) -> Result<bool> {
        let resp = self
            .get(
                "read the waiter key",
                s.key.clone(),
                GetOptions::new().with_keys_only(),
            )
            .await?;
        Ok(resp.kvs().first().map(KeyValue::create_revision) == Some(s.rev))
    }

    /// Whether `key` exists; errors count as "exists" (nothing is concluded from silence).
    async fn key_exists(&self, key: &str) -> bool {
        let read = self.get(
            "read the waiter key",
            key,
            GetOptions::new().with_count_only(),
        );
        match read.await {
            Ok(r) => r.count() > 0,
            Err(_) => true,
        }
    }

    /// Renews every session of the batch; a lost one is forgotten.
    pub(super) async fn renew(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let one = |r: &Renewal| {
            let session = self.sessions().get(&r.owner).cloned();
            let owner = r.owner.clone();
            async move {
                let Some(s) = session else {
                    return Renewed::NotHolder;
                };
                match self.keep_alive(s.lease).await {
                    Ok(()) => {}
                    // A raft leader elected a moment ago may answer "not found" for a lease
                    // it has not applied yet; while the key attached to the lease exists, the
                    // lease does too: a failed renewal, not a lost lease.
                    Err(e) if lease_gone(&e) => {
                        return match self.key_is_mine(&s).await {
                            Ok(true) => Renewed::Failed(e.to_string()),
                            Err(e) => Renewed::Failed(e.to_string()),
                            Ok(false) => Renewed::NotHolder,
                        };
                    }
                    Err(e) => return Renewed::Failed(e.to_string()),
                }
                match self.key_is_mine(&s).await {
                    Ok(true) => {
                        self.touch(&owner);
                        Renewed::Extended
                    }
                    Ok(false) => Renewed::NotHolder,
                    Err(e) => Renewed::Failed(e.to_string()),
                }
            }
        };
        let answers = futures_util::future::join_all(batch.iter().map(one)).await;
        let mut sessions = self.sessions();
        for (r, a) in batch.iter().zip(&answers) {
            if *a == Renewed::NotHolder {
                sessions.remove(&r.owner);
            }
        }
        Ok(answers)
    }

    /// Deletes the owner's key if it is still the one its session created, and revokes the
    /// session lease. Whether the key was held and is now deleted.
    pub(super) async fn close_session(&self, owner: &str) -> Result<bool> {
        let Some(s) = self.sessions().remove(owner) else {
            return Ok(false);
        };
        let cmp = if s.rev == 0 {
            Compare::create_revision(s.key.clone(), CompareOp::Greater, 0)
        } else {
            s.key_unchanged()
        };
        let txn = Txn::new()
            .when([cmp])
            .and_then([TxnOp::delete(s.key.clone(), None)]);
        let deleted = self.txn("release", txn).await;
        // Revoking the session removes whatever key is still attached to it, also one whose
        // creation was never answered. A lease that is already gone is not an error.
        let (client, limit, lease) = (self.client.clone(), self.op_timeout, s.lease);
        let endpoints = self.endpoints.clone();
        let revoke = async move {
            let revoked = retrying(
                &client,
                &endpoints,
                limit,
                "revoke the session lease",
                |mut c| async move { c.lease_revoke(lease).await },
            );
            match revoked.await {
                Ok(_) => {}
                Err(e) if lease_gone(&e) => {}
                Err(e) => tracing::debug!(error = %e, "lease revoke failed; it expires on its own"),
            }
        };
        let held = s.rev != 0 && deleted.as_ref().is_ok_and(|r| r.succeeded());
        if held {
            // The key this session created is deleted and no creation of it can be in flight
            // (it was answered): the revocation only frees the lease, off the release's path.
            tokio::spawn(revoke);
        } else {
            revoke.await;
        }
        deleted?;
        Ok(held)
    }
}

/// Whether an error says the lease does not exist (expired or revoked).
fn lease_gone(e: &dyn std::fmt::Display) -> bool {
    let text = e.to_string();
    text.contains("lease not found")
}

pub(super) fn session_expired() -> Error {
    Error::engine_failure(
        KIND,
        "the session lease of this waiter expired while it waited in the queue; the lock was \
         not acquired",
    )
}
