//! The statements one uncontended acquire and release send, as the engine sends them, for
//! whoever needs to reproduce them outside fencelock: a benchmark running them through
//! `pgbench` in the same protocol, or a DBA matching them in `pg_stat_statements`.

use super::url::{PgMode, PostgresUrl};

/// The two statements of one uncontended acquire+release, in the order they are sent, one
/// round trip each, with what their `$n` parameters carry. Given by
/// [`PostgresUrl::pair_statements`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgPairStatements {
    /// The grant: the limits check, the lock (or the lease row) and the token, in one
    /// statement.
    pub acquire: &'static str,
    /// What `$1`, `$2`, ... of [`acquire`](Self::acquire) carry, in order (`key`, `row`,
    /// `owner`, `host`, `pid`, `client`, `acquired_at`, `ttl_ms`, `prefix`, `holder_id`,
    /// `channel`, `name`).
    pub acquire_params: &'static [&'static str],
    /// The owner's release, with the wake-up notification.
    pub release: &'static str,
    /// What the parameters of [`release`](Self::release) carry, in order.
    pub release_params: &'static [&'static str],
    /// Named statements, prepared once per connection (`pgbench -M prepared`), or unnamed
    /// ones, parsed on every call, as a transaction pooler needs (`pgbench -M extended`).
    pub prepared: bool,
    /// The channel the release notifies: `fencelock_` and 16 hex digits derived from the
    /// prefix.
    pub channel: String,
}

impl PostgresUrl {
    /// The statements this URL's engine sends for one uncontended acquire+release under
    /// `prefix`.
    pub fn pair_statements(&self, prefix: &str) -> PgPairStatements {
        let channel = super::channel_name(prefix);
        match self.mode {
            PgMode::Advisory => PgPairStatements {
                acquire: super::advisory::GRANT,
                acquire_params: super::advisory::GRANT_PARAMS,
                release: super::advisory::RELEASE,
                release_params: super::advisory::RELEASE_PARAMS,
                prepared: true,
                channel,
            },
            PgMode::Lease => PgPairStatements {
                acquire: super::lease::ACQUIRE,
                acquire_params: super::lease::ACQUIRE_PARAMS,
                release: super::lease::RELEASE,
                release_params: super::lease::RELEASE_PARAMS,
                prepared: self.prepare,
                channel,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    /// The highest `$n` a statement uses.
    fn params_of(sql: &str) -> usize {
        let mut highest = 0;
        let mut rest = sql;
        while let Some(at) = rest.find('$') {
            rest = &rest[at + 1..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if let Ok(n) = digits.parse::<usize>() {
                highest = highest.max(n);
            }
        }
        highest
    }

    #[test]
    fn every_parameter_is_named() {
        for url in ["postgres://h/db", "postgres://h/db?mode=lease"] {
            let Ok(crate::Backend::Postgres(u)) = crate::Backend::parse(url) else {
                unreachable!("{url} parses")
            };
            let p = u.pair_statements("fencelock:v1:");
            assert_eq!(params_of(p.acquire), p.acquire_params.len(), "{url}");
            assert_eq!(params_of(p.release), p.release_params.len(), "{url}");
            assert!(p.channel.starts_with("fencelock_"));
        }
    }
}
