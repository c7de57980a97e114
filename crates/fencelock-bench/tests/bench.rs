//! `fencelock-bench` as a real process: on a SQLite file, against a real redis-server and a
//! real PostgreSQL.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Stdio};

use common::bench;
use fencelock_testkit::{free_port, Finished, PgServer, RedisServer};

fn assert_sections(out: &Finished) {
    assert_eq!(
        out.code(),
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        out.stdout,
        out.stderr
    );
    for header in [
        "fencelock bench: engine",
        "== 1. uncontended acquire+release",
        "sequential, 1 client",
        "64 tasks, 1 shared client",
        "== 2. contention: 16 workers",
        "== 3. renewal load",
        "clean-up: released every lease",
    ] {
        assert!(
            out.stdout.contains(header),
            "missing {header:?} in:\n{}",
            out.stdout
        );
    }
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

#[test]
fn bench_on_sqlite_prints_every_section() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("b.db").display());
    let out = bench(
        dir.path(),
        &["--backend", &url, "--quick", "--seconds", "1"],
    );
    assert_sections(&out);
    assert!(out.stdout.contains("fair mode skipped"), "{}", out.stdout);
    assert!(
        out.stdout.contains("skipped: Redis engines only"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("reference: unavailable"),
        "{}",
        out.stdout
    );

    let json = bench(
        dir.path(),
        &["--backend", &url, "--quick", "--seconds", "1", "--json"],
    );
    assert_eq!(json.code(), Some(0), "{}", json.stderr);
    let line = json.stdout.trim();
    assert!(
        line.starts_with('{') && line.ends_with('}') && !line.contains('\n'),
        "{line}"
    );
    assert!(line.contains("\"engine\":\"sqlite\""), "{line}");
    assert!(
        line.contains("\"uncontended.sequential.ops_per_s\":"),
        "{line}"
    );
}

