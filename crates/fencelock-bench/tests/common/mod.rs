//! `fencelock-bench` as a real process, started through the test kit's [`BinCommand`] like
//! every binary the project's tests drive.

use std::path::Path;
use std::time::Duration;

use fencelock_testkit::{BinCommand, Finished};

/// A whole quick bench takes about 25 s against Redis; this only catches a hung one.
pub const LIMIT: Duration = Duration::from_secs(180);

/// Runs `fencelock-bench ARGS` with output in files under `dir`, so a full pipe can never
/// stall it, and waits up to [`LIMIT`].
pub fn bench(dir: &Path, args: &[&str]) -> Finished {
    let (out, err) = (dir.join("bench.out"), dir.join("bench.err"));
    let mut proc = BinCommand::new(env!("CARGO_BIN_EXE_fencelock-bench"))
        .args(args)
        .output_to(&out, &err)
        .spawn()
        .unwrap();
    let finished = proc.wait(LIMIT);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    assert!(
        finished.is_ok(),
        "bench {args:?} still running after {LIMIT:?}; stdout so far:\n{}\nstderr:\n{}",
        read(&out),
        read(&err)
    );
    finished.unwrap()
}
