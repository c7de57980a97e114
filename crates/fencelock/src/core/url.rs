//! What every engine's URL parser shares: host and port lists, percent-decoding, and the
//! redaction of passwords for messages. Each engine parses the rest of its own URL
//! (`engines/<name>/url.rs`).

use std::path::PathBuf;

use crate::core::error::{Error, Result};

/// One server address of a backend URL: a Redis node, an etcd endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// Host name or address.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
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

/// Percent-decodes one part of a URL; `what` names it in the error.
pub(crate) fn decode(part: &str, what: &str) -> Result<String> {
    percent_encoding::percent_decode_str(part)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| Error::invalid(format!("the {what} in the backend URL is not valid UTF-8")))
}

/// The files a backend URL names for TLS, with `ca=`, `cert=` and `key=` (percent-encoded
/// paths): the CA that signed the servers' certificates, and a client certificate and its key.
#[derive(Debug, Default)]
pub(crate) struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// Reads the options of `query` (`a=b&c=d`), which may hold nothing else. `engine` names
    /// the URL's kind in messages, `tls_scheme` the scheme(s) that connect over TLS; the
    /// options are refused without TLS, and a certificate without its key or the reverse.
    pub(crate) fn parse(
        query: &str,
        engine: &str,
        tls: bool,
        tls_scheme: &str,
    ) -> Result<TlsFiles> {
        let mut files = TlsFiles::default();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let slot = match k {
                "ca" => &mut files.ca,
                "cert" => &mut files.cert,
                "key" => &mut files.key,
                other => {
                    return Err(Error::invalid(format!(
                        "unknown {engine} URL option {other:?}; the options are ca, cert and key"
                    )))
                }
            };
            if v.is_empty() {
                return Err(Error::invalid(format!(
                    "the {engine} URL option {k:?} needs a file path"
                )));
            }
            *slot = Some(PathBuf::from(decode(v, "TLS file path")?));
        }
        let named = files.ca.is_some() || files.cert.is_some() || files.key.is_some();
        if !tls && named {
            return Err(Error::invalid(format!(
                "ca, cert and key are TLS options: use {tls_scheme} to connect over TLS"
            )));
        }
        if files.cert.is_some() != files.key.is_some() {
            return Err(Error::invalid(
                "a client certificate needs its key and a key its certificate: give both cert \
                 and key",
            ));
        }
        Ok(files)
    }
}

/// Parses `host`, `host:port`, `[v6]` or `[v6]:port`, with `default_port` when none is given.
pub(crate) fn parse_host_port(s: &str, default_port: u16) -> Result<HostPort> {
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
    Ok(HostPort {
        host: host.to_owned(),
        port,
    })
}

/// Refuses a node list that names one server twice (same host, ignoring case, and port): a
/// quorum counted over it would count that server's vote twice.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn distinct_nodes(nodes: &[HostPort]) -> Result<()> {
    for (i, a) in nodes.iter().enumerate() {
        if let Some(b) = nodes[..i]
            .iter()
            .find(|b| b.port == a.port && b.host.eq_ignore_ascii_case(&a.host))
        {
            return Err(Error::invalid(format!(
                "the backend URL names node {b} twice; a quorum needs distinct servers"
            )));
        }
    }
    Ok(())
}

/// Refuses a node list in which two names resolve to one address (`localhost:7000` and
/// `127.0.0.1:7000`). A name that does not resolve is left to the connection to report.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) async fn distinct_addresses(
    nodes: &[HostPort],
    timeout: std::time::Duration,
) -> Result<()> {
    let mut seen: Vec<(std::net::SocketAddr, &HostPort)> = Vec::new();
    for node in nodes {
        let lookup = tokio::net::lookup_host((node.host.as_str(), node.port));
        let Ok(Ok(addrs)) = tokio::time::timeout(timeout, lookup).await else {
            continue;
        };
        let addrs: Vec<_> = addrs.collect();
        for addr in &addrs {
            if let Some((_, other)) = seen.iter().find(|(a, n)| a == addr && *n != node) {
                return Err(Error::invalid(format!(
                    "nodes {other} and {node} of the backend URL are the same server \
                     ({addr}); a quorum needs distinct servers"
                )));
            }
        }
        seen.extend(addrs.into_iter().map(|a| (a, node)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_named_twice_is_refused() {
        let n = |h: &str, p| HostPort {
            host: h.into(),
            port: p,
        };
        assert!(distinct_nodes(&[n("a", 1), n("b", 1), n("a", 2)]).is_ok());
        assert!(distinct_nodes(&[n("a", 1), n("b", 1), n("A", 1)]).is_err());
    }

    #[tokio::test]
    async fn names_of_one_address_are_refused() {
        let n = |h: &str| HostPort {
            host: h.into(),
            port: 7000,
        };
        let t = std::time::Duration::from_secs(2);
        assert!(distinct_addresses(&[n("127.0.0.1"), n("127.0.0.2")], t)
            .await
            .is_ok());
        let e = distinct_addresses(&[n("127.0.0.1"), n("localhost")], t).await;
        assert!(e.is_err(), "{e:?}");
    }

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(redact_url("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact_url("redis://secret@h:1"), "redis://***@h:1");
        assert_eq!(redact_url("sqlite:///x"), "sqlite:///x");
    }

    #[test]
    fn host_and_port_forms() {
        let hp = |s| parse_host_port(s, 7).map(|h| h.to_string());
        assert_eq!(hp("a:1").ok().as_deref(), Some("a:1"));
        assert_eq!(hp("a").ok().as_deref(), Some("a:7"));
        assert_eq!(hp("[::1]:9").ok().as_deref(), Some("[::1]:9"));
        for bad in [":1", "a:0", "a:x", "a:99999"] {
            assert!(hp(bad).is_err(), "{bad}");
        }
    }
}
