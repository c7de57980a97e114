//! The leases the sidecar holds for applications, and the keeper task of each.
//!
//! The library's watchdog renews every lease (batched, one task per client). What the sidecar
//! adds is the application's side of the bargain: a lease lives only while its application
//! shows it is alive, by keep-alives. The keeper of a lease releases it (owner-checked) the
//! moment the application's deadline passes: the latest keep-alive (the grant counts as one)
//! plus the TTL. An open event stream is not a sign of life: the kernel keeps the connection
//! of a stopped (SIGSTOP, a debugger) or hung process open, so a stream alone would keep a
//! frozen application's lock for ever. The stream is how the application learns of a loss.
//!
//! Dapr-style leases ([`Mode::Dapr`]) are not renewed at all: Dapr's lock is held for
//! `expiryInSeconds` and then expires, which the library reports as a loss. Their owner value
//! is derived from the application's `lockOwner` ([`Registry::dapr_owner`]), so that a
//! restarted sidecar can still unlock them.
//!
//! **Handing a lease back** (the sidecar stops, or the auth file no longer lets the lease's
//! client use its name): a lease is released only once its application has been told, else
//! it could go on working unlocked. Told means: the `lost` event went out on its event stream
//! and the application then closed every stream of the lease, within [`TOLD_WITHIN`]. Any
//! other lease (keep-alives only, Dapr's, a stream left open) is left held on the engine,
//! neither renewed nor released, until its validity ends ([`Lease::leave`]); where the engine
//! would end it with this process, the process waits for that ([`Registry::shut_down`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use fencelock::{FencingToken, Lease};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::time::Instant;

/// How a lease's application proves it is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Keep-alives, each within a TTL of the previous one; renewed by the watchdog meanwhile.
    App,
    /// Dapr's API: held for its TTL without renewal, released by `lockOwner`.
    Dapr { lock_owner: String },
}

/// Why a lease ended, as the event stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// A short code: `released`, `expired`, `not_holder`, `force_released`,
    /// `application_gone`, `revoked`, `shutdown`.
    pub reason: &'static str,
    /// One sentence for people.
    pub message: String,
}

/// What an event stream shows: the lease's current state.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Confirmed renewals so far; a stream reports `renewed` when it grows.
    pub renewals: u64,
    /// Time left in the validity window at the last change.
    pub valid_for: Duration,
    /// When the lease was last renewed (or granted), wall clock.
    pub renewed_at: SystemTime,
    /// Set once the lease has ended; the stream reports `lost` and closes.
    pub ended: Option<Ended>,
}

/// Requests to a lease's keeper, which owns the [`Lease`].
pub enum Cmd {
    /// Owner-checked release; answers with the library's outcome.
    Release(ReleaseReply),
    /// Owner-checked extension now.
    Extend(oneshot::Sender<fencelock::Result<Duration>>),
    /// The lock was force-released through this sidecar: report the loss at once.
    Forced(String),
    /// The sidecar is stopping: report `shutdown`; release once the application has been
    /// told, else leave the lease to expire.
    Shutdown,
    /// The auth file no longer lets the lease's client use its name (said here): as for
    /// `Shutdown`, with the reason `revoked`.
    Revoked(String),
}

/// How long a lease being handed back waits for its application to close its streams after
/// the `lost` event: the time a live application's stream reader takes to read the event and
/// close the connection, with room for a loaded machine.
pub const TOLD_WITHIN: Duration = Duration::from_secs(2);

/// Whether a stream that reported this end waits for the application to close it (its
/// closing is the proof the application was told); other ends close the stream at once.
pub fn awaits_close(reason: &str) -> bool {
    matches!(reason, "shutdown" | "revoked")
}

