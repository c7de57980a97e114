//! What a web browser may make the sidecar do: nothing, unless the page is the sidecar's own.
//!
//! A page on any site can make its visitor's browser send requests to `127.0.0.1:7878`: form
//! posts and `no-cors` fetches with `text/plain` bodies go out without asking anyone, and a
//! name the attacker controls can be made to resolve to 127.0.0.1 after the page has loaded
//! (DNS rebinding), which makes the sidecar the page's own origin. Bearer tokens do not help a
//! sidecar started without an auth file, and a browser sends no token by itself anyway. Three
//! checks run on every request, before authentication:
//!
//! 1. **Host** must name the sidecar as it is served: its listen address and port (with
//!    `localhost`, `127.0.0.1` and `[::1]` for a loopback address; any IP address for an
//!    unspecified one), or a `--public-url`. A rebound name is none of these: 421.
//! 2. **Origin**, when a browser sends one, must be the sidecar's own (`http://127.0.0.1:7878`,
//!    or a `--public-url`'s): 403 otherwise. Browsers send it with every request but a
//!    same-origin `GET`, so the dashboard passes and other pages do not.
//! 3. **Content-Type** of every request but `GET` and `HEAD` must be `application/json` when it
//!    is given, and must be given when there is a body: 415 otherwise. A page on another origin
//!    can only send that type after a CORS preflight, and the sidecar grants none.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::HttpBody;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use super::http::{refuse, ApiError};

/// The names and origins the sidecar is reached by.
#[derive(Debug)]
pub struct Served {
    /// `http` or `https`: how the listener itself serves.
    scheme: &'static str,
    port: u16,
    /// `Host` values accepted, in lower case: `name:port`, and `name` alone where the port is
    /// its scheme's default (browsers leave it out then).
    hosts: BTreeSet<String>,
    /// Origins accepted, serialized as browsers send them (lower case, no default port).
    origins: BTreeSet<String>,
    /// Listening on an unspecified address (`0.0.0.0`, `[::]`): any IP address literal with the
    /// served port names this sidecar, and no rebound name is an IP literal.
    any_ip: bool,
}

/// A URL the sidecar is reached by other than its listen address (`--public-url`): a DNS name,
/// or a proxy in front of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicUrl {
    scheme: &'static str,
    host: String,
    port: u16,
}

fn default_port(scheme: &str) -> u16 {
    if scheme == "https" {
        443
    } else {
        80
    }
}

impl PublicUrl {
    /// Parses `http[s]://HOST[:PORT][/]`; anything else (a path, a query, a user) is refused,
    /// since only the origin is used.
    pub fn parse(url: &str) -> Result<PublicUrl, String> {
        let bad = |why: &str| {
            format!("--public-url {url:?}: {why}; write it like https://locks.example.com or http://sidecar.internal:7878")
        };
        let (scheme, rest) = match url.split_once("://") {
            Some((s, rest)) if s.eq_ignore_ascii_case("http") => ("http", rest),
            Some((s, rest)) if s.eq_ignore_ascii_case("https") => ("https", rest),
            _ => return Err(bad("the scheme must be http or https")),
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains(['/', '?', '#', '@']) || authority.is_empty() {
            return Err(bad("give the scheme, the host and a port, nothing else"));
        }
        let (host, port) = split_authority(authority)
            .ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        let host = host.to_ascii_lowercase();
        let plain_name = host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        if !(plain_name || is_ip_literal(&host)) || host.is_empty() {
            return Err(bad("the host is not a DNS name or an IP address"));
        }
        Ok(PublicUrl {
            scheme,
            port: port.unwrap_or_else(|| default_port(scheme)),
            host,
        })
    }
}

/// `host[:port]` split, IPv6 literals in brackets kept whole; `None` for a port that is not a
/// number from 1 to 65535.
fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    let (host, port) = if authority.starts_with('[') {
        match authority.split_once(']') {
            Some((_, "")) => (authority, None),
            Some((h, p)) => (&authority[..h.len() + 1], Some(p.strip_prefix(':')?)),
            None => return None,
        }
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        }
    };
    match port {
        None => Some((host, None)),
        Some(p) => {
            let n: u16 = p.parse().ok().filter(|n| *n > 0)?;
            // A port written with a sign or leading zeros is not how anyone names a port.
            (n.to_string() == p).then_some((host, Some(n)))
        }
    }
}

