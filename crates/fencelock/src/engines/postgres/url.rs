//! `postgres://` and `postgresql://` URLs: libpq's own form, plus fencelock's `mode` and `pool`
//! parameters, which are taken out before the driver sees the rest.

use crate::core::error::{Error, Result};

/// The default number of pooled PostgreSQL connections per client.
pub(crate) const DEFAULT_POOL: usize = 4;
/// The most pooled PostgreSQL connections per client `?pool=` accepts.
pub(crate) const MAX_POOL: usize = 10;

/// A parsed PostgreSQL URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PostgresUrl {
    /// The connection URL as libpq reads it, without fencelock's own parameters.
    pub url: String,
    /// Advisory locks (the default) or the lease table.
    pub mode: PgMode,
    /// The most connections one client opens (`?pool=N`, 2 to 10, default 4): one listens
    /// for wake-up notifications, the others carry the leases.
    pub pool: usize,
}

impl PostgresUrl {
    /// The engine's short name: `postgres` or `postgres-lease`.
    pub fn engine(&self) -> &'static str {
        match self.mode {
            PgMode::Advisory => "postgres",
            PgMode::Lease => "postgres-lease",
        }
    }
}

/// How the PostgreSQL engine keeps locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgMode {
    /// Session advisory locks (`pg_try_advisory_lock`), the default: a lost session is a lost
    /// lease, and `psql` users can take the same lock.
    Advisory,
    /// Rows with owner, token and expiry by the database clock (`?mode=lease`): no session
    /// state, so it works through transaction poolers.
    Lease,
}

/// Takes fencelock's own query parameters (`mode`, `pool`) out of a PostgreSQL URL and leaves
/// the rest for the driver, which checks it when the engine connects.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<PostgresUrl> {
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, q),
        None => (rest, ""),
    };
    let mut mode = PgMode::Advisory;
    let mut pool = DEFAULT_POOL;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "mode" => {
                mode = match v {
                    "advisory" => PgMode::Advisory,
                    "lease" => PgMode::Lease,
                    other => {
                        return Err(Error::invalid(format!(
                            "mode {other:?} in the backend URL is not one of advisory, lease"
                        )))
                    }
                }
            }
            "pool" => {
                pool = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (2..=MAX_POOL).contains(n))
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "pool {v:?} in the backend URL is not a number from 2 to {MAX_POOL}"
                        ))
                    })?
            }
            _ => kept.push(pair),
        }
    }
    if base.is_empty() || base.starts_with('/') && !kept.iter().any(|p| p.starts_with("host=")) {
        return Err(Error::invalid(
            "the PostgreSQL URL names no host; write postgres://user@host:port/database",
        ));
    }
    let mut url = format!("{scheme}://{base}");
    if !kept.is_empty() {
        url.push('?');
        url.push_str(&kept.join("&"));
    }
    Ok(PostgresUrl { url, mode, pool })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_urls() {
        assert_eq!(
            parse(
                "postgres",
                "u:p@127.0.0.1:5432/db?mode=lease&pool=8&sslmode=disable"
            )
            .ok(),
            Some(PostgresUrl {
                url: "postgres://u:p@127.0.0.1:5432/db?sslmode=disable".into(),
                mode: PgMode::Lease,
                pool: 8,
            })
        );
        assert_eq!(
            parse("postgresql", "h/db").ok(),
            Some(PostgresUrl {
                url: "postgresql://h/db".into(),
                mode: PgMode::Advisory,
                pool: DEFAULT_POOL,
            })
        );
        for rest in ["h/db?mode=x", "h/db?pool=1", "h/db?pool=11", ""] {
            let e = parse("postgres", rest).expect_err(rest);
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{rest}");
        }
    }
}
