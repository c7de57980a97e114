//! The stuck-lock runbook on ZooKeeper: the holder's metadata, listing, forced release and
//! the audit records.
//!
//! - **Holder**: the data of the first node of the queue, fencelock's metadata
//!   (`fencelock owner=… host=… pid=…`). A Curator holder's data is its IP address (Curator's
//!   default node data); it shows as that host, its owner being the node's name. The token is
//!   the node's czxid. The time left is not recorded: a node lives exactly as long as its
//!   holder's session, so a holder whose node is there is alive as far as ZooKeeper knows.
//! - **Forced release**: one `multi` that deletes the holder's node with the version that was
//!   read (so a node that changed in between is left alone) and creates the audit record, a
//!   persistent sequential node under `<prefix>%audit/<esc(name)>/`. The record's counter is
//!   that node's czxid: above the old holder's token, below every later grant's.

use zookeeper_client::{CreateMode, Error as ZkError, Stat};

use super::call::{ok, zk_error};
use super::paths::{self, LATCH, LOCK};
use super::session::Session;
use super::ZkEngine;
use crate::core::error::Result;
use crate::core::holder::{from_unix_millis, unix_millis, Holder};
pub(super) use crate::core::records::encode_fields;
use crate::core::records::{decode_fields, AuditRecord, HeldLock};
use crate::core::token::FencingToken;

impl ZkEngine {
    /// The holder that node `child` of `name`'s lock path records, if it still exists.
    pub(super) async fn holder_at(&self, s: &Session, name: &str, child: &str) -> Option<Holder> {
        let path = format!("{}/{child}", self.paths.lock(name));
        match self
            .read("read the holder", || s.client.get_data(&path))
            .await
        {
            Ok(Ok((data, stat))) => Some(holder_of(child, &data, &stat)),
            _ => None,
        }
    }

    /// The head of `name`'s queue: lock waiters, else election candidates.
    async fn head(&self, s: &Session, name: &str) -> Result<Option<(String, Vec<u8>, Stat)>> {
        for marker in [LOCK, LATCH] {
            let q = self.read_queue(s, name, marker).await?;
            // The head may go between the listing and the read: look again.
            for (_, child) in q.iter().take(3) {
                let path = format!("{}/{child}", self.paths.lock(name));
                match self
                    .read("read the holder", || s.client.get_data(&path))
                    .await?
                {
                    Ok((data, stat)) => return Ok(Some((child.clone(), data, stat))),
                    Err(ZkError::NoNode) => continue,
                    Err(e) => return Err(zk_error("read the holder", e)),
                }
            }
        }
        Ok(None)
    }

    pub(super) async fn inspect_holder(&self, name: &str) -> Result<Option<Holder>> {
        let s = self.session_for(None).await?;
        Ok(self
            .head(&s, name)
            .await?
            .map(|(child, data, stat)| holder_of(&child, &data, &stat)))
    }

    pub(super) async fn list_held(&self, prefix: &str) -> Result<Vec<HeldLock>> {
        let s = self.session_for(None).await?;
        let root = self.paths.root().to_owned();
        let children = match self
            .read("list locks", || s.client.list_children(&root))
            .await?
        {
            Ok(c) => c,
            Err(ZkError::NoNode) => return Ok(Vec::new()),
            Err(e) => return Err(zk_error("list locks", e)),
        };
        let mut held = Vec::new();
        for esc in children {
            let Some(name) = paths::unescape(&esc) else {
                continue;
            };
            if !name.starts_with(prefix) {
                continue;
            }
            if let Some((child, data, stat)) = self.head(&s, &name).await? {
                held.push(HeldLock::new(name, holder_of(&child, &data, &stat)));
            }
        }
        Ok(held)
    }

