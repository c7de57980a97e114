//! How long the client may count on its session: what the ZooKeeper leader is known to have
//! seen of it.
//!
//! A lease on ZooKeeper lasts as long as its node, which lasts as long as the session. Only the
//! leader expires sessions, and a follower cut off from the leader keeps answering reads from its
//! own copy (for up to `syncLimit x tickTime`) while the leader expires the session and grants
//! the lock to the next waiter. So nothing a follower answers alone confirms a lease: the client
//! counts a lease only as long as the leader cannot have expired the session yet, which it works
//! out from its own clock as follows (ZooKeeper 3.8's server, `PrepRequestProcessor`,
//! `SessionTrackerImpl`, `ExpiryQueue`, `Learner`, `LearnerHandler`, `Leader`).
//!
//! # What the servers do
//!
//! 1. **Touches.** Every packet a server receives from a client touches its session. On the
//!    leader that sets the session's expiry to `now + timeout` (rounded *up* to a tick); on a
//!    follower it is only noted, and reported to the leader in the follower's reply to the
//!    leader's next `PING`, which the leader sends every follower every `tickTime / 2`; the
//!    leader then sets `expiry = now + timeout`. An expiry only ever moves later. A touch of a
//!    session the leader has begun to expire ("closing") does nothing.
//! 2. **New sessions, reconnections, new leaders.** Creating a session, revalidating it when
//!    the client reconnects to a follower, and a new leader taking over all set
//!    `expiry = now + timeout` on the leader.
//! 3. **Writes are checked.** A write (here a `multi` of `check` operations) is checked against
//!    the session on the leader (`checkSession`) and fails with `SESSIONEXPIRED` once the
//!    session is closing. A follower's touch reports and forwarded writes travel on one TCP
//!    stream to the leader, which handles them in order on one thread, and checks the write
//!    after that.
//! 4. **Timeouts.** The servers bound a session's timeout to `[minSessionTimeout,
//!    maxSessionTimeout]`, 2 and 20 ticks by default, so `tickTime <= timeout / 2` and the
//!    leader pings a follower at least every `timeout / 4`.
//!
//! # The rule
//!
//! Let a request `A` be sent at `a` and answered at `c` (any request, a read included: its
//! answer proves it reached a server by `c`), and a write `W` sent at `b >= c + GAP`, where
//! `GAP = timeout / 4 + timeout / 16`, be answered OK. Then the leader cannot expire the
//! session before `a + timeout`.
//!
//! *Proof.* If `A` and `W` went to one server `F` over one connection: `A` reached `F` before
//! `c`, `W` after `b`. Between them (`GAP`, more than `tickTime / 2` and a margin of
//! `timeout / 16` for the leader's timer and the link) `F` received a `PING` and answered it,
//! reporting `A`'s touch; that answer reached the leader before `W` did (one stream, in order),
//! at a time `T >= a`. If the session was not closing then, the leader set
//! `expiry >= T + timeout >= a + timeout` (1). If it was closing, the leader's later check of `W`
//! failed (3), and `W` was not answered OK. If the client reconnected in between, the
//! reconnection came after `c` (it ends the connection that answered `A`) and before `W`, and
//! its revalidation set `expiry >= a + timeout` on the leader (2), or failed, and then `W` did
//! too. Connected to the leader itself, `A`'s own touch did. ∎
//!
//! The session's creation counts as such an `A`, sent when the client began to connect (2).
//! The client keeps `proven`, the latest `a` the rule has established, and counts a lease of
//! TTL `ttl <= timeout` valid until `proven + timeout - drift`: from
//! `min(sent, proven + timeout - ttl)` in the watchdog's terms, `sent` being when the
//! renewal or grant that vouched for it was sent. A client that cannot get a write through (its
//! server cut off from the leader) stops advancing `proven`, and its leases end by its own
//! clock before the leader can expire the session.
//!
//! Assumed: the servers' `minSessionTimeout` is at least two ticks (ZooKeeper's default), the
//! leader's ping timer and the follower's answer to it run within `timeout / 16` of time, and
//! clocks advance at the same rate within the drift allowance (1 % of the TTL).
//!
//! # Keeping it fresh
//!
//! Every renewal is a write, and every grant is confirmed by one (the waiter's own create, or a
//! `check` of its node after a wait). Answers to them, and to the other requests of the client,
//! are the candidates `A` of later writes. While the session sends nothing else, it sends a
//! cheap read every `timeout / 16` ([`Proof::heartbeat`]), so that a write is never far from a
//! candidate: a confirmed write at `b` proves the session until about
//! `b + timeout - GAP - timeout / 16`, 5/8 of the timeout ahead.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// How much of the session the leader is known to have seen.
#[derive(Debug)]
pub(super) struct Proof {
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The leader cannot expire the session before `proven + timeout`.
    proven: Instant,
    /// Requests answered, `(sent, answered)`, oldest first: the candidates of later writes.
    answered: VecDeque<(Instant, Instant)>,
    /// When the last answer came.
    last_answer: Instant,
}

/// The spacing between a request's answer and a write that can vouch for it.
fn gap(timeout: Duration) -> Duration {
    timeout / 4 + timeout / 16
}

/// The instant a lease of `ttl` counts its validity from when the session is proven as of
/// `proven` and the renewal or grant was sent at `sent`: it ends `ttl` after that, at or
/// before `proven + timeout`.
fn valid_from(proven: Instant, timeout: Duration, ttl: Duration, sent: Instant) -> Instant {
    let end = proven + timeout;
    match end.checked_sub(ttl) {
        Some(from) => from.min(sent),
        // No representable instant that early: nothing is left to count.
        None => proven.min(sent),
    }
}

