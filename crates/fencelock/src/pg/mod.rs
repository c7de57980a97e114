//! The lock-free alternatives PostgreSQL offers, for when the best lock is no lock.
//!
//! A distributed lock is often a stand-in for something the database can do by itself, inside
//! the transaction that does the work, with nothing to renew and nothing to lose:
//!
//! - [`JobQueue`]: workers claim jobs from a table with `FOR UPDATE SKIP LOCKED`, so two
//!   workers never get the same job, and a job whose worker died becomes claimable again after
//!   its visibility timeout. Use it instead of "lock the queue, take a job, unlock".
//! - [`VersionedTable`]: optimistic concurrency: read a row and its version, write
//!   `... WHERE version = $v`, and retry from a fresh read when another writer got there
//!   first. Use it instead of "lock the record, read, modify, write, unlock".
//! - [`Idempotency`]: a unique constraint on an idempotency key decides which caller runs a
//!   side effect; every other caller with the same key gets the first caller's result. Use it
//!   instead of "lock the request id, check whether it ran, run it, unlock".
//!
//! Each works on the caller's own [`tokio_postgres::Client`] and creates its table with
//! `install` (idempotent). Table names are plain identifiers (`jobs`, `app.jobs`), checked
//! before any I/O. Runnable examples: `examples/pg_jobs.rs`, `examples/pg_optimistic.rs`,
//! `examples/pg_idempotency.rs` (they read `DATABASE_URL`).

mod idempotency;
mod jobs;
mod optimistic;

pub use idempotency::{Idempotency, Outcome};
pub use jobs::{Job, JobQueue};
pub use optimistic::{Versioned, VersionedTable};

use crate::core::error::{Error, Result};

const ENGINE: &str = "postgres";

/// A table name as SQL: each dot-separated part `[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes,
/// double-quoted so that case and reserved words are kept.
pub(crate) fn table_ident(name: &str) -> Result<String> {
    let parts: Vec<&str> = name.split('.').collect();
    let valid = |p: &&str| {
        !p.is_empty()
            && p.len() <= 63
            && p.chars()
                .enumerate()
                .all(|(i, c)| c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit()))
    };
    if parts.len() > 2 || !parts.iter().all(valid) {
        return Err(Error::invalid(format!(
            "table name {name:?} is not a plain identifier (letters, digits, underscores; \
             optionally schema.table)"
        )));
    }
    Ok(parts
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join("."))
}

/// The index name derived from a table name, unquoted parts joined by underscores.
pub(crate) fn index_name(name: &str, suffix: &str) -> String {
    let flat = name.replace('.', "_");
    let mut idx = format!("{flat}_{suffix}");
    idx.truncate(63);
    format!("\"{idx}\"")
}

pub(crate) fn pg_error(what: &str, e: tokio_postgres::Error) -> Error {
    Error::engine_failure(ENGINE, format!("{what}: {e}")).with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_checked_and_quoted() {
        assert_eq!(table_ident("jobs").unwrap(), "\"jobs\"");
        assert_eq!(table_ident("app.Jobs_2").unwrap(), "\"app\".\"Jobs_2\"");
        for bad in ["", "1jobs", "jobs; DROP TABLE x", "a.b.c", "jo\"bs", "a..b"] {
            assert_eq!(
                table_ident(bad).unwrap_err().kind(),
                crate::ErrorKind::InvalidInput,
                "{bad}"
            );
        }
    }
}
