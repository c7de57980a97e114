//! The limits of a prefix on etcd, checked by the client: etcd's transactions compare keys
//! with values and revisions, and cannot compare a lease's TTL with a stored cap or count a
//! client's keys across the prefix, so no grant can be made conditional on them there.
//!
//! The limits live at `<prefix>%limits` (no escaped name can produce `%l`), in the text form
//! of [`Limits`]. This client reads them before each acquisition (at most once a second: a
//! change reaches a running client within that) and refuses a TTL above `max-ttl` and an
//! acquisition beyond `max-held-per-client`, counting its own leases and acquisitions in
//! flight: etcd cannot tell whose keys are whose across processes. It stops a buggy client of
//! this library; it does not stop another client. The server-side control on etcd is its
//! RBAC: a role that may write only its own prefix (`fencelock acl`).

use std::time::Duration;

use etcd_client::GetOptions;
use tokio::time::Instant;

use super::{EtcdEngine, KIND};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::{Error, Result};
use crate::core::limits::{Limits, StoredLimits};

/// How long a reading of the limits is used before it is read again.
const FRESH_FOR: Duration = Duration::from_secs(1);

impl EtcdEngine {
    fn limits_key(&self) -> String {
        format!("{}%limits", self.keys.prefix)
    }

    /// The stored limits, read again when the last reading is older than [`FRESH_FOR`].
    pub(super) async fn current_limits(&self) -> Result<Limits> {
        if let Some((at, limits)) = *self.limits_seen() {
            if at.elapsed() < FRESH_FOR {
                return Ok(limits);
            }
        }
        let limits = self.stored_limits().await?;
        *self.limits_seen() = Some((Instant::now(), limits));
        Ok(limits)
    }

    fn limits_seen(&self) -> std::sync::MutexGuard<'_, Option<(Instant, Limits)>> {
        self.limits_seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn stored_limits(&self) -> Result<Limits> {
        let resp = self
            .get("read the limits", self.limits_key(), GetOptions::new())
            .await?;
        match resp.kvs().first() {
            None => Ok(Limits::default()),
            Some(kv) => kv.value_str().ok().and_then(Limits::decode).ok_or_else(|| {
                Error::engine_failure(
                    KIND,
                    format!(
                        "the limits at {} are malformed; store them again with fencelock \
                             limits set",
                        self.limits_key()
                    ),
                )
            }),
        }
    }

    pub(super) async fn read_limits(&self) -> Result<Vec<StoredLimits>> {
        let limits = self.stored_limits().await?;
        Ok(vec![StoredLimits {
            node: format!("etcd {}", self.endpoints),
            limits: Ok((!limits.is_empty()).then_some(limits)),
        }])
    }

    pub(super) async fn store_limits(&self, limits: &Limits) -> Result<()> {
        let key = self.limits_key();
        if limits.is_empty() {
            self.bounded("clear the limits", |mut c| {
                let key = key.clone();
                async move { c.delete(key, None).await }
            })
            .await?;
        } else {
            let value = limits.encode();
            self.bounded("store the limits", |mut c| {
                let (key, value) = (key.clone(), value.clone());
                async move { c.put(key, value, None).await }
            })
            .await?;
        }
        *self.limits_seen() = None;
        Ok(())
    }

    /// The renewals of `batch`: those beyond the cap are refused here, the others renewed.
    pub(super) async fn renew_within_limits(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let cap = match self.current_limits().await {
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
