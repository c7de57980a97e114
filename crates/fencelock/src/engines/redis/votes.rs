//! Counting the nodes' answers against the quorum: the one place Redlock's arithmetic lives.
//!
//! A quorum is `N / 2 + 1` of the N nodes (1 of 1), so any two quorums share a node. A node
//! that failed or did not answer in time says neither yes nor no. When grants are counted, a
//! node that lost its data sits out ([`Node::votes`]); every other count takes each answer.

use std::time::Duration;

use futures_util::future::join_all;

use super::node::{Node, NodeResult, ScriptCall};
use super::{scripts, RedisEngine};
use crate::core::error::{Error, Result};

/// The quorum of `nodes` nodes.
pub(super) fn quorum(nodes: usize) -> usize {
    nodes / 2 + 1
}

/// Every node's answer to one step of an operation, in node order.
pub(super) struct Tally<'a, T> {
    engine: &'a RedisEngine,
    answers: Vec<NodeResult<T>>,
    /// Only nodes with a vote count (grants); otherwise every answer counts.
    votes_only: bool,
}

/// What the nodes said to one yes-or-no question.
pub(super) enum Verdict {
    /// A quorum said yes.
    Yes,
    /// So many said no that a quorum can no longer say yes.
    No,
    /// Neither: too few nodes answered.
    Open,
}

impl RedisEngine {
    /// Asks every node at once and stops waiting once `decided` holds for the answers so far
    /// (or every node answered): a hung node then costs nothing once the others have settled
    /// the outcome, and the nodes still waiting count as not having answered. Their requests
    /// go on in a task of their own until they end or time out: a request may take more than
    /// one round trip (the driver loads a script a node does not know, as after its restart,
    /// and sends it again), and one abandoned halfway would leave a healthy node holding a
    /// released lock until its TTL ended.
    pub(super) async fn ask_until<'a, T, Fut>(
        &'a self,
        mut ask: impl FnMut(&'a Node) -> Fut,
        decided: impl Fn(&[&T]) -> bool,
    ) -> Tally<'a, T>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = NodeResult<T>> + Send + 'static,
    {
        use futures_util::stream::{FuturesUnordered, StreamExt};
        // One node decides alone: its answer is awaited in place, with none of the set of
        // futures below, which costs more than the rest of a release's client work.
        if let [node] = self.nodes.as_slice() {
            return Tally {
                engine: self,
                answers: vec![ask(node).await],
                votes_only: false,
            };
        }
        let mut pending: FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(ask)
            .enumerate()
            .map(|(i, f)| async move { (i, f.await) })
            .collect();
        let mut answers: Vec<Option<NodeResult<T>>> = self.nodes.iter().map(|_| None).collect();
        while let Some((i, answer)) = pending.next().await {
            answers[i] = Some(answer);
            let ok: Vec<&T> = answers
                .iter()
                .filter_map(|a| a.as_ref().and_then(|a| a.as_ref().ok()))
                .collect();
            if decided(&ok) {
                break;
            }
        }
        if !pending.is_empty() {
            tokio::spawn(async move { while pending.next().await.is_some() {} });
        }
        Tally {
            engine: self,
            answers: answers
                .into_iter()
                .zip(&self.nodes)
                .map(|(a, n)| {
                    a.unwrap_or_else(|| {
                        Err(format!("{}: not waited for, the others decided", n.addr()))
                    })
                })
                .collect(),
            votes_only: false,
        }
    }

    /// Asks every node at once; every answer counts.
    pub(super) async fn ask<'a, T, Fut>(
        &'a self,
        mut ask: impl FnMut(&'a Node) -> Fut,
    ) -> Tally<'a, T>
    where
        Fut: std::future::Future<Output = NodeResult<T>>,
    {
        let answers = match self.nodes.as_slice() {
            [node] => vec![ask(node).await],
            nodes => join_all(nodes.iter().map(ask)).await,
        };
        Tally {
            engine: self,
            answers,
            votes_only: false,
        }
    }
}

impl<'a, T> Tally<'a, T> {
    /// From here on only nodes with a vote count: a node sitting out after a restart may
    /// grant, but its grant is no vote.
    pub(super) fn only_votes(mut self) -> Self {
        self.votes_only = true;
        self
    }

