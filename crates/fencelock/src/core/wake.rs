//! Release announcements, fanned out to the waiters of each resource, for engines whose
//! server can announce a release to a listening connection (Redis pub/sub, PostgreSQL
//! LISTEN/NOTIFY). One listener per client feeds them; each waiter holds a receiver of its
//! resource, subscribed before its attempt is sent, so an announcement right after a refusal
//! is never missed.
//!
//! - **One waiter per release.** A waiter that subscribes with its owner value takes a place
//!   among the waiters of its resource in this client, kept for its whole acquisition (across
//!   retries). A release announcement that names nobody (the default, barging mode) is
//!   delivered to the oldest of them only: the other waiters would only race it and each
//!   other, and on Redlock a race of several waiters ends in split votes that nobody wins. If
//!   that waiter gives up (its wait ends, its acquisition is dropped) with an announcement it
//!   did not act on, the announcement passes to the next. A waiter that is granted the lock
//!   passes nothing on: the lock is held again, and its release announces itself.
//! - **A release on a quorum.** Each node of a Redlock set announces its own part of one
//!   release; a waiter that retried after the first would find the lock still held on the
//!   others. A waiter retries once announcements from `need` distinct nodes (the quorum)
//!   concern it, or when its own pause ends.
//! - **A release by this client** need not wait for the nodes' announcements: once the release
//!   is written to every node's connection, [`Wakers::wake_ahead`] wakes the oldest waiter at
//!   once (in fair mode only on Redlock, where no release hands the lock on), and its retry
//!   follows the release on each connection, so the server runs it right after the release.
//!   The nodes' own announcements of that release then reach the same waiter, still in its
//!   place, and are spent with it.
//! - **Only the waiter concerned wakes.** A waiter with a place is woken through its own
//!   notification, by an announcement that names it or nobody; the resource's channel only
//!   keeps the announcements for it to read. So a handoff to one of 16 waiters of a client
//!   runs one task, not 16 that would look, find it names another, and sleep again (on a
//!   small machine, beside the server that runs the next release).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use crate::core::token::FencingToken;

/// The release announcements of one resource as waiters see them: the newest few, numbered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Wake {
    /// The newest announcements, oldest first, at most [`Wake::KEPT`], numbered from 1 so that
    /// equal announcements still tell apart.
    pub recent: std::collections::VecDeque<Announcement>,
}

/// One release announcement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Announcement {
    pub seq: u64,
    /// In FIFO mode, the only waiter that can win next; the others keep waiting.
    pub only: Option<String>,
    /// The release handed the lock straight to `only` with this token: that waiter holds it
    /// from the moment the release ran, for its TTL cut to what was left of its queue entry.
    pub granted: Option<FencingToken>,
    /// The announcing node's index in its engine (0 for an engine of one server).
    pub node: usize,
}

impl Wake {
    /// Enough for the announcements of one release by every node of a Redlock set, and some.
    pub(crate) const KEPT: usize = 16;

    /// The number of the newest announcement, 0 before the first.
    pub(crate) fn seq(&self) -> u64 {
        self.recent.back().map_or(0, |a| a.seq)
    }

    pub(crate) fn push(
        &mut self,
        node: usize,
        only: Option<String>,
        granted: Option<FencingToken>,
    ) {
        let seq = self.seq().wrapping_add(1);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Announcement {
            seq,
            only,
            granted,
            node,
        });
    }
}

impl Announcement {
    pub(crate) fn concerns(&self, owner: &str) -> bool {
        self.only.as_deref().is_none_or(|o| o == owner)
    }
}

/// Names with no receiver left are dropped once the map grows past this.
const PRUNE_ABOVE: usize = 1024;

/// The announcements of one resource, from the moment of subscription.
///
/// A watch channel shows only its latest value, and several announcements can come in before
/// the waiter looks (Redlock nodes each announce the same release, naming their own queue
/// heads): the value keeps the newest few, so an earlier one that named this waiter is not
/// lost behind a later one that named another.
#[derive(Debug)]
pub(crate) struct WakeRx {
    rx: watch::Receiver<Wake>,
    seen: u64,
    /// Nodes whose announcements concerning this waiter it has heard but not yet acted on.
    heard: Vec<usize>,
    place: Option<Box<Place>>,
}

