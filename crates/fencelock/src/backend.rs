//! Backend URLs: which engine, where, with which credentials.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// A parsed backend URL, for tools that talk to the engine's servers directly (benchmarks,
/// diagnostics).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Backend {
    /// `sqlite:///absolute/path.db`, or `sqlite://` for the default file.
    Sqlite {
        /// The database file.
        path: PathBuf,
    },
    /// `redis://` / `rediss://` (one node) and `redlock://` (N independent nodes).
    Redis {
        /// `rediss://`.
        tls: bool,
        /// `redlock://`: a majority of the nodes must agree.
        quorum: bool,
        /// The nodes, in URL order.
        nodes: Vec<RedisNode>,
        /// ACL user name, if any.
        user: Option<String>,
        /// Password, if any (decoded).
        password: Option<String>,
        /// Database number.
        db: i64,
    },
    /// `postgres://` / `postgresql://`: PostgreSQL advisory locks, or a lease table with
    /// `?mode=lease`.
    Postgres {
        /// The connection URL as libpq reads it, without fencelock's own parameters.
        url: String,
        /// Advisory locks (the default) or the lease table.
        mode: PgMode,
        /// The most connections one client opens (`?pool=N`, 2 to 10, default 4): one listens
        /// for wake-up notifications, the others carry the leases.
        pool: usize,
    },
    /// `etcd://h1:p1,h2:p2,...` and `etcds://...` (TLS): one etcd cluster.
    Etcd {
        /// `etcds://`.
        tls: bool,
        /// The client endpoints, in URL order (port 2379 when omitted).
        endpoints: Vec<RedisNode>,
        /// User name, if any.
        user: Option<String>,
        /// Password, if any (decoded).
        password: Option<String>,
        /// `?ca=PATH`: the CA certificate (PEM) that signed the servers' certificates.
        ca: Option<PathBuf>,
        /// `?cert=PATH`: the client certificate (PEM), for servers with `--client-cert-auth`.
        cert: Option<PathBuf>,
        /// `?key=PATH`: the client certificate's private key (PEM).
        key: Option<PathBuf>,
    },
}

/// How the PostgreSQL engine keeps locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgMode {
    /// Session advisory locks (`pg_try_advisory_lock`), the default: a lost session is a lost
    /// lease, and `psql` users can take the same lock.
    Advisory,
    /// Rows with owner, token and expiry by the database clock (`?mode=lease`): no session
    /// state, so it works through transaction poolers.
    Lease,
}

/// The default number of pooled PostgreSQL connections per client.
pub(crate) const PG_DEFAULT_POOL: usize = 4;
/// The most pooled PostgreSQL connections per client `?pool=` accepts.
pub(crate) const PG_MAX_POOL: usize = 10;

/// One Redis node address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisNode {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl std::fmt::Display for RedisNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Backend {
    /// Parses a backend URL, with the same rules and errors as [`Client::connect`](crate::Client::connect).
    pub fn parse(url: &str) -> Result<Backend> {
        parse(url)
    }

    /// The engine's short name: `sqlite`, `redis`, `redlock`, `postgres` or `postgres-lease`.
    pub fn engine(&self) -> &'static str {
        match self {
            Backend::Sqlite { .. } => "sqlite",
            Backend::Redis { quorum: true, .. } => "redlock",
            Backend::Redis { .. } => "redis",
            Backend::Postgres {
                mode: PgMode::Advisory,
                ..
            } => "postgres",
            Backend::Postgres {
                mode: PgMode::Lease,
                ..
            } => "postgres-lease",
            Backend::Etcd { .. } => "etcd",
        }
    }

    /// One `redis://` URL per node, credentials and database included; empty for SQLite.
    pub fn redis_node_urls(&self) -> Vec<String> {
        let Backend::Redis {
            nodes,
            user,
            password,
            db,
            ..
        } = self
        else {
            return Vec::new();
        };
        use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
        let enc = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
        let creds = match (user, password) {
            (Some(u), Some(p)) => format!("{}:{}@", enc(u), enc(p)),
            (None, Some(p)) => format!(":{}@", enc(p)),
            (Some(u), None) => format!("{}@", enc(u)),
            (None, None) => String::new(),
        };
        nodes
            .iter()
            .map(|n| format!("redis://{creds}{n}/{db}"))
            .collect()
    }
}

