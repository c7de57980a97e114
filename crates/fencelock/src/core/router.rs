//! The backends of a routed client ([`Client::routed`](crate::Client::routed)), each opened the
//! first time a call needs it rather than all when the client starts: a process whose names
//! all route to healthy backends never waits on one that is down, and a backend that was down
//! when the process started serves it once it is back.
//!
//! Opening is shared: calls that find an attempt under way wait for it and share its outcome,
//! so a backend that is down costs each of them one attempt at most, never a queue of them. A
//! failed attempt leaves nothing behind, and the next call tries again. Each attempt is
//! bounded by the engine's own deadlines and by [`OPEN_LIMIT`] operation timeouts in all.
//!
//! Listings that ask several backends ([`Client::list`](crate::Client::list),
//! [`Client::audit`](crate::Client::audit) without a name) ask them at once and gather what
//! those that answered hold, with each one that failed and why: a [`Partial`].

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use crate::core::client::{ClientBuilder, ClientInner};
use crate::core::engine::{EngineConfig, Opened};
use crate::core::error::{Error, ErrorKind, Result};
use crate::core::options::display_duration;
use crate::core::routes::Routes;

/// The bound on opening one backend, in operation timeouts: engines bound each of their own
/// steps (a name lookup, a connection, a handshake), this bounds them together.
pub(crate) const OPEN_LIMIT: u32 = 3;

/// How the registry opens one backend's engine, when the core first needs it.
pub(crate) type OpenEngine =
    Box<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Opened>> + Send>> + Send + Sync>;

/// The engine keys of a name on one backend, from its URL alone.
pub(crate) type EngineKeys = Box<dyn Fn(&str) -> Result<Vec<(&'static str, String)>> + Send + Sync>;

/// What the registry knows of a backend before it is opened.
pub(crate) struct Unopened {
    /// The engine's short name, from the URL.
    pub(crate) engine: &'static str,
    pub(crate) keys: EngineKeys,
    pub(crate) open: OpenEngine,
}

/// The backends of a routed client and the table that picks one per name.
pub(crate) struct Router {
    pub(crate) routes: Routes,
    backends: BTreeMap<String, LazyBackend>,
    /// The backend that speaks for the client as a whole (its `engine()`, `url()`, limits):
    /// the default backend, else the first by name.
    main: String,
}

/// One backend, opened on first use.
struct LazyBackend {
    name: String,
    /// Its URL, password redacted.
    url: String,
    /// The builder of this backend's client: the routed client's settings, its URL and name.
    builder: ClientBuilder,
    cfg: EngineConfig,
    unopened: Unopened,
    opened: OnceLock<Arc<ClientInner>>,
    /// Held while an attempt to open runs; keeps the last failed attempt, which the calls
    /// that waited for it share.
    attempt: tokio::sync::Mutex<Option<Failed>>,
}

struct Failed {
    ended: Instant,
    error: Error,
}

impl Router {
    /// A router on `backends` (name, builder, what the registry knows), none opened yet.
    pub(crate) fn new(
        routes: Routes,
        cfg: &EngineConfig,
        backends: Vec<(String, ClientBuilder, Unopened)>,
    ) -> Result<Router> {
        let main = routes
            .default_backend_name()
            .map(str::to_owned)
            .or_else(|| backends.first().map(|(n, _, _)| n.clone()))
            .ok_or_else(|| Error::invalid("the routing table names no backend"))?;
        let backends = backends
            .into_iter()
            .map(|(name, builder, unopened)| {
                let lazy = LazyBackend {
                    url: crate::core::url::redact_url(routes.url_of(&name).unwrap_or_default()),
                    name: name.clone(),
                    builder,
                    cfg: cfg.clone(),
                    unopened,
                    opened: OnceLock::new(),
                    attempt: tokio::sync::Mutex::new(None),
                };
                (name, lazy)
            })
            .collect();
        Ok(Router {
            routes,
            backends,
            main,
        })
    }

    /// The name of the backend that speaks for the client as a whole.
    pub(crate) fn main(&self) -> &str {
        &self.main
    }

    /// Every backend's name and engine, in name order, opened or not.
    pub(crate) fn names(&self) -> impl Iterator<Item = (&str, &'static str)> {
        self.backends
            .iter()
            .map(|(n, b)| (n.as_str(), b.unopened.engine))
    }

    /// The engine of the backend called `name`.
    pub(crate) fn engine_of(&self, name: &str) -> Option<&'static str> {
        self.backends.get(name).map(|b| b.unopened.engine)
    }

    /// The URL of the backend called `name`, password redacted.
    pub(crate) fn url_of(&self, name: &str) -> Option<&str> {
        self.backends.get(name).map(|b| b.url.as_str())
    }

    /// The backends opened so far.
    pub(crate) fn opened(&self) -> impl Iterator<Item = &Arc<ClientInner>> {
        self.backends.values().filter_map(|b| b.opened.get())
    }

    /// The engine keys of `name` on its backend, without opening it.
    pub(crate) fn keys(&self, name: &str) -> Result<Vec<(&'static str, String)>> {
        let backend = self.backend(self.routes.backend_for(name)?, name)?;
        (backend.unopened.keys)(name)
    }

    /// The backend `name` routes to, opened if it was not.
    pub(crate) async fn route(&self, name: &str) -> Result<&Arc<ClientInner>> {
        let backend = self.routes.backend_for(name)?;
        self.open(backend).await
    }

    /// The backend called `backend`, opened if it was not.
    pub(crate) async fn open(&self, backend: &str) -> Result<&Arc<ClientInner>> {
        self.backend(backend, backend)?.get().await
    }

    fn backend(&self, backend: &str, about: &str) -> Result<&LazyBackend> {
        self.backends.get(backend).ok_or_else(|| {
            Error::invalid(format!("backend {backend:?} is not in the routing table"))
                .with_resource(about)
        })
    }
}