/// A waiter's place among the waiters of its resource (see the module docs).
#[derive(Debug)]
struct Place {
    wakers: Arc<Wakers>,
    name: String,
    owner: String,
    /// Announcements from this many distinct nodes make a release.
    need: usize,
    /// The waiter's own notification (see [`Waiter::notify`]).
    notify: Arc<Notify>,
    /// Granted: nothing to pass on.
    settled: bool,
}

impl WakeRx {
    /// Waits for an announcement that may concern `owner`: one naming it (or nobody in
    /// particular), from as many distinct nodes as the subscription needs, or any after more
    /// announcements than are kept went by unseen. Returns the token a handoff granted it, if
    /// the announcement says so; `None` when the announcer is gone.
    pub(crate) async fn concerning(&mut self, owner: &str) -> Option<Option<FencingToken>> {
        let need = self.place.as_ref().map_or(1, |p| p.need.max(1));
        let notify = self.place.as_ref().map(|p| p.notify.clone());
        loop {
            match &notify {
                Some(n) => {
                    n.notified().await;
                    if self.rx.has_changed().is_err() {
                        return None;
                    }
                }
                None => {
                    if self.rx.changed().await.is_err() {
                        return None;
                    }
                }
            }
            let w = self.rx.borrow_and_update();
            if w.seq() == self.seen {
                // A notification left by an announcement an earlier subscription of this
                // waiter already read.
                continue;
            }
            let unseen = || {
                w.recent
                    .iter()
                    .filter(|a| a.seq.wrapping_sub(self.seen) as i64 > 0)
            };
            let missed = unseen()
                .next()
                .is_none_or(|a| a.seq.wrapping_sub(self.seen) > 1);
            // A handoff to this owner wins over any plain wake-up beside it.
            let handoff = unseen()
                .filter(|a| a.concerns(owner))
                .find_map(|a| a.granted);
            for a in unseen().filter(|a| a.concerns(owner)) {
                if !self.heard.contains(&a.node) {
                    self.heard.push(a.node);
                }
            }
            self.seen = w.seq();
            drop(w);
            if handoff.is_some() {
                self.heard.clear();
                return Some(handoff);
            }
            if missed || self.heard.len() >= need {
                self.heard.clear();
                return Some(None);
            }
        }
    }

    /// Ends the subscription of a waiter that was granted the lock: announcements it did not
    /// act on are not passed to the next waiter, since the lock is held again.
    pub(crate) fn settle(mut self) {
        if let Some(p) = self.place.as_mut() {
            p.settled = true;
        }
    }
}

impl Drop for WakeRx {
    fn drop(&mut self) {
        let Some(place) = self.place.take() else {
            return;
        };
        let owner = place.owner.as_str();
        let mut owed = std::mem::take(&mut self.heard);
        {
            let w = self.rx.borrow();
            for a in w
                .recent
                .iter()
                .filter(|a| a.seq.wrapping_sub(self.seen) as i64 > 0)
            {
                if a.only.as_deref() == Some(owner)
                    && a.granted.is_none()
                    && !owed.contains(&a.node)
                {
                    owed.push(a.node);
                }
            }
        }
        let last = place.wakers.leave(&place.name, owner);
        if last && !place.settled {
            for node in owed {
                place.wakers.wake(&place.name, node, None, None);
            }
        }
    }
}

struct Entry {
    tx: watch::Sender<Wake>,
    /// The waiters of this client that took a place, oldest first.
    waiters: Vec<Waiter>,
}

struct Waiter {
    owner: String,
    /// Its live subscriptions.
    refs: usize,
    /// Waits in FIFO mode, where the release itself hands the lock on or names the head.
    fair: bool,
    /// Woken by each announcement that concerns this waiter. Its subscriptions share it, and
    /// only one of them is awaited at a time (the acquisition's latest), which takes the
    /// permit a notification leaves when nobody awaits it yet.
    notify: Arc<Notify>,
}

impl Entry {
    /// Wakes the waiters with a place that an announcement naming `only` concerns, once it is
    /// published: a waiter woken earlier could read the channel before it and sleep again.
    /// Subscribers without a place wait on the channel itself, which every announcement
    /// changes.
    fn notify_concerned(&self, only: Option<&str>) {
        for w in &self.waiters {
            if only.is_none_or(|o| o == w.owner) {
                w.notify.notify_one();
            }
        }
    }
}

