//! Owner-checked renewal of a batch of leases on every node.

use super::node::{Node, NodeResult};
use super::values::ms;
use super::votes::Verdict;
use super::{scripts, RedisEngine};
use crate::core::engine::{Renewal, Renewed};
use crate::core::error::Result;

/// Leases per extension script call: keeps each call's argument list and run time small.
const EXTEND_CHUNK: usize = 1000;

impl RedisEngine {
    async fn extend_on(&self, node: &Node, batch: &[Renewal]) -> NodeResult<Vec<bool>> {
        let mut out = Vec::with_capacity(batch.len());
        let limit = self.op_timeout;
        for chunk in batch.chunks(EXTEND_CHUNK) {
            let mut inv = scripts::EXTEND.prepare_invoke();
            for r in chunk {
                let k = self.keys(&r.name);
                inv.key(k.lock).key(k.meta).arg(&r.owner).arg(ms(r.ttl));
            }
            let flags: Vec<i64> = node.run(inv, limit).await?;
            if flags.len() != chunk.len() {
                return Err(format!(
                    "{}: unexpected reply to the extend script",
                    node.addr
                ));
            }
            out.extend(flags.into_iter().map(|f| f == 1));
        }
        Ok(out)
    }

    /// Each lease is extended when a quorum extended it, and lost when a quorum no longer can.
    pub(super) async fn extend_leases(&self, batch: &[Renewal]) -> Result<Vec<Renewed>> {
        let per_node = self.ask(|n| self.extend_on(n, batch)).await;
        per_node.unless_every_node_failed()?;
        Ok((0..batch.len())
            .map(|i| match per_node.verdict(|extended| extended[i]) {
                Verdict::Yes => Renewed::Extended,
                Verdict::No => Renewed::NotHolder,
                Verdict::Open => Renewed::Failed("too few nodes confirmed the renewal".to_owned()),
            })
            .collect())
    }
}
