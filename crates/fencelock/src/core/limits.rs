//! Limits an operator stores in the engine under a prefix: a TTL cap and a per-client quota of
//! held leases. The engine checks them inside the grant (the Redis scripts on every node, the
//! SQLite transaction, the PostgreSQL statements); etcd cannot, so its client checks them
//! (see `docs/security.md`). This module is the engine-neutral part: the value, the text form
//! stored where an engine keeps a string (Redis, etcd), and the errors a refusal becomes.

use std::fmt;
use std::time::Duration;

use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::millis_of;
use crate::core::options::{display_duration, MIN_TTL, TTL_CEILING};

/// The largest quota of held leases one client may be given.
pub const MAX_HELD_CEILING: u32 = 1_000_000;

/// The limits stored under one prefix. Both are optional; an empty value means no limit.
///
/// # Examples
/// ```
/// use std::time::Duration;
/// let limits = fencelock::Limits::default()
///     .with_max_ttl(Duration::from_secs(600))
///     .with_max_held_per_client(100);
/// assert_eq!(limits.max_ttl(), Some(Duration::from_secs(600)));
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    max_ttl: Option<Duration>,
    max_held: Option<u32>,
}

impl Limits {
    /// A cap on the TTL of every grant and renewal under the prefix (whole milliseconds).
    pub fn with_max_ttl(mut self, max: Duration) -> Limits {
        self.max_ttl = Some(Duration::from_millis(
            u64::try_from(max.as_millis()).unwrap_or(u64::MAX),
        ));
        self
    }

    /// A cap on how many leases one client (by client name, or by the client's random id
    /// when it was given no name) may hold at once under the prefix.
    pub fn with_max_held_per_client(mut self, max: u32) -> Limits {
        self.max_held = Some(max);
        self
    }

    /// The TTL cap, if any.
    pub fn max_ttl(&self) -> Option<Duration> {
        self.max_ttl
    }

    /// The per-client quota, if any.
    pub fn max_held_per_client(&self) -> Option<u32> {
        self.max_held
    }

    /// No limit at all.
    pub fn is_empty(&self) -> bool {
        self.max_ttl.is_none() && self.max_held.is_none()
    }

    /// Checks the values before they are stored: a cap below the shortest TTL any lease may
    /// have, or a quota of zero, would refuse every grant.
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(t) = self.max_ttl {
            if t < MIN_TTL || t > TTL_CEILING {
                return Err(Error::invalid(format!(
                    "a max-ttl of {} is outside {}..={}",
                    display_duration(t),
                    display_duration(MIN_TTL),
                    display_duration(TTL_CEILING)
                )));
            }
        }
        if let Some(n) = self.max_held {
            if n == 0 || n > MAX_HELD_CEILING {
                return Err(Error::invalid(format!(
                    "a max-held-per-client of {n} is outside 1..={MAX_HELD_CEILING}"
                )));
            }
        }
        Ok(())
    }

    /// The TTL cap in milliseconds, 0 for none (what the engines store and compare).
    pub(crate) fn max_ttl_ms(&self) -> i64 {
        self.max_ttl.map_or(0, millis_of)
    }

    /// The quota, 0 for none.
    pub(crate) fn max_held_value(&self) -> i64 {
        self.max_held.map_or(0, i64::from)
    }

    /// The limits from the stored numbers (0 or negative: no limit).
    pub(crate) fn from_stored(max_ttl_ms: i64, max_held: i64) -> Limits {
        Limits {
            max_ttl: u64::try_from(max_ttl_ms)
                .ok()
                .filter(|v| *v > 0)
                .map(Duration::from_millis),
            max_held: u32::try_from(max_held).ok().filter(|v| *v > 0),
        }
    }

    /// The text form kept in a string value: `"<max_ttl_ms> <max_held>"`, 0 for no limit.
    /// The Redis scripts read it with one `string.match`.
    pub(crate) fn encode(&self) -> String {
        format!("{} {}", self.max_ttl_ms(), self.max_held_value())
    }

    /// The value [`Limits::encode`] wrote; `None` for anything else.
    pub(crate) fn decode(s: &str) -> Option<Limits> {
        let (t, h) = s.split_once(' ')?;
        let digits = |v: &str| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
        if !digits(t) || !digits(h) {
            return None;
        }
        Some(Limits::from_stored(t.parse().ok()?, h.parse().ok()?))
    }

    /// The refusal of a TTL above the cap, if it is; for the engines that check on the client
    /// (etcd) and for messages.
    pub(crate) fn check_ttl(&self, ttl: Duration) -> Option<Error> {
        let max = self.max_ttl?;
        (ttl > max).then(|| ttl_refused(max, ttl))
    }
}

