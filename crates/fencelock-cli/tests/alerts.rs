//! The Prometheus alert rules in `ops/prometheus` are valid and pass their unit tests
//! (`promtool test rules`), which make each alert fire and show a case where it does not.
//! Skipped when promtool is missing, except in CI (`CI` set), where that is a failure.

use std::path::{Path, PathBuf};
use std::process::Command;

fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/prometheus")
}

/// `promtool`, or `None` (after saying why) when it is missing outside CI.
fn promtool() -> Option<Command> {
    let found = Command::new("promtool").arg("--version").output();
    if found.is_ok_and(|o| o.status.success()) {
        return Some(Command::new("promtool"));
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "promtool is not on PATH, and CI is set: the alert rules cannot be checked. \
         Install it (Debian: apt-get install prometheus; scripts/test does this when run as root)."
    );
    eprintln!("skipped: promtool is not on PATH (Debian: apt-get install prometheus)");
    None
}

fn run(mut cmd: Command, args: &[&str]) {
    let out = cmd
        .args(args)
        .current_dir(rules_dir())
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool {}: {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alert_rules_are_valid() {
    if let Some(cmd) = promtool() {
        run(cmd, &["check", "rules", "fencelock-alerts.yml"]);
    }
}

#[test]
fn alert_rules_pass_their_unit_tests() {
    if let Some(cmd) = promtool() {
        run(cmd, &["test", "rules", "fencelock-alerts.test.yml"]);
    }
}
