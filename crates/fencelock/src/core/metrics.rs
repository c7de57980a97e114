//! Metrics through the `metrics` facade: the library records, the application chooses the
//! exporter (the `fencelock` binary serves Prometheus text with `--metrics-addr`). An
//! acquisition records two series (its latency, and the TTL or the failure).
//!
//! Everything is recorded in the core (acquire loop, lease, watchdog), so every engine reports
//! the same series; the exception is the per-node pair ([`NODE_UP`], [`NODE_CALL_FAILURES`]),
//! which only the engine can see, recorded through this module so its labels stay uniform.
//!
//! Every series of a lock carries a `backend` label as well, after `engine`: the backend's name
//! in a client routed by prefix ([`Client::routed`](crate::Client::routed)), `default` for a
//! client opened on one URL.
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | [`ACQUIRE_DURATION`] | histogram | `engine`, `backend`, `resource`, `outcome` | one `acquire`/`try_acquire` call, waiting included |
//! | [`ACQUIRE_FAILURES`] | counter | `engine`, `backend`, `resource`, `reason` | acquisitions that returned an error |
//! | [`HOLD_DURATION`] | histogram | `engine`, `backend`, `resource` | from grant to release, loss or drop |
//! | [`LEASE_TTL`] | gauge | `engine`, `backend`, `resource` | the TTL of the latest grant |
//! | [`RENEWALS`] | counter | `engine`, `backend`, `resource` | renewal attempts, one per lease |
//! | [`RENEWAL_FAILURES`] | counter | `engine`, `backend`, `resource` | renewal attempts that did not extend the lease |
//! | [`LEASES_LOST`] | counter | `engine`, `backend`, `resource`, `reason` | leases marked lost |
//! | [`STALE_TOKEN_REJECTIONS`] | counter | `resource` | writes refused by a [fence](crate::fence) |
//! | [`NODE_UP`] | gauge | `engine`, `node` | whether the latest call to a Redis node reached it (set at the first call and whenever that changes) |
//! | [`NODE_CALL_FAILURES`] | counter | `engine`, `node` | calls to a Redis node that did not reach it |
//!
//! `outcome` is one of `acquired`, `held`, `timed_out`, `error`, `invalid`, `limit`; an acquire
//! failure's `reason` is `held` (one attempt found the lock held), `timed_out` (the wait ran
//! out), `engine`, `invalid` or `limit` (a limit stored in the engine refused it). A lease is
//! lost for `expired` (its validity ended without a confirmed renewal), `not_holder` (the
//! engine lists another owner, or none) or `renewals_failed`. An
//! acquisition whose future is dropped is not recorded: it has no outcome.
//!
//! The watchdog renews many leases in one engine call; [`RENEWALS`] still counts one attempt
//! per lease, so failure ratios mean the same whatever the batching. Explicit
//! [`Lease::extend`](crate::Lease::extend) calls count as renewals too.
//!
//! Counters start at zero (failure and loss counters at a resource's first acquisition in the
//! process, a node's failure counter at its first call in the process, the stale-token counter
//! once a fence has accepted a write for it): Prometheus' `increase()` cannot see the first
//! increment of a series that appears with it. Install the recorder before the first acquisition: the zero
//! is recorded once, not again at every acquisition, which would cost the uncontended path
//! more than the rest of the client's work.
//!
//! Engine calls are traced as well: each runs in a `tracing` span `engine_call` with fields
//! `engine`, `resource` (for a batch of renewals, their count) and `outcome` (`ok`, `error`
//! with an `error` field, or `timeout`), inside an `acquire` span for acquisitions whose
//! `outcome` is the label above.
//!
//! # Bounded resource labels
//! Resource names are labels. To bound their cardinality, at most [`MAX_RESOURCE_LABELS`]
//! distinct names are used as label values per process; later names, and names that are not
//! valid resource names, are recorded under `resource="other"`.
//!
//! # Histogram buckets
//! The facade records raw observations; the exporter chooses buckets. Alert rules that take
//! quantiles across processes need real buckets (Prometheus `_bucket` series), not per-process
//! summaries: configure [`ACQUIRE_DURATION_BUCKETS`] and [`HOLD_DURATION_BUCKETS`], as the
//! `fencelock` binary does with `metrics-exporter-prometheus`:
//!
//! ```no_run
//! # fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//! use fencelock::metrics;
//!
//! PrometheusBuilder::new()
//!     .with_http_listener(([127, 0, 0, 1], 9464))
//!     .set_buckets_for_metric(
//!         Matcher::Full(metrics::ACQUIRE_DURATION.into()),
//!         metrics::ACQUIRE_DURATION_BUCKETS,
//!     )?
//!     .set_buckets_for_metric(
//!         Matcher::Full(metrics::HOLD_DURATION.into()),
//!         metrics::HOLD_DURATION_BUCKETS,
//!     )?
//!     .install()?;
//! metrics::describe();
//! # Ok(()) }
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use metrics::Unit;

