//! Process bookkeeping shared by fencelock and its supervisor: who descends from whom, the
//! monotonic clock both read, and the wire between them.

use std::collections::HashMap;

use nix::sys::signal::{kill, Signal};
use nix::time::{clock_gettime, ClockId};
use nix::unistd::Pid;

/// Every living process below `root`, found through the parent links in /proc.
///
/// Process groups are not enough: a command may start children in groups or sessions of
/// their own, and those must stop with the lease too. Under a child subreaper every orphan is
/// reparented to `root`, so the parent links always lead back to it.
pub fn descendants(root: Pid) -> Vec<Pid> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        // the last one.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let ppid = fields.next().and_then(|p| p.parse::<i32>().ok());
        // Zombies have exited already: only reaping is left, and signals cannot reach them.
        if let (Some(ppid), Some(state)) = (ppid, state) {
            if state != "Z" && state != "X" {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut found = Vec::new();
    let mut queue = vec![root.as_raw()];
    while let Some(p) = queue.pop() {
        if let Some(kids) = children.get(&p) {
            for &k in kids {
                found.push(Pid::from_raw(k));
                queue.push(k);
            }
        }
    }
    found
}

/// The state letter of `pid` in /proc/PID/stat (`R`, `S`, `T` stopped, `t` traced, `Z`...);
/// `None` when it is gone.
pub fn state_of(pid: Pid) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ...": comm may hold spaces and parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Sends `sig` to every process below `root`.
pub fn signal_all(root: Pid, sig: Signal) -> usize {
    let procs = descendants(root);
    for &p in &procs {
        let _ = kill(p, sig);
    }
    procs.len()
}

/// CLOCK_MONOTONIC in nanoseconds: the clock `Instant` reads, the same in every process on
/// the machine, so a deadline can cross a process boundary as a number.
pub fn monotonic_ns() -> i64 {
    clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map(|t| {
            t.tv_sec()
                .saturating_mul(1_000_000_000)
                .saturating_add(t.tv_nsec())
        })
        .unwrap_or(0)
}

/// `instant` (a lease's deadline, on tokio's clock) on the CLOCK_MONOTONIC scale of
/// [`monotonic_ns`].
pub fn instant_ns(instant: tokio::time::Instant) -> i64 {
    let instant = instant.into_std();
    let now = std::time::Instant::now();
    let now_ns = monotonic_ns();
    if instant >= now {
        now_ns.saturating_add(i64::try_from((instant - now).as_nanos()).unwrap_or(i64::MAX / 2))
    } else {
        now_ns.saturating_sub(i64::try_from((now - instant).as_nanos()).unwrap_or(i64::MAX / 2))
    }
}

/// What fencelock tells its supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToWorker {
    /// The lease is valid until this CLOCK_MONOTONIC time (ns).
    Deadline(i64),
    /// Pass this signal on to the command.
    Signal(i32),
    /// The lease is lost: stop every descendant.
    Terminate,
}

/// What the supervisor tells fencelock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToParent {
    /// The command runs with this pid (also its process group).
    Started(i32),
    /// The command could not be started; fencelock exits with this code.
    NotStarted(u8),
    /// The command was stopped by this signal.
    Stopped(i32),
    /// The command has exited; its status as a shell reports it.
    Exited(u8),
    /// The validity deadline came without a renewal: every descendant is being killed.
    DeadlineFired,
    /// Every descendant has exited; the supervisor exits next.
    AllGone,
}

impl ToWorker {
    pub fn encode(&self) -> String {
        match self {
            ToWorker::Deadline(ns) => format!("D {ns}\n"),
            ToWorker::Signal(s) => format!("S {s}\n"),
            ToWorker::Terminate => "T\n".into(),
        }
    }

    pub fn decode(line: &str) -> Option<ToWorker> {
        let (tag, arg) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "D" => arg.parse().ok().map(ToWorker::Deadline),
            "S" => arg.parse().ok().map(ToWorker::Signal),
            "T" => Some(ToWorker::Terminate),
            _ => None,
        }
    }
}

impl ToParent {
    pub fn encode(&self) -> String {
        match self {
            ToParent::Started(p) => format!("P {p}\n"),
            ToParent::NotStarted(c) => format!("E {c}\n"),
            ToParent::Stopped(s) => format!("Z {s}\n"),
            ToParent::Exited(c) => format!("X {c}\n"),
            ToParent::DeadlineFired => "K\n".into(),
            ToParent::AllGone => "G\n".into(),
        }
    }

    pub fn decode(line: &str) -> Option<ToParent> {
        let (tag, arg) = line.split_once(' ').unwrap_or((line, ""));
        match tag {
            "P" => arg.parse().ok().map(ToParent::Started),
            "E" => arg.parse().ok().map(ToParent::NotStarted),
            "Z" => arg.parse().ok().map(ToParent::Stopped),
            "X" => arg.parse().ok().map(ToParent::Exited),
            "K" => Some(ToParent::DeadlineFired),
            "G" => Some(ToParent::AllGone),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            ToWorker::Deadline(-5),
            ToWorker::Deadline(123_456_789_012),
            ToWorker::Signal(15),
            ToWorker::Terminate,
        ] {
            assert_eq!(ToWorker::decode(m.encode().trim_end()), Some(m));
        }
        for m in [
            ToParent::Started(42),
            ToParent::NotStarted(127),
            ToParent::Stopped(20),
            ToParent::Exited(137),
            ToParent::DeadlineFired,
            ToParent::AllGone,
        ] {
            assert_eq!(ToParent::decode(m.encode().trim_end()), Some(m));
        }
        assert_eq!(ToParent::decode("Q"), None);
    }

    #[test]
    fn this_process_descends_from_its_parent() {
        let me = nix::unistd::getpid();
        let parent = nix::unistd::getppid();
        assert!(descendants(parent).contains(&me));
    }

    #[test]
    fn instants_map_onto_the_monotonic_clock() {
        let later = tokio::time::Instant::now() + std::time::Duration::from_secs(2);
        let diff = instant_ns(later) - monotonic_ns();
        assert!((1_900_000_000..=2_000_000_000).contains(&diff), "{diff}");
    }
}