impl LazyBackend {
    async fn get(&self) -> Result<&Arc<ClientInner>> {
        if let Some(inner) = self.opened.get() {
            return Ok(inner);
        }
        let arrived = Instant::now();
        let mut last = self.attempt.lock().await;
        if let Some(inner) = self.opened.get() {
            return Ok(inner);
        }
        // An attempt that ended after this call arrived was under way meanwhile: its outcome
        // is as fresh as a new attempt's would be.
        if let Some(failed) = last.as_ref().filter(|f| f.ended >= arrived) {
            return Err(failed.error.duplicate());
        }
        let limit = self.cfg.op_timeout.saturating_mul(OPEN_LIMIT);
        let opened = match tokio::time::timeout(limit, (self.unopened.open)()).await {
            Ok(Ok(opened)) => opened,
            Ok(Err(e)) => return Err(self.failed(&mut last, e)),
            Err(_) => {
                let e = Error::engine_failure(
                    self.unopened.engine,
                    format!(
                        "could not be opened within {}; check that it is up and reachable",
                        display_duration(limit)
                    ),
                );
                return Err(self.failed(&mut last, e));
            }
        };
        *last = None;
        tracing::debug!(backend = %self.name, "backend opened");
        let inner = self.builder.clone().start_inner(self.cfg.clone(), opened);
        Ok(self.opened.get_or_init(|| inner))
    }

    fn failed(&self, last: &mut Option<Failed>, e: Error) -> Error {
        let e = if e.backend().is_none() {
            e.with_backend(&self.name)
        } else {
            e
        };
        tracing::debug!(backend = %self.name, error = %e, "backend failed to open");
        *last = Some(Failed {
            ended: Instant::now(),
            error: e.duplicate(),
        });
        e
    }
}

/// What a call over several backends found: the rows of those that answered, and each backend
/// that failed with its error. [`Client::list_partial`](crate::Client::list_partial) and
/// [`Client::audit_partial`](crate::Client::audit_partial) hand it over as it is;
/// [`Client::list`](crate::Client::list) and [`Client::audit`](crate::Client::audit) turn
/// any failure into their error ([`Partial::complete`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct Partial<T> {
    /// What the backends that answered hold, merged and sorted as the complete call sorts it.
    pub found: Vec<T>,
    /// The backends that answered, in name order.
    pub answered: Vec<String>,
    /// The backends that did not answer, in name order, each with its error.
    pub failed: Vec<BackendFailure>,
}

/// A backend that failed to answer a call over several backends.
#[derive(Debug)]
#[non_exhaustive]
pub struct BackendFailure {
    /// The backend's name (`default` for a client opened on one URL).
    pub backend: String,
    /// Why: it could not be opened, it failed, or it did not answer in time. The error names
    /// the backend.
    pub error: Error,
}

impl<T> Partial<T> {
    /// Whether every backend asked answered.
    pub fn is_complete(&self) -> bool {
        self.failed.is_empty()
    }

