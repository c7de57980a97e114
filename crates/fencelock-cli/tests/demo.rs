//! `fencelock demo` tells the story and its fenced ledger refuses every stale write.
#![allow(clippy::unwrap_used)]

#[test]
fn demo_bills_every_customer_once_and_refuses_the_stalled_worker() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fencelock"))
        .args(["demo", "--ttl", "300ms", "--backend"])
        .arg(format!("sqlite://{}/demo.db", dir.path().display()))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert_eq!(text.matches("billed 1 time(s)").count(), 3, "{text}");
    assert_eq!(text.matches(": refused, token").count(), 3, "{text}");
    assert!(
        text.contains("stale writes refused by the ledger: 3"),
        "{text}"
    );
    assert!(text.contains("checks its lease: lost"), "{text}");
}
