//! `fencelock demo` tells the story and its fenced ledger refuses every stale write.
#![allow(clippy::unwrap_used)]

mod common;

use common::{fencelock, FINISH};

#[test]
fn demo_bills_every_customer_once_and_refuses_the_stalled_worker() {
    // A 300 ms lease renews within 50 ms: the database lives in memory, where an `fsync` never
    // waits on a loaded disk (a full test run once lost the takeover's lease on the disk).
    let dir = fencelock_testkit::memory_tempdir().unwrap();
    let out = fencelock(&["demo", "--ttl", "300ms", "--backend"])
        .arg(format!("sqlite://{}/demo.db", dir.path().display()))
        .run(FINISH)
        .unwrap();
    let text = &out.stdout;
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert_eq!(text.matches("billed 1 time(s)").count(), 3, "{text}");
    assert_eq!(text.matches(": refused, token").count(), 3, "{text}");
    assert!(
        text.contains("stale writes refused by the ledger: 3"),
        "{text}"
    );
    assert!(text.contains("checks its lease: lost"), "{text}");
}
