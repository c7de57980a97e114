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
//!   `redis`), each implementing one small internal trait;
//! - **fencing tokens**: [`FencingToken`], advanced by the engine atomically with every grant;
//! - **the protected resource**: [`fence`], guards that reject stale tokens: in memory, in
//!   Redis (feature `redis`), in PostgreSQL inside the caller's transaction (feature
//!   `postgres`), and with the `http` feature a tower layer that refuses stale requests before
//!   the handler runs.
//!
//! # Backends
//! | URL | engine |
//! |---|---|
//! | `sqlite:///absolute/path.db` (`sqlite://` for the default file) | SQLite, many processes on one machine |
//! | `redis://[user:pass@]host:port[/db]`, `rediss://...` | one Redis node |
//! | `redlock://[user:pass@]h1:p1,h2:p2,h3:p3` | Redlock over N independent Redis nodes |
//!
//! # Validity
//! Every grant's validity is computed as the Redlock spec does, for every engine:
//! `validity = ttl - elapsed - (ttl / 100 + 2 ms)`, with `elapsed` measured from before the
//! request was sent. A grant left with less than a tenth of its TTL is released and retried.
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod backend;
mod client;
mod engine;
mod error;
pub mod fence;
mod holder;
mod lease;
pub mod metrics;
mod name;
mod options;
mod token;
mod watchdog;

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
mod sqlite;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
mod redis;

pub use backend::{default_sqlite_path, default_url, redact_url, Backend, RedisNode};
pub use client::{Client, ClientBuilder, DEFAULT_PREFIX};
pub use error::{Error, ErrorKind, Result};
pub use holder::Holder;
pub use lease::{Lease, LostSignal};
pub use name::{validate_name, MAX_NAME_BYTES};
pub use options::{
    display_duration, drift, renew_interval, usable, validity, LockOptions, MIN_TTL,
};
pub use token::FencingToken;
