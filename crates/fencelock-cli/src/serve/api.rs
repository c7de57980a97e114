//! The JSON API: acquire, the lease's event stream and keep-alives, release, extend, the
//! runbook (inspect, list, audit, forced release) and the fence.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fencelock::{ErrorKind, FencingToken, ForceRelease, LockOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio_stream::wrappers::ReceiverStream;
use utoipa::{IntoParams, ToSchema};

use super::auth::Principal;
use super::fence::Admitted;
use super::http::{ApiError, ErrorBody, JsonBody};
use super::leases::{Cmd, Grant, Held, Mode, Snapshot};
use super::views::{
    ms, when, AuditLog, AuditView, FailedBackend, HolderView, LockList, LockView, SidecarLeaseView,
};
use super::AppState;

type St = State<Arc<AppState>>;
type Who = Extension<Principal>;

/// Tag of the native API in the OpenAPI document.
pub const TAG: &str = "locks";

fn default_ttl() -> u64 {
    30_000
}

/// Acquire a lock.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    /// Resource name: 1 to 256 bytes, no control characters, bidirectional controls or
    /// invisible spaces.
    pub resource: String,
    /// Lease TTL in milliseconds (at least 100). Default 30000. The application must send a
    /// keep-alive within every TTL (every TTL/3 is safe), or the lease is released.
    #[serde(default = "default_ttl")]
    #[schema(default = 30000, minimum = 100)]
    pub ttl_ms: u64,
    /// How long to wait while another owner holds the lock, in milliseconds. Default 0 (one
    /// attempt). Waiting uses the engine's wake-ups, not polling.
    #[serde(default)]
    pub wait_ms: u64,
    /// Wait in FIFO order behind earlier waiters (engines with a queue).
    #[serde(default)]
    pub fair: bool,
    /// Client name recorded with the lease (shown by `inspect`). With an auth file it is the
    /// token's client name, and this field is refused if it differs.
    #[serde(default)]
    #[schema(value_type = String, required = false)]
    pub client: Option<String>,
}

/// A granted lease.
#[derive(Debug, Serialize, ToSchema)]
pub struct LeaseView {
    /// The lease's id: send it to release, extend, keep alive and watch the lease. Keep it
    /// secret: it is the lease.
    pub lease_id: String,
    pub resource: String,
    /// The fencing token: send it with every write to the protected resource.
    pub token: u64,
    /// The owner value the engine records for this lease.
    pub owner: String,
    pub client: String,
    /// When the lease was granted.
    pub granted_at: String,
    pub ttl_ms: u64,
    /// Time left in the validity window when this answer was made.
    pub valid_for_ms: u64,
    /// Time left before the lease is released unless a keep-alive arrives.
    pub keepalive_within_ms: u64,
    /// Open event streams.
    pub streams: usize,
    /// Confirmed renewals.
    pub renewals: u64,
    /// Set once the lease has ended (`released`, `expired`, `not_holder`, `force_released`,
    /// `application_gone`, `revoked`, `shutdown`).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = String, required = false)]
    pub ended: Option<&'static str>,
    /// Where the lease's Server-Sent Events are.
    pub events: String,
}

pub fn lease_view(h: &Held) -> LeaseView {
    let snap = h.snapshot();
    let now = tokio::time::Instant::now();
    LeaseView {
        lease_id: h.id.clone(),
        resource: h.resource.clone(),
        token: h.token.get(),
        owner: h.owner.clone(),
        client: h.client.clone(),
        granted_at: when(h.granted_at),
        ttl_ms: ms(h.ttl),
        valid_for_ms: ms(snap.valid_for),
        keepalive_within_ms: ms(h.app_deadline().saturating_duration_since(now)),
        streams: h.streams(),
        renewals: snap.renewals,
        ended: snap.ended.as_ref().map(|e| e.reason),
        events: format!("/v1/leases/{}/events", h.id),
    }
}

/// The longest wait an acquire may ask for.
const MAX_WAIT: Duration = Duration::from_secs(3600);

