//! The etcd engine: the recipe of etcd's own `concurrency` package (`mutex.go`), so that
//! `etcdctl lock` and fencelock exclude each other on the same name.
//!
//! - **Session**: every acquisition gets its own etcd lease (a session, as `etcdctl lock`
//!   opens one per lock) with the lease's TTL rounded *up* to whole seconds, etcd's unit; the
//!   server may raise it further to its minimum (1.5 election timeouts). The lease's validity
//!   is still computed from the TTL the caller asked for, so rounding up only makes the lock
//!   outlive a dead holder a little longer, never makes the holder trust it longer. A lease
//!   per acquisition (rather than one per client) keeps fencelock's contract that a dropped
//!   [`Lease`](crate::Lease) stops being renewed and expires on its own.
//! - **Lock**: a waiter key `<lock prefix>/<lease id hex>` attached to the session lease
//!   ([`keys`] documents the name mapping). One transaction creates it (if absent) and reads
//!   the first key by create revision; the lock is held by the key with the lowest create
//!   revision, so an uncontended acquisition is the lease grant and one transaction.
//! - **Waiting**: a waiter watches only the key with the greatest create revision below its
//!   own and re-checks when that key is deleted (FIFO, no polling). The watch is re-armed
//!   every operation timeout, so a member that stopped answering cannot hold a waiter forever.
//!   While queued, the waiter keeps its session lease alive itself.
//! - **Token**: the create revision of the holder's key. etcd's revision is one counter for
//!   the whole cluster, raised by every write and never reused, so later grants carry larger
//!   tokens, across member crashes and leader changes.
//! - **Renewal**: a keep-alive of the session lease, then a read of the waiter key. A lease
//!   that is gone (TTL 0), or a key that was deleted (a forced release), is a lost lease,
//!   never re-acquired behind the holder's back.
//! - **Release**: an owner-checked delete (compare on the key's create revision) and the
//!   revocation of the session lease. Revoking the lease also removes a key whose creation
//!   the caller never saw answered, so a cancelled acquisition leaves no key.
//! - **Runbook**: holder metadata is the waiter key's value (`etcdctl lock` writes an empty
//!   value; such holders show as their lease id). A forced release deletes the holder's key
//!   in a transaction that compares its create revision and writes the audit record under
//!   `<prefix>%audit/`; the record's counter is that transaction's revision.

mod keys;
pub(crate) mod url;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use etcd_client::{
    Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use percent_encoding::{percent_decode_str, utf8_percent_encode, NON_ALPHANUMERIC};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::core::engine::{
    AcquireRequest, Attempt, Elections, Engine, EngineConfig, Opened, Renewal, Renewed, WaitQueue,
    DEFAULT_PREFIX,
};
use crate::core::error::{Error, Result};
use crate::core::holder::{from_unix_millis, unix_millis, Holder};
use crate::core::options::renew_interval;
use crate::core::records::{publish, Leader};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::token::FencingToken;
use url::EtcdUrl;

pub(crate) use keys::{Keys, DEFAULT_ETCD_PREFIX};

const KIND: &str = "etcd";

/// One queued or held acquisition: its session lease and waiter key.
#[derive(Debug, Clone)]
struct Session {
    name: String,
    lease: i64,
    key: String,
    /// The key's create revision once known; 0 while the enqueue is unanswered.
    rev: i64,
    ttl: Duration,
    /// When the session was last granted or kept alive: an entry whose lease has surely
    /// expired (a lease dropped without release, or lost by expiry) is forgotten.
    seen: Instant,
}

impl Session {
    fn forgotten(&self, op_timeout: Duration) -> bool {
        self.seen.elapsed() > self.ttl * 2 + op_timeout
    }
}

pub(crate) struct EtcdEngine {
    client: etcd_client::Client,
    keys: Keys,
    op_timeout: Duration,
    /// Sessions by owner value.
    sessions: Mutex<HashMap<String, Session>>,
}

/// Opens the engine for an `etcd://` / `etcds://` backend. Connecting is lazy: an unreachable
/// cluster shows at the first call, which is bounded like every call.
/// Hands out the lock, etcd's own waiter queue (every acquisition waits in FIFO order) and
/// native elections.
pub(crate) async fn open(url: EtcdUrl, cfg: &EngineConfig) -> Result<Opened> {
    let engine = Arc::new(EtcdEngine::connect(&url, cfg).await?);
    Ok(Opened {
        queue: Some(engine.clone()),
        elections: Some(engine.clone()),
        ..Opened::lock(engine)
    })
}

impl EtcdEngine {
    async fn connect(url: &EtcdUrl, cfg: &EngineConfig) -> Result<EtcdEngine> {
        let client = connect_client(url, cfg.op_timeout).await?;
        let prefix = if cfg.prefix == DEFAULT_PREFIX {
            DEFAULT_ETCD_PREFIX.to_owned()
        } else {
            cfg.prefix.clone()
        };
        Ok(EtcdEngine {
            client,
            keys: Keys { prefix },
            op_timeout: cfg.op_timeout,
            sessions: Mutex::new(HashMap::new()),
        })
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self, owner: &str) {
        if let Some(s) = self.sessions().get_mut(owner) {
            s.seen = Instant::now();
        }
    }

