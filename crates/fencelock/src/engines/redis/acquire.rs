//! Acquisition: one attempt on every node, its vote, and the rollback of a split vote.
//!
//! - **Tokens on a quorum.** Each granting node answers `max(counter + 1, floor)`, where the
//!   floor is the client's clock in microseconds (the server's, for one node). The lease token
//!   `T` is the maximum over the granting nodes; unless a majority already answered `T`, the
//!   counter is raised to `T` on a majority before the lease is handed out, so any later
//!   majority, which intersects that one, grants above `T`. With synchronised clocks the nodes
//!   answer the same floor and the raise is skipped: one round trip.
//! - **Fairness.** By default woken waiters race and the fastest wins: no order, and a waiter
//!   can in principle lose many races in a row. Fair mode ([`LockOptions::fair`]) keeps a FIFO
//!   queue on the node: the lock is granted to the oldest waiter still asking; a waiter that
//!   stops asking (crashed, cancelled) leaves the queue after its entry expires, or at once
//!   when its acquisition is cancelled. On one node a release hands the lock straight to the
//!   head of the queue and names it, with its token, in the wake-up: the handoff costs one
//!   message instead of a message and a round trip (see the release script for the expiry
//!   such a grant gets, and the client's acquire loop for the validity it counts). On Redlock
//!   every node places a waiter by the start of its acquisition, so that all nodes agree on
//!   the head, and a split vote's rollback leaves the waiter's place alone.
//!
//! [`LockOptions::fair`]: crate::LockOptions::fair

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use redis::Value;

use super::keys::Keys;
use super::node::{Node, NodeResult, ScriptCall};
use super::release::Release;
use super::values::{as_i64, as_string, as_u64, holder_from, holder_value, ms, pttl_of};
use super::votes::errors_text;
use super::{scripts, RedisEngine};
use crate::core::engine::{AcquireRequest, Attempt, FairQueue};
use crate::core::error::{Error, Result};
use crate::core::holder::Holder;
use crate::core::token::FencingToken;

/// One node's answer to an acquisition attempt.
enum NodeAttempt {
    Granted(u64),
    Held {
        holder: Option<Holder>,
        pttl: Option<Duration>,
    },
    /// The TTL is above the node's `max-ttl` (ms).
    TtlCapped(u64),
    /// The client holds the node's `max-held-per-client` leases; one expires in `retry`.
    OverQuota {
        max: u32,
        retry: Duration,
    },
    /// A quota is stored and the call carried no `held` set: send it again with it.
    NeedsHeld,
}

/// The holder part of a compact refusal, `<pttl> <counter>\n<holder>`, or `<pttl>` alone
/// when the lock is free and another fair waiter heads the queue (the `H` taken off).
fn held_from_text(text: &[u8]) -> Option<NodeAttempt> {
    let (head, holder) = match text.iter().position(|b| *b == b'\n') {
        Some(nl) => (&text[..nl], Some(&text[nl + 1..])),
        None => (text, None),
    };
    let head = std::str::from_utf8(head).ok()?;
    let (pttl, counter) = head.split_once(' ').unwrap_or((head, ""));
    let pttl = pttl
        .parse::<i64>()
        .ok()?
        .try_into()
        .ok()
        .map(Duration::from_millis);
    let counter = counter.parse().ok();
    let holder = holder
        .and_then(|h| std::str::from_utf8(h).ok())
        .map(|value| holder_from(value, pttl, counter));
    Some(NodeAttempt::Held { holder, pttl })
}

impl RedisEngine {
    /// Where a fair waiter goes in a node's queue: 0 lets one node number its waiters in
    /// arrival order; Redlock nodes get the acquisition's start in microseconds instead, the
    /// same on every node, because two waiters' attempts can reach two nodes in opposite
    /// orders, and nodes whose queues disagree on the head split their votes.
    fn queue_place(&self, since: SystemTime) -> u64 {
        if self.one_node() {
            return 0;
        }
        // 0 is taken by "number them here".
        crate::core::holder::unix_micros(since).max(1)
    }

