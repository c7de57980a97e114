//! Calls to etcd: connecting, one bounded call (retried while it reached no usable member),
//! the reads, transactions and watches the engine makes, and their errors.

use std::time::Duration;

use etcd_client::{
    ConnectOptions, GetOptions, GetResponse, Txn, TxnResponse, WatchOptions, WatchResponse,
    WatchStream,
};
use tokio::time::Instant;

use super::url::EtcdUrl;
use super::{EtcdEngine, KIND};
use crate::core::error::{Error, Result};

/// Pause between two tries of a call that never reached a usable member.
const RETRY_PAUSE: Duration = Duration::from_millis(10);

/// How often the client pings an etcd member over a connection with a call or stream open:
/// above etcd's default `--grpc-keepalive-min-time` of 5 s.
const KEEP_ALIVE_EVERY: Duration = Duration::from_secs(6);

/// Connects a client to the backend's endpoints (lazily), with credentials and TLS.
pub(super) async fn connect_client(
    url: &EtcdUrl,
    op_timeout: Duration,
) -> Result<etcd_client::Client> {
    let EtcdUrl {
        tls,
        endpoints,
        user,
        password,
        ca,
        cert,
        key,
    } = url;
    let scheme = if *tls { "https" } else { "http" };
    let eps: Vec<String> = endpoints
        .iter()
        .map(|e| format!("{scheme}://{e}"))
        .collect();
    // A member without a leader refuses calls instead of serving stale reads or silent
    // watches. HTTP/2 pings notice a dead member while a call or stream is open, at the pace
    // etcd allows: it sends a client away (GOAWAY `too_many_pings`, failing the calls in
    // flight) that pings more often than `--grpc-keepalive-min-time` (5 s by default) or at
    // all while no stream is open. A second above the minimum absorbs timer and network jitter.
    let mut opts = ConnectOptions::new()
        .with_connect_timeout(op_timeout)
        .with_require_leader(true)
        .with_keep_alive(KEEP_ALIVE_EVERY, op_timeout)
        .with_keep_alive_while_idle(false);
    if let (Some(u), Some(p)) = (user, password) {
        opts = opts.with_user(u.clone(), p.clone());
    }
    if *tls {
        use crate::core::tls::{certificates, private_key, read_pem};
        // tonic takes the files as bytes and finds them unusable only while connecting, which
        // would read as an unreachable cluster: they are checked here, as bad input.
        let mut t = etcd_client::TlsOptions::new();
        if let Some(ca) = ca {
            certificates(ca, "ca")?;
            t = t.ca_certificate(etcd_client::Certificate::from_pem(read_pem(ca, "ca")?));
        }
        if let (Some(c), Some(k)) = (cert, key) {
            certificates(c, "cert")?;
            private_key(k, "key")?;
            t = t.identity(etcd_client::Identity::from_pem(
                read_pem(c, "cert")?,
                read_pem(k, "key")?,
            ));
        }
        opts = opts.with_tls(t);
    }
    let named = eps.join(",");
    let connect = etcd_client::Client::connect(eps, Some(opts));
    match tokio::time::timeout(op_timeout, connect).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(etcd_error("connect", e)),
        Err(_) => Err(Error::engine_failure(
            KIND,
            format!(
                "no answer from etcd at {named} while connecting (authenticating); check that \
                 the cluster is up"
            ),
        )),
    }
}

impl EtcdEngine {
    /// One etcd call, bounded by the operation timeout. `f` is called again (on a fresh
    /// handle, which the client balances to another member) while the call fails before it
    /// reached a server that could act on it: a refused connection (a dead member the channel
    /// still lists) or a member without a leader.
    pub(super) async fn bounded<T, F, Fut>(&self, what: &str, f: F) -> Result<T>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
    {
        retrying(&self.client, &self.endpoints, self.op_timeout, what, f).await
    }

    /// One read.
    pub(super) async fn get(
        &self,
        what: &str,
        key: impl Into<Vec<u8>>,
        opts: GetOptions,
    ) -> Result<GetResponse> {
        let key = key.into();
        self.bounded(what, |mut c| {
            let (key, opts) = (key.clone(), opts.clone());
            async move { c.get(key, Some(opts)).await }
        })
        .await
    }

    /// One transaction.
    pub(super) async fn txn(&self, what: &str, txn: Txn) -> Result<TxnResponse> {
        self.bounded(what, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// A watch, once etcd has accepted it.
    pub(super) async fn watch(
        &self,
        what: &str,
        key: impl Into<Vec<u8>>,
        opts: WatchOptions,
    ) -> Result<WatchStream> {
        let key = key.into();
        self.bounded(what, |mut c| {
            let (key, opts) = (key.clone(), opts.clone());
            async move { c.watch(key, Some(opts)).await }
        })
        .await
    }

    /// Reads `stream` until `done` says so of a message, the watch ends, or one operation
    /// timeout has passed: a watch is re-armed that often, so that a member that stopped
    /// answering is not trusted forever.
    pub(super) async fn watch_until(
        &self,
        stream: &mut WatchStream,
        done: impl Fn(&WatchResponse) -> bool,
    ) -> Result<()> {
        let rearm = tokio::time::sleep(self.op_timeout);
        tokio::pin!(rearm);
        loop {
            tokio::select! {
                _ = &mut rearm => return Ok(()),
                msg = stream.message() => match msg {
                    Ok(Some(resp)) => {
                        if done(&resp) {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(etcd_error("watch", e)),
                },
            }
        }
    }
}

/// [`EtcdEngine::bounded`], for tasks that outlive the engine borrow.
pub(super) async fn retrying<T, F, Fut>(
    client: &etcd_client::Client,
    endpoints: &str,
    limit: Duration,
    what: &str,
    f: F,
) -> Result<T>
where
    F: FnMut(etcd_client::Client) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    tries(client, limit, f).await.map_err(|e| match e {
        Some(e) => etcd_error(what, e),
        None => no_answer(endpoints, what, limit),
    })
}

/// Calls `f` until it succeeds, fails on a member that could act on it, or `limit` has
/// passed (`None`: no answer in time).
pub(super) async fn tries<T, F, Fut>(
    client: &etcd_client::Client,
    limit: Duration,
    mut f: F,
) -> std::result::Result<T, Option<etcd_client::Error>>
where
    F: FnMut(etcd_client::Client) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, f(client.clone())).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) if unsent(&e) && Instant::now() + RETRY_PAUSE < deadline => {
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Ok(Err(e)) => return Err(Some(e)),
            Err(_) => return Err(None),
        }
    }
}

/// Whether a call failed before any member acted on it, so trying again cannot apply it
/// twice: the connection was refused, or the member had no leader to forward it to.
fn unsent(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    text.contains("tcp connect error") || text.contains("no leader")
}

fn no_answer(endpoints: &str, what: &str, limit: Duration) -> Error {
    Error::engine_failure(
        KIND,
        format!(
            "no answer from etcd at {endpoints} to {what} within {}; check that a majority of \
             members is up",
            crate::core::options::display_duration(limit)
        ),
    )
}

pub(super) fn etcd_error(what: &str, e: etcd_client::Error) -> Error {
    let hint = if e.to_string().contains("permission denied") {
        "; the user's roles do not cover this prefix's key range (`fencelock acl` prints the \
         role fencelock needs)"
    } else {
        ""
    };
    Error::engine_failure(KIND, format!("etcd failed to {what}: {e}{hint}"))
}