    /// The rows, when every backend asked answered.
    ///
    /// # Errors
    /// The error of the backend that failed; when several did, an
    /// [`ErrorKind::Engine`] error naming each with its error.
    pub fn complete(mut self) -> Result<Vec<T>> {
        match self.failed.len() {
            0 => Ok(self.found),
            1 => Err(self.failed.remove(0).error),
            n => Err(Error::new(
                ErrorKind::Engine,
                format!(
                    "{n} backends failed: {}",
                    self.failed
                        .iter()
                        .map(|f| f.error.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            )),
        }
    }
}

/// Asks each backend of `names` at once with `ask` (opening it first if needed), and gathers
/// what they answer by `within` (none later: a backend still silent then is counted failed;
/// `None`: each as long as its own bounds).
pub(crate) async fn gather<T, F, Fut>(
    router: &Arc<Router>,
    names: Vec<String>,
    within: Option<Duration>,
    ask: F,
) -> Partial<T>
where
    T: Send + 'static,
    F: Fn(Arc<ClientInner>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<Vec<T>>> + Send + 'static,
{
    let deadline = within.and_then(|w| Some((Instant::now().checked_add(w)?, w)));
    let mut asked = tokio::task::JoinSet::new();
    let mut by_task = std::collections::HashMap::new();
    for name in names {
        let engine = router.engine_of(&name).unwrap_or("unknown");
        let (router, ask, backend) = (router.clone(), ask.clone(), name.clone());
        let one = async move {
            let inner = router.open(&backend).await?.clone();
            ask(inner).await
        };
        let task = asked.spawn(async move {
            match deadline {
                Some((at, within)) => tokio::time::timeout_at(at, one)
                    .await
                    .unwrap_or_else(|_| Err(silent(engine, within))),
                None => one.await,
            }
        });
        by_task.insert(task.id(), name);
    }
    let mut partial = Partial {
        found: Vec::new(),
        answered: Vec::new(),
        failed: Vec::new(),
    };
    while let Some(done) = asked.join_next_with_id().await {
        let (id, answer) = match done {
            Ok((id, answer)) => (id, answer),
            Err(e) => (
                e.id(),
                Err(Error::new(
                    ErrorKind::Engine,
                    format!("the task asking this backend failed: {e}"),
                )),
            ),
        };
        let backend = by_task.remove(&id).unwrap_or_default();
        match answer {
            Ok(rows) => {
                partial.found.extend(rows);
                partial.answered.push(backend);
            }
            Err(e) => {
                let error = if e.backend().is_none() {
                    e.with_backend(&backend)
                } else {
                    e
                };
                partial.failed.push(BackendFailure { backend, error });
            }
        }
    }
    partial.answered.sort();
    partial.failed.sort_by(|a, b| a.backend.cmp(&b.backend));
    partial
}

/// The failure of a backend that did not answer within `limit`.
pub(crate) fn silent(engine: &'static str, limit: Duration) -> Error {
    Error::engine_failure(
        engine,
        format!("no answer within {}", display_duration(limit)),
    )
}

/// The answer of a client on one backend to a call over "all" its backends.
pub(crate) fn single<T>(backend: &str, answer: Result<Vec<T>>) -> Partial<T> {
    match answer {
        Ok(found) => Partial {
            found,
            answered: vec![backend.to_owned()],
            failed: Vec::new(),
        },
        Err(error) => Partial {
            found: Vec::new(),
            answered: Vec::new(),
            failed: vec![BackendFailure {
                backend: backend.to_owned(),
                error,
            }],
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(backend: &str) -> BackendFailure {
        BackendFailure {
            backend: backend.into(),
            error: Error::engine_failure("redis", "cannot connect").with_backend(backend),
        }
    }

    #[test]
    fn complete_is_the_rows_or_every_failure() {
        let whole = Partial {
            found: vec![1, 2],
            answered: vec!["a".into()],
            failed: Vec::new(),
        };
        assert!(whole.is_complete());
        assert_eq!(whole.complete().unwrap(), [1, 2]);

        let one = Partial {
            found: vec![1],
            answered: vec!["a".into()],
            failed: vec![failure("b")],
        };
        let e = one.complete().unwrap_err();
        assert_eq!(e.backend(), Some("b"));
        assert_eq!(e.to_string(), "backend b (redis): cannot connect");

        let two = Partial::<u8> {
            found: Vec::new(),
            answered: Vec::new(),
            failed: vec![failure("b"), failure("c")],
        };
        let e = two.complete().unwrap_err().to_string();
        assert!(e.starts_with("2 backends failed: backend b (redis)"), "{e}");
        assert!(e.contains("; backend c (redis)"), "{e}");
    }
}
