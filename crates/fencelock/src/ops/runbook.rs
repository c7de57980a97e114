//! The stuck-lock runbook: whether a holder is alive, which locks are held, forced release and
//! the audit log it writes.
//!
//! Design decisions:
//! - **Time since the last renewal is read off the engine's clock.** Every renewal resets the
//!   expiry to the lease's TTL, so `ttl - ttl_left` is the time since the last renewal as the
//!   engine counts it, and no two machines' wall clocks are compared. The holder's wall-clock
//!   `renewed_at` is only the fallback when the TTL was not recorded.
//! - **Suspect** means the last renewal is overdue — older than the watchdog's cadence (TTL/3)
//!   plus half a cadence, at least 1 s ([`overdue_after`]) — or the holder's process is gone
//!   from this host (the holder recorded this host's name and its pid no longer exists, or is
//!   a zombie).
//! - **A forced release refuses while the holder looks alive**: its process still exists on
//!   this host (a stopped or hung process may resume), or, for a holder on another host (or
//!   whose pid cannot be checked), its last renewal is not overdue or was never recorded. A
//!   process gone from this host is dead whatever its last renewal says, unless work it
//!   supervised under the lease still runs here: the supervisor of a killed `fencelock run`
//!   may still be stopping a command that ignores SIGTERM. That work is found without any
//!   record in the engine, by the owner value it carries: the supervisor's arguments hold
//!   `--owner OWNER` (/proc/PID/cmdline, readable by every user), and the command and its
//!   descendants inherit `FENCELOCK_OWNER=OWNER` (/proc/PID/environ, readable by the same user
//!   and root). An operator who knows better says so ([`ForceRelease::holder_is_dead`]) and the
//!   audit record keeps that.
//!   A recycled pid makes a dead holder look alive: the error is a refusal, the safe side. A
//!   holder in another pid namespace under the same host name (a container sharing the host's
//!   name) would look dead from here: give such containers their own host names.
//! - **Compare-and-delete.** The release deletes the lock only if the owner that was inspected
//!   still holds it, so a lock that changed hands in between (a new, live holder) is left alone.
//! - **The fencing counter advances** in the same atomic step as the deletion, to the *mark*
//!   kept in the audit record: the old holder's token is below it and every later grant's
//!   token above it, so fences reject the old holder once the next holder has written. The old
//!   holder itself learns of the loss at its next renewal, which finds the key gone or taken.
//! - **The audit log lives in the engine** (a table in the SQLite file, a capped stream on each
//!   Redis node), next to the locks it is about, readable by anyone who can inspect them.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::core::client::{Client, ClientInner};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::{Holder, HolderMeta};
use crate::core::name::{validate_name, MAX_NAME_BYTES};
use crate::core::options::{display_duration, renew_interval};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::router::{gather, silent, single, Partial};
use crate::core::token::FencingToken;

/// The age after which a holder's last renewal counts as overdue for a lease of this TTL: the
/// watchdog's cadence (TTL/3) plus half a cadence, and at least one second more than the
/// cadence, so that a slow renewal call is not mistaken for a dead holder.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(fencelock::overdue_after(Duration::from_secs(30)), Duration::from_secs(15));
/// assert_eq!(fencelock::overdue_after(Duration::from_secs(3)), Duration::from_secs(2));
/// ```
pub fn overdue_after(ttl: Duration) -> Duration {
    let cadence = renew_interval(ttl);
    cadence + (cadence / 2).max(Duration::from_secs(1))
}

/// How a holder looks from here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verdict {
    /// Renewing on time, or its process runs on this host.
    Healthy,
    /// Its last renewal is overdue, or its process is gone from this host.
    Suspect,
    /// Nothing to judge by: no renewal recorded (a lock taken with a plain `SET ... NX PX` by
    /// another client) and no process that can be checked from this host.
    Unknown,
}

impl Verdict {
    /// `healthy`, `suspect` or `unknown`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Healthy => "healthy",
            Verdict::Suspect => "suspect",
            Verdict::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The holder's process as this host can see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProcessState {
    /// The holder recorded this host's name and its pid exists (possibly stopped).
    Running,
    /// The holder recorded this host's name and its pid no longer exists, or is a zombie.
    Gone,
    /// The holder is on another host, or recorded no host or pid: not checked.
    NotChecked,
}

