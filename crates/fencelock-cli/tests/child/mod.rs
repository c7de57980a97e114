//! The `fencelock` binary as a child process pointed at one backend, killed when a test ends.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::process::{Child, Command, Stdio};

pub const BIN: &str = env!("CARGO_BIN_EXE_fencelock");

/// A child process killed by pid when the test ends, whatever happened.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fencelock ARGS` with `FENCELOCK_URL=url`, no stdin, output captured.
pub fn fencelock(url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(args)
        .env("FENCELOCK_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}
