//! An HTTP fence: a tower [`Layer`] that refuses requests carrying a stale fencing token before
//! the service behind it runs, and the client-side helpers that set the headers it reads.
//!
//! A writer sends its lease's resource and token in two headers, [`FENCING_RESOURCE`] and
//! [`FENCING_TOKEN`] (a decimal `u64`). [`FenceLayer`] admits the token through a
//! [`FenceStore`] ([`MemoryFence`], or [`RedisFence`] with the `redis` feature) and answers:
//!
//! | request | answer | inner service called |
//! |---|---|---|
//! | token at least the highest seen | the inner service's | yes |
//! | token lower than the highest seen | `409 Conflict`, naming both tokens | no |
//! | a header missing | `428 Precondition Required` | no |
//! | a header malformed, or not the layer's fixed resource | `400 Bad Request` | no |
//! | the store unreachable | `503 Service Unavailable` | no |
//!
//! Rejections have a one-line `text/plain` body saying what to do. A stale token is counted in
//! `fencelock_stale_token_rejections_total` by the store and logged at `warn`.
//!
//! # What the layer does not do
//! The check happens before the handler runs, and nothing ties it to the handler's own write:
//! a request admitted with token 7 can still be overtaken by one with token 8 before its
//! handler writes. The layer's value is refusing zombie requests at the door, from writers that
//! lost their lease long ago. Where the write itself must be fenced, make it inside the handler
//! through a guard that checks the token atomically with the write, such as
//! [`RedisFence::set`] or [`RedisFence::script`]; the admitted resource and token are in the
//! request's extensions as [`AdmittedToken`] for that.
//!
//! The resource named in the header is the client's word. On a route that serves one resource,
//! fix it with [`FenceLayer::with_resource`], so a client cannot fence itself against another
//! resource's tokens (or fill an in-memory store with names).
//!
//! ```no_run
//! # async fn demo() {
//! use std::sync::Arc;
//! use fencelock::fence::{http::FenceLayer, MemoryFence};
//!
//! let fence = FenceLayer::new(Arc::new(MemoryFence::new()));
//! let app: axum::Router = axum::Router::new()
//!     .route("/ledger", axum::routing::post(|| async { "written" }))
//!     .layer(fence);
//! # }
//! ```
//!
//! [`Layer`]: tower_layer::Layer
//! [`RedisFence`]: crate::fence::RedisFence
//! [`RedisFence::set`]: crate::fence::RedisFence::set
//! [`RedisFence::script`]: crate::fence::RedisFence::script

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use ::http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE};
use ::http::{Request, Response, StatusCode};
use async_trait::async_trait;
use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, CONTROLS};
use tower_layer::Layer;
use tower_service::Service;

use crate::core::error::{Error, ErrorKind, Result};
use crate::core::lease::Lease;
use crate::core::name::validate_name;
use crate::core::token::FencingToken;
use crate::fence::MemoryFence;

/// The request header carrying the fencing token, a decimal `u64`.
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");

/// The request header naming the fenced resource, percent-encoded (see [`encode_resource`]).
pub const FENCING_RESOURCE: HeaderName = HeaderName::from_static("fencing-resource");

/// Resource names may hold any UTF-8 but control characters, and may start or end with a
/// space; HTTP values are visible ASCII with surrounding whitespace stripped. Encoding spaces
/// and `%` besides (non-ASCII is always encoded) makes every name survive the trip.
const HEADER_UNSAFE: &AsciiSet = &CONTROLS.add(b' ').add(b'%');

/// A resource name as the [`FENCING_RESOURCE`] header carries it: percent-encoded where it
/// is not visible ASCII, and at `%` and spaces. Names of plain ASCII words pass unchanged.
pub fn encode_resource(resource: &str) -> String {
    utf8_percent_encode(resource, HEADER_UNSAFE).to_string()
}

/// The two headers that fence a request made under `lease`, to add to a request builder.
///
/// ```
/// # fn demo(lease: &fencelock::Lease) -> Result<(), Box<dyn std::error::Error>> {
/// let mut req = http::Request::post("http://ledger.internal/entries");
/// for (name, value) in fencelock::fence::http::fencing_headers(lease) {
///     req = req.header(name, value);
/// }
/// let req = req.body(())?;
/// # Ok(()) }
/// ```
pub fn fencing_headers(lease: &Lease) -> [(HeaderName, HeaderValue); 2] {
    headers_for(lease.resource(), lease.token())
}