impl Proof {
    /// The proof of a session with this (granted) `timeout`, opened by a connection begun at
    /// `connecting`.
    pub(super) fn new(timeout: Duration, connecting: Instant) -> Proof {
        Proof {
            timeout,
            state: Mutex::new(State {
                proven: connecting,
                answered: VecDeque::new(),
                last_answer: connecting,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How often a quiet session sends a read of its own.
    pub(super) fn heartbeat(&self) -> Duration {
        (self.timeout / 16).max(Duration::from_millis(1))
    }

    /// How long ago the last answer came.
    pub(super) fn quiet_for(&self) -> Duration {
        self.state().last_answer.elapsed()
    }

    /// A request sent at `sent` was answered at `at`.
    pub(super) fn answered(&self, sent: Instant, at: Instant) {
        let gap = gap(self.timeout);
        let mut s = self.state();
        s.last_answer = s.last_answer.max(at);
        let place = s.answered.partition_point(|(a, _)| *a <= sent);
        s.answered.insert(place, (sent, at));
        // An entry is useless once a later one already qualifies for every write sent from
        // now on.
        while s.answered.len() > 1 && s.answered[1].1 + gap <= at {
            s.answered.pop_front();
        }
    }

    /// A write sent at `sent` was answered OK: advances `proven` by the rule (module docs).
    pub(super) fn confirmed(&self, sent: Instant) {
        let gap = gap(self.timeout);
        let mut s = self.state();
        if let Some(&(a, _)) = s.answered.iter().rev().find(|(_, c)| *c + gap <= sent) {
            s.proven = s.proven.max(a);
        }
    }

    /// The instant a lease of `ttl` vouched for by a write sent at `sent` counts its validity
    /// from (see [`valid_from`]).
    pub(super) fn valid_from(&self, ttl: Duration, sent: Instant) -> Instant {
        valid_from(self.state().proven, self.timeout, ttl, sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_write_vouches_for_requests_answered_a_gap_before_it() {
        let t0 = Instant::now();
        let p = Proof::new(ms(1600), t0);
        // GAP = 400 + 100 ms.
        p.answered(t0 + ms(100), t0 + ms(110));
        p.answered(t0 + ms(300), t0 + ms(310));
        p.confirmed(t0 + ms(700));
        assert_eq!(p.state().proven, t0 + ms(100));
        p.confirmed(t0 + ms(810));
        assert_eq!(p.state().proven, t0 + ms(300));
        // A lease of the whole timeout counts from `proven`; a shorter one from the send.
        assert_eq!(p.valid_from(ms(1600), t0 + ms(810)), t0 + ms(300));
        assert_eq!(p.valid_from(ms(400), t0 + ms(810)), t0 + ms(810));
    }

    #[test]
    fn reads_alone_prove_nothing() {
        let t0 = Instant::now();
        let p = Proof::new(ms(1000), t0);
        for i in 1..100 {
            p.answered(t0 + ms(i * 50), t0 + ms(i * 50 + 1));
        }
        assert_eq!(p.state().proven, t0);
        assert!(p.state().answered.len() < 10, "{:?}", p.state().answered);
    }

    proptest! {
        /// `proven` is always the session's start or the send of a request answered a gap
        /// before some confirmed write, and never later than that write was sent.
        #[test]
        fn proven_follows_the_rule(
            timeout_ms in 100u64..60_000,
            events in proptest::collection::vec((0u64..5_000, 0u64..500, any::<bool>()), 1..60),
        ) {
            let t0 = Instant::now();
            let timeout = ms(timeout_ms);
            let p = Proof::new(timeout, t0);
            let mut now = 0;
            let mut answers: Vec<(Instant, Instant)> = Vec::new();
            for (step, rtt, write) in events {
                now += step;
                let sent = t0 + ms(now);
                let at = sent + ms(rtt);
                if write {
                    let before = p.state().proven;
                    p.confirmed(sent);
                    let proven = p.state().proven;
                    prop_assert!(proven >= before);
                    prop_assert!(proven <= sent);
                    prop_assert!(
                        proven == t0 || answers.iter().any(|(a, c)| *a == proven && *c + gap(timeout) <= sent)
                    );
                    // The best candidate was taken.
                    if let Some(best) = answers.iter().filter(|(_, c)| *c + gap(timeout) <= sent).map(|(a, _)| *a).max() {
                        prop_assert!(proven >= best);
                    }
                }
                p.answered(sent, at);
                answers.push((sent, at));
                now += rtt;
            }
        }

        /// A lease counted from `valid_from` ends by `proven + timeout`, and never after `ttl`
        /// from the send.
        #[test]
        fn validity_ends_before_the_leader_can_expire(
            timeout_ms in 1u64..100_000, ttl_ms in 1u64..100_000, proven_ms in 0u64..100_000, sent_ms in 0u64..200_000,
        ) {
            let t0 = Instant::now();
            let (timeout, ttl) = (ms(timeout_ms), ms(ttl_ms));
            let proven = t0 + ms(proven_ms);
            let sent = proven + ms(sent_ms);
            let from = valid_from(proven, timeout, ttl, sent);
            prop_assert!(from + ttl <= (proven + timeout).max(proven + ttl));
            if ttl <= timeout {
                prop_assert!(from + ttl <= proven + timeout);
            }
            prop_assert!(from <= sent);
        }
    }
}