/// What the runbook concludes about a holder; see [`Holder::assess`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Assessment {
    /// Healthy, suspect or unknown.
    pub verdict: Verdict,
    /// Time since the last renewal (or the grant), on the engine's clock where it can be.
    pub since_renewal: Option<Duration>,
    /// The age after which the last renewal counts as overdue ([`overdue_after`] of the TTL).
    pub overdue_after: Option<Duration>,
    /// The holder's process, if it runs on this host.
    pub process: ProcessState,
    /// When the holder's process is [gone](ProcessState::Gone): the processes of this host
    /// still at work under its lease (the supervisor and command of a `fencelock run` that was
    /// killed), by pid, in ascending order. While any runs the holder looks alive.
    pub supervised: Vec<u32>,
    /// Whether a forced release must be refused unless the holder is declared dead.
    pub looks_alive: bool,
    /// The evidence behind the verdict, in one sentence.
    pub reason: String,
}

impl Holder {
    /// Judges the holder as seen from this host, now: its renewal age against
    /// [`overdue_after`] and, when the holder recorded this host's name, whether its pid still
    /// exists. The rules are in the crate docs, [stuck-lock runbook](crate#stuck-lock-runbook).
    pub fn assess(&self) -> Assessment {
        self.assess_with(SystemTime::now(), &local_host(), pid_running, working_for)
    }

    /// [`Holder::assess`] with the clock, the host name and the process probes given, so the
    /// rules can be tested without real processes. `running(pid)` is `None` when it cannot
    /// tell; `working_for(owner)` lists the live processes at work under that owner's lease.
    pub(crate) fn assess_with(
        &self,
        now: SystemTime,
        local_host: &str,
        running: impl Fn(u32) -> Option<bool>,
        working_for: impl Fn(&str) -> Vec<u32>,
    ) -> Assessment {
        let since_renewal = match (self.ttl, self.ttl_left) {
            (Some(ttl), Some(left)) => Some(ttl.saturating_sub(left)),
            _ => self
                .renewed_at
                .map(|r| now.duration_since(r).unwrap_or_default()),
        };
        let overdue = self.ttl.map(overdue_after);
        let stale = since_renewal.zip(overdue).map(|(s, o)| s > o);
        let process = match (self.host.as_deref(), self.pid) {
            (Some(h), Some(pid)) if h == local_host => match running(pid) {
                Some(true) => ProcessState::Running,
                Some(false) => ProcessState::Gone,
                None => ProcessState::NotChecked,
            },
            _ => ProcessState::NotChecked,
        };
        // Only the pid recorded with the lease says that this host is the holder's: a
        // process carrying the owner of a holder elsewhere is none of this check's business.
        let supervised = if process == ProcessState::Gone && !self.owner.is_empty() {
            working_for(&self.owner)
        } else {
            Vec::new()
        };

        let mut facts = Vec::new();
        match (stale, since_renewal, self.ttl) {
            (Some(stale), Some(since), Some(ttl)) => facts.push(format!(
                "last renewal {} ago, {} (renewal cadence {}, overdue after {})",
                display_duration(since),
                if stale { "overdue" } else { "on time" },
                display_duration(renew_interval(ttl)),
                display_duration(overdue_after(ttl)),
            )),
            (_, Some(since), None) => facts.push(format!(
                "last renewal {} ago, lease TTL not recorded",
                display_duration(since)
            )),
            _ => facts.push("no renewal recorded".to_owned()),
        }
        let pid = self.pid.map_or_else(|| "?".to_owned(), |p| p.to_string());
        match (process, self.host.as_deref()) {
            (ProcessState::Running, _) => facts.push(format!("pid {pid} is running on this host")),
            (ProcessState::Gone, _) if supervised.is_empty() => {
                facts.push(format!("pid {pid} is no longer running on this host"))
            }
            (ProcessState::Gone, _) => {
                let pids: Vec<String> = supervised.iter().take(8).map(u32::to_string).collect();
                facts.push(format!(
                    "pid {pid} is no longer running on this host, but the work it supervised \
                     under this lease still runs (pid {}{})",
                    pids.join(", "),
                    if supervised.len() > pids.len() {
                        ", ..."
                    } else {
                        ""
                    }
                ))
            }
            (ProcessState::NotChecked, Some(h)) if h != local_host => {
                facts.push(format!("its process is on {h}, not checked from here"))
            }
            (ProcessState::NotChecked, _) => {}
        }

        let verdict = if process == ProcessState::Gone || stale == Some(true) {
            Verdict::Suspect
        } else if process == ProcessState::Running || stale == Some(false) {
            Verdict::Healthy
        } else {
            Verdict::Unknown
        };
        let looks_alive = match process {
            ProcessState::Running => true,
            ProcessState::Gone => !supervised.is_empty(),
            ProcessState::NotChecked => stale != Some(true),
        };
        Assessment {
            verdict,
            since_renewal,
            overdue_after: overdue,
            process,
            supervised,
            looks_alive,
            reason: facts.join("; "),
        }
    }
}