use crate::core::error::ErrorKind;

/// The number of distinct resource names used as label values before folding into `other`.
pub const MAX_RESOURCE_LABELS: usize = 200;

/// Acquisition latency in seconds (waiting included), by engine, resource and outcome.
pub const ACQUIRE_DURATION: &str = "fencelock_acquire_duration_seconds";

/// Failed acquisitions, by engine, resource and reason (`held`, `timed_out`, `engine`,
/// `invalid`, `limit`).
pub const ACQUIRE_FAILURES: &str = "fencelock_acquire_failures_total";

/// Time from grant to release, loss or drop of a lease in seconds, by engine and resource.
pub const HOLD_DURATION: &str = "fencelock_hold_duration_seconds";

/// The TTL of the latest grant in seconds, by engine and resource: what hold durations are
/// compared against.
pub const LEASE_TTL: &str = "fencelock_lease_ttl_seconds";

/// Renewal attempts, one per lease (the watchdog's batches included), by engine and resource.
pub const RENEWALS: &str = "fencelock_renewals_total";

/// Renewal attempts that did not extend the lease (engine error, no answer in time, too few
/// nodes, not the holder, confirmed too late), by engine and resource.
pub const RENEWAL_FAILURES: &str = "fencelock_renewal_failures_total";

/// Leases marked lost, by engine, resource and reason (`expired`, `not_holder`,
/// `renewals_failed`).
pub const LEASES_LOST: &str = "fencelock_leases_lost_total";

/// Whether the latest call to one node of a multi-node engine reached it (1) or not (0), by
/// engine and node (`host:port`). Recorded by the engine at the node's first call and whenever
/// its state changes: with one Redlock node down acquisitions still succeed, so this is the
/// series that shows it.
pub const NODE_UP: &str = "fencelock_node_up";

/// Calls to one node that did not reach it (no connection, no answer in time, credentials
/// refused), by engine and node.
pub const NODE_CALL_FAILURES: &str = "fencelock_node_call_failures_total";

/// Stale-token rejections by fences, by resource.
pub const STALE_TOKEN_REJECTIONS: &str = "fencelock_stale_token_rejections_total";

/// Suggested histogram buckets for [`ACQUIRE_DURATION`], in seconds: from an uncontended
/// round trip on loopback to a minute of waiting.
pub const ACQUIRE_DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Suggested histogram buckets for [`HOLD_DURATION`], in seconds: dense around common TTLs
/// (5 s to 2 min) so that a quantile can be compared with half of one, up to a day.
pub const HOLD_DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0, 21600.0, 86400.0,
];

/// Registers units and help texts for every metric with the installed recorder. Call it once
/// after installing one; metrics are recorded whether or not it is called.
pub fn describe() {
    metrics::describe_histogram!(
        ACQUIRE_DURATION,
        Unit::Seconds,
        "Time an acquire call took, waiting included, by outcome"
    );
    metrics::describe_counter!(
        ACQUIRE_FAILURES,
        "Acquire calls that failed, by reason (held, timed_out, engine, invalid, limit)"
    );
    metrics::describe_histogram!(
        HOLD_DURATION,
        Unit::Seconds,
        "Time from grant to release, loss or drop of a lease"
    );
    metrics::describe_gauge!(LEASE_TTL, Unit::Seconds, "TTL of the latest grant");
    metrics::describe_counter!(RENEWALS, "Renewal attempts, one per lease");
    metrics::describe_counter!(
        RENEWAL_FAILURES,
        "Renewal attempts that did not extend the lease"
    );
    metrics::describe_counter!(
        LEASES_LOST,
        "Leases marked lost, by reason (expired, not_holder, renewals_failed)"
    );
    metrics::describe_gauge!(
        NODE_UP,
        "Whether the latest call to this engine node reached it (1) or not (0)"
    );
    metrics::describe_counter!(
        NODE_CALL_FAILURES,
        "Calls to this engine node that did not reach it"
    );
    metrics::describe_counter!(
        STALE_TOKEN_REJECTIONS,
        "Writes refused by a fence because their token was stale"
    );
}

