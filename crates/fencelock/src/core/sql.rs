//! What the SQL engines (SQLite, PostgreSQL) store alike: the forced-release audit log
//! `fencelock_audit`, and the holder columns it shares with PostgreSQL's lease table.
//!
//! The schemas differ only in their SQL types (SQLite's `INTEGER` where PostgreSQL has `bigint`
//! and `boolean`), so each engine keeps its own `CREATE TABLE`; the column names, their order
//! and the mapping to and from an [`AuditRecord`] live here. An engine adds only its driver's
//! glue: [`SqlRow`] over its row type, and a binding of each [`SqlValue`] as a parameter.

use crate::core::holder::{duration_from_millis, from_unix_millis, millis_of, unix_millis, Holder};
use crate::core::records::AuditRecord;
use crate::core::token::FencingToken;

/// The columns of a `fencelock_audit` row, in the order [`audit_values`] gives them and
/// [`audit_record`] reads them. The last nine are [`HOLDER_COLUMNS`] and `counter`.
pub(crate) const AUDIT_COLUMNS: &str = "record_id, key, at, by_user, by_host, reason, \
     declared_dead, assessment, owner, token, host, pid, client, acquired_at, renewed_at, \
     ttl_ms, counter";

/// Where the holder's columns start in [`AUDIT_COLUMNS`].
const AUDIT_HOLDER_AT: usize = 8;

/// A holder as the SQL tables record it, in the order [`holder_from`] reads them: owner,
/// token, host, pid, client, acquired and renewed (Unix ms), TTL (ms).
pub(crate) const HOLDER_COLUMNS: &str =
    "owner, token, host, pid, client, acquired_at, renewed_at, ttl_ms";

/// The statement appending one record, with the parameters [`audit_values`] gives, numbered
/// after `placeholder` (`?1` for SQLite, `$1` for PostgreSQL).
pub(crate) fn audit_insert_sql(placeholder: char) -> String {
    let width = AUDIT_COLUMNS.split(',').count();
    let params: Vec<String> = (1..=width).map(|i| format!("{placeholder}{i}")).collect();
    format!(
        "INSERT INTO fencelock_audit ({AUDIT_COLUMNS}) VALUES ({})",
        params.join(", ")
    )
}

/// The statement reading the records `filter` selects (a `WHERE` condition over `key`),
/// newest first.
pub(crate) fn audit_select_sql(filter: &str) -> String {
    format!("SELECT {AUDIT_COLUMNS} FROM fencelock_audit WHERE {filter} ORDER BY id DESC")
}

/// One value of a row, in the few types the audit log and the holder columns use. The
/// nullable kinds keep their type, because PostgreSQL checks a parameter's type even when it
/// is NULL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SqlValue {
    Text(String),
    MaybeText(Option<String>),
    Int(i64),
    MaybeInt(Option<i64>),
    Bool(bool),
}

/// A row as an engine's driver reads it: the value of the column at a position, in one of
/// the types of [`SqlValue`].
pub(crate) trait SqlRow {
    /// The driver's error, for a missing column or a value of another type.
    type Error;
    fn text(&self, i: usize) -> Result<String, Self::Error>;
    fn maybe_text(&self, i: usize) -> Result<Option<String>, Self::Error>;
    fn int(&self, i: usize) -> Result<i64, Self::Error>;
    fn maybe_int(&self, i: usize) -> Result<Option<i64>, Self::Error>;
    fn flag(&self, i: usize) -> Result<bool, Self::Error>;
}

/// The values of the [`AUDIT_COLUMNS`] for `record`, kept under the row key `key`. The
/// holder is stored as the record has it, but for `ttl_left`, which the log does not keep.
pub(crate) fn audit_values(key: &str, record: &AuditRecord) -> Vec<SqlValue> {
    use SqlValue::*;
    let h = &record.holder;
    let ms = |t: Option<std::time::SystemTime>| MaybeInt(t.map(unix_millis));
    vec![
        Text(record.id.clone()),
        Text(key.to_owned()),
        Int(unix_millis(record.at)),
        Text(record.user.clone()),
        Text(record.host.clone()),
        Text(record.reason.clone()),
        Bool(record.holder_declared_dead),
        Text(record.assessment.clone()),
        // HOLDER_COLUMNS
        Text(h.owner.clone()),
        MaybeInt(h.token.map(FencingToken::to_stored)),
        MaybeText(h.host.clone()),
        MaybeInt(h.pid.map(i64::from)),
        MaybeText(h.client.clone()),
        ms(h.acquired_at),
        ms(h.renewed_at),
        MaybeInt(h.ttl.map(millis_of)),
        Int(record.counter.to_stored()),
    ]
}