/// This machine's host name, as holders record it.
fn local_host() -> String {
    HolderMeta::current(String::new()).host
}

/// Whether `pid` exists on this host and is not a zombie; `None` when it cannot tell.
fn pid_running(pid: u32) -> Option<bool> {
    use nix::errno::Errno;
    // Zero and negative values address process groups, not one process.
    let raw = i32::try_from(pid).ok().filter(|p| *p > 0)?;
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None) {
        Ok(()) | Err(Errno::EPERM) => Some(!is_zombie(raw)),
        Err(Errno::ESRCH) => Some(false),
        Err(_) => None,
    }
}

/// The live processes of this host that carry `owner`: an argument `--owner OWNER` (the
/// supervisor of `fencelock run`), or `FENCELOCK_OWNER=OWNER` in the environment they were
/// started with (its command and their descendants). Another user's environment cannot be
/// read unless this process runs as root, and a process in another pid namespace is not seen.
fn working_for(owner: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut found: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me && carries_owner(pid, owner))
        // Read after the match: a process that exited meanwhile is a zombie or gone.
        .filter(|&pid| pid_running(pid) == Some(true))
        .collect();
    found.sort_unstable();
    found
}

fn carries_owner(pid: u32, owner: &str) -> bool {
    let nul_separated = |file: &str| std::fs::read(format!("/proc/{pid}/{file}")).ok();
    if let Some(args) = nul_separated("cmdline") {
        let args: Vec<&[u8]> = args.split(|&b| b == 0).collect();
        if args
            .windows(2)
            .any(|w| w[0] == b"--owner" && w[1] == owner.as_bytes())
        {
            return true;
        }
    }
    let var = format!("FENCELOCK_OWNER={owner}");
    nul_separated("environ").is_some_and(|env| env.split(|&b| b == 0).any(|v| v == var.as_bytes()))
}

/// A killed process whose parent has not reaped it yet still has a pid, but will never renew.
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // The state is the first field after the parenthesised command name.
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().next().map(|s| s == "Z" || s == "X")
        })
        .unwrap_or(false)
}

/// What an operator states when forcing a release: why, who, from where, and whether the
/// holder is to be taken as dead whatever it looks like.
///
/// ```
/// let req = fencelock::ForceRelease::new("worker-7 was decommissioned")
///     .user("alice")
///     .holder_is_dead(true);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForceRelease {
    reason: String,
    user: String,
    host: String,
    holder_is_dead: bool,
}

/// The longest reason, user or host name kept in an audit record.
const MAX_AUDIT_TEXT: usize = 1024;

impl ForceRelease {
    /// A forced release for `reason` (required, kept in the audit log), by the current user
    /// (`$USER`, else the name of the real user id) on this host, refused while the holder
    /// looks alive.
    pub fn new(reason: impl Into<String>) -> ForceRelease {
        ForceRelease {
            reason: reason.into(),
            user: current_user(),
            host: local_host(),
            holder_is_dead: false,
        }
    }

    /// Who forces the release, for the audit record.
    pub fn user(mut self, user: impl Into<String>) -> ForceRelease {
        self.user = user.into();
        self
    }

    /// The host the release is forced from, for the audit record. Default: this host.
    pub fn host(mut self, host: impl Into<String>) -> ForceRelease {
        self.host = host.into();
        self
    }

    /// Release even though the holder looks alive: the operator has established that it is
    /// dead (or will never write again). Recorded in the audit log.
    pub fn holder_is_dead(mut self, yes: bool) -> ForceRelease {
        self.holder_is_dead = yes;
        self
    }

