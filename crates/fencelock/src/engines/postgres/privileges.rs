//! What a PostgreSQL role needs to use fencelock: the objects the engine creates on first use,
//! and the privileges each mode's operations need on them. `fencelock doctor` checks them
//! against the server; the advisory-lock functions need no grant.

use super::url::PgMode;

/// The tables, indexes and sequence the engine creates on first use (both modes create all
/// of them), unqualified: they live in the first schema of the role's `search_path`. When
/// every one exists, opening the engine needs no `CREATE` privilege on that schema.
pub const PG_OBJECTS: &[&str] = &[
    "fencelock_tokens",
    "fencelock_tokens_by_lock_key",
    "fencelock_leases",
    "fencelock_audit",
    "fencelock_audit_id_seq",
    "fencelock_audit_by_key",
    "fencelock_limits",
];

/// One privilege a mode needs on one of [`PG_OBJECTS`], and what for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PgPrivilege {
    /// The table or sequence.
    pub object: &'static str,
    /// `table` or `sequence`.
    pub kind: &'static str,
    /// `SELECT`, `INSERT`, `UPDATE` or `USAGE`.
    pub privilege: &'static str,
    /// The operations that need it, as a user would name them.
    pub needed_for: &'static str,
}

const fn p(
    object: &'static str,
    kind: &'static str,
    privilege: &'static str,
    needed_for: &'static str,
) -> PgPrivilege {
    PgPrivilege {
        object,
        kind,
        privilege,
        needed_for,
    }
}

/// Forced releases, the audit log and the stored limits, alike in both modes.
const AUDIT: [PgPrivilege; 4] = [
    p("fencelock_audit", "table", "SELECT", "audit"),
    p("fencelock_audit", "table", "INSERT", "release --force"),
    p(
        "fencelock_audit_id_seq",
        "sequence",
        "USAGE",
        "release --force",
    ),
    p(
        "fencelock_limits",
        "table",
        "SELECT",
        "acquire, extend, limits show",
    ),
];

const ADVISORY: [PgPrivilege; 7] = [
    p(
        "fencelock_tokens",
        "table",
        "SELECT",
        "acquire, inspect, list",
    ),
    p("fencelock_tokens", "table", "INSERT", "acquire"),
    p(
        "fencelock_tokens",
        "table",
        "UPDATE",
        "acquire, release --force",
    ),
    AUDIT[0],
    AUDIT[1],
    AUDIT[2],
    AUDIT[3],
];

const LEASE: [PgPrivilege; 7] = [
    p(
        "fencelock_leases",
        "table",
        "SELECT",
        "acquire, extend, release, inspect, list",
    ),
    p("fencelock_leases", "table", "INSERT", "acquire"),
    p(
        "fencelock_leases",
        "table",
        "UPDATE",
        "acquire, extend, release, release --force",
    ),
    AUDIT[0],
    AUDIT[1],
    AUDIT[2],
    AUDIT[3],
];

impl PgMode {
    /// The privileges this mode's operations need (no operation deletes rows). Advisory
    /// mode's forced release also needs the right to end the holder's session (superuser,
    /// the same role, or `pg_signal_backend`), which is no grant on an object.
    pub fn privileges(self) -> &'static [PgPrivilege] {
        match self {
            PgMode::Advisory => &ADVISORY,
            PgMode::Lease => &LEASE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_privilege_is_on_an_object_the_engine_creates() {
        for mode in [PgMode::Advisory, PgMode::Lease] {
            for p in mode.privileges() {
                assert!(PG_OBJECTS.contains(&p.object), "{p:?}");
                assert!(super::super::SCHEMA.contains(p.object.trim_end_matches("_id_seq")));
            }
        }
    }
}
