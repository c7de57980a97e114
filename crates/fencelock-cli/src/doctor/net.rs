//! Where a server is reached: on this machine (a loopback address), or across a network where
//! plaintext can be read and changed by whoever is on the path.

use std::net::{IpAddr, SocketAddr};

/// Whether every address is a loopback one (`127.0.0.0/8`, `::1`, or `::ffff:127.x.y.z`).
/// An empty list (a name that did not resolve) is not: nothing shows the traffic stays here.
pub(crate) fn all_loopback(addrs: &[IpAddr]) -> bool {
    !addrs.is_empty()
        && addrs.iter().all(|a| match a {
            IpAddr::V4(v4) => v4.is_loopback(),
            IpAddr::V6(v6) => {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            }
        })
}

/// The addresses `host` resolves to (itself when it is an address), as a client connecting
/// to it would try them; empty when it does not resolve.
pub(crate) async fn resolve(host: &str, port: u16) -> Vec<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    match tokio::time::timeout(
        std::time::Duration::from_secs(5),
        tokio::net::lookup_host((host, port)),
    )
    .await
    {
        Ok(Ok(found)) => found.map(|a: SocketAddr| a.ip()).collect(),
        _ => Vec::new(),
    }
}

/// Whether `host:port` is reached on loopback only.
pub(crate) async fn on_loopback(host: &str, port: u16) -> bool {
    all_loopback(&resolve(host, port).await)
}

/// The warning for a server reached in plaintext off this machine, or `None` on loopback.
pub(crate) fn plaintext_warning(what: &str, loopback: bool, use_instead: &str) -> Option<String> {
    (!loopback).then(|| {
        format!(
            "{what} is reached without TLS on a non-loopback address: passwords, lock owners \
             and tokens cross the network in plaintext, and anyone on the path can change \
             them; use {use_instead}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        let parsed: Vec<IpAddr> = list.iter().filter_map(|a| a.parse().ok()).collect();
        assert_eq!(parsed.len(), list.len(), "{list:?}");
        parsed
    }

    #[test]
    fn loopback_addresses_and_the_others() {
        for loopback in [
            &["127.0.0.1"][..],
            &["127.45.6.7"],
            &["::1"],
            &["::ffff:127.0.0.1"],
            &["127.0.0.1", "::1"],
        ] {
            assert!(all_loopback(&ips(loopback)), "{loopback:?}");
        }
        for other in [
            &[][..],
            &["10.0.0.5"],
            &["192.168.1.2"],
            &["0.0.0.0"],
            &["::"],
            &["fe80::1"],
            &["::ffff:10.0.0.1"],
            &["128.0.0.1"],
            // A name resolving to loopback and to another address may be reached on either.
            &["127.0.0.1", "10.1.2.3"],
        ] {
            assert!(!all_loopback(&ips(other)), "{other:?}");
        }
    }

    #[tokio::test]
    async fn names_are_resolved_before_they_are_judged() {
        assert!(on_loopback("localhost", 6379).await);
        assert!(on_loopback("127.0.0.1", 6379).await);
        assert!(!on_loopback("10.0.0.5", 6379).await);
        assert!(!on_loopback("name.that.does.not.resolve.invalid", 6379).await);
    }

    #[test]
    fn plaintext_is_flagged_off_loopback_only() {
        assert_eq!(plaintext_warning("node", true, "rediss://"), None);
        let w = plaintext_warning("node 10.0.0.5:6379", false, "rediss://").unwrap_or_default();
        assert!(w.contains("without TLS on a non-loopback address"), "{w}");
        assert!(w.contains("rediss://"), "{w}");
    }
}
