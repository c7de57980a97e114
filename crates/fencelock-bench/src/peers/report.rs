//! The side-by-side run's output: one line per round as it ends, then every figure as the
//! median over rounds for each library, fencelock's as a ratio of rslock's, and the targets
//! of the performance issue marked met or missed. With `--json` the same figures are one flat
//! object whose keys are listed in `docs/benchmarks.md`.

use std::time::Duration;

use super::{LibRound, Round, Setup, HOLD, TTL, WORKERS};
use crate::harness::Contention;
use crate::plumbing::{dur, rate, Out};
use crate::reference::median;

#[derive(Clone, Copy)]
enum Unit {
    Rate,
    Micros,
    Ratio,
}

/// One figure of one library in one round: its JSON key (under the library's name), the label
/// of its table row, how it reads, and its value (NaN where it has none).
struct Figure {
    key: String,
    label: String,
    unit: Unit,
    value: f64,
}

fn figures(lib: &LibRound, round_trip: Duration) -> Vec<Figure> {
    let f = |key: &str, label: &str, unit, value| Figure {
        key: key.to_owned(),
        label: label.to_owned(),
        unit,
        value,
    };
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let s = &lib.sequential;
    let mut out = vec![
        f(
            "sequential.pairs_per_s",
            "sequential: pairs/s",
            Unit::Rate,
            s.per_s,
        ),
        f(
            "sequential.acquire_p50_us",
            "sequential: acquire p50",
            Unit::Micros,
            us(s.acquire.p(50.0)),
        ),
        f(
            "sequential.release_p50_us",
            "sequential: release p50",
            Unit::Micros,
            us(s.release.p(50.0)),
        ),
    ];
    for (mode, c) in &lib.modes {
        let rtt = round_trip.as_secs_f64();
        let handoff = c.handoff.p(50.0);
        for (key, label, unit, value) in [
            ("acquisitions_per_s", "acquisitions/s", Unit::Rate, c.per_s),
            ("handoff_p50_us", "handoff p50", Unit::Micros, us(handoff)),
            (
                "handoff_over_round_trip",
                "handoff p50 / round trip",
                Unit::Ratio,
                handoff.as_secs_f64() / rtt,
            ),
            ("wait_p99_us", "wait p99", Unit::Micros, us(c.wait.p(99.0))),
            (
                "worker_max_over_min",
                "per-worker max/min",
                Unit::Ratio,
                c.ratio().unwrap_or(f64::NAN),
            ),
            ("hold_mean_us", "hold mean", Unit::Micros, us(c.hold_mean)),
            (
                "utilisation",
                "utilisation",
                Unit::Ratio,
                utilisation(c, round_trip),
            ),
        ] {
            out.push(f(
                &format!("{mode}.{key}"),
                &format!("{mode}: {label}"),
                unit,
                value,
            ));
        }
    }
    out
}

/// Acquisitions/s × (mean hold + the round trip): 1.0 for a lock handed over in one round trip.
fn utilisation(c: &Contention, round_trip: Duration) -> f64 {
    c.per_s * (c.hold_mean.as_secs_f64() + round_trip.as_secs_f64())
}

/// rslock's figure a fencelock figure is compared with: the same one, except that fair mode,
/// which rslock lacks, is compared with rslock's only mode.
fn counterpart(key: &str) -> String {
    match key.strip_prefix("fair.") {
        Some(rest) => format!("default.{rest}"),
        None => key.to_owned(),
    }
}

fn text(unit: Unit, v: f64) -> String {
    if !v.is_finite() {
        return "-".to_owned();
    }
    match unit {
        Unit::Rate => rate(v),
        Unit::Micros => dur(Duration::from_secs_f64(v.max(0.0) / 1e6)),
        Unit::Ratio => format!("{v:.2}"),
    }
}

/// The median over rounds of the finite values; NaN if none is.
fn median_of(values: impl Iterator<Item = f64>) -> f64 {
    median(values.filter(|v| v.is_finite()).collect()).unwrap_or(f64::NAN)
}