    /// One etcd call, bounded by the operation timeout. `f` is called again (on a fresh
    /// handle, which the client balances to another member) while the call fails before it
    /// reached a server that could act on it: a refused connection (a dead member the channel
    /// still lists) or a member without a leader.
    async fn bounded<T, F, Fut>(&self, what: &str, f: F) -> Result<T>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        retrying(&self.client, self.op_timeout, what, f).await
    }

    /// Enqueues the session's key (if absent) and reads the queue head, in one transaction.
    /// Returns the key's create revision and the head.
    async fn enqueue(&self, s: &Session, value: String) -> Result<(i64, Option<KeyValue>)> {
        let head = TxnOp::get(
            self.keys.waiters(&s.name),
            Some(first_created().with_limit(1)),
        );
        let txn = Txn::new()
            .when([Compare::create_revision(s.key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(
                    s.key.clone(),
                    value,
                    Some(PutOptions::new().with_lease(s.lease)),
                ),
                head.clone(),
            ])
            .or_else([TxnOp::get(s.key.clone(), None), head]);
        let resp = self
            .bounded("enqueue", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
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
            let read = self.bounded("read the queue", |mut c| {
                let (waiters, opts) = (waiters.clone(), opts.clone());
                async move { c.get(waiters, Some(opts)).await }
            });
            let resp = match read.await {
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
        let mut stream = self
            .bounded("watch", |mut c| {
                let (key, opts) = (key.clone(), opts.clone());
                async move { c.watch(key, Some(opts)).await }
            })
            .await?;
        let rearm = tokio::time::sleep(self.op_timeout);
        tokio::pin!(rearm);
        loop {
            tokio::select! {
                _ = &mut rearm => return Ok(()),
                msg = stream.message() => match msg {
                    Ok(Some(resp)) => {
                        if resp.canceled()
                            || resp
                                .events()
                                .iter()
                                .any(|e| e.event_type() == etcd_client::EventType::Delete)
                        {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(etcd_error("watch", e)),
                },
            }
        }
    }

    /// Keeps a queued session's lease alive every TTL/3. Returns the error that ended it: the
    /// lease is gone, or no keep-alive was confirmed for a whole TTL.
    async fn keep_queued_alive(
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
        let deadline = Instant::now() + self.op_timeout;
        loop {
            let mut c = self.client.clone();
            match tokio::time::timeout_at(deadline, c.lease_keep_alive(lease)).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) if unsent(&e) && Instant::now() + RETRY_PAUSE < deadline => {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    return Err(etcd_client::Error::LeaseKeepAliveError(
                        "no answer in time".to_owned(),
                    ))
                }
            }
        }
    }

    /// Whether `s`'s key still exists with the revision it was created at.
    async fn key_is_mine(&self, s: &Session) -> Result<bool> {
        let resp = self
            .bounded("read the waiter key", |mut c| {
                let key = s.key.clone();
                async move { c.get(key, Some(GetOptions::new().with_keys_only())).await }
            })
            .await?;
        Ok(resp.kvs().first().map(KeyValue::create_revision) == Some(s.rev))
    }

    /// Whether `key` exists; errors count as "exists" (nothing is concluded from silence).
    async fn key_exists(&self, key: &str) -> bool {
        let read = self.bounded("read the waiter key", |mut c| {
            let key = key.to_owned();
            async move { c.get(key, Some(GetOptions::new().with_count_only())).await }
        });
        match read.await {
            Ok(r) => r.count() > 0,
            Err(_) => true,
        }
    }

    async fn holder_of(&self, kv: &KeyValue) -> Holder {
        let mut holder =
            parse_meta(kv.value()).unwrap_or_else(|| Holder::bare(lease_owner(kv.lease())));
        holder.token = FencingToken::checked_from_stored(kv.create_revision());
        if kv.lease() != 0 {
            let lease = kv.lease();
            let ttl = self
                .bounded("read the lease", |mut c| async move {
                    c.lease_time_to_live(lease, None).await
                })
                .await;
            if let Ok(ttl) = ttl {
                holder.ttl_left = u64::try_from(ttl.ttl()).ok().map(Duration::from_secs);
                holder.ttl = u64::try_from(ttl.granted_ttl())
                    .ok()
                    .map(Duration::from_secs);
            }
        }
        holder
    }

    /// The key holding `name`'s lock now, if any.
    async fn head(&self, name: &str) -> Result<Option<KeyValue>> {
        let waiters = self.keys.waiters(name);
        let resp = self
            .bounded("read the lock holder", |mut c| {
                let waiters = waiters.clone();
                async move { c.get(waiters, Some(first_created().with_limit(1))).await }
            })
            .await?;
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
        // The lease id is chosen here, not by the server, and registered before the grant is
        // sent: a release after a cancelled grant can then revoke it (and any key on it).
        let lease = (rand::random::<u64>() >> 2) as i64 | 1;
        let mut session = Session {
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
        let value = match campaign {
            Some(v) => v.to_owned(),
            None => Self::meta_value(req),
        };
        let (rev, head) = self.enqueue(&session, value).await?;
        session.rev = rev;
        if let Some(s) = self.sessions().get_mut(&req.owner) {
            s.rev = rev;
        }
        let head_rev = head.as_ref().map_or(0, KeyValue::create_revision);
        if head_rev == rev {
            return Ok((Attempt::Granted(token_of(rev)?), started));
        }
        let held = |holder| Attempt::Held {
            holder,
            retry_in: None,
            wake: None,
        };
        if wait.is_zero() {
            let holder = match &head {
                Some(kv) => Some(self.holder_of(kv).await),
                None => None,
            };
            return Ok((held(holder), started));
        }
        // The lease's expiry on the server counts from the last keep-alive it confirmed (the
        // grant, at first): a grant after the wait counts its validity from there.
        let confirmed_at = Mutex::new(started);
        tokio::select! {
            r = self.wait_deletes(&req.name, rev) => r?,
            e = self.keep_queued_alive(&req.owner, lease, &session.key, req.ttl, &confirmed_at) => return Err(e.with_resource(&req.name)),
            _ = tokio::time::sleep_until(deadline) => {
                let holder = match self.head(&req.name).await {
                    Ok(Some(kv)) => Some(self.holder_of(&kv).await),
                    _ => None,
                };
                return Ok((held(holder), started));
            }
        }
        // First in line. As etcd's mutex does, check that the key is still there: the session
        // may have expired, or the key been force-released, while the watch was quiet.
        let confirmed = *confirmed_at.lock().unwrap_or_else(|p| p.into_inner());
        if !self.key_is_mine(&session).await? {
            return Err(session_expired());
        }
        Ok((Attempt::Granted(token_of(rev)?), confirmed))
    }
}

#[async_trait]
impl Elections for EtcdEngine {
    async fn leader(&self, name: &str) -> Result<Option<Leader>> {
        Ok(self.head(name).await?.map(|kv| leader_of(&kv)))
    }

    async fn proclaim(&self, _name: &str, owner: &str, value: &str) -> Result<bool> {
        let Some(s) = self.sessions().get(owner).cloned() else {
            return Ok(false);
        };
        // As election.go's Proclaim: rewrite the leader's key only while it is still the key
        // this campaign created.
        let txn = Txn::new()
            .when([Compare::create_revision(
                s.key.clone(),
                CompareOp::Equal,
                s.rev,
            )])
            .and_then([TxnOp::put(
                s.key.clone(),
                value,
                Some(PutOptions::new().with_lease(s.lease)),
            )]);
        let resp = self
            .bounded("proclaim", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        Ok(resp.succeeded())
    }

    async fn observe(&self, name: &str, tx: &watch::Sender<Option<Leader>>) {
        let waiters = self.keys.waiters(name);
        loop {
            let step = async {
                // Read the leader, then watch the election's keys from just after that read:
                // no change between the two is missed.
                let read = self.bounded("read the leader", |mut c| {
                    let waiters = waiters.clone();
                    async move { c.get(waiters, Some(first_created().with_limit(1))).await }
                });
                let resp = match read.await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::debug!(error = %e, "reading the leader failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return;
                    }
                };
                publish(tx, resp.kvs().first().map(leader_of));
                let at = resp.header().map_or(0, |h| h.revision());
                let opts = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(at + 1);
                let watch = self.bounded("watch the election", |mut c| {
                    let (waiters, opts) = (waiters.clone(), opts.clone());
                    async move { c.watch(waiters, Some(opts)).await }
                });
                let Ok(mut stream) = watch.await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    return;
                };
                // Any event may change the leader; the loop reads it again. Re-armed every
                // operation timeout, as waiters are.
                let rearm = tokio::time::sleep(self.op_timeout);
                tokio::pin!(rearm);
                loop {
                    tokio::select! {
                        _ = &mut rearm => return,
                        msg = stream.message() => match msg {
                            Ok(Some(r)) if r.events().is_empty() && !r.canceled() => {}
                            _ => return,
                        },
                    }
                }
            };
            tokio::select! {
                _ = tx.closed() => return,
                _ = step => {}
            }
        }
    }
}

#[async_trait]
impl Engine for EtcdEngine {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn keys(&self, name: &str) -> Vec<(&'static str, String)> {
        vec![
            ("etcdctl lock/elect name", self.keys.lock_prefix(name)),
            (
                "waiter keys",
                format!("{}<lease id hex>", self.keys.waiters(name)),
            ),
        ]
    }

    async fn try_acquire(&self, req: &AcquireRequest) -> Result<Attempt> {
        Ok(self.acquire_queued(req, Duration::ZERO, None).await?.0)
    }
    async fn extend(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
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

    async fn release(&self, _name: &str, owner: &str) -> Result<bool> {
        let Some(s) = self.sessions().remove(owner) else {
            return Ok(false);
        };
        let cmp = if s.rev == 0 {
            Compare::create_revision(s.key.clone(), CompareOp::Greater, 0)
        } else {
            Compare::create_revision(s.key.clone(), CompareOp::Equal, s.rev)
        };
        let txn = Txn::new()
            .when([cmp])
            .and_then([TxnOp::delete(s.key.clone(), None)]);
        let deleted = self
            .bounded("release", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await;
        // Revoking the session removes whatever key is still attached to it, also one whose
        // creation was never answered. A lease that is already gone is not an error.
        let (client, limit, lease) = (self.client.clone(), self.op_timeout, s.lease);
        let revoke = async move {
            let revoked = retrying(
                &client,
                limit,
                "revoke the session lease",
                |mut c| async move { c.lease_revoke(lease).await },
            );
            match revoked.await {
                Ok(_) => {}
                Err(e) if e.to_string().contains("lease not found") => {}
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

    async fn inspect(&self, name: &str) -> Result<Option<Holder>> {
        match self.head(name).await? {
            Some(kv) => Ok(Some(self.holder_of(&kv).await)),
            None => Ok(None),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let range = format!("{}{}", self.keys.prefix, keys::escape(prefix));
        let resp = self
            .bounded("list locks", |mut c| {
                let range = range.clone();
                async move { c.get(range, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let mut heads: HashMap<String, KeyValue> = HashMap::new();
        for kv in resp.kvs() {
            let Some((name, _)) = kv.key_str().ok().and_then(|k| self.keys.parse_waiter(k)) else {
                continue;
            };
            if !name.starts_with(prefix) {
                continue;
            }
            let older = heads
                .get(&name)
                .is_none_or(|h| kv.create_revision() < h.create_revision());
            if older {
                heads.insert(name, kv.clone());
            }
        }
        let mut held = Vec::with_capacity(heads.len());
        for (resource, kv) in heads {
            held.push(HeldLock {
                resource,
                holder: self.holder_of(&kv).await,
            });
        }
        Ok(held)
    }

    async fn force_release(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let Some(head) = self.head(name).await? else {
            return Ok(None);
        };
        let mut holder = self.holder_of(&head).await;
        if expected_owner.is_some_and(|o| o != holder.owner) {
            return Ok(None);
        }
        holder.ttl_left = None;
        let mut record = draft.clone();
        record.holder = holder;
        let key = format!("{}{}", self.keys.audit(Some(name)), record.id);
        let txn = Txn::new()
            .when([Compare::create_revision(
                head.key().to_vec(),
                CompareOp::Equal,
                head.create_revision(),
            )])
            .and_then([
                TxnOp::delete(head.key().to_vec(), None),
                TxnOp::put(key, encode_record(&record), None),
            ]);
        let resp = self
            .bounded("force release", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        record.counter = token_of(resp.header().map_or(0, |h| h.revision()))?;
        Ok(Some(record))
    }

    async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let range = self.keys.audit(name);
        let resp = self
            .bounded("read the audit log", |mut c| {
                let range = range.clone();
                async move { c.get(range, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let mut records: Vec<AuditRecord> = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let mut r = decode_record(kv.value())?;
                r.counter = FencingToken::checked_from_stored(kv.create_revision())?;
                Some(r)
            })
            .collect();
        records.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| b.counter.cmp(&a.counter)));
        Ok(records)
    }
}

/// Connects a client to the backend's endpoints (lazily), with credentials and TLS.
pub(crate) async fn connect_client(
    url: &EtcdUrl,
    op_timeout: Duration,
) -> Result<etcd_client::Client> {
    let EtcdUrl {
        tls,
        endpoints,
        user,
        password,
        ca,
        cert,
        key,
    } = url;
    let scheme = if *tls { "https" } else { "http" };
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| format!("{scheme}://{e}"))
        .collect();
    // A member without a leader refuses calls instead of serving stale reads or silent
    // watches; HTTP/2 pings notice a dead member within about a second.
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(op_timeout)
        .with_require_leader(true)
        .with_keep_alive(Duration::from_secs(1), op_timeout)
        .with_keep_alive_while_idle(true);
    if let (Some(u), Some(p)) = (user, password) {
        opts = opts.with_user(u.clone(), p.clone());
    }
    if *tls {
        let read = |p: &std::path::Path, what: &str| {
            std::fs::read(p)
                .map_err(|e| Error::invalid(format!("cannot read the {what} {}: {e}", p.display())))
        };
        let mut t = etcd_client::TlsOptions::new();
        if let Some(ca) = ca {
            t = t.ca_certificate(etcd_client::Certificate::from_pem(read(
                ca,
                "CA certificate",
            )?));
        }
        if let (Some(c), Some(k)) = (cert, key) {
            t = t.identity(etcd_client::Identity::from_pem(
                read(c, "client certificate")?,
                read(k, "client key")?,
            ));
        }
        opts = opts.with_tls(t);
    }
    let connect = etcd_client::Client::connect(eps, Some(opts));
    match tokio::time::timeout(op_timeout, connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(etcd_error("connect", e)),
        Err(_) => Err(Error::engine_failure(
            KIND,
            "no answer from etcd while connecting (authenticating); check that the cluster is up",
        )),
    }
}

/// [`EtcdEngine::bounded`], for tasks that outlive the engine borrow.
async fn retrying<T, F, Fut>(
    client: &etcd_client::Client,
    limit: Duration,
    what: &str,
    mut f: F,
) -> Result<T>
where
    F: FnMut(etcd_client::Client) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, f(client.clone())).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if unsent(&e) && Instant::now() + RETRY_PAUSE < deadline => {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Ok(Err(e)) => return Err(etcd_error(what, e)),
            Err(_) => return Err(no_answer(what, limit)),
        }
    }
}

/// Pause between two tries of a call that never reached a usable member.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// Whether a call failed before any member acted on it, so trying again cannot apply it
/// twice: the connection was refused, or the member had no leader to forward it to.
fn unsent(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    text.contains("tcp connect error") || text.contains("no leader")
}

fn no_answer(what: &str, limit: Duration) -> Error {
    Error::engine_failure(
        KIND,
        format!(
            "no answer from etcd to {what} within {}; check that a majority of members is up",
            crate::core::options::display_duration(limit)
        ),
    )
}

fn etcd_error(what: &str, e: etcd_client::Error) -> Error {
    Error::engine_failure(KIND, format!("etcd failed to {what}: {e}"))
}

/// Whether an etcd error says the lease does not exist (expired or revoked).
fn lease_gone(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    text.contains("lease not found")
}

fn session_expired() -> Error {
    Error::engine_failure(
        KIND,
        "the session lease of this waiter expired while it waited in the queue; the lock was \
         not acquired",
    )
}

fn leader_of(kv: &KeyValue) -> Leader {
    Leader {
        value: String::from_utf8_lossy(kv.value()).into_owned(),
        token: FencingToken::from_stored(kv.create_revision()),
    }
}

fn first_created() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

fn token_of(rev: i64) -> Result<FencingToken> {
    FencingToken::checked_from_stored(rev)
        .filter(|t| t.get() > 0)
        .ok_or_else(|| Error::engine_failure(KIND, format!("etcd returned revision {rev}")))
}

/// The owner shown for a key written by another etcd client (`etcdctl lock`): its lease.
fn lease_owner(lease: i64) -> String {
    format!("etcd lease {lease:x}")
}

/// `fencelock k=v k=v ...`, values percent-encoded.
fn encode_fields(fields: &[(&str, String)]) -> String {
    let mut out = String::from("fencelock");
    for (k, v) in fields {
        out.push(' ');
        out.push_str(k);
        out.push('=');
        out.push_str(&utf8_percent_encode(v, NON_ALPHANUMERIC).to_string());
    }
    out
}

fn decode_fields(value: &[u8]) -> Option<HashMap<String, String>> {
    let text = std::str::from_utf8(value).ok()?;
    let rest = text.strip_prefix("fencelock")?;
    let mut fields = HashMap::new();
    for pair in rest.split_whitespace() {
        let (k, v) = pair.split_once('=')?;
        fields.insert(
            k.to_owned(),
            percent_decode_str(v).decode_utf8().ok()?.into_owned(),
        );
    }
    Some(fields)
}

fn parse_meta(value: &[u8]) -> Option<Holder> {
    let f = decode_fields(value)?;
    let mut h = Holder::bare(f.get("owner")?.clone());
    h.host = f.get("host").cloned();
    h.pid = f.get("pid").and_then(|p| p.parse().ok());
    h.client = f.get("client").cloned();
    h.acquired_at = f
        .get("acquired_at")
        .and_then(|v| v.parse().ok())
        .map(from_unix_millis);
    Some(h)
}

fn encode_record(r: &AuditRecord) -> String {
    let h = &r.holder;
    let opt = |v: Option<String>| v.unwrap_or_default();
    let mut fields = r.operator_fields();
    fields.extend([
        ("owner", h.owner.clone()),
        ("token", opt(h.token.map(|t| t.to_string()))),
        ("holder_host", opt(h.host.clone())),
        ("pid", opt(h.pid.map(|p| p.to_string()))),
        ("client", opt(h.client.clone())),
        (
            "acquired_at",
            opt(h.acquired_at.map(|t| unix_millis(t).to_string())),
        ),
        ("ttl", opt(h.ttl.map(|t| t.as_millis().to_string()))),
    ]);
    encode_fields(&fields)
}

fn decode_record(value: &[u8]) -> Option<AuditRecord> {
    let f = decode_fields(value)?;
    AuditRecord::from_fields(|k| f.get(k).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_with_spaces_and_equals() {
        let v = encode_fields(&[
            ("owner", "ab".into()),
            ("host", "a b=c%".into()),
            ("pid", "7".into()),
        ]);
        let h = parse_meta(v.as_bytes()).unwrap();
        assert_eq!(
            (h.owner.as_str(), h.host.as_deref(), h.pid),
            ("ab", Some("a b=c%"), Some(7))
        );
        assert!(parse_meta(b"").is_none());
    }
}
