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

/// `s` with every control character written as `\u{..}`: holder fields are written by other
/// clients, and a newline or a terminal escape in them must not forge a line of output.
pub(crate) fn escaped(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

impl fmt::Display for Holder {
    /// One line; control characters in the fields other clients wrote are escaped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.pid, &self.host) {
            (Some(pid), Some(host)) => write!(f, "pid {pid} on {}", escaped(host))?,
            (None, Some(host)) => write!(f, "host {}", escaped(host))?,
            _ => write!(f, "owner {}", escaped(&self.owner))?,
        }
        if let Some(client) = &self.client {
            write!(f, ", client {}", escaped(client))?;
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

// The conversions engines store times and durations with: signed 64-bit milliseconds (SQL
// `bigint`, Redis and etcd metadata), and Redis' microsecond queue places. Each is total: a
// time before the epoch or a negative value (never written by fencelock) reads as 0, and an
// out-of-range value saturates instead of wrapping.

/// Milliseconds since the Unix epoch, for metadata stored by engines.
pub(crate) fn unix_millis(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map(millis_of).unwrap_or(0)
}

/// The time [`unix_millis`] stored.
pub(crate) fn from_unix_millis(ms: i64) -> SystemTime {
    UNIX_EPOCH + duration_from_millis(ms)
}

/// Microseconds since the Unix epoch.
pub(crate) fn unix_micros(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A duration in whole milliseconds (a TTL, a window) for a signed 64-bit column or argument.
pub(crate) fn millis_of(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The duration [`millis_of`] stored.
pub(crate) fn duration_from_millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn holder_fields_cannot_forge_lines_or_escapes() {
        let mut h = Holder::bare("o\nwner".into());
        assert_eq!(h.to_string(), "owner o\\u{a}wner");
        h.host = Some("h\x1b[2J".into());
        h.pid = Some(7);
        h.client = Some("c\r\nfencelock: lock is free".into());
        let text = h.to_string();
        assert!(!text.chars().any(char::is_control), "{text}");
        assert!(text.contains("h\\u{1b}[2J"), "{text}");
    }

    #[test]
    fn conversions_clamp_at_the_edges() {
        assert_eq!(millis_of(Duration::MAX), i64::MAX);
        assert_eq!(millis_of(Duration::from_micros(1999)), 1);
        assert_eq!(duration_from_millis(-1), Duration::ZERO);
        assert_eq!(duration_from_millis(i64::MIN), Duration::ZERO);
        assert_eq!(from_unix_millis(-5), UNIX_EPOCH);
        let before_epoch = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(unix_millis(before_epoch), 0);
        assert_eq!(unix_micros(before_epoch), 0);
        assert_eq!(unix_micros(UNIX_EPOCH + Duration::from_micros(17)), 17);
    }

    proptest! {
        #[test]
        fn millis_round_trip(ms in 0..=i64::MAX) {
            prop_assert_eq!(millis_of(duration_from_millis(ms)), ms);
        }

        #[test]
        fn unix_millis_round_trip(ms in 0..(1i64 << 50)) {
            prop_assert_eq!(unix_millis(from_unix_millis(ms)), ms);
            prop_assert_eq!(unix_micros(from_unix_millis(ms)), ms as u64 * 1000);
        }

        #[test]
        fn millis_truncate_and_keep_the_order(a in any::<u64>(), b in any::<u64>()) {
            let (da, db) = (Duration::from_nanos(a), Duration::from_nanos(b));
            prop_assert_eq!(millis_of(da), (a / 1_000_000) as i64);
            if da <= db {
                prop_assert!(millis_of(da) <= millis_of(db));
            }
        }

        #[test]
        fn negative_millis_are_zero(ms in i64::MIN..0) {
            prop_assert_eq!(duration_from_millis(ms), Duration::ZERO);
            prop_assert_eq!(from_unix_millis(ms), UNIX_EPOCH);
        }
    }
}