/// `127.0.0.1` or `[::1]`: an IP address as a URL writes it.
fn is_ip_literal(host: &str) -> bool {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok(),
    }
}

fn literal(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    }
}

impl Served {
    /// What a sidecar listening on `local` (over TLS or not) and reached by `public` serves.
    pub fn new(local: SocketAddr, tls: bool, public: &[PublicUrl]) -> Served {
        let scheme = if tls { "https" } else { "http" };
        let mut served = Served {
            scheme,
            port: local.port(),
            hosts: BTreeSet::new(),
            origins: BTreeSet::new(),
            any_ip: local.ip().is_unspecified(),
        };
        let mut names = vec![literal(local.ip())];
        if local.ip().is_loopback() || local.ip().is_unspecified() {
            names.extend(["localhost", "127.0.0.1", "[::1]"].map(String::from));
        }
        for name in names {
            served.add(scheme, &name, local.port());
        }
        for p in public {
            served.add(p.scheme, &p.host, p.port);
        }
        served
    }

    fn add(&mut self, scheme: &str, host: &str, port: u16) {
        self.hosts.insert(format!("{host}:{port}"));
        if port == default_port(scheme) {
            self.hosts.insert(host.to_owned());
            self.origins.insert(format!("{scheme}://{host}"));
        } else {
            self.origins.insert(format!("{scheme}://{host}:{port}"));
        }
    }

    /// Whether a `Host` value names this sidecar.
    pub fn host_ok(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        self.hosts.contains(&host) || (self.any_ip && self.any_ip_authority(&host))
    }

    /// An IP literal with the served port, written as `self.scheme` would.
    fn any_ip_authority(&self, authority: &str) -> bool {
        match split_authority(authority) {
            Some((host, port)) => {
                is_ip_literal(host)
                    && port.unwrap_or_else(|| default_port(self.scheme)) == self.port
            }
            None => false,
        }
    }

    /// Whether an `Origin` value is this sidecar's own.
    pub fn origin_ok(&self, origin: &str) -> bool {
        let origin = origin.to_ascii_lowercase();
        if self.origins.contains(&origin) {
            return true;
        }
        self.any_ip
            && origin
                .strip_prefix(self.scheme)
                .and_then(|o| o.strip_prefix("://"))
                .is_some_and(|authority| self.any_ip_authority(authority))
    }

    /// The sidecar's own origin, for messages.
    fn example_origin(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }
}

/// Refuses what a browser on another site could have sent (see the module's documentation).
pub async fn guard(State(served): State<Arc<Served>>, req: Request, next: Next) -> Response {
    match check(&served, &req) {
        Ok(()) => next.run(req).await,
        Err(e) => refuse(req.uri().path(), e),
    }
}

fn check(served: &Served, req: &Request) -> Result<(), ApiError> {
    let headers = req.headers();
    // HTTP/2 carries the host in the request's authority rather than a Host header.
    let host = match headers.get(header::HOST) {
        Some(v) => Some(v.to_str().unwrap_or("")),
        None => req.uri().authority().map(|a| a.as_str()),
    };
    let Some(host) = host else {
        return Err(ApiError::field(
            "Host",
            "Host: the request has no Host header",
        ));
    };
    if !served.host_ok(host) {
        return Err(ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "misdirected",
            format!(
                "this sidecar is not served as {host:?} (a page on another site may have pointed \
                 its own name at it); use the address it listens on, or start it with \
                 --public-url for the name you reach it by"
            ),
        ));
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if !served.origin_ok(origin) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "cross_origin",
                format!(
                    "requests from pages of {origin:?} are refused: only the sidecar's own \
                     pages ({}, or a --public-url) may use it from a browser",
                    served.example_origin()
                ),
            ));
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        json_declared(headers, has_body(req))?;
    }
    Ok(())
}

fn has_body(req: &Request) -> bool {
    let declared_empty = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_some_and(|v| v.as_bytes() == b"0");
    !declared_empty && !req.body().is_end_stream()
}

