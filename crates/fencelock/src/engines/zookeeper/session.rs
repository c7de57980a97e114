//! The client's one ZooKeeper session, shared by all its leases, and what follows from it.
//!
//! - **Session timeout**: the URL's `session_timeout=`, else the TTL of the acquisition that
//!   opened the session (10 s when a read opened it). The servers bound it between 2 and 20
//!   ticks (`minSessionTimeout`/`maxSessionTimeout`) and answer the timeout they granted. A
//!   lease must not trust its node longer than the servers keep it for a silent session: an
//!   acquisition whose TTL exceeds the granted timeout is refused while the session holds
//!   anything, and otherwise reopens the session with a timeout that fits.
//! - **Renewal**: one `multi` of `check` operations (any version) on every renewed lease's
//!   node, per batch: a write, so the leader answers it, checking the session and each node on
//!   its own state, where a read would be answered by whichever server the client is connected
//!   to, from its own copy, even one cut off from the leader. How long an answer lets the
//!   leases count on the session is worked out in [`super::proof`]: it is what makes the
//!   renewal `Renewed::ExtendedFrom` an instant up to about 3/8 of the session timeout before
//!   it was sent. A node that is gone is a lost lease. While the session is disconnected
//!   nothing is sent: renewals are unconfirmed, and the lease is lost at the end of its
//!   validity unless the session reconnects in time.
//! - **Loss**: when the session expires (or is closed, or its authentication fails), every
//!   lease it held is reported lost at once, through the watchdog's loss feed; its nodes are
//!   gone with it on the servers, and nothing is created again behind the holder's back.
//! - **Release** deletes the owner's node. A node whose creation was never answered is found
//!   by its protected-mode name (`_c_<owner>-`) and deleted too, so a cancelled acquisition
//!   leaves nothing behind. A lease dropped without release is neither renewed nor released:
//!   its node is deleted here once its TTL has passed since its last confirmed renewal.

use std::sync::{Arc, MutexGuard, Weak};
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{Client, Error as ZkError, MultiWriteError, SessionState};

use super::call::{ok, zk_error};
use super::paths::protected;
use super::proof::Proof;
use super::{ZkEngine, KIND};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::{Error, Result};

/// The session timeout asked for when the first call is not an acquisition.
const READ_SESSION: Duration = Duration::from_secs(10);

/// How many nodes one renewal `multi` checks: ZooKeeper takes requests of at most 1 MB.
const RENEW_CHUNK: usize = 512;

/// One ZooKeeper session.
pub(super) struct Session {
    pub(super) client: Client,
    /// The timeout the servers granted.
    pub(super) timeout: Duration,
    /// Tells this session's nodes from those of an earlier one.
    pub(super) id: i64,
    /// What the leader is known to have seen of it.
    pub(super) proof: Proof,
}

impl Session {
    pub(super) fn alive(&self) -> bool {
        !self.client.state().is_terminated()
    }

    /// Confirms by a write through the leader that the nodes at `paths` exist and that the
    /// session is alive. `Ok(Ok(sent))`: all confirmed by a write sent at `sent`; `Ok(Err(i))`: node `i` is gone, the others unconfirmed.
    pub(super) async fn confirm(
        &self,
        engine: &ZkEngine,
        what: &str,
        paths: &[&str],
    ) -> Result<std::result::Result<Instant, usize>> {
        let sent = Instant::now();
        let mut writer = self.client.new_multi_writer();
        for path in paths {
            writer
                .add_check_version(path, -1)
                .map_err(|e| zk_error(what, e))?;
        }
        let answer = engine.bounded(what, writer.commit()).await?;
        match answer {
            Ok(_) => {
                let at = Instant::now();
                self.proof.confirmed(sent);
                self.proof.answered(sent, at);
                Ok(Ok(sent))
            }
            Err(MultiWriteError::OperationFailed {
                index,
                source: ZkError::NoNode,
            }) => {
                self.proof.answered(sent, Instant::now());
                Ok(Err(index))
            }
            Err(MultiWriteError::OperationFailed { source, .. })
            | Err(MultiWriteError::RequestFailed { source }) => Err(zk_error(what, source)),
        }
    }
}

/// One waiter or holder node of this client.
#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) name: String,
    /// The node's full path once its creation was answered.
    pub(super) path: Option<String>,
    pub(super) czxid: i64,
    /// The data version, for an owner-checked `setData` (proclaim).
    pub(super) version: i32,
    pub(super) session: i64,
    pub(super) granted: bool,
    pub(super) ttl: Duration,
    /// A granted node neither renewed nor released by then belongs to a dropped lease.
    pub(super) expires: Instant,
}

