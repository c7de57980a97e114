//! How resource names map to ZooKeeper paths, and the names of the nodes under them.
//!
//! A name `N` maps to the *lock path* `<prefix><esc(N)>`, the path to give Curator's
//! `InterProcessMutex` (or `LeaderLatch`). `esc` percent-encodes (as UTF-8 bytes) `/`, `%`, and
//! every character ZooKeeper refuses in a path (`\u0000`–`\u001f`, `\u007f`–`\u009f`,
//! `\ue000`–`\uf8ff`, `\ufff0`–`\uffff`), and writes the names `.` and `..`, which are not
//! valid path components, as `%2E` and `%2E%2E`. So `esc(N)` is one valid path component, and
//! `esc` is injective (percent-decoding inverts it): distinct names never share a path, and
//! `a` and `a/b` are siblings (`…/a`, `…/a%2Fb`), never parent and child.
//!
//! Under the lock path, every waiter is a protected ephemeral sequential node, Curator's
//! `_c_<uuid>-lock-<10-digit sequence>` (`-latch-` for an election, as Curator's
//! `LeaderLatch` names them). Audit records are persistent sequential nodes under
//! `<prefix>%audit/<esc(N)>/`; no escaped name starts with `%a` (an escaped `%` is `%25`).

use std::fmt::Write as _;

use crate::core::engine::DEFAULT_PREFIX;
use crate::core::error::{Error, Result};

/// The prefix every path of the ZooKeeper engine starts with when the client keeps the
/// default (`fencelock:v1:`, a Redis-style namespace).
pub(crate) const DEFAULT_ZK_PREFIX: &str = "/fencelock/v1/";

/// The node-name marker of a lock waiter (Curator's `InterProcessMutex`).
pub(crate) const LOCK: &str = "lock-";
/// The node-name marker of an election candidate (Curator's `LeaderLatch`).
pub(crate) const LATCH: &str = "latch-";

fn forbidden(c: char) -> bool {
    matches!(c, '/' | '%' | '\u{0}'..='\u{1f}' | '\u{7f}'..='\u{9f}' | '\u{e000}'..='\u{f8ff}' | '\u{fff0}'..='\u{ffff}')
}

fn percent(out: &mut String, c: char) {
    let mut buf = [0u8; 4];
    for b in c.encode_utf8(&mut buf).bytes() {
        let _ = write!(out, "%{b:02X}");
    }
}

/// `name` as one valid ZooKeeper path component.
pub(crate) fn escape(name: &str) -> String {
    if name == "." || name == ".." {
        return "%2E".repeat(name.len());
    }
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if forbidden(c) {
            percent(&mut out, c);
        } else {
            out.push(c);
        }
    }
    out
}

/// The inverse of [`escape`]; `None` for text `escape` cannot produce.
pub(crate) fn unescape(esc: &str) -> Option<String> {
    let name = percent_encoding::percent_decode_str(esc)
        .decode_utf8()
        .ok()?
        .into_owned();
    (escape(&name) == esc).then_some(name)
}

/// The client's prefix as a ZooKeeper path ending in `/`. The default is `/fencelock/v1/`; a
/// prefix that starts with `/` is a path (a `/` is added at its end when missing); any other
/// prefix becomes one path component under the root.
pub(crate) fn zk_prefix(prefix: &str) -> Result<String> {
    if prefix == DEFAULT_PREFIX {
        return Ok(DEFAULT_ZK_PREFIX.to_owned());
    }
    let path = if prefix.starts_with('/') {
        let p = prefix.trim_end_matches('/');
        let bad = p.is_empty()
            || p.split('/')
                .skip(1)
                .any(|c| c.is_empty() || c == "." || c == ".." || c.chars().any(forbidden));
        if bad || p == "/zookeeper" || p.starts_with("/zookeeper/") {
            return Err(Error::invalid(format!(
                "the key prefix {prefix:?} is not a ZooKeeper path fencelock can own; give one \
                 such as /fencelock/v1/ (not the root, nor under /zookeeper)"
            )));
        }
        format!("{p}/")
    } else {
        format!("/{}/", escape(prefix))
    };
    Ok(path)
}

/// The paths of one client's namespace.
#[derive(Debug, Clone)]
pub(crate) struct Paths {
    /// Ends with `/`.
    pub prefix: String,
}