    /// The answers of the nodes that answered, counted or not.
    pub(super) fn answers(&self) -> impl Iterator<Item = &T> {
        self.answers.iter().filter_map(|a| a.as_ref().ok())
    }

    /// Each node's answer turned into another, or into a failure of that node.
    pub(super) fn map<U>(self, mut f: impl FnMut(&Node, T) -> NodeResult<U>) -> Tally<'a, U> {
        let nodes = &self.engine.nodes;
        Tally {
            engine: self.engine,
            answers: self
                .answers
                .into_iter()
                .zip(nodes)
                .map(|(a, n)| a.and_then(|v| f(n, v)))
                .collect(),
            votes_only: self.votes_only,
        }
    }

    /// How many counted nodes answered so.
    pub(super) fn count(&self, so: impl Fn(&T) -> bool) -> usize {
        self.answers
            .iter()
            .zip(&self.engine.nodes)
            .filter(|(a, n)| matches!(a, Ok(v) if so(v)) && (!self.votes_only || n.votes()))
            .count()
    }

    /// Whether a quorum answered so.
    pub(super) fn quorum_says(&self, so: impl Fn(&T) -> bool) -> bool {
        self.count(so) >= self.engine.quorum
    }

    /// Whether a quorum said yes, or so many said no that it no longer can.
    pub(super) fn verdict(&self, yes: impl Fn(&T) -> bool) -> Verdict {
        if self.quorum_says(&yes) {
            Verdict::Yes
        } else if self.engine.nodes.len() - self.count(|v| !yes(v)) < self.engine.quorum {
            Verdict::No
        } else {
            Verdict::Open
        }
    }

    /// The addresses of the nodes that answered so, in node order.
    pub(super) fn nodes_where(&self, so: impl Fn(&T) -> bool) -> Vec<&'a str> {
        let engine: &'a RedisEngine = self.engine;
        self.answers
            .iter()
            .zip(&engine.nodes)
            .filter(|(a, _)| matches!(a, Ok(v) if so(v)))
            .map(|(_, n)| n.addr())
            .collect()
    }

    /// How many nodes answered at all, counted or not.
    pub(super) fn answered(&self) -> usize {
        self.answers.iter().filter(|a| a.is_ok()).count()
    }

    /// Whether fewer than a quorum answered: silence, not a refusal, so no answer of the
    /// nodes that did speak stands for the whole.
    pub(super) fn too_few_answered(&self) -> bool {
        self.answered() < self.engine.quorum
    }

    /// The failures, in node order.
    pub(super) fn errors(&self) -> Vec<String> {
        self.answers
            .iter()
            .filter_map(|r| r.as_ref().err().cloned())
            .collect()
    }

    /// The failures as one text.
    pub(super) fn errors_text(&self) -> String {
        errors_text(&self.errors())
    }

    /// An engine error naming every node's failure when no node answered at all.
    pub(super) fn unless_every_node_failed(&self) -> Result<()> {
        if self.answered() == 0 {
            return Err(Error::engine_failure(self.engine.kind, self.errors_text()));
        }
        Ok(())
    }

    /// Makes the fencing counter `fence` hold at least `mark` on a quorum, counted as this
    /// tally counts: the nodes whose answer `has_mark` says hold it already, then those where
    /// it could be raised (every other node, failed ones included). Any later quorum meets
    /// that one, so it grants above `mark`. Whether it succeeded.
    pub(super) async fn raise_to(
        &self,
        fence: &str,
        mark: u64,
        has_mark: impl Fn(&T) -> bool,
        limit: Duration,
    ) -> bool {
        let agree = self.count(&has_mark);
        if agree >= self.engine.quorum {
            return true;
        }
        let raised = join_all(self.engine.nodes.iter().zip(&self.answers).map(|(n, a)| {
            let skip = matches!(a, Ok(v) if has_mark(v));
            let mut inv = ScriptCall::new(&scripts::RAISE, 1);
            inv.arg(fence).arg(mark);
            async move {
                if skip {
                    return Ok(false);
                }
                n.run::<i64>(inv, limit).await.map(|_| true)
            }
        }))
        .await;
        let raised = Tally {
            engine: self.engine,
            answers: raised,
            votes_only: self.votes_only,
        };
        agree + raised.count(|r| *r) >= self.engine.quorum
    }
}

pub(super) fn errors_text(errors: &[String]) -> String {
    errors.join("; ")
}