#[derive(Default)]
pub(crate) struct Wakers {
    by_name: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for Wakers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wakers")
    }
}

impl Wakers {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.by_name.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver of `name`'s announcements, the number of the last one it has seen, and the
    /// resource's entry.
    fn receiver<'m>(
        map: &'m mut HashMap<String, Entry>,
        name: &str,
    ) -> (watch::Receiver<Wake>, u64, &'m mut Entry) {
        if map.len() > PRUNE_ABOVE {
            map.retain(|_, e| e.tx.receiver_count() > 0 || !e.waiters.is_empty());
        }
        let e = map.entry(name.to_owned()).or_insert_with(|| Entry {
            tx: watch::channel(Wake::default()).0,
            waiters: Vec::new(),
        });
        let rx = e.tx.subscribe();
        // Announcements take the map's lock too, so this is the value the receiver has seen.
        let seen = rx.borrow().seq();
        (rx, seen, e)
    }

    /// Whether any attempt or waiter holds a subscription now: a listener may stop listening
    /// only when nobody does.
    pub(crate) fn anyone_subscribed(&self) -> bool {
        self.entries().values().any(|e| e.tx.receiver_count() > 0)
    }

    /// Every announcement of `name` from now on, without a place among its waiters.
    pub(crate) fn subscribe(&self, name: &str) -> WakeRx {
        let (rx, seen, _) = Self::receiver(&mut self.entries(), name);
        WakeRx {
            rx,
            seen,
            heard: Vec::new(),
            place: None,
        }
    }

    /// The announcements of `name` for the waiter `owner`, which keeps its place among the
    /// waiters while any of its subscriptions lives; a release is `need` nodes' announcements.
    /// `fair`: the waiter is in a FIFO queue, which [`Wakers::wake_ahead`] leaves alone.
    pub(crate) fn subscribe_as(
        self: &Arc<Self>,
        name: &str,
        owner: &str,
        need: usize,
        fair: bool,
    ) -> WakeRx {
        let mut map = self.entries();
        let (rx, seen, e) = Self::receiver(&mut map, name);
        let notify = match e.waiters.iter_mut().find(|w| w.owner == owner) {
            Some(w) => {
                w.refs += 1;
                w.notify.clone()
            }
            None => {
                let notify = Arc::new(Notify::new());
                e.waiters.push(Waiter {
                    owner: owner.to_owned(),
                    refs: 1,
                    fair,
                    notify: notify.clone(),
                });
                notify
            }
        };
        WakeRx {
            rx,
            seen,
            heard: Vec::new(),
            place: Some(Box::new(Place {
                wakers: self.clone(),
                name: name.to_owned(),
                owner: owner.to_owned(),
                need,
                notify,
                settled: false,
            })),
        }
    }

    /// One subscription of `owner` ended; whether it was its last.
    fn leave(&self, name: &str, owner: &str) -> bool {
        let mut map = self.entries();
        let Some(e) = map.get_mut(name) else {
            return true;
        };
        let Some(i) = e.waiters.iter().position(|w| w.owner == owner) else {
            return true;
        };
        e.waiters[i].refs -= 1;
        if e.waiters[i].refs == 0 {
            e.waiters.remove(i);
            return true;
        }
        false
    }

    /// Announces a release of `name` by `node` to its waiters: to `only` (the head of a FIFO
    /// queue, which `granted` says already holds the lock with that token), or, naming nobody,
    /// to the oldest waiter with a place (to every subscriber when none has one).
    pub(crate) fn wake(
        &self,
        name: &str,
        node: usize,
        only: Option<String>,
        granted: Option<FencingToken>,
    ) {
        let map = self.entries();
        if let Some(e) = map.get(name) {
            let only = only.or_else(|| e.waiters.first().map(|w| w.owner.clone()));
            e.tx.send_modify(|w| w.push(node, only, granted));
            let published = e.tx.borrow();
            e.notify_concerned(published.recent.back().and_then(|a| a.only.as_deref()));
        }
    }

    /// This client's release of `name` has been written to the connection of each of `nodes`
    /// nodes, answers pending: wakes the oldest waiter of `name` with a place now, as if every
    /// node had announced the release. Its retry then goes out behind the release on every
    /// connection, which saves the trip of the nodes' announcements before it.
    ///
    /// A fair waiter is woken so only where `fair_too` (Redlock, whose release hands nothing
    /// on): the client's oldest waiter is the head of the queue unless another client's waiter
    /// queued earlier, and then its retry is refused and changes nothing (a queued waiter keeps
    /// its place). Where the release hands the lock to the head itself (one node), a fair
    /// waiter is left to that handoff. Returns whether a waiter was woken.
    pub(crate) fn wake_ahead(&self, name: &str, nodes: usize, fair_too: bool) -> bool {
        let map = self.entries();
        let Some(e) = map.get(name) else {
            return false;
        };
        let Some(first) = e.waiters.first().filter(|w| fair_too || !w.fair) else {
            return false;
        };
        let owner = first.owner.clone();
        e.tx.send_modify(|w| {
            for node in 0..nodes {
                w.push(node, Some(owner.clone()), None);
            }
        });
        first.notify.notify_one();
        true
    }
}

