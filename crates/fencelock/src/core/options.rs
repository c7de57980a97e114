//! Lock options and the validity arithmetic every engine shares.

use std::time::Duration;

use crate::core::error::{Error, Result};

/// The shortest TTL accepted. Renewal calls get TTL/6 to answer; below 100 ms that is a few
/// milliseconds, which a loaded machine or a disk sync (SQLite) regularly exceeds, so the lease
/// would be declared lost while nothing is wrong.
pub const MIN_TTL: Duration = Duration::from_millis(100);

/// The longest pause between two attempts [`LockOptions::backoff`] accepts.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);

/// The longest TTL a client can be allowed ([`ClientBuilder::max_ttl`](crate::ClientBuilder::max_ttl)):
/// a year, far beyond any useful lease, and far below what the clock arithmetic can hold.
pub(crate) const TTL_CEILING: Duration = Duration::from_secs(365 * 24 * 3600);

/// The longest deadline of one engine call
/// ([`ClientBuilder::op_timeout`](crate::ClientBuilder::op_timeout)).
pub(crate) const OP_TIMEOUT_CEILING: Duration = Duration::from_secs(3600);

/// Options for one acquisition. Start from [`LockOptions::default`] and change what you need:
///
/// ```
/// use std::time::Duration;
/// let opts = fencelock::LockOptions::default()
///     .ttl(Duration::from_secs(10))
///     .wait(Duration::from_secs(60));
/// assert_eq!(opts.ttl_value(), Duration::from_secs(10));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockOptions {
    ttl: Duration,
    wait: Duration,
    retry_min: Duration,
    retry_max: Duration,
    auto_renew: bool,
    fair: bool,
    client_name: Option<String>,
    owner: Option<String>,
}

impl Default for LockOptions {
    /// TTL 30 s, no waiting (one attempt), retries between 5 ms and 250 ms with jitter, and
    /// automatic renewal every TTL/3.
    fn default() -> LockOptions {
        LockOptions {
            ttl: Duration::from_secs(30),
            wait: Duration::ZERO,
            retry_min: Duration::from_millis(5),
            retry_max: Duration::from_millis(250),
            auto_renew: true,
            fair: false,
            client_name: None,
            owner: None,
        }
    }
}

impl LockOptions {
    /// How long a grant lasts on the engine without renewal.
    pub fn ttl(mut self, ttl: Duration) -> LockOptions {
        self.ttl = ttl;
        self
    }

    /// How long [`Client::acquire`](crate::Client::acquire) keeps trying while the lock is held
    /// elsewhere; zero means one attempt.
    pub fn wait(mut self, wait: Duration) -> LockOptions {
        self.wait = wait;
        self
    }

