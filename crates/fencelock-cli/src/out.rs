//! The command's output on stdout, written with [`outln!`] and [`out!`] instead of `println!`
//! and `print!`, which panic when the write fails.
//!
//! A closed pipe (`fencelock list | head -1`) ends the output quietly and changes nothing
//! else: the reader has what it wanted, and a script with `set -o pipefail` does not fail on
//! it (ripgrep does the same). Any other failure, a full disk above all, is reported on stderr
//! once the command is done and turns a successful exit into 74 (EX_IOERR). Either way the
//! rest of the output is dropped and the command's work is finished, not cut short halfway:
//! a forced release that could not print its record still happened, and is in the audit log.

use std::io::{self, Write};
use std::sync::OnceLock;

/// The first write that failed; every later one is skipped.
static FAILED: OnceLock<io::Error> = OnceLock::new();

/// Writes `args` to stdout and flushes, so that a failure shows here and not at exit.
pub fn write(args: std::fmt::Arguments<'_>) {
    if FAILED.get().is_some() {
        return;
    }
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        let _ = FAILED.set(e);
    }
}

/// Whether stdout has failed: a command that prints until stopped (`elect --listen`) stops.
pub fn failed() -> bool {
    FAILED.get().is_some()
}

/// The exit code of a command that ended with `code`, after reporting a failed write other
/// than a closed pipe.
pub fn exit_code(code: u8) -> u8 {
    match FAILED.get() {
        Some(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            let _ = writeln!(io::stderr(), "fencelock: cannot write the output: {e}");
            if code == 0 {
                crate::exit::IO
            } else {
                code
            }
        }
        _ => code,
    }
}

/// `println!` to stdout without the panic (see the `out` module).
macro_rules! outln {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` to stdout without the panic (see the `out` module).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}
