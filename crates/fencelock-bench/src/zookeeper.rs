//! The ZooKeeper part of the bench: ZooKeeper's own create+delete rate, measured with the same
//! client crate against the same ensemble in the same run, as the reference for the lock
//! figures.
//!
//! The reference is an ephemeral node created and deleted again under `/fencelock-bench/<run>`,
//! one client doing it pair after pair, then 64 tasks sharing that client's session (as the lock
//! runs share theirs). A create and a delete are two writes through the leader; an uncontended
//! fencelock acquire+release is the same two writes and one listing of the lock path (a read
//! served by the connected server), so a pair ratio near 1 means the lock adds nothing of its
//! own beyond that read.

use std::time::Duration;

use tokio::task::JoinSet;
use zookeeper_client::{Acls, Client, CreateMode};

use crate::engine::ZkTarget;
use crate::plumbing::{calls_per_s, rate, Out, Stop};
use crate::uncontended::Uncontended;
use crate::CONCURRENT_TASKS;

pub(crate) struct ZkReference {
    client: Client,
    base: String,
}

impl ZkReference {
    /// Opens a session of its own on the ensemble of a `zk://` URL.
    pub(crate) async fn open(target: &ZkTarget, run: &str) -> Result<ZkReference, String> {
        let mut connector = Client::connector().with_session_timeout(Duration::from_secs(10));
        if let (Some(u), Some(p)) = (&target.user, &target.password) {
            connector = connector.with_auth("digest", format!("{u}:{p}").as_bytes());
        }
        let connect = connector.connect(&target.connect);
        let client = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .map_err(|_| "no session within 10 s".to_owned())?
            .map_err(|e| e.to_string())?;
        let base = format!("/fencelock-bench/{run}");
        client
            .mkdir(&base, &CreateMode::Persistent.with_acls(Acls::anyone_all()))
            .await
            .map_err(|e| e.to_string())?;
        Ok(ZkReference { client, base })
    }

    /// Create+delete pairs per second: `tasks` tasks sharing the session, each on a node of
    /// its own, for `dur`.
    async fn pair_rate(&self, tasks: usize, dur: Duration, stop: &Stop) -> Result<f64, String> {
        let mut set = JoinSet::new();
        for t in 0..tasks {
            let c = self.client.clone();
            let path = format!("{}/k{t}", self.base);
            let stop = stop.clone();
            set.spawn(async move {
                let mode = CreateMode::Ephemeral.with_acls(Acls::anyone_all());
                let pair = || async {
                    c.create(&path, b"x", &mode)
                        .await
                        .map_err(|e| e.to_string())?;
                    c.delete(&path, None).await.map_err(|e| e.to_string())
                };
                calls_per_s(dur, &stop, pair).await
            });
        }
        let mut total = 0.0;
        while let Some(r) = set.join_next().await {
            total += r.map_err(|e| e.to_string())??;
        }
        Ok(total)
    }

    /// Measures the reference and prints it next to the lock figures, as ratios.
    pub(crate) async fn report(
        &self,
        out: &mut Out,
        dur: Duration,
        stop: &Stop,
        seq: &Uncontended,
        par: &Uncontended,
    ) {
        out.line(
            "reference: ZooKeeper create+delete of an ephemeral node, same client crate, same \
             ensemble; an acquire+release is those two writes and one listing",
        );
        for (label, key, tasks, r) in [
            ("1 client", "c1", 1, seq),
            ("64 tasks", "tasks64", CONCURRENT_TASKS, par),
        ] {
            match self.pair_rate(tasks, dur, stop).await {
                Ok(refs) => {
                    let ratio = r.ops_per_s / refs;
                    out.line(format!(
                        "  {label:<9} create+delete {:>8}/s  pairs {:>8}/s  pairs/reference {ratio:.2}",
                        rate(refs),
                        rate(r.ops_per_s),
                    ));
                    out.num(&format!("reference.zookeeper.{key}.pairs_per_s"), refs);
                    out.num(&format!("uncontended.{key}.zookeeper_ratio"), ratio);
                }
                Err(e) => out.line(format!("  {label:<9} unavailable: {e}")),
            }
        }
    }

    /// Deletes the reference's directory (its nodes are deleted as they are made).
    pub(crate) async fn clean(&self) -> Result<String, String> {
        self.client
            .delete(&self.base, None)
            .await
            .map_err(|e| e.to_string())?;
        // Other runs may be using the parent; it is removed only when empty.
        let _ = self.client.delete("/fencelock-bench", None).await;
        Ok(format!(
            "the ZooKeeper engine leaves only empty containers, which the servers delete; \
             reference path {} deleted",
            self.base
        ))
    }
}
