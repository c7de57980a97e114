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
    /// A stable code, one of [`ErrorCode`]'s.
    #[schema(value_type = ErrorCode)]
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

/// The codes of [`ErrorBody::error`], for the OpenAPI document (the answers write them as
/// strings; a unit test checks that every code written is listed here).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
#[allow(dead_code)]
pub enum ErrorCode {
    /// 400: a bad request field, named by `field`.
    InvalidInput,
    /// 401: no valid bearer token (with an auth file).
    Unauthorized,
    /// 403: a name outside the token's prefixes.
    Forbidden,
    /// 403: refused by a TTL cap or a per-client quota stored in the engine.
    Limit,
    /// 403: an `Origin` other than the sidecar's own.
    CrossOrigin,
    /// 404: no such lease or route.
    NotFound,
    /// 409: held by another owner.
    Held,
    /// 409: still held when the wait ran out.
    TimedOut,
    /// 409: the lease had expired or been taken.
    NotHolder,
    /// 409: a forced release refused while the holder looks alive.
    HolderAlive,
    /// 409: a stale fencing token.
    StaleToken,
    /// 410: the lease has ended.
    Lost,
    /// 413: a body over 64 KiB.
    TooLarge,
    /// 415: a body not sent as `Content-Type: application/json`.
    ContentType,
    /// 421: a `Host` the sidecar is not served as.
    Misdirected,
    /// 503: the engine failed or is unreachable.
    Engine,
    /// 503: the request's deadline passed.
    Deadline,
    /// 503: the sidecar is shutting down.
    ShuttingDown,
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

/// An error answer in the shape of the route's API: Dapr's error body on Dapr's routes.
pub fn refuse(path: &str, e: ApiError) -> Response {
    if super::dapr::is_dapr(path) {
        super::dapr::refusal_of(e)
    } else {
        e.into_response()
    }
}

/// A JSON body whose refusal names the field: `serde_path_to_error` tracks where the
/// deserializer was when it failed. Its content type was checked before (see `browser`): only
/// `application/json` is read.
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

/// One JSON value, and nothing after it but whitespace.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
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
    })?;
    de.end().map_err(|e| {
        ApiError::field(
            "body",
            format!("body: trailing characters after the JSON value ({e}); send one JSON value"),
        )
    })?;
    Ok(value)
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
                .and_then(bearer);
            match presented.and_then(|t| auth.check(t)) {
                Some(p) => p,
                None => {
                    let e = ApiError::new(
                        StatusCode::UNAUTHORIZED,
                        "unauthorized",
                        "send a valid token from the auth file: Authorization: Bearer TOKEN",
                    );
                    let mut r = refuse(req.uri().path(), e);
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

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's case does not matter
/// (RFC 9110, section 11.1).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer abc"), Some("abc"));
        assert_eq!(bearer("BEARER\tabc "), Some("abc"));
        assert_eq!(bearer("Bearer   abc"), Some("abc"));
        for no in ["Basic abc", "Bearerabc", "Bearer", "Bearer   ", "", "abc"] {
            assert_eq!(bearer(no), None, "{no:?}");
        }
    }

    #[test]
    fn one_json_value_and_nothing_after_it() {
        #[derive(serde::Deserialize)]
        struct Body {
            #[allow(dead_code)]
            a: u8,
        }
        assert!(parse_json::<Body>(b"{\"a\": 1} \n").is_ok());
        for junk in [&b"{\"a\": 1} x"[..], b"{\"a\": 1}{}", b"{\"a\": 1} 2"] {
            let e = parse_json::<Body>(junk).err().unwrap();
            assert_eq!(e.body.field.as_deref(), Some("body"));
        }
    }

    /// Every code an answer is written with is listed in the document's `ErrorCode`: the
    /// codes follow a status (`StatusCode::X, "code"`) or are set on a body.
    #[test]
    fn every_error_code_written_is_documented() {
        let schema = serde_json::to_value(<ErrorCode as utoipa::PartialSchema>::schema()).unwrap();
        let listed: Vec<&str> = schema["enum"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        let sources = [
            include_str!("http.rs"),
            include_str!("api.rs"),
            include_str!("browser.rs"),
            include_str!("leases.rs"),
            include_str!("mod.rs"),
        ];
        let mut written = Vec::new();
        for src in sources {
            // The code, not its tests.
            let src = src.split("#[cfg(test)]").next().unwrap();
            for (marker, after) in [("StatusCode::", true), ("body.error = ", false)] {
                for (at, _) in src.match_indices(marker) {
                    let mut rest = &src[at + marker.len()..];
                    if after {
                        let end = rest
                            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .unwrap_or(rest.len());
                        rest = rest[end..].trim_start();
                        let Some(r) = rest.strip_prefix(',') else {
                            continue;
                        };
                        rest = r.trim_start();
                    }
                    let Some(r) = rest.strip_prefix('"') else {
                        continue;
                    };
                    let code = &r[..r.find('"').unwrap()];
                    if !code.starts_with("ERR_") {
                        written.push(code.to_owned());
                    }
                }
            }
        }
        assert!(written.len() > 10, "{written:?}");
        for code in written {
            assert!(
                listed.contains(&code.as_str()),
                "{code} is not in ErrorCode: {listed:?}"
            );
        }
    }
}
