//! What every section shares and none of them is about: latency samples and their
//! percentiles, the bench's lock names, the Ctrl-C flag, the bound on each phase, and the
//! output (human tables as the run goes, or one JSON object at the end) with the way its
//! figures are written. Kept apart so that each section reads as what it measures.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::cli::{exit, fail, Exit};
use crate::{LibResult, PHASE_SLACK};

/// Latency samples, sorted for percentiles.
pub(crate) struct Samples(Vec<Duration>);

impl Samples {
    pub(crate) fn new(mut v: Vec<Duration>) -> Samples {
        v.sort_unstable();
        Samples(v)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Nearest-rank percentile; zero without samples.
    pub(crate) fn p(&self, pct: f64) -> Duration {
        let n = self.0.len();
        if n == 0 {
            return Duration::ZERO;
        }
        let rank = ((pct / 100.0) * n as f64).ceil() as usize;
        self.0[rank.clamp(1, n) - 1]
    }
}

/// The bench's resource names: one random run id, so runs never meet each other's (or
/// anybody's) locks, and the list of every name used, for clean-up.
pub(crate) struct Names {
    pub(crate) base: String,
    pub(crate) used: Vec<String>,
}

impl Names {
    pub(crate) fn new(run: &str) -> Names {
        Names {
            base: format!("fencelock-bench-{run}"),
            used: Vec::new(),
        }
    }

    pub(crate) fn take(&mut self, what: &str) -> String {
        let name = format!("{}-{what}", self.base);
        self.used.push(name.clone());
        name
    }
}

pub(crate) fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:x}{:08x}", std::process::id(), nanos)
}

/// Set on Ctrl-C: every phase stops early and the bench still releases what it holds. A second
/// Ctrl-C exits at once.
#[derive(Clone)]
pub(crate) struct Stop(Arc<watch::Sender<bool>>);

impl Stop {
    pub(crate) fn on_interrupt() -> Stop {
        let stop = Stop(Arc::new(watch::channel(false).0));
        let s = stop.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                eprintln!("fencelock-bench: interrupted; releasing what the bench holds");
                s.set();
                if tokio::signal::ctrl_c().await.is_ok() {
                    std::process::exit(130);
                }
            }
        });
        stop
    }

    pub(crate) fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    fn set(&self) {
        self.0.send_replace(true);
    }

    pub(crate) async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|set| *set).await;
    }
}

/// Bounds a phase: `nominal` plus [`PHASE_SLACK`].
pub(crate) async fn bounded<T>(
    nominal: Duration,
    fut: impl std::future::Future<Output = T>,
) -> Result<T> {
    let limit = nominal + PHASE_SLACK;
    tokio::time::timeout(limit, fut).await.map_err(|_| {
        eprintln!(
            "fencelock-bench: a bench phase did not finish within {}",
            dur(limit)
        );
        Exit(exit::UNAVAILABLE).into()
    })
}

