//! The stuck-lock runbook on Redis and Redlock: inspecting and listing held locks, forced
//! release and the audit stream.
//!
//! - **Inspection** asks every node: a lock is held when one owner holds it on a majority (a
//!   minority grant is not a lock), and the answer is an error when too few nodes answered to
//!   tell.
//! - **Listing** scans the lock keys (`SCAN MATCH`, see [`keys::lock_pattern`]) on every node,
//!   then inspects each name found as `inspect` does: on Redlock a lock is listed only when
//!   one owner holds it on a majority. Any `N - quorum + 1` nodes include one node of every
//!   majority, so that many must answer the scan.
//! - **Forced release** runs one script per node that deletes the lock (only where the expected
//!   owner holds it), advances the counter to `max(counter + 1, floor)` and appends the audit
//!   record, atomically. On Redlock the floor is the client's clock, as for grants, so healthy
//!   nodes agree on one mark; where they do not, the counter is then raised to the highest
//!   mark on a majority, so every later grant (whose majority meets that one) is above it.
//!   The release needs a majority of nodes to answer (releasing, or finding the key gone):
//!   then the old owner holds the key on a minority at most. A node whose ACL refuses a
//!   command the script writes with (`XADD` for the audit record) refuses before the first
//!   write, so on each node the release and its record happen together or not at all; the
//!   nodes that did neither are named, in the returned record when the others were a
//!   majority, else in the error.
//! - **The audit log** is a stream capped near [`AUDIT_MAX_LEN`] entries on each node. Redlock
//!   merges the nodes' logs by record id, keeping the highest mark a node recorded.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use futures_util::future::join_all;
use redis::Value;

use super::node::{Node, NodeResult, ScriptCall};
use super::values::{as_i64, as_string, as_u64, holder_from, pttl_of};
use super::{keys, scripts, RedisEngine};
use crate::core::engine::Engine;
use crate::core::error::{Error, Result};
use crate::core::holder::{from_unix_millis, Holder};
use crate::core::records::{AuditRecord, HeldLock};
use crate::core::token::FencingToken;

/// The length Redis trims each audit stream to (approximately, `MAXLEN ~`, which trims whole
/// macro nodes and so costs nothing per append).
pub(super) const AUDIT_MAX_LEN: usize = 10_000;

/// Names inspected concurrently while listing: enough to fill the pipeline, few enough that
/// one listing never floods a node.
const LIST_BATCH: usize = 100;

/// Keys a node examines per SCAN call.
const SCAN_COUNT: usize = 500;

impl Node {
    /// The names of every lock key matching `pattern` on this node.
    async fn scan_names(
        &self,
        prefix: &str,
        pattern: &str,
        limit: Duration,
    ) -> NodeResult<Vec<String>> {
        let mut names = Vec::new();
        let mut cursor = "0".to_owned();
        loop {
            let mut cmd = redis::cmd("SCAN");
            cmd.arg(&cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT);
            let (next, found): (String, Vec<Vec<u8>>) = self.query(&cmd, limit).await?;
            // Names are UTF-8 (validated before any write); other keys are not fencelock's.
            names.extend(
                found
                    .into_iter()
                    .filter_map(|k| String::from_utf8(k).ok())
                    .filter_map(|k| keys::name_of_lock_key(prefix, &k).map(str::to_owned)),
            );
            if next == "0" {
                return Ok(names);
            }
            cursor = next;
        }
    }
}

impl RedisEngine {
    /// The deadline of one node's part in an inspection, listing, forced release or audit read.
    /// Shorter than the client's deadline for the whole call (one operation timeout per step),
    /// so that a dead or hung node costs its vote, not the answer of the nodes that are up.
    pub(super) fn node_limit(&self) -> Duration {
        self.op_timeout * 3 / 4
    }