/// Sets the two headers that fence a request on `resource` with `token`, replacing any there.
///
/// Fails with [`ErrorKind::InvalidInput`] if `resource` is not a valid resource name.
pub fn apply_fencing_headers(
    headers: &mut HeaderMap,
    resource: &str,
    token: FencingToken,
) -> Result<()> {
    validate_name(resource)?;
    for (name, value) in headers_for(resource, token) {
        headers.insert(name, value);
    }
    Ok(())
}

fn headers_for(resource: &str, token: FencingToken) -> [(HeaderName, HeaderValue); 2] {
    [
        (FENCING_RESOURCE, text_value(encode_resource(resource))),
        (FENCING_TOKEN, HeaderValue::from(token.get())),
    ]
}

/// For strings this module built itself (visible ASCII); an impossible failure degrades to an
/// empty value, which the fence refuses as malformed rather than the client panicking.
fn text_value(s: String) -> HeaderValue {
    HeaderValue::try_from(s).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Where [`FenceLayer`] checks and records tokens: the fence store shared with every other
/// writer to the resource. Implemented for [`MemoryFence`] and, with the `redis` feature,
/// [`RedisFence`](crate::fence::RedisFence).
#[async_trait]
pub trait FenceStore: Send + Sync {
    /// Records `token` as the highest for `resource` unless a higher one has been seen, in
    /// which case it fails with [`ErrorKind::StaleToken`] carrying both tokens.
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<()>;
}

#[async_trait]
impl FenceStore for MemoryFence {
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<()> {
        MemoryFence::admit(self, resource, token)
    }
}

#[cfg(feature = "redis")]
#[async_trait]
impl FenceStore for crate::fence::RedisFence {
    async fn admit(&self, resource: &str, token: FencingToken) -> Result<()> {
        crate::fence::RedisFence::admit(self, resource, token).await
    }
}

/// The resource and token a request was admitted with, put in its extensions by the fence so
/// the handler can fence its own writes with them (in axum, `Extension<AdmittedToken>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmittedToken {
    /// The fenced resource.
    pub resource: String,
    /// The token, not lower than any seen for the resource when the request was admitted.
    pub token: FencingToken,
}

/// A tower layer that admits a request's fencing token before the inner service runs; see
/// the [module docs](self) for the answers it gives. Cloning shares the store.
#[derive(Clone)]
pub struct FenceLayer {
    store: Arc<dyn FenceStore>,
    resource: Option<Arc<str>>,
}

impl FenceLayer {
    /// A layer admitting tokens through `store`, for the resource each request names.
    pub fn new(store: Arc<dyn FenceStore>) -> FenceLayer {
        FenceLayer {
            store,
            resource: None,
        }
    }

    /// Fences every request on `resource`: the [`FENCING_RESOURCE`] header becomes optional
    /// and, when present, must name the same resource.
    ///
    /// Fails with [`ErrorKind::InvalidInput`] if `resource` is not a valid resource name.
    pub fn with_resource(mut self, resource: &str) -> Result<FenceLayer> {
        validate_name(resource)?;
        self.resource = Some(Arc::from(resource));
        Ok(self)
    }
}

impl fmt::Debug for FenceLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceLayer")
            .field("resource", &self.resource)
            .finish_non_exhaustive()
    }
}

impl<S> Layer<S> for FenceLayer {
    type Service = Fenced<S>;

    fn layer(&self, inner: S) -> Fenced<S> {
        Fenced {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`FenceLayer`] wraps around an inner service.
#[derive(Clone, Debug)]
pub struct Fenced<S> {
    inner: S,
    layer: FenceLayer,
}

/// The future [`Fenced`] returns.
pub type FencedFuture<T, E> = Pin<Box<dyn Future<Output = std::result::Result<T, E>> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Fenced<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
    ResBody: From<String>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = FencedFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        // The service that was polled ready is the one that must be called; the clone stays
        // behind for the next poll_ready.
        let ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, ready);
        let layer = self.layer.clone();
        Box::pin(async move {
            match admit(&layer, req.headers()).await {
                Ok(admitted) => {
                    req.extensions_mut().insert(admitted);
                    inner.call(req).await
                }
                Err(refusal) => Ok(refusal.into_response()),
            }
        })
    }
}

/// Why a request was refused, and what the client should do about it.
struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
        }
    }

    fn into_response<B: From<String>>(self) -> Response<B> {
        let mut res = Response::new(B::from(format!("{}\n", self.message)));
        *res.status_mut() = self.status;
        res.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        res
    }
}

