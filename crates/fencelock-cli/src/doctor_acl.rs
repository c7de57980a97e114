//! `fencelock doctor` on Redis: does the connected ACL user have what fencelock needs under the
//! prefix, and no more?
//!
//! A least-privilege user may not run `ACL`, so the check does not depend on it: a script asks
//! `redis.acl_check_cmd` (Redis 7.0+) whether the caller may run each command fencelock runs,
//! with keys and channels under the prefix, and a few it never needs (a key outside the
//! prefix, `FLUSHALL`, `CONFIG SET`, `KEYS`): the same ACL check the server applies, without
//! running any of them. The user needs `EVALSHA` and `SCRIPT LOAD` for that, which fencelock
//! needs anyway; without them, `ACL DRYRUN` (which needs the `ACL` command) is tried instead,
//! and otherwise the doctor says what it could not check.

use std::time::Duration;

/// Asks `redis.acl_check_cmd` about each command of ARGV, given as its length and then its
/// arguments: 1 allowed, 0 refused, -1 not a command this server knows.
const CHECK: &str = r#"
local out, i = {}, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local c = {}
  for j = 1, n do c[j] = ARGV[i + j] end
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(c))
  if not ok then out[#out + 1] = -1 elseif allowed then out[#out + 1] = 1 else out[#out + 1] = 0 end
  i = i + n + 1
end
return out
"#;

/// The resource name the samples use; nothing is written to it.
const NAME: &str = "fencelock-doctor";

/// A sample invocation of each command fencelock runs, on the keys and channels it runs it on.
fn sample(command: &str, prefix: &str, db: i64) -> Option<Vec<String>> {
    let key = |category: &str| format!("{prefix}{category}:{NAME}");
    let audit = format!("{prefix}audit");
    let mut wake = String::new();
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            wake.push('\\');
        }
        wake.push(c);
    }
    wake.push_str("wake:*");
    let args: Vec<String> = match command {
        "del" => vec!["DEL".into(), key("lock")],
        "evalsha" => vec!["EVALSHA".into(), "0".repeat(40), "1".into(), key("lock")],
        "exec" => vec!["EXEC".into()],
        "get" => vec!["GET".into(), key("lock")],
        "hdel" => vec!["HDEL".into(), key("qinfo"), "w".into()],
        "hget" => vec!["HGET".into(), key("qinfo"), "w".into()],
        "hset" => vec!["HSET".into(), key("qinfo"), "w".into(), "v".into()],
        "incr" => vec!["INCR".into(), key("qseq")],
        "multi" => vec!["MULTI".into()],
        "pexpire" => vec!["PEXPIRE".into(), key("lock"), "1000".into()],
        "ping" => vec!["PING".into()],
        "psubscribe" => vec!["PSUBSCRIBE".into(), wake],
        "pttl" => vec!["PTTL".into(), key("lock")],
        "publish" => vec!["PUBLISH".into(), key("wake"), String::new()],
        "scan" => vec!["SCAN".into(), "0".into()],
        "script|load" => vec!["SCRIPT".into(), "LOAD".into(), "return 1".into()],
        "set" => vec!["SET".into(), key("fence"), "1".into()],
        "subscribe" => vec!["SUBSCRIBE".into(), format!("{prefix}client:{NAME}")],
        "time" => vec!["TIME".into()],
        "xadd" => vec!["XADD".into(), audit, "*".into(), "f".into(), "v".into()],
        "xrevrange" => vec!["XREVRANGE".into(), audit, "+".into(), "-".into()],
        "zadd" => vec!["ZADD".into(), key("queue"), "1".into(), "w".into()],
        "zcard" => vec!["ZCARD".into(), key("queue")],
        "zrange" => vec!["ZRANGE".into(), key("queue"), "0".into(), "0".into()],
        "zrangebyscore" => vec![
            "ZRANGEBYSCORE".into(),
            key("qexp"),
            "-inf".into(),
            "0".into(),
        ],
        "zrem" => vec!["ZREM".into(), key("queue"), "w".into()],
        "zremrangebyscore" => vec![
            "ZREMRANGEBYSCORE".into(),
            key("held:c"),
            "-inf".into(),
            "0".into(),
        ],
        "zscore" => vec!["ZSCORE".into(), key("queue"), "w".into()],
        "select" => vec!["SELECT".into(), db.to_string()],
        _ => return None,
    };
    Some(args)
}

/// What fencelock never needs; a user allowed these has more than its share.
fn beyond(prefix: &str) -> Vec<(String, Vec<String>)> {
    let outside = format!("{NAME}-outside-{}", prefix.len());
    vec![
        (
            format!("keys outside the prefix (GET {outside})"),
            vec!["GET".into(), outside],
        ),
        ("FLUSHALL".into(), vec!["FLUSHALL".into()]),
        (
            "CONFIG SET".into(),
            vec![
                "CONFIG".into(),
                "SET".into(),
                "maxmemory".into(),
                "0".into(),
            ],
        ),
        ("KEYS".into(), vec!["KEYS".into(), "*".into()]),
    ]
}

/// Checks the ACL user of every node of `url` against what fencelock needs under `prefix`,
/// printing what it finds as the doctor does; returns the number of problems.
pub async fn redis(url: &fencelock::RedisUrl, prefix: &str) -> usize {
    let Ok(clients) = url.clients() else {
        return 0;
    };
    let user = url.user.clone().unwrap_or_else(|| "default".into());
    outln!("ACL user {user:?}, prefix {prefix:?}");
    let mut problems = 0;
    for (node, client) in url.nodes.iter().zip(clients) {
        let found = tokio::time::timeout(
            Duration::from_secs(5),
            check_node(client, &user, prefix, url.db),
        )
        .await
        .unwrap_or_else(|_| Err("no answer within 5s".into()));
        match found {
            Ok(lines) => {
                for (warn, text) in lines {
                    if warn {
                        problems += 1;
                        outln!("  WARN  {node}: {text}");
                    } else {
                        outln!("  ok    {node}: {text}");
                    }
                }
            }
            Err(why) => outln!("  note  {node}: ACL not checked: {why}"),
        }
    }
    problems
}