    /// Per-node deadline of an acquisition: small against the TTL, as Redlock asks, so a hung
    /// node costs a fraction of the validity, not all of it. One node gets the whole call.
    fn node_timeout(&self, ttl: Duration) -> Duration {
        if self.one_node() {
            self.op_timeout
        } else {
            (ttl / 20)
                .clamp(Duration::from_millis(50), Duration::from_millis(500))
                .min(self.op_timeout)
        }
    }

    async fn acquire_on(
        &self,
        node: &Node,
        req: &AcquireRequest,
        fair: Option<(Duration, SystemTime)>,
        keys: &Keys,
        (floor, value): (u64, &str),
        limit: Duration,
    ) -> NodeResult<NodeAttempt> {
        let script = match fair {
            None => &*scripts::ACQUIRE,
            Some(_) => &*scripts::ACQUIRE_FAIR,
        };
        let with_held = self.quota_seen();
        let mut inv = ScriptCall::new(script, 4 + usize::from(with_held));
        inv.arg(&keys.lock)
            .arg(&keys.fence)
            .arg(&self.node_key)
            .arg(&self.limits_key);
        if with_held {
            inv.arg(&self.held_key);
        }
        inv.arg(value).arg(ms(req.ttl)).arg(node.known_id());
        if let Some((window, _)) = fair {
            inv.arg(ms(window))
                .arg(&self.channel)
                .arg(self.prefix.len());
        }
        // Only Redlock has a place to give a fair waiter and a floor to propose.
        if !self.one_node() {
            if let Some((_, since)) = fair {
                inv.arg(self.queue_place(since));
            }
            inv.arg(floor);
        }
        let reply: Value = node.run(inv, limit).await?;
        self.node_attempt(node, reply)
    }

    /// What a node's reply to the acquire script says (see [`scripts::ACQUIRE`] for its
    /// shapes): a bare token or holder when the node's id is the one the client knows, a table
    /// with the node's id otherwise.
    fn node_attempt(&self, node: &Node, reply: Value) -> NodeResult<NodeAttempt> {
        let bad = || format!("{}: unexpected reply to the acquire script", node.addr());
        let reply = match reply {
            Value::Int(token) => {
                let token = u64::try_from(token).map_err(|_| bad())?;
                return Ok(NodeAttempt::Granted(token));
            }
            Value::BulkString(text) => {
                return match text.strip_prefix(b"H") {
                    Some(held) => held_from_text(held).ok_or_else(bad),
                    None => std::str::from_utf8(&text)
                        .ok()
                        .and_then(|t| t.parse().ok())
                        .map(NodeAttempt::Granted)
                        .ok_or_else(bad),
                };
            }
            Value::Array(items) => items,
            _ => return Err(bad()),
        };
        let id = reply.get(2).and_then(as_string).ok_or_else(bad)?;
        node.observe(&id, self.max_ttl);
        match reply.first().and_then(as_i64) {
            Some(1) => {
                let token = reply.get(1).and_then(as_u64).ok_or_else(bad)?;
                Ok(NodeAttempt::Granted(token))
            }
            Some(0) => {
                let pttl = pttl_of(reply.get(1));
                let counter = reply.get(4).and_then(as_u64);
                let holder = reply
                    .get(3)
                    .and_then(as_string)
                    .map(|value| holder_from(&value, pttl, counter));
                Ok(NodeAttempt::Held { holder, pttl })
            }
            Some(2) => {
                let max = reply.get(3).and_then(as_u64).ok_or_else(bad)?;
                Ok(NodeAttempt::TtlCapped(max))
            }
            Some(3) => {
                let retry = reply.get(1).and_then(as_u64).ok_or_else(bad)?;
                let max = reply.get(3).and_then(as_u64).ok_or_else(bad)?;
                Ok(NodeAttempt::OverQuota {
                    max: u32::try_from(max).unwrap_or(u32::MAX),
                    retry: Duration::from_millis(retry),
                })
            }
            Some(4) => Ok(NodeAttempt::NeedsHeld),
            _ => Err(bad()),
        }
    }

