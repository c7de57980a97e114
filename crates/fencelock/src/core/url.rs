//! What every engine's URL parser shares: host and port lists, percent-decoding, and the
//! redaction of passwords for messages. Each engine parses the rest of its own URL
//! (`engines/<name>/url.rs`).

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

#[cfg(test)]
mod tests {
    use super::*;

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
