//! The scripts one uncontended acquire and release run on each node, and the keys and
//! arguments the engine passes them, for whoever needs to reproduce them outside fencelock: a
//! benchmark that runs them through the bare `redis` crate to tell the cost of the scripts on
//! the servers from the cost of the client around them.

use std::time::{Duration, SystemTime};

use super::keys::{self, Keys};
use super::scripts;
use super::url::RedisUrl;
use super::values::{holder_value, ms, unix_micros};
use crate::core::holder::HolderMeta;

/// One script call: the script's text, its `KEYS` and its `ARGV`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisScriptCall {
    /// The Lua text, as `SCRIPT LOAD` takes it.
    pub source: String,
    /// `KEYS[1]`, `KEYS[2]`, ...
    pub keys: Vec<String>,
    /// `ARGV[1]`, `ARGV[2]`, ...
    pub args: Vec<String>,
}

/// Where the acquire call's arguments hold the node id the client last saw on the node:
/// empty in [`RedisUrl::pair_calls`], for the caller to fill in per node. A node answers with
/// the bare token when the id is its own, and with `{1, token, node_id}` otherwise.
pub const NODE_ID_ARG: usize = 2;

/// What every node runs for one uncontended acquire+release in default mode: the acquire
/// script (limits, lock, token, holder metadata) and the owner's release. Given by
/// [`RedisUrl::pair_calls`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisPairCalls {
    /// The acquisition; its reply is the token (an integer or its digits) when granted by a
    /// node of the id passed at [`NODE_ID_ARG`], a table starting with 1 when granted by a
    /// node of another id.
    pub acquire: RedisScriptCall,
    /// The release; it replies 1 when the owner's lock was deleted.
    pub release: RedisScriptCall,
}

impl RedisUrl {
    /// The calls this URL's engine sends to each node for one uncontended acquire+release of
    /// `name` under `prefix` by `owner`, for a client named `client` that has seen no quota,
    /// with a lease of `ttl`.
    /// The token floor is taken now, as the engine takes it at each attempt (the client's clock
    /// on Redlock, 0 on one node), so a caller builds the calls anew for every pair.
    pub fn pair_calls(
        &self,
        prefix: &str,
        client: &str,
        name: &str,
        owner: &str,
        ttl: Duration,
    ) -> RedisPairCalls {
        let k = Keys::new(prefix, name);
        // As the engine: one node is judged by the count of nodes, not the scheme.
        let one_node = self.nodes.len() == 1;
        let floor = if one_node { 0 } else { unix_micros() };
        let meta = HolderMeta::current(client.to_owned());
        let value = holder_value(owner, ttl, SystemTime::now(), &meta);
        RedisPairCalls {
            acquire: RedisScriptCall {
                source: scripts::acquire_source(),
                keys: vec![
                    k.lock.clone(),
                    k.fence,
                    keys::node_key(prefix),
                    keys::limits_key(prefix),
                ],
                args: std::iter::once(value)
                    .chain([ms(ttl).to_string(), String::new()])
                    .chain((!one_node).then(|| floor.to_string()))
                    .collect(),
            },
            release: RedisScriptCall {
                source: scripts::release_source(),
                keys: vec![k.lock],
                args: vec![
                    owner.to_owned(),
                    (prefix.len() * 4 + 2 * usize::from(one_node)).to_string(),
                ],
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn one_node_and_redlock_differ_in_the_floor_and_the_handoff_mode_only() {
        let url = |u: &str| match crate::Backend::parse(u) {
            Ok(crate::Backend::Redis(r)) => r,
            _ => unreachable!("{u} parses"),
        };
        let one =
            url("redis://127.0.0.1:6379").pair_calls("p:", "c", "n", "o", Duration::from_secs(3));
        let three = url("redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3").pair_calls(
            "p:",
            "c",
            "n",
            "o",
            Duration::from_secs(3),
        );
        assert_eq!(one.acquire.keys, three.acquire.keys);
        assert_eq!(one.acquire.keys[0], "p:lock:n");
        assert!(one.acquire.args[0].starts_with("o\n00\n3000\n"));
        assert_eq!(one.acquire.args[1..], ["3000", ""]);
        assert_eq!(three.acquire.args.len(), 4);
        assert_ne!(three.acquire.args[3], "0");
        // The prefix's length times 4, plus 2 for the handoff only one node makes.
        assert_eq!(one.release.args, ["o", "10"]);
        assert_eq!(three.release.args, ["o", "8"]);
    }
}