    fn validate(&self) -> Result<()> {
        for (what, text) in [
            ("reason", &self.reason),
            ("user", &self.user),
            ("host", &self.host),
        ] {
            if text.trim().is_empty() {
                return Err(Error::invalid(format!(
                    "a forced release needs a {what}; it is kept in the audit log"
                )));
            }
            if text.len() > MAX_AUDIT_TEXT || text.chars().any(char::is_control) {
                return Err(Error::invalid(format!(
                    "the {what} of a forced release must be at most {MAX_AUDIT_TEXT} bytes \
                     without control characters"
                )));
            }
        }
        Ok(())
    }
}

fn current_user() -> String {
    if let Some(user) = std::env::var("USER").ok().filter(|u| !u.is_empty()) {
        return user;
    }
    let uid = nix::unistd::getuid();
    match nix::unistd::User::from_uid(uid) {
        Ok(Some(u)) => u.name,
        _ => format!("uid {uid}"),
    }
}

impl Client {
    /// Every held lock whose name starts with `prefix` (a plain string: no pattern characters;
    /// `""` for all), sorted by name. Held means what [`Client::inspect`] says: on Redlock,
    /// held on a majority. Redis engines find the names with `SCAN`, which visits keys a few
    /// hundred at a time, so listing a large namespace costs many calls; the whole listing is
    /// bounded by twelve operation timeouts.
    ///
    /// A routed client asks only the backends some name under `prefix` can route to, all at
    /// once, and merges their rows.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a prefix that is not valid; the error of a backend that
    /// failed (see [`Partial::complete`]). [`Client::list_partial`] answers with what the other
    /// backends hold instead.
    pub async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        self.list_partial(prefix, None).await?.complete()
    }

    /// [`Client::list`], answering with what the backends that answered hold and naming each
    /// one that did not, rather than failing as a whole: a listing that a backend's outage
    /// must not blank out (a dashboard, an operator during an incident). Each backend's answer
    /// is awaited at most `within` (`None`: as long as its own bound), after which it counts
    /// as failed. A client on one URL has one backend, `default`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a prefix that is not valid; every other failure is in
    /// [`Partial::failed`].
    pub async fn list_partial(
        &self,
        prefix: &str,
        within: Option<Duration>,
    ) -> Result<Partial<HeldLock>> {
        if prefix.len() > MAX_NAME_BYTES || prefix.chars().any(char::is_control) {
            return Err(Error::invalid(format!(
                "a name prefix must be at most {MAX_NAME_BYTES} bytes without control characters"
            )));
        }
        let mut partial = self
            .gather(within, backends_under(self, prefix), {
                let prefix = prefix.to_owned();
                move |inner: Arc<ClientInner>| {
                    let prefix = prefix.clone();
                    async move { inner.list_here(&prefix).await }
                }
            })
            .await;
        partial.found.sort_by(|a, b| {
            a.resource
                .cmp(&b.resource)
                .then_with(|| a.backend.cmp(&b.backend))
        });
        Ok(partial)
    }

    /// Runs `ask` on each backend of `names` (on the one backend of a client opened on one
    /// URL), within `within`.
    async fn gather<T, F, Fut>(
        &self,
        within: Option<Duration>,
        names: Vec<String>,
        ask: F,
    ) -> Partial<T>
    where
        T: Send + 'static,
        F: Fn(Arc<ClientInner>) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = Result<Vec<T>>> + Send + 'static,
    {
        match self.router() {
            Some(router) => gather(router, names, within, ask).await,
            None => {
                let answer = async {
                    let inner = self.main().await?.clone();
                    ask(inner).await
                };
                let answer = match within {
                    Some(limit) => tokio::time::timeout(limit, answer)
                        .await
                        .unwrap_or_else(|_| Err(silent(self.engine(), limit))),
                    None => answer.await,
                };
                single(self.backend(), answer)
            }
        }
    }

    /// Deletes the lock on `name` whatever its owner, after checking that its holder looks
    /// dead, and advances the fencing counter so the old holder's token is stale; records
    /// who, when, why and the old holder in the engine's audit log.
    ///
    /// Steps: [`Client::inspect`]; unless [`ForceRelease::holder_is_dead`], refuse with
    /// [`ErrorKind::HeldByAnother`] (carrying the holder and the evidence) while
    /// [`Holder::assess`] says the holder looks alive; then delete the lock only if that same
    /// owner still holds it. Returns the audit record, or `Ok(None)` when the lock was free.
    /// A lock that changed hands after the inspection is not touched: the call fails with
    /// [`ErrorKind::HeldByAnother`] naming the new holder.
    ///
    /// On Redlock the release goes to every node and needs a majority to release the lock (or
    /// find it gone); the counter ends at or above the mark on a majority. On each node the
    /// release and its audit record happen together or not at all; the nodes that did neither
    /// (refused, silent) are named in [`AuditRecord::not_released_on`], or, when they are so
    /// many that the old holder still has a majority, in the error.
    ///
    /// Cancel safety: dropping the future after the release was sent may leave it done (and
    /// recorded) or not done; on each node it is all or nothing.
    pub async fn force_release(
        &self,
        name: &str,
        request: &ForceRelease,
    ) -> Result<Option<AuditRecord>> {
        validate_name(name)?;
        request.validate()?;
        let this = self.on(name).await?;
        this.force_release_here(name, request)
            .await
            .map_err(|e| this.calls.named(e))
    }

    /// The audit log of forced releases under this client's prefix, of `name` or of every
    /// resource, newest first. Redis keeps about the last 10,000 records per prefix (a capped
    /// stream on each node; Redlock merges the nodes' logs); SQLite keeps them all. A routed
    /// client reads `name`'s backend, or without a name every backend at once, merging their
    /// logs.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a name that is not valid; the error of a backend that
    /// failed (see [`Partial::complete`]). [`Client::audit_partial`] answers with the other
    /// backends' records instead.
    pub async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        self.audit_partial(name, None).await?.complete()
    }

    /// [`Client::audit`], answering with the records of the backends that answered and naming
    /// each one that did not, as [`Client::list_partial`] does.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`] for a name that is not valid; every other failure is in
    /// [`Partial::failed`].
    pub async fn audit_partial(
        &self,
        name: Option<&str>,
        within: Option<Duration>,
    ) -> Result<Partial<AuditRecord>> {
        let names = match name {
            Some(name) => {
                validate_name(name)?;
                vec![self.route_of(name)?.to_owned()]
            }
            None => self
                .backends()
                .into_iter()
                .map(|(n, _)| n.to_owned())
                .collect(),
        };
        let name = name.map(str::to_owned);
        let mut partial = self
            .gather(within, names, move |inner: Arc<ClientInner>| {
                let name = name.clone();
                async move { inner.audit_here(name.as_deref()).await }
            })
            .await;
        // Each backend's log is newest first; so is the merge.
        partial.found.sort_by_key(|r| std::cmp::Reverse(r.at));
        Ok(partial)
    }
}

