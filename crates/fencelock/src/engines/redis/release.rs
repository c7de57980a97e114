//! Owner-checked release on every node: of a lease, or of a split vote's minority grant.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use super::keys::Keys;
use super::node::{Node, NodeResult, ScriptCall};
use super::votes::Tally;
use super::{scripts, RedisEngine};
use crate::core::error::Result;

/// What a release means for the owner's place in the FIFO queues.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Release {
    /// The owner is done: a lease released, or an acquisition abandoned; it leaves the queues.
    Done,
    /// A split vote rolled back: the owner goes on waiting and keeps its place in the queues
    /// of the nodes that refused it. Nodes that answered one attempt in different orders
    /// would otherwise send a waiter that won on a minority to the back of every queue, again
    /// and again.
    KeepWaiting,
}

impl RedisEngine {
    /// The release on one node, as a future that owns what it needs: a release the caller
    /// stopped waiting for still reaches its node (see [`RedisEngine::ask_until`]).
    fn release_on(
        &self,
        node: &Node,
        keys: &Keys,
        owner: &str,
        release: Release,
        limit: Duration,
    ) -> impl Future<Output = NodeResult<bool>> + Send + 'static {
        let mode = self.prefix.len() * 4
            + 2 * usize::from(self.one_node())
            + usize::from(release == Release::KeepWaiting);
        let invoke = move |lock: &str, owner: &str, held: Option<&str>| {
            let mut inv = ScriptCall::new(&scripts::RELEASE, 1 + usize::from(held.is_some()));
            inv.arg(lock);
            if let Some(held) = held {
                inv.arg(held);
            }
            inv.arg(owner).arg(mode);
            inv
        };
        let (node, lock, owner) = (node.owned(), keys.lock.clone(), owner.to_owned());
        let (held, seen) = (self.held_key.clone(), self.quota_seen.clone());
        async move {
            let with_held = seen.load(Ordering::Relaxed);
            let call = invoke(&lock, &owner, with_held.then_some(held.as_str()));
            match node.run::<i64>(call, limit).await? {
                // The grant was counted under a quota this client had not seen yet: the script
                // changed nothing and asks for the `held` set, which it gets from now on.
                2 if !with_held => {
                    seen.store(true, Ordering::Relaxed);
                    let call = invoke(&lock, &owner, Some(&held));
                    Ok(node.run::<i64>(call, limit).await? == 1)
                }
                answer => Ok(answer == 1),
            }
        }
    }

    /// Whether each node released `owner`'s key.
    pub(super) async fn release_everywhere(
        &self,
        keys: &Keys,
        owner: &str,
        release: Release,
        limit: Duration,
    ) -> Tally<'_, bool> {
        self.ask(|n| self.release_on(n, keys, owner, release, limit))
            .await
    }

    /// The release of a lease: released when a quorum released it.
    pub(super) async fn release_lease(&self, name: &str, owner: &str) -> Result<bool> {
        let keys = self.keys(name);
        let (n, q) = (self.nodes.len(), self.quorum);
        // Decided once a quorum released, or so many did not that a quorum no longer can: a
        // hung node does not hold up the end of a command that has finished.
        let release = self.ask_until(
            |node| self.release_on(node, &keys, owner, Release::Done, self.op_timeout),
            |ok| {
                let yes = ok.iter().filter(|r| ***r).count();
                yes >= q || ok.len() - yes > n - q
            },
        );
        let mut release = std::pin::pin!(release);
        // The first poll writes the release to every node's connection. A waiter of this
        // client woken now sends its retry behind it on each connection, so the nodes run the
        // retry right after the release, without waiting for their announcements of it.
        let first = std::future::poll_fn(|cx| Poll::Ready(release.as_mut().poll(cx))).await;
        let answers = match first {
            Poll::Ready(answers) => answers,
            Poll::Pending => {
                self.wakers.wake_ahead(name, n, !self.one_node());
                release.await
            }
        };
        answers.unless_every_node_failed()?;
        Ok(answers.quorum_says(|released| *released))
    }
}
