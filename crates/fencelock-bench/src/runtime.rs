//! Bench runs on an OS thread of their own, each with a single-threaded runtime.
//!
//! The bench's main runtime has two worker threads, as the `fencelock` command line's does, and
//! on a small machine every wake-up that crosses between them costs tens of microseconds. A run
//! compared with redis-benchmark's one event loop, or meant to stand for a separate process,
//! must not pay that toll, so it gets a current-thread runtime where its client's tasks and its
//! own code wake each other without leaving the thread.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use anyhow::{anyhow, Result};
use tokio::sync::oneshot;

/// How long a finished job's runtime gets to stop what the job left behind (tasks a client
/// spawned, a DNS lookup on the blocking pool) before the thread ends regardless.
const SHUTDOWN: Duration = Duration::from_secs(2);

/// Runs `job` on a new thread with its own current-thread runtime and returns its result.
///
/// `job` builds its future on that thread, so whatever the future creates there (a
/// `fencelock::Client` spawns its background tasks on the runtime current at creation) lives
/// on that runtime. The caller only awaits a channel, so its own runtime keeps running; a
/// panic or a runtime that cannot be built comes back as an error, and the thread is joined
/// before this returns.
pub(crate) async fn on_own_thread<F, Fut, T>(name: &str, job: F) -> Result<T>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T>> + 'static,
    T: Send + 'static,
{
    let (tx, rx) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            // The caller may have given up waiting; the result has nowhere to go then.
            let _ = tx.send(run(job));
        })
        .map_err(|e| anyhow!("cannot start the bench thread {name}: {e}"))?;
    let outcome = rx.await;
    // The thread has sent its result (or unwound) and has nothing left to do, but joining is
    // still a blocking call, which has no place on the caller's runtime.
    let joined = tokio::task::spawn_blocking(move || thread.join()).await;
    match (outcome, joined) {
        (Ok(result), _) => result,
        (Err(_), Ok(Err(panic))) => Err(anyhow!(
            "the bench thread {name} panicked: {}",
            panic_text(panic.as_ref())
        )),
        (Err(_), _) => Err(anyhow!("the bench thread {name} ended without a result")),
    }
}

fn run<F, Fut, T>(job: F) -> Result<T>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow!("cannot start a single-threaded runtime: {e}"))?;
    // Caught here rather than left to unwind the thread, so the runtime is still shut down
    // within SHUTDOWN and the caller hears why.
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| runtime.block_on(job())));
    runtime.shutdown_timeout(SHUTDOWN);
    outcome.unwrap_or_else(|panic| Err(anyhow!("panicked: {}", panic_text(panic.as_ref()))))
}

fn panic_text(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn results_errors_and_panics_come_back() {
        let on_thread = on_own_thread("t-ok", || async {
            // A current-thread runtime of its own: this thread is not the caller's.
            let flavor = tokio::runtime::Handle::current().runtime_flavor();
            Ok((flavor, std::thread::current().name().map(str::to_owned)))
        })
        .await;
        let Ok((flavor, name)) = on_thread else {
            unreachable!("{on_thread:?}")
        };
        assert_eq!(flavor, tokio::runtime::RuntimeFlavor::CurrentThread);
        assert_eq!(name.as_deref(), Some("t-ok"));

        let failed = on_own_thread("t-err", || async { Err::<(), _>(anyhow!("no")) }).await;
        assert_eq!(failed.map_err(|e| e.to_string()), Err("no".to_owned()));

        #[allow(clippy::panic, reason = "what is tested is a job that panics")]
        let panicked = on_own_thread("t-panic", || async {
            if std::hint::black_box(true) {
                panic!("boom");
            }
            Ok(())
        })
        .await;
        let text = panicked.map_err(|e| e.to_string());
        assert_eq!(text, Err("panicked: boom".to_owned()));
    }
}
