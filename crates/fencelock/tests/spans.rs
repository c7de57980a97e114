//! Engine calls are traced: every call, the watchdog's batched renewals included, runs in an
//! `engine_call` span carrying the resource, the engine and the outcome.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use fencelock::{Client, ErrorKind, LockOptions};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

type Fields = HashMap<String, String>;

/// Closed spans: name and fields.
#[derive(Clone, Default)]
struct Closed(Arc<Mutex<Vec<(String, Fields)>>>);

struct Collect(Closed);

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Collect {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::new();
        attrs.record(&mut Visitor(&mut fields));
        ctx.span(id).unwrap().extensions_mut().insert(fields);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut ext = span.extensions_mut();
        values.record(&mut Visitor(ext.get_mut::<Fields>().unwrap()));
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).unwrap();
        let fields = span.extensions_mut().remove::<Fields>().unwrap_or_default();
        self.0
             .0
            .lock()
            .unwrap()
            .push((span.name().to_owned(), fields));
    }
}

fn closed() -> &'static Closed {
    static CLOSED: OnceLock<Closed> = OnceLock::new();
    CLOSED.get_or_init(|| {
        let closed = Closed::default();
        let subscriber = tracing_subscriber::registry().with(Collect(closed.clone()));
        tracing::subscriber::set_global_default(subscriber).unwrap();
        closed
    })
}

/// The closed spans named `name` for `resource`.
fn spans(name: &str, resource: &str) -> Vec<Fields> {
    closed()
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(n, f)| n == name && f.get("resource").map(String::as_str) == Some(resource))
        .map(|(_, f)| f.clone())
        .collect()
}

fn outcomes(name: &str, resource: &str) -> Vec<String> {
    spans(name, resource)
        .iter()
        .map(|f| f.get("outcome").cloned().unwrap_or_default())
        .collect()
}

async fn sqlite(dir: &tempfile::TempDir) -> Client {
    closed();
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    Client::connect(&url).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn acquire_renew_and_release_run_in_engine_call_spans() {
    let dir = tempfile::tempdir().unwrap();
    let c = sqlite(&dir).await;
    // Long enough that a renewal (given half a cadence) succeeds even on a busy machine.
    let opts = LockOptions::default().ttl(Duration::from_millis(1500));
    let lease = c.try_acquire("s-traced", &opts).await.unwrap();
    // The watchdog's renewal of a one-lease batch is named after that lease.
    let renewed = tokio::time::timeout(Duration::from_secs(10), async {
        while spans("engine_call", "s-traced").len() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(renewed.is_ok(), "no renewal span");
    lease.release().await.unwrap();

    let calls = spans("engine_call", "s-traced");
    assert!(calls.len() >= 3, "acquire, renewal and release: {calls:?}");
    for call in &calls {
        assert_eq!(call.get("engine").map(String::as_str), Some("sqlite"));
        assert_eq!(
            call.get("outcome").map(String::as_str),
            Some("ok"),
            "{call:?}"
        );
    }
    assert_eq!(outcomes("acquire", "s-traced"), ["acquired"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_acquire_records_its_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let holder = sqlite(&dir).await;
    let other = sqlite(&dir).await;
    let lease = holder
        .try_acquire("s-held", &LockOptions::default())
        .await
        .unwrap();
    let e = other
        .try_acquire("s-held", &LockOptions::default())
        .await
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::HeldByAnother);
    assert_eq!(outcomes("acquire", "s-held"), ["acquired", "held"]);
    // The engine answered both attempts: the calls themselves succeeded.
    assert_eq!(outcomes("engine_call", "s-held"), ["ok", "ok"]);
    lease.release().await.unwrap();
}

/// A stopped server accepts connections but never answers: the call's deadline, not an error
/// of the engine, ends it. (A SQLite file held by another process is no such case: its busy
/// timeout equals the call's deadline, and either may end the call first.)
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn an_engine_call_without_an_answer_records_a_timeout() {
    closed();
    let server = fencelock_testkit::RedisServer::start().unwrap();
    let c = Client::builder(server.url())
        .op_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    server.pause().unwrap();
    let e = c
        .try_acquire("s-stuck", &LockOptions::default())
        .await
        .unwrap_err();
    server.resume().unwrap();
    assert_eq!(e.kind(), ErrorKind::Engine, "{e}");
    assert_eq!(outcomes("acquire", "s-stuck"), ["error"]);
    let calls = spans("engine_call", "s-stuck");
    assert!(
        calls
            .iter()
            .any(|f| f.get("outcome").map(String::as_str) == Some("timeout")),
        "{calls:?}"
    );
    c.close().await;
}
