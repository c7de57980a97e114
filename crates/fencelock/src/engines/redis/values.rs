//! What goes to the scripts and comes back: times and TTLs as numbers, reply values, and the
//! holder metadata the scripts store.

use std::time::{Duration, SystemTime};

use redis::Value;

use crate::core::holder::{from_unix_millis, Holder, HolderMeta};
use crate::core::token::FencingToken;

pub(super) fn unix_micros() -> u64 {
    crate::core::holder::unix_micros(SystemTime::now())
}

/// A TTL or window as the scripts take it: whole milliseconds, at least one.
pub(super) fn ms(d: Duration) -> i64 {
    crate::core::holder::millis_of(d).max(1)
}

pub(super) fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        Value::Okay => Some("OK".to_owned()),
        _ => None,
    }
}

pub(super) fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        other => as_string(other)?.parse().ok(),
    }
}

/// A number a script answers as text: a counter or a token.
pub(super) fn as_u64(v: &Value) -> Option<u64> {
    as_string(v)?.parse().ok()
}

pub(super) fn pttl_of(v: Option<&Value>) -> Option<Duration> {
    v.and_then(as_i64)
        .and_then(|p| u64::try_from(p).ok())
        .map(Duration::from_millis)
}

/// Appends the `who` part of the holder metadata: `pid\nhost\nclient`. The client name comes
/// last so it may hold any byte; a newline in the host (no real host name has one) would shift
/// the fields, so it is replaced.
fn push_who(out: &mut String, meta: &HolderMeta) {
    use std::fmt::Write;
    let _ = writeln!(out, "{}", meta.pid);
    if meta.host.contains('\n') {
        out.push_str(&meta.host.replace('\n', " "));
    } else {
        out.push_str(&meta.host);
    }
    out.push('\n');
    out.push_str(&meta.client);
}

/// The lock's value for a grant to `owner` with both flags down:
/// `owner\n00\nttl_ms\nacquired_at_ms\npid\nhost\nclient`. Built in place, as every attempt
/// builds one: `format!` and the nested strings it took cost the attempt several times more.
pub(super) fn holder_value(
    owner: &str,
    ttl: Duration,
    acquired_at: SystemTime,
    meta: &HolderMeta,
) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(owner.len() + 48 + meta.host.len() + meta.client.len());
    out.push_str(owner);
    out.push_str("\n00\n");
    let _ = write!(
        out,
        "{}\n{}\n",
        ms(ttl),
        crate::core::holder::unix_millis(acquired_at)
    );
    push_who(&mut out, meta);
    out
}

/// Builds a holder from the lock's value (`owner\nWQ\nttl\nacquired_at\npid\nhost\nclient`, see
/// the scripts), its PTTL and the fencing counter, which is the holder's token while it holds
/// the lock.
///
/// A value of any other shape (another client's `SET NX PX`) is a bare owner, shown whole and
/// without a token: the counter is fencelock's, not that holder's.
pub(super) fn holder_from(value: &str, pttl: Option<Duration>, counter: Option<u64>) -> Holder {
    let f: Vec<&str> = value.splitn(7, '\n').collect();
    let layout = f.len() == 7 && f[1].len() == 2 && f[1].bytes().all(|b| b == b'0' || b == b'1');
    let mut h = Holder::bare(if layout { f[0] } else { value }.to_owned());
    h.ttl_left = pttl;
    if !layout {
        return h;
    }
    h.token = counter.map(FencingToken::new);
    h.ttl = f[2].parse().ok().map(Duration::from_millis);
    h.acquired_at = f[3].parse().ok().map(from_unix_millis);
    h.pid = f[4].parse().ok();
    h.host = Some(f[5].to_owned());
    h.client = Some(f[6].to_owned());
    // Every renewal restores the full TTL, so the last one was `ttl - left` ago.
    h.renewed_at = match (h.ttl, pttl) {
        (Some(ttl), Some(left)) => SystemTime::now().checked_sub(ttl.saturating_sub(left)),
        _ => None,
    };
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_metadata_round_trips() {
        let meta = HolderMeta {
            host: "box\n1".to_owned(),
            pid: 42,
            client: "billing\nnightly".to_owned(),
        };
        let text = holder_value(
            "abc",
            Duration::from_secs(30),
            from_unix_millis(1_700_000_000_000),
            &meta,
        );
        assert!(
            text.starts_with("abc\n00\n30000\n1700000000000\n42\n"),
            "{text:?}"
        );
        let h = holder_from(&text, Some(Duration::from_secs(20)), Some(17));
        assert_eq!(h.owner, "abc");
        assert_eq!(h.token, Some(FencingToken::new(17)));
        assert_eq!(h.ttl, Some(Duration::from_secs(30)));
        assert_eq!(h.acquired_at, Some(from_unix_millis(1_700_000_000_000)));
        assert_eq!(h.pid, Some(42));
        assert_eq!(h.host.as_deref(), Some("box 1"));
        assert_eq!(h.client.as_deref(), Some("billing\nnightly"));
        // Renewed 10 s ago: 30 s of TTL, 20 s left.
        let ago = SystemTime::now()
            .duration_since(h.renewed_at.unwrap())
            .unwrap();
        assert!(
            ago >= Duration::from_secs(10) && ago < Duration::from_secs(11),
            "{ago:?}"
        );
        // A bare owner (an older layout's value, another client's) is shown whole.
        for bare in ["abc", "abc\n00\n30000", "evil\nxy\n1\n2\n3\n4\n5"] {
            let h = holder_from(bare, None, Some(5));
            assert_eq!(h.owner, bare);
            assert_eq!((h.token, h.host, h.renewed_at), (None, None, None));
        }
    }
}
