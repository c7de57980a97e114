//! The HTTP plumbing around the handlers: JSON errors that name the field, the request body
//! reader, the middleware (auth, deadline, request metrics) and the TLS listener.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{FromRequest, MatchedPath, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use fencelock::ErrorKind;
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::ToSchema;

use super::auth::Principal;
use super::views::HolderView;
use super::AppState;

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// A stable code: `invalid_input`, `unauthorized`, `forbidden`, `not_found`, `held`,
    /// `timed_out`, `not_holder`, `lost`, `holder_alive`, `stale_token`, `engine`,
    /// `deadline`, `too_large`, `shutting_down`.
    pub error: &'static str,
    /// What went wrong and what to do, in one sentence.
    pub message: String,
    /// The request field that was refused, for `invalid_input`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub field: Option<String>,
    /// The current holder, for `held` and `timed_out`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = HolderView, required = false)]
    pub holder: Option<HolderView>,
}

/// An error answer: a status and an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    // Boxed: handlers return `Result<_, ApiError>` everywhere, and the Ok side is small.
    pub body: Box<ErrorBody>,
}

impl ApiError {
    pub fn new(status: StatusCode, error: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: Box::new(ErrorBody {
                error,
                message: message.into(),
                field: None,
                holder: None,
            }),
        }
    }

    /// 400 naming the field.
    pub fn field(field: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid_input", message);
        e.body.field = Some(field.to_owned());
        e
    }

    pub fn forbidden(name: &str) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("this client may not use {name:?}: it is outside the name prefixes its token allows"),
        )
    }

    pub fn not_found(what: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", what)
    }

    /// A library error, mapped to the status a client can act on. `field` names the request
    /// field an invalid-input error is about.
    pub fn from_lib(e: &fencelock::Error, field: &str) -> ApiError {
        let (status, code) = match e.kind() {
            ErrorKind::InvalidInput => (StatusCode::BAD_REQUEST, "invalid_input"),
            ErrorKind::HeldByAnother => (StatusCode::CONFLICT, "held"),
            ErrorKind::TimedOut => (StatusCode::CONFLICT, "timed_out"),
            ErrorKind::NotHolder => (StatusCode::CONFLICT, "not_holder"),
            ErrorKind::LeaseLost => (StatusCode::GONE, "lost"),
            ErrorKind::StaleToken => (StatusCode::CONFLICT, "stale_token"),
            // A limit stored in the engine (TTL cap, per-client quota): `fencelock run` exits
            // 77, EX_NOPERM, on it; the HTTP equivalent is a refusal, not a conflict.
            ErrorKind::LimitExceeded => (StatusCode::FORBIDDEN, "limit"),
            _ => (StatusCode::SERVICE_UNAVAILABLE, "engine"),
        };
        let mut err = ApiError::new(status, code, e.to_string());
        if code == "invalid_input" {
            err.body.field = Some(field.to_owned());
        }
        err.body.holder = e
            .holder()
            .map(|h| HolderView::of(e.resource().unwrap_or(""), h));
        err
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(*self.body)).into_response()
    }
}

/// The largest request body accepted.
pub const MAX_BODY: usize = 64 * 1024;

/// A JSON body whose refusal names the field: `serde_path_to_error` tracks where the
/// deserializer was when it failed. Any content type is read as JSON, so `curl -d` works.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                let mut err = ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "too_large",
                    format!("the request body is larger than {} KiB", MAX_BODY / 1024),
                );
                err.body.field = Some("body".into());
                err
            } else {
                ApiError::field("body", format!("cannot read the request body: {e}"))
            }
        })?;
        parse_json(&bytes).map(JsonBody)
    }
}

pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner().to_string();
        // A missing field fails at the object, so the path names its parent: take the name
        // from serde's message instead.
        let field = match inner.split('`').nth(1) {
            Some(name) if inner.starts_with("missing field") => name.to_owned(),
            _ if path == "." => "body".to_owned(),
            _ => path,
        };
        ApiError::field(&field, format!("{field}: {inner}"))
    })
}

/// Checks the bearer token (when there is an auth file) and puts the [`Principal`] into the
/// request's extensions.
pub async fn authenticate(
    State(app): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let principal = match &app.auth {
        None => Principal::local(),
        Some(auth) => {
            let presented = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::trim);
            match presented.and_then(|t| auth.check(t)) {
                Some(p) => p,
                None => {
                    let mut r = ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        "unauthorized",
                        "send a valid token from the auth file: Authorization: Bearer TOKEN",
                    )
                    .into_response();
                    r.headers_mut()
                        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                    return r;
                }
            }
        }
    };
    req.extensions_mut().insert(principal);
    next.run(req).await
}

