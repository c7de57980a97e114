//! PostgreSQL, both modes: reachability (with the server's own message when it refuses),
//! latency, version, the privileges the mode needs on fencelock's tables, and TLS.

use std::time::Instant;

use fencelock::{PgMode, PostgresUrl, SslMode};
use tokio_postgres::{Client, SimpleQueryMessage};

use super::{median, net, Finding, Findings, ANSWER_WITHIN};

pub(super) async fn postgres(url: &PostgresUrl, f: &mut Findings) -> anyhow::Result<()> {
    outln!("server");
    let started = Instant::now();
    let client = match url.connect(ANSWER_WITHIN).await {
        Ok(c) => c,
        // A TLS file that cannot be read is the URL's fault, not the server's: exit 64.
        Err(e) if e.kind() == fencelock::ErrorKind::InvalidInput => return Err(crate::fail(e)),
        Err(e) => {
            f.unreachable_node(&format!("unreachable: {e}"));
            return Ok(());
        }
    };
    let connected = started.elapsed();
    match check(url, &client, connected).await {
        Ok(findings) => f.add_all(findings),
        Err(e) => f.unreachable_node(&format!("the server stopped answering: {e}")),
    }
    Ok(())
}

/// One row of a simple query, as text (`None` for NULL); the simple protocol passes through
/// transaction poolers, where the lease-table mode may be reached.
async fn row(client: &Client, sql: &str) -> Result<Vec<Option<String>>, String> {
    let messages = tokio::time::timeout(ANSWER_WITHIN, client.simple_query(sql))
        .await
        .map_err(|_| "no answer within 5s".to_owned())?
        .map_err(|e| match e.as_db_error() {
            Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
            None => e.to_string(),
        })?;
    messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .ok_or_else(|| format!("no row from {sql}"))
}

async fn check(
    url: &PostgresUrl,
    client: &Client,
    connected: std::time::Duration,
) -> Result<Vec<Finding>, String> {
    let mut out = Vec::new();
    let mut rtts = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        row(client, "SELECT 1").await?;
        rtts.push(t.elapsed());
    }
    let info = row(
        client,
        "SELECT current_setting('server_version'), current_user, current_database(), \
         current_schema(), host(inet_server_addr()), \
         (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), \
         pg_has_role(current_user, 'pg_signal_backend', 'MEMBER')",
    )
    .await?;
    let text = |i: usize| info.get(i).cloned().flatten();
    let (version, user, database) = (
        text(0).unwrap_or_default(),
        text(1).unwrap_or_default(),
        text(2).unwrap_or_default(),
    );
    out.push(Finding::Ok(format!(
        "reachable, PostgreSQL {version}, connected in {}, round trip p50 {}",
        crate::human_duration(connected),
        crate::human_duration(median(rtts))
    )));
    out.push(Finding::Note(format!(
        "role {user}, database {database}, mode {}",
        match url.mode {
            PgMode::Advisory => "advisory",
            _ => "lease",
        }
    )));
    let schema = text(3);
    out.extend(privileges(client, url.mode, &user, schema.as_deref()).await?);
    if url.mode == PgMode::Advisory
        && text(5).as_deref() != Some("t")
        && text(6).as_deref() != Some("t")
    {
        out.push(Finding::Note(format!(
            "release --force ends the holder's session: as {user} (no superuser, not in \
             pg_signal_backend) it can end only sessions of {user}"
        )));
    }
    let ssl = row(
        client,
        "SELECT ssl, version, cipher FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await?;
    out.extend(transport(url, text(4).as_deref(), &ssl).await);
    Ok(out)
}