impl fmt::Display for Limits {
    /// `max-ttl 10m, max-held-per-client 100`, or `no limits`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(t) = self.max_ttl {
            parts.push(format!("max-ttl {}", display_duration(t)));
        }
        if let Some(n) = self.max_held {
            parts.push(format!("max-held-per-client {n}"));
        }
        if parts.is_empty() {
            f.write_str("no limits")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// The limits one node (or the one database) of an engine stores, for `fencelock limits show`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredLimits {
    /// The node (`host:port`) or database the limits were read from.
    pub node: String,
    /// What it stores: `Ok(None)` when no limits are set there, `Err` with the reason when
    /// the node could not be read.
    pub limits: std::result::Result<Option<Limits>, String>,
}

/// A TTL above the cap: not retryable, the caller must ask for a shorter TTL.
pub(crate) fn ttl_refused(max: Duration, ttl: Duration) -> Error {
    Error::new(
        ErrorKind::LimitExceeded,
        format!(
            "refused by the limit max-ttl = {}: a TTL of {} is longer; use a shorter TTL (the \
             watchdog renews it) or ask the operator to raise the limit",
            display_duration(max),
            display_duration(ttl)
        ),
    )
}

/// The client holds its quota of leases already.
pub(crate) fn quota_refused(max: u32, who: &str) -> Error {
    Error::new(
        ErrorKind::LimitExceeded,
        format!(
            "refused by the limit max-held-per-client = {max}: client {who:?} already holds \
             {max} leases under this prefix; release one, or wait for one to expire"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn zero_means_no_limit() {
        assert_eq!(Limits::decode("0 0"), Some(Limits::default()));
        assert!(Limits::default().is_empty());
        assert_eq!(Limits::default().to_string(), "no limits");
    }

    #[test]
    fn garbage_is_not_limits() {
        for s in [
            "",
            "1",
            "1 ",
            " 1",
            "a b",
            "1 2 3",
            "-1 2",
            "1  2",
            "99999999999999999999 1",
        ] {
            assert_eq!(Limits::decode(s), None, "{s:?}");
        }
    }

    #[test]
    fn values_that_would_refuse_everything_are_invalid() {
        assert!(Limits::default()
            .with_max_held_per_client(0)
            .validate()
            .is_err());
        assert!(Limits::default()
            .with_max_ttl(Duration::from_millis(1))
            .validate()
            .is_err());
        assert!(Limits::default()
            .with_max_ttl(Duration::from_secs(60))
            .with_max_held_per_client(2)
            .validate()
            .is_ok());
    }

    #[test]
    fn refusals_name_the_limit_and_its_value() {
        let l = Limits::default().with_max_ttl(Duration::from_secs(60));
        assert!(l.check_ttl(Duration::from_secs(60)).is_none());
        let e = l.check_ttl(Duration::from_secs(300)).expect("refused");
        assert_eq!(e.kind(), ErrorKind::LimitExceeded);
        assert!(e.to_string().contains("max-ttl = 1m"), "{e}");
        let e = quota_refused(2, "batch");
        assert!(e.to_string().contains("max-held-per-client = 2"), "{e}");
        assert!(!e.is_retryable());
    }

    proptest! {
        #[test]
        fn the_text_form_round_trips(ttl in proptest::option::of(1u64..=u64::from(u32::MAX)), held in proptest::option::of(1u32..)) {
            let mut l = Limits::default();
            if let Some(t) = ttl { l = l.with_max_ttl(Duration::from_millis(t)); }
            if let Some(h) = held { l = l.with_max_held_per_client(h); }
            prop_assert_eq!(Limits::decode(&l.encode()), Some(l));
        }

        #[test]
        fn decoding_never_panics(s in ".{0,40}") {
            let _ = Limits::decode(&s);
        }
    }
}
