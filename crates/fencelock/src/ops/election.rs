//! Leader election: one campaigner at a time leads a named election, with a fencing token,
//! and everyone can observe who leads.
//!
//! On etcd this is the recipe of etcd's `concurrency` package (`election.go`), on the same keys
//! as `etcdctl elect NAME` (the name mapping of [`Client::keys_for`]): a campaign is a lock
//! acquisition whose key holds the campaign value instead of fencelock's holder metadata;
//! candidates queue in FIFO order behind the leader, the leader is the key with the lowest
//! create revision, its token that revision. Observers watch the election's keys (no polling)
//! and see every change of leader or value; `etcdctl elect -l NAME` sees fencelock's leaders
//! and fencelock sees `etcdctl elect`'s.
//!
//! On ZooKeeper it is the layout of Curator's `LeaderLatch`: candidates are protected
//! ephemeral sequential `-latch-` nodes under the lock path holding the campaign value, the
//! leader the first of them, its token that node's czxid; observers are fed by watches, and
//! Curator's `LeaderLatch` on the same path sees the same leader (see `docs/zookeeper.md`).
//!
//! On the other engines (SQLite, Redis, Redlock) an election is what can be built honestly
//! from their leases: a campaign is an ordinary acquisition (renewed lease, same tokens, same
//! waiting: no FIFO order unless the engine's fair mode is asked for) whose holder metadata
//! records the campaign value in place of the client name (`inspect` shows it as `client`),
//! and the leader is whoever holds the lock. Observers read it every 250 ms, so they see a
//! change up to that much later and may miss a leader that lasted less. There is no
//! [`Leadership::proclaim`] there ([`ErrorKind::InvalidInput`]): resign and campaign again.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

use crate::core::client::{Client, ClientInner};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::holder::Holder;
use crate::core::lease::Lease;
use crate::core::name::validate_name;
use crate::core::options::LockOptions;
use crate::core::records::{publish, Leader};
use crate::core::token::FencingToken;

/// The longest campaign value accepted, in bytes.
pub const MAX_VALUE_BYTES: usize = 64 * 1024;

/// How often the engines without change notifications read the leader when observed.
const POLL: Duration = Duration::from_millis(250);

/// A named election on one client. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Election {
    client: Client,
    name: String,
}

impl Client {
    /// The election called `name` (the same name rules as locks; on etcd, the same keys as
    /// the lock of that name, as with `etcdctl`).
    pub fn election(&self, name: &str) -> Result<Election> {
        validate_name(name)?;
        // A routed client's election lives on the backend its name routes to, opened when the
        // election is first used.
        self.route_of(name)?;
        Ok(Election {
            client: self.clone(),
            name: name.to_owned(),
        })
    }
}

impl Election {
    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Campaigns with `value`: waits (up to `opts.wait`, in FIFO order behind earlier
    /// candidates) until this candidate leads. The returned [`Leadership`] renews itself like a
    /// lease and reports its loss the same way.
    ///
    /// Cancel safe as [`Client::acquire`]: dropping the future withdraws the candidacy.
    pub async fn campaign(&self, value: &str, opts: &LockOptions) -> Result<Leadership> {
        check_value(value)?;
        let lease = self
            .client
            .acquire_within(&self.name, opts, opts.wait_value(), Some(value))
            .await?;
        Ok(Leadership {
            lease,
            value: Mutex::new(value.to_owned()),
        })
    }

    /// The current leader, if any.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        leader_of(self.client.on(&self.name).await?, &self.name).await
    }

    /// A receiver that starts with the current leader (`None` when nobody leads), always
    /// holds the latest known one and wakes on every change of leader or value. The first
    /// read is made before this returns, so an unreachable engine is an error here;
    /// afterwards a failed read keeps the last value and tries again. Observation stops when
    /// every receiver is dropped.
    pub async fn observe(&self) -> Result<watch::Receiver<Option<Leader>>> {
        let (tx, rx) = watch::channel(self.leader().await?);
        let inner = self.client.on(&self.name).await?.clone();
        let name = self.name.clone();
        tokio::spawn(async move {
            match &inner.elections {
                Some(elections) => elections.observe(&name, &tx).await,
                None => poll_leader(&inner, &name, &tx).await,
            }
        });
        Ok(rx)
    }
}

