//! The conformance suite: the behaviour every engine must show, written once and run against
//! every engine this build has, each check a test of its own (`sqlite::mutual_exclusion`,
//! `etcd::forced_release_...`), against servers of its own.
//!
//! An engine joins with one line at the end of this file, `conformance!(name, Harness);`
//! behind its cargo feature, once `conformance/harness.rs` says how to start it, where it
//! listens, how it goes away and what the checks must allow for. What engines do differently
//! is data there ([`harness::Quirks`]), never a branch in the checks.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "conformance/errors.rs"]
mod errors;
#[path = "conformance/harness.rs"]
mod harness;
#[path = "conformance/limits.rs"]
mod limits;
#[path = "conformance/locking.rs"]
mod locking;
#[path = "conformance/runbook.rs"]
mod runbook;

use std::time::Duration;

use fencelock::{Client, ClientBuilder};
use harness::Harness;

/// What a busy two-core machine may add to a deadline: timers firing late, tasks waiting for a
/// worker thread.
const SLACK: Duration = Duration::from_millis(300);

/// An engine started for one check; its servers stop when it is dropped.
struct Engine<H: Harness> {
    harness: H,
    url: String,
}

impl<H: Harness> Engine<H> {
    async fn start() -> Engine<H> {
        let harness = tokio::task::spawn_blocking(H::start).await.unwrap();
        let url = harness.url();
        Engine { harness, url }
    }

    fn builder(&self) -> ClientBuilder {
        Client::builder(&self.url)
    }

    /// A client with its own connections, as another process would have.
    async fn client(&self) -> Client {
        let c = self.builder().connect().await.unwrap();
        assert_eq!(c.engine(), H::ENGINE);
        c
    }

    /// A client that records `name` as the holder's client name.
    async fn named(&self, name: &str) -> Client {
        self.builder().client_name(name).connect().await.unwrap()
    }

    fn take_down(&mut self) {
        tokio::task::block_in_place(|| self.harness.take_down());
    }
}

/// Polls a future once and drops it, as a `select!` that picks another branch would.
async fn poll_once<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match f.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

/// Whether `name` stops being held within `limit`. An expiry on the engine sends no event,
/// so this asks every 20 ms.
async fn gone_within(c: &Client, name: &str, limit: Duration) -> bool {
    let gone = async {
        while c.inspect(name).await.unwrap().is_some() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(limit, gone).await.is_ok()
}

/// Every check, as tests of a module named after the engine, run against `$harness`.
macro_rules! conformance {
    ($engine:ident, $harness:ty) => {
        mod $engine {
            use super::*;

            conformance!(@checks $harness;
                locking::mutual_exclusion,
                locking::tokens_increase_across_client_restarts,
                locking::stale_owner_cannot_touch_a_successor,
                locking::watchdog_keeps_a_lease_for_ten_ttls,
                locking::loss_is_reported_when_the_engine_goes_away,
                locking::cancelled_and_timed_out_acquires_leave_nothing_behind,
                runbook::inspect_and_list,
                runbook::forced_release_is_refused_then_audited_and_fenced,
                errors::unreachable_engine_and_bad_input_give_clear_errors,
                limits::stored_limits_refuse_long_ttls_and_hoarders,
            );
        }
    };
    (@checks $harness:ty; $($module:ident :: $check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                $module::$check::<$harness>().await;
            }
        )*
    };
}

#[cfg(feature = "sqlite")]
conformance!(sqlite, harness::Sqlite);
#[cfg(feature = "redis")]
conformance!(redis, harness::Redis);
#[cfg(feature = "redis")]
conformance!(redlock, harness::Redlock);
#[cfg(feature = "postgres")]
conformance!(postgres, harness::Postgres);
#[cfg(feature = "postgres")]
conformance!(postgres_lease, harness::PostgresLease);
#[cfg(feature = "postgres")]
conformance!(postgres_lease_pooled, harness::PostgresLeasePooled);
#[cfg(feature = "etcd")]
conformance!(etcd, harness::Etcd);
#[cfg(feature = "zookeeper")]
conformance!(zookeeper, harness::ZooKeeper);
