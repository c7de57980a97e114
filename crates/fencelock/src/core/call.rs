//! Every call the core makes to an engine goes through [`Calls`]: bounded by a deadline,
//! traced in an `engine_call` span with its outcome, and named in errors. An engine that
//! hangs costs its caller the deadline, never more.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tracing::Instrument;

use crate::core::error::{Error, Result};
use crate::core::options::display_duration;
use crate::core::routes::SINGLE_BACKEND;

/// How the core calls one engine: its name and URL (password redacted) for spans and errors.
#[derive(Debug, Clone)]
pub(crate) struct Calls {
    pub engine: &'static str,
    pub url: String,
    /// The backend's name in a routed client; `None` for a client opened on one URL.
    pub backend: Option<Arc<str>>,
}

impl Calls {
    /// The `backend` label of metrics: the backend's name, or `default`.
    pub(crate) fn backend_label(&self) -> &str {
        self.backend.as_deref().unwrap_or(SINGLE_BACKEND)
    }

    /// [`Calls::backend_label`] as a metric label, shared rather than copied per series.
    pub(crate) fn backend_metric_label(&self) -> crate::core::metrics::Label {
        match &self.backend {
            Some(b) => b.clone().into(),
            None => crate::core::metrics::Label::const_str(SINGLE_BACKEND),
        }
    }

    /// `e`, naming this backend when it is one of a routed client's.
    pub(crate) fn named(&self, e: Error) -> Error {
        match &self.backend {
            Some(b) if e.backend().is_none() => e.with_backend(b),
            _ => e,
        }
    }

    /// Runs one engine call on `resource` within `limit`; errors name the resource.
    pub(crate) async fn call<T>(
        &self,
        resource: &str,
        limit: Duration,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        self.traced(resource, limit, fut).await.map_err(|e| {
            if e.resource().is_none() {
                e.with_resource(resource)
            } else {
                e
            }
        })
    }

    /// Runs one engine call within `limit`, in a span labelled `label` (a resource, or what a
    /// batch is about), without naming a resource in its error.
    pub(crate) async fn traced<T>(
        &self,
        label: &str,
        limit: Duration,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let span = tracing::debug_span!(
            "engine_call",
            engine = self.engine,
            resource = label,
            outcome = tracing::field::Empty,
            error = tracing::field::Empty,
        );
        let answer = tokio::time::timeout(limit, fut)
            .instrument(span.clone())
            .await;
        match &answer {
            Ok(Ok(_)) => {
                span.record("outcome", "ok");
            }
            Ok(Err(e)) => {
                span.record("outcome", "error");
                span.record("error", tracing::field::display(e));
            }
            Err(_) => {
                span.record("outcome", "timeout");
            }
        }
        answer
            .unwrap_or_else(|_| {
                Err(Error::engine_failure(
                    self.engine,
                    format!(
                        "no answer from {} within {}; check that the engine is up and reachable",
                        self.url,
                        display_duration(limit)
                    ),
                ))
            })
            .map_err(|e| self.named(e))
    }
}
