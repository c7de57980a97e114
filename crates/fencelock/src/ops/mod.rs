//! The operations built on the core's leases, for every engine alike: leader election and
//! the stuck-lock runbook. Engine-specific parts (native elections, forced release in one
//! atomic step) come to them through the engine contract, never by naming an engine.

pub(crate) mod election;
pub(crate) mod runbook;