/// Leadership of an election: a lease whose grant carries the campaign value.
///
/// Renewed by the client's watchdog like any [`Lease`]; when it is lost, [`Leadership::lost`]
/// completes and the work under it must stop. Dropping it without resigning lets it expire.
#[must_use = "dropping a Leadership stops its renewals; hold it while leading and resign when done"]
#[derive(Debug)]
pub struct Leadership {
    lease: Lease,
    value: Mutex<String>,
}

impl Leadership {
    /// The fencing token of this leadership: greater than every earlier leader's.
    pub fn token(&self) -> FencingToken {
        self.lease.token()
    }

    /// The value last campaigned with or proclaimed.
    pub fn value(&self) -> String {
        self.value.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The lease underneath.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The lease underneath, to hand to code that works with leases; releasing it resigns.
    pub fn into_lease(self) -> Lease {
        self.lease
    }

    /// Whether leadership is lost (or its validity has ended).
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// Completes when leadership is lost. Cancel safe.
    pub async fn lost(&self) {
        self.lease.lost().await
    }

    /// Replaces the leader's value, which observers then see, without an election. Fails
    /// with [`ErrorKind::NotHolder`] when this candidate no longer leads.
    pub async fn proclaim(&self, value: &str) -> Result<()> {
        check_value(value)?;
        let inner = self.lease.client();
        let name = self.lease.resource();
        if self.lease.is_lost() {
            return Err(not_leader(name, inner.engine.kind()));
        }
        let Some(elections) = &inner.elections else {
            return Err(no_proclaim(inner.engine.kind()).with_resource(name));
        };
        let done = inner
            .calls
            .call(
                name,
                inner.cfg.op_timeout,
                elections.proclaim(name, self.lease.owner(), value),
            )
            .await?;
        if !done {
            return Err(not_leader(name, inner.engine.kind()));
        }
        *self.value.lock().unwrap_or_else(|p| p.into_inner()) = value.to_owned();
        Ok(())
    }

    /// Gives up leadership: the next candidate in line leads. Fails with
    /// [`ErrorKind::NotHolder`] when leadership had already been lost.
    pub async fn resign(self) -> Result<()> {
        self.lease.release().await
    }
}

fn check_value(value: &str) -> Result<()> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(Error::invalid(format!(
            "a campaign value is at most {MAX_VALUE_BYTES} bytes, got {}",
            value.len()
        )));
    }
    Ok(())
}

fn not_leader(name: &str, engine: &'static str) -> Error {
    Error::new(
        ErrorKind::NotHolder,
        "this candidate no longer leads the election; the new leader's value stands",
    )
    .with_resource(name)
    .with_engine(engine)
}

fn no_proclaim(engine: &'static str) -> Error {
    Error::invalid(format!(
        "proclaim needs the etcd engine; on {engine} the value is fixed at campaign time: \
         resign and campaign again with the new value"
    ))
    .with_engine(engine)
}

/// The leader: the engine's own, or on an engine without elections the holder of the
/// election's lock, whose client name is the campaign value.
async fn leader_of(inner: &ClientInner, name: &str) -> Result<Option<Leader>> {
    let limit = inner.cfg.op_timeout;
    match &inner.elections {
        Some(elections) => inner.calls.call(name, limit, elections.leader(name)).await,
        None => Ok(inner
            .calls
            .call(name, limit, inner.engine.inspect(name))
            .await?
            .map(from_holder)),
    }
}

fn from_holder(h: Holder) -> Leader {
    Leader {
        value: h.client.unwrap_or_default(),
        token: h.token.unwrap_or(FencingToken::new(0)),
    }
}

/// Observation on an engine without change notifications: the leader is read every [`POLL`]
/// until no receiver is left.
async fn poll_leader(inner: &ClientInner, name: &str, tx: &watch::Sender<Option<Leader>>) {
    loop {
        let step = async {
            match tokio::time::timeout(POLL, leader_of(inner, name)).await {
                Ok(Ok(leader)) => publish(tx, leader),
                Ok(Err(e)) => tracing::debug!(error = %e, "reading the leader failed"),
                Err(_) => tracing::debug!("reading the leader timed out"),
            }
            tokio::time::sleep(POLL).await;
        };
        tokio::select! {
            _ = tx.closed() => return,
            _ = step => {}
        }
    }
}
