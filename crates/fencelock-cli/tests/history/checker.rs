//! The history checker: grants and write decisions in, violations out.

/// One grant as the worker reported it (CLOCK_MONOTONIC ns).
#[derive(Debug, Clone)]
pub struct Grant {
    pub resource: usize,
    pub worker: u32,
    pub token: u64,
    pub requested: u128,
    pub acquired: u128,
    pub valid_until: u128,
    /// When the holder started to release, if it did.
    pub released: Option<u128>,
    /// When the holder learnt it had lost the lease, if it did.
    pub lost: Option<u128>,
}

impl Grant {
    /// End of the window in which the holder believed it held the lock.
    pub fn believed_until(&self) -> u128 {
        [self.released, self.lost]
            .into_iter()
            .flatten()
            .fold(self.valid_until, u128::min)
    }
}

/// One write decision as the ledger made it.
#[derive(Debug, Clone)]
pub struct Write {
    pub resource: usize,
    pub worker: u32,
    pub token: u64,
    /// When the ledger decided (CLOCK_MONOTONIC ns).
    pub at: u128,
    pub accepted: bool,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub grants: usize,
    pub writes_accepted: usize,
    pub writes_refused: usize,
    /// Accepted tokens per resource that did not strictly increase.
    pub accepted_order_violations: usize,
    /// Accepted writes whose token was below one already granted and written before them.
    pub stale_accepted: usize,
    /// Grant pairs where the later one (requested after the earlier was granted) has the
    /// smaller token.
    pub token_order_violations: usize,
    /// Grant pairs of one resource whose believed-valid windows overlap.
    pub double_grants: usize,
    /// Writes sent after the writer's validity window had ended.
    pub zombie_writes: usize,
}

pub fn check(grants: &[Grant], writes: &[Write]) -> Verdict {
    let mut v = Verdict {
        grants: grants.len(),
        ..Verdict::default()
    };
    let resources = grants
        .iter()
        .map(|g| g.resource)
        .chain(writes.iter().map(|w| w.resource))
        .max()
        .map_or(0, |m| m + 1);
    for r in 0..resources {
        let mut ws: Vec<&Write> = writes.iter().filter(|w| w.resource == r).collect();
        ws.sort_by_key(|w| w.at);
        let mut last_accepted: Option<u64> = None;
        let mut highest_written: Option<u64> = None;
        for w in &ws {
            if w.accepted {
                v.writes_accepted += 1;
                if last_accepted.is_some_and(|l| w.token <= l) {
                    // Equal tokens are one holder writing twice; the suite writes once per grant.
                    v.accepted_order_violations += 1;
                }
                if highest_written.is_some_and(|h| w.token < h) {
                    v.stale_accepted += 1;
                }
                last_accepted = Some(w.token);
            } else {
                v.writes_refused += 1;
            }
            highest_written = Some(highest_written.map_or(w.token, |h| h.max(w.token)));
            let grant = grants
                .iter()
                .find(|g| g.resource == r && g.worker == w.worker && g.token == w.token);
            if grant.is_some_and(|g| w.at > g.valid_until) {
                v.zombie_writes += 1;
            }
        }
        let gs: Vec<&Grant> = grants.iter().filter(|g| g.resource == r).collect();
        for (i, a) in gs.iter().enumerate() {
            for b in &gs[i + 1..] {
                let (first, second) = if a.acquired <= b.acquired {
                    (a, b)
                } else {
                    (b, a)
                };
                if first.acquired < second.requested && first.token >= second.token {
                    v.token_order_violations += 1;
                }
                let overlap = first.acquired < second.believed_until()
                    && second.acquired < first.believed_until();
                if overlap && (first.worker, first.token) != (second.worker, second.token) {
                    v.double_grants += 1;
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(worker: u32, token: u64, requested: u128, acquired: u128, valid_until: u128) -> Grant {
        Grant {
            resource: 0,
            worker,
            token,
            requested,
            acquired,
            valid_until,
            released: None,
            lost: None,
        }
    }

    fn w(worker: u32, token: u64, at: u128, accepted: bool) -> Write {
        Write {
            resource: 0,
            worker,
            token,
            at,
            accepted,
        }
    }

    #[test]
    fn a_clean_history_has_no_violations() {
        let grants = [g(1, 5, 0, 10, 100), g(2, 6, 50, 120, 200)];
        let writes = [w(1, 5, 20, true), w(2, 6, 130, true), w(1, 5, 150, false)];
        let v = check(&grants, &writes);
        assert_eq!(v.double_grants, 0);
        assert_eq!(v.stale_accepted, 0);
        assert_eq!(v.accepted_order_violations, 0);
        assert_eq!(v.token_order_violations, 0);
        assert_eq!(v.zombie_writes, 1);
        assert_eq!((v.writes_accepted, v.writes_refused), (2, 1));
    }

    #[test]
    fn a_released_lease_no_longer_overlaps_its_successor() {
        let mut first = g(1, 5, 0, 10, 100);
        first.released = Some(30);
        let v = check(&[first, g(2, 6, 20, 40, 200)], &[]);
        assert_eq!(v.double_grants, 0);
    }

    #[test]
    fn catches_a_double_grant_a_stale_write_and_a_token_going_back() {
        let grants = [g(1, 7, 0, 10, 100), g(2, 6, 20, 30, 130)];
        let writes = [w(1, 7, 40, true), w(2, 6, 50, true)];
        let v = check(&grants, &writes);
        assert_eq!(v.double_grants, 1);
        assert_eq!(v.token_order_violations, 1);
        assert_eq!(v.stale_accepted, 1);
        assert_eq!(v.accepted_order_violations, 1);
    }
}
