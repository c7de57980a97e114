//! Least privilege on Redis: the commands fencelock runs, and the ACL users allowed them under
//! one prefix.
//!
//! Redis checks every command a script runs against the caller's ACL, so the read-write user
//! is granted the commands inside the scripts as well as the scripts themselves: a user cannot
//! be limited to what the scripts write. The key and channel patterns are what confine it to
//! its prefix.

use super::keys;
use crate::core::access::{
    redis_quote, validate_user, AccessPlan, AccessStep, AccessUser, PASSWORD_PLACEHOLDER,
};
use crate::core::error::Result;

/// Every command a fencelock client runs on a Redis node (lower case, ACL syntax), for every
/// operation: `run` (plain and fair, with the wake-ups), `elect`, `inspect`, `list`, `release
/// --force` with its audit record, and `audit`. The commands the scripts call are counted:
/// Redis checks them against the caller's ACL too.
///
/// `tests/acl.rs` of the command line runs every operation against a real server and compares
/// the commands the server counted with this list, so a script that starts calling another
/// command fails that test, naming it. `AUTH` needs no grant; `SELECT` is added for a URL that
/// names a database.
pub const REDIS_COMMANDS: &[&str] = &[
    "del",
    "evalsha",
    "exec",
    "get",
    "hdel",
    "hget",
    "hset",
    "incr",
    "multi",
    "pexpire",
    "ping",
    "psubscribe",
    "pttl",
    "publish",
    "scan",
    "script|load",
    "set",
    "subscribe",
    "time",
    "xadd",
    "xrevrange",
    "zadd",
    "zcard",
    "zrange",
    "zrangebyscore",
    "zrem",
    "zremrangebyscore",
    "zscore",
];

/// The commands of the read-only user: `inspect`, `list` and `audit`, none of which writes.
/// The user's keys are read-only as well (`%R~`), and it runs no script.
pub const REDIS_READ_COMMANDS: &[&str] =
    &["exec", "get", "multi", "ping", "pttl", "scan", "xrevrange"];

/// The key pattern of every key under `prefix`, with the prefix's glob characters escaped.
pub(crate) fn key_pattern(prefix: &str) -> String {
    let mut p = String::new();
    keys::glob_escape(prefix, &mut p);
    p.push('*');
    p
}

/// The channel patterns fencelock uses under `prefix`: the wake-up pattern it subscribes to
/// (a `PSUBSCRIBE` is allowed only by that very pattern, not by a wider one) and the
/// per-client handoff channels.
pub(crate) fn channel_patterns(prefix: &str) -> Vec<String> {
    let mut client = String::new();
    keys::glob_escape(prefix, &mut client);
    client.push_str("client:*");
    vec![keys::wake_pattern(prefix), client]
}

/// The `ACL SETUSER` lines for a read-write `user` and a `read_only` one under `prefix`, to
/// run on every node. `select` is granted when the URL names a database other than 0.
pub(crate) fn plan(
    engine: &'static str,
    prefix: &str,
    user: &str,
    read_only: &str,
    db: i64,
) -> Result<AccessPlan> {
    validate_user(user)?;
    validate_user(read_only)?;
    let setuser = |name: &str, keys: String, channels: Vec<String>, commands: &[&str]| {
        let mut argv: Vec<String> = ["ACL", "SETUSER", name, "on", "resetpass"]
            .map(str::to_owned)
            .to_vec();
        argv.push(format!(">{PASSWORD_PLACEHOLDER}"));
        argv.push("resetkeys".into());
        argv.push(keys);
        argv.push("resetchannels".into());
        argv.extend(channels.into_iter().map(|c| format!("&{c}")));
        argv.push("-@all".into());
        argv.extend(commands.iter().map(|c| format!("+{c}")));
        if db != 0 {
            argv.push("+select".into());
        }
        AccessUser {
            name: name.to_owned(),
            read_only: keys_read_only(&argv),
            steps: vec![AccessStep::command(argv, redis_quote)],
        }
    };
    let pattern = key_pattern(prefix);
    let users = vec![
        setuser(
            user,
            format!("~{pattern}"),
            channel_patterns(prefix),
            REDIS_COMMANDS,
        ),
        setuser(
            read_only,
            format!("%R~{pattern}"),
            vec![],
            REDIS_READ_COMMANDS,
        ),
    ];
    Ok(AccessPlan {
        engine,
        runs_in: "redis-cli",
        setup: Vec::new(),
        users,
        notes: vec![
            format!(
                "replace {PASSWORD_PLACEHOLDER} with the user's password (or write \
                 #<sha256 of it in hex> instead of the whole >{PASSWORD_PLACEHOLDER} argument, \
                 so the password itself is never typed into redis-cli)"
            ),
            "run the lines on every node (Redlock: every node of the URL), then ACL SAVE \
             where users live in an ACL file, or CONFIG REWRITE where they live in \
             redis.conf"
                .into(),
            format!(
                "the key pattern also covers every prefix that starts with {prefix:?}: give \
                 services prefixes of which none starts another"
            ),
            "within the prefix, the read-write user can write the keys directly (Redis checks \
             the commands a script runs against the caller's ACL): the owner-checked release \
             and the fencing token protect one holder from another"
                .into(),
            "fencelock doctor needs INFO and CONFIG GET for some of its checks; run it with an \
             administrator's user for those"
                .into(),
        ],
    })
}

fn keys_read_only(argv: &[String]) -> bool {
    argv.iter().any(|a| a.starts_with("%R~"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_escape_the_prefix_and_match_what_fencelock_subscribes_to() {
        assert_eq!(key_pattern("app[1]:"), "app\\[1\\]:*");
        assert_eq!(
            channel_patterns("a*:"),
            vec!["a\\*:wake:*".to_owned(), "a\\*:client:*".to_owned()]
        );
    }

    #[test]
    fn the_plan_grants_the_listed_commands_and_no_category() {
        let p = plan("redis", "svc:", "svc", "svc-ro", 0).unwrap();
        let rw = &p.users[0].steps[0].argv;
        assert!(rw.contains(&"~svc:*".to_owned()));
        assert!(rw.contains(&"&svc:wake:*".to_owned()));
        assert!(!rw.iter().any(|a| a.starts_with("+@") || a == "allkeys"));
        assert_eq!(
            rw.iter().filter(|a| a.starts_with('+')).count(),
            REDIS_COMMANDS.len()
        );
        let ro = &p.users[1];
        assert!(ro.read_only && !p.users[0].read_only);
        assert!(ro.steps[0].argv.contains(&"%R~svc:*".to_owned()));
        assert!(!ro.steps[0].argv.iter().any(|a| a.starts_with('&')));
        assert!(
            plan("redis", "svc:", "svc", "svc-ro", 2).unwrap().users[0].steps[0]
                .argv
                .contains(&"+select".to_owned())
        );
        assert!(plan("redis", "svc:", "a b", "svc-ro", 0).is_err());
    }
}
