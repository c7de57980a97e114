//! Key layout of the Redis engines.
//!
//! For a prefix `P` (default `fencelock:v1:`) and a resource name `N`:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `P lock: N` | string | the holder, `owner\nWQ\nttl_ms\nacquired_at_ms\npid\nhost\nclient`, set with `SET key holder NX PX ttl`; `W` is `1` while someone waits (its release announces itself), `Q` is `1` when the grant is counted in its client's `held` set |
//! | `P fence: N` | string | the fencing counter (no expiry); while the lock is held, its holder's token |
//! | `P queue: N`, `P qexp: N`, `P qseq: N`, `P qinfo: N` | zset, zset, string, hash | FIFO waiters: order, entry expiry, sequence, and, on one node, each waiter's TTL and metadata for a release that hands the lock on (fair mode only) |
//! | `P wake: N` | pub/sub channel | a message on every release that someone waits for |
//! | `P client: C` | pub/sub channel | the handoffs to the fair waiters of one client (`C`: a random id per client) |
//! | `P node` | string | a random id the node keeps in memory: it changes when the node loses its data |
//! | `P seen: N` | string | the highest token a [`RedisFence`](crate::fence::RedisFence) has accepted for resource `N` |
//! | `P limits` | string | the limits stored by `fencelock limits set`: `max_ttl_ms max_held`, 0 for none (no expiry) |
//! | `P held: C` | zset | the leases client `C` (its name, or its random id) holds under the prefix, owner -> expiry (ms); kept only while a `max-held-per-client` limit is set |
//! | `P audit` | stream | the audit log of forced releases under this prefix, capped near 10,000 entries |
//!
//! Every key is the prefix, then a category ending in `:`, then the name verbatim (or nothing,
//! for `node` and `audit`, which belong to the prefix, not to one name). Two keys of different
//! categories differ right after the prefix; two keys of one category differ exactly where
//! their names differ. So no two distinct names ever share a key, whatever bytes the names hold
//! (`:`, `{`, `}` included), and no name's key is `P node`, `P limits` or `P audit`: after the
//! prefix, every name's key starts with a category and a `:`, which none of those does. A
//! client's `held` set is a category of its own, named by the client instead of a resource.
//!
//! `fencelock list` finds held locks with `SCAN MATCH` on `P lock:` followed by the name prefix,
//! both glob-escaped ([`lock_pattern`]), so a prefix or name holding `*`, `?`, `[`, `]` or `\`
//! matches only itself.
//!
//! Braces in names are not hash tags here: fencelock does not run against Redis Cluster; Redlock
//! uses independent nodes.

/// The keys of one resource that every acquisition uses; the others (queue, wake channel)
/// are built where they are needed ([`Keys::of`]), as each one built costs an allocation on
/// every call of the uncontended path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    pub lock: String,
    pub fence: String,
    prefix_len: usize,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &str) -> Keys {
        Keys {
            lock: key(prefix, "lock:", name),
            fence: key(prefix, "fence:", name),
            prefix_len: prefix.len(),
        }
    }

    /// The key of this resource in `category` (`queue`, `qexp`, `qseq`, `qinfo`, `wake`).
    pub(crate) fn of(&self, category: &str) -> String {
        let (prefix, rest) = self.lock.split_at(self.prefix_len);
        let name = &rest["lock:".len()..];
        let mut k = String::with_capacity(self.lock.len() + category.len() + 1);
        k.push_str(prefix);
        k.push_str(category);
        k.push(':');
        k.push_str(name);
        k
    }

    pub(crate) fn labelled(&self) -> Vec<(&'static str, String)> {
        let mut all = vec![("lock", self.lock.clone()), ("fence", self.fence.clone())];
        for category in ["queue", "qexp", "qseq", "qinfo", "wake"] {
            all.push((category, self.of(category)));
        }
        all
    }
}

/// `prefix`, `category` (with its `:`), `name`: `format!` costs several times as much on the
/// path every acquisition takes.
fn key(prefix: &str, category: &str, name: &str) -> String {
    let mut k = String::with_capacity(prefix.len() + category.len() + name.len());
    k.push_str(prefix);
    k.push_str(category);
    k.push_str(name);
    k
}

/// The limits stored under `prefix`.
pub(crate) fn limits_key(prefix: &str) -> String {
    format!("{prefix}limits")
}

/// The set of leases client `holder` holds under `prefix`.
pub(crate) fn held_key(prefix: &str, holder: &str) -> String {
    format!("{prefix}held:{holder}")
}

pub(crate) fn node_key(prefix: &str) -> String {
    format!("{prefix}node")
}

