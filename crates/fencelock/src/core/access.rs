//! Least privilege: what an operator runs on an engine so that a service's user may use
//! fencelock under one prefix and nothing else (`fencelock acl`).
//!
//! Each engine writes its own plan (the registry picks it); this module holds what the plans
//! share: their shape, the checks on user names, and the quoting of the lines they print.

use crate::core::error::{Error, Result};

/// What an operator runs to create fencelock's users on one engine, for one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessPlan {
    /// The engine's short name, as [`Backend::engine`](crate::Backend::engine) gives it.
    pub engine: &'static str,
    /// Where the steps' lines are run: `redis-cli` (on every node), `shell`, `psql`, or
    /// `none` when the engine has no users to create (SQLite).
    pub runs_in: &'static str,
    /// What runs once, before the users are created (PostgreSQL: the tables, created by
    /// their owner); empty on most engines.
    pub setup: Vec<AccessStep>,
    /// The users to create, the read-write one first.
    pub users: Vec<AccessUser>,
    /// What the operator must know: what must be replaced, what is not covered, the limits
    /// of the protection.
    pub notes: Vec<String>,
}

/// One user (or role) of an [`AccessPlan`] and the steps that create it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessUser {
    /// The user's name.
    pub name: String,
    /// Only `inspect`, `list` and `audit` work for this user; every lock operation is refused.
    pub read_only: bool,
    /// The steps, in order.
    pub steps: Vec<AccessStep>,
}

/// One step of a plan: a command line (or SQL statement) to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessStep {
    /// The command's arguments, unquoted (for `psql`, one element: the statement).
    pub argv: Vec<String>,
    /// The same step as a line to paste where the plan's `runs_in` says, quoted as needed.
    pub line: String,
}

/// The placeholder a plan prints where the operator puts a password of their own choice:
/// no plan ever holds a password.
pub const PASSWORD_PLACEHOLDER: &str = "<password>";

/// A user name fit for every engine's user (or role) and for a line of any of them, unquoted.
pub(crate) fn validate_user(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "user name {name:?} is not accepted: write 1 to 63 ASCII letters, digits, '_', '-' \
             or '.' (not starting with '-'), which every engine takes unquoted"
        )))
    }
}

impl AccessStep {
    /// A step for a shell or `redis-cli`, whose line quotes the arguments that need it.
    pub(crate) fn command(argv: Vec<String>, quote: fn(&str) -> String) -> AccessStep {
        let line = argv.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" ");
        AccessStep { argv, line }
    }

    /// An SQL statement.
    pub(crate) fn sql(statement: String) -> AccessStep {
        AccessStep {
            line: statement.clone(),
            argv: vec![statement],
        }
    }
}

fn plain(arg: &str, extra: &[u8]) -> bool {
    !arg.is_empty()
        && arg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-./:=@,+%".contains(&b) || extra.contains(&b))
}

/// `arg` for a POSIX shell: as is when it holds nothing the shell reads, else single-quoted.
pub(crate) fn shell_quote(arg: &str) -> String {
    if plain(arg, b"") {
        arg.to_owned()
    } else {
        format!("'{}'", arg.replace('\'', r"'\''"))
    }
}

/// `arg` for a `redis-cli` line: as is when plain, else double-quoted with `redis-cli`'s
/// escapes (the same as `redis-server`'s inline protocol reads).
pub(crate) fn redis_quote(arg: &str) -> String {
    if plain(arg, b"~&*?[]<>|#!") {
        return arg.to_owned();
    }
    let mut out = String::with_capacity(arg.len() + 2);
    out.push('"');
    for c in arg.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 || u32::from(c) == 0x7f => {
                out.push_str(&format!("\\x{:02x}", u32::from(c)))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `text` as an SQL string literal.
pub(crate) fn sql_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_every_engine_takes_unquoted() {
        for ok in ["fencelock", "svc-a.ro", "A_1"] {
            assert!(validate_user(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a b", "a;b", "-x", "é", &"x".repeat(64), "a'b"] {
            assert!(validate_user(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn quoting_keeps_odd_prefixes_one_argument() {
        assert_eq!(shell_quote("/fencelock/v1/"), "/fencelock/v1/");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(redis_quote("~fencelock:v1:*"), "~fencelock:v1:*");
        assert_eq!(redis_quote("~a b\"c*"), "\"~a b\\\"c*\"");
        assert_eq!(redis_quote("x\ny"), "\"x\\ny\"");
        assert_eq!(sql_literal("o'k"), "'o''k'");
    }
}