impl ClientInner {
    /// [`Client::list`] on this backend, rows labelled with it.
    async fn list_here(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let label = format!("{prefix}*");
        let mut locks = self
            .calls
            .call(&label, self.cfg.op_timeout * 12, self.engine.list(prefix))
            .await?;
        for lock in &mut locks {
            self.calls.backend_label().clone_into(&mut lock.backend);
        }
        Ok(locks)
    }

    async fn force_release_here(
        &self,
        name: &str,
        request: &ForceRelease,
    ) -> Result<Option<AuditRecord>> {
        let inner = self;
        let engine = inner.engine.kind();
        let Some(holder) = self.inspect(name).await? else {
            return Ok(None);
        };
        let assessment = holder.assess();
        if assessment.looks_alive && !request.holder_is_dead {
            let next = if assessment.process == ProcessState::Running {
                "stop its process first, or declare the holder dead (--holder-is-dead) if it \
                 can never write again"
                    .to_owned()
            } else if !assessment.supervised.is_empty() {
                "wait for that work to end (its supervisor kills it before the lease's TTL \
                 runs out) or stop it, or declare the holder dead (--holder-is-dead) if it \
                 can never write again"
                    .to_owned()
            } else {
                format!(
                    "wait until its renewal is overdue{}, or declare the holder dead \
                     (--holder-is-dead) once you have checked on it",
                    assessment
                        .overdue_after
                        .map(|o| format!(" (after {})", display_duration(o)))
                        .unwrap_or_default()
                )
            };
            return Err(Error::new(
                ErrorKind::HeldByAnother,
                format!(
                    "refusing to force the release, the holder looks alive: {}. To go on, {next}",
                    assessment.reason
                ),
            )
            .with_resource(name)
            .with_engine(engine)
            .with_holder(Some(holder)));
        }
        let mut old = holder.clone();
        old.ttl_left = None;
        let draft = AuditRecord {
            id: format!("{:016x}", rand::random::<u64>()),
            resource: name.to_owned(),
            // Engines keep milliseconds: the record handed back equals the one read back.
            at: crate::core::holder::from_unix_millis(crate::core::holder::unix_millis(
                SystemTime::now(),
            )),
            user: request.user.clone(),
            host: request.host.clone(),
            reason: request.reason.clone(),
            holder_declared_dead: request.holder_is_dead,
            assessment: assessment.reason,
            holder: old,
            counter: FencingToken::new(0),
            not_released_on: Vec::new(),
            ended_with: Vec::new(),
        };
        let done = inner
            .calls
            .call(
                name,
                inner.cfg.op_timeout * 2,
                inner
                    .engine
                    .force_release(name, Some(&holder.owner), &draft),
            )
            .await?;
        if let Some(record) = done {
            tracing::warn!(
                resource = name,
                engine,
                user = %record.user,
                reason = %record.reason,
                old_token = ?record.holder.token,
                counter = %record.counter,
                "lock force-released"
            );
            return Ok(Some(record));
        }
        match self.inspect(name).await? {
            None => Ok(None),
            Some(now) => Err(Error::new(
                ErrorKind::HeldByAnother,
                format!(
                    "nothing was released: the lock changed hands after it was inspected \
                     (owner {} was judged, owner {} holds it now); inspect it again",
                    holder.owner, now.owner
                ),
            )
            .with_resource(name)
            .with_engine(engine)
            .with_holder(Some(now))),
        }
    }