    /// One attempt on every node; `fair` is the queue entry's window and the acquisition's
    /// start, for a waiter in fair mode.
    pub(super) async fn attempt(
        &self,
        req: &AcquireRequest,
        fair: Option<(Duration, SystemTime)>,
    ) -> Result<Attempt> {
        match self.attempt_once(req, fair).await? {
            Some(attempt) => Ok(attempt),
            // A node told of a quota the call did not carry the `held` set for: the same
            // attempt again, with it (`attempt_once` only answers `None` the first time).
            None => match self.attempt_once(req, fair).await? {
                Some(attempt) => Ok(attempt),
                None => Err(Error::engine_failure(
                    self.kind,
                    "a node asked twice for the client's set of held leases",
                )),
            },
        }
    }

    /// One attempt on every node, or `None` when a node refused it for want of the `held`
    /// set (a quota this client had not seen yet): nothing is then left held, and the caller
    /// sends the attempt again, which now carries the set.
    async fn attempt_once(
        &self,
        req: &AcquireRequest,
        fair: Option<(Duration, SystemTime)>,
    ) -> Result<Option<Attempt>> {
        let keys = self.keys(&req.name);
        // Subscribed before the attempt is sent: a release announced after the refusal below
        // changes this receiver even if the waiter has not started waiting yet.
        let wake = req.waits.then(|| {
            self.wakers
                .subscribe_as(&req.name, &req.owner, self.quorum, fair.is_some())
        });
        let limit = self.node_timeout(req.ttl);
        let floor = self.floor();
        let value = holder_value(&req.owner, req.ttl, SystemTime::now(), &req.meta);
        let granted = |a: &NodeAttempt| matches!(a, NodeAttempt::Granted(_));
        let answers = self
            .ask(|n| self.acquire_on(n, req, fair, &keys, (floor, &value), limit))
            .await
            .only_votes();

        let votes = answers.count(granted);
        let granted_any = answers.answers().any(granted);
        let top = answers
            .answers()
            .filter_map(|a| match a {
                NodeAttempt::Granted(t) => Some(*t),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let holders: Vec<(Option<Holder>, Option<Duration>)> = answers
            .answers()
            .filter_map(|a| match a {
                NodeAttempt::Held { holder, pttl } => Some((holder.clone(), *pttl)),
                _ => None,
            })
            .collect();
        let capped = answers.answers().find_map(|a| match a {
            NodeAttempt::TtlCapped(max) => Some(*max),
            _ => None,
        });
        let quota = answers
            .answers()
            .filter_map(|a| match a {
                NodeAttempt::OverQuota { max, retry } => Some((*max, *retry)),
                _ => None,
            })
            .min_by_key(|(_, retry)| *retry);
        let mut errors = answers.errors();

        if votes >= self.quorum {
            // Raise the counter to `top` where it is lower, so a majority holds at least `top`.
            let at_top = |a: &NodeAttempt| matches!(a, NodeAttempt::Granted(t) if *t == top);
            if answers.raise_to(&keys.fence, top, at_top, limit).await {
                if let Some(wake) = wake {
                    wake.settle();
                }
                if answers
                    .answers()
                    .any(|a| matches!(a, NodeAttempt::NeedsHeld))
                {
                    self.saw_quota();
                }
                return Ok(Some(Attempt::Granted(FencingToken::new(top))));
            }
            errors.push("the fencing counter could not be raised on a majority".to_owned());
        }

        let needs_held = answers
            .answers()
            .any(|a| matches!(a, NodeAttempt::NeedsHeld));
        if granted_any || !errors.is_empty() {
            // A minority grant (or an answer that never came) must not linger: release it on
            // every node, including those that timed out.
            self.release_everywhere(&keys, &req.owner, Release::KeepWaiting, limit)
                .await;
        }
        if needs_held && !self.quota_seen() {
            self.saw_quota();
            return Ok(None);
        }
        // A limit refused it on some node and no quorum granted: the limit is the answer.
        if let Some(max) = capped {
            return Err(
                crate::core::limits::ttl_refused(Duration::from_millis(max), req.ttl)
                    .with_resource(&req.name)
                    .with_engine(self.kind),
            );
        }
        if let Some((max, retry)) = quota {
            if holders.len() < self.quorum {
                return Ok(Some(Attempt::OverQuota {
                    max,
                    retry_in: Some(retry),
                }));
            }
        }
        // Nobody else holds it, or too few nodes answered for any grant to be possible:
        // that is an engine problem, not contention.
        if holders.is_empty() || answers.too_few_answered() {
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "only {votes} of {} nodes granted (quorum {}): {}",
                    self.nodes.len(),
                    self.quorum,
                    errors_text(&errors)
                ),
            ));
        }
        // The holder most nodes name, and the shortest remaining TTL among them.
        let mut counts: HashMap<Option<String>, usize> = HashMap::new();
        for (h, _) in &holders {
            *counts
                .entry(h.as_ref().map(|h| h.owner.clone()))
                .or_default() += 1;
        }
        let top_owner = counts.into_iter().max_by_key(|(_, c)| *c).map(|(o, _)| o);
        let holder = holders
            .iter()
            .find(|(h, _)| {
                top_owner
                    .as_ref()
                    .is_some_and(|o| h.as_ref().map(|h| &h.owner) == o.as_ref())
            })
            .and_then(|(h, _)| h.clone());
        let split = granted_any || holders.len() < self.quorum;
        let retry_in = if split {
            None
        } else {
            holders.iter().filter_map(|(_, p)| *p).min()
        };
        Ok(Some(Attempt::Held {
            holder,
            retry_in,
            wake: wake.map(Box::new),
        }))
    }
}