fn checked_name(who: &Principal, field: &str, name: &str) -> Result<(), ApiError> {
    fencelock::validate_name(name).map_err(|e| ApiError::field(field, e.to_string()))?;
    if who.may(name) {
        Ok(())
    } else {
        Err(ApiError::forbidden(name))
    }
}

/// The client name a request's leases are recorded with.
fn client_name(who: &Principal, asked: Option<String>) -> Result<String, ApiError> {
    match (who.client.as_str(), asked) {
        ("", Some(c)) => {
            fencelock::validate_name(&c).map_err(|_| {
                ApiError::field(
                    "client",
                    format!("client {c:?}: 1 to 256 bytes, no control characters"),
                )
            })?;
            Ok(c)
        }
        ("", None) => Ok("fencelock-serve".to_owned()),
        (mine, Some(c)) if c != mine => Err(ApiError::field(
            "client",
            format!("this token's client name is {mine:?}; leave the field out or send that"),
        )),
        (mine, _) => Ok(mine.to_owned()),
    }
}

/// Acquires a lock, waiting up to `wait_ms` while another owner holds it.
#[utoipa::path(post, path = "/v1/acquire", tag = TAG, request_body = AcquireRequest,
    responses(
        (status = 200, description = "Granted", body = LeaseView),
        (status = 400, description = "Bad input; `field` names it", body = ErrorBody),
        (status = 401, description = "No valid bearer token", body = ErrorBody),
        (status = 403, description = "Name outside the token's prefixes", body = ErrorBody),
        (status = 409, description = "`held` (wait 0) or `timed_out`, with the holder", body = ErrorBody),
        (status = 503, description = "Engine unavailable, deadline passed or shutting down", body = ErrorBody),
    ))]
pub async fn acquire(
    State(app): St,
    Extension(who): Who,
    JsonBody(req): JsonBody<AcquireRequest>,
) -> Result<Json<LeaseView>, ApiError> {
    checked_name(&who, "resource", &req.resource)?;
    let wait = Duration::from_millis(req.wait_ms);
    if wait > MAX_WAIT {
        return Err(ApiError::field(
            "wait_ms",
            "wait_ms: at most 3600000 (an hour)",
        ));
    }
    let ttl = Duration::from_millis(req.ttl_ms);
    if ttl < fencelock::MIN_TTL {
        return Err(ApiError::field("ttl_ms", "ttl_ms: at least 100"));
    }
    let client = client_name(&who, req.client)?;
    let opts = LockOptions::default()
        .ttl(ttl)
        .wait(wait)
        .fair(req.fair)
        .client_name(client.clone());
    let limit = wait + app.request_timeout;
    let lease = match tokio::time::timeout(limit, app.client.acquire(&req.resource, &opts)).await {
        Ok(Ok(lease)) => lease,
        Ok(Err(e)) => {
            // The library names what it refused in its message; point at the request field.
            let text = e.to_string();
            let field = if text.contains("TTL") {
                "ttl_ms"
            } else if text.contains("fair") {
                "fair"
            } else if text.contains("client name") {
                "client"
            } else {
                "resource"
            };
            return Err(ApiError::from_lib(&e, field));
        }
        // The library's acquire is cancel safe: dropping it leaves nothing held or queued.
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "deadline",
                format!(
                    "no answer from the engine within {}",
                    crate::human_duration(limit)
                ),
            ))
        }
    };
    let grant = Grant {
        client,
        principal: who.client.clone(),
        mode: Mode::App,
    };
    match app.registry.adopt(lease, grant).await {
        Some(held) => Ok(Json(lease_view(&held))),
        None => Err(shutting_down()),
    }
}

pub fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutting_down",
        "the sidecar is shutting down",
    )
}

