//! Native elections: the head of the waiter queue is the leader, as in etcd's `election.go`.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{KeyValue, PutOptions, Txn, TxnOp, WatchOptions};
use tokio::sync::watch;

use super::hold::Phase;
use super::EtcdEngine;
use crate::core::engine::Elections;
use crate::core::error::Result;
use crate::core::records::{publish, Leader};
use crate::core::token::FencingToken;

#[async_trait]
impl Elections for EtcdEngine {
    async fn leader(&self, name: &str) -> Result<Option<Leader>> {
        Ok(self.head(name).await?.map(|kv| leader_of(&kv)))
    }

    async fn proclaim(&self, _name: &str, owner: &str, value: &str) -> Result<bool> {
        let Some((h, rev)) = self.state().holds.get(owner).and_then(|h| match h.phase {
            Phase::Queued(rev) => Some((h.clone(), rev)),
            _ => None,
        }) else {
            return Ok(false);
        };
        // As election.go's Proclaim: rewrite the leader's key only while it is still the key
        // this campaign created.
        let txn = Txn::new()
            .when([h.key_unchanged(rev)])
            .and_then([TxnOp::put(
                h.key.clone(),
                value,
                Some(PutOptions::new().with_lease(h.session)),
            )]);
        let resp = self.txn("proclaim", txn).await?;
        Ok(resp.succeeded())
    }

    async fn observe(&self, name: &str, tx: &watch::Sender<Option<Leader>>) {
        let waiters = self.keys.waiters(name);
        loop {
            let step = async {
                // Read the leader, then watch the election's keys from just after that read:
                // no change between the two is missed.
                let resp = match self.read_head("read the leader", name).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::debug!(error = %e, "reading the leader failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        return;
                    }
                };
                publish(tx, resp.kvs().first().map(leader_of));
                let at = resp.header().map_or(0, |h| h.revision());
                let opts = WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(at + 1);
                let Ok(mut stream) = self
                    .watch("watch the election", waiters.clone(), opts)
                    .await
                else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    return;
                };
                // Any event may change the leader, and so may a failed watch: the loop reads
                // it again either way. Re-armed every operation timeout, as waiters are.
                let _ = self
                    .watch_until(&mut stream, |r| !r.events().is_empty() || r.canceled())
                    .await;
            };
            tokio::select! {
                _ = tx.closed() => return,
                _ = step => {}
            }
        }
    }
}

fn leader_of(kv: &KeyValue) -> Leader {
    Leader {
        value: String::from_utf8_lossy(kv.value()).into_owned(),
        token: FencingToken::from_stored(kv.create_revision()),
    }
}