    pub(super) async fn force_release_head(
        &self,
        name: &str,
        expected_owner: Option<&str>,
        draft: &AuditRecord,
    ) -> Result<Option<AuditRecord>> {
        let s = self.session_for(None).await?;
        let Some((child, data, stat)) = self.head(&s, name).await? else {
            return Ok(None);
        };
        let mut record = draft.clone();
        record.holder = holder_of(&child, &data, &stat);
        if expected_owner.is_some_and(|o| o != record.holder.owner) {
            return Ok(None);
        }
        let dir = self.paths.audit(Some(name));
        // Records are readable by anyone and changed by nobody; the directories are open, so
        // that every identity sharing the prefix can add its own (they are created before the
        // delete is tried: an identity the delete then refuses must not take them over).
        let seq = CreateMode::PersistentSequential.with_acls(zookeeper_client::Acls::anyone_read());
        let dirs = CreateMode::Persistent.with_acls(zookeeper_client::Acls::anyone_all());
        ok(
            "create the audit path",
            self.read("create the audit path", || s.client.mkdir(&dir, &dirs))
                .await?,
        )?;
        let node = format!("{}/{child}", self.paths.lock(name));
        let record_prefix = format!("{dir}/r-");
        let value = encode_record(&record);
        let committed = self
            .bounded("force release", {
                let mut w = s.client.new_multi_writer();
                let added = w
                    .add_delete(&node, Some(stat.version))
                    .and_then(|()| w.add_create(&record_prefix, value.as_bytes(), &seq));
                async move {
                    added?;
                    w.commit().await.map_err(ZkError::from)
                }
            })
            .await?;
        let results = match committed {
            Ok(r) => r,
            Err(ZkError::NoNode | ZkError::BadVersion) => return Ok(None),
            Err(e) => return Err(zk_error("force release", e)),
        };
        let created = results.into_iter().find_map(|r| match r {
            zookeeper_client::MultiWriteResult::Create { path, .. } => Some(path),
            _ => None,
        });
        // The multi's create answers its stat unreliably (ZOOKEEPER-4026): read it back.
        if let Some(path) = created {
            if let Ok(Ok((_, st))) = self
                .read("read the audit record", || s.client.get_data(&path))
                .await
            {
                record.counter = FencingToken::from_stored(st.czxid);
            }
        }
        Ok(Some(record))
    }

    pub(super) async fn read_audit(&self, name: Option<&str>) -> Result<Vec<AuditRecord>> {
        let s = self.session_for(None).await?;
        let dirs: Vec<String> = match name {
            Some(n) => vec![self.paths.audit(Some(n))],
            None => {
                let top = self.paths.audit(None);
                match self
                    .read("read the audit log", || s.client.list_children(&top))
                    .await?
                {
                    Ok(c) => c.into_iter().map(|c| format!("{top}/{c}")).collect(),
                    Err(ZkError::NoNode) => Vec::new(),
                    Err(e) => return Err(zk_error("read the audit log", e)),
                }
            }
        };
        let mut records = Vec::new();
        for dir in dirs {
            let children = match self
                .read("read the audit log", || s.client.list_children(&dir))
                .await?
            {
                Ok(c) => c,
                Err(ZkError::NoNode) => continue,
                Err(e) => return Err(zk_error("read the audit log", e)),
            };
            for c in children {
                let path = format!("{dir}/{c}");
                if let Ok(Ok((data, stat))) = self
                    .read("read the audit log", || s.client.get_data(&path))
                    .await
                {
                    if let Some(mut r) = decode_record(&data) {
                        r.counter = FencingToken::from_stored(stat.czxid);
                        records.push(r);
                    }
                }
            }
        }
        records.sort_by(|a, b| b.at.cmp(&a.at).then_with(|| b.counter.cmp(&a.counter)));
        Ok(records)
    }
}

/// The holder a node records: fencelock's metadata, or (another client's node, such as
/// Curator's, whose data is its IP address) the node's name as owner and its data as host.
pub(super) fn holder_of(child: &str, data: &[u8], stat: &Stat) -> Holder {
    let mut h = parse_meta(data).unwrap_or_else(|| {
        let mut h = Holder::bare(child.to_owned());
        let text = String::from_utf8_lossy(data).trim().to_owned();
        h.host = (!text.is_empty()).then_some(text);
        h.acquired_at = u64::try_from(stat.ctime)
            .ok()
            .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms));
        h
    });
    h.token = FencingToken::checked_from_stored(stat.czxid);
    h
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
    h.ttl = f
        .get("ttl")
        .and_then(|v| v.parse().ok())
        .map(std::time::Duration::from_millis);
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
    fn curator_holders_show_their_address() {
        let stat = Stat {
            czxid: 0x1_0000_0007,
            mzxid: 0,
            pzxid: 0,
            ctime: 0,
            mtime: 0,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 0,
            data_length: 0,
            num_children: 0,
        };
        let h = holder_of("_c_x-lock-0000000001", b"10.1.2.3", &stat);
        assert_eq!(h.owner, "_c_x-lock-0000000001");
        assert_eq!(h.host.as_deref(), Some("10.1.2.3"));
        assert_eq!(h.token.map(|t| t.get()), Some(0x1_0000_0007));
        let v = encode_fields(&[("owner", "ab".into()), ("host", "a b=c%".into())]);
        let h = holder_of("n", v.as_bytes(), &stat);
        assert_eq!(
            (h.owner.as_str(), h.host.as_deref()),
            ("ab", Some("a b=c%"))
        );
    }
}