/// The lease `id` if this principal took it, and may still use its name.
fn own_lease(app: &AppState, who: &Principal, id: &str) -> Result<Arc<Held>, ApiError> {
    let held = app
        .registry
        .get(id)
        .filter(|h| h.principal == who.client)
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "no lease {id:?} held by this sidecar for this client; it ended or never existed"
            ))
        })?;
    if who.may(&held.resource) {
        Ok(held)
    } else {
        Err(ApiError::forbidden(&held.resource))
    }
}

fn gone(h: &Held, snap: &Snapshot) -> ApiError {
    let e = snap.ended.as_ref();
    ApiError::new(
        StatusCode::GONE,
        "lost",
        format!(
            "the lease on {:?} with token {} has ended ({}): {}",
            h.resource,
            h.token,
            e.map_or("ended", |e| e.reason),
            e.map_or("", |e| e.message.as_str())
        ),
    )
}

/// The lease's state.
#[utoipa::path(get, path = "/v1/leases/{lease_id}", tag = TAG,
    params(("lease_id" = String, Path, description = "The lease id from acquire")),
    responses((status = 200, body = LeaseView), (status = 404, body = ErrorBody)))]
pub async fn lease(
    State(app): St,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Result<Json<LeaseView>, ApiError> {
    let held = own_lease(&app, &who, &id)?;
    Ok(Json(lease_view(&held)))
}

/// Shows the application is alive: the lease is kept one more TTL from now.
#[utoipa::path(post, path = "/v1/leases/{lease_id}/keepalive", tag = TAG,
    params(("lease_id" = String, Path, description = "The lease id from acquire")),
    responses((status = 200, body = LeaseView), (status = 404, body = ErrorBody), (status = 410, description = "The lease has ended", body = ErrorBody)))]
pub async fn keepalive(
    State(app): St,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Result<Json<LeaseView>, ApiError> {
    let held = own_lease(&app, &who, &id)?;
    let snap = held.snapshot();
    if snap.ended.is_some() {
        return Err(gone(&held, &snap));
    }
    held.keepalive();
    Ok(Json(lease_view(&held)))
}

/// Extends the lease by its TTL now (owner-checked); the watchdog also renews on its own.
#[utoipa::path(post, path = "/v1/leases/{lease_id}/extend", tag = TAG,
    params(("lease_id" = String, Path, description = "The lease id from acquire")),
    responses((status = 200, body = LeaseView), (status = 404, body = ErrorBody), (status = 410, body = ErrorBody)))]
pub async fn extend(
    State(app): St,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Result<Json<LeaseView>, ApiError> {
    let held = own_lease(&app, &who, &id)?;
    let (tx, rx) = oneshot::channel();
    if !held.send(Cmd::Extend(tx)).await {
        return Err(gone(&held, &held.snapshot()));
    }
    match rx.await {
        Ok(Ok(_)) => {
            held.keepalive();
            Ok(Json(lease_view(&held)))
        }
        Ok(Err(e)) => Err(ApiError::from_lib(&e, "lease_id")),
        Err(_) => Err(gone(&held, &held.snapshot())),
    }
}

/// Released.
#[derive(Debug, Serialize, ToSchema)]
pub struct Released {
    pub released: bool,
    pub resource: String,
    pub token: u64,
}

/// Releases the lease (owner-checked: only this lease's own grant is deleted) and wakes waiters.
#[utoipa::path(post, path = "/v1/leases/{lease_id}/release", tag = TAG,
    params(("lease_id" = String, Path, description = "The lease id from acquire")),
    responses((status = 200, body = Released), (status = 404, body = ErrorBody),
        (status = 409, description = "`not_holder`: the lease had expired or been taken", body = ErrorBody)))]
