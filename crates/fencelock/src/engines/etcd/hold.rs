//! One acquisition's key on its session: created, renewed and deleted.
//!
//! - **Creation**: the transaction that creates the key runs in a task of its own, so that a
//!   cancelled acquisition cannot leave its outcome unknown: when the acquisition is released
//!   (cancelled, timed out, dropped) while the transaction is in flight, the task deletes the
//!   key it created once etcd answers. A creation that failed, or went unanswered, may still
//!   have left a key: its release deletes it if it is there and retires the session, which is
//!   revoked (taking any late key with it) once its last lease ends.
//! - **Renewal**: one keep-alive per session in the batch, then one read of every key in it. A
//!   key that is gone (a forced release) is a lost lease; a session that is gone loses every
//!   lease on it ([`session`](super::session)). A "lease not found" from a raft leader elected
//!   a moment ago, while keys on the session still exist, is a failed renewal, not a loss.
//! - **Release**: an owner-checked delete (compare on the key's create revision). The session
//!   stays, for the client's next acquisition. The core releases the leases it drops or
//!   declares lost, so that a key never outlives its lease on a session that others renew.

use std::collections::{HashMap, HashSet};

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp, TxnOpResponse};
use tokio::time::Instant;

use super::session::lease_gone;
use super::{EtcdEngine, KIND};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::{Error, Result};

/// How far an acquisition's key has got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Phase {
    /// A session is picked; no creation sent yet.
    Picked,
    /// The creating transaction is in flight; `abandoned` once released meanwhile.
    Enqueuing { abandoned: bool },
    /// The key exists, created at this revision.
    Queued(i64),
    /// The creation failed or went unanswered: the key may exist.
    Unknown,
}

/// One queued or held acquisition.
#[derive(Debug, Clone)]
pub(super) struct Hold {
    pub(super) name: String,
    pub(super) session: i64,
    pub(super) key: String,
    pub(super) phase: Phase,
    /// Turns true once the creating task has settled the outcome (and deleted the key of an
    /// acquisition released meanwhile).
    settled: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Hold {
    pub(super) fn picked(name: &str, session: i64, key: String) -> Hold {
        Hold {
            name: name.to_owned(),
            session,
            key,
            phase: Phase::Picked,
            settled: None,
        }
    }

    pub(super) fn enqueuing(&self) -> bool {
        matches!(self.phase, Phase::Enqueuing { .. })
    }

    /// Holds while the key is still the one this acquisition created.
    pub(super) fn key_unchanged(&self, rev: i64) -> Compare {
        Compare::create_revision(self.key.clone(), CompareOp::Equal, rev)
    }
}

/// What one keep-alive of a session found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Kept {
    Alive,
    Lost,
    Failed(String),
}

/// The revision the enqueue created the key at, and the queue's head.
pub(super) type Enqueued = (i64, Option<KeyValue>);

impl EtcdEngine {
    /// Runs `txn`, which creates `owner`'s key, to its end even if the caller stops waiting
    /// for it, and settles the acquisition by its answer.
    pub(super) async fn create_key(
        &self,
        owner: &str,
        txn: Txn,
        parse: fn(etcd_client::TxnResponse) -> Result<Enqueued>,
    ) -> Result<Enqueued> {
        let (session, key, settled) = {
            let mut st = self.state();
            let Some(h) = st.holds.get_mut(owner) else {
                return Err(super::session::session_expired());
            };
            h.phase = Phase::Enqueuing { abandoned: false };
            let (tx, rx) = tokio::sync::watch::channel(false);
            h.settled = Some(rx);
            (h.session, h.key.clone(), tx)
        };
        let Some(me) = self.this.upgrade() else {
            return Err(Error::engine_failure(KIND, "the etcd client was closed"));
        };
        let owner = owner.to_owned();
        let task = tokio::spawn(async move {
            let outcome = me.txn("enqueue", txn).await.and_then(parse);
            me.settle(&owner, session, &key, &outcome).await;
            let _ = settled.send(true);
            outcome
        });
        task.await.unwrap_or_else(|e| {
            Err(Error::engine_failure(
                KIND,
                format!("the enqueue task ended: {e}"),
            ))
        })
    }

