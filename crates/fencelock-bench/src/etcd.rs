//! The etcd part of the bench: etcd's own write rate, measured with the same client
//! crate against the same cluster in the same run, as the reference for the lock figures.
//!
//! The reference is plain `Put`s on keys under `/fencelock-bench/<run>/`, one client doing them
//! one after another, then 64 tasks sharing that client (as the lock runs share theirs). Every
//! Put is one raft proposal; an uncontended fencelock acquire+release on etcd is two (the
//! enqueue transaction on the client's session, the owner-checked delete), so a pair rate near
//! half the put rate means the lock adds nothing of its own. The bench counts those writes
//! rather than trusting this: etcd's `etcd_server_proposals_committed_total` (its `/metrics`
//! on the first endpoint) before and after a run of sequential pairs.
//!
//! A third figure is the floor of a Rust client: the engine's own two requests of one pair
//! (the enqueue transaction, which creates the waiter key on a session lease and reads the
//! queue's head, and the owner-checked delete) sent through the bare client one after the
//! other, with nothing around them. `driver / puts` is what those two transactions cost etcd
//! against two Puts, `fencelock / driver` what fencelock's client adds. Below it, the two
//! writes alone: a Put of the waiter key on the session lease and a plain Delete, without the
//! enqueue's compare and head read or the delete's owner check (not a lock: nothing tells its
//! caller whether it holds anything). What separates that from two plain Puts is the lease;
//! what separates the driver from it is the recipe's reads and compares.

use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use tokio::task::JoinSet;

use crate::engine::EtcdTarget;
use crate::plumbing::{calls_per_s, rate, Out, Stop};
use crate::uncontended::Uncontended;
use crate::CONCURRENT_TASKS;

/// The raft proposals one uncontended acquire+release costs on etcd, when they cannot be
/// counted (no `/metrics` over plain HTTP on the first endpoint).
const WRITES_PER_PAIR: f64 = 2.0;

/// Sequential pairs whose raft writes are counted.
const COUNTED_PAIRS: u32 = 50;

