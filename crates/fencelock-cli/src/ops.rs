//! The stuck-lock runbook on the command line: `inspect`, `list`, `release --force`, `audit`.
//!
//! Text output is for people; `--json` output is for scripts and keeps its field names.
//! Times are RFC 3339 in UTC, durations in milliseconds (`*_ms`).

use std::time::{Duration, SystemTime};

use anyhow::Result;
use clap::Args;
use fencelock::{AuditRecord, ForceRelease, HeldLock, Holder};

use crate::{connect, fail, BackendArg};

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Resource name.
    name: String,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
    /// Only locks whose name starts with this (a plain string, not a pattern).
    #[arg(id = "name_prefix", value_name = "PREFIX", default_value = "")]
    name_prefix: String,
}

#[derive(Args, Debug)]
#[command(
    after_help = "Refused (exit 75) while the holder looks alive: its process still \
    exists on this host (same host name), or it is gone but work it supervised under the lease \
    still runs here (the supervisor or command of a killed `fencelock run`), or, for a holder \
    on another host, its last renewal is not yet overdue (TTL/3 plus half of that, at least \
    1 s more). A holder whose process and supervised work are gone from this host counts as \
    dead. --holder-is-dead overrides the check. Exit 0 when released or already free."
)]
pub struct ReleaseArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Delete the lock whatever its owner. Required: a holder releases its own lock (fencelock
    /// run does when its command exits).
    #[arg(long, required = true)]
    force: bool,
    /// Why, for the audit log.
    #[arg(long, required = true)]
    reason: String,
    /// Release even if the holder looks alive: you have made sure it is dead.
    #[arg(long)]
    holder_is_dead: bool,
    /// Print the audit record as JSON.
    #[arg(long)]
    json: bool,
    /// Resource name.
    name: String,
}

#[derive(Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Print a JSON array instead of text.
    #[arg(long)]
    json: bool,
    /// Only the forced releases of this resource.
    name: Option<String>,
}

pub async fn inspect(args: InspectArgs) -> Result<u8> {
    fencelock::validate_name(&args.name).map_err(fail)?;
    let client = connect(&args.backend, "fencelock-inspect").await?;
    let holder = client.inspect(&args.name).await.map_err(fail)?;
    let on = client.backend_for(&args.name).await.map_err(fail)?;
    let (engine, backend) = (on.engine(), on.backend());
    match (holder, args.json) {
        (Some(h), true) => outln!("{}", held_json(&args.name, engine, backend, &h)),
        (None, true) => outln!(
            "{}",
            object(&[
                ("resource", Json::Str(&args.name)),
                ("engine", Json::Str(engine)),
                ("backend", Json::Str(backend)),
                ("held", Json::Bool(false)),
            ])
        ),
        (Some(h), false) => out!("{}", held_text(&args.name, &h)),
        (None, false) => outln!("{}: free", args.name),
    }
    Ok(0)
}

pub async fn list(args: ListArgs) -> Result<u8> {
    let client = connect(&args.backend, "fencelock-list").await?;
    let listing = client
        .list_partial(&args.name_prefix, None)
        .await
        .map_err(fail)?;
    let listing = answered(listing)?;
    let locks = &listing.found;
    if args.json {
        let engines = client.backends();
        let items: Vec<String> = locks
            .iter()
            .map(|l| {
                let on = engines.iter().find(|(n, _)| *n == l.backend);
                let engine = on.map_or(client.engine(), |(_, e)| e);
                held_json(&l.resource, engine, &l.backend, &l.holder)
            })
            .collect();
        outln!("[{}]", items.join(","));
    } else if locks.is_empty() {
        let under = if args.name_prefix.is_empty() {
            String::new()
        } else {
            format!(" starting with {:?}", args.name_prefix)
        };
        let on = if listing.is_complete() {
            String::new()
        } else {
            format!(" on {}", listing.answered.join(", "))
        };
        outln!("no held locks{under}{on}");
    } else {
        out!("{}", table(locks));
    }
    Ok(partial_exit(&listing, "locks"))
}

