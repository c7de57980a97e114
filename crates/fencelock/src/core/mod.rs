//! The core: what every engine shares and no engine knows about. The client and its acquire
//! loop, the lease and its watchdog, options and the validity arithmetic, tokens, errors,
//! names, holder metadata, what the SQL engines store alike, metrics, and the [`engine`] contract through which the core talks
//! to whichever engine the registry (`crate::engines`) opened.
//!
//! Nothing here names an engine: `scripts/check-layers` fails the build's checks if a file of
//! this folder imports anything outside it.

pub(crate) mod access;
pub(crate) mod acquire;
pub(crate) mod call;
pub(crate) mod client;
pub(crate) mod engine;
pub(crate) mod error;
pub(crate) mod holder;
pub(crate) mod lease;
pub(crate) mod limits;
pub mod metrics;
pub(crate) mod name;
pub(crate) mod options;
pub(crate) mod records;
pub(crate) mod router;
pub(crate) mod routes;
pub(crate) mod sql;
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "etcd",
    feature = "zookeeper"
))]
pub(crate) mod tls;
pub(crate) mod token;
pub(crate) mod url;
pub(crate) mod wake;
pub(crate) mod watchdog;