    /// Records the creation's outcome; deletes the key if the acquisition was released while
    /// it was in flight.
    async fn settle(&self, owner: &str, session: i64, key: &str, outcome: &Result<Enqueued>) {
        // `None`: the session was lost meanwhile, and the hold with it.
        let abandoned = {
            let mut st = self.state();
            match st.holds.get_mut(owner) {
                Some(h) if h.session == session => {
                    let abandoned = h.phase == Phase::Enqueuing { abandoned: true };
                    h.phase = match outcome {
                        Ok((rev, _)) => Phase::Queued(*rev),
                        Err(_) => Phase::Unknown,
                    };
                    Some(abandoned)
                }
                _ => None,
            }
        };
        let Some(abandoned) = abandoned else {
            if let Ok((rev, _)) = outcome {
                let _ = self.delete_key(key, *rev).await;
            }
            return;
        };
        if let Err(e) = outcome {
            if lease_gone(e) {
                self.session_lost(session);
                return;
            }
        }
        if abandoned {
            let _ = self.close_session(owner).await;
        }
    }

    /// Deletes `key` if it still has create revision `rev`. Whether it did.
    async fn delete_key(&self, key: &str, rev: i64) -> Result<bool> {
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, rev)])
            .and_then([TxnOp::delete(key, None)]);
        Ok(self.txn("release", txn).await?.succeeded())
    }

    /// Deletes the owner's key if it is still the one it created; the session stays. Whether
    /// the key was held and is now deleted.
    pub(super) async fn close_session(&self, owner: &str) -> Result<bool> {
        let hold = {
            let mut st = self.state();
            let Some(h) = st.holds.get_mut(owner) else {
                return Ok(false);
            };
            if let Phase::Enqueuing { abandoned } = &mut h.phase {
                *abandoned = true;
                h.settled.clone()
            } else {
                None
            }
            .ok_or_else(|| h.clone())
        };
        let hold = match hold {
            // The creating task deletes the key once etcd answers; the release ends with it,
            // so that `Client::close` waits for that too. The task's call is bounded.
            Ok(mut settled) => {
                let limit = self.op_timeout.saturating_mul(2);
                let _ = tokio::time::timeout(limit, settled.wait_for(|done| *done)).await;
                return Ok(false);
            }
            Err(hold) => hold,
        };
        let deleted = match hold.phase {
            Phase::Queued(rev) => self.delete_key(&hold.key, rev).await,
            Phase::Unknown => {
                let txn = Txn::new()
                    .when([Compare::create_revision(
                        hold.key.clone(),
                        CompareOp::Greater,
                        0,
                    )])
                    .and_then([TxnOp::delete(hold.key.clone(), None)]);
                self.retire(hold.session);
                self.txn("release", txn).await.map(|_| false)
            }
            Phase::Picked | Phase::Enqueuing { .. } => Ok(false),
        };
        // A key whose delete was not confirmed may still be there: its session must not
        // create the same key again for a later acquisition.
        if deleted.is_err() {
            self.retire(hold.session);
        }
        self.forget_hold(owner);
        deleted
    }

    /// Whether each `(key, create revision)` still exists with that revision, in one read.
    pub(super) async fn keys_present(&self, keys: &[(String, i64)]) -> Result<Vec<bool>> {
        let mut present = Vec::with_capacity(keys.len());
        // etcd refuses transactions of more than 128 operations by default.
        for chunk in keys.chunks(100) {
            let gets = chunk
                .iter()
                .map(|(k, _)| TxnOp::get(k.clone(), Some(GetOptions::new().with_keys_only())));
            let resp = self
                .txn(
                    "read the waiter keys",
                    Txn::new().and_then(gets.collect::<Vec<_>>()),
                )
                .await?;
            let ops = resp.op_responses();
            for (i, (_, rev)) in chunk.iter().enumerate() {
                let found = match ops.get(i) {
                    Some(TxnOpResponse::Get(g)) => g.kvs().first().map(KeyValue::create_revision),
                    _ => None,
                };
                present.push(found == Some(*rev));
            }
        }
        Ok(present)
    }

    /// Whether `key` still exists with create revision `rev`.
    pub(super) async fn key_is_mine(&self, key: &str, rev: i64) -> Result<bool> {
        Ok(self
            .keys_present(&[(key.to_owned(), rev)])
            .await?
            .first()
            .copied()
            .unwrap_or(false))
    }

    /// Renews every lease of the batch: one keep-alive per session, one read of the keys.
    pub(super) async fn renew(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let held: Vec<Option<(i64, String, i64)>> = {
            let st = self.state();
            batch
                .iter()
                .map(|r| match st.holds.get(&r.owner) {
                    Some(h) => match h.phase {
                        Phase::Queued(rev) => Some((h.session, h.key.clone(), rev)),
                        _ => None,
                    },
                    None => None,
                })
                .collect()
        };
        let sessions: HashSet<i64> = held.iter().flatten().map(|(s, _, _)| *s).collect();
        let kept = futures_util::future::join_all(sessions.iter().map(|&id| async move {
            let sent = Instant::now();
            (id, sent, self.keep_alive(id).await)
        }))
        .await;
        let mut alive: HashMap<i64, Kept> = HashMap::new();
        for (id, sent, outcome) in kept {
            let verdict = match outcome {
                Ok(()) => {
                    self.confirm(id, sent);
                    Kept::Alive
                }
                Err(e) if lease_gone(&e) => self.session_gone_or_lagging(id, e.to_string()).await,
                Err(e) => Kept::Failed(e.to_string()),
            };
            alive.insert(id, verdict);
        }
        // The keys of live sessions, read together: a forced release deletes one of them.
        let to_read: Vec<(String, i64)> = held
            .iter()
            .flatten()
            .filter(|(s, _, _)| alive.get(s) == Some(&Kept::Alive))
            .map(|(_, k, rev)| (k.clone(), *rev))
            .collect();
        let read = if to_read.is_empty() {
            Ok(Vec::new())
        } else {
            self.keys_present(&to_read).await
        };
        let mut present = read.as_ref().map(|v| v.iter().copied());
        let mut answers = Vec::with_capacity(batch.len());
        for (r, h) in batch.iter().zip(&held) {
            let answer = match h {
                None => Renewed::NotHolder,
                Some((s, _, _)) => match alive.get(s) {
                    // The session was lost: every lease on it went with it.
                    None | Some(Kept::Lost) => Renewed::NotHolder,
                    Some(Kept::Failed(msg)) => Renewed::Failed(msg.clone()),
                    Some(Kept::Alive) => match &mut present {
                        Ok(it) => match it.next() {
                            Some(true) => Renewed::Extended,
                            _ => Renewed::NotHolder,
                        },
                        Err(e) => Renewed::Failed(e.to_string()),
                    },
                },
            };
            if answer == Renewed::NotHolder {
                self.forget_hold(&r.owner);
            }
            answers.push(answer);
        }
        Ok(answers)
    }

    /// After a keep-alive said session `id` is gone: lost when no key of it is left (it is
    /// ended, with every lease on it); a failed renewal while its keys still exist (a raft
    /// leader elected a moment ago may not have applied it yet).
    pub(super) async fn session_gone_or_lagging(&self, id: i64, reason: String) -> Kept {
        let keys: Vec<(String, i64)> = {
            let st = self.state();
            st.holds
                .values()
                .filter(|h| h.session == id)
                .filter_map(|h| match h.phase {
                    Phase::Queued(rev) => Some((h.key.clone(), rev)),
                    _ => None,
                })
                .collect()
        };
        match self.keys_present(&keys).await {
            Ok(p) if p.iter().any(|&b| b) => Kept::Failed(reason),
            Ok(_) => {
                self.session_lost(id);
                Kept::Lost
            }
            Err(e) => Kept::Failed(e.to_string()),
        }
    }
}