/// Waits for every task; the first error wins (and is reported once), but only after all have
/// stopped, so no task is left holding a lease.
pub(crate) async fn join_all<T: 'static>(mut tasks: JoinSet<LibResult<T>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(tasks.len());
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_error.get_or_insert_with(|| fail(e));
            }
            Err(e) => {
                first_error.get_or_insert(anyhow::anyhow!("a bench task failed: {e}"));
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// Human tables on stdout as the run goes, or one JSON object at the end.
pub(crate) struct Out {
    json: bool,
    fields: Vec<(String, String)>,
    stop: Stop,
}

impl Out {
    pub(crate) fn new(json: bool, stop: Stop) -> Out {
        Out {
            json,
            fields: Vec::new(),
            stop,
        }
    }

    pub(crate) fn line(&mut self, s: impl AsRef<str>) {
        if !self.json {
            self.write(s.as_ref());
        }
    }

    /// A reader that went away (`| head`) ends the run like Ctrl-C does, so the bench still
    /// releases its leases and deletes its keys instead of dying on a broken pipe.
    fn write(&self, s: &str) {
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        if writeln!(stdout, "{s}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            self.stop.set();
        }
    }

    pub(crate) fn num(&mut self, key: &str, v: f64) {
        let v = if v.is_finite() {
            format!("{}", (v * 1000.0).round() / 1000.0)
        } else {
            "null".to_owned()
        };
        self.fields.push((key.to_owned(), v));
    }

    /// The last number recorded under `key`.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn value(&self, key: &str) -> Option<f64> {
        let (_, v) = self.fields.iter().rev().find(|(k, _)| k == key)?;
        v.parse().ok()
    }

    pub(crate) fn micros(&mut self, key: &str, d: Duration) {
        self.num(key, d.as_secs_f64() * 1e6);
    }

    pub(crate) fn text(&mut self, key: &str, v: &str) {
        self.fields.push((key.to_owned(), json_string(v)));
    }

    /// A target line next to its figure; `pass` is `None` where no verdict applies.
    pub(crate) fn target(&mut self, key: &str, what: &str, measured: &str, pass: Option<bool>) {
        let verdict = match pass {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None => "-",
        };
        self.line(format!("  target  {what:<58} {measured:>9}  {verdict}"));
        if pass.is_some() {
            self.text(&format!("{key}.target"), verdict);
        }
    }

    /// Ends a run whose figures and clean-up are printed: the JSON object (with `--json`),
    /// then the run's error, or exit code 130 after Ctrl-C, else 0.
    pub(crate) fn end_run<E: Into<anyhow::Error>>(
        &self,
        outcome: std::result::Result<(), E>,
        stop: &Stop,
    ) -> Result<u8> {
        self.finish();
        outcome.map_err(Into::into)?;
        if stop.is_set() {
            eprintln!("fencelock-bench: run interrupted");
            return Ok(130);
        }
        Ok(0)
    }

    fn finish(&self) {
        if !self.json {
            return;
        }
        let body = self
            .fields
            .iter()
            .map(|(k, v)| format!("{}:{v}", json_string(k)))
            .collect::<Vec<_>>()
            .join(",");
        self.write(&format!("{{{body}}}"));
    }
}

/// `s` as a JSON string literal. The output is one flat object of numbers and short strings,
/// so an escaper is all it takes (the `fencelock` command line's `--json` uses the same one).
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Calls of `op` per second, one after another for `dur` (or until `stop`), after 20 untimed
/// ones: the reference runs' loop of a server's own requests.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) async fn calls_per_s<F, Fut>(
    dur: Duration,
    stop: &Stop,
    mut op: F,
) -> std::result::Result<f64, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<(), String>>,
{
    for _ in 0..20 {
        op().await?;
    }
    let (start, mut n) = (tokio::time::Instant::now(), 0u64);
    while start.elapsed() < dur && !stop.is_set() {
        op().await?;
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// A rate with thousands separators, no decimals.
pub(crate) fn rate(v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A small rate, with one decimal below 100.
pub(crate) fn rate2(v: f64) -> String {
    if v < 100.0 {
        format!("{v:.1}")
    } else {
        rate(v)
    }
}

pub(crate) fn ratio_text(r: Option<f64>) -> String {
    r.map_or("-".to_owned(), |r| format!("{r:.2}"))
}

pub(crate) fn dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.0}µs")
    } else if us < 10_000.0 {
        format!("{:.2}ms", us / 1000.0)
    } else if us < 1_000_000.0 {
        format!("{:.1}ms", us / 1000.0)
    } else if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{:.2}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let s = Samples::new((1..=100).rev().map(Duration::from_micros).collect());
        assert_eq!(s.p(50.0), Duration::from_micros(50));
        assert_eq!(s.p(99.0), Duration::from_micros(99));
        assert_eq!(Samples::new(Vec::new()).p(99.0), Duration::ZERO);
    }

    #[test]
    fn figures_read_well() {
        assert_eq!(rate(1234567.4), "1,234,567");
        assert_eq!(rate(999.0), "999");
        assert_eq!(dur(Duration::from_micros(48)), "48µs");
        assert_eq!(dur(Duration::from_micros(1234)), "1.23ms");
        assert_eq!(dur(Duration::from_secs(25)), "25s");
        assert_eq!(json_string("a\"b\n"), "\"a\\\"b\\n\"");
    }
}
