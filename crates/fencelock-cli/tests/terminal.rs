//! `fencelock run` in the foreground of a terminal, driven through an interactive bash on a
//! pseudo-terminal (`tests/pty/session.py`, python3's `pty` module): interactive commands read
//! the terminal, Ctrl-C reaches them, Ctrl-Z gives the shell its prompt back and `fg` resumes
//! them, and a command stopped past the TTL is gone before another holder gets the lock.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::{BinCommand, Sandbox};

#[test]
fn job_control_in_a_terminal() {
    let sb = Sandbox::new();
    let mut python = Command::new("python3");
    python
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pty/session.py"))
        .arg(env!("CARGO_BIN_EXE_fencelock"))
        .arg(sb.url())
        .arg(sb.path(""))
        .env_remove("FENCELOCK_URL")
        .env_remove("FENCELOCK_PREFIX");
    let out = sb
        .spawn(BinCommand::from(python))
        .wait(Duration::from_secs(90))
        .unwrap();
    assert_eq!(out.code(), Some(0), "{}\n{}", out.stdout, out.stderr);
}