pub(super) fn header(out: &mut Out, s: &Setup) {
    let what = if s.engine == "redlock" {
        format!("Redlock over {} nodes", s.nodes.len())
    } else {
        "one Redis node".to_owned()
    };
    out.line(format!(
        "fencelock-bench peers: fencelock and rslock 0.10 on {what} ({}), {} round(s) of {} s \
         per run, names {}-*",
        s.nodes.join(", "),
        s.rounds,
        s.seconds,
        s.base
    ));
    out.line(format!(
        "harness: one process, a runtime with 2 worker threads, one client per library shared \
         by every worker; sequential acquire+release on distinct names; {WORKERS} workers on one \
         name, hold {}, TTL {}; rounds interleaved (odd: fencelock first, even: rslock first); \
         rslock retries: {} per lock call, random delay below {}",
        dur(HOLD),
        dur(TTL),
        s.retry.count,
        dur(s.retry.delay)
    ));
    out.text("command", "peers");
    out.text("engine", s.engine);
    out.num("nodes", s.nodes.len() as f64);
    out.num("rounds", f64::from(s.rounds));
    out.num("seconds", s.seconds as f64);
    out.num("workers", WORKERS as f64);
    out.micros("hold_us", HOLD);
    out.num("ttl_ms", TTL.as_secs_f64() * 1e3);
    out.num("rslock.retry_count", f64::from(s.retry.count));
    out.num("rslock.retry_delay_ms", s.retry.delay.as_secs_f64() * 1e3);
}

pub(super) fn round_line(out: &mut Out, r: u32, round: &Round) {
    let f = figures(&round.fencelock, round.round_trip);
    let s = figures(&round.rslock, round.round_trip);
    let get = |v: &[Figure], key: &str| {
        v.iter()
            .find(|x| x.key == key)
            .map_or(f64::NAN, |x| x.value)
    };
    out.line(format!(
        "round {r} ({} first): SET round trip p50 {}; sequential pairs/s fencelock {} rslock {}; \
         16 workers acquisitions/s fencelock {} (fair {}) rslock {}",
        round.first,
        dur(round.round_trip),
        rate(get(&f, "sequential.pairs_per_s")),
        rate(get(&s, "sequential.pairs_per_s")),
        rate(get(&f, "default.acquisitions_per_s")),
        rate(get(&f, "fair.acquisitions_per_s")),
        rate(get(&s, "default.acquisitions_per_s")),
    ));
    let p = format!("round.{r}");
    out.text(&format!("{p}.first"), round.first);
    out.micros(&format!("{p}.round_trip_p50_us"), round.round_trip);
    for (lib, figs) in [("fencelock", &f), ("rslock", &s)] {
        for x in figs.iter() {
            out.num(&format!("{p}.{lib}.{}", x.key), x.value);
        }
    }
    for (kind, pairs) in &round.floors {
        out.num(
            &format!("{p}.floor.{}.pairs_per_s", kind.key()),
            pairs.per_s,
        );
    }
    if let Some(c) = &round.handoff {
        out.num(
            &format!("{p}.floor.fair_handoff.utilisation"),
            utilisation(c, round.round_trip),
        );
    }
    let timeouts: u64 = round
        .fencelock
        .modes
        .iter()
        .chain(&round.rslock.modes)
        .map(|(_, c)| c)
        .chain(&round.handoff)
        .map(|c| c.timeouts)
        .sum();
    if timeouts > 0 {
        out.line(format!(
            "  {timeouts} acquire(s) waited the whole {} without the lock",
            dur(super::WAIT)
        ));
    }
}