#[async_trait]
impl FairQueue for RedisEngine {
    async fn try_acquire_fair(
        &self,
        req: &AcquireRequest,
        window: Duration,
        since: SystemTime,
    ) -> Result<Attempt> {
        self.attempt(req, Some((window, since))).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compact_refusal_names_the_holder_its_time_left_and_token() {
        let value = "o1\n10\n30000\n1700000000000\n42\nbox\nbilling";
        let text = format!("1500 17\n{value}");
        let Some(NodeAttempt::Held { holder, pttl }) = held_from_text(text.as_bytes()) else {
            unreachable!("a refusal parses");
        };
        assert_eq!(pttl, Some(Duration::from_millis(1500)));
        let holder = holder.expect("a holder");
        assert_eq!(holder.owner, "o1");
        assert_eq!(holder.token, Some(FencingToken::new(17)));
        assert_eq!(holder.client.as_deref(), Some("billing"));
    }

    #[test]
    fn a_compact_refusal_without_a_holder_or_time_left_has_neither() {
        // The lock free and another fair waiter first: no holder, and PTTL's -2.
        let Some(NodeAttempt::Held { holder, pttl }) = held_from_text(b"-2") else {
            unreachable!("a refusal parses");
        };
        assert!(holder.is_none());
        assert_eq!(pttl, None);
        // Held by a plain SET NX PX of another client: shown whole, with no token.
        let Some(NodeAttempt::Held { holder, .. }) = held_from_text(b"900 5\nsomeone") else {
            unreachable!("a refusal parses");
        };
        let holder = holder.expect("a holder");
        assert_eq!((holder.owner.as_str(), holder.token), ("someone", None));
        assert!(held_from_text(b"x 1\nv").is_none());
    }
}