/// A label value shared by a lease's series without a copy per record: the resource and
/// backend labels are made once (a resource's at its acquisition) and only their reference
/// counts move after that.
pub(crate) type Label = metrics::SharedString;

/// The label value for `resource`: the name itself while fewer than
/// [`MAX_RESOURCE_LABELS`] names have been seen, else `other`.
pub(crate) fn resource_label(resource: &str) -> Label {
    static SEEN: OnceLock<Mutex<HashSet<Arc<str>>>> = OnceLock::new();
    // An invalid name may be huge or full of control characters: never a label.
    if crate::core::name::validate_name(resource).is_err() {
        return Label::const_str("other");
    }
    let mut seen = process_wide(&SEEN);
    if let Some(known) = seen.get(resource) {
        return Label::from(known.clone());
    }
    if seen.len() < MAX_RESOURCE_LABELS {
        let known: Arc<str> = resource.into();
        seen.insert(known.clone());
        return Label::from(known);
    }
    Label::const_str("other")
}

/// Why a lease was lost, as the `reason` label of [`LEASES_LOST`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// Its validity ended without a confirmed renewal.
    Expired,
    /// The engine lists another owner, or none.
    NotHolder,
    /// Too many renewals in a row failed.
    RenewalsFailed,
}

impl Loss {
    fn label(self) -> &'static str {
        match self {
            Loss::Expired => "expired",
            Loss::NotHolder => "not_holder",
            Loss::RenewalsFailed => "renewals_failed",
        }
    }
}

/// Records the end of one acquisition: `Ok(ttl)` of the grant, or the error's kind. Returns
/// the outcome label, for the caller's span.
pub(crate) fn acquire_finished(
    engine: &'static str,
    backend: &Label,
    label: &Label,
    elapsed: Duration,
    result: Result<Duration, ErrorKind>,
) -> &'static str {
    let (outcome, reason) = match result {
        Ok(_) => ("acquired", None),
        Err(ErrorKind::HeldByAnother) => ("held", Some("held")),
        Err(ErrorKind::TimedOut) => ("timed_out", Some("timed_out")),
        Err(ErrorKind::InvalidInput) => ("invalid", Some("invalid")),
        Err(ErrorKind::LimitExceeded) => ("limit", Some("limit")),
        Err(_) => ("error", Some("engine")),
    };
    metrics::histogram!(
        ACQUIRE_DURATION,
        "engine" => engine,
        "backend" => backend.clone(),
        "resource" => label.clone(),
        "outcome" => outcome
    )
    .record(elapsed.as_secs_f64());
    // Every reason's series exists from the resource's first acquisition on: `increase()`
    // cannot see the first increment of a series that appears with it. Registered once: ten
    // series touched on every acquisition cost more than the rest of the client's work.
    let first = first_sight(engine, backend, label);
    for r in ["held", "timed_out", "engine", "invalid", "limit"] {
        if first || reason == Some(r) {
            metrics::counter!(
                ACQUIRE_FAILURES,
                "engine" => engine,
                "backend" => backend.clone(),
                "resource" => label.clone(),
                "reason" => r
            )
            .increment(u64::from(reason == Some(r)));
        }
    }
    if let Ok(ttl) = result {
        metrics::gauge!(LEASE_TTL, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone())
            .set(ttl.as_secs_f64());
    }
    if first {
        metrics::counter!(RENEWALS, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone()).increment(0);
        metrics::counter!(RENEWAL_FAILURES, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone())
            .increment(0);
        for loss in [Loss::Expired, Loss::NotHolder, Loss::RenewalsFailed] {
            lease_lost_by(engine, backend, label, loss, 0);
        }
    }
    outcome
}