impl ZkEngine {
    pub(super) fn nodes(&self) -> MutexGuard<'_, std::collections::HashMap<String, Node>> {
        self.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The live session, opening one whose timeout fits `ttl` (a lease's TTL) if needed.
    pub(super) async fn session_for(&self, ttl: Option<Duration>) -> Result<Arc<Session>> {
        let mut current = self.session.lock().await;
        if let Some(s) = current.as_ref().filter(|s| s.alive()) {
            match ttl {
                Some(ttl) if ttl > s.timeout => {
                    let busy = self.nodes().values().any(|n| n.session == s.id);
                    if busy || self.url.session_timeout.is_some() {
                        return Err(Error::invalid(format!(
                            "a TTL of {} is longer than the {} ZooKeeper session this client \
                             holds its locks with, which the servers would let expire first; \
                             use a TTL of at most the session timeout, or set \
                             session_timeout= in the URL (the servers allow 2 to 20 ticks)",
                            show(ttl),
                            show(s.timeout)
                        )));
                    }
                }
                _ => return Ok(s.clone()),
            }
        }
        // The old session closes once its last handle (a call still in flight) is dropped.
        if let Some(old) = current.take() {
            self.forget_session(old.id);
        }
        let wanted = self
            .url
            .session_timeout
            .or(ttl)
            .unwrap_or(READ_SESSION)
            .max(Duration::from_millis(1));
        let session = Arc::new(self.connect(wanted).await?);
        if let Some(ttl) = ttl.filter(|t| *t > session.timeout) {
            return Err(Error::invalid(format!(
                "the ZooKeeper servers granted a session of {} for a TTL of {}: their \
                 maxSessionTimeout (20 ticks by default) is below the TTL; use a TTL of at \
                 most {}",
                show(session.timeout),
                show(ttl),
                show(session.timeout)
            )));
        }
        watch_session(self.weak(), session.id, session.client.state_watcher());
        keep_shown(Arc::downgrade(&session), self.op_timeout);
        *current = Some(session.clone());
        Ok(session)
    }

    fn weak(&self) -> Weak<ZkEngine> {
        self.me.clone()
    }

    async fn connect(&self, timeout: Duration) -> Result<Session> {
        // The session's creation sets its expiry on the leader after this (see `proof`).
        let connecting = Instant::now();
        let mut connector = Client::connector()
            .with_session_timeout(timeout)
            .with_fail_eagerly();
        if let (Some(u), Some(p)) = (&self.url.user, &self.url.password) {
            connector = connector.with_auth("digest", format!("{u}:{p}").as_bytes());
        }
        let target = self.url.connect_string();
        let connecting_to = async {
            match &self.tls {
                None => connector.connect(&target).await,
                Some(tls) => {
                    // The client builds its TLS configuration from the process' default
                    // provider, and rustls cannot pick one with both ring and aws-lc compiled in.
                    crate::core::tls::ensure_provider();
                    connector
                        .with_tls(tls.clone())
                        .secure_connect(&target)
                        .await
                }
            }
        };
        let client = match tokio::time::timeout(self.op_timeout, connecting_to).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) if self.tls.is_some() => {
                return Err(Error::engine_failure(
                    KIND,
                    format!(
                        "ZooKeeper failed to open a TLS session with {target}: {e}; check that \
                         these are the servers' TLS client ports (secureClientPort), that ca= \
                         names the CA that signed their certificates, for the host names in \
                         the URL, and that cert= and key= give a client certificate they \
                         accept"
                    ),
                ))
            }
            Ok(Err(e)) => return Err(zk_error(&format!("open a session with {target}"), e)),
            Err(_) => {
                return Err(Error::engine_failure(
                    KIND,
                    format!(
                        "no ZooKeeper server at {target} opened a session within {}; check \
                         that a majority of the ensemble is up",
                        show(self.op_timeout)
                    ),
                ))
            }
        };
        let timeout = client.session_timeout();
        Ok(Session {
            timeout,
            id: client.session_id().0,
            proof: Proof::new(timeout, connecting),
            client,
        })
    }

    /// Forgets the nodes of a session that ended, reporting its leases lost.
    fn forget_session(&self, id: i64) {
        let mut lost = Vec::new();
        self.nodes().retain(|owner, n| {
            if n.session != id {
                return true;
            }
            if n.granted {
                lost.push(owner.clone());
            }
            false
        });
        for owner in lost {
            let _ = self.losses.send(owner);
        }
    }

    /// Renews every lease of the batch with one multi-read per chunk.
    pub(super) async fn renew(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let mut out = vec![Renewed::NotHolder; batch.len()];
        let session = self.session.lock().await.clone();
        let Some(session) = session.filter(|s| s.alive()) else {
            return Ok(out);
        };
        if session.client.state() == SessionState::Disconnected {
            let why = "disconnected from ZooKeeper: the session may still be alive, but nothing \
                       confirms it"
                .to_owned();
            // Leases of an older session are gone; the others are unconfirmed.
            let nodes = self.nodes();
            for (i, r) in batch.iter().enumerate() {
                if nodes.get(&r.owner).is_some_and(|n| n.session == session.id) {
                    out[i] = Renewed::Failed(why.clone());
                }
            }
            return Ok(out);
        }
        let known: Vec<(usize, String)> = {
            let nodes = self.nodes();
            batch
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    let n = nodes.get(&r.owner)?;
                    let path = n.path.clone()?;
                    (n.session == session.id && n.granted).then_some((i, path))
                })
                .collect()
        };
        for chunk in known.chunks(RENEW_CHUNK) {
            let mut left: Vec<&(usize, String)> = chunk.iter().collect();
            // A gone node fails the whole `multi`: it is taken out and the others asked again.
            while !left.is_empty() {
                let paths: Vec<&str> = left.iter().map(|(_, p)| p.as_str()).collect();
                match session.confirm(self, "renew", &paths).await {
                    Ok(Ok(sent)) => {
                        let mut nodes = self.nodes();
                        for (i, _) in &left {
                            let r = &batch[*i];
                            let from = session.proof.valid_from(r.ttl, sent);
                            if let Some(n) = nodes.get_mut(&r.owner) {
                                n.expires = from + n.ttl;
                            }
                            out[*i] = Renewed::ExtendedFrom(from);
                        }
                        break;
                    }
                    Ok(Err(gone)) => {
                        let (i, _) = left.remove(gone.min(left.len() - 1));
                        self.nodes().remove(&batch[*i].owner);
                        out[*i] = Renewed::NotHolder;
                    }
                    Err(e) => {
                        let why = e.to_string();
                        for (i, _) in &left {
                            out[*i] = Renewed::Failed(why.clone());
                        }
                        break;
                    }
                }
            }
        }
        Ok(out)
    }

    /// Deletes `owner`'s node, found by path or (creation unanswered) by its protected name.
    /// Whether it held the lock and its node is now deleted.
    pub(super) async fn delete_node(&self, owner: &str) -> Result<bool> {
        let Some(node) = self.nodes().remove(owner) else {
            return Ok(false);
        };
        let session = self.session.lock().await.clone();
        let Some(session) = session.filter(|s| s.alive() && s.id == node.session) else {
            // Its session ended: the servers deleted the node with it.
            return Ok(false);
        };
        let path = match node.path {
            Some(p) => p,
            None => {
                let lock = self.paths.lock(&node.name);
                let mine = protected(&super::queue::protected_id(owner));
                let children = self
                    .read("find the waiter node", || {
                        session.client.list_children(&lock)
                    })
                    .await?;
                match children {
                    Ok(c) => match c.into_iter().find(|c| c.starts_with(&mine)) {
                        Some(c) => format!("{lock}/{c}"),
                        None => return Ok(false),
                    },
                    Err(ZkError::NoNode) => return Ok(false),
                    Err(e) => return Err(zk_error("find the waiter node", e)),
                }
            }
        };
        let deleted = self
            .read("release", || session.client.delete(&path, None))
            .await?;
        match deleted {
            Ok(()) => Ok(node.granted),
            Err(ZkError::NoNode) => Ok(false),
            Err(e) => ok("release", Err(e)),
        }
    }
}