/// One lease held for an application: what handlers read, and the channel to its keeper.
pub struct Held {
    pub id: String,
    pub resource: String,
    pub owner: String,
    pub token: FencingToken,
    pub ttl: Duration,
    pub client: String,
    /// The bearer token's client name that acquired it (`""` without an auth file).
    pub principal: String,
    pub mode: Mode,
    pub granted_at: SystemTime,
    cmds: mpsc::Sender<Cmd>,
    state: watch::Sender<Snapshot>,
    streams: AtomicUsize,
    last_keepalive: Mutex<Instant>,
    liveness: Notify,
    /// Forced releases of this lease's name through this sidecar in flight.
    forcing: AtomicUsize,
}

impl Held {
    /// Sends a command to the keeper; `false` when the keeper has already finished.
    pub async fn send(&self, cmd: Cmd) -> bool {
        self.cmds.send(cmd).await.is_ok()
    }

    /// Watches the lease's state, for an event stream.
    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.state.subscribe()
    }

    pub fn snapshot(&self) -> Snapshot {
        self.state.borrow().clone()
    }

    /// The application showed it is alive.
    pub fn keepalive(&self) {
        *self
            .last_keepalive
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.liveness.notify_one();
    }

    /// An event stream opened; the guard counts it until dropped.
    pub fn stream_opened(self: &Arc<Self>) -> StreamGuard {
        self.streams.fetch_add(1, Ordering::SeqCst);
        self.liveness.notify_one();
        StreamGuard { held: self.clone() }
    }

    pub fn streams(&self) -> usize {
        self.streams.load(Ordering::SeqCst)
    }

    /// When the application must next show it is alive.
    pub fn app_deadline(&self) -> Instant {
        *self
            .last_keepalive
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            + self.ttl
    }
}

/// Counts one open event stream until dropped (the connection closed).
pub struct StreamGuard {
    held: Arc<Held>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.held.streams.fetch_sub(1, Ordering::SeqCst);
        self.held.liveness.notify_one();
    }
}

/// Every lease the sidecar holds, by lease id.
pub struct Registry {
    leases: Mutex<HashMap<String, Arc<Held>>>,
    closing: AtomicBool,
    /// Signalled when the last keeper has finished, for the shutdown.
    emptied: Notify,
    /// What tells this sidecar's Dapr owners from another's: see [`Registry::dapr_owner`].
    identity: String,
    /// Dapr owner values with a lock attempt in flight: one attempt per owner at a time.
    claims: Mutex<HashSet<String>>,
    /// Leases handed back: how many were released, and the ones left to expire.
    handed_back: Mutex<HandedBack>,
}

/// What the shutdown did with the leases.
#[derive(Debug, Default, Clone)]
pub struct HandedBack {
    /// Released once their application had been told.
    pub released: usize,
    /// Left held on the engine until their validity ends.
    pub left: usize,
    /// The latest end of validity among the left leases that end with this process: until
    /// then the process must live, or they end early.
    pub hold_until: Option<Instant>,
}

/// Leases whose name a forced release through this sidecar is releasing.
pub struct Forcing {
    held: Vec<Arc<Held>>,
}

impl Drop for Forcing {
    fn drop(&mut self) {
        for h in &self.held {
            h.forcing.fetch_sub(1, Ordering::SeqCst);
            h.liveness.notify_one();
        }
    }
}

/// One Dapr owner value with a lock attempt in flight; dropping it ends the claim.
pub struct Claim {
    registry: Arc<Registry>,
    owner: String,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.registry
            .claims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.owner);
    }
}

/// What the handler that acquired a lease tells the registry about it.
pub struct Grant {
    pub client: String,
    pub principal: String,
    pub mode: Mode,
}

impl Registry {
    /// A registry for the sidecar known by `identity`: its host and the address it listens
    /// on, which a restarted sidecar serving the same applications has too.
    pub fn new(identity: String) -> Registry {
        Registry {
            leases: Mutex::default(),
            closing: AtomicBool::new(false),
            emptied: Notify::new(),
            identity,
            claims: Mutex::default(),
            handed_back: Mutex::default(),
        }
    }

