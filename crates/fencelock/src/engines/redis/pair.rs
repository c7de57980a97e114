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

/// What every node runs for one uncontended acquire+release in default mode: the acquire
/// script (limits, lock, token, holder metadata) and the owner's release. Given by
/// [`RedisUrl::pair_calls`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RedisPairCalls {
    /// The acquisition; its reply starts with 1 when granted.
    pub acquire: RedisScriptCall,
    /// The release; it replies 1 when the owner's lock was deleted.
    pub release: RedisScriptCall,
}

impl RedisUrl {
    /// The calls this URL's engine sends to each node for one uncontended acquire+release of
    /// `name` under `prefix` by `owner`, for a client named `client`, with a lease of `ttl`.
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
        let held = keys::held_key(prefix, client);
        // As the engine: one node is judged by the count of nodes, not the scheme.
        let one_node = self.nodes.len() == 1;
        let floor = if one_node { 0 } else { unix_micros() };
        let meta = HolderMeta::current(client.to_owned());
        let value = holder_value(owner, ttl, SystemTime::now(), &meta);
        RedisPairCalls {
            acquire: RedisScriptCall {
                source: scripts::ACQUIRE_SOURCE.to_owned(),
                keys: vec![
                    k.lock.clone(),
                    k.fence,
                    keys::node_key(prefix),
                    keys::limits_key(prefix),
                    held.clone(),
                ],
                args: vec![
                    owner.to_owned(),
                    ms(ttl).to_string(),
                    floor.to_string(),
                    value,
                ],
            },
            release: RedisScriptCall {
                source: scripts::release_source(),
                keys: vec![k.lock, held],
                args: vec![
                    owner.to_owned(),
                    prefix.len().to_string(),
                    u8::from(one_node).to_string(),
                    "0".to_owned(),
                ],
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn one_node_and_redlock_differ_in_the_floor_and_the_handoff_flag_only() {
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
        assert_eq!(one.acquire.args[..2], ["o", "3000"]);
        assert_eq!(one.acquire.args[2], "0");
        assert_ne!(three.acquire.args[2], "0");
        assert_eq!(one.release.args, ["o", "2", "1", "0"]);
        assert_eq!(three.release.args, ["o", "2", "0", "0"]);
    }
}
