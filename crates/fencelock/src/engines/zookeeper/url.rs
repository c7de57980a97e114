//! `zk://` URLs: `zk://[user:password@]h1:p1[,h2:p2...][/chroot][?session_timeout=10s]`, and
//! `zks://` for TLS, with `ca=PATH` (required) and `cert=PATH&key=PATH` (a client certificate).

use std::path::PathBuf;
use std::time::Duration;

use crate::core::error::{Error, Result};
use crate::core::url::{decode, parse_host_port, HostPort, TlsFiles};

/// ZooKeeper's client port, used for servers written without one.
const DEFAULT_PORT: u16 = 2181;

/// A parsed ZooKeeper URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkUrl {
    /// The servers, in URL order (port 2181 when omitted).
    pub servers: Vec<HostPort>,
    /// The chroot every path is relative to (`/apps/x`), if any; it must exist on the servers.
    pub chroot: Option<String>,
    /// Digest user name, if any.
    pub user: Option<String>,
    /// Digest password, if any (decoded).
    pub password: Option<String>,
    /// `?session_timeout=`: the session timeout to ask the servers for. Without it the session
    /// asks for the TTL of the first lease.
    pub session_timeout: Option<Duration>,
    /// `zks://`: every server is reached over TLS (ZooKeeper's `secureClientPort`).
    pub tls: bool,
    /// `ca=`: the CA that signed the servers' certificates (PEM).
    pub ca: Option<PathBuf>,
    /// `cert=`: a client certificate (PEM), for servers that require one.
    pub cert: Option<PathBuf>,
    /// `key=`: the client certificate's key (PEM).
    pub key: Option<PathBuf>,
}

impl ZkUrl {
    /// The connect string of ZooKeeper's own clients: `h1:p1,h2:p2[/chroot]`.
    pub fn connect_string(&self) -> String {
        let hosts = self
            .servers
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        format!("{hosts}{}", self.chroot.as_deref().unwrap_or(""))
    }
}

impl ZkUrl {
    /// The TLS settings of a `zks://` URL, its files read and checked now: `None` for `zk://`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidInput`](crate::ErrorKind::InvalidInput) when a file cannot be read or
    /// holds no PEM CA certificate, client certificate or key; the message names the file,
    /// never its contents.
    pub(crate) fn tls_options(&self) -> Result<Option<zookeeper_client::TlsOptions>> {
        use crate::core::tls::read_pem;
        if !self.tls {
            return Ok(None);
        }
        let text = |path: &std::path::Path, option: &str| -> Result<String> {
            String::from_utf8(read_pem(path, option)?).map_err(|_| not_pem(path, option))
        };
        let mut options = zookeeper_client::TlsOptions::new();
        if let Some(ca) = &self.ca {
            options = options
                .with_pem_ca(&text(ca, "ca")?)
                .map_err(|_| not_pem(ca, "ca"))?;
        }
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            let (c, k) = (text(cert, "cert")?, text(key, "key")?);
            // The client's message may quote the key file: it is left out.
            options = options.with_pem_identity(&c, &k).map_err(|_| {
                Error::invalid(format!(
                    "the files {} (cert=) and {} (key=) in the backend URL are not a PEM client \
                     certificate and its private key",
                    cert.display(),
                    key.display()
                ))
            })?;
        }
        Ok(Some(options))
    }
}

fn not_pem(path: &std::path::Path, option: &str) -> Error {
    Error::invalid(format!(
        "the TLS file {} given as {option}= in the backend URL holds no PEM {}",
        path.display(),
        if option == "ca" {
            "CA certificate"
        } else {
            "certificate or key"
        }
    ))
}

