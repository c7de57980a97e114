//! The etcd part of the bench: etcd's own write rate, measured with the same client
//! crate against the same cluster in the same run, as the reference for the lock figures.
//!
//! The reference is plain `Put`s on keys under `/fencelock-bench/<run>/`, one client doing them
//! one after another, then 64 tasks sharing that client (as the lock runs share theirs). Every
//! Put is one raft proposal; an uncontended fencelock acquire+release on etcd is four (lease
//! grant, the enqueue transaction, the owner-checked delete, the lease revocation), so a pair
//! rate near a quarter of the put rate means the lock adds nothing of its own.

use std::time::Duration;

use etcd_client::{DeleteOptions, PutOptions};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::engine::EtcdTarget;
use crate::plumbing::{rate, Out, Stop};
use crate::uncontended::Uncontended;
use crate::CONCURRENT_TASKS;

/// The raft proposals one uncontended acquire+release costs on etcd.
const WRITES_PER_PAIR: f64 = 4.0;

pub(crate) struct EtcdReference {
    client: etcd_client::Client,
    base: String,
}

impl EtcdReference {
    /// Connects to the cluster of an `etcd://` URL.
    pub(crate) async fn open(target: &EtcdTarget, run: &str) -> Result<EtcdReference, String> {
        if target.tls {
            return Err("the reference run speaks plain etcd://, not etcds://".to_owned());
        }
        let eps: Vec<String> = target
            .endpoints
            .iter()
            .map(|e| format!("http://{e}"))
            .collect();
        let mut opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(5));
        if let (Some(u), Some(p)) = (&target.user, &target.password) {
            opts = opts.with_user(u, p);
        }
        let client = etcd_client::Client::connect(eps, Some(opts))
            .await
            .map_err(|e| e.to_string())?;
        Ok(EtcdReference {
            client,
            base: format!("/fencelock-bench/{run}/"),
        })
    }

    /// Puts per second: `tasks` tasks sharing the client, each putting its own key for `dur`.
    async fn put_rate(&self, tasks: usize, dur: Duration, stop: &Stop) -> Result<f64, String> {
        let mut set = JoinSet::new();
        for t in 0..tasks {
            let mut c = self.client.clone();
            let key = format!("{}k{t}", self.base);
            let stop = stop.clone();
            set.spawn(async move {
                for _ in 0..20 {
                    c.put(key.clone(), "x", None::<PutOptions>)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                let (start, mut n) = (Instant::now(), 0u64);
                while start.elapsed() < dur && !stop.is_set() {
                    c.put(key.clone(), "x", None::<PutOptions>)
                        .await
                        .map_err(|e| e.to_string())?;
                    n += 1;
                }
                Ok::<f64, String>(n as f64 / start.elapsed().as_secs_f64())
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
        out.line(format!(
            "reference: etcd Put rate, same client crate, same cluster; an acquire+release is \
             {WRITES_PER_PAIR:.0} raft writes (grant, enqueue txn, delete txn, revoke)"
        ));
        for (label, key, tasks, r) in [
            ("1 client", "c1", 1, seq),
            ("64 tasks", "tasks64", CONCURRENT_TASKS, par),
        ] {
            match self.put_rate(tasks, dur, stop).await {
                Ok(puts) => {
                    let ratio = r.ops_per_s / puts;
                    out.line(format!(
                        "  {label:<9} Put {:>8}/s  pairs {:>8}/s  pairs/puts {ratio:.2}  \
                         writes/puts {:.2}",
                        rate(puts),
                        rate(r.ops_per_s),
                        ratio * WRITES_PER_PAIR
                    ));
                    out.num(&format!("reference.etcd.{key}.put_rps"), puts);
                    out.num(&format!("uncontended.{key}.etcd_ratio"), ratio);
                }
                Err(e) => out.line(format!("  {label:<9} unavailable: {e}")),
            }
        }
    }

    /// Deletes the reference keys.
    pub(crate) async fn clean(&self) -> Result<String, String> {
        let mut c = self.client.clone();
        c.delete(self.base.clone(), Some(DeleteOptions::new().with_prefix()))
            .await
            .map_err(|e| e.to_string())?;
        Ok(format!(
            "the etcd engine leaves no key behind a released lease; reference keys under {} \
             deleted",
            self.base
        ))
    }
}
