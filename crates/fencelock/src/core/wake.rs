//! Release announcements, fanned out to the waiters of each resource, for engines whose
//! server can announce a release to a listening connection (Redis pub/sub, PostgreSQL
//! LISTEN/NOTIFY). One listener per client feeds them; each waiter holds a receiver of its
//! resource, subscribed before its attempt is sent, so an announcement right after a refusal
//! is never missed.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
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
}

impl Wake {
    /// Enough for the announcements of one release by every node of a Redlock set, and some.
    pub(crate) const KEPT: usize = 16;

    /// The number of the newest announcement, 0 before the first.
    pub(crate) fn seq(&self) -> u64 {
        self.recent.back().map_or(0, |a| a.seq)
    }

    pub(crate) fn push(&mut self, only: Option<String>, granted: Option<FencingToken>) {
        let seq = self.seq().wrapping_add(1);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(Announcement { seq, only, granted });
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
}

impl WakeRx {
    /// Waits for an announcement that may concern `owner`: one naming it (or nobody in
    /// particular), or any after more announcements than are kept went by unseen. Returns the
    /// token a handoff granted it, if the announcement says so; `None` when the announcer is
    /// gone.
    pub(crate) async fn concerning(&mut self, owner: &str) -> Option<Option<FencingToken>> {
        while self.rx.changed().await.is_ok() {
            let w = self.rx.borrow_and_update();
            let unseen = w
                .recent
                .iter()
                .filter(|a| a.seq.wrapping_sub(self.seen) as i64 > 0);
            let mut found = None;
            let mut oldest = None;
            for a in unseen {
                oldest.get_or_insert(a.seq);
                if a.concerns(owner) {
                    // A handoff to this owner wins over any plain wake-up beside it.
                    if a.granted.is_some() || found.is_none() {
                        found = Some(a.granted);
                    }
                }
            }
            let missed = oldest.is_none_or(|o| o.wrapping_sub(self.seen) > 1);
            self.seen = w.seq();
            if found.is_some() {
                return found;
            }
            if missed {
                return Some(None);
            }
        }
        None
    }
}

#[derive(Default)]
pub(crate) struct Wakers {
    by_name: Mutex<HashMap<String, watch::Sender<Wake>>>,
}

impl Wakers {
    pub(crate) fn subscribe(&self, name: &str) -> WakeRx {
        let mut map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() > PRUNE_ABOVE {
            map.retain(|_, s| s.receiver_count() > 0);
        }
        let rx = map
            .entry(name.to_owned())
            .or_insert_with(|| watch::channel(Wake::default()).0)
            .subscribe();
        // Announcements take the map's lock too, so this is the value the receiver has seen.
        let seen = rx.borrow().seq();
        WakeRx { rx, seen }
    }

    /// Whether any attempt or waiter holds a subscription now: a listener may stop listening
    /// only when nobody does.
    pub(crate) fn anyone_subscribed(&self) -> bool {
        let map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        map.values().any(|s| s.receiver_count() > 0)
    }

    /// Announces a release of `name` to its waiters: to all of them, or only to `only` (the
    /// head of a FIFO queue), which `granted` says already holds the lock with that token.
    pub(crate) fn wake(&self, name: &str, only: Option<String>, granted: Option<FencingToken>) {
        let map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(name) {
            s.send_modify(|w| w.push(only, granted));
        }
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
        wakers.wake("r", Some("w1".into()), None);
        wakers.wake("r", Some("w2".into()), Some(FencingToken::new(7)));
        assert_eq!(concerning(&mut w1, "w1").await, Some(None));
        assert_eq!(
            concerning(&mut w2, "w2").await,
            Some(Some(FencingToken::new(7)))
        );
        assert_eq!(concerning(&mut w3, "w3").await, None);
        // An announcement naming nobody concerns everybody.
        wakers.wake("r", None, None);
        assert_eq!(concerning(&mut w3, "w3").await, Some(None));
    }

    #[tokio::test]
    async fn more_unseen_announcements_than_are_kept_wake_every_waiter() {
        let wakers = Wakers::default();
        let mut w = wakers.subscribe("r");
        for i in 0..=Wake::KEPT {
            wakers.wake("r", Some(format!("other-{i}")), None);
        }
        assert_eq!(concerning(&mut w, "w").await, Some(None));
        let mut late = wakers.subscribe("r");
        wakers.wake("r", Some("other".into()), None);
        assert_eq!(concerning(&mut late, "w").await, None);
    }
}
