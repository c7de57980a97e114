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
//!   process gone from this host is dead whatever its last renewal says. An operator who knows
//!   better says so ([`ForceRelease::holder_is_dead`]) and the audit record keeps that.
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

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use crate::core::client::Client;
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::{Holder, HolderMeta};
use crate::core::name::{validate_name, MAX_NAME_BYTES};
use crate::core::options::{display_duration, renew_interval};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::routes::Routes;
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
        self.assess_with(SystemTime::now(), &local_host(), pid_running)
    }

    /// [`Holder::assess`] with the clock, the host name and the process probe given, so the
    /// rules can be tested without real processes. `running(pid)` is `None` when it cannot
    /// tell.
    pub(crate) fn assess_with(
        &self,
        now: SystemTime,
        local_host: &str,
        running: impl Fn(u32) -> Option<bool>,
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
            (ProcessState::Gone, _) => {
                facts.push(format!("pid {pid} is no longer running on this host"))
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
            ProcessState::Gone => false,
            ProcessState::NotChecked => stale != Some(true),
        };
        Assessment {
            verdict,
            since_renewal,
            overdue_after: overdue,
            process,
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
    pub async fn list(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        if prefix.len() > MAX_NAME_BYTES || prefix.chars().any(char::is_control) {
            return Err(Error::invalid(format!(
                "a name prefix must be at most {MAX_NAME_BYTES} bytes without control characters"
            )));
        }
        let mut locks = Vec::new();
        match &self.router {
            None => locks = self.list_here(prefix).await?,
            Some(router) => {
                // Only the backends some name under `prefix` can route to are asked, so that
                // listing `jobs/` does not wait on a payments outage. They are asked at once.
                let mut asked = tokio::task::JoinSet::new();
                for name in backends_under(&router.routes, prefix) {
                    if let Some(client) = router.backends.get(name) {
                        let (client, prefix) = (client.clone(), prefix.to_owned());
                        asked.spawn(async move { client.list_here(&prefix).await });
                    }
                }
                while let Some(answer) = asked.join_next().await {
                    let found = answer
                        .map_err(|e| Error::invalid(format!("a listing task failed: {e}")))??;
                    locks.extend(found);
                }
            }
        }
        locks.sort_by(|a, b| {
            a.resource
                .cmp(&b.resource)
                .then_with(|| a.backend.cmp(&b.backend))
        });
        Ok(locks)
    }

    /// [`Client::list`] on this client's one backend, rows labelled with it.
    async fn list_here(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let inner = &self.inner;
        let label = format!("{prefix}*");
        let mut locks = inner
            .calls
            .call(&label, inner.cfg.op_timeout * 12, inner.engine.list(prefix))
            .await?;
        for lock in &mut locks {
            inner.calls.backend_label().clone_into(&mut lock.backend);
        }
        Ok(locks)
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
        let this = self.on(name)?;
        this.force_release_here(name, request)
            .await
            .map_err(|e| this.inner.calls.named(e))
    }

    async fn force_release_here(
        &self,
        name: &str,
        request: &ForceRelease,
    ) -> Result<Option<AuditRecord>> {
        let inner = &self.inner;
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

    /// The audit log of forced releases under this client's prefix, of `name` or of every
    /// resource, newest first. Redis keeps about the last 10,000 records per prefix (a capped
    /// stream on each node; Redlock merges the nodes' logs); SQLite keeps them all.
    pub async fn audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        if let Some(name) = name {
            validate_name(name)?;
            return self.on(name)?.audit_here(Some(name)).await;
        }
        let mut records = Vec::new();
        for (_, client) in self.backends() {
            records.extend(client.audit_here(None).await?);
        }
        // Each backend's log is newest first; so is the merge.
        records.sort_by_key(|r| std::cmp::Reverse(r.at));
        Ok(records)
    }

    async fn audit_here(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let inner = &self.inner;
        inner
            .calls
            .call(
                name.unwrap_or("*"),
                inner.cfg.op_timeout * 2,
                inner.engine.audit(name),
            )
            .await
    }
}

/// The backends some name starting with `prefix` routes to: those of the routes whose
/// prefix starts with `prefix` (longer, more specific routes), and the one that the
/// longest route `prefix` itself starts with gives (or the default) to every other name.
fn backends_under<'a>(routes: &'a Routes, prefix: &str) -> BTreeSet<&'a str> {
    let mut out: BTreeSet<&str> = routes
        .routes()
        .filter(|(p, _)| p.starts_with(prefix))
        .map(|(_, b)| b)
        .collect();
    let enclosing = routes
        .routes()
        .find(|(p, _)| prefix.starts_with(p))
        .map(|(_, b)| b)
        .or(routes.default_backend_name());
    out.extend(enclosing);
    out
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

    #[test]
    fn renewal_on_time_elsewhere_looks_alive() {
        let h = holder("other", Duration::from_secs(5), Duration::from_secs(30));
        let a = h.assess_with(NOW, "here", |_| unreachable!("other host"));
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
        let a = h.assess_with(NOW, "here", |_| None);
        assert_eq!(a.verdict, Verdict::Suspect);
        assert!(!a.looks_alive);
        assert!(a.reason.contains("overdue"), "{}", a.reason);
    }

    #[test]
    fn gone_process_here_is_dead_whatever_its_last_renewal() {
        let h = holder("here", Duration::from_millis(10), Duration::from_secs(60));
        let a = h.assess_with(NOW, "here", |pid| {
            assert_eq!(pid, 42);
            Some(false)
        });
        assert_eq!(a.verdict, Verdict::Suspect);
        assert_eq!(a.process, ProcessState::Gone);
        assert!(!a.looks_alive);
    }

    #[test]
    fn running_process_here_looks_alive_even_when_overdue() {
        // A stopped process misses its renewals but may resume.
        let h = holder("here", Duration::from_secs(50), Duration::from_secs(60));
        let a = h.assess_with(NOW, "here", |_| Some(true));
        assert_eq!(a.verdict, Verdict::Suspect);
        assert!(a.looks_alive);
        assert!(a.reason.contains("running"), "{}", a.reason);
    }

    #[test]
    fn holder_without_metadata_is_unknown_and_looks_alive() {
        let mut h = Holder::bare("foreign".into());
        h.ttl_left = Some(Duration::from_secs(3));
        let a = h.assess_with(NOW, "here", |_| unreachable!("no pid"));
        assert_eq!(a.verdict, Verdict::Unknown);
        assert!(a.looks_alive);
    }

    #[test]
    fn wall_clock_renewal_is_the_fallback() {
        let mut h = Holder::bare("o".into());
        h.ttl = Some(Duration::from_secs(3));
        h.renewed_at = Some(NOW);
        let a = h.assess_with(NOW + Duration::from_secs(10), "here", |_| None);
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