/// The default SQLite file: `$XDG_STATE_HOME/fencelock/locks.db`, else
/// `~/.local/state/fencelock/locks.db`.
pub fn default_sqlite_path() -> Result<PathBuf> {
    let base = match std::env::var_os("XDG_STATE_HOME").filter(|v| !v.is_empty()) {
        Some(state) => PathBuf::from(state),
        None => {
            let home = std::env::var_os("HOME")
                .filter(|v| !v.is_empty())
                .ok_or_else(|| {
                    Error::invalid(
                        "neither XDG_STATE_HOME nor HOME is set, so there is no default SQLite \
                     file; pass --backend sqlite:///path/to/locks.db",
                    )
                })?;
            PathBuf::from(home).join(".local").join("state")
        }
    };
    Ok(base.join("fencelock").join("locks.db"))
}

/// The backend used when none is given: `$FENCELOCK_URL`, else the default SQLite file.
pub fn default_url() -> Result<String> {
    if let Some(url) = std::env::var("FENCELOCK_URL")
        .ok()
        .filter(|u| !u.is_empty())
    {
        return Ok(url);
    }
    Ok(format!("sqlite://{}", default_sqlite_path()?.display()))
}

/// The URL with any password replaced by `***`, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((creds, hosts)) => match creds.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{hosts}"),
            None => format!("{scheme}://***@{hosts}"),
        },
        None => url.to_owned(),
    }
}

const SCHEMES: &str = "sqlite://, redis://, rediss://, redlock://, postgres://, etcd://, etcds://";

pub(crate) fn parse(url: &str) -> Result<Backend> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(Error::invalid(format!(
            "backend {:?} is not a URL; use one of {SCHEMES}",
            redact_url(url)
        )));
    };
    match scheme {
        "sqlite" => parse_sqlite(rest),
        "redis" | "rediss" | "redlock" => parse_redis(scheme, rest),
        "postgres" | "postgresql" => parse_postgres(scheme, rest),
        "etcd" | "etcds" => crate::backend_etcd::parse_etcd(scheme, rest),
        other => Err(Error::invalid(format!(
            "unknown backend scheme {other:?}; use one of {SCHEMES}"
        ))),
    }
}

fn parse_sqlite(rest: &str) -> Result<Backend> {
    if rest.is_empty() {
        return Ok(Backend::Sqlite {
            path: default_sqlite_path()?,
        });
    }
    let path = percent_encoding::percent_decode_str(rest)
        .decode_utf8()
        .map_err(|_| Error::invalid("the SQLite path is not valid UTF-8 once decoded"))?;
    let path = PathBuf::from(path.as_ref());
    if !path.is_absolute() {
        return Err(Error::invalid(format!(
            "SQLite path {:?} is not absolute; write sqlite:///absolute/path.db",
            path.display()
        )));
    }
    Ok(Backend::Sqlite { path })
}

pub(crate) fn decode(part: &str, what: &str) -> Result<String> {
    percent_encoding::percent_decode_str(part)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| Error::invalid(format!("the {what} in the backend URL is not valid UTF-8")))
}

fn parse_redis(scheme: &str, rest: &str) -> Result<Backend> {
    let (authority, path) = match rest.split_once('/') {
        Some((a, p)) => (a, p),
        None => (rest, ""),
    };
    let (creds, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let (user, password) = match creds {
        None => (None, None),
        Some(c) => match c.split_once(':') {
            Some((u, p)) => (
                Some(decode(u, "user name")?).filter(|u| !u.is_empty()),
                Some(decode(p, "password")?),
            ),
            // `redis://secret@host` is the common spelling of a password-only AUTH.
            None => (None, Some(decode(c, "password")?)),
        },
    };
    let db = if path.is_empty() {
        0
    } else {
        path.parse::<i64>()
            .ok()
            .filter(|d| *d >= 0)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "database {path:?} in the backend URL is not a number"
                ))
            })?
    };
    let nodes = hosts
        .split(',')
        .map(parse_host_port)
        .collect::<Result<Vec<_>>>()?;
    let quorum = scheme == "redlock";
    if quorum && (nodes.len() < 3 || nodes.len() % 2 == 0) {
        return Err(Error::invalid(format!(
            "redlock needs an odd number of at least 3 independent nodes, got {}",
            nodes.len()
        )));
    }
    if !quorum && nodes.len() != 1 {
        return Err(Error::invalid(format!(
            "{scheme}:// takes one node, got {}; use redlock:// for a quorum of nodes",
            nodes.len()
        )));
    }
    Ok(Backend::Redis {
        tls: scheme == "rediss",
        quorum,
        nodes,
        user,
        password,
        db,
    })
}

