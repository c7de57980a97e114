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
