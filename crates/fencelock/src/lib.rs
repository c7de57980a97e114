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
//! - **clients**: [`Client`], [`ClientBuilder`], [`LockOptions`], [`Lease`] (the lost signal,
//!   `run`, `extend`, `release`) and the watchdog that renews leases;
//! - **lock servers**: one module per engine behind a cargo feature (`sqlite`, on by default;
//!   `redis`; `postgres`: advisory locks, or a lease table with `?mode=lease`; `etcd`), each
//!   implementing one small internal trait;
//! - **fencing tokens**: [`FencingToken`], advanced by the engine atomically with every grant;
//! - **the protected resource**: [`fence`], guards that reject stale tokens: in memory, in
//!   Redis (feature `redis`), in PostgreSQL inside the caller's transaction (feature
//!   `postgres`), and with the `http` feature a tower layer that refuses stale requests before
//!   the handler runs.
//! - **no lock at all**: with the `postgres` feature, `fencelock::pg` offers what the database does by
//!   itself: claiming jobs with `FOR UPDATE SKIP LOCKED`, optimistic updates by version, and
//!   idempotency keys on a unique constraint.
//! - **leader election**: [`Election`] (campaign, observe, proclaim, resign) on top of the
//!   same leases, with the leader's fencing token; on etcd interoperable with `etcdctl elect`.
//! - **operations**: the [stuck-lock runbook](#stuck-lock-runbook): [`Holder::assess`],
//!   [`Client::list`], [`Client::force_release`] and its audit log, [`Client::audit`].
//!
//! # Backends
//! | URL | engine |
//! |---|---|
//! | `sqlite:///absolute/path.db` (`sqlite://` for the default file) | SQLite, many processes on one machine |
//! | `redis://[user:pass@]host:port[/db]`, `rediss://...` | one Redis node |
//! | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3` | Redlock over N independent Redis nodes |
//! | `postgres://[user:pass@]host:port/db[?mode=lease&pool=N]` | PostgreSQL advisory locks, or a lease table (feature `postgres`) |
//! | `etcd://[user:pass@]h1:p1,h2:p2,...`, `etcds://...?ca=PATH&cert=PATH&key=PATH` | one etcd cluster (feature `etcd`) |
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
//! [`ErrorKind::HeldByAnother`], while the holder looks alive (its process exists on this host;
//! or, for a holder elsewhere, its last renewal is not overdue or was never recorded) unless
//! told [`ForceRelease::holder_is_dead`]; a process gone from this host is dead whatever its
//! last renewal says. The deletion is a compare-and-delete on the owner that was inspected. In
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

mod backend;
mod backend_etcd;
mod client;
mod election;
mod engine;
mod error;
pub mod fence;
mod holder;
mod lease;
pub mod metrics;
mod name;
mod options;
mod runbook;
mod token;
mod watchdog;

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
mod sqlite;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
mod redis;

// The acquire loop waits on announcements whatever the engines built in; only the engines that
// announce releases (Redis, PostgreSQL) feed them.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
mod wakers;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
mod postgres;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod pg;

#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
mod etcd;

pub use backend::{default_sqlite_path, default_url, redact_url, Backend, PgMode, RedisNode};
pub use client::{Client, ClientBuilder, DEFAULT_PREFIX};
pub use election::{Election, Leader, Leadership, MAX_VALUE_BYTES};
pub use error::{Error, ErrorKind, Result};
pub use holder::Holder;
pub use lease::{Lease, LostSignal};
pub use name::{validate_name, MAX_NAME_BYTES};
pub use options::{
    display_duration, drift, renew_interval, usable, validity, LockOptions, MIN_TTL,
};
pub use runbook::{
    overdue_after, Assessment, AuditRecord, ForceRelease, HeldLock, ProcessState, Verdict,
};
pub use token::FencingToken;