    /// The owner value of the Dapr lock `lock_owner` takes on `resource` through `store`, as
    /// `principal`: the same in every process of this sidecar (so that a restarted one can
    /// unlock what its predecessor locked), different for every other sidecar and client.
    /// Dapr's own Redis store writes the `lockOwner` itself as the value; here the engine
    /// grants a lock again to its owner value, so the value must not be shared with another
    /// sidecar whose application happens to use the same `lockOwner`.
    pub fn dapr_owner(
        &self,
        principal: &str,
        store: &str,
        resource: &str,
        lock_owner: &str,
    ) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"fencelock dapr owner v1");
        // Each field with its length, so that no two different tuples hash alike.
        for field in [
            self.identity.as_str(),
            principal,
            store,
            resource,
            lock_owner,
        ] {
            h.update((field.len() as u64).to_be_bytes());
            h.update(field.as_bytes());
        }
        h.finalize()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Marks the leases held on `resource` as being force-released through this sidecar, until
    /// the guard is dropped (the forced release answered, and its lease was told why).
    pub fn forcing(&self, resource: &str) -> Forcing {
        let held = self.on_resource(resource);
        for h in &held {
            h.forcing.fetch_add(1, Ordering::SeqCst);
        }
        Forcing { held }
    }

    /// Claims `owner` for one lock attempt; `None` while another attempt has it.
    pub fn claim(self: &Arc<Self>, owner: &str) -> Option<Claim> {
        let fresh = self
            .claims
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(owner.to_owned());
        fresh.then(|| Claim {
            registry: self.clone(),
            owner: owner.to_owned(),
        })
    }

    fn handed_back(&self) -> std::sync::MutexGuard<'_, HandedBack> {
        self.handed_back.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `lease` into the sidecar's care and starts its keeper. `None` when the sidecar
    /// is shutting down: the lease is released before returning.
    pub async fn adopt(self: &Arc<Self>, lease: Lease, grant: Grant) -> Option<Arc<Held>> {
        if self.closing.load(Ordering::SeqCst) {
            let _ = lease.release().await;
            return None;
        }
        let (cmds, rx) = mpsc::channel(8);
        let (state, _) = watch::channel(Snapshot {
            renewals: 0,
            valid_for: lease.time_left(),
            renewed_at: SystemTime::now(),
            ended: None,
        });
        let held = Arc::new(Held {
            // Lease ids are capabilities (they release and extend): 128 random bits, like owners.
            id: format!("{:032x}", rand::random::<u128>()),
            resource: lease.resource().to_owned(),
            owner: lease.owner().to_owned(),
            token: lease.token(),
            ttl: lease.ttl(),
            client: grant.client,
            principal: grant.principal,
            mode: grant.mode,
            granted_at: SystemTime::now(),
            cmds,
            state,
            streams: AtomicUsize::new(0),
            last_keepalive: Mutex::new(Instant::now()),
            liveness: Notify::new(),
            forcing: AtomicUsize::new(0),
        });
        self.map().insert(held.id.clone(), held.clone());
        tokio::spawn(keep(self.clone(), held.clone(), lease, rx));
        Some(held)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Held>>> {
        self.leases.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Option<Arc<Held>> {
        self.map().get(id).cloned()
    }

    /// The leases held on `resource`.
    pub fn on_resource(&self, resource: &str) -> Vec<Arc<Held>> {
        self.map()
            .values()
            .filter(|h| h.resource == resource)
            .cloned()
            .collect()
    }

    pub fn all(&self) -> Vec<Arc<Held>> {
        self.map().values().cloned().collect()
    }

    fn remove(&self, id: &str) {
        let mut map = self.map();
        map.remove(id);
        if map.is_empty() {
            self.emptied.notify_waiters();
        }
    }

    /// Hands back the leases `revoked` picks (their client lost the right to their name), as
    /// a shutdown does; returns how many.
    pub async fn revoke(&self, revoked: impl Fn(&Held) -> Option<String>) -> usize {
        let mut n = 0;
        for held in self.all() {
            if let Some(why) = revoked(&held) {
                n += usize::from(held.send(Cmd::Revoked(why)).await);
            }
        }
        n
    }

    /// Refuses new leases, tells every keeper to hand its lease back (see the module docs),
    /// and waits (up to `limit`) until all have. Returns what became of them.
    pub async fn shut_down(&self, limit: Duration) -> HandedBack {
        self.closing.store(true, Ordering::SeqCst);
        let all = self.all();
        for held in &all {
            held.send(Cmd::Shutdown).await;
        }
        let _ = tokio::time::timeout(limit, async {
            loop {
                let emptied = self.emptied.notified();
                if self.map().is_empty() {
                    return;
                }
                emptied.await;
            }
        })
        .await;
        self.handed_back().clone()
    }
}

/// The keeper: owns the lease until it ends, reports its renewals and its end, and releases
/// it when its application stops showing it is alive.
async fn keep(
    registry: Arc<Registry>,
    held: Arc<Held>,
    lease: Lease,
    mut cmds: mpsc::Receiver<Cmd>,
) {
    let (ended, reply) = watch_lease(&held, &lease, &mut cmds).await;
    let ended = if awaits_close(ended.reason) {
        hand_back(&registry, &held, lease, ended).await
    } else if matches!(ended.reason, "application_gone" | "released") {
        // Reported before the release call returns: streams learn at once that the lease
        // must no longer be relied on.
        held.state.send_modify(|s| s.ended = Some(ended.clone()));
        let outcome = lease.release().await;
        let ended = match &outcome {
            Ok(()) => ended,
            Err(e) => Ended {
                reason: ended.reason,
                message: format!("{}; the release failed ({e})", ended.message),
            },
        };
        if let Some(reply) = reply {
            let _ = reply.send(outcome);
        }
        ended
    } else {
        drop(lease);
        ended
    };
    tracing::info!(resource = %held.resource, token = %held.token, reason = ended.reason, "sidecar lease ended");
    held.state.send_modify(|s| s.ended = Some(ended));
    registry.remove(&held.id);
}

type ReleaseReply = oneshot::Sender<fencelock::Result<()>>;

/// The reason of a forced release through this sidecar that was in flight when the lease was
/// found lost: it caused the loss, and its handler sends the reason once answered.
async fn forced_meanwhile(held: &Held, cmds: &mut mpsc::Receiver<Cmd>) -> Option<String> {
    while held.forcing.load(Ordering::SeqCst) > 0 {
        let done = held.liveness.notified();
        tokio::select! {
            // Whatever else was asked of a lost lease gets its answer from the keeper's end:
            // the reply is dropped, which the handlers report as gone.
            cmd = cmds.recv() => if let Some(Cmd::Forced(why)) = cmd {
                return Some(why);
            },
            () = done => {}
        }
    }
    // The handler may have sent its reason just before letting go.
    match cmds.try_recv() {
        Ok(Cmd::Forced(why)) => Some(why),
        _ => None,
    }
}

/// Ends a lease whose application may still be working: reports `ended` to its streams, and
/// releases it if the application then closes them all within [`TOLD_WITHIN`]; otherwise
/// leaves it held, unrenewed, until its validity ends.
async fn hand_back(registry: &Registry, held: &Held, lease: Lease, ended: Ended) -> Ended {
    let streams = held.streams();
    held.state.send_modify(|s| s.ended = Some(ended.clone()));
    let told = streams > 0 && streams_closed_within(held, TOLD_WITHIN).await;
    // The shutdown's count; a lease left to expire counts wherever it was left, since the
    // process may have to outlive it.
    let shutdown = ended.reason == "shutdown";
    if told {
        let outcome = lease.release().await;
        let mut record = registry.handed_back();
        record.released += usize::from(shutdown);
        return Ended {
            reason: ended.reason,
            message: match outcome {
                Ok(()) => format!(
                    "{}; released once the application had closed its stream",
                    ended.message
                ),
                Err(e) => format!("{}; the release failed ({e})", ended.message),
            },
        };
    }
    let left = lease.time_left();
    {
        let mut record = registry.handed_back();
        record.left += usize::from(shutdown);
        if lease.ends_with_process() {
            let until = lease.valid_until();
            record.hold_until = Some(record.hold_until.map_or(until, |u| u.max(until)));
        }
    }
    lease.leave();
    Ended {
        reason: ended.reason,
        message: format!(
            "{}; its application could not be told first, so the lease stays held on the \
             engine, not renewed, until its validity ends in {}",
            ended.message,
            crate::human_duration(left)
        ),
    }
}

/// Whether every stream of `held` closes within `limit`.
async fn streams_closed_within(held: &Held, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        // Made before the check: a stream closing in between leaves its notice stored.
        let closed = held.liveness.notified();
        if held.streams() == 0 {
            return true;
        }
        tokio::select! {
            () = closed => {}
            () = tokio::time::sleep_until(deadline) => return held.streams() == 0,
        }
    }
}

