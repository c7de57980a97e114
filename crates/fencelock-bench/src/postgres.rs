//! The PostgreSQL reference of the bench: the server's own rate for the statements
//! one acquire+release pair sends, measured with `pgbench` and a custom script against the
//! same server in the same run, printed next to fencelock's figures as ratios.
//!
//! The script repeats the engine's statements (advisory mode: the grant with its counter
//! upsert, then the unlock with its notification; lease-table mode: the row upsert, then the
//! owner-checked release), in the protocol the engine uses (prepared statements for advisory
//! mode, unnamed ones for the lease table). Each pgbench client works on a key of its own, as
//! each fencelock task does. pgbench's transactions per second are therefore pairs per second
//! without fencelock's client-side work (validity, watchdog registration, session map).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::engine::PgTarget;
use crate::plumbing::{rate, Out, Stop};

const ADVISORY_SCRIPT: &str = "\
\\set k 8000000000 + :client_id
WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock(:k) AS ok), t AS (INSERT INTO fencelock_tokens AS t (key, lock_key, counter, owner, backend_pid, host, pid, client, acquired_at, ttl_ms) SELECT 'fencelock-bench-reference:' || :k, :k, 1, 'pgbench', pg_backend_pid(), 'localhost', 1, 'pgbench', 0, 30000 FROM l WHERE l.ok ON CONFLICT (key) DO UPDATE SET counter = t.counter + 1, owner = EXCLUDED.owner, backend_pid = EXCLUDED.backend_pid, host = EXCLUDED.host, pid = EXCLUDED.pid, client = EXCLUDED.client, acquired_at = EXCLUDED.acquired_at, ttl_ms = EXCLUDED.ttl_ms RETURNING counter) SELECT l.ok, (SELECT counter FROM t) FROM l;
WITH u AS MATERIALIZED (SELECT pg_advisory_unlock(:k) AS ok) SELECT u.ok, (SELECT count(*) FROM (SELECT pg_notify('fencelock_bench_reference', 'x') FROM u WHERE u.ok) n) FROM u;
";

const LEASE_SCRIPT: &str = "\
\\set k 8000000000 + :client_id
INSERT INTO fencelock_leases AS l (key, token, owner, expires_at, ttl_ms, host, pid, client, acquired_at, renewed_at) VALUES ('fencelock-bench-reference:' || :k, 1, 'pgbench', clock_timestamp() + 30000 * interval '1 millisecond', 30000, 'localhost', 1, 'pgbench', 0, 0) ON CONFLICT (key) DO UPDATE SET token = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > clock_timestamp() THEN l.token ELSE l.token + 1 END, acquired_at = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > clock_timestamp() THEN l.acquired_at ELSE EXCLUDED.acquired_at END, owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at, ttl_ms = EXCLUDED.ttl_ms, host = EXCLUDED.host, pid = EXCLUDED.pid, client = EXCLUDED.client, renewed_at = EXCLUDED.renewed_at WHERE l.owner IS NULL OR l.expires_at IS NULL OR l.expires_at <= clock_timestamp() OR l.owner = EXCLUDED.owner RETURNING token;
WITH old AS (SELECT expires_at > clock_timestamp() AS live FROM fencelock_leases WHERE key = 'fencelock-bench-reference:' || :k AND owner = 'pgbench' FOR UPDATE), u AS (UPDATE fencelock_leases SET owner = NULL, expires_at = NULL WHERE key = 'fencelock-bench-reference:' || :k AND owner = 'pgbench' RETURNING 1), n AS (SELECT pg_notify('fencelock_bench_reference', 'x') FROM old WHERE old.live) SELECT old.live, (SELECT count(*) FROM u), (SELECT count(*) FROM n) FROM old;
";

/// Measures the reference and prints it with the ratios to fencelock's uncontended figures,
/// which section 1 recorded in `out`.
pub(crate) async fn reference(target: &PgTarget, seconds: u64, out: &mut Out, stop: &Stop) {
    out.line(String::new());
    out.line("== 4. reference: pgbench, the same statements, same server, same run ==");
    if let Err(why) = measure(target, seconds, out, stop).await {
        out.line(format!("reference: unavailable ({why})"));
    }
}

