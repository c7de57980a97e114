//! `postgres://` and `postgresql://` URLs: libpq's own form, plus fencelock's `mode`, `pool`
//! and `prepare` parameters, which are taken out before the driver sees the rest. So are libpq's TLS
//! parameters (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`), which the driver knows only in
//! part: fencelock applies them itself, with libpq's meaning (see [`SslMode`]).

use std::path::PathBuf;

use crate::core::error::{Error, Result};
use crate::core::url::decode;

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
    /// Named statements, prepared once per connection (`?prepare=true|false`). Always in
    /// advisory mode, whose session locks need a session of their own anyway; off by default
    /// in lease-table mode, which then sends unnamed statements only, as a transaction pooler
    /// needs (one that hands each transaction to any server connection knows nothing of a
    /// statement prepared on another).
    pub prepare: bool,
    /// The TLS settings: libpq's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`.
    pub tls: PgTls,
}

/// libpq's TLS parameters of a PostgreSQL URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgTls {
    /// `sslmode`, `prefer` when absent (as libpq).
    pub mode: SslMode,
    /// `sslrootcert=PATH`: the CA certificate(s) (PEM) to verify the server with; the
    /// system's roots when absent (libpq would read `~/.postgresql/root.crt`).
    pub root_cert: Option<PathBuf>,
    /// `sslcert=PATH`: a client certificate (PEM), for `hostssl ... cert` lines.
    pub cert: Option<PathBuf>,
    /// `sslkey=PATH`: its private key (PEM).
    pub key: Option<PathBuf>,
}

/// libpq's `sslmode`, with libpq's meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS if the server accepts it, else plaintext (only when the server declines TLS, never
    /// after a failed handshake). The certificate is checked as with `require`.
    Prefer,
    /// TLS or no connection. The certificate chain is verified only when `sslrootcert` is
    /// given (then as `verify-ca`), as libpq does.
    Require,
    /// TLS, with the server's certificate chain verified against `sslrootcert` (or the system's
    /// roots); the host name is not checked.
    VerifyCa,
    /// As `verify-ca`, and the certificate must name the host as written in the URL.
    VerifyFull,
}

impl SslMode {
    fn parse(v: &str) -> Result<SslMode> {
        Ok(match v {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            // libpq's `allow` tries plaintext first: a downgrade fencelock does not offer.
            other => {
                return Err(Error::invalid(format!(
                    "sslmode {other:?} in the backend URL is not one of disable, prefer, \
                     require, verify-ca, verify-full"
                )))
            }
        })
    }