fn redis_benchmark_exists() -> bool {
    let bin = std::env::var("FENCELOCK_REDIS_BENCHMARK")
        .ok()
        .filter(|b| !b.is_empty())
        .unwrap_or_else(|| "redis-benchmark".to_owned());
    Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn bench_on_redis_measures_renewals_and_leaves_nothing_behind() {
    let server = RedisServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = bench(
        dir.path(),
        &["--backend", &server.url(), "--quick", "--seconds", "1"],
    );
    assert_sections(&out);
    for expected in [
        "target  fair: per-worker max/min",
        "requests/s",
        "two no-op scripts with fencelock's keys and arguments",
        // Not asserted to be 0: an unoptimised build under a busy test run can be too slow to
        // renew 10,000 leases at the 3 s TTL of --quick, which the bench reports as it should.
        "leases lost during the window: ",
    ] {
        assert!(
            out.stdout.contains(expected),
            "missing {expected:?} in:\n{}",
            out.stdout
        );
    }
    if redis_benchmark_exists() {
        assert!(
            out.stdout.contains("pair rate") && out.stdout.contains("sequential / 1-client"),
            "{}",
            out.stdout
        );
    } else {
        assert!(
            out.stdout.contains("reference: unavailable"),
            "{}",
            out.stdout
        );
    }

    let keys = server.cli(&["--scan", "--pattern", "*"]).unwrap();
    let keys = String::from_utf8_lossy(&keys.stdout);
    let left: Vec<&str> = keys
        .lines()
        .filter(|k| k.contains("fencelock-bench-") || *k == "key:__rand_int__")
        .collect();
    assert!(left.is_empty(), "bench keys left behind: {left:?}");
}

#[test]
fn bench_exit_codes_match_the_other_commands() {
    let dir = tempfile::tempdir().unwrap();
    let bad = bench(dir.path(), &["--backend", "ftp://nowhere"]);
    assert_eq!(bad.code(), Some(64), "{}", bad.stderr);

    let closed = format!("redis://127.0.0.1:{}", free_port());
    let down = bench(dir.path(), &["--backend", &closed, "--quick"]);
    assert_eq!(down.code(), Some(69), "{}", down.stderr);

    let closed = format!(
        "redlock://127.0.0.1:{},127.0.0.1:{},127.0.0.1:{}",
        free_port(),
        free_port(),
        free_port()
    );
    let down = bench(dir.path(), &["--backend", &closed, "--quick"]);
    assert_eq!(down.code(), Some(69), "{}", down.stderr);
}

/// On PostgreSQL the bench prints the pgbench reference of the same statements, in the same
/// protocol, and the ratios to it with the sequential target.
#[test]
fn bench_measures_pgbench_reference_in_the_same_run() {
    let server = PgServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = bench(
        dir.path(),
        &[
            "--backend",
            &server.url(),
            "--seconds",
            "1",
            "--quick",
            "--json",
        ],
    );
    let json = out.stdout;
    assert_eq!(out.status.code(), Some(0), "{json}");
    for field in [
        "\"engine\":\"postgres\"",
        "\"reference.pgbench.c1.pairs_per_s\":",
        "\"reference.pgbench.c3.pairs_per_s\":",
        "\"uncontended.sequential.pgbench_ratio\":",
        "\"uncontended.tasks64.pgbench_ratio\":",
        "\"uncontended.sequential.pgbench_ratio.target\":",
        "\"reference.tool\":\"pgbench",
        "\"reference.protocol\":\"prepared\"",
        // The bare driver on the same statements: the floor under fencelock's ratio.
        "\"reference.driver.over_pgbench\":",
        "\"reference.driver.fencelock_over\":",
    ] {
        assert!(json.contains(field), "{field} missing from {json}");
    }
}

/// Runs the quick bench on `url` with the password in `$FENCELOCK_PASSWORD`, sampling every
/// process's argv (`ps -eo args`) while it runs: the password must appear in none.
fn bench_keeps_the_password_out_of_argv(url: &str, password: &str) -> Finished {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("bench.out"), dir.path().join("bench.err"));
    let mut proc = fencelock_testkit::BinCommand::new(env!("CARGO_BIN_EXE_fencelock-bench"))
        .args(["--backend", url, "--quick", "--seconds", "1"])
        .env("FENCELOCK_PASSWORD", password)
        .output_to(&out, &err)
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    let mut samples = 0;
    while proc.try_finish().is_none() && started.elapsed() < common::LIMIT {
        let ps = Command::new("ps")
            .args(["-eo", "args"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&ps.stdout);
        assert!(
            !text.contains(password),
            "a process shows the password:\n{text}"
        );
        samples += 1;
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(samples > 10, "only {samples} samples");
    proc.wait(common::LIMIT).unwrap()
}

#[test]
fn bench_on_password_protected_redis_and_postgres_shows_no_password() {
    let password = "Sekr3tPassw0rdXyz";
    let redis = RedisServer::start().unwrap();
    let set = redis
        .cli(&["CONFIG", "SET", "requirepass", password])
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let out = bench_keeps_the_password_out_of_argv(&redis.url(), password);
    assert_sections(&out);
    assert!(
        out.stdout.contains("redis-benchmark would show it"),
        "{}",
        out.stdout
    );

    let pg = PgServer::start().unwrap();
    let url = pg.add_password_role("benchpw", password).unwrap();
    let su = pg.psql("ALTER ROLE benchpw SUPERUSER").unwrap();
    assert!(su.status.success(), "{su:?}");
    let out = bench_keeps_the_password_out_of_argv(&url, password);
    assert_sections(&out);
    assert!(out.stdout.contains("pgbench"), "{}", out.stdout);
    assert!(
        !out.stdout.contains("pgbench round failed") && !out.stdout.contains("client(s): failed"),
        "{}",
        out.stdout
    );
}

/// The figures every `peers --json` run gives, under `fencelock.`, `rslock.` (not `fair.`:
/// rslock has one mode) and `ratio.`, and per round under `round.1.`.
fn peers_keys(engine: &str) -> Vec<String> {
    let seq = ["pairs_per_s", "acquire_p50_us", "release_p50_us"];
    let mode = [
        "acquisitions_per_s",
        "handoff_p50_us",
        "handoff_over_round_trip",
        "wait_p99_us",
        "worker_max_over_min",
        "hold_mean_us",
        "utilisation",
    ];
    let mut fencelock: Vec<String> = seq.iter().map(|k| format!("sequential.{k}")).collect();
    let mut rslock = fencelock.clone();
    for k in mode {
        fencelock.push(format!("default.{k}"));
        fencelock.push(format!("fair.{k}"));
        rslock.push(format!("default.{k}"));
    }
    let mut keys = vec![
        "round_trip_p50_us".to_owned(),
        "round.1.round_trip_p50_us".to_owned(),
    ];
    keys.extend([
        "clean_up.deleted_keys".to_owned(),
        "rslock.retry_delay_ms".to_owned(),
    ]);
    // The bare driver's floors under the sequential figure.
    for floor in ["fencelock_scripts", "minimal_scripts", "transaction"] {
        for k in ["pairs_per_s", "over_rslock", "fencelock_over"] {
            keys.push(format!("floor.{floor}.{k}"));
        }
        keys.push(format!("round.1.floor.{floor}.pairs_per_s"));
    }
    for k in &fencelock {
        keys.extend([
            format!("fencelock.{k}"),
            format!("ratio.{k}"),
            format!("round.1.fencelock.{k}"),
        ]);
    }
    for k in &rslock {
        keys.extend([format!("rslock.{k}"), format!("round.1.rslock.{k}")]);
    }
    let targets: &[&str] = if engine == "redlock" {
        &[
            "sequential",
            "default_acquisitions",
            "fair_acquisitions",
            "fair_max_over_min",
            "fair_wait_p99",
        ]
    } else {
        keys.push("fencelock.default_over_fair".to_owned());
        // The least fair handoff, measured on one node only.
        for k in [
            "acquisitions_per_s",
            "handoff_p50_us",
            "handoff_over_round_trip",
            "utilisation",
            "fencelock_over",
        ] {
            keys.push(format!("floor.fair_handoff.{k}"));
        }
        keys.push("round.1.floor.fair_handoff.utilisation".to_owned());
        &[
            "sequential",
            "fair_utilisation",
            "fair_handoff",
            "default_vs_fair",
        ]
    };
    keys.extend(targets.iter().map(|t| format!("target.{t}")));
    keys
}

/// `peers` on Redlock and on one node: every figure of both libraries is there, positive and
/// finite, the floors measured by the bare driver are there too, and nothing leaves a key of
/// the run behind.
#[test]
fn peers_measures_fencelock_and_rslock_side_by_side_and_cleans_up() {
    let nodes = fencelock_testkit::start_redis_nodes(3).unwrap();
    let single = RedisServer::start().unwrap();
    let runs = [
        ("redlock", fencelock_testkit::redlock_url(&nodes)),
        ("redis", single.url()),
    ];
    // Both at once: each run is timed by wall clock (5 timed runs of 1 s), so in parallel the
    // test takes the time of one.
    let outputs: Vec<(&str, Finished)> = std::thread::scope(|s| {
        let handles: Vec<_> = runs
            .iter()
            .map(|(engine, url)| {
                s.spawn(move || {
                    let dir = tempfile::tempdir().unwrap();
                    let args = ["peers", "--backend", url, "--seconds", "1", "--rounds", "1"];
                    (
                        *engine,
                        bench(dir.path(), &[&args[..], &["--json"]].concat()),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (engine, out) in &outputs {
        assert_eq!(
            out.code(),
            Some(0),
            "{engine}: {}\n{}",
            out.stdout,
            out.stderr
        );
        let parsed = serde_json::from_str::<serde_json::Value>(out.stdout.trim());
        assert!(
            parsed.is_ok(),
            "{engine}: not one JSON object: {}",
            out.stdout
        );
        let json = parsed.unwrap();
        assert_eq!(json["engine"], *engine, "{json}");
        if *engine == "redlock" {
            // A handoff needs a quorum there: the one-node floor does not apply.
            assert!(json["floor.fair_handoff.utilisation"].is_null(), "{json}");
        }
        for key in peers_keys(engine) {
            let v = &json[&key];
            if key.starts_with("target.") {
                assert!(*v == "met" || *v == "missed", "{engine}: {key} = {v}");
                continue;
            }
            // A worker that got the lock not once in a 1 s run has no max/min (null), which a
            // busy test machine can cause for a barging lock.
            if key.ends_with("worker_max_over_min") && v.is_null() {
                continue;
            }
            let n = v.as_f64();
            assert!(
                n.is_some_and(|n| n.is_finite() && n > 0.0),
                "{engine}: {key} = {v} in {json}"
            );
        }
    }
    // The library's one shared node marker (`<prefix>node`, written by every fencelock client)
    // is not the run's; nothing else may be left.
    for server in nodes.iter().chain([&single]) {
        let keys = server.cli(&["--scan", "--pattern", "*"]).unwrap();
        let keys = String::from_utf8_lossy(&keys.stdout);
        let left: Vec<&str> = keys.lines().filter(|k| *k != "fencelock:v1:node").collect();
        assert!(left.is_empty(), "keys left on {}: {left:?}", server.addr());
    }
}