/// Runs a listening session again and again until `shutdown`, backing off from 50 ms to 2 s
/// after failures (reset by a session that ended cleanly). While no session runs, waiters fall
/// back to their own backoff.
pub(crate) async fn keep_listening<F, Fut, E>(
    what: &str,
    shutdown: CancellationToken,
    mut session: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut delay = Duration::from_millis(50);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            r = session() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "{what} lost; reconnecting");
                } else {
                    delay = Duration::from_millis(50);
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn concerning(rx: &mut WakeRx, owner: &str) -> Option<Option<FencingToken>> {
        tokio::time::timeout(Duration::from_millis(50), rx.concerning(owner))
            .await
            .ok()
            .flatten()
    }

    #[tokio::test]
    async fn a_waiter_named_by_an_earlier_announcement_is_not_lost_behind_a_later_one() {
        let wakers = Wakers::default();
        let (mut w1, mut w2, mut w3) = (
            wakers.subscribe("r"),
            wakers.subscribe("r"),
            wakers.subscribe("r"),
        );
        // Two nodes announce one release, each naming its own queue head.
        wakers.wake("r", 0, Some("w1".into()), None);
        wakers.wake("r", 1, Some("w2".into()), Some(FencingToken::new(7)));
        assert_eq!(concerning(&mut w1, "w1").await, Some(None));
        assert_eq!(
            concerning(&mut w2, "w2").await,
            Some(Some(FencingToken::new(7)))
        );
        assert_eq!(concerning(&mut w3, "w3").await, None);
        // An announcement naming nobody concerns everybody.
        wakers.wake("r", 0, None, None);
        assert_eq!(concerning(&mut w3, "w3").await, Some(None));
    }

    /// Counts the wake-ups of the task it stands for.
    struct Counted(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn an_announcement_naming_one_waiter_wakes_no_other() {
        let wakers = Arc::new(Wakers::default());
        let mut first = wakers.subscribe_as("r", "w1", 1, true);
        let mut second = wakers.subscribe_as("r", "w2", 1, true);
        let woken = Arc::new(Counted(0.into()));
        let waker = std::task::Waker::from(woken.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut waiting = Box::pin(second.concerning("w2"));
        assert!(waiting.as_mut().poll(&mut cx).is_pending());

        wakers.wake("r", 0, Some("w1".into()), Some(FencingToken::new(3)));
        wakers.wake("r", 0, Some("w3".into()), None);
        assert_eq!(woken.0.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(
            concerning(&mut first, "w1").await,
            Some(Some(FencingToken::new(3)))
        );
        // Named, it wakes and sees the announcement, past the two it was not woken for.
        wakers.wake("r", 0, Some("w2".into()), None);
        assert_eq!(woken.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(
            waiting.as_mut().poll(&mut cx),
            std::task::Poll::Ready(Some(None))
        );
    }

    #[tokio::test]
    async fn more_unseen_announcements_than_are_kept_wake_every_waiter() {
        let wakers = Wakers::default();
        let mut w = wakers.subscribe("r");
        for i in 0..=Wake::KEPT {
            wakers.wake("r", 0, Some(format!("other-{i}")), None);
        }
        assert_eq!(concerning(&mut w, "w").await, Some(None));
        let mut late = wakers.subscribe("r");
        wakers.wake("r", 0, Some("other".into()), None);
        assert_eq!(concerning(&mut late, "w").await, None);
    }

    #[tokio::test]
    async fn a_release_naming_nobody_wakes_the_oldest_waiter_only() {
        let wakers = Arc::new(Wakers::default());
        let mut first = wakers.subscribe_as("r", "w1", 1, false);
        let mut second = wakers.subscribe_as("r", "w2", 1, false);
        wakers.wake("r", 0, None, None);
        assert_eq!(concerning(&mut second, "w2").await, None);
        assert_eq!(concerning(&mut first, "w1").await, Some(None));
        // A retry subscribes again before the old subscription ends: the place is kept.
        let again = wakers.subscribe_as("r", "w1", 1, false);
        drop(first);
        wakers.wake("r", 0, None, None);
        assert_eq!(concerning(&mut second, "w2").await, None);
        drop(again);
        wakers.wake("r", 0, None, None);
        assert_eq!(concerning(&mut second, "w2").await, Some(None));
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_wake_up_on_unless_it_was_granted() {
        let wakers = Arc::new(Wakers::default());
        let first = wakers.subscribe_as("r", "w1", 1, false);
        let mut second = wakers.subscribe_as("r", "w2", 1, false);
        wakers.wake("r", 0, None, None);
        drop(first);
        assert_eq!(concerning(&mut second, "w2").await, Some(None));

        let granted = wakers.subscribe_as("r", "w3", 1, false);
        let mut last = wakers.subscribe_as("r", "w4", 1, false);
        drop(second);
        wakers.wake("r", 0, None, None);
        granted.settle();
        assert_eq!(concerning(&mut last, "w4").await, None);
    }

    #[tokio::test]
    async fn a_waiter_on_a_quorum_retries_once_enough_nodes_released() {
        let wakers = Arc::new(Wakers::default());
        let mut w = wakers.subscribe_as("r", "w", 2, false);
        wakers.wake("r", 1, None, None);
        wakers.wake("r", 1, None, None);
        assert_eq!(concerning(&mut w, "w").await, None);
        wakers.wake("r", 2, None, None);
        assert_eq!(concerning(&mut w, "w").await, Some(None));
        // A handoff needs no quorum.
        wakers.wake("r", 0, Some("w".into()), Some(FencingToken::new(9)));
        assert_eq!(
            concerning(&mut w, "w").await,
            Some(Some(FencingToken::new(9)))
        );
    }

    #[tokio::test]
    async fn a_release_on_its_way_wakes_the_oldest_barging_waiter_on_every_node() {
        let wakers = Arc::new(Wakers::default());
        assert!(!wakers.wake_ahead("r", 3, false));
        let mut first = wakers.subscribe_as("r", "w1", 2, false);
        let mut second = wakers.subscribe_as("r", "w2", 2, false);
        assert!(wakers.wake_ahead("r", 3, false));
        // A quorum of nodes is heard at once; the next waiter is not woken.
        assert_eq!(concerning(&mut first, "w1").await, Some(None));
        assert_eq!(concerning(&mut second, "w2").await, None);
        // The nodes' own announcements of that release reach the same waiter, which settles.
        wakers.wake("r", 0, None, None);
        wakers.wake("r", 1, None, None);
        first.settle();
        assert_eq!(concerning(&mut second, "w2").await, None);

        // A fair waiter first in line is left to the release's handoff on one node, and
        // woken on Redlock, whose release hands nothing on.
        let fair = Arc::new(Wakers::default());
        let mut queued = fair.subscribe_as("q", "w1", 1, true);
        assert!(!fair.wake_ahead("q", 1, false));
        assert_eq!(concerning(&mut queued, "w1").await, None);
        let mut on_quorum = fair.subscribe_as("q3", "w1", 2, true);
        assert!(fair.wake_ahead("q3", 3, true));
        assert_eq!(concerning(&mut on_quorum, "w1").await, Some(None));
    }
}
