//! The client's one ZooKeeper session, shared by all its leases, and what follows from it.
//!
//! - **Session timeout**: the URL's `session_timeout=`, else the TTL of the acquisition that
//!   opened the session (10 s when a read opened it). The servers bound it between 2 and 20
//!   ticks (`minSessionTimeout`/`maxSessionTimeout`) and answer the timeout they granted. A
//!   lease must not trust its node longer than the servers keep it for a silent session: an
//!   acquisition whose TTL exceeds the granted timeout is refused while the session holds
//!   anything, and otherwise reopens the session with a timeout that fits.
//! - **Renewal**: one multi-read of every renewed lease's node, per batch. An answer confirms
//!   the session was alive when the batch was sent (the servers keep its nodes at least a
//!   session timeout, no less than the TTL, from then), and each node's creation zxid that it
//!   is still the node this lease created. A node that is gone is a lost lease. While the
//!   session is disconnected nothing is sent: renewals are unconfirmed, and the lease is lost
//!   at the end of its validity unless the session reconnects in time.
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
use zookeeper_client::{Client, Error as ZkError, MultiReadResult, SessionState};

use super::call::{ok, zk_error};
use super::paths::protected;
use super::{ZkEngine, KIND};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::{Error, Result};

/// The session timeout asked for when the first call is not an acquisition.
const READ_SESSION: Duration = Duration::from_secs(10);

/// How many nodes one renewal multi-read reads: ZooKeeper answers at most 1 MB at once.
const RENEW_CHUNK: usize = 512;

/// One ZooKeeper session.
pub(super) struct Session {
    pub(super) client: Client,
    /// The timeout the servers granted.
    pub(super) timeout: Duration,
    /// Tells this session's nodes from those of an earlier one.
    pub(super) id: i64,
}

impl Session {
    pub(super) fn alive(&self) -> bool {
        !self.client.state().is_terminated()
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
        *current = Some(session.clone());
        Ok(session)
    }

    fn weak(&self) -> Weak<ZkEngine> {
        self.me.clone()
    }

    async fn connect(&self, timeout: Duration) -> Result<Session> {
        let mut connector = Client::connector()
            .with_session_timeout(timeout)
            .with_fail_eagerly();
        if let (Some(u), Some(p)) = (&self.url.user, &self.url.password) {
            connector = connector.with_auth("digest", format!("{u}:{p}").as_bytes());
        }
        let target = self.url.connect_string();
        let client = match tokio::time::timeout(self.op_timeout, connector.connect(&target)).await {
            Ok(Ok(c)) => c,
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
        Ok(Session {
            timeout: client.session_timeout(),
            id: client.session_id().0,
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
        let known: Vec<(usize, String, i64)> = {
            let nodes = self.nodes();
            batch
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    let n = nodes.get(&r.owner)?;
                    let path = n.path.clone()?;
                    (n.session == session.id && n.granted).then_some((i, path, n.czxid))
                })
                .collect()
        };
        for chunk in known.chunks(RENEW_CHUNK) {
            let sent = Instant::now();
            let answers = self
                .read("renew", || {
                    let mut reader = session.client.new_multi_reader();
                    for (_, path, _) in chunk {
                        // A path the client refuses is not a lease's: it reads as gone.
                        let _ = reader.add_get_data(path);
                    }
                    reader.commit()
                })
                .await;
            let answers = match answers {
                Ok(Ok(a)) if a.len() == chunk.len() => a,
                Ok(Ok(_)) | Ok(Err(_)) | Err(_) => {
                    let why = match answers {
                        Ok(Err(e)) => zk_error("renew", e).to_string(),
                        Err(e) => e.to_string(),
                        Ok(Ok(_)) => "ZooKeeper answered a renewal for other nodes".to_owned(),
                    };
                    for (i, _, _) in chunk {
                        out[*i] = Renewed::Failed(why.clone());
                    }
                    continue;
                }
            };
            let mut nodes = self.nodes();
            for ((i, _, czxid), answer) in chunk.iter().zip(answers) {
                let owner = &batch[*i].owner;
                out[*i] = match answer {
                    MultiReadResult::Data { stat, .. } if stat.czxid == *czxid => {
                        if let Some(n) = nodes.get_mut(owner) {
                            n.expires = sent + n.ttl;
                        }
                        Renewed::Extended
                    }
                    MultiReadResult::Error {
                        err: ZkError::NoNode,
                    }
                    | MultiReadResult::Data { .. } => {
                        nodes.remove(owner);
                        Renewed::NotHolder
                    }
                    MultiReadResult::Error { err } => Renewed::Failed(err.to_string()),
                    _ => {
                        Renewed::Failed("ZooKeeper answered a renewal with another read".to_owned())
                    }
                };
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