async fn admit(layer: &FenceLayer, headers: &HeaderMap) -> Result<AdmittedToken, Refusal> {
    let resource = match (single(headers, &FENCING_RESOURCE)?, &layer.resource) {
        (None, Some(fixed)) => fixed.to_string(),
        (None, None) => {
            return Err(Refusal::new(
                StatusCode::PRECONDITION_REQUIRED,
                "this endpoint is fenced: send the resource in the Fencing-Resource header \
                 and the lease's token in the Fencing-Token header",
            ))
        }
        (Some(value), fixed) => {
            let named = decode_resource(value)?;
            if let Some(fixed) = fixed.as_deref().filter(|f| *f != named) {
                return Err(Refusal::new(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "this endpoint is fenced on {fixed:?}, but Fencing-Resource names \
                         {named:?}; send a token for {fixed:?}"
                    ),
                ));
            }
            named
        }
    };
    let token = match single(headers, &FENCING_TOKEN)? {
        Some(value) => parse_token(value)?,
        None => {
            return Err(Refusal::new(
                StatusCode::PRECONDITION_REQUIRED,
                format!(
                    "this endpoint is fenced on {resource:?}: send the lease's token in the \
                     Fencing-Token header"
                ),
            ))
        }
    };
    match layer.store.admit(&resource, token).await {
        Ok(()) => Ok(AdmittedToken { resource, token }),
        Err(e) => Err(refused(&resource, token, e)),
    }
}

fn refused(resource: &str, token: FencingToken, e: Error) -> Refusal {
    match (e.kind(), e.stale_tokens()) {
        (ErrorKind::StaleToken, Some((presented, highest))) => {
            tracing::warn!(
                resource,
                presented = presented.get(),
                highest = highest.get(),
                "HTTP fence refused a stale fencing token"
            );
            Refusal::new(
                StatusCode::CONFLICT,
                format!(
                    "fencing token {presented} for {resource:?} is stale: the resource has \
                     already seen token {highest}; this writer lost its lease and must stop"
                ),
            )
        }
        (ErrorKind::InvalidInput, _) => Refusal::new(StatusCode::BAD_REQUEST, e.to_string()),
        _ => {
            tracing::warn!(resource, token = token.get(), error = %e, "HTTP fence could not check a token");
            Refusal::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the fence for {resource:?} cannot check tokens right now; retry later"),
            )
        }
    }
}

/// The header's one value; a repeated header is refused, since its values could disagree.
fn single<'a>(
    headers: &'a HeaderMap,
    name: &HeaderName,
) -> Result<Option<&'a HeaderValue>, Refusal> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("the {name} header is repeated; send it once"),
        ));
    }
    Ok(first)
}

fn decode_resource(value: &HeaderValue) -> Result<String, Refusal> {
    let malformed = |why: &str| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("the Fencing-Resource header is malformed: {why}"),
        )
    };
    let raw = std::str::from_utf8(value.as_bytes())
        .map_err(|_| malformed("not UTF-8; percent-encode the resource name"))?;
    let name = percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| malformed("its percent-encoding does not decode to UTF-8"))?;
    validate_name(&name).map_err(|e| malformed(&e.to_string()))?;
    Ok(name.into_owned())
}

fn parse_token(value: &HeaderValue) -> Result<FencingToken, Refusal> {
    value
        .to_str()
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(FencingToken::new)
        .ok_or_else(|| {
            Refusal::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "the Fencing-Token header is malformed: {:?} is not a fencing token; send \
                     the lease's token as a decimal number",
                    String::from_utf8_lossy(value.as_bytes())
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn plain_names_pass_unchanged() {
        assert_eq!(encode_resource("nightly-invoices"), "nightly-invoices");
        assert_eq!(encode_resource("a:fence/{x}"), "a:fence/{x}");
    }

    proptest! {
        /// Every valid name, spaces, `%` and non-ASCII included, survives a header round trip.
        #[test]
        fn every_valid_name_survives_the_header(
            name in "[^\\p{Cc}]{1,60}".prop_filter("a valid name", |n| {
                crate::core::name::validate_name(n).is_ok()
            })
        ) {
            let [(_, value), _] = headers_for(&name, FencingToken::new(1));
            prop_assert_eq!(decode_resource(&value).ok(), Some(name));
        }
    }
}
