//! One harness per engine: how to start it, where clients find it, how to make it go away, and
//! what the checks must allow for. The differences between engines live here, as data, so the
//! checks stay the same for all of them.

use std::time::Duration;

/// What an engine does within the contract that the checks must allow for.
#[derive(Debug, Clone, Copy)]
pub struct Quirks {
    /// The TTL of the checks' short leases: a few times the engine's slowest grant or renewal
    /// on a busy machine, so that a lease lapses only when a check means it to.
    pub short_ttl: Duration,
    /// How long after a lease's validity ends the engine may still show the lock held: the
    /// engine expires it on its own clock and in its own unit (etcd grants whole seconds, at
    /// least one), and the validity ends a drift allowance before the engine's expiry.
    pub expiry_lag: Duration,
    /// Whether `inspect` tells the time left before the engine lets the lock expire.
    /// PostgreSQL never expires an advisory lock by itself.
    pub ttl_left_known: bool,
    /// Whether the holder's metadata records its last renewal. etcd renews the session lease
    /// without touching the key; PostgreSQL renews an advisory lock by holding on to it.
    pub renewals_recorded: bool,
    /// Whether an engine that goes away is noticed before the lease's validity ends, by two
    /// renewals failing at once, rather than only when it ends. etcd's keep-alive retries
    /// until the validity is over; a stuck SQLite writer makes each renewal wait out its
    /// whole timeout, so the second failure lands near the end.
    pub loss_before_validity_ends: bool,
    /// Whether the `max-held-per-client` quota is counted by the engine across every client
    /// of one name. etcd's is counted by each client over its own leases (the engine cannot
    /// count inside a grant), so another process of the same name has a quota of its own.
    pub quota_shared_by_name: bool,
}

/// What most engines do: expire a lock at its TTL on their own clock, record renewals, and notice an outage at the next two renewals.
const USUAL: Quirks = Quirks {
    short_ttl: Duration::from_millis(500),
    expiry_lag: TTL_EXPIRY,
    ttl_left_known: true,
    renewals_recorded: true,
    loss_before_validity_ends: true,
    quota_shared_by_name: true,
};

/// The lag of an engine that expires a lock at its TTL on its own clock: the drift allowance
/// and a busy machine's scheduling.
const TTL_EXPIRY: Duration = Duration::from_millis(500);

/// An engine under test, started for one check and stopped when dropped.
pub trait Harness: Sized + Send + 'static {
    /// The engine's name, as [`fencelock::Client::engine`] and error messages give it.
    const ENGINE: &'static str;

    /// What the checks allow for on this engine.
    const QUIRKS: Quirks;

    /// Malformed URLs of this engine's schemes, each refused before any I/O.
    const BAD_URLS: &'static [&'static str];

    /// Starts the engine's servers and waits until they answer. Blocks: the checks call it
    /// on a blocking thread.
    fn start() -> Self;

    /// The URL clients of this engine connect to.
    fn url(&self) -> String;

    /// Makes the engine go away at once, as a crash would: every server killed (for an
    /// embedded engine, its database taken by a writer that never lets go). Blocks.
    fn take_down(&mut self);

    /// A well-formed URL of this engine where nothing answers, and the parts of it the error
    /// message names besides the engine (the address, or the path).
    fn unreachable() -> (String, Vec<String>);
}

/// `127.0.0.1:PORT` on a port nothing listens on.
#[cfg(any(
    feature = "redis",
    feature = "postgres",
    feature = "etcd",
    feature = "zookeeper"
))]
fn nowhere() -> String {
    format!("127.0.0.1:{}", fencelock_testkit::free_port())
}