async fn measure(
    target: &PgTarget,
    seconds: u64,
    out: &mut Out,
    stop: &Stop,
) -> Result<(), String> {
    let bin = pgbench()?;
    let (script, protocol) = if target.lease_table {
        (LEASE_SCRIPT, "extended")
    } else {
        (ADVISORY_SCRIPT, "prepared")
    };
    let path = std::env::temp_dir().join(format!(
        "fencelock-bench-{}-{:x}.sql",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::write(&path, script).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let version = tool_version(&bin).await;
    out.line(format!(
        "reference: {version}, -M {protocol}, one key per client, {seconds} s per run"
    ));
    out.text("reference.tool", &version);
    // The 64 tasks of section 1 share the client's lock sessions (the pool minus the listening
    // one): the fair comparison is pgbench with as many connections.
    let sessions = target.pool.saturating_sub(1).max(1);
    let mut runs = Vec::new();
    for clients in [1, sessions] {
        if stop.is_set() {
            break;
        }
        let tps = run(&bin, &target.url, &path, protocol, clients, seconds).await;
        runs.push((clients, tps));
    }
    let _ = std::fs::remove_file(&path);
    for (clients, tps) in &runs {
        match tps {
            Ok(tps) => {
                out.line(format!(
                    "  pgbench {clients:>2} client(s): {:>9} pairs/s",
                    rate(*tps)
                ));
                out.num(&format!("reference.pgbench.c{clients}.pairs_per_s"), *tps);
            }
            Err(e) => out.line(format!("  pgbench {clients:>2} client(s): failed: {e}")),
        }
    }
    let fencelock_seq = out.value("uncontended.sequential.ops_per_s");
    let fencelock_par = out.value("uncontended.tasks64.ops_per_s");
    let ratios = [
        (
            "sequential / pgbench 1 client",
            "sequential",
            fencelock_seq,
            runs.first(),
        ),
        (
            "64 tasks / pgbench, as many connections",
            "tasks64",
            fencelock_par,
            runs.get(1),
        ),
    ];
    for (what, key, mine, reference) in ratios {
        if let (Some(mine), Some((clients, Ok(tps)))) = (mine, reference) {
            let ratio = mine / tps;
            out.num(&format!("uncontended.{key}.pgbench_ratio"), ratio);
            out.line(format!(
                "  ratio   {what:<42} {ratio:>6.2}  ({} vs {} at {clients} connection(s))",
                rate(mine),
                rate(*tps)
            ));
        }
    }
    out.line(
        "reference rows: fencelock-bench-reference:* in the engine's table (one per pgbench \
         client), kept like every name's counter",
    );
    Ok(())
}

/// `$FENCELOCK_PGBENCH`, else the newest `/usr/lib/postgresql/*/bin/pgbench`, else `pgbench`
/// on the PATH.
fn pgbench() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("FENCELOCK_PGBENCH").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin").join("pgbench");
            bin.is_file().then_some((major, bin))
        })
        .max_by_key(|(major, _)| *major);
    if let Some((_, bin)) = newest {
        return Ok(bin);
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("pgbench"))
            .find(|p| p.is_file())
    });
    on_path.ok_or_else(|| {
        "pgbench not found: install the Debian package postgresql, or set FENCELOCK_PGBENCH"
            .to_owned()
    })
}

async fn tool_version(bin: &Path) -> String {
    let out = tokio::process::Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .await;
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        Err(_) => "pgbench".to_owned(),
    }
}

async fn run(
    bin: &Path,
    url: &str,
    script: &Path,
    protocol: &str,
    clients: usize,
    seconds: u64,
) -> Result<f64, String> {
    let threads = clients.min(2);
    // The password goes through the environment, never pgbench's argv, where `ps` shows it.
    let (url, password) = split_password(url);
    let mut cmd = tokio::process::Command::new(bin);
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let child = cmd
        .args(["-n", "-M", protocol, "-T", &seconds.to_string()])
        .args(["-c", &clients.to_string(), "-j", &threads.to_string()])
        .arg("-f")
        .arg(script)
        .arg(&url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    let limit = Duration::from_secs(seconds) + Duration::from_secs(30);
    let out = tokio::time::timeout(limit, child)
        .await
        .map_err(|_| "pgbench did not finish in time".to_owned())?
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(format!(
            "pgbench exited with {}: {}",
            out.status,
            last.unwrap_or("no message")
        ));
    }
    parse_tps(&stdout).ok_or_else(|| "no tps line in pgbench's output".to_owned())
}

/// The figure of `tps = 1234.5 (without initial connection time)`.
fn parse_tps(output: &str) -> Option<f64> {
    output
        .lines()
        .rev()
        .filter_map(|l| l.trim().strip_prefix("tps = "))
        .find_map(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// `url` without its password, and the password (percent-decoded) if it had one.
fn split_password(url: &str) -> (String, Option<String>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_owned(), None);
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let Some((creds, hosts)) = authority.rsplit_once('@') else {
        return (url.to_owned(), None);
    };
    let Some((user, password)) = creds.split_once(':') else {
        return (url.to_owned(), None);
    };
    let password = percent_encoding::percent_decode_str(password)
        .decode_utf8_lossy()
        .into_owned();
    (format!("{scheme}://{user}@{hosts}{tail}"), Some(password))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tps_is_read_from_pgbench_output() {
        let out = "transaction type: x.sql\nlatency average = 0.2 ms\n\
                   initial connection time = 3.1 ms\n\
                   tps = 4871.532921 (without initial connection time)\n";
        assert_eq!(parse_tps(out), Some(4871.532921));
        assert_eq!(parse_tps("nothing"), None);
    }

    #[test]
    fn the_password_leaves_the_url() {
        assert_eq!(
            super::split_password("postgres://u:p%40s@h:5/db?x=1"),
            ("postgres://u@h:5/db?x=1".to_owned(), Some("p@s".to_owned()))
        );
        assert_eq!(
            super::split_password("postgres://u@h/db"),
            ("postgres://u@h/db".to_owned(), None)
        );
    }
}