/// Reports every lease of session `id` lost when the session ends.
fn watch_session(engine: Weak<ZkEngine>, id: i64, mut states: zookeeper_client::StateWatcher) {
    tokio::spawn(async move {
        loop {
            let state = states.changed().await;
            tracing::debug!(session = id, ?state, "ZooKeeper session state");
            if state.is_terminated() {
                if let Some(e) = engine.upgrade() {
                    e.forget_session(id);
                }
                return;
            }
            if engine.strong_count() == 0 {
                return;
            }
        }
    });
}

/// While session `session` lives, sends a cheap read whenever it has had no answer for a
/// heartbeat ([`Proof::heartbeat`]), so that its next write has a recent answer to vouch for.
fn keep_shown(session: Weak<Session>, op_timeout: Duration) {
    tokio::spawn(async move {
        loop {
            let pause = match session.upgrade() {
                Some(s) if s.alive() => s.proof.heartbeat().saturating_sub(s.proof.quiet_for()),
                _ => return,
            };
            tokio::time::sleep(pause.max(Duration::from_millis(1))).await;
            let Some(s) = session.upgrade().filter(|s| s.alive()) else {
                return;
            };
            if s.proof.quiet_for() < s.proof.heartbeat()
                || s.client.state() != SessionState::SyncConnected
            {
                continue;
            }
            let sent = Instant::now();
            // Any answer from a server, "no node" included, shows the request reached it.
            if let Ok(Ok(_) | Err(ZkError::NoNode)) =
                tokio::time::timeout(op_timeout, s.client.check_stat("/")).await
            {
                s.proof.answered(sent, Instant::now());
            }
        }
    });
}

/// Deletes the nodes of leases dropped without release once their TTL has passed since their
/// last confirmed renewal, until the engine is gone.
pub(super) fn sweep_dropped(engine: Weak<ZkEngine>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(e) = engine.upgrade() else {
                return;
            };
            let now = Instant::now();
            let expired: Vec<String> = e
                .nodes()
                .iter()
                .filter(|(_, n)| n.granted && n.expires <= now)
                .map(|(o, _)| o.clone())
                .collect();
            for owner in expired {
                tracing::debug!("deleting the node of a lease dropped without release");
                let _ = e.delete_node(&owner).await;
            }
        }
    });
}

fn show(d: Duration) -> String {
    crate::core::options::display_duration(d)
}
