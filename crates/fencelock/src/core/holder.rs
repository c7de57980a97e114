//! Holder metadata: who holds a lock, for messages, `inspect` and the stuck-lock runbook.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::core::token::FencingToken;

/// Who holds a lock, as the engine recorded it at grant and renewal time.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The holder's random owner value (128 bits, lower-case hex), or the value another client
    /// stored when it took the lock with a plain `SET key value NX PX`.
    pub owner: String,
    /// The holder's fencing token, when the engine knows it.
    pub token: Option<FencingToken>,
    /// Host name of the holder's machine, when recorded.
    pub host: Option<String>,
    /// Process id of the holder, when recorded.
    pub pid: Option<u32>,
    /// Client name the holder gave, when recorded.
    pub client: Option<String>,
    /// When the lease was granted (holder's wall clock), when recorded.
    pub acquired_at: Option<SystemTime>,
    /// When the lease was last renewed (holder's wall clock), when recorded.
    pub renewed_at: Option<SystemTime>,
    /// Time left before the engine lets the lock expire.
    pub ttl_left: Option<Duration>,
    /// The lease's TTL, to which every renewal resets the expiry, when recorded. With
    /// `ttl_left` it gives the time since the last renewal on the engine's own clock.
    pub ttl: Option<Duration>,
}

impl Holder {
    pub(crate) fn bare(owner: String) -> Holder {
        Holder {
            owner,
            token: None,
            host: None,
            pid: None,
            client: None,
            acquired_at: None,
            renewed_at: None,
            ttl_left: None,
            ttl: None,
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.pid, &self.host) {
            (Some(pid), Some(host)) => write!(f, "pid {pid} on {host}")?,
            (None, Some(host)) => write!(f, "host {host}")?,
            _ => write!(f, "owner {}", self.owner)?,
        }
        if let Some(client) = &self.client {
            write!(f, ", client {client}")?;
        }
        if let Some(token) = self.token {
            write!(f, ", token {token}")?;
        }
        if let Some(left) = self.ttl_left {
            write!(f, ", {} left", crate::core::options::display_duration(left))?;
        }
        Ok(())
    }
}

/// What this client writes about itself next to every lease it takes.
#[derive(Debug, Clone)]
pub(crate) struct HolderMeta {
    pub host: String,
    pub pid: u32,
    pub client: String,
}

impl HolderMeta {
    pub(crate) fn current(client: String) -> HolderMeta {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "unknown-host".to_owned());
        HolderMeta {
            host,
            pid: std::process::id(),
            client,
        }
    }
}

/// Milliseconds since the Unix epoch, for metadata stored by engines.
pub(crate) fn unix_millis(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

pub(crate) fn from_unix_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