impl Paths {
    /// The lock path of `name`: the path to give Curator's recipes.
    pub(crate) fn lock(&self, name: &str) -> String {
        format!("{}{}", self.prefix, escape(name))
    }

    /// The path a new waiter node is created at (ZooKeeper appends the sequence).
    pub(crate) fn waiter(&self, name: &str, id: &str, marker: &str) -> String {
        format!("{}/{}{marker}", self.lock(name), protected(id))
    }

    /// The prefix itself, without its trailing `/`.
    pub(crate) fn root(&self) -> &str {
        self.prefix.trim_end_matches('/')
    }

    /// Where the audit records of `name` (or the parent of every resource's) live.
    pub(crate) fn audit(&self, name: Option<&str>) -> String {
        match name {
            Some(n) => format!("{}%audit/{}", self.prefix, escape(n)),
            None => format!("{}%audit", self.prefix),
        }
    }
}

/// Curator's protected-mode prefix of a node name: `_c_<id>-`.
pub(crate) fn protected(id: &str) -> String {
    format!("_c_{id}-")
}

/// The sequence number ZooKeeper appended to a waiter node's name, for the names Curator's
/// lock and latch recipes create (`…lock-0000000007`); `None` for other children.
pub(crate) fn sequence(child: &str, marker: &str) -> Option<i64> {
    let (_, seq) = child.rsplit_once(marker)?;
    if seq.len() < 10 || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    seq.parse().ok()
}

/// The children that are `marker` waiters, in queue order (lowest sequence first), as
/// Curator's `StandardLockInternalsDriver` sorts them.
pub(crate) fn queue(children: &[String], marker: &str) -> Vec<(i64, String)> {
    let mut q: Vec<(i64, String)> = children
        .iter()
        .filter_map(|c| sequence(c, marker).map(|s| (s, c.clone())))
        .collect();
    q.sort();
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn paths() -> Paths {
        Paths {
            prefix: DEFAULT_ZK_PREFIX.to_owned(),
        }
    }

    #[test]
    fn names_map_to_one_component() {
        let p = paths();
        assert_eq!(p.lock("a"), "/fencelock/v1/a");
        assert_eq!(p.lock("a/b"), "/fencelock/v1/a%2Fb");
        assert_eq!(p.lock(".."), "/fencelock/v1/%2E%2E");
        assert_eq!(p.lock("x\u{e000}"), "/fencelock/v1/x%EE%80%80");
        assert_eq!(
            p.waiter("jobs", "f00", LOCK),
            "/fencelock/v1/jobs/_c_f00-lock-"
        );
        assert_eq!(p.audit(Some("a")), "/fencelock/v1/%audit/a");
        assert_eq!(unescape("a%2fb"), None);
        assert_eq!(unescape("%2E"), Some(".".into()));
    }

    #[test]
    fn prefixes() {
        assert_eq!(zk_prefix(DEFAULT_PREFIX).unwrap(), "/fencelock/v1/");
        assert_eq!(zk_prefix("/a/b").unwrap(), "/a/b/");
        assert_eq!(zk_prefix("svc:").unwrap(), "/svc:/");
        assert_eq!(zk_prefix("a/b").unwrap(), "/a%2Fb/");
        for bad in ["/", "//", "/a//b", "/zookeeper", "/zookeeper/x", "/a/../b"] {
            assert!(zk_prefix(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn queue_order_is_curators() {
        let children: Vec<String> = [
            "_c_b-lock-0000000012",
            "_c_a-lock-0000000003",
            "_c_c-latch-0000000001",
            "stray",
            "_c_d-lock-12",
        ]
        .map(String::from)
        .into();
        let q = queue(&children, LOCK);
        assert_eq!(
            q.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [3, 12],
            "{q:?}"
        );
        assert_eq!(queue(&children, LATCH).len(), 1);
    }

    proptest! {
        #[test]
        fn escaping_is_injective_and_valid(a in "\\PC{1,20}", b in "\\PC{1,20}") {
            let e = escape(&a);
            prop_assert!(!e.contains('/'));
            prop_assert!(e != "." && e != "..");
            prop_assert!(!e.chars().any(|c| forbidden(c) && c != '%'));
            prop_assert_eq!(unescape(&e), Some(a.clone()));
            if a != b {
                prop_assert_ne!(e, escape(&b));
            }
            prop_assert!(!escape(&a).starts_with("%a"));
        }
    }
}
