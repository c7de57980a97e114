//! Wake-ups by `LISTEN`/`NOTIFY`, listened for only while this client has waiters.
//!
//! Every release notifies the prefix's channel, since waiters may sit in other processes. A
//! client that only takes free locks waits for nothing, yet while its session listens, the
//! server signals that session's backend and delivers every release to it, and the client
//! wakes to read each one: on a busy machine that costs the uncontended path more than the
//! statements themselves. So the listening session stays connected but idle until an attempt
//! of this client is refused; it then listens, and wakes the waiters refused before its
//! `LISTEN` took effect, whose release may have gone by unheard, so that they try again at
//! once. It stops listening once nobody has been refused for [`IDLE`] and no attempt or waiter
//! of this client holds a subscription.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_postgres::{AsyncMessage, Config};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use crate::core::wake::{keep_listening, Wakers};

/// How long after the last refusal the session keeps listening when nobody is subscribed.
const IDLE: Duration = Duration::from_secs(2);
/// How often a listening session looks whether it may stop.
const IDLE_CHECK: Duration = Duration::from_millis(500);

/// The refusals the listener has not seen yet.
#[derive(Default)]
pub(super) struct Demand {
    names: Mutex<Vec<String>>,
    notify: Notify,
}

impl Demand {
    /// An attempt on `name` was refused: its waiter needs the wake-ups.
    pub(super) fn refused(&self, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if !names.iter().any(|n| n == name) {
            names.push(name.to_owned());
        }
        drop(names);
        self.notify.notify_one();
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.names.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Keeps one session for the prefix's channel, listening while [`Demand`] says so, and wakes
/// the waiters of the resource each notification names; reconnects when it drops. While it is
/// down, waiters fall back to their backoff.
pub(super) async fn listen_for_wakeups(
    config: Config,
    tls: MakeRustlsConnect,
    channel: String,
    wakers: Arc<Wakers>,
    demand: Arc<Demand>,
    shutdown: CancellationToken,
) {
    let (listen, unlisten) = (format!("LISTEN {channel}"), format!("UNLISTEN {channel}"));
    let reconnected = std::sync::atomic::AtomicBool::new(false);
    keep_listening("wake-up listener", shutdown, || async {
        let (client, mut connection) = config.connect(tls.clone()).await?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let driver = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        let _ = tx.send(n.payload().to_owned());
                    }
                    Ok(_) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        });
        // Waiters left from before a reconnect need the wake-ups at once. The first session
        // waits for a refusal (one made before it connected is kept by `Demand`): an attempt
        // in flight holds a subscription too, and a client that only takes free locks must not
        // listen because its first attempt was under way as the session came up.
        let again = reconnected.swap(true, std::sync::atomic::Ordering::Relaxed);
        let mut wanted = again && wakers.anyone_subscribed();
        'session: loop {
            while !wanted {
                tokio::select! {
                    () = demand.notify.notified() => wanted = true,
                    // Ends when the connection does; a stray notification wakes its waiters.
                    m = rx.recv() => match m {
                        Some(name) => wakers.wake(&name, 0, None, None),
                        None => break 'session,
                    },
                }
            }
            client.batch_execute(&listen).await?;
            // A release between these refusals and the LISTEN went by unheard: their
            // waiters try again now.
            for name in demand.take() {
                wakers.wake(&name, 0, None, None);
            }
            let mut last = Instant::now();
            let mut check = tokio::time::interval(IDLE_CHECK);
            loop {
                tokio::select! {
                    m = rx.recv() => match m {
                        Some(name) => wakers.wake(&name, 0, None, None),
                        None => break 'session,
                    },
                    // Refused while listening: nothing went by unheard.
                    () = demand.notify.notified() => {
                        demand.take();
                        last = Instant::now();
                    }
                    _ = check.tick() => {
                        if last.elapsed() >= IDLE && !wakers.anyone_subscribed() {
                            break;
                        }
                    }
                }
            }
            client.batch_execute(&unlisten).await?;
            wanted = false;
        }
        driver.abort();
        Ok::<(), tokio_postgres::Error>(())
    })
    .await;
}
