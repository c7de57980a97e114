//! The records the core and the engines exchange beyond a single grant: held locks as
//! listings find them, forced-release audit records, and election leaders.

use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::core::holder::Holder;
use crate::core::token::FencingToken;

/// One held lock, as [`Client::list`](crate::Client::list) finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HeldLock {
    /// The resource name.
    pub resource: String,
    /// Who holds it.
    pub holder: Holder,
    /// The backend it is held on: its name in a routed client
    /// ([`Client::routed`](crate::Client::routed)), else `default`.
    pub backend: String,
}

impl HeldLock {
    /// A lock an engine found; the client fills in the backend.
    pub(crate) fn new(resource: String, holder: Holder) -> HeldLock {
        HeldLock {
            resource,
            holder,
            backend: crate::core::routes::SINGLE_BACKEND.to_owned(),
        }
    }
}

/// One forced release, as the engine's audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditRecord {
    /// A random id naming the record (the same on every Redlock node).
    pub id: String,
    /// The resource that was released.
    pub resource: String,
    /// When (the operator's wall clock).
    pub at: SystemTime,
    /// Who forced the release.
    pub user: String,
    /// The host it was forced from.
    pub host: String,
    /// Why, in the operator's words.
    pub reason: String,
    /// Whether the operator declared the holder dead, overriding the liveness check.
    pub holder_declared_dead: bool,
    /// What the liveness check found at the time ([`Assessment::reason`](crate::Assessment::reason)).
    pub assessment: String,
    /// The holder whose lock was deleted: owner, token, host, pid, client, times, TTL as the
    /// engine had them (`ttl_left` is not kept).
    pub holder: Holder,
    /// The fencing counter after the release (the *mark*): above the old holder's token, and
    /// below every token granted afterwards.
    pub counter: FencingToken,
    /// Redlock, in the record a forced release returns: the nodes where nothing was released
    /// nor recorded, each with why (its ACL refused a command the release writes with, it did
    /// not answer). The others, a majority, released the lock and recorded it, so it is free;
    /// on the nodes named here the old holder's key stays until its TTL ends. Empty on every
    /// other engine, and in records read back from the log.
    pub not_released_on: Vec<String>,
    /// PostgreSQL advisory mode, in the record a forced release returns: the other leases that
    /// ended with it, because the lock lived in another process's database session and ending
    /// that session was the only way to release it. Each is recorded in the audit log too, with
    /// its own mark, and its holder learns of the loss at once (its session is gone). Empty
    /// when the lock could be released alone, on every other engine, and in records read
    /// back from the log.
    pub ended_with: Vec<AuditRecord>,
}

impl AuditRecord {
    /// The operator's part of the record as named fields (what [`AuditRecord::from_fields`]
    /// reads back): id, resource, time, who, from where, why, and the liveness verdict.
    pub(crate) fn operator_fields(&self) -> Vec<(&'static str, String)> {
        vec![
            ("id", self.id.clone()),
            ("resource", self.resource.clone()),
            ("at", crate::core::holder::unix_millis(self.at).to_string()),
            ("user", self.user.clone()),
            ("host", self.host.clone()),
            ("reason", self.reason.clone()),
            (
                "declared_dead",
                if self.holder_declared_dead { "1" } else { "0" }.to_owned(),
            ),
            ("assessment", self.assessment.clone()),
        ]
    }

    /// A record from the named fields an engine stored it as (key-value engines: the Redis
    /// audit stream, etcd's audit keys): `id`, `resource`, `at`, `user`, `host`, `reason`,
    /// `declared_dead`, `assessment`, the old holder's `owner`, `token`, `holder_host`, `pid`,
    /// `client`, `acquired_at`, `renewed_at`, `ttl` (ms), and `counter` (0 when absent, for
    /// engines that know it from elsewhere). Empty values count as absent. `None` for records
    /// fencelock did not write.
    pub(crate) fn from_fields(field: impl Fn(&str) -> Option<String>) -> Option<AuditRecord> {
        use crate::core::holder::from_unix_millis;
        let text = |k: &str| field(k).filter(|v| !v.is_empty());
        let number = |k: &str| text(k).and_then(|v| v.parse::<i64>().ok());
        let mut holder = Holder::bare(text("owner")?);
        holder.token = number("token").and_then(FencingToken::checked_from_stored);
        holder.host = text("holder_host");
        holder.pid = number("pid").and_then(|p| u32::try_from(p).ok());
        holder.client = text("client");
        holder.acquired_at = number("acquired_at").map(from_unix_millis);
        holder.renewed_at = number("renewed_at").map(from_unix_millis);
        holder.ttl = number("ttl")
            .and_then(|t| u64::try_from(t).ok())
            .map(Duration::from_millis);
        Some(AuditRecord {
            id: text("id")?,
            resource: text("resource")?,
            at: from_unix_millis(number("at")?),
            user: text("user")?,
            host: text("host")?,
            reason: text("reason")?,
            holder_declared_dead: text("declared_dead").as_deref() == Some("1"),
            assessment: text("assessment").unwrap_or_default(),
            holder,
            counter: number("counter").map_or(FencingToken::new(0), FencingToken::from_stored),
            not_released_on: Vec::new(),
            ended_with: Vec::new(),
        })
    }
}

/// Who leads an election, as observers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The value the leader campaigned with or last proclaimed (lossily decoded as UTF-8 when
    /// another client stored bytes).
    pub value: String,
    /// The leader's fencing token, greater than every earlier leader's.
    pub token: FencingToken,
}

/// Sends `leader` to observers if it differs from what they last saw.
pub(crate) fn publish(tx: &watch::Sender<Option<Leader>>, leader: Option<Leader>) {
    tx.send_if_modified(|current| {
        if *current == leader {
            false
        } else {
            *current = leader;
            true
        }
    });
}

/// `fencelock k=v k=v ...`, values percent-encoded: holder metadata and audit records as the
/// engines without a structured value (etcd, ZooKeeper) store them, so that `etcdctl get` or
/// `zkCli.sh get` shows them readably.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) fn encode_fields(fields: &[(&str, String)]) -> String {
    use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
    let mut out = String::from("fencelock");
    for (k, v) in fields {
        out.push(' ');
        out.push_str(k);
        out.push('=');
        out.push_str(&utf8_percent_encode(v, NON_ALPHANUMERIC).to_string());
    }
    out
}

/// The fields of a value [`encode_fields`] made; `None` for anything else.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) fn decode_fields(value: &[u8]) -> Option<std::collections::HashMap<String, String>> {
    use percent_encoding::percent_decode_str;
    let text = std::str::from_utf8(value).ok()?;
    let rest = text.strip_prefix("fencelock")?;
    let mut fields = std::collections::HashMap::new();
    for pair in rest.split_whitespace() {
        let (k, v) = pair.split_once('=')?;
        fields.insert(
            k.to_owned(),
            percent_decode_str(v).decode_utf8().ok()?.into_owned(),
        );
    }
    Some(fields)
}
