//! Distributed locks for async Rust services that stay safe when processes pause, clocks jump
//! and servers die.
//!
//! A [`Client`] built from a backend URL hands out [`Lease`]s: ownership of a named resource for
//! a while, with a [`FencingToken`] greater than every earlier grant's for that resource. The
//! client's watchdog renews leases every TTL/3 and marks a lease lost after two failed renewals
//! in a row, or when its validity ends without a confirmed renewal, so work under it stops
//! instead of running unlocked.
//!
//! ```no_run
//! # async fn demo() -> Result<(), fencelock::Error> {
//! use std::time::Duration;
//! use fencelock::{Client, LockOptions};
//!
//! let client = Client::connect("sqlite:///var/lib/myapp/locks.db").await?;
//! let opts = LockOptions::default().ttl(Duration::from_secs(30)).wait(Duration::from_secs(10));
//! let lease = client.acquire("nightly-invoices", &opts).await?;
//! let token = lease.token();
//! // The work is cancelled if the lease is lost; send `token` with every write it makes.
//! lease.run(async move { send_invoices(token).await }).await?;
//! lease.release().await?;
//! # Ok(()) }
//! # async fn send_invoices(_: fencelock::FencingToken) {}
//! ```
//!
//! # Layout
//! The modules map onto the four pieces of the design:
//! - **clients** (`core/`): [`Client`], [`ClientBuilder`], [`LockOptions`], [`Lease`] (the lost
//!   signal, `run`, `extend`, `release`), the acquire loops and the watchdog that renews
//!   leases; with tokens, errors, names, holder metadata, [`metrics`], and the small internal
//!   engine trait through which the core talks to whichever engine it was given. A routed
//!   client ([`Routes`]) opens each backend when a call first needs it (`core/router.rs`). The
//!   core names no engine.
//! - **lock servers** (`engines/`): one folder per engine behind a cargo feature (`sqlite`, on
//!   by default; `redis` for one node and Redlock; `postgres`: advisory locks, or a lease table
//!   with `?mode=lease`; `etcd`; `zookeeper`), each with its own URL parser. `engines/mod.rs` is the one
//!   place that names every engine: it maps a URL scheme ([`Backend`]) to the engine's parser
//!   and constructor. What only some engines have (a waiter queue, native elections, a feed of
//!   lost sessions) is a capability the engine hands out when opened.
//! - **fencing tokens**: [`FencingToken`], advanced by the engine atomically with every grant;
//! - **the protected resource** (`fence/`): [`fence`], guards that reject stale tokens: in
//!   memory, in Redis (feature `redis`), in PostgreSQL inside the caller's transaction (feature
//!   `postgres`), and with the `http` feature a tower layer that refuses stale requests before
//!   the handler runs.
//! - **no lock at all** (`pg/`): with the `postgres` feature, `fencelock::pg` offers what the
//!   database does by itself: claiming jobs with `FOR UPDATE SKIP LOCKED`, optimistic updates by
//!   version, and idempotency keys on a unique constraint.
//! - **operations** (`ops/`), built on the core for every engine: leader election
//!   ([`Election`]: campaign, observe, proclaim, resign, with the leader's fencing token; on etcd
//!   interoperable with `etcdctl elect`) and the [stuck-lock runbook](#stuck-lock-runbook):
//!   [`Holder::assess`], [`Client::list`], [`Client::force_release`] and its audit log,
//!   [`Client::audit`].
//!
//! `scripts/check-layers` keeps these lines: it fails when a core file imports an engine or an
//! engine imports another engine, the operations or the client.
//!
//! # Backends
//! | URL | engine |
//! |---|---|
//! | `sqlite:///absolute/path.db` (`sqlite://` for the default file) | SQLite, many processes on one machine |
//! | `redis://[user:pass@]host:port[/db]`, `rediss://...` | one Redis node |
//! | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3` | Redlock over N independent Redis nodes |
//! | `postgres://[user:pass@]host:port/db[?mode=lease&pool=N&prepare=true]` | PostgreSQL advisory locks, or a lease table (feature `postgres`) |
//! | `etcd://[user:pass@]h1:p1,h2:p2,...`, `etcds://...?ca=PATH&cert=PATH&key=PATH` | one etcd cluster (feature `etcd`) |
//! | `zk://[user:pass@]h1:p1,h2:p2,.../chroot[?session_timeout=10s]` | one ZooKeeper ensemble, Curator's lock layout (feature `zookeeper`) |
//!
//! # Validity
//! Every grant's validity is computed as the Redlock spec does, for every engine:
//! `validity = ttl - elapsed - (ttl / 100 + 2 ms)`, with `elapsed` measured from before the
//! request was sent. A grant left with less than a tenth of its TTL is released and retried.
//!
//! # Stuck-lock runbook
//! When a lock stays held and nothing happens, [`Client::inspect`] names the holder and
//! [`Holder::assess`] judges it ([`Verdict`]): *suspect* when its last renewal is overdue
//! ([`overdue_after`]: the cadence TTL/3 plus half a cadence, at least 1 s), measured as
//! `ttl - ttl_left` on the engine's own clock, or when it recorded this host's name and its pid
//! is gone. [`Client::list`] finds every held lock under a name prefix.
//!
//! [`Client::force_release`] deletes a dead holder's lock. It refuses, with
//! [`ErrorKind::HeldByAnother`], while the holder looks alive (its process exists on this host,
//! or it is gone but processes carrying its owner value still run here, such as the supervisor
//! and command of a killed `fencelock run`; or, for a holder elsewhere, its last renewal is not
//! overdue or was never recorded) unless told [`ForceRelease::holder_is_dead`]; a process gone
//! from this host with nothing left at work is dead whatever its last renewal says. The deletion is a compare-and-delete on the owner that was inspected. In
//! the same atomic step it advances the fencing counter to a mark above the old holder's token,
//! below every later grant's, so fences refuse the old holder once the next one has written, and
//! appends an [`AuditRecord`] to the log the engine keeps (the SQLite or PostgreSQL table `fencelock_audit`;
//! the stream `<prefix>audit` on each Redis node, capped near 10,000 entries), which
//! [`Client::audit`] reads back. The old holder learns of the loss at its next renewal. With
//! PostgreSQL advisory locks, which live as long as the holder's session, a forced release
//! ends that session (`pg_terminate_backend`), with every other lock it holds, and the old
//! holder learns it at once.
//!
//! ```no_run
//! # async fn demo(client: fencelock::Client) -> Result<(), fencelock::Error> {
//! use fencelock::{ForceRelease, Verdict};
//!
//! if let Some(holder) = client.inspect("nightly-invoices").await? {
//!     let verdict = holder.assess();
//!     println!("{holder}: {} ({})", verdict.verdict, verdict.reason);
//!     if verdict.verdict == Verdict::Suspect {
//!         let request = ForceRelease::new("the invoice worker's VM was deleted");
//!         if let Some(record) = client.force_release("nightly-invoices", &request).await? {
//!             println!("released; every later token is above {}", record.counter);
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(test, allow(clippy::unwrap_used))]
// A build without some engines leaves parts of the engine contract (types only some engines
// construct or read) unused; the full build, which CI lints, has no such allowance.
#![cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "etcd",
        feature = "zookeeper"
    )),
    allow(dead_code)
)]

