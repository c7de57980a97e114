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
use std::path::Path;
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
/// process may take it before the caller binds it; [`RedisServer::start`] and
/// [`ZkEnsemble::start`] cope with that by retrying on new ports.
///
/// Ports come from below the kernel's ephemeral range: a port the kernel hands
/// out for "any free port" is also what it hands out as the source port of the
/// next outgoing connection, and a server started a moment later (three JVMs
/// dialling each other, say) then finds it taken. Each process walks that
/// range from its own starting point, so tests running side by side in one
/// process never get the same port twice and separate processes rarely meet.
///
/// Returns 0 if no port can be bound at all, which leaves the caller to fail
/// with a bind or connect error that names the real cause, rather than
/// panicking inside a test helper.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let high = ephemeral_low().clamp(LOW + 1_000, 65_535);
    let span = high - LOW;
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % span,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..span {
        let port = LOW + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let Ok(port) = u16::try_from(port) else {
            continue;
        };
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .unwrap_or(0)
}

/// The first port of the kernel's ephemeral range (Linux's default when unreadable).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A temporary directory in memory-backed `/dev/shm` where there is one, else in the default
/// temporary directory: for an embedded database (SQLite) under a test's short TTLs, as the
/// test PostgreSQL runs with `fsync=off`. An `fsync` on the test machine's disk takes up to a
/// quarter of a second under a full run's load (ZooKeeper's writes measured 230 ms at p99
/// with it), longer than a renewal of a 300 ms lease may take. A file there still outlives
/// the processes that open it.
pub fn memory_tempdir() -> std::io::Result<tempfile::TempDir> {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm)
    } else {
        tempfile::tempdir()
    }
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

    /// A port was free a moment ago, no more (see `free_port`): the other tests of this
    /// binary start servers and connections meanwhile, and one free port was once taken
    /// before the test could bind it. So, as the servers' `start` does, a taken port is
    /// followed by another; a `free_port` that handed out taken ports would still fail here.
    #[test]
    fn free_port_is_bindable() {
        let bound = (0..5).find_map(|_| {
            let port = free_port();
            assert!(
                port != 0 && u32::from(port) < ephemeral_low(),
                "port {port}"
            );
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).ok()
        });
        assert!(bound.is_some(), "none of five free ports could be bound");
        assert_ne!(free_port(), free_port(), "one process got one port twice");
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
