//! The slots and their sessions: a resource always maps to the same slot, so re-entrance is
//! seen locally; each session remembers what it holds and runs its statements from a queue,
//! those of one key in the order they were asked.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_postgres::{Client, Statement};
use tokio_util::sync::CancellationToken;

use super::acquire::{grant, GRANT};
use super::release::{release, RELEASE, UNLOCK};
use super::renew::{take_expired, unlock_expired, MINE, SWEEP_EVERY};
use super::AdvisoryEngine;
use crate::core::engine::{AcquireRequest, Attempt};
use crate::core::error::Result;
use crate::core::holder::Holder;

/// What this process knows a session holds, per advisory key.
pub(super) enum Held {
    /// An attempt whose answer never came: the session may or may not hold the key. Nobody
    /// was handed a lease for it, so the next attempt unlocks it first.
    Pending,
    Granted {
        owner: String,
        name: String,
        holder: Box<Holder>,
        /// The TTL enforced here, since the server has none: a lease neither renewed nor
        /// released by then (dropped, or its process's renewals stalled) is unlocked.
        expires: Instant,
    },
}

pub(super) struct Session {
    pub(super) client: Client,
    pub(super) grant: Statement,
    pub(super) release: Statement,
    pub(super) unlock: Statement,
    pub(super) mine: Statement,
    /// The namespace and who this client is, for the limits the grant checks.
    pub(super) prefix: String,
    pub(super) holder_id: String,
    pub(super) held: Arc<Mutex<HashMap<i64, Held>>>,
    pub(super) ended: CancellationToken,
    pub(super) ops: mpsc::UnboundedSender<Op>,
}

pub(super) enum Op {
    Acquire {
        key: i64,
        row: String,
        req: AcquireRequest,
        reply: oneshot::Sender<Result<Attempt>>,
    },
    Release {
        key: i64,
        owner: String,
        channel: String,
        name: String,
        reply: oneshot::Sender<Result<bool>>,
    },
}

pub(super) fn lock(held: &Mutex<HashMap<i64, Held>>) -> MutexGuard<'_, HashMap<i64, Held>> {
    held.lock().unwrap_or_else(|p| p.into_inner())
}

impl AdvisoryEngine {
    pub(super) fn slot_of(&self, key: i64) -> usize {
        // Every lease of one resource uses the same session, so re-entrance is seen locally.
        (key as u64 % self.slots.len() as u64) as usize
    }

    /// The slot's live session, connecting one if there is none.
    pub(super) async fn session(&self, slot: usize) -> Result<Arc<Session>> {
        let mut current = self.slots[slot].lock().await;
        if let Some(s) = current.as_ref().filter(|s| !s.ended.is_cancelled()) {
            return Ok(s.clone());
        }
        let s = self.open_session().await?;
        *current = Some(s.clone());
        Ok(s)
    }

    /// The slot's session if it is alive; never connects (a new session holds nothing).
    pub(super) async fn live_session(&self, slot: usize) -> Option<Arc<Session>> {
        let current = self.slots[slot].lock().await;
        current
            .as_ref()
            .filter(|s| !s.ended.is_cancelled())
            .cloned()
    }

    pub(super) async fn any_session(&self) -> Result<Arc<Session>> {
        for slot in 0..self.slots.len() {
            if let Some(s) = self.live_session(slot).await {
                return Ok(s);
            }
        }
        self.session(0).await
    }

