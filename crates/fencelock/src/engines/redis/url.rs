//! `redis://` and `rediss://` (one node) and `redlock://` (N independent nodes):
//! `SCHEME://[user:password@]host:port[,host:port...][/db]`.

use crate::core::error::{Error, Result};
use crate::core::url::{decode, distinct_nodes, parse_host_port, HostPort};

/// Redis' port, used for nodes written without one.
const DEFAULT_PORT: u16 = 6379;

/// A parsed Redis or Redlock URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisUrl {
    /// `rediss://`.
    pub tls: bool,
    /// `redlock://`: a majority of the nodes must agree.
    pub quorum: bool,
    /// The nodes, in URL order.
    pub nodes: Vec<HostPort>,
    /// ACL user name, if any.
    pub user: Option<String>,
    /// Password, if any (decoded).
    pub password: Option<String>,
    /// Database number.
    pub db: i64,
}

impl RedisUrl {
    /// The engine's short name: `redis` or `redlock`.
    pub fn engine(&self) -> &'static str {
        if self.quorum {
            "redlock"
        } else {
            "redis"
        }
    }

    /// One `redis://` URL per node, credentials and database included.
    pub fn node_urls(&self) -> Vec<String> {
        use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};
        let enc = |s: &str| utf8_percent_encode(s, NON_ALPHANUMERIC).to_string();
        let creds = match (&self.user, &self.password) {
            (Some(u), Some(p)) => format!("{}:{}@", enc(u), enc(p)),
            (None, Some(p)) => format!(":{}@", enc(p)),
            (Some(u), None) => format!("{}@", enc(u)),
            (None, None) => String::new(),
        };
        self.nodes
            .iter()
            .map(|n| format!("redis://{creds}{n}/{}", self.db))
            .collect()
    }
}

/// Parses what follows `scheme://` for `redis`, `rediss` and `redlock`.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<RedisUrl> {
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
        .map(|h| parse_host_port(h, DEFAULT_PORT))
        .collect::<Result<Vec<_>>>()?;
    let quorum = scheme == "redlock";
    if quorum && (nodes.len() < 3 || nodes.len() % 2 == 0) {
        return Err(Error::invalid(format!(
            "redlock needs an odd number of at least 3 independent nodes, got {}",
            nodes.len()
        )));
    }
    if quorum {
        distinct_nodes(&nodes)?;
    }
    if !quorum && nodes.len() != 1 {
        return Err(Error::invalid(format!(
            "{scheme}:// takes one node, got {}; use redlock:// for a quorum of nodes",
            nodes.len()
        )));
    }
    Ok(RedisUrl {
        tls: scheme == "rediss",
        quorum,
        nodes,
        user,
        password,
        db,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_urls() {
        let Ok(RedisUrl {
            nodes,
            user,
            password,
            db,
            quorum,
            tls,
        }) = parse("redis", "app:p%40ss@127.0.0.1:7000/2")
        else {
            unreachable!("parse failed")
        };
        assert_eq!(
            nodes,
            vec![HostPort {
                host: "127.0.0.1".into(),
                port: 7000
            }]
        );
        assert_eq!(user.as_deref(), Some("app"));
        assert_eq!(password.as_deref(), Some("p@ss"));
        assert_eq!((db, quorum, tls), (2, false, false));

        let Ok(RedisUrl { nodes, quorum, .. }) = parse("redlock", "a:1,b:2,c") else {
            unreachable!("parse failed")
        };
        assert!(quorum);
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[2].port, 6379);
    }

    #[test]
    fn node_urls_keep_credentials() {
        let Ok(url) = parse("redlock", "u:p%40@a:1,b:2,c:3/4") else {
            unreachable!("parse failed")
        };
        assert_eq!(
            url.node_urls(),
            [
                "redis://u:p%40@a:1/4",
                "redis://u:p%40@b:2/4",
                "redis://u:p%40@c:3/4"
            ]
        );
    }

    #[test]
    fn bad_urls_are_invalid_input() {
        for (scheme, rest) in [
            ("redis", "h:0"),
            ("redis", "h:99999"),
            ("redis", "a:1,b:2"),
            ("redlock", "a:1,b:2"),
            ("redlock", "a:1,b:2,c:3,d:4"),
            ("redis", "h:1/x"),
            ("redis", ":1"),
            ("redlock", "a:1,b:2,a:1"),
        ] {
            let e = parse(scheme, rest).expect_err(rest);
            assert_eq!(
                e.kind(),
                crate::ErrorKind::InvalidInput,
                "{scheme}://{rest}"
            );
        }
    }
}