mod core;
mod engines;
pub mod fence;
mod ops;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod pg;

pub use crate::core::metrics;

pub use crate::core::access::{AccessPlan, AccessStep, AccessUser, PASSWORD_PLACEHOLDER};
pub use crate::core::client::{Client, ClientBuilder, DEFAULT_PREFIX};
pub use crate::core::error::{Error, ErrorKind, Result};
pub use crate::core::holder::Holder;
pub use crate::core::lease::{Lease, LostSignal};
pub use crate::core::limits::{Limits, StoredLimits, MAX_HELD_CEILING};
pub use crate::core::name::{validate_name, MAX_NAME_BYTES};
pub use crate::core::options::{LockOptions, MIN_TTL};
pub use crate::core::records::{AuditRecord, HeldLock, Leader};
pub use crate::core::router::{BackendFailure, Partial};
pub use crate::core::routes::{config_path, Routes, SINGLE_BACKEND};
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "etcd",
    feature = "zookeeper"
))]
pub use crate::core::tls::TlsSession;
pub use crate::core::token::FencingToken;
pub use crate::core::url::{redact_url, HostPort};
#[cfg(feature = "etcd")]
pub use crate::engines::etcd::url::EtcdUrl;
#[cfg(feature = "postgres")]
pub use crate::engines::postgres::privileges::{PgPrivilege, PG_OBJECTS};
#[cfg(feature = "postgres")]
pub use crate::engines::postgres::url::{PgMode, PgTls, PostgresUrl, SslMode};
#[cfg(feature = "postgres")]
pub use crate::engines::postgres::PgPairStatements;
#[cfg(feature = "redis")]
pub use crate::engines::redis::acl::{REDIS_COMMANDS, REDIS_READ_COMMANDS};
#[cfg(feature = "redis")]
pub use crate::engines::redis::url::RedisUrl;
#[cfg(feature = "redis")]
pub use crate::engines::redis::{
    RedisPairCalls, RedisScriptCall, NODE_ID_ARG as REDIS_NODE_ID_ARG,
};
#[cfg(feature = "sqlite")]
pub use crate::engines::sqlite::url::{default_sqlite_path, SqliteUrl};
#[cfg(feature = "zookeeper")]
pub use crate::engines::zookeeper::url::ZkUrl;
pub use crate::engines::{default_url, Backend};
pub use crate::ops::election::{Election, Leadership, MAX_VALUE_BYTES};
pub use crate::ops::runbook::{overdue_after, Assessment, ForceRelease, ProcessState, Verdict};