/// The privileges the mode needs, each checked on the server (`has_table_privilege`,
/// `has_sequence_privilege`), and whether the tables that do not exist yet can be created.
async fn privileges(
    client: &Client,
    mode: PgMode,
    user: &str,
    schema: Option<&str>,
) -> Result<Vec<Finding>, String> {
    let mut out = Vec::new();
    let exists_sql = fencelock::PG_OBJECTS
        .iter()
        .map(|o| format!("to_regclass('{o}') IS NOT NULL"))
        .collect::<Vec<_>>()
        .join(", ");
    let exists = row(client, &format!("SELECT {exists_sql}")).await?;
    let missing: Vec<&str> = fencelock::PG_OBJECTS
        .iter()
        .zip(&exists)
        .filter(|(_, e)| e.as_deref() != Some("t"))
        .map(|(o, _)| *o)
        .collect();
    let schema_name = schema.unwrap_or("(none)");
    if missing.is_empty() {
        out.push(Finding::Ok(format!(
            "fencelock's tables exist (schema {schema_name})"
        )));
    } else {
        let may_create = match schema {
            Some(s) => {
                row(
                    client,
                    &format!("SELECT has_schema_privilege({}, 'CREATE')", literal(s)),
                )
                .await?
                .first()
                .cloned()
                .flatten()
                    == Some("t".into())
            }
            None => false,
        };
        let list = missing.join(", ");
        out.push(if may_create {
            Finding::Ok(format!(
                "not created yet: {list}; the first client creates them, as {user} may \
                 (CREATE on schema {schema_name})"
            ))
        } else if schema.is_none() {
            Finding::Warn(format!(
                "not created yet: {list}, and the search_path names no schema that exists to \
                 create them in: every client fails until they exist"
            ))
        } else {
            Finding::Warn(format!(
                "not created yet: {list}, and {user} may not create them (no CREATE on schema \
                 {schema_name}): every client fails until they exist; connect once as a role \
                 that may (their owner), or GRANT CREATE ON SCHEMA {schema_name} TO {user}"
            ))
        });
    }
    let needed: Vec<_> = mode
        .privileges()
        .iter()
        .filter(|p| !missing.contains(&p.object))
        .collect();
    if needed.is_empty() {
        return Ok(out);
    }
    let checks = needed
        .iter()
        .map(|p| {
            let function = if p.kind == "sequence" {
                "has_sequence_privilege"
            } else {
                "has_table_privilege"
            };
            format!("{function}('{}', '{}')", p.object, p.privilege)
        })
        .collect::<Vec<_>>()
        .join(", ");
    let granted = row(client, &format!("SELECT {checks}")).await?;
    let mut lacking = 0;
    for (p, g) in needed.iter().zip(&granted) {
        if g.as_deref() != Some("t") {
            lacking += 1;
            out.push(Finding::Warn(format!(
                "{user} lacks {} on {} {} (needed for {})",
                p.privilege, p.kind, p.object, p.needed_for
            )));
        }
    }
    if lacking == 0 {
        let list: Vec<String> = needed
            .iter()
            .map(|p| format!("{} on {}", p.privilege, p.object))
            .collect();
        out.push(Finding::Ok(format!(
            "{user} has every privilege this mode needs: {}",
            list.join(", ")
        )));
    }
    Ok(out)
}

/// A string as an SQL literal.
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// TLS as the session has it (`pg_stat_ssl`), how the certificate was verified (from
/// `sslmode`), and plaintext off this machine.
async fn transport(
    url: &PostgresUrl,
    server_addr: Option<&str>,
    ssl: &[Option<String>],
) -> Vec<Finding> {
    // NULL: a Unix-domain socket, which never leaves the machine.
    let loopback = match server_addr {
        None => true,
        Some(a) => net::all_loopback(&a.parse().map(|ip| vec![ip]).unwrap_or_default()),
    };
    let where_ = server_addr.unwrap_or("a Unix-domain socket");
    let on_tls = ssl.first().cloned().flatten().as_deref() == Some("t");
    if !on_tls {
        let why = if url.tls.mode == SslMode::Disable {
            "sslmode=disable".to_owned()
        } else {
            "the server declined TLS, and sslmode=prefer fell back to plaintext".to_owned()
        };
        return vec![match net::plaintext_warning(
            &format!("the server ({where_}, {why})"),
            loopback,
            "sslmode=verify-full with sslrootcert=PATH",
        ) {
            Some(w) => Finding::Warn(w),
            None => Finding::Ok(format!(
                "plaintext ({why}), on {where_}, a loopback address"
            )),
        }];
    }
    let version = ssl.get(1).cloned().flatten().unwrap_or_default();
    let cipher = ssl.get(2).cloned().flatten().unwrap_or_default();
    let roots = url
        .tls
        .root_cert
        .as_ref()
        .map(|p| format!("sslrootcert={}", p.display()))
        .unwrap_or_else(|| "the system's roots".into());
    let version = version.replace("TLSv", "TLS ");
    let verified = match url.tls.mode {
        SslMode::VerifyFull => Ok(format!(
            "server certificate verified: chain against {roots}, host name (sslmode=verify-full)"
        )),
        SslMode::VerifyCa => Ok(format!(
            "server certificate chain verified against {roots}; the host name is not checked \
             (sslmode=verify-full would)"
        )),
        _ if url.tls.root_cert.is_some() => Ok(format!(
            "server certificate chain verified against {roots}; the host name is not checked \
             (sslmode=verify-full would)"
        )),
        _ => Err(
            "server certificate NOT verified (sslmode=prefer or require without sslrootcert): \
             whoever sits on the path can pose as the server; use sslmode=verify-full with \
             sslrootcert=PATH"
                .to_owned(),
        ),
    };
    match verified {
        Ok(v) => vec![Finding::Ok(format!("{version} ({cipher}); {v}"))],
        Err(w) if loopback => vec![
            Finding::Ok(format!("{version} ({cipher})")),
            Finding::Note(format!("{w} (on loopback here)")),
        ],
        Err(w) => vec![
            Finding::Ok(format!("{version} ({cipher})")),
            Finding::Warn(w),
        ],
    }
}