pub async fn release(
    State(app): St,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Result<Json<Released>, ApiError> {
    let held = own_lease(&app, &who, &id)?;
    let (tx, rx) = oneshot::channel();
    if !held.send(Cmd::Release(tx)).await {
        return Err(gone(&held, &held.snapshot()));
    }
    match rx.await {
        Ok(Ok(())) => Ok(Json(Released {
            released: true,
            resource: held.resource.clone(),
            token: held.token.get(),
        })),
        Ok(Err(e)) => Err(ApiError::from_lib(&e, "lease_id")),
        Err(_) => Err(gone(&held, &held.snapshot())),
    }
}

/// The lease's events, as Server-Sent Events: `granted` first, `renewed` after each
/// confirmed renewal, and `lost` with the reason, after which the stream closes. The stream
/// does not keep the lease alive: keep-alives do.
#[utoipa::path(get, path = "/v1/leases/{lease_id}/events", tag = TAG,
    params(("lease_id" = String, Path, description = "The lease id from acquire")),
    responses((status = 200, description = "text/event-stream: events `granted`, `renewed`, `lost` with JSON data", content_type = "text/event-stream", body = String),
        (status = 404, body = ErrorBody)))]
pub async fn events(
    State(app): St,
    Extension(who): Who,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let held = own_lease(&app, &who, &id)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(16);
    let guard = held.stream_opened();
    let mut state = held.subscribe();
    let h = held.clone();
    tokio::spawn(async move {
        let _guard = guard;
        let mut renewals = None;
        loop {
            let snap = state.borrow_and_update().clone();
            let event = match (&snap.ended, renewals) {
                (Some(end), _) => Some(json_event(
                    "lost",
                    serde_json::json!({
                        "lease_id": h.id, "resource": h.resource, "token": h.token.get(),
                        "reason": end.reason, "message": end.message,
                    }),
                )),
                (None, None) => Some(json_event(
                    "granted",
                    serde_json::json!({
                        "lease_id": h.id, "resource": h.resource, "token": h.token.get(),
                        "owner": h.owner, "ttl_ms": ms(h.ttl), "valid_for_ms": ms(snap.valid_for),
                    }),
                )),
                (None, Some(n)) if snap.renewals > n => Some(json_event(
                    "renewed",
                    serde_json::json!({
                        "lease_id": h.id, "token": h.token.get(), "renewals": snap.renewals,
                        "valid_for_ms": ms(snap.valid_for), "renewed_at": when(snap.renewed_at),
                    }),
                )),
                _ => None,
            };
            renewals = Some(snap.renewals);
            if let Some(event) = event {
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            if let Some(end) = &snap.ended {
                if super::leases::awaits_close(end.reason) {
                    await_close(&tx).await;
                }
                return;
            }
            tokio::select! {
                changed = state.changed() => if changed.is_err() { return },
                // The client went away: the stream guard drops with this task.
                _ = tx.closed() => return,
            }
        }
    });
    // Heartbeats find a connection whose application died (its kernel closed it) at the next
    // write, so that the stream count the runbook shows stays true.
    let beat = (held.ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    Ok(Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(beat))
        .into_response())
}

/// Holds a stream that reported a lease handed back until the application closes it (its
/// proof of having been told) or the keeper stops waiting. Comments are written meanwhile: a
/// connection its peer closed is noticed only when a write fails.
async fn await_close(tx: &tokio::sync::mpsc::Sender<Result<Event, Infallible>>) {
    let until = tokio::time::Instant::now() + super::leases::TOLD_WITHIN;
    let mut ping = tokio::time::interval(Duration::from_millis(50));
    while tokio::time::Instant::now() < until {
        tokio::select! {
            () = tx.closed() => return,
            _ = ping.tick() => {
                if tx.send(Ok(Event::default().comment(""))).await.is_err() {
                    return;
                }
            }
        }
    }
}

fn json_event(name: &str, data: serde_json::Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// A resource name in a query string.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct NameQuery {
    /// Resource name.
    pub name: String,
}

fn query<T>(q: Result<Query<T>, axum::extract::rejection::QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(t)| t)
        .map_err(|e| ApiError::field("query", e.body_text()))
}

