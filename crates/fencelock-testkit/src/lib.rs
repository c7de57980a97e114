//! Test support for fencelock: starts real lock servers on loopback.
//!
//! Integration tests need the genuine article (a real `redis-server` with its
//! real timing, persistence and failure behaviour), not a mock. This crate
//! starts such servers as child processes, each on its own free loopback port
//! and in its own temporary directory, and stops them by pid so that tests can
//! also simulate crashes ([`RedisServer::kill`]), hangs
//! ([`RedisServer::pause`]) and amnesia ([`RedisServer::restart`]).
//! [`PgServer`] does the same for PostgreSQL, whose restart is a crash and a
//! recovery that keeps committed data, and [`PgBouncer`] puts a transaction
//! pooler in front of one. [`EtcdCluster`] starts an N-member etcd cluster with
//! members that can be killed, restarted and paused one by one, and [`ZkEnsemble`] a
//! ZooKeeper ensemble (or a standalone server) whose leader `srvr` names. [`BinCommand`]
//! starts the binaries under test themselves (`fencelock`, `fencelock-bench`)
//! with a clean environment, output captured in files, and a [`Proc`] guard
//! that stops them when a test ends. [`FaultProxy`] stands between a client and
//! a node to cut, slow, reset or half-open the network while traffic flows.
//!
//! Nothing is installed: the binaries must already be present (on Debian,
//! `apt-get install redis-server postgresql`), or be named by the
//! `FENCELOCK_REDIS_SERVER` and `FENCELOCK_REDIS_CLI` environment variables and
//! `FENCELOCK_PG_BINDIR` (the directory holding `initdb`, `postgres`, `psql`),
//! `FENCELOCK_ETCD` and `FENCELOCK_ETCDCTL`.

#![deny(missing_docs)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

mod command;
mod etcd;
mod netns;
mod postgres;
mod proc;
mod proxy;
mod redis;
mod tls;
mod zookeeper;

use std::net::{Ipv4Addr, TcpListener};
use std::time::{Duration, Instant};

pub use command::{BinCommand, Finished, Proc, ProcError};
pub use etcd::{EtcdCluster, EtcdTls};
pub use netns::Lan;
pub use postgres::{PgBouncer, PgServer};
pub use proxy::{Fault, FaultProxy};
pub use redis::{backend_url, redlock_url, start_redis_nodes, RedisServer};
pub use tls::TestTls;
pub use zookeeper::{curator_classpath, four_letters, java_bin, ZkEnsemble, SMALL_JVM, ZK_TICK};

/// Returns a TCP port on 127.0.0.1 that was free a moment ago.
///
/// The port is only reserved while the probe listener lives, so another
/// process may take it before the caller binds it; [`RedisServer::start`]
/// copes with that by retrying on a new port.
///
/// Returns 0 if the kernel refuses to hand out an ephemeral port at all,
/// which leaves the caller to fail with a bind or connect error that names
/// the real cause, rather than panicking inside a test helper.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or(0)
}

/// Polls `f` every 10 ms until it returns `true` or `deadline` has elapsed.
///
/// Meant for conditions that produce no event to wait on (a key expiring, a
/// process disappearing). `f` is always called at least once, and once more
/// after the deadline, so a condition that became true during the last sleep
/// is not reported as a timeout.
///
/// Returns whether `f` returned `true`.
pub fn wait_until(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_port_is_bindable() {
        let port = free_port();
        assert_ne!(port, 0);
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    }

    #[test]
    fn wait_until_reports_success_and_timeout() {
        let mut calls = 0;
        assert!(wait_until(Duration::from_secs(5), || {
            calls += 1;
            calls == 3
        }));
        assert_eq!(calls, 3);

        let start = Instant::now();
        assert!(!wait_until(Duration::from_millis(50), || false));
        assert!(start.elapsed() >= Duration::from_millis(50));
    }
}