/// `listing`, unless no backend answered: then the failure, as the exit of a client on one
/// backend would be.
fn answered<T>(listing: fencelock::Partial<T>) -> Result<fencelock::Partial<T>> {
    if listing.answered.is_empty() && !listing.is_complete() {
        return Err(listing
            .complete()
            .err()
            .map_or_else(|| anyhow::anyhow!("no backend answered"), fail));
    }
    Ok(listing)
}

/// Names each backend that failed on stderr, after what the others answered was printed:
/// exit 80 then, 0 when every backend answered.
fn partial_exit<T>(listing: &fencelock::Partial<T>, what: &str) -> u8 {
    if listing.is_complete() {
        return 0;
    }
    for f in &listing.failed {
        eprintln!("fencelock: {}", f.error);
    }
    let failed: Vec<&str> = listing.failed.iter().map(|f| f.backend.as_str()).collect();
    eprintln!(
        "fencelock: partial answer: the {what} of backend(s) {} are not shown; {} answered",
        failed.join(", "),
        listing.answered.join(", ")
    );
    crate::exit::PARTIAL
}

pub async fn release(args: ReleaseArgs) -> Result<u8> {
    fencelock::validate_name(&args.name).map_err(fail)?;
    let client = connect(&args.backend, "fencelock-release").await?;
    let request = ForceRelease::new(&args.reason).holder_is_dead(args.holder_is_dead);
    match client
        .force_release(&args.name, &request)
        .await
        .map_err(fail)?
    {
        Some(r) if args.json => {
            let nodes: Vec<String> = r
                .not_released_on
                .iter()
                .map(|n| crate::json::string(n))
                .collect();
            let record = record_json(&r);
            let ended: Vec<String> = r.ended_with.iter().map(record_json).collect();
            // The record's object, with the nodes that did not release it (Redlock) and the
            // leases that ended with the holder's session (PostgreSQL advisory locks).
            let body = record.strip_suffix('}').unwrap_or(&record);
            outln!(
                "{body},\"not_released_on\":[{}],\"ended_with\":[{}]}}",
                nodes.join(","),
                ended.join(",")
            );
        }
        Some(r) => {
            outln!(
                "{}: force-released from {}; fencing counter now {}, so the old token is \
                 stale; recorded in the audit log",
                shown(&r.resource),
                r.holder,
                r.counter
            );
            if !r.not_released_on.is_empty() {
                eprintln!(
                    "fencelock: {}: released and recorded on a majority of the nodes, so the \
                     lock is free; NOT released nor recorded on {} node(s), where the old \
                     holder's key stays until its TTL ends:",
                    shown(&r.resource),
                    r.not_released_on.len()
                );
                for n in &r.not_released_on {
                    eprintln!("  {}", shown(n));
                }
            }
            if !r.ended_with.is_empty() {
                outln!(
                    "{}: the lock lived in another process's PostgreSQL session, which had to \
                     end; {} more lease(s) ended with it, each recorded in the audit log:",
                    shown(&r.resource),
                    r.ended_with.len()
                );
                for e in &r.ended_with {
                    outln!(
                        "  {}: {}; fencing counter now {}",
                        shown(&e.resource),
                        e.holder,
                        e.counter
                    );
                }
            }
        }
        None if args.json => outln!(
            "{}",
            object(&[
                ("resource", Json::Str(&args.name)),
                ("held", Json::Bool(false)),
                ("released", Json::Bool(false)),
            ])
        ),
        None => outln!("{}: free; nothing to release", args.name),
    }
    Ok(0)
}

pub async fn audit(args: AuditArgs) -> Result<u8> {
    if let Some(name) = &args.name {
        fencelock::validate_name(name).map_err(fail)?;
    }
    let client = connect(&args.backend, "fencelock-audit").await?;
    let listing = client
        .audit_partial(args.name.as_deref(), None)
        .await
        .map_err(fail)?;
    let listing = answered(listing)?;
    let records = &listing.found;
    if args.json {
        let items: Vec<String> = records.iter().map(record_json).collect();
        outln!("[{}]", items.join(","));
    } else if records.is_empty() {
        if listing.is_complete() {
            outln!("no forced releases recorded");
        } else {
            outln!(
                "no forced releases recorded on {}",
                listing.answered.join(", ")
            );
        }
    } else {
        for r in records {
            out!("{}", record_text(r));
        }
    }
    Ok(partial_exit(&listing, "audit records"))
}

