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

use crate::engine::Wake;
use crate::token::FencingToken;

/// Names with no receiver left are dropped once the map grows past this.
const PRUNE_ABOVE: usize = 1024;

#[derive(Default)]
pub(crate) struct Wakers {
    by_name: Mutex<HashMap<String, watch::Sender<Wake>>>,
}

impl Wakers {
    pub(crate) fn subscribe(&self, name: &str) -> watch::Receiver<Wake> {
        let mut map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() > PRUNE_ABOVE {
            map.retain(|_, s| s.receiver_count() > 0);
        }
        map.entry(name.to_owned())
            .or_insert_with(|| watch::channel(Wake::default()).0)
            .subscribe()
    }

    /// Announces a release of `name` to its waiters: to all of them, or only to `only` (the
    /// head of a FIFO queue), which `granted` says already holds the lock with that token.
    pub(crate) fn wake(&self, name: &str, only: Option<String>, granted: Option<FencingToken>) {
        let map = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = map.get(name) {
            s.send_modify(|w| {
                w.seq = w.seq.wrapping_add(1);
                w.only = only;
                w.granted = granted;
            });
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