#[cfg(feature = "sqlite")]
pub use self::sqlite::Sqlite;

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;

    /// A SQLite file in a temporary directory.
    pub struct Sqlite {
        dir: tempfile::TempDir,
        /// A writer holding the database's write lock until this is dropped.
        stuck: Option<StuckWriter>,
    }

    impl Harness for Sqlite {
        const ENGINE: &'static str = "sqlite";
        const QUIRKS: Quirks = Quirks {
            loss_before_validity_ends: false,
            ..USUAL
        };
        const BAD_URLS: &'static [&'static str] = &[
            "sqlite://relative",
            "sqlite://relative/locks.db",
            "sqlite:relative",
        ];

        /// The database lives in memory (see `memory_tempdir`): with this suite's 500 ms TTL a
        /// renewal has 83 ms, and during a full test run two renewals in a row once went
        /// unanswered within it on the disk, so the lease was lost.
        fn start() -> Sqlite {
            Sqlite {
                dir: fencelock_testkit::memory_tempdir().unwrap(),
                stuck: None,
            }
        }

        fn url(&self) -> String {
            format!("sqlite://{}/locks.db", self.dir.path().display())
        }

        fn take_down(&mut self) {
            self.stuck = Some(StuckWriter::take(&self.dir.path().join("locks.db")));
        }

        fn unreachable() -> (String, Vec<String>) {
            // Nothing can create a directory under /proc: the engine cannot open its file.
            let dir = "/proc/fencelock-cannot-write";
            (format!("sqlite://{dir}/locks.db"), vec![dir.to_owned()])
        }
    }

    /// Another connection inside an exclusive transaction on a database file, as a stuck writer
    /// would be: every write of the engine waits for it until its busy timeout ends.
    struct StuckWriter {
        done: Option<std::sync::mpsc::Sender<()>>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl StuckWriter {
        fn take(path: &std::path::Path) -> StuckWriter {
            let (taken, is_taken) = std::sync::mpsc::channel();
            let (done, is_done) = std::sync::mpsc::channel::<()>();
            let path = path.to_owned();
            let thread = std::thread::spawn(move || {
                let conn = rusqlite::Connection::open(path).unwrap();
                conn.busy_timeout(Duration::from_secs(10)).unwrap();
                conn.execute_batch("BEGIN EXCLUSIVE").unwrap();
                taken.send(()).unwrap();
                // Bounded, so a lost harness cannot keep the file locked for good.
                let _ = is_done.recv_timeout(Duration::from_secs(60));
                conn.execute_batch("ROLLBACK").unwrap();
            });
            is_taken.recv_timeout(Duration::from_secs(15)).unwrap();
            StuckWriter {
                done: Some(done),
                thread: Some(thread),
            }
        }
    }

    impl Drop for StuckWriter {
        fn drop(&mut self) {
            drop(self.done.take());
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(feature = "redis")]
pub use self::redis::{Redis, Redlock};

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use fencelock_testkit::{redlock_url, start_redis_nodes, RedisServer};

    /// One redis-server.
    pub struct Redis(RedisServer);

    impl Harness for Redis {
        const ENGINE: &'static str = "redis";
        const QUIRKS: Quirks = USUAL;
        const BAD_URLS: &'static [&'static str] = &[
            "redis://h:x",
            "redis://",
            "redis://127.0.0.1:6379/x",
            "rediss://127.0.0.1:1?cert=/only-a-certificate.pem",
            "rediss://127.0.0.1:1?ca=/nonexistent/ca.pem",
        ];

        fn start() -> Redis {
            Redis(RedisServer::start().unwrap())
        }

        fn url(&self) -> String {
            self.0.url()
        }

        fn take_down(&mut self) {
            self.0.kill();
        }

        fn unreachable() -> (String, Vec<String>) {
            let at = nowhere();
            (format!("redis://{at}"), vec![at])
        }
    }

    /// Redlock over three redis-servers.
    pub struct Redlock(Vec<RedisServer>);

    impl Harness for Redlock {
        const ENGINE: &'static str = "redlock";
        const QUIRKS: Quirks = USUAL;
        const BAD_URLS: &'static [&'static str] = &[
            // Redlock needs at least three nodes for a majority that survives one loss.
            "redlock://127.0.0.1:1,127.0.0.1:2",
            "redlock://127.0.0.1:1,127.0.0.1:x,127.0.0.1:3",
        ];

        fn start() -> Redlock {
            Redlock(start_redis_nodes(3).unwrap())
        }

        fn url(&self) -> String {
            redlock_url(&self.0)
        }

        fn take_down(&mut self) {
            for node in &mut self.0 {
                node.kill();
            }
        }

        fn unreachable() -> (String, Vec<String>) {
            let nodes = vec![nowhere(), nowhere(), nowhere()];
            (format!("redlock://{}", nodes.join(",")), nodes)
        }
    }
}

#[cfg(feature = "postgres")]
pub use self::postgres::{Postgres, PostgresLease, PostgresLeasePooled};

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use fencelock_testkit::{PgBouncer, PgServer};

    const BAD_URLS: &[&str] = &[
        "postgres://h/db?mode=nope",
        "postgres://h/db?pool=50",
        "postgres://h:notaport/db",
    ];

    /// The message names the engine only: the PostgreSQL engine does not put the address in
    /// its connect errors (yet).
    fn unreachable(query: &str) -> (String, Vec<String>) {
        (
            format!("postgres://postgres@{}/postgres{query}", nowhere()),
            vec![],
        )
    }

    /// PostgreSQL advisory locks.
    pub struct Postgres(PgServer);

    impl Harness for Postgres {
        const ENGINE: &'static str = "postgres";
        const QUIRKS: Quirks = Quirks {
            // The server never expires an advisory lock: the client unlocks it once its TTL
            // has passed, on its next sweep.
            expiry_lag: Duration::from_millis(1500),
            ttl_left_known: false,
            renewals_recorded: false,
            ..USUAL
        };
        const BAD_URLS: &'static [&'static str] = BAD_URLS;

        fn start() -> Postgres {
            Postgres(PgServer::start().unwrap())
        }

        fn url(&self) -> String {
            self.0.url()
        }

        fn take_down(&mut self) {
            self.0.kill();
        }

        fn unreachable() -> (String, Vec<String>) {
            unreachable("")
        }
    }

    /// PostgreSQL's lease table (`?mode=lease`).
    pub struct PostgresLease(PgServer);

    impl Harness for PostgresLease {
        const ENGINE: &'static str = "postgres-lease";
        const QUIRKS: Quirks = USUAL;
        const BAD_URLS: &'static [&'static str] = BAD_URLS;

        fn start() -> PostgresLease {
            PostgresLease(PgServer::start().unwrap())
        }

        fn url(&self) -> String {
            format!("{}?mode=lease", self.0.url())
        }

        fn take_down(&mut self) {
            self.0.kill();
        }

        fn unreachable() -> (String, Vec<String>) {
            unreachable("?mode=lease")
        }
    }

    /// The lease table through a transaction pooler (PgBouncer, `pool_mode = transaction`):
    /// the deployment that rules out session state. The engine going away is the database
    /// behind the pooler.
    pub struct PostgresLeasePooled {
        // Declared first, so it stops before the server behind it.
        pooler: PgBouncer,
        server: PgServer,
    }

    impl Harness for PostgresLeasePooled {
        const ENGINE: &'static str = "postgres-lease";
        const QUIRKS: Quirks = PostgresLease::QUIRKS;
        const BAD_URLS: &'static [&'static str] = BAD_URLS;

        fn start() -> PostgresLeasePooled {
            let server = PgServer::start().unwrap();
            let pooler = PgBouncer::start(&server).unwrap();
            PostgresLeasePooled { pooler, server }
        }

        fn url(&self) -> String {
            format!("{}?mode=lease", self.pooler.url())
        }

        fn take_down(&mut self) {
            self.server.kill();
        }

        fn unreachable() -> (String, Vec<String>) {
            unreachable("?mode=lease")
        }
    }
}