async fn watch_lease(
    held: &Held,
    lease: &Lease,
    cmds: &mut mpsc::Receiver<Cmd>,
) -> (Ended, Option<ReleaseReply>) {
    // No engine call here: the watchdog renews; this only looks at the validity window.
    let tick = (held.ttl / 6).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut valid_until = lease.valid_until();
    loop {
        let app_check = held.mode == Mode::App;
        let deadline = held.app_deadline();
        tokio::select! {
            lost = lease.run(std::future::pending::<()>()) => {
                let message = lost.err().map(|e| e.to_string()).unwrap_or_default();
                if let Some(why) = forced_meanwhile(held, cmds).await {
                    return (Ended { reason: "force_released", message: why }, None);
                }
                // The engine no longer lists this owner, or ended the session that held it
                // (a forced release elsewhere, typically).
                let reason = if message.contains("no longer lists this owner")
                    || message.contains("session holding it ended")
                {
                    "not_holder"
                } else {
                    "expired"
                };
                return (Ended { reason, message }, None);
            }
            cmd = cmds.recv() => match cmd {
                Some(Cmd::Release(reply)) => {
                    let ended = Ended { reason: "released", message: "released by the application".into() };
                    return (ended, Some(reply));
                }
                Some(Cmd::Extend(reply)) => {
                    let out = lease.extend().await.map(|()| lease.time_left());
                    let _ = reply.send(out);
                }
                Some(Cmd::Forced(why)) => {
                    return (Ended { reason: "force_released", message: why }, None);
                }
                Some(Cmd::Revoked(why)) => {
                    return (Ended { reason: "revoked", message: why }, None);
                }
                Some(Cmd::Shutdown) | None => {
                    let ended = Ended { reason: "shutdown", message: "the sidecar is shutting down".into() };
                    return (ended, None);
                }
            },
            _ = tokio::time::sleep_until(deadline), if app_check => {
                if Instant::now() >= held.app_deadline() {
                    let ended = Ended {
                        reason: "application_gone",
                        message: format!(
                            "no keep-alive within the TTL ({}); released",
                            crate::human_duration(held.ttl)
                        ),
                    };
                    return (ended, None);
                }
            }
            _ = held.liveness.notified() => {}
            _ = tokio::time::sleep(tick) => {}
        }
        let now_until = lease.valid_until();
        if now_until > valid_until {
            valid_until = now_until;
            held.state.send_modify(|s| {
                s.renewals += 1;
                s.valid_for = lease.time_left();
                s.renewed_at = SystemTime::now();
            });
        }
    }
}