    async fn open_session(&self) -> Result<Arc<Session>> {
        let held: Arc<Mutex<HashMap<i64, Held>>> = Arc::default();
        let ended = CancellationToken::new();
        let (h, e, losses) = (held.clone(), ended.clone(), self.loss_tx.clone());
        let client = self
            .shared
            .connect_with(move || {
                // Cancelled before the map is drained: a grant recorded after the drain sees
                // the session ended and is withdrawn (see `grant`).
                e.cancel();
                let drained = std::mem::take(&mut *lock(&h));
                for held in drained.into_values() {
                    if let Held::Granted { owner, .. } = held {
                        let _ = losses.send(owner);
                    }
                }
            })
            .await?;
        let prepare = async {
            Ok::<_, tokio_postgres::Error>((
                client.prepare(GRANT).await?,
                client.prepare(RELEASE).await?,
                client.prepare(UNLOCK).await?,
                client.prepare(MINE).await?,
            ))
        };
        let (grant, release, unlock, mine) = self.shared.bounded(prepare).await?;
        let (ops, queue) = mpsc::unbounded_channel();
        let session = Arc::new(Session {
            client,
            grant,
            release,
            unlock,
            mine,
            prefix: self.shared.prefix.clone(),
            holder_id: self.shared.holder_id.clone(),
            held,
            ended,
            ops,
        });
        tokio::spawn(work(
            session.clone(),
            queue,
            self.shared.channel.clone(),
            self.shared.shutdown.clone(),
            self.shared.kind,
            self.shared.op_timeout,
        ));
        Ok(session)
    }
}

/// Runs one session's grants and releases: those of different keys concurrently (pipelined
/// on the connection), those of one key one after another in the order they were asked, and
/// whether or not the caller still waits for the answer.
pub(super) async fn work(
    s: Arc<Session>,
    mut queue: mpsc::UnboundedReceiver<Op>,
    channel: String,
    shutdown: CancellationToken,
    kind: &'static str,
    limit: Duration,
) {
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Keys with a statement in flight, and what waits behind it.
    let mut busy: HashMap<i64, VecDeque<Op>> = HashMap::new();
    let mut running: FuturesUnordered<BoxFuture<'static, Vec<i64>>> = FuturesUnordered::new();
    // Made once: a cancellation future built anew in every turn of the loop would register
    // with its token and deregister again for every statement.
    let (ended, stopped) = (s.ended.clone(), shutdown.clone());
    let (ended, stopped) = (ended.cancelled(), stopped.cancelled());
    tokio::pin!(ended, stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = &mut ended => return,
            _ = sweep.tick() => {
                let (keys, names) = take_expired(&s, &busy);
                if !keys.is_empty() {
                    for k in &keys {
                        busy.insert(*k, VecDeque::new());
                    }
                    let (s, channel) = (s.clone(), channel.clone());
                    running.push(Box::pin(async move {
                        unlock_expired(&s, keys, names, &channel, kind, limit).await
                    }));
                }
            }
            op = queue.recv() => {
                let Some(op) = op else { return };
                let key = op.key();
                match busy.get_mut(&key) {
                    Some(behind) => behind.push_back(op),
                    None => {
                        busy.insert(key, VecDeque::new());
                        running.push(run(s.clone(), op, kind, limit));
                    }
                }
            }
            Some(done) = running.next(), if !running.is_empty() => {
                for key in done {
                    let next = busy.get_mut(&key).and_then(VecDeque::pop_front);
                    match next {
                        Some(op) => running.push(run(s.clone(), op, kind, limit)),
                        None => {
                            busy.remove(&key);
                        }
                    }
                }
            }
        }
    }
}

impl Op {
    fn key(&self) -> i64 {
        match self {
            Op::Acquire { key, .. } | Op::Release { key, .. } => *key,
        }
    }
}

/// One grant or release; resolves to the key it concerned.
fn run(
    s: Arc<Session>,
    op: Op,
    kind: &'static str,
    limit: Duration,
) -> BoxFuture<'static, Vec<i64>> {
    Box::pin(async move {
        match op {
            Op::Acquire {
                key,
                row,
                req,
                reply,
            } => {
                let _ = reply.send(grant(&s, key, &row, &req, kind, limit).await);
                vec![key]
            }
            Op::Release {
                key,
                owner,
                channel,
                name,
                reply,
            } => {
                let _ = reply.send(release(&s, key, &owner, &channel, &name, kind, limit).await);
                vec![key]
            }
        }
    })
}
