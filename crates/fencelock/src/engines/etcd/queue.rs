//! The waiter queue: enqueueing, waiting for the predecessor, and the grant.
//!
//! - **Lock**: a waiter key `<lock prefix>/<lease id hex>` attached to the client's session
//!   lease ([`keys`](super::keys) documents the name mapping, [`session`](super::session) the
//!   sessions). One transaction creates it (if absent) and reads the first key by create
//!   revision; the lock is held by the key with the lowest create revision, so an uncontended
//!   acquisition is one transaction on a session already granted.
//! - **Waiting**: a waiter watches only the key with the greatest create revision below its
//!   own and re-checks when that key is deleted (FIFO, no polling). The watch is re-armed
//!   every operation timeout, so a member that stopped answering cannot hold a waiter forever.
//!   While queued, the waiter keeps its session alive itself.
//! - **Token**: the create revision of the holder's key. etcd's revision is one counter for
//!   the whole cluster, raised by every write and never reused, so later grants carry larger
//!   tokens, across member crashes and leader changes.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use etcd_client::{
    Compare, CompareOp, GetOptions, GetResponse, KeyValue, PutOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, WatchOptions,
};
use tokio::time::Instant;

use super::hold::Enqueued;
use super::runbook::encode_fields;
use super::session::session_expired;
use super::{EtcdEngine, KIND};
use crate::core::engine::{AcquireRequest, Attempt, WaitQueue};
use crate::core::error::{Error, Result};
use crate::core::holder::unix_millis;
use crate::core::token::FencingToken;

