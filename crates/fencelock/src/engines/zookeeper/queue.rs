//! The waiter queue, as Curator's `LockInternals` keeps it.
//!
//! - **Lock**: a protected ephemeral sequential node `<lock path>/_c_<id>-lock-<seq>`, whose
//!   data is the holder's metadata. The id is the owner value written as a UUID, as Curator
//!   writes its protected-mode ids, so a create whose answer was lost (the connection dropped)
//!   is found again by name. The lock path is a container node, created with its parents on
//!   the first acquisition and deleted by the servers once it is empty, as Curator's
//!   `creatingParentContainersIfNeeded`. An uncontended acquisition is the create and one
//!   listing.
//! - **Waiting**: the children sorted by sequence are the queue; the first holds the lock.
//!   Each waiter watches only its predecessor (a data watch, as Curator sets one) and looks
//!   again when it goes: FIFO, no herd, no polling. The watch is re-armed every operation
//!   timeout, so a silent server cannot hold a waiter forever.
//! - **Token**: the creation zxid (`czxid`) of the holder's node. The zxid orders every write of
//!   the ensemble, and its high half is the leader's epoch, raised at every leader change, so a
//!   later grant always carries a larger one, across leader changes and full restarts. The
//!   sequence number would not do: it counts the children of the lock path, which the servers
//!   delete once empty (a container), so it starts again from 0.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use tokio::time::Instant;
use zookeeper_client::{Acls, CreateMode, Error as ZkError};

use super::call::{ok, zk_error};
use super::paths::{protected, queue, LATCH, LOCK};
use super::runbook::encode_fields;
use super::session::{Node, Session};
use super::{ZkEngine, KIND};
use crate::core::engine::{AcquireRequest, Attempt, WaitQueue};
use crate::core::error::{Error, Result};
use crate::core::holder::unix_millis;
use crate::core::token::FencingToken;

/// The protected-mode id of `owner`'s nodes: its 128 bits written as a UUID
/// (`8-4-4-4-12` hex digits), the form Curator gives its own.
pub(super) fn protected_id(owner: &str) -> String {
    if owner.len() == 32 && owner.bytes().all(|b| b.is_ascii_hexdigit()) {
        format!(
            "{}-{}-{}-{}-{}",
            &owner[..8],
            &owner[8..12],
            &owner[12..16],
            &owner[16..20],
            &owner[20..]
        )
    } else {
        owner.to_owned()
    }
}