    async fn audit_here(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        self.calls
            .call(
                name.unwrap_or("*"),
                self.cfg.op_timeout * 2,
                self.engine.audit(name),
            )
            .await
    }
}

/// The backends some name starting with `prefix` routes to (the one backend of a client opened
/// on one URL).
fn backends_under(client: &Client, prefix: &str) -> Vec<String> {
    match client.routes() {
        Some(routes) => routes
            .backends_under(prefix)
            .into_iter()
            .map(str::to_owned)
            .collect(),
        None => vec![client.backend().to_owned()],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(host: &str, since_renewal: Duration, ttl: Duration) -> Holder {
        let mut h = Holder::bare("o".into());
        h.host = Some(host.into());
        h.pid = Some(42);
        h.ttl = Some(ttl);
        h.ttl_left = Some(ttl.saturating_sub(since_renewal));
        h
    }

    const NOW: SystemTime = SystemTime::UNIX_EPOCH;

    fn no_work(_: &str) -> Vec<u32> {
        Vec::new()
    }

    #[test]
    fn renewal_on_time_elsewhere_looks_alive() {
        let h = holder("other", Duration::from_secs(5), Duration::from_secs(30));
        let a = h.assess_with(NOW, "here", |_| unreachable!("other host"), no_work);
        assert_eq!(a.verdict, Verdict::Healthy);
        assert_eq!(a.process, ProcessState::NotChecked);
        assert!(a.looks_alive);
        assert_eq!(a.since_renewal, Some(Duration::from_secs(5)));
        assert!(a.reason.contains("on time"), "{}", a.reason);
        assert!(a.reason.contains("on other"), "{}", a.reason);
    }

    #[test]
    fn overdue_renewal_elsewhere_is_suspect_and_may_be_released() {
        let h = holder("other", Duration::from_secs(16), Duration::from_secs(30));
        let a = h.assess_with(NOW, "here", |_| None, no_work);
        assert_eq!(a.verdict, Verdict::Suspect);
        assert!(!a.looks_alive);
        assert!(a.reason.contains("overdue"), "{}", a.reason);
    }

    #[test]
    fn gone_process_here_is_dead_whatever_its_last_renewal() {
        let h = holder("here", Duration::from_millis(10), Duration::from_secs(60));
        let a = h.assess_with(
            NOW,
            "here",
            |pid| {
                assert_eq!(pid, 42);
                Some(false)
            },
            no_work,
        );
        assert_eq!(a.verdict, Verdict::Suspect);
        assert_eq!(a.process, ProcessState::Gone);
        assert!(!a.looks_alive);
    }

    #[test]
    fn gone_process_whose_supervised_work_still_runs_looks_alive() {
        let h = holder("here", Duration::from_millis(10), Duration::from_secs(60));
        let a = h.assess_with(
            NOW,
            "here",
            |_| Some(false),
            |owner| {
                assert_eq!(owner, "o");
                vec![456, 457]
            },
        );
        assert_eq!(a.verdict, Verdict::Suspect);
        assert_eq!(a.process, ProcessState::Gone);
        assert_eq!(a.supervised, [456, 457]);
        assert!(a.looks_alive);
        assert!(
            a.reason.contains(
                "pid 42 is no longer running on this host, but the work it \
                           supervised under this lease still runs (pid 456, 457)"
            ),
            "{}",
            a.reason
        );
    }

    #[test]
    fn work_of_a_holder_elsewhere_is_not_looked_for() {
        let h = holder("other", Duration::from_secs(16), Duration::from_secs(30));
        let a = h.assess_with(NOW, "here", |_| None, |_| unreachable!("other host"));
        assert!(!a.looks_alive);
    }

    #[test]
    fn work_is_found_by_its_owner_argument_or_variable() {
        let owner = format!("{:032x}", rand::random::<u128>());
        let mut by_arg = std::process::Command::new("sh")
            .args(["-c", "read _", "sh", "--owner", &owner])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut by_env = std::process::Command::new("sh")
            .args(["-c", "read _"])
            .env("FENCELOCK_OWNER", &owner)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut expected = vec![by_arg.id(), by_env.id()];
        expected.sort_unstable();
        assert_eq!(working_for(&owner), expected);
        assert_eq!(working_for(&format!("{owner}0")), Vec::<u32>::new());
        // Closing stdin ends `read`; a zombie is no longer at work.
        drop(by_arg.stdin.take());
        assert!(fencelock_wait_for(|| is_zombie(
            i32::try_from(by_arg.id()).unwrap()
        )));
        assert_eq!(working_for(&owner), [by_env.id()]);
        drop(by_env.stdin.take());
        by_arg.wait().unwrap();
        by_env.wait().unwrap();
        assert_eq!(working_for(&owner), Vec::<u32>::new());
    }

    #[test]
    fn running_process_here_looks_alive_even_when_overdue() {
        // A stopped process misses its renewals but may resume.
        let h = holder("here", Duration::from_secs(50), Duration::from_secs(60));
        let a = h.assess_with(NOW, "here", |_| Some(true), |_| unreachable!("running"));
        assert_eq!(a.verdict, Verdict::Suspect);
        assert!(a.looks_alive);
        assert!(a.reason.contains("running"), "{}", a.reason);
    }

    #[test]
    fn holder_without_metadata_is_unknown_and_looks_alive() {
        let mut h = Holder::bare("foreign".into());
        h.ttl_left = Some(Duration::from_secs(3));
        let a = h.assess_with(NOW, "here", |_| unreachable!("no pid"), no_work);
        assert_eq!(a.verdict, Verdict::Unknown);
        assert!(a.looks_alive);
    }

    #[test]
    fn wall_clock_renewal_is_the_fallback() {
        let mut h = Holder::bare("o".into());
        h.ttl = Some(Duration::from_secs(3));
        h.renewed_at = Some(NOW);
        let a = h.assess_with(NOW + Duration::from_secs(10), "here", |_| None, no_work);
        assert_eq!(a.since_renewal, Some(Duration::from_secs(10)));
        assert_eq!(a.verdict, Verdict::Suspect);
    }

    #[test]
    fn this_process_is_running_and_a_reaped_child_is_not() {
        assert_eq!(pid_running(std::process::id()), Some(true));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // The pid may be reused by then, but almost never within this instant.
        assert_eq!(pid_running(pid), Some(false));
        assert_eq!(pid_running(0), None);
    }

    #[test]
    fn a_zombie_counts_as_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Not reaped yet: a zombie once it has exited.
        assert!(fencelock_wait_for(|| is_zombie(
            i32::try_from(pid).unwrap()
        )));
        assert_eq!(pid_running(pid), Some(false));
        child.wait().unwrap();
    }

    fn fencelock_wait_for(mut f: impl FnMut() -> bool) -> bool {
        (0..500).any(|_| {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
            false
        })
    }

    #[test]
    fn forced_release_needs_a_reason() {
        assert!(ForceRelease::new("  ").validate().is_err());
        assert!(ForceRelease::new("a\nb").validate().is_err());
        assert!(ForceRelease::new("ok").user("").validate().is_err());
        assert!(ForceRelease::new("host died").validate().is_ok());
    }
}