/// Counts and times every request by route, and gives it a deadline. Acquire and the event
/// stream set their own: acquire waits as long as it was asked to, a stream lasts as long
/// as its lease.
pub async fn deadline_and_metrics(
    State(app): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = req.method().as_str().to_owned();
    let own_deadline = route.ends_with("/events") || route == "/v1/acquire";
    let started = Instant::now();
    let response = if own_deadline {
        next.run(req).await
    } else {
        match tokio::time::timeout(app.request_timeout, next.run(req)).await {
            Ok(r) => r,
            Err(_) => deadline_passed(app.request_timeout),
        }
    };
    let status = response.status().as_u16().to_string();
    metrics::counter!(REQUESTS, "route" => route.clone(), "method" => method, "status" => status)
        .increment(1);
    metrics::histogram!(REQUEST_DURATION, "route" => route).record(started.elapsed().as_secs_f64());
    response
}

pub fn deadline_passed(limit: Duration) -> Response {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "deadline",
        format!(
            "the request did not complete within {}; the engine may be slow or unreachable",
            crate::human_duration(limit)
        ),
    )
    .into_response()
}

/// Requests answered, by route, method and status.
pub const REQUESTS: &str = "fencelock_sidecar_requests_total";
/// Time to answer a request (for the event stream: until its headers), by route.
pub const REQUEST_DURATION: &str = "fencelock_sidecar_request_duration_seconds";

/// Buckets of [`REQUEST_DURATION`].
pub const REQUEST_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

pub fn describe() {
    metrics::describe_counter!(
        REQUESTS,
        "Sidecar requests answered, by route, method and status."
    );
    metrics::describe_histogram!(
        REQUEST_DURATION,
        metrics::Unit::Seconds,
        "Time the sidecar took to answer, by route."
    );
}

/// TLS: a listener whose connections have completed the handshake. Handshakes run in their
/// own tasks with a deadline, so a slow client does not hold up the accept loop.
pub mod tls {
    use std::io;
    use std::net::SocketAddr;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::mpsc;
    use tokio_rustls::server::TlsStream;
    use tokio_rustls::TlsAcceptor;

    /// Reads the certificate chain and key (PEM) into a server configuration, with the
    /// build's one crypto provider, ring.
    pub fn config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(|i| i.collect::<Result<_, _>>())
            .map_err(|e| pem_error("--tls-cert", cert, "certificates", e))?;
        if certs.is_empty() {
            return Err(format!(
                "--tls-cert {}: no certificate in the file",
                cert.display()
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| pem_error("--tls-key", key, "a private key", e))?;
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("--tls-cert/--tls-key: {e}"))
    }

    /// The file's problem without its contents: a PEM parser's error can quote a line of a
    /// key file, which must never reach a log.
    fn pem_error(
        option: &str,
        path: &Path,
        what: &str,
        e: rustls::pki_types::pem::Error,
    ) -> String {
        match e {
            rustls::pki_types::pem::Error::Io(io) => format!("{option} {}: {io}", path.display()),
            _ => format!(
                "{option} {}: cannot read {what} in PEM form from it",
                path.display()
            ),
        }
    }

    pub struct TlsListener {
        local: SocketAddr,
        ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    }

    impl TlsListener {
        pub fn new(listener: TcpListener, config: rustls::ServerConfig) -> io::Result<TlsListener> {
            let local = listener.local_addr()?;
            let acceptor = TlsAcceptor::from(Arc::new(config));
            let (tx, ready) = mpsc::channel(64);
            tokio::spawn(async move {
                loop {
                    let (tcp, peer) = match listener.accept().await {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::warn!("accept failed: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let (acceptor, ready) = (acceptor.clone(), tx.clone());
                    tokio::spawn(async move {
                        let hs =
                            tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp));
                        match hs.await {
                            Ok(Ok(tls)) => {
                                let _ = ready.send((tls, peer)).await;
                            }
                            Ok(Err(e)) => tracing::debug!(%peer, "TLS handshake failed: {e}"),
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    });
                    if tx.is_closed() {
                        return;
                    }
                }
            });
            Ok(TlsListener { local, ready })
        }
    }

    impl axum::serve::Listener for TlsListener {
        type Io = TlsStream<TcpStream>;
        type Addr = SocketAddr;

        async fn accept(&mut self) -> (Self::Io, Self::Addr) {
            match self.ready.recv().await {
                Some(c) => c,
                // The accept task only ends when this listener is dropped.
                None => std::future::pending().await,
            }
        }

        fn local_addr(&self) -> io::Result<SocketAddr> {
            Ok(self.local)
        }
    }
}