    pub(super) async fn inspect_holder(&self, name: &str) -> Result<Option<Holder>> {
        let keys = self.keys(name);
        let limit = self.node_limit();
        let answers = self
            .ask(|n| {
                // A transaction, not a script: the read-only user (`%R~` keys) may run it,
                // where EVALSHA declares its keys written.
                let mut pipe = redis::pipe();
                pipe.atomic()
                    .cmd("GET")
                    .arg(&keys.lock)
                    .cmd("PTTL")
                    .arg(&keys.lock)
                    .cmd("GET")
                    .arg(&keys.fence);
                async move { n.query_pipe::<Vec<Value>>(&pipe, limit).await }
            })
            .await;
        answers.unless_every_node_failed()?;
        let holders = answers.map(|_, v| {
            Ok(v.first()
                .and_then(as_string)
                .map(|value| holder_from(&value, pttl_of(v.get(1)), v.get(2).and_then(as_u64))))
        });
        // Held means held on a majority: a minority grant is not a lock.
        let found = holders
            .answers()
            .flatten()
            .find(|h| holders.quorum_says(|o| o.as_ref().is_some_and(|o| o.owner == h.owner)));
        if found.is_none() && holders.too_few_answered() {
            // The silent nodes may hold the majority: "free" would be a guess, and the
            // runbook acts on this answer.
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "only {} of {} nodes answered (quorum {}), too few to tell whether \
                     the lock is held",
                    holders.answered(),
                    self.nodes.len(),
                    self.quorum
                ),
            ));
        }
        Ok(found.cloned())
    }

    pub(super) async fn list_held(&self, name_prefix: &str) -> Result<Vec<HeldLock>> {
        let pattern = keys::lock_pattern(&self.prefix, name_prefix);
        let scans = self
            .ask(|n| n.scan_names(&self.prefix, &pattern, self.node_limit()))
            .await;
        let needed = self.nodes.len() - self.quorum + 1;
        if scans.answered() < needed {
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "listing needs {needed} of {} nodes to answer: {}",
                    self.nodes.len(),
                    scans.errors_text()
                ),
            ));
        }
        let names: Vec<String> = scans
            .answers()
            .flatten()
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let mut held = Vec::new();
        for chunk in names.chunks(LIST_BATCH) {
            let holders = join_all(chunk.iter().map(|n| Engine::inspect(self, n))).await;
            for (name, holder) in chunk.iter().zip(holders) {
                if let Some(holder) = holder? {
                    held.push(HeldLock::new(name.clone(), holder));
                }
            }
        }
        Ok(held)
    }

    pub(super) async fn force_release_everywhere(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let keys = self.keys(name);
        let audit = keys::audit_key(&self.prefix);
        let floor = self.floor();
        let limit = self.node_limit();
        let fields = draft.operator_fields();
        let answers = self.ask(|n| {
            let mut inv = ScriptCall::new(&scripts::FORCE_RELEASE, 4);
            inv.arg(&keys.lock)
                .arg(&keys.fence)
                .arg(keys.of("queue"))
                .arg(&audit)
                .arg(expected_owner.unwrap_or(""))
                .arg(floor)
                .arg(keys.of("wake"))
                .arg(AUDIT_MAX_LEN);
            for (field, value) in &fields {
                inv.arg(*field).arg(value);
            }
            async move { n.run::<Vec<Value>>(inv, limit).await }
        });
        // Per node: the counter it now holds when it released, with the old holder it saw.
        let released = answers.await.map(|node, v| {
            if v.first().and_then(as_i64) != Some(1) {
                return Ok(None);
            }
            let counter = v.get(1).and_then(as_u64);
            let owner = v.get(2).and_then(as_string);
            let Some((c, owner)) = counter.zip(owner) else {
                return Err(format!(
                    "{}: unexpected reply to the forced release",
                    node.addr()
                ));
            };
            let value = v
                .get(3)
                .and_then(as_string)
                .unwrap_or_else(|| owner.clone());
            let mut holder = holder_from(&value, None, v.get(5).and_then(as_u64));
            // As the script wrote it into the audit record.
            holder.renewed_at = v.get(4).and_then(as_i64).map(from_unix_millis);
            Ok(Some((c, holder)))
        });
        if released.too_few_answered() {
            let done = released.nodes_where(Option::is_some);
            let done = if done.is_empty() {
                "nothing was released on any node".to_owned()
            } else {
                format!(
                    "released and recorded on {} only; the others still hold it for the old \
                     holder",
                    done.join(", ")
                )
            };
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "the forced release was done on too few nodes: {} of {} answered (quorum \
                     {}), so the lock may still be held on a majority; {done}. Not released \
                     on: {}. Fix what those nodes refused (a user that may not XADD cannot \
                     write the audit record) or wait until they answer, then run it again",
                    released.answered(),
                    self.nodes.len(),
                    self.quorum,
                    released.errors_text()
                ),
            ));
        }
        let Some(mark) = released.answers().flatten().map(|(c, _)| *c).max() else {
            return Ok(None);
        };

        let at_mark = |r: &Option<(u64, Holder)>| matches!(r, Some((c, _)) if *c == mark);
        if !released.raise_to(&keys.fence, mark, at_mark, limit).await {
            return Err(Error::engine_failure(
                self.kind,
                format!(
                    "the lock was force-released, but the fencing counter could not be \
                     raised to {mark} on a majority; a later grant may get a token below \
                     the mark in the audit log"
                ),
            ));
        }

        let mut record = draft.clone();
        // The holder as a releasing node had it, unless its metadata had already gone.
        if let Some((_, seen)) = released
            .answers()
            .flatten()
            .find(|(_, h)| h.client.is_some())
        {
            record.holder = seen.clone();
        }
        record.counter = FencingToken::new(mark);
        // A majority released and recorded it; the others did neither, and are named.
        record.not_released_on = released.errors();
        if !record.not_released_on.is_empty() {
            tracing::warn!(
                resource = name,
                nodes = %released.errors_text(),
                "forced release not done on every node"
            );
        }
        Ok(Some(record))
    }

    pub(super) async fn read_audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let key = keys::audit_key(&self.prefix);
        let mut cmd = redis::cmd("XREVRANGE");
        cmd.arg(&key).arg("+").arg("-");
        let answers = self
            .ask(|n| n.query::<Value>(&cmd, self.node_limit()))
            .await;
        answers.unless_every_node_failed()?;
        let mut by_id: HashMap<String, AuditRecord> = HashMap::new();
        for entries in answers.answers() {
            let Value::Array(entries) = entries else {
                continue;
            };
            for entry in entries {
                let Some(record) = parse_entry(entry) else {
                    continue;
                };
                if name.is_some_and(|n| n != record.resource) {
                    continue;
                }
                // A node whose counter was raised after its append recorded a lower mark.
                match by_id.get(&record.id) {
                    Some(seen) if seen.counter >= record.counter => {}
                    _ => {
                        by_id.insert(record.id.clone(), record);
                    }
                }
            }
        }
        let mut records: Vec<AuditRecord> = by_id.into_values().collect();
        records.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| b.id.cmp(&a.id)));
        Ok(records)
    }
}

/// One stream entry (`[id, [field, value, ...]]`) as a record; `None` for entries fencelock did
/// not write.
fn parse_entry(entry: &Value) -> Option<AuditRecord> {
    let Value::Array(parts) = entry else {
        return None;
    };
    let mut fields: HashMap<String, String> = HashMap::new();
    match parts.get(1)? {
        Value::Array(flat) => {
            for pair in flat.chunks(2) {
                if let [k, v] = pair {
                    fields.insert(as_string(k)?, as_string(v)?);
                }
            }
        }
        Value::Map(pairs) => {
            for (k, v) in pairs {
                fields.insert(as_string(k)?, as_string(v)?);
            }
        }
        _ => return None,
    }
    // A record whose script never wrote the counter is not one of ours.
    fields.get("counter")?;
    AuditRecord::from_fields(|k| fields.get(k).cloned())
}