/// The media type is `application/json` (any parameters), or there is neither a type nor a
/// body.
fn json_declared(headers: &HeaderMap, has_body: bool) -> Result<(), ApiError> {
    let refused = |what: String| {
        Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content_type",
            format!(
                "{what}: send the body as JSON with Content-Type: application/json (curl: \
                 --json, or -H 'Content-Type: application/json')"
            ),
        ))
    };
    match headers.get(header::CONTENT_TYPE) {
        Some(v) => {
            let value = v.to_str().unwrap_or("");
            let media = value.split(';').next().unwrap_or("").trim();
            if media.eq_ignore_ascii_case("application/json") {
                Ok(())
            } else {
                refused(format!("the body's type is {value:?}"))
            }
        }
        None if has_body => refused("the body has no Content-Type".to_owned()),
        None => Ok(()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn served(listen: &str, tls: bool, public: &[&str]) -> Served {
        let public: Vec<PublicUrl> = public
            .iter()
            .map(|u| PublicUrl::parse(u).unwrap())
            .collect();
        Served::new(listen.parse().unwrap(), tls, &public)
    }

    #[test]
    fn loopback_is_served_by_its_names_and_port_only() {
        let s = served("127.0.0.1:7878", false, &[]);
        for ok in [
            "127.0.0.1:7878",
            "localhost:7878",
            "LOCALHOST:7878",
            "[::1]:7878",
        ] {
            assert!(s.host_ok(ok), "{ok}");
        }
        for no in [
            "evil.example:7878",
            "127.0.0.1",
            "localhost:7879",
            "127.0.0.2:7878",
            "localhost.:7878",
            "127.0.0.1:7878.evil.example",
            "",
        ] {
            assert!(!s.host_ok(no), "{no}");
        }
        assert!(s.origin_ok("http://127.0.0.1:7878"));
        assert!(s.origin_ok("http://localhost:7878"));
        for no in [
            "https://127.0.0.1:7878",
            "http://127.0.0.1:7879",
            "http://evil.example",
            "null",
            "http://127.0.0.1:7878/",
            "",
        ] {
            assert!(!s.origin_ok(no), "{no}");
        }
    }

    #[test]
    fn default_ports_are_left_out_as_browsers_do() {
        let s = served("127.0.0.1:443", true, &[]);
        assert!(s.host_ok("localhost") && s.host_ok("localhost:443"));
        assert!(s.origin_ok("https://localhost"));
        assert!(!s.origin_ok("http://localhost"));
    }

    #[test]
    fn public_urls_add_their_host_and_origin() {
        let s = served(
            "127.0.0.1:7878",
            false,
            &["https://Locks.Example.com/", "http://sidecar.internal:7878"],
        );
        assert!(s.host_ok("locks.example.com") && s.host_ok("locks.example.com:443"));
        assert!(!s.host_ok("locks.example.com:7878"));
        assert!(s.origin_ok("https://locks.example.com"));
        assert!(!s.origin_ok("http://locks.example.com"));
        assert!(s.host_ok("sidecar.internal:7878") && !s.host_ok("sidecar.internal"));
        assert!(s.origin_ok("http://sidecar.internal:7878"));
        for bad in [
            "ftp://x",
            "locks.example.com",
            "https://x/path",
            "https://u@x",
            "https://x:0",
            "https://x:99999",
            "https://x:+1",
            "https://",
            "https://under_score",
        ] {
            assert!(PublicUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_unspecified_address_serves_any_ip_literal_on_its_port() {
        let s = served("0.0.0.0:7878", false, &[]);
        assert!(s.host_ok("10.1.2.3:7878") && s.host_ok("[fd00::1]:7878"));
        assert!(s.origin_ok("http://10.1.2.3:7878"));
        assert!(!s.host_ok("10.1.2.3:7879") && !s.host_ok("evil.example:7878"));
        assert!(!s.origin_ok("https://10.1.2.3:7878") && !s.origin_ok("http://evil.example:7878"));
    }

    #[test]
    fn only_json_bodies_are_read() {
        let with = |t: Option<&str>, body: bool| {
            let mut h = HeaderMap::new();
            if let Some(t) = t {
                h.insert(header::CONTENT_TYPE, t.parse().unwrap());
            }
            json_declared(&h, body).is_ok()
        };
        assert!(with(Some("application/json"), true));
        assert!(with(Some("application/json; charset=utf-8"), true));
        assert!(with(Some("APPLICATION/JSON"), true));
        assert!(with(None, false));
        assert!(!with(None, true));
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonx",
            "application/json-seq",
            "text/json",
            "",
        ] {
            assert!(!with(Some(t), true), "{t}");
            assert!(!with(Some(t), false), "{t} without a body");
        }
    }
}