/// Takes fencelock's own query parameters (`mode`, `pool`) out of a PostgreSQL URL and leaves
/// the rest for the driver, which checks it when the engine connects.
fn parse_postgres(scheme: &str, rest: &str) -> Result<Backend> {
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, q),
        None => (rest, ""),
    };
    let mut mode = PgMode::Advisory;
    let mut pool = PG_DEFAULT_POOL;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "mode" => {
                mode = match v {
                    "advisory" => PgMode::Advisory,
                    "lease" => PgMode::Lease,
                    other => {
                        return Err(Error::invalid(format!(
                            "mode {other:?} in the backend URL is not one of advisory, lease"
                        )))
                    }
                }
            }
            "pool" => {
                pool = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (2..=PG_MAX_POOL).contains(n))
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "pool {v:?} in the backend URL is not a number from 2 to {PG_MAX_POOL}"
                        ))
                    })?
            }
            _ => kept.push(pair),
        }
    }
    if base.is_empty() || base.starts_with('/') && !kept.iter().any(|p| p.starts_with("host=")) {
        return Err(Error::invalid(
            "the PostgreSQL URL names no host; write postgres://user@host:port/database",
        ));
    }
    let mut url = format!("{scheme}://{base}");
    if !kept.is_empty() {
        url.push('?');
        url.push_str(&kept.join("&"));
    }
    Ok(Backend::Postgres { url, mode, pool })
}

pub(crate) fn parse_host_port(s: &str) -> Result<RedisNode> {
    parse_host_port_or(s, 6379)
}

pub(crate) fn parse_host_port_or(s: &str, default_port: u16) -> Result<RedisNode> {
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || h.starts_with('[') => (h, Some(p)),
        _ => (s, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(Error::invalid(format!(
            "node {s:?} in the backend URL has no host"
        )));
    }
    let port = match port {
        None => default_port,
        Some(p) => p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| {
            Error::invalid(format!("node {s:?} in the backend URL has an invalid port"))
        })?,
    };
    Ok(RedisNode {
        host: host.to_owned(),
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_urls() {
        assert_eq!(
            parse("sqlite:///tmp/x.db").ok(),
            Some(Backend::Sqlite {
                path: "/tmp/x.db".into()
            })
        );
        assert!(parse("sqlite://relative.db").is_err());
        assert!(matches!(parse("sqlite://"), Ok(Backend::Sqlite { .. })));
    }

    #[test]
    fn redis_urls() {
        let Ok(Backend::Redis {
            nodes,
            user,
            password,
            db,
            quorum,
            tls,
        }) = parse("redis://app:p%40ss@127.0.0.1:7000/2")
        else {
            unreachable!("parse failed")
        };
        assert_eq!(
            nodes,
            vec![RedisNode {
                host: "127.0.0.1".into(),
                port: 7000
            }]
        );
        assert_eq!(user.as_deref(), Some("app"));
        assert_eq!(password.as_deref(), Some("p@ss"));
        assert_eq!((db, quorum, tls), (2, false, false));

        let Ok(Backend::Redis { nodes, quorum, .. }) = parse("redlock://a:1,b:2,c") else {
            unreachable!("parse failed")
        };
        assert!(quorum);
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[2].port, 6379);
    }

    #[test]
    fn bad_urls_are_invalid_input() {
        for url in [
            "ftp://x",
            "nonsense",
            "redis://h:0",
            "redis://h:99999",
            "redis://a:1,b:2",
            "redlock://a:1,b:2",
            "redlock://a:1,b:2,c:3,d:4",
            "redis://h:1/x",
            "redis://:1",
        ] {
            let e = parse(url).expect_err(url);
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{url}");
        }
    }

    #[test]
    fn postgres_urls() {
        assert_eq!(
            parse("postgres://u:p@127.0.0.1:5432/db?mode=lease&pool=8&sslmode=disable").ok(),
            Some(Backend::Postgres {
                url: "postgres://u:p@127.0.0.1:5432/db?sslmode=disable".into(),
                mode: PgMode::Lease,
                pool: 8,
            })
        );
        assert_eq!(
            parse("postgresql://h/db").ok(),
            Some(Backend::Postgres {
                url: "postgresql://h/db".into(),
                mode: PgMode::Advisory,
                pool: PG_DEFAULT_POOL,
            })
        );
        for url in [
            "postgres://h/db?mode=x",
            "postgres://h/db?pool=1",
            "postgres://h/db?pool=11",
            "postgres://",
        ] {
            let e = parse(url).expect_err(url);
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{url}");
        }
    }

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(redact_url("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact_url("redis://secret@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("sqlite:///x"), "sqlite:///x");
    }
}