#[cfg(feature = "etcd")]
pub use self::etcd::Etcd;

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use fencelock_testkit::EtcdCluster;

    /// A three-member etcd cluster.
    pub struct Etcd(EtcdCluster);

    impl Harness for Etcd {
        const ENGINE: &'static str = "etcd";
        const QUIRKS: Quirks = Quirks {
            // Every grant is a few raft commits on three members, each a disk sync; the
            // session lease lasts a whole second however short the TTL, so a second costs
            // nothing in expiry.
            short_ttl: Duration::from_secs(1),
            // The session lease is granted in whole seconds, at least the cluster's minimum
            // (1 s with the test kit's raft timings), and etcd checks for expired leases
            // every half second.
            expiry_lag: Duration::from_millis(2500),
            renewals_recorded: false,
            loss_before_validity_ends: false,
            quota_shared_by_name: false,
            ..USUAL
        };
        const BAD_URLS: &'static [&'static str] = &[
            "etcd://",
            "etcd://127.0.0.1:x",
            "etcds://127.0.0.1:2379?ca=/nonexistent/ca.pem",
        ];

        fn start() -> Etcd {
            Etcd(EtcdCluster::start(3).unwrap())
        }

        fn url(&self) -> String {
            self.0.url()
        }

        fn take_down(&mut self) {
            for i in 0..self.0.len() {
                self.0.kill(i);
            }
        }

        fn unreachable() -> (String, Vec<String>) {
            let at = nowhere();
            (format!("etcd://{at}"), vec![at])
        }
    }
}

#[cfg(feature = "zookeeper")]
pub use self::zookeeper::ZooKeeper;

#[cfg(feature = "zookeeper")]
mod zookeeper {
    use super::*;
    use fencelock_testkit::ZkEnsemble;

    /// One standalone ZooKeeper server: each check starts its own, and one JVM starts in a
    /// third of the time of an ensemble's three. The ensemble's failures (leader kills, lost
    /// quorum) are checked in `tests/zookeeper.rs`.
    pub struct ZooKeeper(ZkEnsemble);

    impl Harness for ZooKeeper {
        const ENGINE: &'static str = "zookeeper";
        const QUIRKS: Quirks = Quirks {
            // The shortest session the servers grant is two ticks (1 s); a lease's TTL sets
            // its client's session timeout.
            short_ttl: Duration::from_secs(1),
            // A lapsed or dropped lease's node is deleted by its client within a quarter
            // second of its TTL.
            expiry_lag: Duration::from_millis(750),
            // A node lives as long as its session: no time left, no renewal recorded.
            ttl_left_known: false,
            renewals_recorded: false,
            // The limits are checked by each client over its own leases, as on etcd.
            quota_shared_by_name: false,
            ..USUAL
        };
        const BAD_URLS: &'static [&'static str] = &[
            "zk://",
            "zk://127.0.0.1:x",
            "zk://127.0.0.1:2181/a//b",
            "zk://127.0.0.1:2181?session_timeout=soon",
        ];

        fn start() -> ZooKeeper {
            ZooKeeper(ZkEnsemble::start(1).unwrap())
        }

        fn url(&self) -> String {
            self.0.url()
        }

        fn take_down(&mut self) {
            for i in 0..self.0.len() {
                self.0.kill(i);
            }
        }

        fn unreachable() -> (String, Vec<String>) {
            let at = nowhere();
            (format!("zk://{at}"), vec![at])
        }
    }
}