/// The audit log of forced releases under `prefix`.
pub(crate) fn audit_key(prefix: &str) -> String {
    format!("{prefix}audit")
}

/// `text` with Redis glob characters escaped, so that in a pattern it matches only itself.
pub(crate) fn glob_escape(text: &str, out: &mut String) {
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
}

/// The PSUBSCRIBE pattern matching every wake-up channel under `prefix`, with the prefix's glob
/// characters escaped so a prefix like `app[1]:` matches only itself.
pub(crate) fn wake_pattern(prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + 8);
    glob_escape(prefix, &mut p);
    p.push_str("wake:*");
    p
}

/// The SCAN pattern matching the lock key of every name that starts with `name_prefix`.
pub(crate) fn lock_pattern(prefix: &str, name_prefix: &str) -> String {
    let mut p = String::with_capacity(prefix.len() + name_prefix.len() + 8);
    glob_escape(prefix, &mut p);
    p.push_str("lock:");
    glob_escape(name_prefix, &mut p);
    p.push('*');
    p
}

/// The resource name a lock key belongs to.
pub(crate) fn name_of_lock_key<'a>(prefix: &str, key: &'a str) -> Option<&'a str> {
    key.strip_prefix(prefix)?.strip_prefix("lock:")
}

/// The resource name a wake-up channel belongs to.
/// The channel on which one client hears that a release handed it a lock.
pub(crate) fn client_channel(prefix: &str, id: &str) -> String {
    format!("{prefix}client:{id}")
}

pub(crate) fn name_of_wake_channel<'a>(prefix: &str, channel: &'a str) -> Option<&'a str> {
    channel.strip_prefix(prefix)?.strip_prefix("wake:")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all(prefix: &str, name: &str) -> Vec<String> {
        Keys::new(prefix, name)
            .labelled()
            .into_iter()
            .map(|(_, k)| k)
            .chain([node_key(prefix), audit_key(prefix)])
            .collect()
    }

    #[test]
    fn lookalike_names_share_no_key() {
        let names = [
            "a", "a:fence", "{a}", "a}", "fence:a", "lock:a", "", "node", "a:",
        ];
        let mut seen = std::collections::HashMap::new();
        for n in names {
            for (label, k) in Keys::new("fencelock:v1:", n).labelled() {
                if let Some(prev) = seen.insert(k.clone(), (n, label)) {
                    unreachable!("{k} shared by {prev:?} and {:?}", (n, label));
                }
            }
        }
        assert!(!seen.contains_key(&node_key("fencelock:v1:")));
        assert!(!seen.contains_key(&audit_key("fencelock:v1:")));
        for n in ["audit", "", ":audit"] {
            assert!(!all("fencelock:v1:", n)[..7].contains(&audit_key("fencelock:v1:")));
        }
    }

    #[test]
    fn lock_pattern_escapes_prefix_and_name() {
        assert_eq!(lock_pattern("p[1]:", "a*b?"), "p\\[1\\]:lock:a\\*b\\?*");
        assert_eq!(lock_pattern("p:", ""), "p:lock:*");
        let k = Keys::new("p:", "x:y");
        assert_eq!(name_of_lock_key("p:", &k.lock), Some("x:y"));
        assert_eq!(name_of_lock_key("p:", &k.fence), None);
    }

    #[test]
    fn wake_channels_map_back_to_names() {
        let k = Keys::new("p:", "a:b{c}");
        assert_eq!(name_of_wake_channel("p:", &k.of("wake")), Some("a:b{c}"));
        assert_eq!(name_of_wake_channel("p:", "p:lock:x"), None);
        assert_eq!(wake_pattern("a*[b]:"), "a\\*\\[b\\]:wake:*");
    }

    proptest! {
        /// The keys built without `format!` are the documented `prefix category: name`.
        #[test]
        fn every_key_is_prefix_category_name(p in "\\PC{0,8}", n in "\\PC{0,12}") {
            for (category, k) in Keys::new(&p, &n).labelled() {
                prop_assert_eq!(k, format!("{p}{category}:{n}"));
            }
        }

        #[test]
        fn distinct_names_never_share_a_key(a in "\\PC{1,12}|[a:{}]{1,6}", b in "\\PC{1,12}|[a:{}]{1,6}") {
            prop_assume!(a != b);
            let ka = all("fencelock:v1:", &a);
            let kb = all("fencelock:v1:", &b);
            for k in &ka[..ka.len() - 2] {
                prop_assert!(!kb.contains(k), "{} shared by {:?} and {:?}", k, a, b);
            }
        }
    }
}
