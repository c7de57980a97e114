//! Mistakes and outages: clear errors, of the right kind, in bounded time.

use std::time::Duration;

use fencelock::{Client, ErrorKind, ForceRelease, LockOptions};
use tokio::time::{timeout, Instant};

use super::harness::Harness;
use super::Engine;

/// Bad names, TTLs and URLs are refused before any I/O as invalid input naming what is wrong;
/// an engine that is not there is an engine error that names where it was looked for, within a
/// few operation timeouts.
pub async fn unreachable_engine_and_bad_input_give_clear_errors<H: Harness>() {
    let engine = Engine::<H>::start().await;
    let c = engine.client().await;
    for name in ["", "a\nb", &"x".repeat(300)] {
        let e = c
            .try_acquire(name, &LockOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{name:?}: {e}");
        let e = c.inspect(name).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{name:?}: {e}");
    }
    for ttl in [Duration::ZERO, Duration::from_millis(50)] {
        let e = c
            .try_acquire("ok", &LockOptions::default().ttl(ttl))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{ttl:?}: {e}");
        assert!(e.to_string().contains("TTL"), "{e}");
    }
    let e = c
        .force_release("ok", &ForceRelease::new(" "))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(c.inspect("ok").await.unwrap().is_none());

    for bad in H::BAD_URLS.iter().chain(&["ftp://x", "nonsense", ""]) {
        let started = Instant::now();
        let e = Client::connect(bad).await.err().unwrap();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad}: {e}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{bad}: took I/O"
        );
    }

    let (url, named) = H::unreachable();
    let op_timeout = Duration::from_millis(500);
    let started = Instant::now();
    let attempt = async {
        // A client may connect lazily; then the first call is the one that fails.
        match Client::builder(&url).op_timeout(op_timeout).connect().await {
            Err(e) => e,
            Ok(c) => c
                .try_acquire("x", &LockOptions::default())
                .await
                .unwrap_err(),
        }
    };
    let e = timeout(Duration::from_secs(10), attempt)
        .await
        .expect("an unreachable engine hung the caller");
    assert_eq!(e.kind(), ErrorKind::Engine, "{url}: {e}");
    assert_eq!(e.engine(), Some(H::ENGINE), "{url}: {e}");
    let msg = e.to_string();
    assert!(msg.contains(H::ENGINE), "{url}: {msg}");
    for part in named {
        assert!(msg.contains(&part), "{url}: {msg}");
    }
    assert!(
        started.elapsed() < op_timeout * 6,
        "{url}: failed after {:?}",
        started.elapsed()
    );
}