impl ZkEngine {
    pub(super) fn acls(&self) -> Acls<'_> {
        Acls::new(&self.acls)
    }

    /// Creates the lock path (a container, with this client's ACL), and first the prefix
    /// (persistent nodes, open to every identity, so that other services can keep their own
    /// locks beside) only when it is missing: creating a node that exists still needs CREATE
    /// on its parent, which an operator may have confined (`fencelock acl`).
    async fn ensure_lock_path(&self, s: &Session, name: &str) -> Result<()> {
        let lock = self.paths.lock(name);
        let container = CreateMode::Container.with_acls(self.acls());
        let create = || async {
            self.read("create the lock path", || {
                s.client.create(&lock, &[], &container)
            })
            .await
        };
        let created = match create().await? {
            Err(ZkError::NoNode) => {
                let open = zookeeper_client::Acls::anyone_all();
                let dir = CreateMode::Persistent.with_acls(open);
                let root = self.paths.root().to_owned();
                ok(
                    "create the prefix",
                    self.read("create the prefix", || s.client.mkdir(&root, &dir))
                        .await?,
                )?;
                create().await?
            }
            other => other,
        };
        match created {
            Ok(_) | Err(ZkError::NodeExists) => Ok(()),
            Err(e) => Err(zk_error("create the lock path", e)),
        }
    }

    /// Creates `owner`'s waiter node; returns its path, its creation zxid, and whether the
    /// create's own answer came (a write through the leader: it vouches for the session, see
    /// [`super::proof`]), rather than the node being found again after a lost answer.
    async fn create_waiter(
        &self,
        s: &Session,
        name: &str,
        owner: &str,
        marker: &'static str,
        data: &[u8],
    ) -> Result<(String, i64, bool)> {
        let id = protected_id(owner);
        let prefix = self.paths.waiter(name, &id, marker);
        let mode = CreateMode::EphemeralSequential.with_acls(self.acls());
        let mut made_parents = false;
        let deadline = Instant::now() + self.op_timeout;
        loop {
            let sent = Instant::now();
            let created = self
                .bounded(
                    "create the waiter node",
                    s.client.create(&prefix, data, &mode),
                )
                .await?;
            match created {
                Ok((stat, seq)) => {
                    s.proof.confirmed(sent);
                    s.proof.answered(sent, Instant::now());
                    return Ok((format!("{prefix}{seq}"), stat.czxid, true));
                }
                Err(ZkError::NoNode) if !made_parents => {
                    self.ensure_lock_path(s, name).await?;
                    made_parents = true;
                }
                // Created or not? Curator's protected mode: look for the node by its id.
                Err(ZkError::ConnectionLoss) if Instant::now() < deadline => {
                    if let Some((path, czxid)) = self.find_waiter(s, name, &id).await? {
                        return Ok((path, czxid, false));
                    }
                }
                Err(e) => return Err(zk_error("create the waiter node", e)),
            }
        }
    }

    /// The node named with protected-mode id `id` under `name`'s lock path, if any.
    async fn find_waiter(
        &self,
        s: &Session,
        name: &str,
        id: &str,
    ) -> Result<Option<(String, i64)>> {
        let lock = self.paths.lock(name);
        let mine = protected(id);
        let children = match self
            .read("find the waiter node", || s.client.list_children(&lock))
            .await?
        {
            Ok(c) => c,
            Err(ZkError::NoNode) => return Ok(None),
            Err(e) => return Err(zk_error("find the waiter node", e)),
        };
        let Some(child) = children.into_iter().find(|c| c.starts_with(&mine)) else {
            return Ok(None);
        };
        let path = format!("{lock}/{child}");
        match self
            .read("read the waiter node", || s.client.get_data(&path))
            .await?
        {
            Ok((_, stat)) => Ok(Some((path, stat.czxid))),
            Err(ZkError::NoNode) => Ok(None),
            Err(e) => Err(zk_error("read the waiter node", e)),
        }
    }

    /// The queue of `name` (children of its lock path that are `marker` waiters, in order).
    pub(super) async fn read_queue(
        &self,
        s: &Session,
        name: &str,
        marker: &str,
    ) -> Result<Vec<(i64, String)>> {
        let lock = self.paths.lock(name);
        match self
            .read("read the queue", || s.client.list_children(&lock))
            .await?
        {
            Ok(children) => Ok(queue(&children, marker)),
            Err(ZkError::NoNode) => Ok(Vec::new()),
            Err(e) => Err(zk_error("read the queue", e)),
        }
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

    /// Waits until `path`'s node changes or goes, `deadline` passes (`false`) or one
    /// operation timeout has passed.
    async fn wait_for(&self, s: &Session, path: &str, deadline: Instant) -> Result<bool> {
        let watched = self
            .bounded("watch the predecessor", s.client.get_and_watch_data(path))
            .await?;
        let watcher = match watched {
            Ok((_, _, w)) => w,
            Err(ZkError::NoNode) => return Ok(true),
            Err(e) => return Err(zk_error("watch the predecessor", e)),
        };
        tokio::select! {
            _ = watcher.changed() => Ok(true),
            _ = tokio::time::sleep(self.op_timeout) => Ok(true),
            _ = tokio::time::sleep_until(deadline) => Ok(false),
        }
    }
}

