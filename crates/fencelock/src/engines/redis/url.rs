//! `redis://` and `rediss://` (one node), `redlock://` and `redlocks://` (N independent
//! nodes): `SCHEME://[user:password@]host:port[,host:port...][/db][?ca=PATH&cert=PATH&key=PATH]`.
//!
//! The TLS schemes (`rediss`, `redlocks`) verify every node's certificate chain and its name
//! (the host as written in the URL): against `ca=` when given, else the system's roots.
//! `cert=` and `key=` (both or neither) present a client certificate, for servers with
//! `tls-auth-clients yes`.

use std::path::PathBuf;

use crate::core::error::{Error, Result};
use crate::core::url::{decode, distinct_nodes, parse_host_port, HostPort, TlsFiles};

/// Redis' port, used for nodes written without one.
const DEFAULT_PORT: u16 = 6379;

/// A parsed Redis or Redlock URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisUrl {
    /// `rediss://` or `redlocks://`.
    pub tls: bool,
    /// `redlock://` or `redlocks://`: a majority of the nodes must agree.
    pub quorum: bool,
    /// The nodes, in URL order.
    pub nodes: Vec<HostPort>,
    /// ACL user name, if any.
    pub user: Option<String>,
    /// Password, if any (decoded).
    pub password: Option<String>,
    /// Database number.
    pub db: i64,
    /// `?ca=PATH`: the CA certificate(s) (PEM) that signed the nodes' certificates; the
    /// system's roots when absent.
    pub ca: Option<PathBuf>,
    /// `?cert=PATH`: the client certificate (PEM), for nodes that require one.
    pub cert: Option<PathBuf>,
    /// `?key=PATH`: the client certificate's private key (PEM).
    pub key: Option<PathBuf>,
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

    /// One `redis://` (or `rediss://`) URL per node, credentials and database included; the
    /// TLS files are not in it: [`clients`](Self::clients) adds them.
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
            .map(|n| format!("{scheme}://{creds}{n}/{}", self.db, scheme = self.scheme()))
            .collect()
    }

    fn scheme(&self) -> &'static str {
        if self.tls {
            "rediss"
        } else {
            "redis"
        }
    }

    /// One `redis` crate client per node, with the URL's TLS settings (CA, client
    /// certificate): how tools that talk to the nodes directly (diagnostics, benchmarks)
    /// connect exactly as the engine does.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) when a TLS file cannot be
    /// read or holds no PEM certificate or key; the message names the file, never its
    /// contents.
    pub fn clients(&self) -> Result<Vec<redis::Client>> {
        let tls = self.tls_files()?;
        if tls.is_some() {
            crate::core::tls::ensure_provider();
        }
        self.nodes
            .iter()
            .zip(self.node_urls())
            .map(|(node, url)| {
                match &tls {
                    None => redis::Client::open(url.as_str())
                        .map_err(|e| Error::invalid(format!("node {node}: {e}"))),
                    // The driver's PEM errors may quote a line of the file, which for the key
                    // is secret: the message names the files' options instead.
                    Some(certs) => redis::Client::build_with_tls(url.as_str(), certs.clone())
                        .map_err(|_| {
                            Error::invalid(format!(
                                "node {node}: the files given as ca=, cert= or key= in the \
                                 backend URL are not a PEM CA certificate, client certificate \
                                 and private key"
                            ))
                        }),
                }
            })
            .collect()
    }

    /// Over TLS (`rediss://`, `redlocks://`), one handshake with node `node` (its index in
    /// [`nodes`](Self::nodes)), verified as the engine verifies it (chain against `ca=` or the
    /// system's roots, and the host name), on a connection of its own: what
    /// `fencelock doctor` reports. `None` without TLS.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for TLS files that cannot
    /// be read; [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the handshake fails or
    /// takes longer than `limit`.
    pub async fn tls_session(
        &self,
        node: usize,
        limit: std::time::Duration,
    ) -> Result<Option<crate::core::tls::TlsSession>> {
        let Some(n) = self.nodes.get(node).filter(|_| self.tls) else {
            return Ok(None);
        };
        let files = crate::core::tls::Verified {
            ca: self.ca.as_deref(),
            cert: self.cert.as_deref(),
            key: self.key.as_deref(),
        };
        crate::core::tls::handshake(n, files, limit).await.map(Some)
    }

    /// The TLS files, read once for every node.
    fn tls_files(&self) -> Result<Option<redis::TlsCertificates>> {
        use crate::core::tls::{certificates, private_key, read_pem};
        if !self.tls {
            return Ok(None);
        }
        // The driver finds a file unusable only while connecting, which would read as a node
        // down: each file is checked here, as bad input.
        if let Some(ca) = &self.ca {
            certificates(ca, "ca")?;
        }
        let root_cert = self.ca.as_deref().map(|p| read_pem(p, "ca")).transpose()?;
        let client_tls = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: {
                    certificates(cert, "cert")?;
                    read_pem(cert, "cert")?
                },
                client_key: {
                    private_key(key, "key")?;
                    read_pem(key, "key")?
                },
            }),
            _ => None,
        };
        Ok(Some(redis::TlsCertificates {
            client_tls,
            root_cert,
        }))
    }
}

/// Parses what follows `scheme://` for `redis`, `rediss`, `redlock` and `redlocks`.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<RedisUrl> {
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, q),
        None => (rest, ""),
    };
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
    let quorum = matches!(scheme, "redlock" | "redlocks");
    let tls = matches!(scheme, "rediss" | "redlocks");
    let TlsFiles { ca, cert, key } =
        TlsFiles::parse(query, "Redis", tls, "rediss:// (or redlocks://)")?;
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
            "{scheme}:// takes one node, got {}; use redlock:// (redlocks:// over TLS) for a \
             quorum of nodes",
            nodes.len()
        )));
    }
    Ok(RedisUrl {
        tls,
        quorum,
        nodes,
        user,
        password,
        db,
        ca,
        cert,
        key,
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
            ..
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
    fn tls_urls() {
        let Ok(url) = parse(
            "redlocks",
            "a:1,b:2,c:3/1?ca=/c%20a.pem&cert=/c.pem&key=/k.pem",
        ) else {
            unreachable!("parse failed")
        };
        assert!(url.tls && url.quorum);
        assert_eq!(url.ca, Some("/c a.pem".into()));
        assert_eq!((url.cert.is_some(), url.key.is_some()), (true, true));
        assert_eq!(url.node_urls()[0], "rediss://a:1/1");
        let Ok(url) = parse("rediss", "h:6380") else {
            unreachable!("parse failed")
        };
        assert!(url.tls && !url.quorum && url.ca.is_none());
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
            ("redis", "h:1?ca=/x"),
            ("rediss", "h:1?cert=/c"),
            ("rediss", "h:1?key=/k"),
            ("rediss", "h:1?ca="),
            ("rediss", "h:1?pin=/x"),
            ("redlocks", "a:1,b:2"),
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
