//! How resource names map to etcd keys.
//!
//! A name `N` maps to the *lock prefix* `<prefix><esc(N)>`, where `esc` writes `%` as `%25`
//! and `/` as `%2F` and leaves every other byte alone. That prefix is what `etcdctl lock` and
//! `etcdctl elect` take as their name: like etcd's `concurrency` package they append `/` and
//! one key per waiter, `<prefix><esc(N)>/<lease id in hex>`. Because `esc(N)` never contains
//! `/`, the range `<prefix><esc(N)>/` of one name never holds another name's keys (`a` and
//! `a/b` map to `…a/` and `…a%2Fb/`), and `esc` is injective, so distinct names never share a
//! key. Audit records live under `<prefix>%audit/`, which no escaped name can produce (an
//! escaped `%` is always followed by `25` or `2F`).

use percent_encoding::percent_decode_str;

/// The prefix every key of the etcd engine starts with when the client keeps the default
/// (`fencelock:v1:`, a Redis-style namespace): etcd keys are paths by convention.
pub(crate) const DEFAULT_ETCD_PREFIX: &str = "/fencelock/v1/";

/// `name` with `%` and `/` escaped.
pub(crate) fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            c => out.push(c),
        }
    }
    out
}

/// The inverse of [`escape`]; `None` for text `escape` cannot produce.
pub(crate) fn unescape(esc: &str) -> Option<String> {
    if esc.contains('/') || escape(&percent_decode_str(esc).decode_utf8().ok()?) != esc {
        return None;
    }
    percent_decode_str(esc)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

/// The keys of one client's namespace.
#[derive(Debug, Clone)]
pub(crate) struct Keys {
    pub prefix: String,
}

impl Keys {
    /// The lock prefix of `name`: the name to give `etcdctl lock` / `etcdctl elect`.
    pub(crate) fn lock_prefix(&self, name: &str) -> String {
        format!("{}{}", self.prefix, escape(name))
    }

    /// The range holding every waiter's key for `name` (the lock prefix and `/`).
    pub(crate) fn waiters(&self, name: &str) -> String {
        format!("{}/", self.lock_prefix(name))
    }

    /// The waiter key of the session lease `lease` on `name`.
    pub(crate) fn waiter(&self, name: &str, lease: i64) -> String {
        format!("{}{lease:x}", self.waiters(name))
    }

    /// The range holding every audit record, or those of one resource.
    pub(crate) fn audit(&self, name: Option<&str>) -> String {
        match name {
            Some(n) => format!("{}%audit/{}/", self.prefix, escape(n)),
            None => format!("{}%audit/", self.prefix),
        }
    }

    /// The resource name and lease id of a waiter key under this prefix; `None` for other keys.
    pub(crate) fn parse_waiter(&self, key: &str) -> Option<(String, i64)> {
        let rest = key.strip_prefix(&self.prefix)?;
        let (esc, lease) = rest.split_once('/')?;
        let name = unescape(esc)?;
        let lease = i64::from_str_radix(lease, 16).ok()?;
        Some((name, lease))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys() -> Keys {
        Keys {
            prefix: DEFAULT_ETCD_PREFIX.to_owned(),
        }
    }

    #[test]
    fn nested_names_do_not_overlap() {
        let k = keys();
        assert_eq!(k.lock_prefix("a"), "/fencelock/v1/a");
        assert_eq!(k.waiters("a/b"), "/fencelock/v1/a%2Fb/");
        assert!(!k.waiter("a/b", 1).starts_with(&k.waiters("a")));
        assert_eq!(k.waiter("a", 0x694d), "/fencelock/v1/a/694d");
        assert_eq!(
            k.parse_waiter("/fencelock/v1/a%2Fb/ff"),
            Some(("a/b".into(), 255))
        );
        assert_eq!(k.parse_waiter("/fencelock/v1/%audit/a/1"), None);
        assert_eq!(k.parse_waiter("/fencelock/v1/a%2fb/1"), None);
    }

    proptest! {
        #[test]
        fn escaping_is_injective_and_reversible(a in "\\PC{1,20}", b in "\\PC{1,20}") {
            prop_assert!(!escape(&a).contains('/'));
            prop_assert_eq!(unescape(&escape(&a)), Some(a.clone()));
            if a != b {
                prop_assert_ne!(escape(&a), escape(&b));
                let k = keys();
                prop_assert!(!k.waiter(&b, 7).starts_with(&k.waiters(&a)));
            }
            prop_assert!(!k_audit_collides(&a));
        }
    }

    fn k_audit_collides(name: &str) -> bool {
        let k = keys();
        k.waiter(name, 1).starts_with(&k.audit(None))
    }
}