pub(super) fn summary(out: &mut Out, setup: &Setup, rounds: &[Round]) {
    let per_round: Vec<(Vec<Figure>, Vec<Figure>)> = rounds
        .iter()
        .map(|r| {
            (
                figures(&r.fencelock, r.round_trip),
                figures(&r.rslock, r.round_trip),
            )
        })
        .collect();
    let value = |v: &[Figure], key: &str| {
        v.iter()
            .find(|x| x.key == key)
            .map_or(f64::NAN, |x| x.value)
    };
    let med = |lib: usize, key: &str| {
        median_of(
            per_round
                .iter()
                .map(|(f, s)| value(if lib == 0 { f } else { s }, key)),
        )
    };
    // A ratio is the median over rounds of the same round's ratio, so that drift between rounds
    // cancels out.
    let ratio = |key: &str| {
        let other = counterpart(key);
        median_of(
            per_round
                .iter()
                .map(|(f, s)| value(f, key) / value(s, &other)),
        )
    };
    let round_trip = median_of(rounds.iter().map(|r| r.round_trip.as_secs_f64() * 1e6));

    out.line(String::new());
    out.line(format!(
        "{:<50} {:>10} {:>10} {:>17}",
        format!("median of {} round(s)", rounds.len()),
        "fencelock",
        "rslock",
        "fencelock/rslock"
    ));
    let Some((first, _)) = per_round.first() else {
        return;
    };
    for x in first {
        let (f, s) = (med(0, &x.key), med(1, &counterpart(&x.key)));
        let r = ratio(&x.key);
        let label = if x.key.starts_with("fair.") {
            format!("{} (rslock: default)", x.label)
        } else {
            x.label.clone()
        };
        out.line(format!(
            "{label:<50} {:>10} {:>10} {:>17}",
            text(x.unit, f),
            text(x.unit, s),
            text(Unit::Ratio, r)
        ));
        out.num(&format!("fencelock.{}", x.key), f);
        if !x.key.starts_with("fair.") {
            out.num(&format!("rslock.{}", x.key), s);
        }
        out.num(&format!("ratio.{}", x.key), r);
    }
    out.line(format!(
        "{:<50} {:>10}",
        "SET round trip p50, first node",
        text(Unit::Micros, round_trip)
    ));
    out.num("round_trip_p50_us", round_trip);
    out.line(
        "ratio: median over rounds of the same round's fencelock / rslock (above 1 is better \
         for rates, below 1 for latencies); handoff: a release starts -> the next holder's \
         acquire returns; utilisation: acquisitions/s x (mean hold + round trip), 1.0 = the \
         lock handed over in one round trip",
    );

    floors(out, rounds);
    handoff_floor(out, rounds);

    out.line(String::new());
    out.line("targets (performance issue, Redis):");
    let targets: Vec<(&str, String, f64, bool)> = if setup.engine == "redlock" {
        let seq = ratio("sequential.pairs_per_s");
        let default = ratio("default.acquisitions_per_s");
        let fair = ratio("fair.acquisitions_per_s");
        let spread = med(0, "fair.worker_max_over_min");
        let wait = med(0, "fair.wait_p99_us");
        vec![
            (
                "sequential",
                "sequential pairs/s >= 1.0x rslock".into(),
                seq,
                seq >= 1.0,
            ),
            (
                "default_acquisitions",
                "16 workers, default: acquisitions/s >= 1.0x rslock".into(),
                default,
                default >= 1.0,
            ),
            (
                "fair_acquisitions",
                "16 workers, fair: acquisitions/s >= 1.0x rslock's".into(),
                fair,
                fair >= 1.0,
            ),
            (
                "fair_max_over_min",
                "fair: per-worker max/min <= 1.1".into(),
                spread,
                spread <= 1.1,
            ),
            (
                "fair_wait_p99",
                "fair: wait p99 <= 50 ms (value in ms)".into(),
                wait / 1e3,
                wait <= 50_000.0,
            ),
        ]
    } else {
        let seq = ratio("sequential.pairs_per_s");
        let util = med(0, "fair.utilisation");
        let handoff = med(0, "fair.handoff_over_round_trip");
        let default_over_fair = median_of(per_round.iter().map(|(f, _)| {
            value(f, "default.acquisitions_per_s") / value(f, "fair.acquisitions_per_s")
        }));
        out.num("fencelock.default_over_fair", default_over_fair);
        vec![
            (
                "sequential",
                "sequential pairs/s >= 0.9x rslock".into(),
                seq,
                seq >= 0.9,
            ),
            (
                "fair_utilisation",
                "fair: utilisation >= 0.95".into(),
                util,
                util >= 0.95,
            ),
            (
                "fair_handoff",
                "fair: handoff p50 <= 3x the round trip".into(),
                handoff,
                handoff <= 3.0,
            ),
            (
                "default_vs_fair",
                "default acquisitions/s >= fair's (default / fair)".into(),
                default_over_fair,
                default_over_fair >= 1.0,
            ),
        ]
    };
    for (id, what, v, met) in targets {
        // A figure that could not be measured (NaN) compares false: missed, not met.
        let verdict = if met { "met" } else { "missed" };
        out.line(format!(
            "  {what:<56} {:>8}  {verdict}",
            text(Unit::Ratio, v)
        ));
        out.text(&format!("target.{id}"), verdict);
    }
}