pub(crate) struct EtcdReference {
    client: etcd_client::Client,
    base: String,
    /// `host:port` of the first member, whose `/metrics` counts raft proposals.
    metrics_at: String,
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
            metrics_at: target
                .endpoints
                .first()
                .map(ToString::to_string)
                .unwrap_or_default(),
        })
    }

    /// etcd's count of raft proposals committed, read from the first member's `/metrics`.
    async fn proposals(&self) -> Result<u64, String> {
        let at = self.metrics_at.clone();
        let read = tokio::task::spawn_blocking(move || -> Result<u64, String> {
            use std::io::{Read, Write};
            let addr = std::net::ToSocketAddrs::to_socket_addrs(&at)
                .map_err(|e| e.to_string())?
                .next()
                .ok_or("no address")?;
            let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| e.to_string())?;
            write!(s, "GET /metrics HTTP/1.0\r\nHost: {at}\r\n\r\n").map_err(|e| e.to_string())?;
            let mut body = String::new();
            s.read_to_string(&mut body).map_err(|e| e.to_string())?;
            body.lines()
                .find_map(|l| l.strip_prefix("etcd_server_proposals_committed_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .map(|v| v as u64)
                .ok_or_else(|| "no etcd_server_proposals_committed_total in /metrics".to_owned())
        });
        read.await.map_err(|e| e.to_string())?
    }

    /// Raft writes per uncontended acquire+release, counted over [`COUNTED_PAIRS`] pairs on
    /// `name` after one that may grant the client's session. Other writers to the cluster
    /// during the count inflate it.
    async fn writes_per_pair(&self, client: &fencelock::Client, name: &str) -> Result<f64, String> {
        let opts = fencelock::LockOptions::default().ttl(Duration::from_secs(30));
        let pair = || async {
            let lease = client
                .try_acquire(name, &opts)
                .await
                .map_err(|e| e.to_string())?;
            lease.release().await.map_err(|e| e.to_string())
        };
        pair().await?;
        let before = self.proposals().await?;
        for _ in 0..COUNTED_PAIRS {
            pair().await?;
        }
        let after = self.proposals().await?;
        Ok(after.saturating_sub(before) as f64 / f64::from(COUNTED_PAIRS))
    }

    /// The engine's two requests of an uncontended pair through the bare client, for `dur`
    /// after 20 untimed pairs: pairs per second; with `writes_only`, only their two writes (a
    /// Put on the lease and a plain Delete). The session lease is granted once, as the
    /// engine's is, and revoked at the end.
    async fn driver_pairs(
        &self,
        dur: Duration,
        stop: &Stop,
        writes_only: bool,
    ) -> Result<f64, String> {
        let mut c = self.client.clone();
        let lease = c
            .lease_grant(30, None)
            .await
            .map_err(|e| e.to_string())?
            .id();
        let waiters = format!("{}driver/", self.base);
        let key = format!("{waiters}{lease:x}");
        // A holder record of the engine's size (owner, host, pid, client, times, TTL).
        let value = format!(
            "owner={:032x}\nhost=bench-host\npid=4242\nclient=fencelock-bench\n\
             acquired_at=1764892800000\nttl=30000",
            1u128
        );
        let head = TxnOp::get(
            waiters.clone(),
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1),
            ),
        );
        let pair = || {
            let (mut c, key, value, head) = (c.clone(), key.clone(), value.clone(), head.clone());
            async move {
                let on_lease = Some(PutOptions::new().with_lease(lease));
                if writes_only {
                    c.put(key.clone(), value, on_lease)
                        .await
                        .map_err(|e| e.to_string())?;
                    c.delete(key, None).await.map_err(|e| e.to_string())?;
                    return Ok(());
                }
                let enqueue = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key.clone(), value, on_lease), head.clone()])
                    .or_else([TxnOp::get(key.clone(), None), head]);
                let resp = c.txn(enqueue).await.map_err(|e| e.to_string())?;
                let rev = resp
                    .header()
                    .map(|h| h.revision())
                    .ok_or("no header in the enqueue's answer")?;
                let delete = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
                    .and_then([TxnOp::delete(key, None)]);
                let deleted = c.txn(delete).await.map_err(|e| e.to_string())?;
                if !deleted.succeeded() {
                    return Err("the driver's delete found another key".to_owned());
                }
                Ok::<(), String>(())
            }
        };
        let outcome = calls_per_s(dur, stop, pair).await;
        let _ = c.lease_revoke(lease).await;
        outcome
    }

    /// Puts per second: `tasks` tasks sharing the client, each putting its own key for `dur`.
    async fn put_rate(&self, tasks: usize, dur: Duration, stop: &Stop) -> Result<f64, String> {
        let mut set = JoinSet::new();
        for t in 0..tasks {
            let c = self.client.clone();
            let key = format!("{}k{t}", self.base);
            let stop = stop.clone();
            set.spawn(async move {
                let put = || {
                    let (mut c, key) = (c.clone(), key.clone());
                    async move {
                        c.put(key, "x", None::<PutOptions>)
                            .await
                            .map(drop)
                            .map_err(|e| e.to_string())
                    }
                };
                calls_per_s(dur, &stop, put).await
            });
        }
        let mut total = 0.0;
        while let Some(r) = set.join_next().await {
            total += r.map_err(|e| e.to_string())??;
        }
        Ok(total)
    }

    /// Measures the reference and prints it next to the lock figures, as ratios.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn report(
        &self,
        out: &mut Out,
        dur: Duration,
        stop: &Stop,
        seq: &Uncontended,
        par: &Uncontended,
        client: &fencelock::Client,
        name: &str,
    ) {
        let writes = match self.writes_per_pair(client, name).await {
            Ok(w) => {
                out.line(format!(
                    "raft writes per acquire+release, counted over {COUNTED_PAIRS} sequential \
                     pairs (etcd_server_proposals_committed_total): {w:.2}"
                ));
                out.num("reference.etcd.raft_writes_per_pair", w);
                w
            }
            Err(e) => {
                out.line(format!(
                    "raft writes per acquire+release not counted ({e}); taken as \
                     {WRITES_PER_PAIR:.0}"
                ));
                WRITES_PER_PAIR
            }
        };
        out.line(format!(
            "reference: etcd Put rate, same client crate, same cluster; an acquire+release is \
             {writes:.2} raft writes (enqueue txn, delete txn)"
        ));
        let driver = match self.driver_pairs(dur, stop, false).await {
            Ok(pairs) => {
                out.num("reference.etcd.c1.driver_pairs_per_s", pairs);
                out.num(
                    "reference.etcd.c1.fencelock_over_driver",
                    seq.ops_per_s / pairs,
                );
                Some(pairs)
            }
            Err(e) => {
                out.line(format!("  driver floor unavailable: {e}"));
                None
            }
        };
        let bare_writes = match self.driver_pairs(dur, stop, true).await {
            Ok(pairs) => {
                out.num("reference.etcd.c1.writes_pairs_per_s", pairs);
                Some(pairs)
            }
            Err(e) => {
                out.line(format!("  two-write floor unavailable: {e}"));
                None
            }
        };
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
                        ratio * writes
                    ));
                    out.num(&format!("reference.etcd.{key}.put_rps"), puts);
                    out.num(&format!("uncontended.{key}.etcd_ratio"), ratio);
                    if let (Some(pairs), "c1") = (driver, key) {
                        out.line(format!(
                            "  {:<9} the engine's two requests through the bare client: \
                             pairs {:>8}/s  pairs/puts {:.2}  fencelock/driver {:.2}",
                            "driver",
                            rate(pairs),
                            pairs / puts,
                            r.ops_per_s / pairs
                        ));
                        out.num("reference.etcd.c1.driver_over_puts", pairs / puts);
                    }
                    if let (Some(pairs), "c1") = (bare_writes, key) {
                        out.line(format!(
                            "  {:<9} a Put on the session lease and a Delete, nothing else: \
                             pairs {:>8}/s  pairs/puts {:.2}  driver/writes {}",
                            "writes",
                            rate(pairs),
                            pairs / puts,
                            driver.map_or("-".to_owned(), |d| format!("{:.2}", d / pairs))
                        ));
                        out.num("reference.etcd.c1.writes_over_puts", pairs / puts);
                    }
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
