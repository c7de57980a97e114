//! The slots and their sessions: a resource always maps to the same slot, so re-entrance is
//! seen locally; each session remembers what it holds and runs the statements of one key in
//! the order they were asked: in the caller's task when the key has none in flight, else
//! from its queue in the session's task.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
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
    /// The server process of this session, as `pg_locks` names its holder.
    pub(super) backend_pid: i32,
    pub(super) grant: Statement,
    pub(super) release: Statement,
    pub(super) unlock: Statement,
    pub(super) mine: Statement,
    /// The namespace and who this client is, for the limits the grant checks.
    pub(super) prefix: String,
    pub(super) holder_id: String,
    pub(super) held: Arc<Mutex<HashMap<i64, Held>>>,
    pub(super) ended: CancellationToken,
    /// Keys with a statement in flight, and the statements waiting behind it. Shared by the
    /// callers and the session's task; locked before `held` where both are.
    busy: Mutex<HashMap<i64, VecDeque<Op>>>,
    /// Statements whose key is already marked busy, for the session's task to run. Closed
    /// when the task stops, after which the session takes no statement.
    ops: mpsc::UnboundedSender<Op>,
    kind: &'static str,
    limit: Duration,
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

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Session {
    /// Whether this session holds `key` for `owner`, as far as this process knows.
    pub(super) fn holds(&self, key: i64, owner: &str) -> bool {
        matches!(lock(&self.held).get(&key), Some(Held::Granted { owner: o, .. }) if o == owner)
    }

    /// Runs `op`, its answer going to the op's reply: right here when no statement of its
    /// key is in flight, so the usual grant or release makes no hop to the session's task
    /// and back; else after the key's earlier statements, from the session's task. A caller
    /// that stops waiting does not stop the statement (see [`Detached`]). `Err` when the
    /// session has stopped taking statements.
    pub(super) async fn submit(self: &Arc<Self>, op: Op) -> std::result::Result<(), ()> {
        let key = op.key();
        let now = {
            let mut busy = lock(&self.busy);
            if self.ops.is_closed() {
                return Err(());
            }
            match busy.get_mut(&key) {
                Some(behind) => {
                    behind.push_back(op);
                    None
                }
                None => {
                    busy.insert(key, VecDeque::new());
                    Some(op)
                }
            }
        };
        if let Some(op) = now {
            let s = self.clone();
            Detached(Some(Box::pin(async move {
                for key in run(s.clone(), op).await {
                    if let Some(next) = s.next_of(key) {
                        // Refused only once the task has stopped: the op is dropped, and
                        // its caller told the session is gone.
                        let _ = s.ops.send(next);
                    }
                }
            })))
            .await;
        }
        Ok(())
    }

    /// The statement waiting next on `key`, whose statement just finished; the key is no
    /// longer busy when none waits.
    fn next_of(&self, key: i64) -> Option<Op> {
        let mut busy = lock(&self.busy);
        let next = busy.get_mut(&key).and_then(VecDeque::pop_front);
        if next.is_none() {
            busy.remove(&key);
        }
        next
    }
}

/// A statement polled in its caller's task that, if the caller drops it before it finished,
/// is finished in a task of its own: a grant the server may have made must be recorded (or
/// a release's answer taken) whether or not anyone still waits for it.
struct Detached(Option<BoxFuture<'static, ()>>);

impl Future for Detached {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(fut) = self.0.as_mut() else {
            return Poll::Ready(());
        };
        let done = fut.as_mut().poll(cx);
        if done.is_ready() {
            self.0 = None;
        }
        done
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(fut) = self.0.take() {
            // Outside a runtime (it is shutting down) the session goes with it.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(fut);
            }
        }
    }
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

    /// This client's live sessions.
    pub(super) async fn live_sessions(&self) -> Vec<Arc<Session>> {
        let mut live = Vec::with_capacity(self.slots.len());
        for slot in 0..self.slots.len() {
            live.extend(self.live_session(slot).await);
        }
        live
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
                client
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await?
                    .try_get::<_, i32>(0)?,
            ))
        };
        let (grant, release, unlock, mine, backend_pid) = self.shared.bounded(prepare).await?;
        let (ops, queue) = mpsc::unbounded_channel();
        let session = Arc::new(Session {
            client,
            backend_pid,
            grant,
            release,
            unlock,
            mine,
            prefix: self.shared.prefix.clone(),
            holder_id: self.shared.holder_id.clone(),
            held,
            ended,
            busy: Mutex::default(),
            ops,
            kind: self.shared.kind,
            limit: self.shared.op_timeout,
        });
        tokio::spawn(work(
            session.clone(),
            queue,
            self.shared.channel.clone(),
            self.shared.shutdown.clone(),
        ));
        Ok(session)
    }
}

/// Runs the statements callers left to the session (those queued behind another of their
/// key, pipelined on the connection with the rest) and the sweep of expired leases, until
/// the session ends or the client shuts down.
pub(super) async fn work(
    s: Arc<Session>,
    mut queue: mpsc::UnboundedReceiver<Op>,
    channel: String,
    shutdown: CancellationToken,
) {
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut running: FuturesUnordered<BoxFuture<'static, Vec<i64>>> = FuturesUnordered::new();
    // Made once: a cancellation future built anew in every turn of the loop would register
    // with its token and deregister again for every statement.
    let (ended, stopped) = (s.ended.clone(), shutdown.clone());
    let (ended, stopped) = (ended.cancelled(), stopped.cancelled());
    tokio::pin!(ended, stopped);
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            _ = &mut ended => break,
            _ = sweep.tick() => {
                let (keys, names) = take_expired(&s, &mut lock(&s.busy));
                if !keys.is_empty() {
                    let (s, channel) = (s.clone(), channel.clone());
                    let (kind, limit) = (s.kind, s.limit);
                    running.push(Box::pin(async move {
                        unlock_expired(&s, keys, names, &channel, kind, limit).await
                    }));
                }
            }
            op = queue.recv() => {
                let Some(op) = op else { break };
                running.push(run(s.clone(), op));
            }
            Some(done) = running.next(), if !running.is_empty() => {
                for key in done {
                    if let Some(op) = s.next_of(key) {
                        running.push(run(s.clone(), op));
                    }
                }
            }
        }
    }
    // Under the lock a caller checks for the closed queue: no statement is left behind it
    // unanswered. The dropped ones tell their callers the session is gone.
    let mut busy = lock(&s.busy);
    queue.close();
    busy.clear();
}

impl Op {
    fn key(&self) -> i64 {
        match self {
            Op::Acquire { key, .. } | Op::Release { key, .. } => *key,
        }
    }
}

/// One grant or release; resolves to the key it concerned.
fn run(s: Arc<Session>, op: Op) -> BoxFuture<'static, Vec<i64>> {
    let (kind, limit) = (s.kind, s.limit);
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
