//! Fencing tokens.

use std::fmt;

/// A number handed out with every grant, strictly greater than every earlier grant's token for
/// the same resource. A protected resource remembers the highest token it has seen and rejects
/// writes carrying a lower one, which makes a holder that lost its lease harmless.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> FencingToken {
        FencingToken(value)
    }

    /// The raw value, for storing next to the data it protects.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// A token read back from a signed 64-bit column or counter (SQL `bigint`, an etcd
    /// revision). Engines never store a negative token; one read anyway counts as 0, below
    /// every token granted.
    pub(crate) fn from_stored(n: i64) -> FencingToken {
        FencingToken(u64::try_from(n).unwrap_or(0))
    }

    /// [`FencingToken::from_stored`] for readers that skip what fencelock did not write:
    /// `None` for a negative value.
    pub(crate) fn checked_from_stored(n: i64) -> Option<FencingToken> {
        u64::try_from(n).ok().map(FencingToken)
    }

    /// The token for a signed 64-bit column. Counters start at 1 and advance by one per grant,
    /// so `i64::MAX` is never reached; the clamp only keeps the conversion total.
    pub(crate) fn to_stored(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

impl From<u64> for FencingToken {
    fn from(v: u64) -> FencingToken {
        FencingToken(v)
    }
}

impl std::str::FromStr for FencingToken {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<FencingToken, Self::Err> {
        s.parse().map(FencingToken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn stored_tokens_clamp_at_the_edges() {
        assert_eq!(FencingToken::from_stored(-1), FencingToken::new(0));
        assert_eq!(FencingToken::from_stored(i64::MIN), FencingToken::new(0));
        assert_eq!(FencingToken::checked_from_stored(-1), None);
        assert_eq!(
            FencingToken::checked_from_stored(0),
            Some(FencingToken::new(0))
        );
        assert_eq!(FencingToken::new(u64::MAX).to_stored(), i64::MAX);
        assert_eq!(FencingToken::new(1 << 63).to_stored(), i64::MAX);
        assert_eq!(FencingToken::new(i64::MAX as u64).to_stored(), i64::MAX);
    }

    proptest! {
        #[test]
        fn stored_tokens_round_trip(n in 0..=i64::MAX) {
            prop_assert_eq!(FencingToken::from_stored(n).to_stored(), n);
            prop_assert_eq!(FencingToken::checked_from_stored(n), Some(FencingToken::from_stored(n)));
        }

        #[test]
        fn storing_keeps_the_order(a in any::<u64>(), b in any::<u64>()) {
            // The fence compares stored tokens: clamping may merge, never invert.
            let (ta, tb) = (FencingToken::new(a), FencingToken::new(b));
            if ta <= tb {
                prop_assert!(ta.to_stored() <= tb.to_stored());
            }
        }

        #[test]
        fn negative_stored_tokens_are_zero(n in i64::MIN..0) {
            prop_assert_eq!(FencingToken::from_stored(n), FencingToken::new(0));
            prop_assert_eq!(FencingToken::checked_from_stored(n), None);
        }
    }
}