impl EtcdEngine {
    /// Enqueues `owner`'s key on `name` under session `lease` (if absent) and reads the
    /// queue head, in one transaction. Returns the key's create revision and the head.
    async fn enqueue(
        &self,
        owner: &str,
        name: &str,
        lease: i64,
        key: &str,
        value: String,
    ) -> Result<Enqueued> {
        let head = TxnOp::get(self.keys.waiters(name), Some(first_created().with_limit(1)));
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease))),
                head.clone(),
            ])
            .or_else([TxnOp::get(key, None), head]);
        self.create_key(owner, txn, enqueued).await
    }

    /// Waits until no key on `name` was created before revision `rev`: watches the newest
    /// older key until it is deleted, then looks again (etcd's `waitDeletes`). Transient
    /// errors (a member going down) are retried; the caller bounds the whole wait.
    async fn wait_deletes(&self, name: &str, rev: i64) -> Result<()> {
        let waiters = self.keys.waiters(name);
        loop {
            let opts = GetOptions::new()
                .with_prefix()
                .with_max_create_revision(rev - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(1);
            let resp = match self.get("read the queue", waiters.clone(), opts).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(error = %e, "queue read failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(prev) = resp.kvs().first() else {
                return Ok(());
            };
            let at = resp.header().map_or(0, |h| h.revision());
            if let Err(e) = self.wait_delete(prev.key().to_vec(), at).await {
                tracing::debug!(error = %e, "watch failed; looking again");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Returns when `key` is deleted after revision `at`, when the watch ends, or after one
    /// operation timeout (so that a member that stopped answering is not trusted forever).
    async fn wait_delete(&self, key: Vec<u8>, at: i64) -> Result<()> {
        let opts = WatchOptions::new().with_start_revision(at + 1);
        let mut stream = self.watch("watch", key, opts).await?;
        self.watch_until(&mut stream, |resp| {
            resp.canceled()
                || resp
                    .events()
                    .iter()
                    .any(|e| e.event_type() == etcd_client::EventType::Delete)
        })
        .await
    }

    /// The first key of `name`'s queue (its holder, its leader), read as `what`.
    pub(super) async fn read_head(&self, what: &str, name: &str) -> Result<GetResponse> {
        let waiters = self.keys.waiters(name);
        self.get(what, waiters, first_created().with_limit(1)).await
    }

    /// The key holding `name`'s lock now, if any.
    pub(super) async fn head(&self, name: &str) -> Result<Option<KeyValue>> {
        let resp = self.read_head("read the lock holder", name).await?;
        Ok(resp.kvs().first().cloned())
    }

    fn meta_value(req: &AcquireRequest) -> String {
        encode_fields(&[
            ("owner", req.owner.clone()),
            ("host", req.meta.host.clone()),
            ("pid", req.meta.pid.to_string()),
            ("client", req.meta.client.clone()),
            ("acquired_at", unix_millis(SystemTime::now()).to_string()),
            ("ttl", req.ttl.as_millis().to_string()),
        ])
    }
}

#[async_trait]
impl WaitQueue for EtcdEngine {
    async fn acquire_queued(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<(Attempt, Instant)> {
        let started = Instant::now();
        let deadline = started + wait;
        // Checked by this client: etcd cannot make the grant conditional on them.
        let limits = self.current_limits().await?;
        if let Some(refused) = limits.check_ttl(req.ttl) {
            return Err(refused.with_resource(&req.name).with_engine(KIND));
        }
        if let Some(max) = limits.max_held_per_client() {
            let mine = self
                .state()
                .holds
                .keys()
                .filter(|o| **o != req.owner)
                .count();
            if mine >= max as usize {
                return Ok((
                    Attempt::OverQuota {
                        max,
                        retry_in: None,
                    },
                    started,
                ));
            }
        }
        let (lease, key) = self.session_for(&req.name, &req.owner, req.ttl).await?;
        let value = match campaign {
            Some(v) => v.to_owned(),
            None => Self::meta_value(req),
        };
        let (rev, head) = self
            .enqueue(&req.owner, &req.name, lease, &key, value)
            .await?;
        let head_rev = head.as_ref().map_or(0, KeyValue::create_revision);
        // The key lives as long as the session: validity counts from the session's last
        // confirmation (see `session`), which may be before this acquisition started.
        let since = || self.valid_since(lease, req.ttl).ok_or_else(session_expired);
        if head_rev == rev {
            return Ok((Attempt::Granted(token_of(rev)?), since()?));
        }
        let held = |holder| Attempt::Held {
            holder,
            retry_in: None,
            wake: None,
        };
        if wait.is_zero() {
            return Ok((held(self.holder_in(head.as_ref()).await), started));
        }
        tokio::select! {
            r = self.wait_deletes(&req.name, rev) => r?,
            e = self.keep_queued_alive(lease, req.ttl) => return Err(e.with_resource(&req.name)),
            _ = tokio::time::sleep_until(deadline) => {
                let head = self.head(&req.name).await.ok().flatten();
                return Ok((held(self.holder_in(head.as_ref()).await), started));
            }
        }
        // First in line. As etcd's mutex does, check that the key is still there: the session
        // may have expired, or the key been force-released, while the watch was quiet.
        if !self.key_is_mine(&key, rev).await? {
            return Err(session_expired());
        }
        Ok((Attempt::Granted(token_of(rev)?), since()?))
    }
}

/// The revision an enqueue transaction created (or found) the key at, and the queue's head.
fn enqueued(resp: etcd_client::TxnResponse) -> Result<Enqueued> {
    let ops = resp.op_responses();
    let mine = if resp.succeeded() {
        resp.header().map_or(0, |h| h.revision())
    } else {
        match ops.first() {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().map_or(0, KeyValue::create_revision),
            _ => 0,
        }
    };
    if mine == 0 {
        return Err(Error::engine_failure(
            KIND,
            "etcd answered the enqueue transaction without the waiter key's revision",
        ));
    }
    let head = match ops.get(1) {
        Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
        _ => None,
    };
    Ok((mine, head))
}

/// Reads a queue in order: oldest key (the holder) first.
pub(super) fn first_created() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

pub(super) fn token_of(rev: i64) -> Result<FencingToken> {
    FencingToken::checked_from_stored(rev)
        .filter(|t| t.get() > 0)
        .ok_or_else(|| Error::engine_failure(KIND, format!("etcd returned revision {rev}")))
}