fn lock_view(
    app: &AppState,
    resource: &str,
    backend: &str,
    holder: Option<&fencelock::Holder>,
) -> LockView {
    let sidecar = holder.and_then(|h| {
        app.registry
            .on_resource(resource)
            .into_iter()
            .find(|l| l.owner == h.owner)
            .map(|l| SidecarLeaseView {
                streams: l.streams(),
                renewals: l.snapshot().renewals,
                mode: match l.mode {
                    Mode::App => "app",
                    Mode::Dapr { .. } => "dapr",
                },
            })
    });
    LockView {
        resource: resource.to_owned(),
        backend: backend.to_owned(),
        engine: app
            .client
            .backends()
            .into_iter()
            .find(|(name, _)| *name == backend)
            .map_or_else(|| app.client.engine(), |(_, engine)| engine),
        held: holder.is_some(),
        holder: holder.map(|h| HolderView::of(resource, h)),
        sidecar,
    }
}

/// Who holds a lock: holder, token, TTL left, last renewal, healthy or suspect.
#[utoipa::path(get, path = "/v1/lock", tag = TAG, params(NameQuery),
    responses((status = 200, body = LockView), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn inspect(
    State(app): St,
    Extension(who): Who,
    q: Result<Query<NameQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<LockView>, ApiError> {
    let q = query(q)?;
    checked_name(&who, "name", &q.name)?;
    let holder = app
        .client
        .inspect(&q.name)
        .await
        .map_err(|e| ApiError::from_lib(&e, "name"))?;
    let backend = app
        .client
        .route_of(&q.name)
        .unwrap_or(fencelock::SINGLE_BACKEND);
    Ok(Json(lock_view(&app, &q.name, backend, holder.as_ref())))
}

/// A name prefix in a query string.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PrefixQuery {
    /// Only locks whose name starts with this (a plain string). Default: every name this
    /// client may see.
    #[serde(default)]
    #[param(required = false)]
    pub prefix: String,
}

/// The held locks this client may see, sorted by name, and the backends that failed to
/// answer: with a routing configuration, one backend's outage leaves the others' locks listed.
/// 503 only when no backend answered.
#[utoipa::path(get, path = "/v1/locks", tag = TAG, params(PrefixQuery),
    responses((status = 200, body = LockList), (status = 400, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn list(
    State(app): St,
    Extension(who): Who,
    q: Result<Query<PrefixQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<LockList>, ApiError> {
    let q = query(q)?;
    let listing = app
        .client
        .list_partial(&q.prefix, Some(gather_within(&app)))
        .await
        .map_err(|e| ApiError::from_lib(&e, "prefix"))?;
    let failed_backends = failed_backends(&app, &who, &listing)?;
    Ok(Json(LockList {
        locks: listing
            .found
            .iter()
            .filter(|l| who.may(&l.resource))
            .map(|l| lock_view(&app, &l.resource, &l.backend, Some(&l.holder)))
            .collect(),
        failed_backends,
    }))
}

/// How long a listing waits for the slower backends: long enough for a healthy one, and short
/// enough that the others' answer beats the request's deadline when one is blackholed.
fn gather_within(app: &AppState) -> Duration {
    app.request_timeout * 3 / 4
}

/// The backends of `listing` that failed and could hold a name `who` may see; the failure
/// itself (503) when no backend answered.
fn failed_backends<T>(
    app: &AppState,
    who: &Principal,
    listing: &fencelock::Partial<T>,
) -> Result<Vec<FailedBackend>, ApiError> {
    if listing.answered.is_empty() {
        if let Some(f) = listing.failed.first() {
            return Err(ApiError::from_lib(&f.error, "prefix"));
        }
    }
    let visible = |backend: &str| match (&who.prefixes, app.client.routes()) {
        (Some(prefixes), Some(routes)) => prefixes
            .iter()
            .any(|p| routes.backends_under(p).contains(&backend)),
        _ => true,
    };
    Ok(listing
        .failed
        .iter()
        .filter(|f| visible(&f.backend))
        .map(|f| FailedBackend {
            backend: f.backend.clone(),
            message: f.error.to_string(),
        })
        .collect())
}

/// An optional resource name in a query string.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct OptionalName {
    /// Only the records of this resource.
    #[param(value_type = String, required = false)]
    pub name: Option<String>,
}

/// The audit log of forced releases this client may see, newest first, and the backends that
/// failed to answer (as for `/v1/locks`).
#[utoipa::path(get, path = "/v1/audit", tag = TAG, params(OptionalName),
    responses((status = 200, body = AuditLog), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn audit(
    State(app): St,
    Extension(who): Who,
    q: Result<Query<OptionalName>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<AuditLog>, ApiError> {
    let q = query(q)?;
    if let Some(name) = &q.name {
        checked_name(&who, "name", name)?;
    }
    let listing = app
        .client
        .audit_partial(q.name.as_deref(), Some(gather_within(&app)))
        .await
        .map_err(|e| ApiError::from_lib(&e, "name"))?;
    let failed_backends = failed_backends(&app, &who, &listing)?;
    Ok(Json(AuditLog {
        records: listing
            .found
            .iter()
            .filter(|r| who.may(&r.resource))
            .map(AuditView::of)
            .collect(),
        failed_backends,
    }))
}

/// Force the release of a stuck lock.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForceReleaseRequest {
    pub resource: String,
    /// Why, for the audit log (required).
    pub reason: String,
    /// Release even if the holder looks alive: you have made sure it is dead.
    #[serde(default)]
    pub holder_is_dead: bool,
}

/// The outcome of a forced release.
#[derive(Debug, Serialize, ToSchema)]
pub struct ForceReleased {
    /// False when the lock was already free.
    pub released: bool,
    pub resource: String,
    /// The audit record written.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = AuditView, required = false)]
    pub record: Option<AuditView>,
    /// The other leases that ended with it (PostgreSQL advisory locks held in another
    /// process's session, which had to end), each with its own audit record.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schema(required = false)]
    pub ended_with: Vec<AuditView>,
}

/// Forces the release of a stuck lock, with the CLI's rules: refused (409 `holder_alive`)
/// while the holder looks alive unless `holder_is_dead`; recorded in the audit log; the
/// fencing counter advanced so the old holder's token is stale. A lease this sidecar held on
/// the lock reports `lost` (`force_released`) to its stream at once.
#[utoipa::path(post, path = "/v1/force-release", tag = TAG, request_body = ForceReleaseRequest,
    responses((status = 200, body = ForceReleased), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 409, description = "`holder_alive`: refused, the holder looks alive", body = ErrorBody)))]
pub async fn force_release(
    State(app): St,
    Extension(who): Who,
    JsonBody(req): JsonBody<ForceReleaseRequest>,
) -> Result<Json<ForceReleased>, ApiError> {
    checked_name(&who, "resource", &req.resource)?;
    if req.reason.trim().is_empty() {
        return Err(ApiError::field(
            "reason",
            "reason: say why, for the audit log",
        ));
    }
    let user = if who.client.is_empty() {
        "fencelock-serve (loopback)".to_owned()
    } else {
        who.client.clone()
    };
    let request = ForceRelease::new(&req.reason)
        .user(user)
        .holder_is_dead(req.holder_is_dead);
    // Until it is answered, a loss of this sidecar's lease on the name is the forced release's
    // doing: the engine may report it before the answer comes.
    let forcing = app.registry.forcing(&req.resource);
    let outcome = app.client.force_release(&req.resource, &request).await;
    match outcome {
        Ok(Some(record)) => {
            for r in std::iter::once(&record).chain(&record.ended_with) {
                for held in app.registry.on_resource(&r.resource) {
                    if held.owner == r.holder.owner {
                        let why = if r.resource == req.resource {
                            format!("force-released: {}", req.reason)
                        } else {
                            r.reason.clone()
                        };
                        held.send(Cmd::Forced(why)).await;
                    }
                }
            }
            drop(forcing);
            Ok(Json(ForceReleased {
                released: true,
                resource: req.resource,
                record: Some(AuditView::of(&record)),
                ended_with: record.ended_with.iter().map(AuditView::of).collect(),
            }))
        }
        Ok(None) => Ok(Json(ForceReleased {
            released: false,
            resource: req.resource,
            record: None,
            ended_with: Vec::new(),
        })),
        Err(e) if e.kind() == ErrorKind::HeldByAnother => {
            let mut err = ApiError::from_lib(&e, "resource");
            err.body.error = "holder_alive";
            Err(err)
        }
        Err(e) => Err(ApiError::from_lib(
            &e,
            if e.to_string().contains("reason") {
                "reason"
            } else {
                "resource"
            },
        )),
    }
}

/// Admit a fencing token for a resource.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FenceRequest {
    pub resource: String,
    /// The writer's fencing token.
    pub token: u64,
}