fn ago(t: SystemTime) -> String {
    match SystemTime::now().duration_since(t) {
        Ok(d) => format!("{} ago", crate::human_duration(round_ms(d))),
        Err(_) => "in the future (clock skew)".to_owned(),
    }
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn when(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

fn optional<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| shown(&v.to_string()))
}

/// `s` with control characters written as `\u{..}`. Holder fields and audit records were
/// written by other clients, possibly not fencelock; a newline or a terminal escape in them
/// must not forge a line of this output or drive the terminal.
fn shown(s: &str) -> String {
    s.chars()
        .fold(String::with_capacity(s.len()), |mut out, c| {
            if c.is_control() {
                out.push_str(&format!("\\u{{{:x}}}", c as u32));
            } else {
                out.push(c);
            }
            out
        })
}

fn held_text(name: &str, h: &Holder) -> String {
    let a = h.assess();
    let mut out = format!("{name}: held by {h} (owner {})\n", shown(&h.owner));
    let mut line = |label: &str, value: String| out.push_str(&format!("  {label:<13} {value}\n"));
    line("owner", shown(&h.owner));
    line("token", optional(h.token));
    line("host", optional(h.host.as_deref()));
    line("pid", optional(h.pid));
    line("client", optional(h.client.as_deref()));
    line(
        "acquired",
        h.acquired_at
            .map_or_else(|| "-".to_owned(), |t| format!("{} ({})", when(t), ago(t))),
    );
    line(
        "last renewal",
        a.since_renewal.map_or_else(
            || "-".to_owned(),
            |d| format!("{} ago", crate::human_duration(round_ms(d))),
        ),
    );
    line(
        "ttl left",
        match (h.ttl_left, h.ttl) {
            (Some(left), Some(ttl)) => format!(
                "{} of {}",
                crate::human_duration(round_ms(left)),
                crate::human_duration(ttl)
            ),
            (Some(left), None) => crate::human_duration(round_ms(left)),
            _ => "-".to_owned(),
        },
    );
    line("verdict", format!("{}: {}", a.verdict, shown(&a.reason)));
    out
}

fn table(locks: &[HeldLock]) -> String {
    let header = [
        "RESOURCE", "BACKEND", "TOKEN", "HOST", "PID", "CLIENT", "TTL LEFT", "RENEWED", "VERDICT",
    ];
    let rows: Vec<[String; 9]> = locks
        .iter()
        .map(|l| {
            let h = &l.holder;
            let a = h.assess();
            [
                shown(&l.resource),
                shown(&l.backend),
                optional(h.token),
                optional(h.host.as_deref()),
                optional(h.pid),
                optional(h.client.as_deref()),
                h.ttl_left
                    .map_or_else(|| "-".into(), |d| crate::human_duration(round_ms(d))),
                a.since_renewal.map_or_else(
                    || "-".into(),
                    |d| format!("{} ago", crate::human_duration(round_ms(d))),
                ),
                a.verdict.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut push_row = |cells: &[&str]| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(padded.join("  ").trim_end());
        out.push('\n');
    };
    push_row(&header);
    for row in &rows {
        push_row(&row.each_ref().map(String::as_str));
    }
    out
}

fn record_text(r: &AuditRecord) -> String {
    let h = &r.holder;
    format!(
        "{} {}: forced by {}@{}: {}\n  old holder: {} (owner {})\n  fencing counter now {}; \
         holder declared dead: {}; found: {}\n",
        when(r.at),
        shown(&r.resource),
        shown(&r.user),
        shown(&r.host),
        shown(&r.reason),
        h,
        shown(&h.owner),
        r.counter,
        if r.holder_declared_dead { "yes" } else { "no" },
        shown(&r.assessment)
    )
}

/// A JSON value, written by hand: the CLI prints a handful of flat objects and a JSON library
/// would be its only use of serialisation.
enum Json<'a> {
    Str(&'a str),
    OwnedStr(String),
    Num(u64),
    Bool(bool),
    Null,
    Raw(String),
}

fn object(fields: &[(&str, Json<'_>)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| {
            let v = match v {
                Json::Str(s) => crate::json::string(s),
                Json::OwnedStr(s) => crate::json::string(s),
                Json::Num(n) => n.to_string(),
                Json::Bool(b) => b.to_string(),
                Json::Null => "null".to_owned(),
                Json::Raw(r) => r.clone(),
            };
            format!("{}:{v}", crate::json::string(k))
        })
        .collect();
    format!("{{{}}}", body.join(","))
}

fn ms(d: Option<Duration>) -> Json<'static> {
    d.map_or(Json::Null, |d| {
        Json::Num(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    })
}

fn opt_str(s: Option<&str>) -> Json<'_> {
    s.map_or(Json::Null, Json::Str)
}

fn opt_time(t: Option<SystemTime>) -> Json<'static> {
    t.map_or(Json::Null, |t| Json::OwnedStr(when(t)))
}

