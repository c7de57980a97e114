//! `etcd://` and `etcds://` URLs: `etcd[s]://[user:password@]h1:p1[,h2:p2...][?ca=PATH&cert=PATH&key=PATH]`.

use std::path::PathBuf;

use crate::core::error::{Error, Result};
use crate::core::url::{decode, parse_host_port, HostPort, TlsFiles};

/// etcd's client port, used for endpoints written without one.
const DEFAULT_PORT: u16 = 2379;

/// A parsed etcd URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EtcdUrl {
    /// `etcds://`.
    pub tls: bool,
    /// The client endpoints, in URL order (port 2379 when omitted).
    pub endpoints: Vec<HostPort>,
    /// User name, if any.
    pub user: Option<String>,
    /// Password, if any (decoded).
    pub password: Option<String>,
    /// `?ca=PATH`: the CA certificate (PEM) that signed the servers' certificates.
    pub ca: Option<PathBuf>,
    /// `?cert=PATH`: the client certificate (PEM), for servers with `--client-cert-auth`.
    pub cert: Option<PathBuf>,
    /// `?key=PATH`: the client certificate's private key (PEM).
    pub key: Option<PathBuf>,
}

impl EtcdUrl {
    /// A client of the cluster, with the URL's credentials and TLS files as the engine uses
    /// them: for tools that make their own calls (diagnostics). It connects lazily; its calls
    /// have no deadline of their own.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) for TLS files that cannot
    /// be read; [`ErrorKind::Engine`](crate::ErrorKind::Engine) when the cluster cannot be
    /// reached or refuses the credentials within `timeout`.
    pub async fn connect(&self, timeout: std::time::Duration) -> Result<etcd_client::Client> {
        super::call::connect_client(self, timeout).await
    }

    /// Over TLS (`etcds://`), one handshake with endpoint `endpoint` (its index in
    /// [`endpoints`](Self::endpoints)), verified against `ca=` (or the system's roots) and
    /// the host name, on a connection of its own: what `fencelock doctor` reports. `None`
    /// without TLS.
    ///
    /// # Errors
    /// As [`RedisUrl::tls_session`](crate::RedisUrl::tls_session).
    pub async fn tls_session(
        &self,
        endpoint: usize,
        limit: std::time::Duration,
    ) -> Result<Option<crate::core::tls::TlsSession>> {
        let Some(n) = self.endpoints.get(endpoint).filter(|_| self.tls) else {
            return Ok(None);
        };
        let files = crate::core::tls::Verified {
            ca: self.ca.as_deref(),
            cert: self.cert.as_deref(),
            key: self.key.as_deref(),
        };
        crate::core::tls::handshake(n, files, limit).await.map(Some)
    }
}

/// Parses what follows `etcd://` or `etcds://`.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<EtcdUrl> {
    let (main, query) = match rest.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (rest, None),
    };
    let authority = main.strip_suffix('/').unwrap_or(main);
    if authority.contains('/') {
        return Err(Error::invalid(
            "an etcd URL has no path; write etcd://host:port[,host:port...]",
        ));
    }
    let (creds, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let (user, password) = match creds {
        None => (None, None),
        Some(c) => match c.split_once(':') {
            Some((u, p)) if !u.is_empty() => {
                (Some(decode(u, "user name")?), Some(decode(p, "password")?))
            }
            _ => return Err(Error::invalid(
                "etcd authenticates a user with a password: write etcd://user:password@host:port",
            )),
        },
    };
    let endpoints = hosts
        .split(',')
        .map(|h| parse_host_port(h, DEFAULT_PORT))
        .collect::<Result<Vec<_>>>()?;
    let tls = scheme == "etcds";
    let TlsFiles { ca, cert, key } = TlsFiles::parse(query.unwrap_or(""), "etcd", tls, "etcds://")?;
    Ok(EtcdUrl {
        tls,
        endpoints,
        user,
        password,
        ca,
        cert,
        key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn parse(url: &str) -> Result<EtcdUrl> {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        super::parse(scheme, rest)
    }

    #[test]
    fn etcd_urls() {
        let Ok(EtcdUrl {
            tls,
            endpoints,
            user,
            password,
            ca,
            cert,
            key,
        }) = parse(
            "etcds://app:p%40ss@127.0.0.1:2381,h2,[::1]:7?ca=/ca.pem&cert=/c.pem&key=/k%20.pem",
        )
        else {
            unreachable!("parse failed")
        };
        assert!(tls);
        assert_eq!(
            endpoints
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["127.0.0.1:2381", "h2:2379", "[::1]:7"]
        );
        assert_eq!(
            (user.as_deref(), password.as_deref()),
            (Some("app"), Some("p@ss"))
        );
        assert_eq!(ca, Some("/ca.pem".into()));
        assert_eq!(cert, Some("/c.pem".into()));
        assert_eq!(key, Some("/k .pem".into()));
        assert!(matches!(
            parse("etcd://a:1/"),
            Ok(EtcdUrl { tls: false, .. })
        ));
    }

    #[test]
    fn bad_etcd_urls_are_invalid_input() {
        for url in [
            "etcd://",
            "etcd://a:0",
            "etcd://a:1/x",
            "etcd://secret@a:1",
            "etcd://a:1?ca=/x",
            "etcds://a:1?cert=/c",
            "etcds://a:1?pin=/c",
            "etcds://a:1?ca=",
        ] {
            let e = parse(url).expect_err(url);
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{url}");
        }
    }
}