    /// The value the driver is given: it knows disable, prefer and require, and fencelock's
    /// certificate verifier does the rest.
    fn driver_value(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
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

/// Takes fencelock's own query parameters (`mode`, `pool`, `prepare`) out of a PostgreSQL URL and leaves
/// the rest for the driver, which checks it when the engine connects.
pub(crate) fn parse(scheme: &str, rest: &str) -> Result<PostgresUrl> {
    let (base, query) = match rest.split_once('?') {
        Some((b, q)) => (b, q),
        None => (rest, ""),
    };
    let mut mode = PgMode::Advisory;
    let mut pool = DEFAULT_POOL;
    let mut prepare = None;
    let mut tls = PgTls {
        mode: SslMode::Prefer,
        root_cert: None,
        cert: None,
        key: None,
    };
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
            "prepare" => {
                prepare = Some(match v {
                    "true" => true,
                    "false" => false,
                    other => {
                        return Err(Error::invalid(format!(
                            "prepare {other:?} in the backend URL is not one of true, false"
                        )))
                    }
                })
            }
            "sslmode" => tls.mode = SslMode::parse(v)?,
            "sslrootcert" | "sslcert" | "sslkey" => {
                if v.is_empty() {
                    return Err(Error::invalid(format!(
                        "{k} in the backend URL needs a file path"
                    )));
                }
                let path = Some(PathBuf::from(decode(v, "TLS file path")?));
                match k {
                    "sslrootcert" => tls.root_cert = path,
                    "sslcert" => tls.cert = path,
                    _ => tls.key = path,
                }
            }
            _ => kept.push(pair),
        }
    }
    let prepare =
        match (mode, prepare) {
            (PgMode::Advisory, Some(false)) => return Err(Error::invalid(
                "prepare=false in the backend URL applies to the lease table (mode=lease), for \
                 transaction poolers; advisory mode holds session locks, which need a session of \
                 their own, and always prepares its statements",
            )),
            (PgMode::Advisory, _) => true,
            (PgMode::Lease, p) => p.unwrap_or(false),
        };
    if tls.cert.is_some() != tls.key.is_some() {
        return Err(Error::invalid(
            "a client certificate needs its key and a key its certificate: give both sslcert \
             and sslkey",
        ));
    }
    let sslmode = format!("sslmode={}", tls.mode.driver_value());
    kept.push(&sslmode);
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
    Ok(PostgresUrl {
        url,
        mode,
        pool,
        prepare,
        tls,
    })
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
                prepare: false,
                tls: PgTls {
                    mode: SslMode::Disable,
                    root_cert: None,
                    cert: None,
                    key: None
                },
            })
        );
        assert_eq!(
            parse("postgresql", "h/db").ok(),
            Some(PostgresUrl {
                url: "postgresql://h/db?sslmode=prefer".into(),
                mode: PgMode::Advisory,
                pool: DEFAULT_POOL,
                prepare: true,
                tls: PgTls {
                    mode: SslMode::Prefer,
                    root_cert: None,
                    cert: None,
                    key: None
                },
            })
        );
        let Ok(u) = parse(
            "postgres",
            "h/db?sslmode=verify-full&sslrootcert=/r%20c.pem&sslcert=/c&sslkey=/k&connect_timeout=3",
        ) else {
            unreachable!("parse failed")
        };
        assert_eq!(u.url, "postgres://h/db?connect_timeout=3&sslmode=require");
        assert_eq!(u.tls.mode, SslMode::VerifyFull);
        assert_eq!(u.tls.root_cert, Some("/r c.pem".into()));
        assert!(u.prepare, "advisory mode always prepares");
    }

    #[test]
    fn prepare_is_a_lease_table_option_the_driver_never_sees() {
        let lease = |q: &str| parse("postgres", &format!("h/db?mode=lease{q}"));
        assert_eq!(lease("").map(|u| u.prepare).ok(), Some(false));
        assert_eq!(lease("&prepare=false").map(|u| u.prepare).ok(), Some(false));
        let Ok(u) = lease("&prepare=true&connect_timeout=3") else {
            unreachable!("parse failed")
        };
        assert!(u.prepare);
        assert_eq!(u.url, "postgres://h/db?connect_timeout=3&sslmode=prefer");
        assert_eq!(
            parse("postgres", "h/db?prepare=true")
                .map(|u| u.prepare)
                .ok(),
            Some(true)
        );
        for (rest, says) in [
            ("h/db?mode=lease&prepare=1", "not one of true, false"),
            ("h/db?mode=lease&prepare=TRUE", "not one of true, false"),
            ("h/db?prepare=false", "applies to the lease table"),
        ] {
            let e = parse("postgres", rest).expect_err(rest);
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{rest}");
            assert!(e.to_string().contains(says), "{rest}: {e}");
        }
        for rest in [
            "h/db?mode=x",
            "h/db?pool=1",
            "h/db?pool=11",
            "",
            "h/db?sslmode=allow",
            "h/db?sslcert=/c",
            "h/db?sslrootcert=",
            "h/db?mode=lease&prepare=yes",
            "h/db?prepare=",
            "h/db?prepare=false",
        ] {
            let e = parse("postgres", rest).expect_err(rest);
            assert_eq!(e.kind(), crate::ErrorKind::InvalidInput, "{rest}");
        }
    }
}
