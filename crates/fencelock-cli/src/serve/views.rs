//! The JSON shapes the API answers with. Field names match `fencelock inspect --json` and
//! `audit --json`; times are RFC 3339 in UTC, durations in milliseconds (`*_ms`). Optional
//! fields are left out when unknown rather than sent as `null`.

use std::time::{Duration, SystemTime};

use fencelock::{AuditRecord, Holder};
use serde::Serialize;
use utoipa::ToSchema;

pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub fn when(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Who holds a lock, and how they look from the sidecar's host.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HolderView {
    /// The lock's resource name.
    pub resource: String,
    /// The holder's owner value.
    pub owner: String,
    /// The holder's fencing token.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    pub token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub host: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u32, required = false)]
    pub pid: Option<u32>,
    /// The client name recorded with the lease.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub client: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub acquired_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub renewed_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    pub ttl_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    pub ttl_left_ms: Option<u64>,
    /// Time since the last renewal, on the engine's clock where it can be.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    pub since_renewal_ms: Option<u64>,
    /// `healthy`, `suspect` or `unknown`.
    pub verdict: &'static str,
    /// Whether a forced release is refused unless the holder is declared dead.
    pub looks_alive: bool,
    /// The evidence behind the verdict.
    pub reason: String,
}

impl HolderView {
    pub fn of(resource: &str, h: &Holder) -> HolderView {
        let a = h.assess();
        HolderView {
            resource: resource.to_owned(),
            owner: h.owner.clone(),
            token: h.token.map(|t| t.get()),
            host: h.host.clone(),
            pid: h.pid,
            client: h.client.clone(),
            acquired_at: h.acquired_at.map(when),
            renewed_at: h.renewed_at.map(when),
            ttl_ms: h.ttl.map(ms),
            ttl_left_ms: h.ttl_left.map(ms),
            since_renewal_ms: a.since_renewal.map(ms),
            verdict: a.verdict.as_str(),
            looks_alive: a.looks_alive,
            reason: a.reason,
        }
    }
}

/// A lock as `inspect` sees it.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockView {
    pub resource: String,
    /// The backend it is on: its name in the routing configuration, else `default`.
    pub backend: String,
    /// The engine (`sqlite`, `redis`, ...).
    pub engine: &'static str,
    pub held: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = HolderView, required = false)]
    pub holder: Option<HolderView>,
    /// The lease this sidecar holds on it for an application, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = SidecarLeaseView, required = false)]
    pub sidecar: Option<SidecarLeaseView>,
}

/// The held locks a client may see, and the backends that failed to answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct LockList {
    /// The locks the backends that answered hold, sorted by name.
    pub locks: Vec<LockView>,
    /// The backends that failed to answer, whose locks are missing from `locks`; empty when
    /// every backend answered.
    pub failed_backends: Vec<FailedBackend>,
}

/// The audit records a client may see, and the backends that failed to answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditLog {
    /// The records of the backends that answered, newest first.
    pub records: Vec<AuditView>,
    /// The backends that failed to answer, whose records are missing; empty when every
    /// backend answered.
    pub failed_backends: Vec<FailedBackend>,
}

/// A backend of the routing configuration that failed to answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct FailedBackend {
    /// Its name in the routing configuration.
    pub backend: String,
    /// Why: it could not be reached or opened, failed, or did not answer in time.
    pub message: String,
}

/// What the sidecar knows of a lease it holds for an application.
#[derive(Debug, Serialize, ToSchema)]
pub struct SidecarLeaseView {
    /// Open event streams for the lease.
    pub streams: usize,
    /// Renewals the watchdog confirmed.
    pub renewals: u64,
    /// `app` (kept by keep-alives) or `dapr` (held for its TTL, not renewed).
    pub mode: &'static str,
}

/// One forced release, from the engine's audit log.
#[derive(Debug, Serialize, ToSchema)]
pub struct AuditView {
    pub id: String,
    pub resource: String,
    pub at: String,
    pub user: String,
    pub host: String,
    pub reason: String,
    pub holder_declared_dead: bool,
    pub assessment: String,
    pub holder: HolderView,
    /// The fencing counter after the release: every later token is above it.
    pub counter: u64,
}

impl AuditView {
    pub fn of(r: &AuditRecord) -> AuditView {
        let mut holder = HolderView::of(&r.resource, &r.holder);
        // The verdict of a record is the one it was released with, not a judgement now.
        holder.verdict = "released";
        holder.looks_alive = false;
        holder.reason = r.assessment.clone();
        AuditView {
            id: r.id.clone(),
            resource: r.resource.clone(),
            at: when(r.at),
            user: r.user.clone(),
            host: r.host.clone(),
            reason: r.reason.clone(),
            holder_declared_dead: r.holder_declared_dead,
            assessment: r.assessment.clone(),
            holder,
            counter: r.counter.get(),
        }
    }
}
