//! Elections in the layout of Curator's `LeaderLatch`: candidates are protected ephemeral
//! sequential nodes `<lock path>/_c_<id>-latch-<seq>` whose data is the campaign value (what
//! `LeaderLatch` stores as the participant id), and the leader is the first of them. Curator's
//! `LeaderLatch` on the same path and fencelock's campaigns share one queue, and each reads
//! the other's leader and value (`LeaderLatch.getLeader().getId()`).
//!
//! Observers watch the lock path's children and the leader's node (watches, no polling), so
//! they see a change of leader and a proclaimed value. A proclaim is a `setData` on the
//! leader's node with the version this campaign last wrote, so a node changed by anyone else
//! is left alone.

use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use zookeeper_client::Error as ZkError;

use super::call::zk_error;
use super::paths::LATCH;
use super::ZkEngine;
use crate::core::engine::Elections;
use crate::core::error::Result;
use crate::core::records::{publish, Leader};
use crate::core::token::FencingToken;

impl ZkEngine {
    async fn leader_now(&self, name: &str) -> Result<Option<(String, Leader)>> {
        let s = self.session_for(None).await?;
        let q = self.read_queue(&s, name, LATCH).await?;
        for (_, child) in q.iter().take(3) {
            let path = format!("{}/{child}", self.paths.lock(name));
            match self
                .read("read the leader", || s.client.get_data(&path))
                .await?
            {
                Ok((data, stat)) => {
                    let leader = Leader {
                        value: String::from_utf8_lossy(&data).into_owned(),
                        token: FencingToken::from_stored(stat.czxid),
                    };
                    return Ok(Some((path, leader)));
                }
                Err(ZkError::NoNode) => continue,
                Err(e) => return Err(zk_error("read the leader", e)),
            }
        }
        Ok(None)
    }

    /// Publishes the leader, then waits for a change of the candidates or of the leader's
    /// node (or one operation timeout, after which the watches are set again).
    async fn observe_once(&self, name: &str, tx: &watch::Sender<Option<Leader>>) -> Result<()> {
        let s = self.session_for(None).await?;
        let lock = self.paths.lock(name);
        let children = self
            .bounded(
                "watch the election",
                s.client.list_and_watch_children(&lock),
            )
            .await?;
        let candidates = match children {
            Ok((_, w)) => Some(w),
            // No candidate yet: wait for the path to be created.
            Err(ZkError::NoNode) => None,
            Err(e) => return Err(zk_error("watch the election", e)),
        };
        let created = match candidates {
            Some(_) => None,
            None => match self
                .bounded("watch the election", s.client.check_and_watch_stat(&lock))
                .await?
            {
                Ok((None, w)) => Some(w),
                // Created since the children were asked for: a watch on its stat would miss
                // the first candidate, so its children are watched instead, at once.
                Ok((Some(_), _)) => return Ok(()),
                Err(e) => return Err(zk_error("watch the election", e)),
            },
        };
        let leader = self.leader_now(name).await?;
        let value_watch = match &leader {
            Some((path, _)) => match self
                .bounded("watch the leader", s.client.get_and_watch_data(path))
                .await?
            {
                Ok((_, _, w)) => Some(w),
                Err(_) => None,
            },
            None => None,
        };
        publish(tx, leader.map(|(_, l)| l));
        let any = async {
            match (candidates, created) {
                (Some(w), _) | (None, Some(w)) => {
                    w.changed().await;
                }
                (None, None) => std::future::pending::<()>().await,
            }
        };
        let value = async {
            match value_watch {
                Some(w) => {
                    w.changed().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = any => {}
            _ = value => {}
            _ = tokio::time::sleep(self.op_timeout) => {}
        }
        Ok(())
    }
}

#[async_trait]
impl Elections for ZkEngine {
    async fn leader(&self, name: &str) -> Result<Option<Leader>> {
        Ok(self.leader_now(name).await?.map(|(_, l)| l))
    }

    async fn proclaim(&self, _name: &str, owner: &str, value: &str) -> Result<bool> {
        let Some(node) = self.nodes().get(owner).cloned() else {
            return Ok(false);
        };
        let Some(path) = node.path.filter(|_| node.granted) else {
            return Ok(false);
        };
        let s = self.session_for(None).await?;
        if s.id != node.session {
            return Ok(false);
        }
        let set = self
            .bounded(
                "proclaim",
                s.client
                    .set_data(&path, value.as_bytes(), Some(node.version)),
            )
            .await?;
        match set {
            Ok(stat) => {
                if let Some(n) = self.nodes().get_mut(owner) {
                    n.version = stat.version;
                }
                Ok(true)
            }
            Err(ZkError::NoNode | ZkError::BadVersion) => Ok(false),
            Err(e) => Err(zk_error("proclaim", e)),
        }
    }

    async fn observe(&self, name: &str, tx: &watch::Sender<Option<Leader>>) {
        loop {
            tokio::select! {
                _ = tx.closed() => return,
                r = self.observe_once(name, tx) => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "observing the election failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }
}
