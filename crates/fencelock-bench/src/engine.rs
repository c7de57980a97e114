//! The engine under test, read once from the backend URL. Every section asks this enum what it
//! is measuring (Redis nodes whose commands can be counted, a PostgreSQL server for pgbench, an
//! etcd cluster for the Put rate) instead of comparing engine names, so each decision is one
//! match the compiler checks rather than a string a renamed engine would silently miss. It is
//! also the one place that looks inside `fencelock::Backend`.

use fencelock::Backend;

/// A server address as the library parses it from a URL.
pub(crate) type Node = fencelock::HostPort;

// A build without some engines never constructs their variants.
#[cfg_attr(
    not(all(
        feature = "sqlite",
        feature = "redis",
        feature = "postgres",
        feature = "etcd",
        feature = "zookeeper"
    )),
    allow(dead_code)
)]
pub(crate) enum Engine {
    /// `sqlite://`: a file, no server of its own to measure.
    Sqlite,
    /// `redis://`, `rediss://` (one node) and `redlock://` (a quorum of nodes).
    Redis(RedisTarget),
    /// `postgres://`, advisory or lease-table mode.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Postgres(PgTarget),
    /// `etcd://` and `etcds://`.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Etcd(EtcdTarget),
    /// `zk://`.
    #[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
    Zookeeper(ZkTarget),
    /// An engine the bench has no reference for: the lock runs apply to it as they are.
    Other,
}

/// The parts of a `redis://` or `redlock://` URL the bench needs to reach the nodes itself.
#[derive(Clone)]
pub(crate) struct RedisTarget {
    /// `redlock://`: a majority of the nodes must agree.
    pub(crate) quorum: bool,
    pub(crate) nodes: Vec<Node>,
    /// One `redis://` (or `rediss://...?ca=...`) URL per node, credentials included.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) urls: Vec<String>,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) db: i64,
}

/// The server pgbench runs against.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct PgTarget {
    /// The connection URL as libpq reads it, without fencelock's own parameters.
    pub(crate) url: String,
    /// The most connections one client opens, the listening one included.
    pub(crate) pool: usize,
    /// The URL as the library parsed it.
    #[cfg(feature = "postgres")]
    parsed: fencelock::PostgresUrl,
}

#[cfg(feature = "postgres")]
impl PgTarget {
    /// The statements the engine sends for one acquire+release under `prefix`.
    pub(crate) fn statements(&self, prefix: &str) -> fencelock::PgPairStatements {
        self.parsed.pair_statements(prefix)
    }
}

/// The cluster the etcd reference connects to with a client of its own.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) struct EtcdTarget {
    /// `etcds://`.
    pub(crate) tls: bool,
    pub(crate) endpoints: Vec<Node>,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
}

/// The ensemble the ZooKeeper reference opens a session of its own on.
#[cfg_attr(not(feature = "zookeeper"), allow(dead_code))]
pub(crate) struct ZkTarget {
    /// `h1:p1,h2:p2[/chroot]`.
    pub(crate) connect: String,
    pub(crate) user: Option<String>,
    pub(crate) password: Option<String>,
}

impl Engine {
    pub(crate) fn parse(url: &str) -> Result<Engine, String> {
        Ok(match Backend::parse(url).map_err(|e| e.to_string())? {
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => Engine::Sqlite,
            #[cfg(feature = "redis")]
            Backend::Redis(u) => Engine::Redis(RedisTarget {
                quorum: u.quorum,
                // Each node's own URL keeps the TLS options (`?ca=&cert=&key=`), so that the
                // bench's direct connections verify and authenticate as the engine does.
                urls: {
                    let query = url.split_once('?').map(|(_, q)| format!("?{q}"));
                    u.node_urls()
                        .into_iter()
                        .map(|n| n + query.as_deref().unwrap_or(""))
                        .collect()
                },
                nodes: u.nodes,
                user: u.user,
                password: u.password,
                db: u.db,
            }),
            #[cfg(feature = "postgres")]
            Backend::Postgres(u) => Engine::Postgres(PgTarget {
                url: u.url.clone(),
                pool: u.pool,
                parsed: u,
            }),
            #[cfg(feature = "etcd")]
            Backend::Etcd(u) => Engine::Etcd(EtcdTarget {
                tls: u.tls,
                endpoints: u.endpoints,
                user: u.user,
                password: u.password,
            }),
            #[cfg(feature = "zookeeper")]
            Backend::Zookeeper(u) => Engine::Zookeeper(ZkTarget {
                connect: u.connect_string(),
                user: u.user,
                password: u.password,
            }),
            _ => Engine::Other,
        })
    }

    /// Whether each Client keeps a subscription of its own for wake-ups from releases (SQLite's
    /// waiters watch the file instead).
    pub(crate) fn subscribes_to_wake_ups(&self) -> bool {
        !matches!(self, Engine::Sqlite)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls_give_node_addresses_and_credentials() {
        let Ok(Engine::Redis(t)) =
            Engine::parse("redlock://app:p%40ss@10.0.0.1:7000,[::1]:7001,h/3")
        else {
            unreachable!("parse failed")
        };
        let addrs: Vec<String> = t.nodes.iter().map(ToString::to_string).collect();
        assert_eq!(addrs, ["10.0.0.1:7000", "[::1]:7001", "h:6379"]);
        assert_eq!(t.user.as_deref(), Some("app"));
        assert_eq!(t.password.as_deref(), Some("p@ss"));
        assert_eq!(t.urls[0], "redis://app:p%40ss@10.0.0.1:7000/3");
        assert_eq!(t.db, 3);
        assert!(t.quorum);
        let Ok(Engine::Redis(t)) = Engine::parse("redlocks://a:1,b:2,c:3?ca=/c.pem") else {
            unreachable!("parse failed")
        };
        assert_eq!(t.urls[2], "rediss://c:3/0?ca=/c.pem");
        assert!(matches!(
            Engine::parse("sqlite:///tmp/x.db"),
            Ok(Engine::Sqlite)
        ));
    }
}
