//! Metrics through the `metrics` facade: the library records, the application chooses the
//! exporter (the `fencelock` binary serves Prometheus text with `--metrics-addr`).
//!
//! Resource names are labels. To bound their cardinality, at most [`MAX_RESOURCE_LABELS`]
//! distinct names are used as label values per process; later names are recorded under
//! `resource="other"`.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// The number of distinct resource names used as label values before folding into `other`.
pub const MAX_RESOURCE_LABELS: usize = 200;

/// Stale-token rejections by fences, by resource.
pub const STALE_TOKEN_REJECTIONS: &str = "fencelock_stale_token_rejections_total";

/// The label value for `resource`: the name itself while fewer than
/// [`MAX_RESOURCE_LABELS`] names have been seen, else `other`.
pub(crate) fn resource_label(resource: &str) -> String {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if seen.contains(resource) {
        return resource.to_owned();
    }
    if seen.len() < MAX_RESOURCE_LABELS {
        seen.insert(resource.to_owned());
        return resource.to_owned();
    }
    "other".to_owned()
}

pub(crate) fn stale_token_rejected(resource: &str) {
    metrics::counter!(STALE_TOKEN_REJECTIONS, "resource" => resource_label(resource)).increment(1);
}
