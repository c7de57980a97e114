//! Process bookkeeping shared by the servers the kit starts.

use std::path::PathBuf;
use std::process::Child;

use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// SIGKILLs and reaps `child`, ignoring errors: this runs from `Drop` and on
/// error paths, where there is nothing better to do.
pub(crate) fn stop(child: &mut Child) {
    // Signal only a child we have not reaped yet: once reaped, its pid may
    // already belong to an unrelated process.
    if let Ok(None) = child.try_wait() {
        // SIGKILL also ends a SIGSTOPped process, so a paused server dies too.
        let _ = signal::kill(as_pid(child.id()), Signal::SIGKILL);
        let _ = child.wait();
    }
}

pub(crate) fn as_pid(pid: u32) -> Pid {
    // Kernel pids fit in pid_t; saturating keeps an impossible value from
    // wrapping to a negative number, which kill(2) reads as a process group.
    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX))
}

/// The program named by environment variable `var`, else `default` (looked up on PATH).
pub(crate) fn env_or(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default))
}
