//! The limits of a prefix (`P limits`), stored on every node: each node's scripts check the
//! copy it holds, so a Redlock grant is refused wherever a majority of nodes refuse it.

use super::RedisEngine;
use crate::core::error::{Error, Result};
use crate::core::limits::{Limits, StoredLimits};

impl RedisEngine {
    /// Each node's copy of the limits.
    pub(super) async fn read_limits(&self) -> Result<Vec<StoredLimits>> {
        let mut get = redis::cmd("GET");
        get.arg(&self.limits_key);
        let answers = futures_util::future::join_all(
            self.nodes
                .iter()
                .map(|n| n.query::<Option<String>>(&get, self.op_timeout)),
        )
        .await;
        if answers.iter().all(|a| a.is_err()) {
            let why: Vec<String> = answers.into_iter().filter_map(|a| a.err()).collect();
            return Err(Error::engine_failure(self.kind, why.join("; ")));
        }
        Ok(self
            .nodes
            .iter()
            .zip(answers)
            .map(|(n, a)| StoredLimits {
                node: n.addr().to_owned(),
                limits: a.and_then(|v| match v {
                    None => Ok(None),
                    Some(text) => Limits::decode(&text)
                        .map(Some)
                        .ok_or_else(|| format!("malformed limits value {text:?}")),
                }),
            })
            .collect())
    }

    /// Writes the limits (or deletes them, when empty) on every node; fails unless every node
    /// took them, since a node without them would grant what the others refuse.
    pub(super) async fn store_limits(&self, limits: &Limits) -> Result<()> {
        let mut cmd = if limits.is_empty() {
            redis::cmd("DEL")
        } else {
            redis::cmd("SET")
        };
        cmd.arg(&self.limits_key);
        if !limits.is_empty() {
            cmd.arg(limits.encode());
        }
        let answers = futures_util::future::join_all(
            self.nodes
                .iter()
                .map(|n| n.query::<redis::Value>(&cmd, self.op_timeout)),
        )
        .await;
        let failed: Vec<String> = answers.into_iter().filter_map(|a| a.err()).collect();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Error::engine_failure(
                self.kind,
                format!(
                    "the limits were not stored on every node ({}); run the command again \
                     once every node answers",
                    failed.join("; ")
                ),
            ))
        }
    }
}