    /// Bounds of the jittered exponential backoff between attempts when the engine has no
    /// wake-up to offer. A waiter the release will wake (a fair waiter, and on Redis one
    /// refused by a holder on every node it asked) pauses for the maximum, since its retries
    /// then only cover a lost wake-up. A waiter never sleeps longer than the holder's remaining
    /// TTL.
    pub fn backoff(mut self, min: Duration, max: Duration) -> LockOptions {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// Whether the client's watchdog renews the lease every TTL/3 (on by default). Without it
    /// the lease is reported lost when its validity ends.
    pub fn auto_renew(mut self, on: bool) -> LockOptions {
        self.auto_renew = on;
        self
    }

    /// FIFO (fair) mode: waiters are granted the lock in the order they first asked for it.
    /// Off by default, where woken waiters race and the fastest wins. Engines without a queue
    /// reject it with [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput).
    pub fn fair(mut self, on: bool) -> LockOptions {
        self.fair = on;
        self
    }

    /// The client name recorded with this lease (shown by `inspect`), instead of the client's
    /// own ([`ClientBuilder::client_name`](crate::ClientBuilder::client_name)): for a process
    /// that takes locks on behalf of others, such as the sidecar. Checked like a resource name.
    pub fn client_name(mut self, name: impl Into<String>) -> LockOptions {
        self.client_name = Some(name.into());
        self
    }

    /// The client name set with [`LockOptions::client_name`], if any.
    pub fn client_name_value(&self) -> Option<&str> {
        self.client_name.as_deref()
    }

    /// Whether FIFO mode is on.
    pub fn fair_value(&self) -> bool {
        self.fair
    }

    /// The TTL these options ask for.
    pub fn ttl_value(&self) -> Duration {
        self.ttl
    }

    /// The wait deadline these options ask for.
    pub fn wait_value(&self) -> Duration {
        self.wait
    }

    /// Whether automatic renewal is on.
    pub fn auto_renew_value(&self) -> bool {
        self.auto_renew
    }

    /// The owner value to acquire with, instead of a random one: 32 lowercase hex digits, as
    /// random owners are. For a holder that must find its grant again after a restart, to
    /// release it with [`Client::release_owner`](crate::Client::release_owner) (the sidecar
    /// derives the owner of a Dapr lock from the application's `lockOwner`).
    ///
    /// The engine knows a holder only by its owner value: two acquisitions with the same value
    /// are one holder, and a retried grant to it returns the grant already made. Derive it
    /// from something unique to the holder, never share it.
    pub fn owner(mut self, owner: impl Into<String>) -> LockOptions {
        self.owner = Some(owner.into());
        self
    }

    /// The owner value given with [`LockOptions::owner`], if any.
    pub fn owner_value(&self) -> Option<&str> {
        self.owner.as_deref()
    }

    pub(crate) fn backoff_bounds(&self) -> (Duration, Duration) {
        (self.retry_min, self.retry_max)
    }

    pub(crate) fn validate(&self, max_ttl: Duration) -> Result<()> {
        if let Some(owner) = &self.owner {
            if owner.len() != 32
                || !owner
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            {
                return Err(Error::invalid(format!(
                    "the owner value {owner:?} must be 32 lowercase hex digits, as random owners are"
                )));
            }
        }
        if let Some(name) = &self.client_name {
            if name.is_empty()
                || name.len() > crate::core::name::MAX_NAME_BYTES
                || name.chars().any(char::is_control)
            {
                return Err(Error::invalid(format!(
                    "the client name {name:?} must be 1 to {} bytes without control characters",
                    crate::core::name::MAX_NAME_BYTES
                )));
            }
        }
        if self.ttl < MIN_TTL {
            return Err(Error::invalid(format!(
                "TTL {} is too short; the minimum is {}",
                display_duration(self.ttl),
                display_duration(MIN_TTL)
            )));
        }
        if self.ttl > max_ttl {
            return Err(Error::invalid(format!(
                "TTL {} exceeds this client's cap of {}; use a shorter TTL with renewal",
                display_duration(self.ttl),
                display_duration(max_ttl)
            )));
        }
        if self.retry_min.is_zero() || self.retry_min > self.retry_max {
            return Err(Error::invalid("backoff bounds must satisfy 0 < min <= max"));
        }
        if self.retry_max > MAX_BACKOFF {
            return Err(Error::invalid(format!(
                "a backoff of {} between attempts is longer than the {} allowed; a waiter \
                 that sleeps that long misses every release",
                display_duration(self.retry_max),
                display_duration(MAX_BACKOFF)
            )));
        }
        Ok(())
    }
}

/// The clock drift allowance for a TTL, as the Redlock spec sizes it: 1 % of the TTL plus 2 ms.
pub fn drift(ttl: Duration) -> Duration {
    ttl / 100 + Duration::from_millis(2)
}

/// Validity left of a grant: `ttl - elapsed - drift(ttl)`, where `elapsed` is measured from
/// before the first request was sent. `None` when nothing is left.
pub fn validity(ttl: Duration, elapsed: Duration) -> Option<Duration> {
    ttl.checked_sub(elapsed)?
        .checked_sub(drift(ttl))
        .filter(|v| !v.is_zero())
}

/// Validity left of a grant whose expiry on the engine is `ttl` cut to `window`, both counted
/// from no earlier than `elapsed` ago: `validity(ttl, elapsed)` less what the cut takes away.
/// A lock handed over by a release gets such an expiry (its TTL, cut to what is left of the
/// waiter's queue entry) and the waiter counts from before its last refused attempt.
pub fn handoff_validity(ttl: Duration, window: Duration, elapsed: Duration) -> Option<Duration> {
    validity(ttl, elapsed.saturating_add(ttl.saturating_sub(window)))
}

/// Whether a grant whose validity is `validity` is worth handing out. Below a tenth of the TTL
/// the holder could barely start work before the lease runs out, so the grant is released and
/// retried instead.
pub fn usable(ttl: Duration, validity: Duration) -> bool {
    validity >= ttl / 10
}

/// The renewal cadence of the watchdog.
pub fn renew_interval(ttl: Duration) -> Duration {
    ttl / 3
}

/// Formats a duration as people write it (`250ms`, `1.5s`, `2m`).
pub fn display_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        if d.as_micros() % 1000 != 0 && ms < 10 {
            return format!("{:.1}ms", d.as_secs_f64() * 1000.0);
        }
        format!("{ms}ms")
    } else if ms % 60_000 == 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_given_owner_value_has_the_shape_of_a_random_one() {
        let cap = Duration::from_secs(3600);
        let owner = format!("{:032x}", u128::MAX - 7);
        let ok = LockOptions::default().owner(owner.clone());
        assert_eq!(ok.owner_value(), Some(owner.as_str()));
        assert!(ok.validate(cap).is_ok());
        for bad in [
            "",
            "vader",
            &"A".repeat(32),
            &"0".repeat(31),
            &"0".repeat(33),
        ] {
            let e = LockOptions::default().owner(bad).validate(cap);
            assert_eq!(
                e.map_err(|e| e.kind()),
                Err(crate::ErrorKind::InvalidInput),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_lease_client_name_is_checked_like_a_resource_name() {
        let cap = Duration::from_secs(3600);
        let ok = LockOptions::default().client_name("billing-worker");
        assert_eq!(ok.client_name_value(), Some("billing-worker"));
        assert!(ok.validate(cap).is_ok());
        for bad in ["", "a\nb", &"x".repeat(257)] {
            let e = LockOptions::default().client_name(bad).validate(cap);
            assert_eq!(
                e.unwrap_err().kind(),
                crate::ErrorKind::InvalidInput,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn redlock_spec_figures() {
        let ttl = Duration::from_secs(10);
        assert_eq!(drift(ttl), Duration::from_millis(102));
        assert_eq!(
            validity(ttl, Duration::from_millis(50)),
            Some(Duration::from_millis(9848))
        );
        assert_eq!(validity(ttl, Duration::from_millis(9898)), None);
        assert_eq!(validity(ttl, Duration::from_secs(11)), None);
    }

    #[test]
    fn options_are_checked() {
        let max = Duration::from_secs(3600);
        assert!(LockOptions::default().validate(max).is_ok());
        assert!(LockOptions::default()
            .ttl(Duration::ZERO)
            .validate(max)
            .is_err());
        assert!(LockOptions::default()
            .ttl(Duration::from_secs(7200))
            .validate(max)
            .is_err());
        assert!(LockOptions::default()
            .backoff(Duration::from_millis(9), Duration::from_millis(1))
            .validate(max)
            .is_err());
    }

    #[test]
    fn durations_display_like_the_cli_takes_them() {
        assert_eq!(display_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(display_duration(Duration::from_secs(30)), "30s");
        assert_eq!(display_duration(Duration::from_secs(120)), "2m");
        assert_eq!(display_duration(Duration::from_millis(1500)), "1.5s");
    }

    proptest! {
        #[test]
        fn validity_plus_costs_is_ttl(ttl_ms in 10u64..10_000_000, elapsed_us in 0u64..20_000_000_000) {
            let ttl = Duration::from_millis(ttl_ms);
            let elapsed = Duration::from_micros(elapsed_us);
            match validity(ttl, elapsed) {
                Some(v) => {
                    prop_assert_eq!(v + elapsed + drift(ttl), ttl);
                    prop_assert!(v < ttl);
                }
                None => prop_assert!(elapsed + drift(ttl) >= ttl),
            }
        }

        #[test]
        fn handoff_validity_ends_before_the_cut_expiry(ttl_ms in 100u64..1_000_000, window_ms in 1u64..2_000_000, elapsed_us in 0u64..2_000_000_000) {
            let (ttl, window) = (Duration::from_millis(ttl_ms), Duration::from_millis(window_ms));
            let elapsed = Duration::from_micros(elapsed_us);
            if let Some(v) = handoff_validity(ttl, window, elapsed) {
                prop_assert!(v + elapsed + drift(ttl) <= ttl.min(window));
            }
            if window >= ttl {
                prop_assert_eq!(handoff_validity(ttl, window, elapsed), validity(ttl, elapsed));
            }
        }

        #[test]
        fn validity_shrinks_as_elapsed_grows(ttl_ms in 10u64..1_000_000, a in 0u64..2_000_000, b in 0u64..2_000_000) {
            let ttl = Duration::from_millis(ttl_ms);
            let (lo, hi) = (a.min(b), a.max(b));
            let vlo = validity(ttl, Duration::from_micros(lo));
            let vhi = validity(ttl, Duration::from_micros(hi));
            prop_assert!(vhi <= vlo);
        }

        #[test]
        fn renewal_comes_well_before_expiry(ttl_ms in 10u64..10_000_000) {
            let ttl = Duration::from_millis(ttl_ms);
            // Two renewals in a row can fail and the second still starts before validity ends.
            prop_assert!(renew_interval(ttl) * 2 < ttl - drift(ttl));
        }
    }
}