fn holder_fields(h: &Holder) -> Vec<(&'static str, Json<'_>)> {
    vec![
        ("owner", Json::Str(&h.owner)),
        ("token", h.token.map_or(Json::Null, |t| Json::Num(t.get()))),
        ("host", opt_str(h.host.as_deref())),
        ("pid", h.pid.map_or(Json::Null, |p| Json::Num(u64::from(p)))),
        ("client", opt_str(h.client.as_deref())),
        ("acquired_at", opt_time(h.acquired_at)),
        ("renewed_at", opt_time(h.renewed_at)),
        ("ttl_ms", ms(h.ttl)),
    ]
}

fn held_json(name: &str, engine: &str, backend: &str, h: &Holder) -> String {
    let a = h.assess();
    let mut fields = vec![
        ("resource", Json::Str(name)),
        ("engine", Json::Str(engine)),
        ("backend", Json::Str(backend)),
        ("held", Json::Bool(true)),
    ];
    fields.extend(holder_fields(h));
    fields.extend([
        ("ttl_left_ms", ms(h.ttl_left)),
        ("since_renewal_ms", ms(a.since_renewal)),
        ("overdue_after_ms", ms(a.overdue_after)),
        ("verdict", Json::Str(a.verdict.as_str())),
        (
            "process",
            Json::Str(match a.process {
                fencelock::ProcessState::Running => "running",
                fencelock::ProcessState::Gone => "gone",
                _ => "not-checked",
            }),
        ),
        (
            "supervised",
            Json::Raw(format!(
                "[{}]",
                a.supervised
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )),
        ),
        ("looks_alive", Json::Bool(a.looks_alive)),
        ("reason", Json::OwnedStr(a.reason.clone())),
    ]);
    object(&fields)
}

fn record_json(r: &AuditRecord) -> String {
    object(&[
        ("id", Json::Str(&r.id)),
        ("resource", Json::Str(&r.resource)),
        ("at", Json::OwnedStr(when(r.at))),
        ("user", Json::Str(&r.user)),
        ("host", Json::Str(&r.host)),
        ("reason", Json::Str(&r.reason)),
        ("holder_declared_dead", Json::Bool(r.holder_declared_dead)),
        ("assessment", Json::Str(&r.assessment)),
        ("holder", Json::Raw(object(&holder_fields(&r.holder)))),
        ("counter", Json::Num(r.counter.get())),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_output_escapes_what_other_clients_wrote() {
        assert_eq!(shown("a\nb\u{1b}[2J"), "a\\u{a}b\\u{1b}[2J");
        assert_eq!(optional(Some("x\ry")), "x\\u{d}y");
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(
            crate::json::string("a\"b\\c\n\u{1}é"),
            r#""a\"b\\c\n\u0001é""#
        );
        assert_eq!(
            object(&[
                ("k", Json::Num(3)),
                ("n", Json::Null),
                ("b", Json::Bool(true))
            ]),
            r#"{"k":3,"n":null,"b":true}"#
        );
    }
}
