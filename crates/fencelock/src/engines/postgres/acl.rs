//! Least privilege on PostgreSQL: grants on fencelock's tables and row-level security on the
//! prefix.
//!
//! Every prefix shares the same tables (a row's `key` is the prefix and the name), so a table
//! grant alone would let one service's role write another's rows. Row-level security confines
//! each role to the rows whose key starts with its prefix. The advisory-lock functions and
//! `pg_notify` need no grant, and cannot be confined: any role can take any advisory lock (so
//! block another prefix's lock, never obtain its token) and send any notification (a spurious
//! wake-up). A forced release ends the holder's session with `pg_terminate_backend`, which a
//! role may do to sessions of its own role without further grant.

use super::{MIGRATIONS, SCHEMA};
use crate::core::access::{sql_literal, validate_user, AccessPlan, AccessStep, AccessUser};
use crate::core::error::Result;

/// fencelock's tables: what a read-write role may do on each, and whether its rows are keyed
/// by prefix and name (and so confined to the prefix by a policy).
const TABLES: &[(&str, &str)] = &[
    ("fencelock_tokens", "SELECT, INSERT, UPDATE"),
    ("fencelock_leases", "SELECT, INSERT, UPDATE"),
    // Append-only for a service: forced releases add records, nobody rewrites them.
    ("fencelock_audit", "SELECT, INSERT"),
];

/// Tables a service only reads, not keyed by name: the limits per prefix, which the operator
/// (the tables' owner) sets with `fencelock limits`, and every grant checks.
const READ_ONLY_TABLES: &[&str] = &["fencelock_limits"];

/// The sequence behind `fencelock_audit.id`, which an insert advances.
const SEQUENCES: &[&str] = &["fencelock_audit_id_seq"];

fn ident(name: &str) -> String {
    format!("\"{name}\"")
}

/// The statements that create the tables (as their owner), a read-write role `user` and a
/// read-only role `read_only` confined to `prefix`.
pub(crate) fn plan(prefix: &str, user: &str, read_only: &str) -> Result<AccessPlan> {
    validate_user(user)?;
    validate_user(read_only)?;
    let tables = TABLES
        .iter()
        .map(|(t, _)| *t)
        .collect::<Vec<_>>()
        .join(", ");
    let under = format!("starts_with(key, {})", sql_literal(prefix));
    let mut owner_steps: Vec<AccessStep> = SCHEMA
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| AccessStep::sql(format!("{s};")))
        .collect();
    // One statement (a DO block with semicolons of its own): the quota functions and columns.
    owner_steps.push(AccessStep::sql(MIGRATIONS.trim().to_owned()));
    owner_steps.extend(
        TABLES
            .iter()
            .map(|(t, _)| AccessStep::sql(format!("ALTER TABLE {t} ENABLE ROW LEVEL SECURITY;"))),
    );
    let role = |name: &str, read_only: bool| {
        let r = ident(name);
        let mut steps = vec![
            AccessStep::sql(format!("CREATE ROLE {r} LOGIN;")),
            // psql asks for the password and sends only its hash.
            AccessStep::sql(format!("\\password {r}")),
        ];
        for t in READ_ONLY_TABLES {
            steps.push(AccessStep::sql(format!("GRANT SELECT ON {t} TO {r};")));
        }
        if read_only {
            steps.push(AccessStep::sql(format!("GRANT SELECT ON {tables} TO {r};")));
        } else {
            for (t, privileges) in TABLES {
                steps.push(AccessStep::sql(format!(
                    "GRANT {privileges} ON {t} TO {r};"
                )));
            }
            for s in SEQUENCES {
                steps.push(AccessStep::sql(format!(
                    "GRANT USAGE ON SEQUENCE {s} TO {r};"
                )));
            }
        }
        let (command, check) = if read_only {
            ("SELECT", String::new())
        } else {
            ("ALL", format!(" WITH CHECK ({under})"))
        };
        for (t, _) in TABLES {
            steps.push(AccessStep::sql(format!(
                "CREATE POLICY {r} ON {t} FOR {command} TO {r} USING ({under}){check};"
            )));
        }
        AccessUser {
            name: name.to_owned(),
            read_only,
            steps,
        }
    };
    Ok(AccessPlan {
        engine: "postgres",
        runs_in: "psql",
        setup: owner_steps,
        users: vec![role(user, false), role(read_only, true)],
        notes: vec![
            "run the statements in psql, connected to the lock database as the role that owns \
             fencelock's tables (or will: the first statements create them, so the service \
             roles need no CREATE privilege)"
                .into(),
            "\\password asks for the new role's password and sends only its hash; add a \
             pg_hba.conf line for the role if it needs one"
                .into(),
            "row-level security hides the rows from every role without a policy of its own \
             (the tables' owner and superusers excepted): run fencelock acl for every \
             service's role that uses these tables"
                .into(),
            "advisory locks and notifications cannot be confined: any role can take any \
             advisory lock, blocking (never obtaining) another prefix's lock"
                .into(),
            "a forced release ends the holder's session, which a role may do only to its own \
             sessions (or with pg_signal_backend)"
                .into(),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table added to the schema without a decision about its grants fails here, naming it.
    #[test]
    fn every_table_of_the_schema_has_its_grants() {
        for stmt in SCHEMA.split(';') {
            if let Some(rest) = stmt.trim().strip_prefix("CREATE TABLE IF NOT EXISTS ") {
                let table = rest.split_whitespace().next().unwrap_or_default();
                assert!(
                    TABLES.iter().any(|(t, _)| *t == table) || READ_ONLY_TABLES.contains(&table),
                    "{table} has no entry in TABLES of postgres/acl.rs"
                );
            }
        }
    }

    #[test]
    fn policies_confine_both_roles_to_the_prefix() {
        let p = plan("svc:", "svc", "svc-ro").unwrap();
        assert!(p.setup[0]
            .line
            .starts_with("CREATE TABLE IF NOT EXISTS fencelock_tokens"));
        let rw: Vec<&str> = p.users[0].steps.iter().map(|s| s.line.as_str()).collect();
        assert!(rw.contains(
            &"CREATE POLICY \"svc\" ON fencelock_tokens FOR ALL TO \"svc\" USING \
              (starts_with(key, 'svc:')) WITH CHECK (starts_with(key, 'svc:'));"
        ));
        assert!(rw
            .iter()
            .all(|l| !l.contains("DELETE") && !l.contains("SUPERUSER")));
        let ro: Vec<&str> = p.users[1].steps.iter().map(|s| s.line.as_str()).collect();
        assert!(ro.contains(
            &"GRANT SELECT ON fencelock_tokens, fencelock_leases, fencelock_audit TO \"svc-ro\";"
        ));
        assert!(ro
            .iter()
            .all(|l| !l.contains("INSERT") && !l.contains("UPDATE")));
        let odd = plan("it's:", "svc", "svc-ro").unwrap();
        assert!(odd.users[0]
            .steps
            .iter()
            .any(|s| s.line.contains("'it''s:'")));
    }
}