/// The fence's answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct FenceAnswer {
    /// True when the token is not lower than the highest seen; it is now the highest.
    pub accepted: bool,
    pub resource: String,
    /// The token presented.
    pub token: u64,
    /// The highest token seen for the resource (after this one, if accepted).
    pub highest: u64,
    /// The fence: `memory`, `redis` or `postgres`.
    pub fence: &'static str,
}

/// Admits a writer's fencing token for a resource that cannot host a fence itself: accepted
/// (200), or stale (409) with both tokens. Check before every write and skip the write when
/// stale: the writer lost its lease.
#[utoipa::path(post, path = "/v1/fence", tag = TAG, request_body = FenceRequest,
    responses((status = 200, body = FenceAnswer), (status = 409, description = "Stale", body = FenceAnswer),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn fence(
    State(app): St,
    Extension(who): Who,
    JsonBody(req): JsonBody<FenceRequest>,
) -> Result<Response, ApiError> {
    checked_name(&who, "resource", &req.resource)?;
    let token = FencingToken::new(req.token);
    let answer = |accepted, highest: u64| FenceAnswer {
        accepted,
        resource: req.resource.clone(),
        token: req.token,
        highest,
        fence: app.fence.kind(),
    };
    match app.fence.admit(&req.resource, token).await {
        Ok(Admitted::Accepted) => Ok(Json(answer(true, req.token)).into_response()),
        Ok(Admitted::Stale(highest)) => {
            Ok((StatusCode::CONFLICT, Json(answer(false, highest.get()))).into_response())
        }
        Err(message) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "engine",
            message,
        )),
    }
}