#[async_trait]
impl WaitQueue for ZkEngine {
    async fn acquire_queued(
        &self,
        req: &AcquireRequest,
        wait: Duration,
        campaign: Option<&str>,
    ) -> Result<(Attempt, Instant)> {
        let started = Instant::now();
        let deadline = started + wait;
        let marker = if campaign.is_some() { LATCH } else { LOCK };
        // Checked by this client: ZooKeeper cannot make the create conditional on them.
        if let Some(max) = self.over_limits(&req.name, &req.owner, req.ttl).await? {
            return Ok((
                Attempt::OverQuota {
                    max,
                    retry_in: None,
                },
                started,
            ));
        }
        let session = self.session_for(Some(req.ttl)).await?;
        // Registered before the create is sent: a release after a cancelled acquisition then
        // finds the node by its protected name even if the create's answer never came.
        self.nodes().insert(
            req.owner.clone(),
            Node {
                name: req.name.clone(),
                path: None,
                czxid: 0,
                version: 0,
                session: session.id,
                granted: false,
                ttl: req.ttl,
                expires: started + req.ttl,
            },
        );
        let data = match campaign {
            Some(v) => v.to_owned(),
            None => Self::meta_value(req),
        };
        let (path, czxid, created) = self
            .create_waiter(&session, &req.name, &req.owner, marker, data.as_bytes())
            .await?;
        let Some(child) = path.rsplit('/').next().map(str::to_owned) else {
            return Err(Error::engine_failure(
                KIND,
                "ZooKeeper returned an empty path",
            ));
        };
        match self.nodes().get_mut(&req.owner) {
            Some(n) => {
                n.path = Some(path.clone());
                n.czxid = czxid;
            }
            None => return Err(session_ended()),
        }
        let mut waited = false;
        loop {
            let q = self.read_queue(&session, &req.name, marker).await?;
            let Some(me) = q.iter().position(|(_, c)| *c == child) else {
                // Its session expired, or an operator deleted it.
                return Err(session_ended());
            };
            if me == 0 {
                // The listing, a read, says nothing of the session on the leader: the grant
                // counts on it as far as the create vouched for it, or, after a wait or a
                // create found again, as far as a write now does (see `proof`).
                let since = if created && !waited {
                    session.proof.valid_from(req.ttl, started)
                } else {
                    match session
                        .confirm(self, "confirm the grant", &[path.as_str()])
                        .await?
                    {
                        Ok(sent) => session.proof.valid_from(req.ttl, sent),
                        Err(_) => return Err(session_ended()),
                    }
                };
                let token = token_of(czxid)?;
                let mut nodes = self.nodes();
                let Some(n) = nodes.get_mut(&req.owner) else {
                    return Err(session_ended());
                };
                n.granted = true;
                n.expires = since + req.ttl;
                return Ok((Attempt::Granted(token), since));
            }
            let held = |holder| Attempt::Held {
                holder,
                retry_in: None,
                wake: None,
            };
            if wait.is_zero() || Instant::now() >= deadline {
                let head = self.holder_at(&session, &req.name, &q[0].1).await;
                return Ok((held(head), started));
            }
            let prev = format!("{}/{}", self.paths.lock(&req.name), q[me - 1].1);
            waited = true;
            if !self.wait_for(&session, &prev, deadline).await? {
                let head = self.read_queue(&session, &req.name, marker).await?;
                let holder = match head.first() {
                    Some((_, c)) => self.holder_at(&session, &req.name, c).await,
                    None => None,
                };
                return Ok((held(holder), started));
            }
        }
    }
}

fn session_ended() -> Error {
    Error::engine_failure(
        KIND,
        "this waiter's node is gone (its ZooKeeper session expired, or it was deleted) while it \
         waited in the queue; the lock was not acquired",
    )
}

pub(super) fn token_of(czxid: i64) -> Result<FencingToken> {
    FencingToken::checked_from_stored(czxid)
        .filter(|t| t.get() > 0)
        .ok_or_else(|| Error::engine_failure(KIND, format!("ZooKeeper returned zxid {czxid}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protected_ids_are_uuids() {
        assert_eq!(
            protected_id("0123456789abcdef0123456789abcdef"),
            "01234567-89ab-cdef-0123-456789abcdef"
        );
        assert_eq!(protected_id("x"), "x");
    }
}