/// Reads one row of [`AUDIT_COLUMNS`]; `prefix` is stripped from the key to give the name.
pub(crate) fn audit_record<R: SqlRow + ?Sized>(
    r: &R,
    prefix: &str,
) -> Result<AuditRecord, R::Error> {
    let key = r.text(1)?;
    Ok(AuditRecord {
        id: r.text(0)?,
        resource: key.strip_prefix(prefix).unwrap_or(&key).to_owned(),
        at: from_unix_millis(r.int(2)?),
        user: r.text(3)?,
        host: r.text(4)?,
        reason: r.text(5)?,
        holder_declared_dead: r.flag(6)?,
        assessment: r.text(7)?,
        holder: holder_from(r, AUDIT_HOLDER_AT)?,
        counter: FencingToken::from_stored(r.int(AUDIT_HOLDER_AT + 8)?),
        not_released_on: Vec::new(),
        ended_with: Vec::new(),
    })
}

/// Reads [`HOLDER_COLUMNS`] starting at column `at`. A pid that is no `u32` (written by hand)
/// is left out rather than wrapped.
pub(crate) fn holder_from<R: SqlRow + ?Sized>(r: &R, at: usize) -> Result<Holder, R::Error> {
    let mut h = Holder::bare(r.text(at)?);
    h.token = r.maybe_int(at + 1)?.map(FencingToken::from_stored);
    h.host = r.maybe_text(at + 2)?;
    h.pid = r.maybe_int(at + 3)?.and_then(|p| u32::try_from(p).ok());
    h.client = r.maybe_text(at + 4)?;
    h.acquired_at = r.maybe_int(at + 5)?.map(from_unix_millis);
    h.renewed_at = r.maybe_int(at + 6)?.map(from_unix_millis);
    h.ttl = r.maybe_int(at + 7)?.map(duration_from_millis);
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::{Duration, UNIX_EPOCH};

    /// The values as a row, to check the mapping without a driver in between.
    impl SqlRow for [SqlValue] {
        type Error = String;
        fn text(&self, i: usize) -> Result<String, String> {
            match self.get(i) {
                Some(SqlValue::Text(s)) => Ok(s.clone()),
                other => Err(format!("column {i}: {other:?} is no text")),
            }
        }
        fn maybe_text(&self, i: usize) -> Result<Option<String>, String> {
            match self.get(i) {
                Some(SqlValue::MaybeText(s)) => Ok(s.clone()),
                other => Err(format!("column {i}: {other:?} is no nullable text")),
            }
        }
        fn int(&self, i: usize) -> Result<i64, String> {
            match self.get(i) {
                Some(SqlValue::Int(n)) => Ok(*n),
                other => Err(format!("column {i}: {other:?} is no integer")),
            }
        }
        fn maybe_int(&self, i: usize) -> Result<Option<i64>, String> {
            match self.get(i) {
                Some(SqlValue::MaybeInt(n)) => Ok(*n),
                other => Err(format!("column {i}: {other:?} is no nullable integer")),
            }
        }
        fn flag(&self, i: usize) -> Result<bool, String> {
            match self.get(i) {
                Some(SqlValue::Bool(b)) => Ok(*b),
                other => Err(format!("column {i}: {other:?} is no boolean")),
            }
        }
    }

    fn columns(list: &str) -> Vec<&str> {
        list.split(',').map(str::trim).collect()
    }

    #[test]
    fn the_holder_columns_sit_inside_the_audit_columns() {
        let audit = columns(AUDIT_COLUMNS);
        let holder = columns(HOLDER_COLUMNS);
        assert_eq!(
            &audit[AUDIT_HOLDER_AT..AUDIT_HOLDER_AT + holder.len()],
            &holder[..]
        );
        assert_eq!(audit[AUDIT_HOLDER_AT + holder.len()], "counter");
        assert_eq!(audit.len(), AUDIT_HOLDER_AT + holder.len() + 1);
    }

    #[test]
    fn statements_number_every_column() {
        assert_eq!(
            audit_insert_sql('$'),
            format!(
                "INSERT INTO fencelock_audit ({AUDIT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, \
                 $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)"
            )
        );
        assert!(audit_insert_sql('?').ends_with("?16, ?17)"));
        assert_eq!(
            audit_select_sql("key = ?1"),
            format!("SELECT {AUDIT_COLUMNS} FROM fencelock_audit WHERE key = ?1 ORDER BY id DESC")
        );
    }

    #[test]
    fn a_bare_holder_is_stored_as_nulls() {
        let mut holder = Holder::bare("o".into());
        holder.ttl_left = Some(Duration::from_secs(3));
        let record = AuditRecord {
            id: "id".into(),
            resource: "r".into(),
            at: UNIX_EPOCH,
            user: "u".into(),
            host: "h".into(),
            reason: "why".into(),
            holder_declared_dead: false,
            assessment: String::new(),
            holder,
            counter: FencingToken::new(1),
            not_released_on: Vec::new(),
            ended_with: Vec::new(),
        };
        let values = audit_values("p:r", &record);
        assert_eq!(values.len(), columns(AUDIT_COLUMNS).len());
        assert!(values[AUDIT_HOLDER_AT + 1..AUDIT_HOLDER_AT + 8]
            .iter()
            .all(|v| matches!(v, SqlValue::MaybeInt(None) | SqlValue::MaybeText(None))));
        let back = audit_record(&values[..], "p:").unwrap();
        // The log does not keep the time that was left.
        assert_eq!(back.holder.ttl_left, None);
        assert_eq!(back.holder, Holder::bare("o".into()));
    }

    #[test]
    fn a_pid_that_is_no_u32_is_left_out() {
        let mut values = vec![SqlValue::Text("o".into()), SqlValue::MaybeInt(Some(1))];
        values.extend([
            SqlValue::MaybeText(None),
            SqlValue::MaybeInt(Some(-1)),
            SqlValue::MaybeText(None),
            SqlValue::MaybeInt(None),
            SqlValue::MaybeInt(None),
            SqlValue::MaybeInt(None),
        ]);
        let h = holder_from(&values[..], 0).unwrap();
        assert_eq!((h.pid, h.token), (None, Some(FencingToken::new(1))));
    }

    fn opt_text() -> impl Strategy<Value = Option<String>> {
        proptest::option::of(".{0,12}")
    }

    /// Times and durations as the log keeps them: whole milliseconds, not before 1970.
    fn millis_time() -> impl Strategy<Value = std::time::SystemTime> {
        (0..(1i64 << 45)).prop_map(from_unix_millis)
    }

    fn record() -> impl Strategy<Value = AuditRecord> {
        let holder = (
            ".{0,12}",
            proptest::option::of(0..=i64::MAX),
            opt_text(),
            proptest::option::of(any::<u32>()),
            opt_text(),
            proptest::option::of(millis_time()),
            proptest::option::of(millis_time()),
            proptest::option::of(0..=i64::MAX),
        )
            .prop_map(
                |(owner, token, host, pid, client, acquired, renewed, ttl)| {
                    let mut h = Holder::bare(owner);
                    h.token = token.map(FencingToken::from_stored);
                    h.host = host;
                    h.pid = pid;
                    h.client = client;
                    h.acquired_at = acquired;
                    h.renewed_at = renewed;
                    h.ttl = ttl.map(duration_from_millis);
                    h
                },
            );
        (
            (".{0,12}", ".{0,12}", millis_time(), ".{0,12}", ".{0,12}"),
            (".{0,12}", any::<bool>(), ".{0,12}", holder, 0..=i64::MAX),
        )
            .prop_map(
                |((id, resource, at, user, host), (reason, dead, assessment, holder, counter))| {
                    AuditRecord {
                        id,
                        resource,
                        at,
                        user,
                        host,
                        reason,
                        holder_declared_dead: dead,
                        assessment,
                        holder,
                        counter: FencingToken::from_stored(counter),
                        not_released_on: Vec::new(),
                        ended_with: Vec::new(),
                    }
                },
            )
    }

    proptest! {
        #[test]
        fn records_round_trip_through_a_row(record in record(), prefix in "[a-z:]{0,8}") {
            let key = format!("{prefix}{}", record.resource);
            let values = audit_values(&key, &record);
            prop_assert_eq!(values.len(), columns(AUDIT_COLUMNS).len());
            prop_assert_eq!(&values[1], &SqlValue::Text(key));
            prop_assert_eq!(audit_record(&values[..], &prefix).unwrap(), record);
        }
    }
}
