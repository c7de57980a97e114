//! Owner-checked renewal of a batch of leases on every node.

use std::time::Duration;

use super::node::{Node, NodeResult, ScriptCall};
use super::values::ms;
use super::votes::Verdict;
use super::{scripts, RedisEngine};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::Result;

/// Leases per extension script call: keeps each call's argument list and run time small.
const EXTEND_CHUNK: usize = 1000;

impl RedisEngine {
    /// Per lease: 1 extended, 0 not the holder, minus the cap (ms) when refused by it.
    async fn extend_on(&self, node: &Node, batch: &[Renewal]) -> NodeResult<Vec<i64>> {
        let mut out = Vec::with_capacity(batch.len());
        let limit = self.op_timeout;
        for chunk in batch.chunks(EXTEND_CHUNK) {
            let mut inv = ScriptCall::new(&scripts::EXTEND, 2 + chunk.len());
            inv.arg(&self.limits_key).arg(&self.held_key);
            for r in chunk {
                inv.arg(self.keys(&r.name).lock);
            }
            for r in chunk {
                inv.arg(&r.owner).arg(ms(r.ttl));
            }
            let flags: Vec<i64> = node.run(inv, limit).await?;
            if flags.len() != chunk.len() {
                return Err(format!(
                    "{}: unexpected reply to the extend script",
                    node.addr()
                ));
            }
            out.extend(flags);
        }
        Ok(out)
    }

    /// Each lease is extended when a quorum extended it, and lost when a quorum no longer can.
    pub(super) async fn extend_leases(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let per_node = self.ask(|n| self.extend_on(n, batch)).await;
        per_node.unless_every_node_failed()?;
        Ok((0..batch.len())
            .map(|i| {
                let refused_by = per_node.answers().map(|f| f[i]).min().filter(|f| *f < 0);
                match per_node.verdict(|flags| flags[i] == 1) {
                    Verdict::Yes => Renewed::Extended,
                    // Refused by a node's cap, and not extended on a quorum.
                    _ if refused_by.is_some() => Renewed::OverLimit(Duration::from_millis(
                        refused_by.map_or(0, i64::unsigned_abs),
                    )),
                    Verdict::No => Renewed::NotHolder,
                    Verdict::Open => {
                        Renewed::Failed("too few nodes confirmed the renewal".to_owned())
                    }
                }
            })
            .collect())
    }
}
