//! The PostgreSQL reference of the bench: the server's own rate for the statements one
//! acquire+release pair sends, measured with `pgbench` against the same server in the same
//! run, printed next to fencelock's figures as ratios.
//!
//! The script is made of the engine's own statements (`PostgresUrl::pair_statements`), their
//! text unchanged but for `$n` becoming pgbench variables with values of the same kind, sent
//! in the engine's protocol (`-M prepared` where it prepares, `-M extended` for the unnamed
//! statements of the lease table): one round trip each, as fencelock's. Each pgbench client
//! works on a key of its own, as each fencelock task does; the first transaction of a client
//! also computes that key's row name once (`\gset`). pgbench's transactions per second are
//! therefore pairs per second without fencelock's client-side work.
//!
//! The target is on the sequential pair: rounds of `pgbench -c 1` and a fencelock client on
//! a single-threaded runtime of its own, one after the other, as the Redis sections
//! interleave redis-benchmark, because a small machine's round trip drifts within seconds.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fencelock::{LockOptions, PgPairStatements};
use tokio::time::Instant;

use crate::cli::{connect, fail, BackendArg};
use crate::engine::PgTarget;
use crate::pg_driver::Driver;
use crate::plumbing::{bounded, rate, Out, Stop};
use crate::reference::median;
use crate::uncontended::PairTimes;
use crate::{runtime, CLIENT_NAME};

/// fencelock's sequential pairs as a share of pgbench's, one client each.
const TARGET_SEQ: f64 = 0.80;
/// Rounds the interleaved sequential comparison is cut into.
const ROUNDS: u32 = 6;
/// pgbench transactions per second of a fencelock round, so that a pgbench round lasts about
/// as long as the fencelock round after it on a small machine.
const ROUND_TRANSACTIONS_PER_S: f64 = 4_000.0;
/// The names (and, under the prefix, the rows) pgbench's clients lock: one per client.
const REFERENCE_NAME: &str = "fencelock-bench-reference-";

/// Measures the reference and prints it with the ratios to fencelock's figures: the
/// sequential pair, interleaved with pgbench here on a client named `name`, and the 64 tasks
/// that section 1 recorded in `out`.
pub(crate) async fn reference(
    target: &PgTarget,
    backend: &BackendArg,
    name: String,
    seconds: u64,
    out: &mut Out,
    stop: &Stop,
) {
    out.line(String::new());
    out.line("== 4. reference: pgbench, the same statements, same server, same run ==");
    if let Err(why) = measure(target, backend, name, seconds, out, stop).await {
        out.line(format!("reference: unavailable ({why})"));
    }
}

/// The pgbench script of one pair and the `-D` values of its variables.
struct Script {
    text: String,
    defines: Vec<(String, String)>,
    protocol: &'static str,
}