/// The floors of the sequential figure (see `floor.rs`): each as pairs/s, as a ratio of
/// rslock's and as what fencelock reaches of it, medians of the same round's ratios.
fn floors(out: &mut Out, rounds: &[Round]) {
    let Some(first) = rounds.first() else {
        return;
    };
    out.line(String::new());
    out.line(format!(
        "{:<50} {:>10} {:>10} {:>17}",
        "floors: sequential pairs/s", "pairs/s", "/ rslock", "fencelock / this"
    ));
    for (i, (kind, _)) in first.floors.iter().enumerate() {
        let of = |r: &Round| r.floors.get(i).map_or(f64::NAN, |(_, p)| p.per_s);
        let per_s = median_of(rounds.iter().map(of));
        let vs_rslock = median_of(rounds.iter().map(|r| of(r) / r.rslock.sequential.per_s));
        let fencelock = median_of(rounds.iter().map(|r| r.fencelock.sequential.per_s / of(r)));
        out.line(format!(
            "{:<50} {:>10} {:>10} {:>17}",
            kind.label(),
            text(Unit::Rate, per_s),
            text(Unit::Ratio, vs_rslock),
            text(Unit::Ratio, fencelock)
        ));
        out.num(&format!("floor.{}.pairs_per_s", kind.key()), per_s);
        out.num(&format!("floor.{}.over_rslock", kind.key()), vs_rslock);
        out.num(&format!("floor.{}.fencelock_over", kind.key()), fencelock);
    }
    out.line(
        "floors: the bare redis crate on every node at once, no client work around the calls; \
         fencelock's scripts are the engine's own for one uncontended pair, the minimal pair is \
         SET NX PX + INCR in one script and rslock's compare-and-delete, MULTI the same \
         without the acquire script (not a safe design: see docs/benchmarks.md)",
    );
}

/// One node: the least fair handoff's contended figures (see `handoff.rs`), medians over
/// rounds, and fencelock's fair utilisation as a share of the floor's, the median of the same
/// round's ratios.
fn handoff_floor(out: &mut Out, rounds: &[Round]) {
    if rounds.iter().all(|r| r.handoff.is_none()) {
        return;
    }
    let of = |f: fn(&Contention, Duration) -> f64| {
        median_of(
            rounds
                .iter()
                .filter_map(|r| r.handoff.as_ref().map(|c| f(c, r.round_trip))),
        )
    };
    let fair = |r: &Round| {
        r.fencelock
            .modes
            .iter()
            .find(|(m, _)| *m == "fair")
            .map_or(f64::NAN, |(_, c)| utilisation(c, r.round_trip))
    };
    let fencelock_over = median_of(rounds.iter().filter_map(|r| {
        r.handoff
            .as_ref()
            .map(|c| fair(r) / utilisation(c, r.round_trip))
    }));
    out.line(String::new());
    out.line(format!(
        "{:<50} {:>10}",
        "floor: fair handoff, 16 workers", "median"
    ));
    for (key, label, unit, v) in [
        (
            "acquisitions_per_s",
            "acquisitions/s",
            Unit::Rate,
            of(|c, _| c.per_s),
        ),
        (
            "handoff_p50_us",
            "handoff p50",
            Unit::Micros,
            of(|c, _| c.handoff.p(50.0).as_secs_f64() * 1e6),
        ),
        (
            "handoff_over_round_trip",
            "handoff p50 / round trip",
            Unit::Ratio,
            of(|c, rtt| c.handoff.p(50.0).as_secs_f64() / rtt.as_secs_f64()),
        ),
        ("utilisation", "utilisation", Unit::Ratio, of(utilisation)),
        (
            "fencelock_over",
            "fencelock fair utilisation / this",
            Unit::Ratio,
            fencelock_over,
        ),
    ] {
        out.line(format!("{label:<50} {:>10}", text(unit, v)));
        out.num(&format!("floor.fair_handoff.{key}"), v);
    }
    out.line(
        "floor: the least FIFO lock whose release hands on: SET NX PX or a place in a list to \
         acquire; a release that checks the owner, pops the next waiter, sets the lock to it \
         with the next token and publishes that on the client's channel (5 calls; not a safe \
         design: see docs/benchmarks.md)",
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fair_mode_is_compared_with_rslocks_only_mode() {
        assert_eq!(counterpart("fair.handoff_p50_us"), "default.handoff_p50_us");
        assert_eq!(counterpart("default.wait_p99_us"), "default.wait_p99_us");
        assert_eq!(
            counterpart("sequential.pairs_per_s"),
            "sequential.pairs_per_s"
        );
        assert!(median_of([f64::NAN, 2.0, 4.0, 3.0].into_iter()) == 3.0);
        assert!(median_of([f64::NAN].into_iter()).is_nan());
    }
}
