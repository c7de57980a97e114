//! An in-process fence, for tests, demos and single-process resources.

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Mutex;

use crate::core::error::{Error, Result};
use crate::core::token::FencingToken;

/// Remembers the highest token per resource in memory; the check and the write happen under
/// one lock, so a stale writer can never slip in between.
///
/// ```
/// use fencelock::{fence::MemoryFence, ErrorKind, FencingToken};
/// let ledger = MemoryFence::new();
/// ledger.write("ledger", FencingToken::new(7), || "paid").unwrap();
/// let stale = ledger.write("ledger", FencingToken::new(6), || "paid twice").unwrap_err();
/// assert_eq!(stale.kind(), ErrorKind::StaleToken);
/// assert_eq!(stale.stale_tokens(), Some((FencingToken::new(6), FencingToken::new(7))));
/// ```
#[derive(Debug, Default)]
pub struct MemoryFence {
    highest: Mutex<HashMap<String, u64>>,
}

impl MemoryFence {
    /// An empty fence: every resource starts with no token seen.
    pub fn new() -> MemoryFence {
        MemoryFence::default()
    }

    /// Runs `write` only if `token` is not lower than the highest token seen for `resource`,
    /// and records `token` as the highest. The write runs under the fence's lock.
    pub fn write<T>(
        &self,
        resource: &str,
        token: FencingToken,
        write: impl FnOnce() -> T,
    ) -> Result<T> {
        let mut highest = self.highest.lock().unwrap_or_else(|p| p.into_inner());
        let seen = match highest.entry(resource.to_owned()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                crate::core::metrics::fence_met(resource);
                e.insert(0)
            }
        };
        if token.get() < *seen {
            crate::core::metrics::stale_token_rejected(resource);
            return Err(Error::stale_token(
                resource,
                token,
                FencingToken::new(*seen),
            ));
        }
        *seen = token.get();
        Ok(write())
    }

    /// Records `token` for `resource` if it is not stale (a write with nothing to do).
    pub fn admit(&self, resource: &str, token: FencingToken) -> Result<()> {
        self.write(resource, token, || ())
    }

    /// The highest token seen for `resource`.
    pub fn highest(&self, resource: &str) -> Option<FencingToken> {
        let highest = self.highest.lock().unwrap_or_else(|p| p.into_inner());
        highest.get(resource).map(|t| FencingToken::new(*t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use proptest::prelude::*;

    #[test]
    fn equal_token_is_the_same_holder_and_accepted() {
        let f = MemoryFence::new();
        f.admit("r", FencingToken::new(5)).unwrap();
        f.admit("r", FencingToken::new(5)).unwrap();
        assert_eq!(f.highest("r"), Some(FencingToken::new(5)));
    }

    #[test]
    fn resources_are_fenced_independently() {
        let f = MemoryFence::new();
        f.admit("a", FencingToken::new(9)).unwrap();
        f.admit("b", FencingToken::new(1)).unwrap();
        assert_eq!(
            f.admit("a", FencingToken::new(8)).unwrap_err().kind(),
            ErrorKind::StaleToken
        );
    }

    proptest! {
        /// Whatever order writes arrive in, the accepted tokens never decrease.
        #[test]
        fn accepted_tokens_never_decrease(tokens in proptest::collection::vec(0u64..50, 1..60)) {
            let f = MemoryFence::new();
            let mut accepted = Vec::new();
            for t in tokens {
                if f.write("r", FencingToken::new(t), || ()).is_ok() {
                    accepted.push(t);
                }
            }
            prop_assert!(accepted.windows(2).all(|w| w[0] <= w[1]));
        }
    }
}