/// Parses what follows `zk://`.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<ZkUrl> {
    let tls = scheme == "zks";
    let (main, query) = match rest.split_once('?') {
        Some((m, q)) => (m, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match main.find('/') {
        Some(i) => main.split_at(i),
        None => (main, ""),
    };
    let (creds, hosts) = match authority.rsplit_once('@') {
        Some((c, h)) => (Some(c), h),
        None => (None, authority),
    };
    let (user, password) = match creds {
        None => (None, None),
        Some(c) => match c.split_once(':') {
            Some((u, p)) if !u.is_empty() && !p.is_empty() => {
                (Some(decode(u, "user name")?), Some(decode(p, "password")?))
            }
            _ => {
                return Err(Error::invalid(
                    "ZooKeeper's digest authentication needs a user and a password: write \
                     zk://user:password@host:port (or give the password in a file with \
                     password_file=)",
                ))
            }
        },
    };
    if hosts.is_empty() {
        return Err(Error::invalid(
            "a ZooKeeper URL names its servers: zk://host:port[,host:port...][/chroot]",
        ));
    }
    let servers = hosts
        .split(',')
        .map(|h| parse_host_port(h, DEFAULT_PORT))
        .collect::<Result<Vec<_>>>()?;
    let path = path.strip_suffix('/').unwrap_or(path);
    let chroot = if path.is_empty() {
        None
    } else {
        let p = decode(path, "chroot")?;
        if p.split('/')
            .skip(1)
            .any(|c| c.is_empty() || c == "." || c == "..")
            || p.chars().any(char::is_control)
        {
            return Err(Error::invalid(format!(
                "the ZooKeeper chroot {p:?} is not a valid absolute path"
            )));
        }
        Some(p)
    };
    let mut session_timeout = None;
    let mut rest = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "session_timeout" => session_timeout = Some(parse_duration(v)?),
            "ca" | "cert" | "key" => rest.push(pair),
            other => {
                return Err(Error::invalid(format!(
                    "unknown ZooKeeper URL option {other:?}; the options are session_timeout, \
                     and ca, cert and key with zks://"
                )))
            }
        }
    }
    let TlsFiles { ca, cert, key } = TlsFiles::parse(&rest.join("&"), "ZooKeeper", tls, "zks://")?;
    if tls && ca.is_none() {
        return Err(Error::invalid(
            "zks:// needs the CA that signed the ZooKeeper servers' certificates: add \
             ca=PATH (a PEM file), as ZooKeeper's own clients need a trust store",
        ));
    }
    Ok(ZkUrl {
        servers,
        chroot,
        user,
        password,
        session_timeout,
        tls,
        ca,
        cert,
        key,
    })
}

/// `250ms`, `10s`, `2m`: a positive whole number and a unit.
fn parse_duration(v: &str) -> Result<Duration> {
    let bad = || {
        Error::invalid(format!(
            "session_timeout={v:?} is not a duration; write it as 500ms, 10s or 1m"
        ))
    };
    let split = v.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        _ => return Err(bad()),
    };
    if d.is_zero() || d > Duration::from_secs(3600) {
        return Err(Error::invalid(format!(
            "session_timeout={v} must be positive and at most 1h"
        )));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn parse(url: &str) -> Result<ZkUrl> {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        super::parse(scheme, rest)
    }

    #[test]
    fn zk_urls() {
        let Ok(u) =
            parse("zk://app:p%40ss@127.0.0.1:2182,h2,[::1]:7/apps/x?session_timeout=1500ms")
        else {
            unreachable!("parse failed")
        };
        assert_eq!(u.connect_string(), "127.0.0.1:2182,h2:2181,[::1]:7/apps/x");
        assert_eq!(
            (u.user.as_deref(), u.password.as_deref()),
            (Some("app"), Some("p@ss"))
        );
        assert_eq!(u.session_timeout, Some(Duration::from_millis(1500)));
        let u = parse("zk://h/").unwrap();
        assert_eq!((u.chroot, u.session_timeout), (None, None));
        let u = parse("zks://h:2281/app?ca=/c.pem&cert=/u.pem&key=/k%20y.pem&session_timeout=2s")
            .unwrap();
        assert!(u.tls);
        assert_eq!(u.connect_string(), "h:2281/app");
        assert_eq!(
            (u.ca, u.cert, u.key),
            (
                Some("/c.pem".into()),
                Some("/u.pem".into()),
                Some("/k y.pem".into())
            )
        );
        assert_eq!(u.session_timeout, Some(Duration::from_secs(2)));
    }

    #[test]
    fn bad_zk_urls_are_invalid_input() {
        for url in [
            "zk://",
            "zk://a:0",
            "zk://a:1/x//y",
            "zk://a:1/x/..",
            "zk://secret@a:1",
            "zk://u:@a:1",
            "zk://a:1?ca=/x",
            "zk://a:1?session_timeout=10",
            "zk://a:1?session_timeout=0s",
            "zk://a:1?session_timeout=2h",
            "zk://a:1?pin=1",
            "zks://a:1",
            "zks://a:1?cert=/c",
            "zks://a:1?ca=/a&key=/k",
            "zks://a:1?ca=",
        ] {
            let e = parse(url).expect_err(url);
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{url}");
        }
    }
}
