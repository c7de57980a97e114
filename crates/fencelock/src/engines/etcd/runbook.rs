//! The stuck-lock runbook on etcd: the holder's metadata, listing, forced release and the
//! audit records.
//!
//! - **Runbook**: holder metadata is the waiter key's value (`etcdctl lock` writes an empty
//!   value; such holders show as their lease id). A forced release deletes the holder's key
//!   in a transaction that compares its create revision and writes the audit record under
//!   `<prefix>%audit/`; the record's counter is that transaction's revision.

use std::collections::HashMap;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, Txn, TxnOp};

use super::queue::token_of;
use super::{keys, EtcdEngine};
use crate::core::error::Result;
use crate::core::holder::{from_unix_millis, unix_millis, Holder};
pub(super) use crate::core::records::encode_fields;
use crate::core::records::{decode_fields, AuditRecord, HeldLock};
use crate::core::token::FencingToken;

impl EtcdEngine {
    async fn holder_of(&self, kv: &KeyValue) -> Holder {
        let mut holder =
            parse_meta(kv.value()).unwrap_or_else(|| Holder::bare(lease_owner(kv.lease())));
        holder.token = FencingToken::checked_from_stored(kv.create_revision());
        if kv.lease() != 0 {
            let lease = kv.lease();
            let ttl = self
                .bounded("read the lease", |mut c| async move {
                    c.lease_time_to_live(lease, None).await
                })
                .await;
            if let Ok(ttl) = ttl {
                holder.ttl_left = u64::try_from(ttl.ttl()).ok().map(Duration::from_secs);
                holder.ttl = u64::try_from(ttl.granted_ttl())
                    .ok()
                    .map(Duration::from_secs);
            }
        }
        holder
    }

    /// The holder of a queue's head, when there is one.
    pub(super) async fn holder_in(&self, head: Option<&KeyValue>) -> Option<Holder> {
        match head {
            Some(kv) => Some(self.holder_of(kv).await),
            None => None,
        }
    }

    pub(super) async fn inspect_holder(&self, name: &str) -> Result<Option<Holder>> {
        let head = self.head(name).await?;
        Ok(self.holder_in(head.as_ref()).await)
    }

    pub(super) async fn list_held(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let range = format!("{}{}", self.keys.prefix, keys::escape(prefix));
        let resp = self
            .get("list locks", range, GetOptions::new().with_prefix())
            .await?;
        let mut heads: HashMap<String, KeyValue> = HashMap::new();
        for kv in resp.kvs() {
            let Some((name, _)) = kv.key_str().ok().and_then(|k| self.keys.parse_waiter(k)) else {
                continue;
            };
            if !name.starts_with(prefix) {
                continue;
            }
            let older = heads
                .get(&name)
                .is_none_or(|h| kv.create_revision() < h.create_revision());
            if older {
                heads.insert(name, kv.clone());
            }
        }
        let mut held = Vec::with_capacity(heads.len());
        for (resource, kv) in heads {
            held.push(HeldLock::new(resource, self.holder_of(&kv).await));
        }
        Ok(held)
    }

    pub(super) async fn force_release_head(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let Some(head) = self.head(name).await? else {
            return Ok(None);
        };
        let mut holder = self.holder_of(&head).await;
        if expected_owner.is_some_and(|o| o != holder.owner) {
            return Ok(None);
        }
        holder.ttl_left = None;
        let mut record = draft.clone();
        record.holder = holder;
        let key = format!("{}{}", self.keys.audit(Some(name)), record.id);
        let txn = Txn::new()
            .when([Compare::create_revision(
                head.key().to_vec(),
                CompareOp::Equal,
                head.create_revision(),
            )])
            .and_then([
                TxnOp::delete(head.key().to_vec(), None),
                TxnOp::put(key, encode_record(&record), None),
            ]);
        let resp = self.txn("force release", txn).await?;
        if !resp.succeeded() {
            return Ok(None);
        }
        record.counter = token_of(resp.header().map_or(0, |h| h.revision()))?;
        Ok(Some(record))
    }

    pub(super) async fn read_audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let range = self.keys.audit(name);
        let resp = self
            .get("read the audit log", range, GetOptions::new().with_prefix())
            .await?;
        let mut records: Vec<AuditRecord> = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                let mut r = decode_record(kv.value())?;
                r.counter = FencingToken::checked_from_stored(kv.create_revision())?;
                Some(r)
            })
            .collect();
        records.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| b.counter.cmp(&a.counter)));
        Ok(records)
    }
}

/// The owner shown for a key written by another etcd client (`etcdctl lock`): its lease.
fn lease_owner(lease: i64) -> String {
    format!("etcd lease {lease:x}")
}

fn parse_meta(value: &[u8]) -> Option<Holder> {
    let f = decode_fields(value)?;
    let mut h = Holder::bare(f.get("owner")?.clone());
    h.host = f.get("host").cloned();
    h.pid = f.get("pid").and_then(|p| p.parse().ok());
    h.client = f.get("client").cloned();
    h.acquired_at = f
        .get("acquired_at")
        .and_then(|v| v.parse().ok())
        .map(from_unix_millis);
    Some(h)
}

fn encode_record(r: &AuditRecord) -> String {
    let h = &r.holder;
    let opt = |v: Option<String>| v.unwrap_or_default();
    let mut fields = r.operator_fields();
    fields.extend([
        ("owner", h.owner.clone()),
        ("token", opt(h.token.map(|t| t.to_string()))),
        ("holder_host", opt(h.host.clone())),
        ("pid", opt(h.pid.map(|p| p.to_string()))),
        ("client", opt(h.client.clone())),
        (
            "acquired_at",
            opt(h.acquired_at.map(|t| unix_millis(t).to_string())),
        ),
        ("ttl", opt(h.ttl.map(|t| t.as_millis().to_string()))),
    ]);
    encode_fields(&fields)
}

fn decode_record(value: &[u8]) -> Option<AuditRecord> {
    let f = decode_fields(value)?;
    AuditRecord::from_fields(|k| f.get(k).cloned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_with_spaces_and_equals() {
        let v = encode_fields(&[
            ("owner", "ab".into()),
            ("host", "a b=c%".into()),
            ("pid", "7".into()),
        ]);
        let h = parse_meta(v.as_bytes()).unwrap();
        assert_eq!(
            (h.owner.as_str(), h.host.as_deref(), h.pid),
            ("ab", Some("a b=c%"), Some(7))
        );
        assert!(parse_meta(b"").is_none());
    }
}
