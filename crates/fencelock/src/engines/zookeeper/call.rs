//! Calls to ZooKeeper: one call bounded by the operation timeout, reads retried while the
//! connection is being re-established, and their errors.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use zookeeper_client::Error as ZkError;

use super::{ZkEngine, KIND};
use crate::core::error::{Error, Result};

/// Pause between two tries of a read whose connection was lost.
const RETRY_PAUSE: Duration = Duration::from_millis(20);

impl ZkEngine {
    /// One call, bounded by the operation timeout. `Ok(Err(e))` is ZooKeeper's own answer
    /// (no node, bad version, ...), for the caller to read; no answer in time is an error.
    pub(super) async fn bounded<T, E>(
        &self,
        what: &str,
        call: impl Future<Output = std::result::Result<T, E>>,
    ) -> Result<std::result::Result<T, E>> {
        tokio::time::timeout(self.op_timeout, call)
            .await
            .map_err(|_| self.no_answer(what))
    }

    /// A read (or another call that may be repeated), tried again while it failed because
    /// the connection was lost, within one operation timeout.
    pub(super) async fn read<T, F, Fut>(
        &self,
        what: &str,
        mut f: F,
    ) -> Result<std::result::Result<T, ZkError>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = std::result::Result<T, ZkError>>,
    {
        let deadline = Instant::now() + self.op_timeout;
        loop {
            match tokio::time::timeout_at(deadline, f()).await {
                Ok(Err(ZkError::ConnectionLoss)) if Instant::now() + RETRY_PAUSE < deadline => {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Ok(r) => return Ok(r),
                Err(_) => return Err(self.no_answer(what)),
            }
        }
    }

    fn no_answer(&self, what: &str) -> Error {
        Error::engine_failure(
            KIND,
            format!(
                "no answer from ZooKeeper at {} to {what} within {}; check that a majority of \
                 the ensemble is up",
                self.url.connect_string(),
                crate::core::options::display_duration(self.op_timeout)
            ),
        )
    }
}

/// ZooKeeper's refusal of `what`, as fencelock's error.
pub(super) fn zk_error(what: &str, e: ZkError) -> Error {
    let hint = match e {
        ZkError::NoAuth => {
            "; the node's ACL does not let these credentials do that (another identity \
             created it)"
        }
        ZkError::AuthFailed => "; check the user and password in the URL",
        ZkError::SessionExpired => "; the session ended, and every lease it held is lost",
        ZkError::NoHosts | ZkError::Timeout => "; check that a majority of the ensemble is up",
        _ => "",
    };
    Error::engine_failure(KIND, format!("ZooKeeper failed to {what}: {e}{hint}"))
}

/// Shorthand: a bounded call's outcome with ZooKeeper's refusals as errors too.
pub(super) fn ok<T>(what: &str, r: std::result::Result<T, ZkError>) -> Result<T> {
    r.map_err(|e| zk_error(what, e))
}