type Lines = Vec<(bool, String)>;

async fn check_node(
    client: redis::Client,
    user: &str,
    prefix: &str,
    db: i64,
) -> Result<Lines, String> {
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut needed: Vec<(&str, Vec<String>)> = Vec::new();
    let mut unchecked = Vec::new();
    let mut commands: Vec<&str> = fencelock::REDIS_COMMANDS.to_vec();
    if db != 0 {
        commands.push("select");
    }
    for c in commands {
        match sample(c, prefix, db) {
            Some(s) => needed.push((c, s)),
            None => unchecked.push(c),
        }
    }
    let extra = beyond(prefix);
    let mut argv = Vec::new();
    for s in needed
        .iter()
        .map(|(_, s)| s)
        .chain(extra.iter().map(|(_, s)| s))
    {
        argv.push(s.len().to_string());
        argv.extend(s.iter().cloned());
    }
    let answers = match by_script(&mut conn, &argv).await {
        Ok(a) => a,
        Err(script_refused) => {
            by_dryrun(&mut conn, user, &needed, &extra)
                .await
                .map_err(|acl_refused| {
                    format!(
                        "this user may not run the check script ({script_refused}) nor ACL \
                     DRYRUN ({acl_refused}); fencelock itself needs EVALSHA and SCRIPT LOAD, \
                     so a user without them cannot take locks (a read-only user cannot)"
                    )
                })?
        }
    };
    let (need, more) = answers.split_at(needed.len().min(answers.len()));
    let mut lines = Lines::new();
    let missing: Vec<String> = needed
        .iter()
        .zip(need)
        .filter(|(_, a)| **a != 1)
        .map(|((c, s), a)| {
            let on = s
                .get(1)
                .filter(|_| *c != "script|load")
                .map_or(String::new(), |k| format!(" {k}"));
            let unknown = if *a == -1 {
                " (unknown to this server)"
            } else {
                ""
            };
            format!("{}{on}{unknown}", c.to_uppercase())
        })
        .collect();
    if missing.is_empty() {
        lines.push((
            false,
            format!(
                "may run the {} commands fencelock runs, on keys and channels under the prefix",
                need.len()
            ),
        ));
    } else {
        lines.push((
            true,
            format!(
                "this user may not run what fencelock needs: {}. Grant what `fencelock acl` \
                 prints for this prefix",
                missing.join(", ")
            ),
        ));
    }
    let allowed: Vec<&str> = extra
        .iter()
        .zip(more)
        .filter(|(_, a)| **a == 1)
        .map(|((what, _), _)| what.as_str())
        .collect();
    if allowed.len() == extra.len() {
        lines.push((
            true,
            "this user may run every command on every key (@all, allkeys?): any bug or \
             compromise of this service reaches every key of the server; use the user \
             `fencelock acl` prints"
                .into(),
        ));
    } else if !allowed.is_empty() {
        lines.push((
            true,
            format!(
                "this user has more than fencelock needs: {}",
                allowed.join(", ")
            ),
        ));
    } else {
        lines.push((
            false,
            "no key outside the prefix, no command beyond fencelock's".into(),
        ));
    }
    if !unchecked.is_empty() {
        lines.push((
            false,
            format!("not checked (no sample): {}", unchecked.join(", ")),
        ));
    }
    Ok(lines)
}

async fn by_script(
    conn: &mut redis::aio::MultiplexedConnection,
    argv: &[String],
) -> Result<Vec<i64>, String> {
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(CHECK)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    redis::cmd("EVALSHA")
        .arg(sha)
        .arg(0)
        .arg(argv)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())
}

/// The same answers from `ACL DRYRUN` (Redis 7.0+), which needs the `ACL` command.
async fn by_dryrun(
    conn: &mut redis::aio::MultiplexedConnection,
    user: &str,
    needed: &[(&str, Vec<String>)],
    extra: &[(String, Vec<String>)],
) -> Result<Vec<i64>, String> {
    let mut out = Vec::new();
    for s in needed
        .iter()
        .map(|(_, s)| s)
        .chain(extra.iter().map(|(_, s)| s))
    {
        let answer: redis::RedisResult<String> = redis::cmd("ACL")
            .arg("DRYRUN")
            .arg(user)
            .arg(s)
            .query_async(conn)
            .await;
        out.push(match answer {
            Ok(a) if a == "OK" => 1,
            Ok(_) => 0,
            Err(e) if e.code() == Some("NOPERM") && out.is_empty() => return Err(e.to_string()),
            Err(e) if e.to_string().contains("unknown command") => -1,
            Err(e) => return Err(e.to_string()),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command added to `REDIS_COMMANDS` without a sample here is reported "not checked":
    /// this test names it, so the doctor keeps up.
    #[test]
    fn every_command_fencelock_runs_has_a_sample() {
        for c in fencelock::REDIS_COMMANDS {
            assert!(sample(c, "p:", 0).is_some(), "no doctor sample for {c}");
        }
        assert_eq!(
            sample("psubscribe", "a*:", 0),
            Some(vec!["PSUBSCRIBE".to_owned(), "a\\*:wake:*".to_owned()])
        );
    }
}
