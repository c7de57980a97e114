//! Whatever durations a caller gives (zero, years, `Duration::MAX`), the library answers with
//! a lease or an error, and never panics: a wait too long for the clock saturates, a TTL,
//! backoff or deadline beyond the library's ceilings is invalid input.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use fencelock::{Client, ErrorKind, LockOptions};
use proptest::prelude::*;

/// Mostly durations a request can be granted with, so that the arithmetic after validation is
/// reached, and the extremes.
fn any_duration() -> impl Strategy<Value = Duration> {
    prop_oneof![
        1 => Just(Duration::ZERO),
        2 => Just(Duration::MAX),
        1 => Just(Duration::from_secs(u64::MAX)),
        4 => (100u64..5_000).prop_map(Duration::from_millis),
        2 => (86_400u64..100 * 365 * 86_400).prop_map(Duration::from_secs),
        1 => (0u64..u64::MAX, 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn no_duration_makes_the_library_panic(
        ttl in any_duration(),
        wait in any_duration(),
        min in prop_oneof![3 => Just(Duration::from_millis(5)), 1 => any_duration()],
        max in prop_oneof![3 => Just(Duration::from_millis(250)), 1 => any_duration()],
        op_timeout in prop_oneof![3 => Just(Duration::from_secs(5)), 1 => any_duration()],
        max_ttl in prop_oneof![3 => Just(Duration::from_secs(86_400)), 1 => any_duration()],
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("locks.db").display());
        rt.block_on(async {
            let client = match Client::builder(&url)
                .op_timeout(op_timeout)
                .max_ttl(max_ttl)
                .connect()
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
                    return;
                }
            };
            let opts = LockOptions::default().ttl(ttl).wait(wait).backoff(min, max);
            // The lock is free: a valid request is granted at once, whatever its wait.
            match tokio::time::timeout(Duration::from_secs(30), client.acquire("d", &opts)).await {
                Ok(Ok(lease)) => lease.release().await.unwrap(),
                Ok(Err(e)) => assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}"),
                Err(_) => unreachable!("acquire hung with ttl {ttl:?}, wait {wait:?}"),
            }
            client.close().await;
        });
    }
}

#[tokio::test]
async fn a_wait_of_years_on_a_held_lock_times_nothing_out_and_is_cancel_safe() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let client = Client::connect(&url).await.unwrap();
    let held = client
        .try_acquire("y", &LockOptions::default())
        .await
        .unwrap();
    let forever = LockOptions::default().wait(Duration::MAX);
    let waited =
        tokio::time::timeout(Duration::from_millis(300), client.acquire("y", &forever)).await;
    assert!(waited.is_err(), "a wait of Duration::MAX ended early");
    held.release().await.unwrap();
    client.close().await;
    let again = client
        .try_acquire("y", &LockOptions::default())
        .await
        .unwrap();
    again.release().await.unwrap();
}