/// The statements of `pair` as a pgbench script: `$n` becomes `:fl_<what it carries>`.
fn script(pair: &PgPairStatements, prefix: &str) -> Script {
    let acquire = with_variables(pair.acquire, pair.acquire_params);
    let release = with_variables(pair.release, pair.release_params);
    // The key and row of each client: pgbench computes no text in `\set`, so the first
    // transaction of each client asks the server once and keeps the answers.
    let text = format!(
        "\\set fl_key 8000000000 + :client_id\n\
         \\if :fl_ready = 0\n\
         SELECT :fl_prefix::text || :fl_base::text || :client_id::text AS fl_row, \
         :fl_base::text || :client_id::text AS fl_name, 1 AS fl_ready \\gset\n\
         \\endif\n\
         {};\n{};\n",
        acquire.trim(),
        release.trim()
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let defines = [
        ("fl_ready", "0".to_owned()),
        ("fl_prefix", prefix.to_owned()),
        ("fl_base", REFERENCE_NAME.to_owned()),
        ("fl_owner", format!("{:032x}", 0x0123_4567_89ab_cdef_u128)),
        ("fl_host", "localhost".to_owned()),
        ("fl_pid", std::process::id().to_string()),
        ("fl_client", CLIENT_NAME.to_owned()),
        ("fl_acquired_at", now.to_string()),
        ("fl_ttl_ms", "30000".to_owned()),
        ("fl_holder_id", "fencelock-bench-reference".to_owned()),
        ("fl_channel", pair.channel.clone()),
    ];
    Script {
        text,
        defines: defines
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
        protocol: if pair.prepared {
            "prepared"
        } else {
            "extended"
        },
    }
}

/// `sql` with each `$n` replaced by `:fl_<names[n - 1]>`.
fn with_variables(sql: &str, names: &[&str]) -> String {
    let mut out = String::with_capacity(sql.len() + 8 * names.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        let n: Option<usize> = rest[at + 1..at + 1 + digits].parse().ok();
        match n.and_then(|n| names.get(n.checked_sub(1)?)) {
            Some(name) => {
                out.push_str(":fl_");
                out.push_str(name);
            }
            None => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

async fn measure(
    target: &PgTarget,
    backend: &BackendArg,
    name: String,
    seconds: u64,
    out: &mut Out,
    stop: &Stop,
) -> Result<(), String> {
    let bin = pgbench()?;
    let pair = target.statements(backend.prefix());
    let script = script(&pair, backend.prefix());
    let path = std::env::temp_dir().join(format!(
        "fencelock-bench-{}-{:x}.sql",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ));
    std::fs::write(&path, &script.text)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    let pgbench = Pgbench {
        bin,
        url: target.url.clone(),
        script: path.clone(),
        protocol: script.protocol,
        defines: script.defines,
    };
    let version = tool_version(&pgbench.bin).await;
    out.line(format!(
        "reference: {version}, -M {}, the engine's two statements (one round trip each), one \
         key per client",
        pgbench.protocol
    ));
    out.text("reference.tool", &version);
    out.text("reference.protocol", pgbench.protocol);

    let share = Duration::from_secs(seconds) / ROUNDS;
    let driver = DriverFloor {
        url: target.url.clone(),
        pair,
    };
    let rounds = interleaved(&pgbench, &driver, backend, name, share, stop).await;
    let (rounds, driver) = match rounds {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
    };
    report_rounds(&rounds, out);
    report_driver(&rounds, driver, out);

    // The 64 tasks of section 1 share the client's lock sessions (the pool minus the listening
    // one): the fair comparison is pgbench with as many connections.
    let sessions = target.pool.saturating_sub(1).max(1);
    let many = if stop.is_set() {
        None
    } else {
        Some(pgbench.run(sessions, Run::Seconds(seconds)).await)
    };
    let _ = std::fs::remove_file(&path);
    if let Some(tps) = many {
        match tps {
            Ok(tps) => {
                out.line(format!(
                    "  pgbench {sessions:>2} client(s), {seconds} s: {:>9} pairs/s",
                    rate(tps)
                ));
                out.num(&format!("reference.pgbench.c{sessions}.pairs_per_s"), tps);
                if let Some(mine) = out.value("uncontended.tasks64.ops_per_s") {
                    let ratio = mine / tps;
                    out.num("uncontended.tasks64.pgbench_ratio", ratio);
                    out.line(format!(
                        "  ratio   64 tasks / pgbench, as many connections  {ratio:>6.2}  ({} vs {})",
                        rate(mine),
                        rate(tps)
                    ));
                }
            }
            Err(e) => out.line(format!("  pgbench {sessions:>2} client(s): failed: {e}")),
        }
    }
    out.line(format!(
        "reference rows: {}{REFERENCE_NAME}* in the engine's table (one per pgbench client), \
         kept like every name's counter",
        backend.prefix()
    ));
    Ok(())
}

/// One interleaved round: pgbench's pairs per second, then fencelock's, then the bare
/// driver's with the same statements (when it could run).
struct Round {
    pgbench: Result<f64, String>,
    fencelock: f64,
    driver: Option<f64>,
}

/// What the bare driver needs to run the pair (see `pg_driver`).
#[derive(Clone)]
struct DriverFloor {
    url: String,
    pair: PgPairStatements,
}

/// The sequential comparison: [`ROUNDS`] times, `pgbench -c 1` for about as many pairs as
/// fit in `share` ([`ROUND_TRANSACTIONS_PER_S`]), then one fencelock client for `share`, on a thread and a single-threaded runtime of
/// their own, on the resource `name`.
async fn interleaved(
    pgbench: &Pgbench,
    floor: &DriverFloor,
    backend: &BackendArg,
    name: String,
    share: Duration,
    stop: &Stop,
) -> Result<(Vec<Round>, Result<(), String>), String> {
    let (pgbench, backend, stop) = (pgbench.clone(), backend.clone(), stop.clone());
    let floor = floor.clone();
    let run = runtime::on_own_thread("fencelock-bench-pg-seq", move || async move {
        let client = connect(&backend, CLIENT_NAME).await?;
        let opts = LockOptions::default();
        let mut driver =
            Driver::connect(&floor.url, &floor.pair, backend.prefix(), REFERENCE_NAME).await;
        let result = async {
            let mut t = PairTimes::default();
            // Connections and prepared statements come first; keep them out of the figures.
            for _ in 0..20 {
                t.one(&client, &name, &opts, false).await.map_err(fail)?;
            }
            let mut rounds = Vec::new();
            for _ in 0..ROUNDS {
                if stop.is_set() {
                    break;
                }
                let n = (share.as_secs_f64() * ROUND_TRANSACTIONS_PER_S).clamp(200.0, 100_000.0);
                let reference = pgbench.run(1, Run::Transactions(n as u32)).await;
                let (start, mut pairs) = (Instant::now(), 0u64);
                let timed = bounded(share, async {
                    while start.elapsed() < share && !stop.is_set() {
                        t.one(&client, &name, &opts, false).await?;
                        pairs += 1;
                    }
                    Ok::<(), fencelock::Error>(())
                })
                .await?;
                timed.map_err(fail)?;
                let fencelock = pairs as f64 / start.elapsed().as_secs_f64().max(1e-9);
                let bare = match &driver {
                    Ok(d) => match timed_pairs(d, share, &stop).await {
                        Ok(per_s) => Some(per_s),
                        Err(e) => {
                            driver = Err(e);
                            None
                        }
                    },
                    Err(_) => None,
                };
                rounds.push(Round {
                    pgbench: reference,
                    fencelock,
                    driver: bare,
                });
            }
            Ok((rounds, driver.map(|_| ())))
        }
        .await;
        client.close().await;
        result
    });
    run.await.map_err(|e| e.to_string())
}

/// The bare driver's pairs per second over `share`.
async fn timed_pairs(driver: &Driver, share: Duration, stop: &Stop) -> Result<f64, String> {
    for _ in 0..20 {
        driver.pair().await?;
    }
    let (start, mut pairs) = (Instant::now(), 0u64);
    let timed = bounded(share, async {
        while start.elapsed() < share && !stop.is_set() {
            driver.pair().await?;
            pairs += 1;
        }
        Ok::<(), String>(())
    })
    .await
    .map_err(|e| e.to_string())?;
    timed?;
    Ok(pairs as f64 / start.elapsed().as_secs_f64().max(1e-9))
}

/// The driver's rounds: its pairs/s against pgbench's and fencelock's, medians of rounds.
fn report_driver(rounds: &[Round], driver: Result<(), String>, out: &mut Out) {
    if let Err(why) = driver {
        out.line(format!("  driver floor: unavailable ({why})"));
        return;
    }
    let mut per_s = Vec::new();
    let (mut over_pgbench, mut fencelock_over) = (Vec::new(), Vec::new());
    for r in rounds {
        let Some(d) = r.driver else { continue };
        per_s.push(rate(d));
        if let Ok(tps) = &r.pgbench {
            over_pgbench.push(d / tps);
        }
        fencelock_over.push(r.fencelock / d);
    }
    out.line(format!(
        "  driver floor: tokio-postgres, same statements, nothing around them {} pairs/s",
        per_s.join(" ")
    ));
    if let (Some(a), Some(b)) = (median(over_pgbench), median(fencelock_over)) {
        out.line(format!(
            "  driver / pgbench {a:.2}, fencelock / driver {b:.2} (medians of rounds)"
        ));
        out.num("reference.driver.over_pgbench", a);
        out.num("reference.driver.fencelock_over", b);
    }
}

/// Prints the rounds, their median ratio and the target.
fn report_rounds(rounds: &[Round], out: &mut Out) {
    let (mut mine, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for r in rounds {
        match &r.pgbench {
            Ok(tps) => {
                mine.push(rate(r.fencelock));
                theirs.push(rate(*tps));
                ratios.push(r.fencelock / tps);
            }
            Err(e) => out.line(format!("  a pgbench round failed: {e}")),
        }
    }
    out.line(format!(
        "  sequential, 1 client, interleaved rounds: pgbench {} pairs/s",
        theirs.join(" ")
    ));
    out.line(format!(
        "                                           fencelock {} pairs/s",
        mine.join(" ")
    ));
    let texts: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    out.line(format!("  ratio per round: {}", texts.join(" ")));
    if let Some(ratio) = median(ratios) {
        let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let ok: Vec<&Round> = rounds.iter().filter(|r| r.pgbench.is_ok()).collect();
        out.num(
            "reference.pgbench.c1.pairs_per_s",
            mean(ok.iter().filter_map(|r| r.pgbench.clone().ok()).collect()),
        );
        out.num(
            "uncontended.sequential_interleaved.ops_per_s",
            mean(ok.iter().map(|r| r.fencelock).collect()),
        );
        out.num("uncontended.sequential.pgbench_ratio", ratio);
        out.target(
            "uncontended.sequential.pgbench_ratio",
            &format!("sequential / pgbench 1 client >= {TARGET_SEQ:.2} (median of rounds)"),
            &format!("{ratio:.2}"),
            Some(ratio >= TARGET_SEQ),
        );
    }
}

/// How long one pgbench run lasts.
enum Run {
    Seconds(u64),
    Transactions(u32),
}

/// pgbench, with the script and its variables.
#[derive(Clone)]
struct Pgbench {
    bin: PathBuf,
    url: String,
    script: PathBuf,
    protocol: &'static str,
    defines: Vec<(String, String)>,
}

impl Pgbench {
    async fn run(&self, clients: usize, length: Run) -> Result<f64, String> {
        let threads = clients.min(2);
        // The password goes through the environment, never pgbench's argv, where `ps` shows
        // it.
        let (url, password) = split_password(&self.url);
        let mut cmd = tokio::process::Command::new(&self.bin);
        if let Some(p) = password {
            cmd.env("PGPASSWORD", p);
        }
        let (flag, value, limit) = match length {
            Run::Seconds(s) => ("-T", s.to_string(), Duration::from_secs(s)),
            Run::Transactions(n) => ("-t", n.to_string(), Duration::ZERO),
        };
        cmd.args(["-n", "-M", self.protocol, flag, &value]).args([
            "-c",
            &clients.to_string(),
            "-j",
            &threads.to_string(),
        ]);
        for (k, v) in &self.defines {
            cmd.arg("-D").arg(format!("{k}={v}"));
        }
        let child = cmd
            .arg("-f")
            .arg(&self.script)
            .arg(&url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output();
        let limit = limit + Duration::from_secs(30);
        let out = tokio::time::timeout(limit, child)
            .await
            .map_err(|_| "pgbench did not finish in time".to_owned())?
            .map_err(|e| format!("cannot run {}: {e}", self.bin.display()))?;
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
    fn the_script_is_the_engines_statements_with_pgbench_variables() {
        assert_eq!(
            with_variables("SELECT f($1, $2), $10, $x, $3", &["a", "b"]),
            "SELECT f(:fl_a, :fl_b), $10, $x, $3"
        );
        for url in ["postgres://h/db", "postgres://h/db?mode=lease"] {
            let Ok(fencelock::Backend::Postgres(u)) = fencelock::Backend::parse(url) else {
                unreachable!("{url} parses")
            };
            let pair = u.pair_statements("fencelock:v1:");
            let s = script(&pair, "fencelock:v1:");
            assert!(
                !s.text.contains('$'),
                "{url}: every parameter is a variable"
            );
            // Every variable the statements use is defined, by -D or by the first transaction.
            let defined: Vec<String> = s
                .defines
                .iter()
                .map(|(k, _)| k.clone())
                .chain(["fl_key", "fl_row", "fl_name"].map(String::from))
                .collect();
            for p in pair.acquire_params.iter().chain(pair.release_params) {
                assert!(defined.contains(&format!("fl_{p}")), "{url}: {p}");
            }
            assert_eq!(
                s.protocol,
                if url.contains("lease") {
                    "extended"
                } else {
                    "prepared"
                }
            );
        }
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
