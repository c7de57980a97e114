//! The limits of a prefix on ZooKeeper, checked by the client: a ZooKeeper create cannot be
//! made conditional on a stored TTL cap or on a count of one client's nodes across the
//! prefix (a multi's checks compare versions only), and a node's lifetime is its session's,
//! not a TTL the servers see.
//!
//! The limits live at `<prefix>%limits` (no escaped name starts with `%l`: an escaped `%` is
//! `%25`), in the text form of [`Limits`], with this client's ACL. This client reads them
//! before each acquisition (at most once a second: a change reaches a running client within
//! that) and refuses a TTL above `max-ttl` and an acquisition beyond `max-held-per-client`,
//! counting its own leases and acquisitions in flight: ZooKeeper cannot tell whose nodes are
//! whose across processes. It stops a buggy client of this library; it does not stop another
//! client. The server-side control on ZooKeeper is its ACLs: the prefix's ACL confines who may
//! create lock paths under it (`fencelock acl`).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::{CreateMode, Error as ZkError};

use super::call::{ok, zk_error};
use super::session::Session;
use super::{ZkEngine, KIND};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::limits::{Limits, StoredLimits};

/// How long a reading of the limits is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(1);

impl ZkEngine {
    fn limits_path(&self) -> String {
        format!("{}%limits", self.paths.prefix)
    }

    /// A session to read or write the limits with: one fitting `ttl` (the acquisition's, so
    /// that it is not reopened right after), else whichever this client can have.
    async fn limits_session(&self, ttl: Option<Duration>) -> Result<Arc<Session>> {
        match self.session_for(ttl).await {
            // The TTL does not fit a session: the acquisition says so after the TTL cap has
            // had its say.
            Err(e) if ttl.is_some() && e.kind() == ErrorKind::InvalidInput => {
                self.session_for(None).await
            }
            r => r,
        }
    }

    /// The stored limits, read again when the last reading is older than [`FRESH_FOR`].
    pub(super) async fn current_limits(&self, ttl: Option<Duration>) -> Result<Limits> {
        if let Some((at, limits)) = *self.limits_seen() {
            if at.elapsed() < FRESH_FOR {
                return Ok(limits);
            }
        }
        let limits = self.stored_limits(ttl).await?;
        *self.limits_seen() = Some((Instant::now(), limits));
        Ok(limits)
    }

    fn limits_seen(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Limits)>> {
        self.limits_seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn stored_limits(&self, ttl: Option<Duration>) -> Result<Limits> {
        let s = self.limits_session(ttl).await?;
        let path = self.limits_path();
        let data = match self
            .read("read the limits", || s.client.get_data(&path))
            .await?
        {
            Ok((data, _)) => data,
            Err(ZkError::NoNode) => return Ok(Limits::default()),
            Err(e) => return Err(zk_error("read the limits", e)),
        };
        std::str::from_utf8(&data)
            .ok()
            .and_then(Limits::decode)
            .ok_or_else(|| {
                Error::engine_failure(
                    KIND,
                    format!(
                        "the limits at {path} are malformed; store them again with fencelock \
                         limits set"
                    ),
                )
            })
    }

    pub(super) async fn read_limits(&self) -> Result<Vec<StoredLimits>> {
        let limits = self.stored_limits(None).await?;
        Ok(vec![StoredLimits {
            node: format!("zookeeper {}", self.url.connect_string()),
            limits: Ok((!limits.is_empty()).then_some(limits)),
        }])
    }

    pub(super) async fn store_limits(&self, limits: &Limits) -> Result<()> {
        let s = self.limits_session(None).await?;
        let path = self.limits_path();
        if limits.is_empty() {
            match self
                .read("clear the limits", || s.client.delete(&path, None))
                .await?
            {
                Ok(()) | Err(ZkError::NoNode) => {}
                Err(e) => return Err(zk_error("clear the limits", e)),
            }
        } else {
            let value = limits.encode();
            let data = value.as_bytes();
            let mode = CreateMode::Persistent.with_acls(self.acls());
            let mut made_prefix = false;
            loop {
                match self
                    .read("store the limits", || s.client.set_data(&path, data, None))
                    .await?
                {
                    Ok(_) => break,
                    Err(ZkError::NoNode) => {}
                    Err(e) => return Err(zk_error("store the limits", e)),
                }
                match self
                    .read("store the limits", || s.client.create(&path, data, &mode))
                    .await?
                {
                    // Created by another client in between: set it again.
                    Ok(_) => break,
                    Err(ZkError::NodeExists) => {}
                    Err(ZkError::NoNode) if !made_prefix => {
                        let open = zookeeper_client::Acls::anyone_all();
                        let dir = CreateMode::Persistent.with_acls(open);
                        let root = self.paths.root().to_owned();
                        ok(
                            "create the prefix",
                            self.read("create the prefix", || s.client.mkdir(&root, &dir))
                                .await?,
                        )?;
                        made_prefix = true;
                    }
                    Err(e) => return Err(zk_error("store the limits", e)),
                }
            }
        }
        *self.limits_seen() = None;
        Ok(())
    }

    /// The refusal of an acquisition by `owner` with `ttl` that the stored limits forbid.
    pub(super) async fn over_limits(
        &self,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> Result<Option<u32>> {
        let limits = self.current_limits(Some(ttl)).await?;
        if let Some(refused) = limits.check_ttl(ttl) {
            return Err(refused.with_resource(name).with_engine(KIND));
        }
        Ok(limits.max_held_per_client().filter(|max| {
            let mine = self.nodes().keys().filter(|o| *o != owner).count();
            mine >= *max as usize
        }))
    }

    /// The renewals of `batch`: those beyond the cap are refused here, the others renewed.
    pub(super) async fn renew_within_limits(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let cap = match self.current_limits(None).await {
            Ok(limits) => limits.max_ttl(),
            // The cap cannot be read: renew rather than let every lease lapse.
            Err(_) => None,
        };
        let Some(max) = cap.filter(|max| batch.iter().any(|r| r.ttl > *max)) else {
            return self.renew(batch).await;
        };
        let allowed: Vec<Renewal> = batch.iter().filter(|r| r.ttl <= max).cloned().collect();
        let mut renewed = self.renew(&allowed).await?.into_iter();
        Ok(batch
            .iter()
            .map(|r| {
                if r.ttl > max {
                    Renewed::OverLimit(max)
                } else {
                    renewed
                        .next()
                        .unwrap_or_else(|| Renewed::Failed("no answer for this lease".into()))
                }
            })
            .collect())
    }
}