/// The process-wide state behind `cell`, made on first use. A poisoned lock is taken as it is:
/// the state is sets of names, which no panic leaves half-written.
fn process_wide<T: Default>(cell: &'static OnceLock<Mutex<T>>) -> MutexGuard<'static, T> {
    cell.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// Whether this process records the first acquisition of `label` by `engine` and `backend`:
/// the one that starts the resource's counters at zero. Bounded as the labels are.
fn first_sight(engine: &'static str, backend: &str, label: &str) -> bool {
    type Seen = HashMap<&'static str, HashMap<String, HashSet<String>>>;
    static SEEN: OnceLock<Mutex<Seen>> = OnceLock::new();
    let mut seen = process_wide(&SEEN);
    let labels = seen.entry(engine).or_default();
    if labels.get(backend).is_some_and(|l| l.contains(label)) {
        return false;
    }
    labels
        .entry(backend.to_owned())
        .or_default()
        .insert(label.to_owned());
    true
}

pub(crate) fn hold_ended(engine: &'static str, backend: &Label, label: &Label, held: Duration) {
    metrics::histogram!(HOLD_DURATION, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone())
        .record(held.as_secs_f64());
}

pub(crate) fn renewal(engine: &'static str, backend: &Label, label: &Label, extended: bool) {
    metrics::counter!(RENEWALS, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone()).increment(1);
    if !extended {
        metrics::counter!(RENEWAL_FAILURES, "engine" => engine, "backend" => backend.clone(), "resource" => label.clone())
            .increment(1);
    }
}

pub(crate) fn lease_lost(engine: &'static str, backend: &Label, label: &Label, loss: Loss) {
    lease_lost_by(engine, backend, label, loss, 1);
}

fn lease_lost_by(engine: &'static str, backend: &Label, label: &Label, loss: Loss, n: u64) {
    metrics::counter!(
        LEASES_LOST,
        "engine" => engine,
        "backend" => backend.clone(),
        "resource" => label.clone(),
        "reason" => loss.label()
    )
    .increment(n);
}

/// A call to `node` of an engine reached it or not, where that differs from the previous
/// call's (or the call failed, or it is the node's `first` call in its client). The caller
/// keeps the last state per node: the gauge moves only when it changes, and the failure
/// counter starts at zero with the first call, so that `increase()` sees its first failure.
/// A series recorded on every call would cost the node's callers more than the rest of their
/// client work.
pub(crate) fn node_answered(engine: &'static str, node: &str, reached: bool, first: bool) {
    metrics::gauge!(NODE_UP, "engine" => engine, "node" => node.to_owned()).set(if reached {
        1.0
    } else {
        0.0
    });
    if !reached || first {
        metrics::counter!(NODE_CALL_FAILURES, "engine" => engine, "node" => node.to_owned())
            .increment(u64::from(!reached));
    }
}

/// A fence met `resource` (an in-memory fence the first time, a remote one at every accepted
/// write; registering is idempotent): its rejection series starts at zero, so that the first
/// burst of rejections shows in `increase()`.
pub(crate) fn fence_met(resource: &str) {
    metrics::counter!(STALE_TOKEN_REJECTIONS, "resource" => resource_label(resource)).increment(0);
}

pub(crate) fn stale_token_rejected(resource: &str) {
    metrics::counter!(STALE_TOKEN_REJECTIONS, "resource" => resource_label(resource)).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_names_are_never_labels() {
        assert_eq!(&*resource_label(""), "other");
        assert_eq!(&*resource_label("a\nb"), "other");
        assert_eq!(&*resource_label(&"x".repeat(300)), "other");
        assert_eq!(&*resource_label("metrics-unit-valid"), "metrics-unit-valid");
    }

    #[test]
    fn buckets_increase() {
        for b in [ACQUIRE_DURATION_BUCKETS, HOLD_DURATION_BUCKETS] {
            assert!(b.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