/// The server is up.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: &'static str,
    /// The engine (`sqlite`, `redis`, ...), or `routed` when names are routed among
    /// `backends` by prefix.
    pub engine: &'static str,
    /// The backends, by name (`default` for a sidecar on one URL), in name order.
    pub backends: Vec<BackendView>,
    /// Leases held for applications.
    pub leases: usize,
}

/// One backend of the sidecar.
#[derive(Debug, Serialize, ToSchema)]
pub struct BackendView {
    pub name: String,
    pub engine: &'static str,
}

/// Liveness: answers while the server runs (no engine call, no token needed).
#[utoipa::path(get, path = "/healthz", tag = TAG, responses((status = 200, body = Health)))]
pub async fn healthz(State(app): St) -> Json<Health> {
    let routed = app.client.routes().is_some();
    Json(Health {
        status: "ok",
        engine: if routed {
            "routed"
        } else {
            app.client.engine()
        },
        backends: app
            .client
            .backends()
            .into_iter()
            .map(|(name, engine)| BackendView {
                name: name.to_owned(),
                engine,
            })
            .collect(),
        leases: app.registry.all().len(),
    })
}

/// Metrics in Prometheus text format: the library's series and the sidecar's requests.
#[utoipa::path(get, path = "/metrics", tag = TAG,
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain", body = String)))]
pub async fn metrics_text(State(app): St) -> Response {
    app.metrics.run_upkeep();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        app.metrics.render(),
    )
        .into_response()
}
