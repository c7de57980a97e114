//! Dapr's distributed lock API (alpha), so that an application written against it works
//! unchanged: `POST /v1.0-alpha1/lock/{store}` and `POST /v1.0-alpha1/unlock/{store}`, with
//! Dapr's request and response bodies, plus the fencing token as an extra field.
//!
//! As in Dapr, the lock is one attempt (no waiting), identified by the application's own
//! `lockOwner`, held for `expiryInSeconds` without renewal. The store name is accepted
//! whatever it is; `resourceId` is the fencelock resource name, so the same lock can be taken
//! with the CLI or the native API. The engine's owner value is derived from the `lockOwner`
//! ([`Registry::dapr_owner`](super::leases::Registry::dapr_owner)), so that unlock works
//! after a restart of the sidecar, as it does with Dapr's stores.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Extension, FromRequest, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use fencelock::{ErrorKind, LockOptions};
use serde::de::{DeserializeOwned, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use utoipa::ToSchema;

use super::auth::Principal;
use super::http::{ApiError, JsonBody};
use super::leases::{Cmd, Grant, Mode};
use super::AppState;

pub const TAG: &str = "dapr";

/// Dapr's lock request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TryLockRequest {
    /// The resource to lock.
    pub resource_id: String,
    /// The owner's name; unique per request, and needed to unlock.
    pub lock_owner: String,
    /// How long the lock is held before it expires, in seconds: a number, or a string of
    /// digits (protojson writes 64-bit integers so, and reads any integer so).
    #[serde(deserialize_with = "protojson_int")]
    pub expiry_in_seconds: i64,
}

/// An integer as protojson reads one: a JSON number without a fraction, or a string of
/// decimal digits (with a leading `-` for a negative one).
fn protojson_int<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    struct Int;
    impl Visitor<'_> for Int {
        type Value = i64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a whole number of seconds, as a number or a string of digits")
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<i64, E> {
            Ok(v)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<i64, E> {
            i64::try_from(v).map_err(|_| E::custom(format!("{v} is too large")))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<i64, E> {
            let digits = v.strip_prefix('-').unwrap_or(v);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(E::custom(format!(
                    "{v:?} is not a whole number of seconds; send 60 or \"60\""
                )));
            }
            v.parse()
                .map_err(|_| E::custom(format!("{v:?} is too large")))
        }
    }
    d.deserialize_any(Int)
}

/// Dapr's lock response, plus the fencing token.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TryLockResponse {
    /// Whether the lock was acquired.
    pub success: bool,
    /// fencelock's addition: the grant's fencing token, when `success`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = u64, required = false)]
    pub fencing_token: Option<u64>,
}

/// Dapr's unlock request.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnlockRequest {
    pub resource_id: String,
    pub lock_owner: String,
}

/// Dapr's unlock response: `status` 0 success, 1 the lock does not exist, 2 the lock belongs
/// to another owner, 3 internal error.
#[derive(Debug, Serialize, ToSchema)]
pub struct UnlockResponse {
    pub status: u8,
}

/// Dapr's error body.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DaprError {
    pub error_code: &'static str,
    pub message: String,
}

fn dapr_error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response {
    (
        status,
        Json(DaprError {
            error_code: code,
            message: message.into(),
        }),
    )
        .into_response()
}

/// Whether `path` is one of Dapr's routes, whose errors take Dapr's shape.
pub fn is_dapr(path: &str) -> bool {
    path.starts_with("/v1.0-alpha1/")
}

/// A refusal of the sidecar's own (a body too large or not JSON, a foreign Host or Origin, no
/// token) in Dapr's shape, with the code Dapr gives the nearest case.
pub fn refusal_of(e: ApiError) -> Response {
    let code = match e.status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::MISDIRECTED_REQUEST => {
            "ERR_PERMISSION_DENIED"
        }
        _ => "ERR_MALFORMED_REQUEST",
    };
    dapr_error(e.status, code, e.body.message)
}

/// A JSON body whose refusals (not JSON, too large, trailing characters) have Dapr's shape.
pub struct DaprBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for DaprBody<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        JsonBody::from_request(req, state)
            .await
            .map(|JsonBody(t)| DaprBody(t))
            .map_err(refusal_of)
    }
}

fn malformed(message: impl Into<String>) -> Response {
    dapr_error(StatusCode::BAD_REQUEST, "ERR_MALFORMED_REQUEST", message)
}

/// The refusal of a request Dapr would refuse, or that this client may not make.
fn refusal(who: &Principal, resource: &str, owner: &str) -> Option<Response> {
    if let Err(e) = fencelock::validate_name(resource) {
        return Some(malformed(format!("resourceId: {e}")));
    }
    if owner.is_empty() {
        return Some(malformed("lockOwner is empty"));
    }
    if fencelock::validate_name(owner).is_err() {
        return Some(malformed(
            "lockOwner: 1 to 256 bytes, no control characters",
        ));
    }
    if !who.may(resource) {
        return Some(dapr_error(
            StatusCode::FORBIDDEN,
            "ERR_PERMISSION_DENIED",
            format!("this client may not lock {resource:?}"),
        ));
    }
    None
}

/// Dapr TryLock: one attempt to take `resourceId` for `lockOwner`, held `expiryInSeconds`.
#[utoipa::path(post, path = "/v1.0-alpha1/lock/{store}", tag = TAG, request_body = TryLockRequest,
    params(("store" = String, Path, description = "The lock store's name (any)")),
    responses((status = 200, body = TryLockResponse), (status = 400, body = DaprError), (status = 403, body = DaprError), (status = 500, body = DaprError)))]
pub async fn lock(
    State(app): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    Path(store): Path<String>,
    DaprBody(req): DaprBody<TryLockRequest>,
) -> Response {
    if let Some(r) = refusal(&who, &req.resource_id, &req.lock_owner) {
        return r;
    }
    let Some(secs) = u64::try_from(req.expiry_in_seconds).ok().filter(|s| *s > 0) else {
        return malformed("expiryInSeconds must be a positive number of seconds");
    };
    let refused = || {
        Json(TryLockResponse {
            success: false,
            fencing_token: None,
        })
        .into_response()
    };
    let owner = app
        .registry
        .dapr_owner(&who.client, &store, &req.resource_id, &req.lock_owner);
    // One owner name takes the lock once, as in Dapr: not twice at once, not again while this
    // process holds it, nor while a lock an earlier process of this sidecar took for it lasts
    // (the engine would grant it again to the same owner value).
    let Some(_claim) = app.registry.claim(&owner) else {
        return refused();
    };
    if app
        .registry
        .on_resource(&req.resource_id)
        .iter()
        .any(|h| h.owner == owner)
    {
        return refused();
    }
    match app.client.inspect(&req.resource_id).await {
        Ok(Some(h)) if h.owner == owner => return refused(),
        Ok(_) => {}
        Err(e) => {
            return dapr_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "ERR_TRY_LOCK",
                e.to_string(),
            )
        }
    }
    let client = if who.client.is_empty() {
        req.lock_owner.clone()
    } else {
        who.client.clone()
    };
    let opts = LockOptions::default()
        .ttl(Duration::from_secs(secs))
        .auto_renew(false)
        .owner(owner)
        .client_name(client.clone());
    match app.client.try_acquire(&req.resource_id, &opts).await {
        Ok(lease) => {
            let token = lease.token().get();
            let grant = Grant {
                client,
                principal: who.client.clone(),
                mode: Mode::Dapr {
                    lock_owner: req.lock_owner,
                },
            };
            match app.registry.adopt(lease, grant).await {
                Some(_) => Json(TryLockResponse {
                    success: true,
                    fencing_token: Some(token),
                })
                .into_response(),
                None => dapr_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "ERR_TRY_LOCK",
                    "the sidecar is shutting down",
                ),
            }
        }
        Err(e) if e.kind() == ErrorKind::HeldByAnother => Json(TryLockResponse {
            success: false,
            fencing_token: None,
        })
        .into_response(),
        Err(e) if e.kind() == ErrorKind::InvalidInput => malformed(e.to_string()),
        Err(e) => dapr_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "ERR_TRY_LOCK",
            e.to_string(),
        ),
    }
}

/// Dapr Unlock: releases `resourceId` if `lockOwner` holds it.
#[utoipa::path(post, path = "/v1.0-alpha1/unlock/{store}", tag = TAG, request_body = UnlockRequest,
    params(("store" = String, Path, description = "The lock store's name (any)")),
    responses((status = 200, body = UnlockResponse), (status = 400, body = DaprError), (status = 403, body = DaprError)))]
pub async fn unlock(
    State(app): State<Arc<AppState>>,
    Extension(who): Extension<Principal>,
    Path(store): Path<String>,
    DaprBody(req): DaprBody<UnlockRequest>,
) -> Response {
    if let Some(r) = refusal(&who, &req.resource_id, &req.lock_owner) {
        return r;
    }
    let status = |status| Json(UnlockResponse { status }).into_response();
    let owner = app
        .registry
        .dapr_owner(&who.client, &store, &req.resource_id, &req.lock_owner);
    if let Some(held) = app
        .registry
        .on_resource(&req.resource_id)
        .into_iter()
        .find(|h| h.owner == owner)
    {
        let (tx, rx) = oneshot::channel();
        if held.send(Cmd::Release(tx)).await {
            return match rx.await {
                Ok(Ok(())) => status(0),
                Ok(Err(e)) if e.kind() == ErrorKind::NotHolder => status(1),
                _ => status(3),
            };
        }
    }
    // Not held by this process: perhaps by an earlier process of this sidecar, under the
    // same derived owner value, which the release checks on the engine.
    match app.client.inspect(&req.resource_id).await {
        Ok(None) => status(1),
        Ok(Some(h)) if h.owner == owner => {
            match app.client.release_owner(&req.resource_id, &owner).await {
                Ok(true) => status(0),
                // Expired meanwhile (1), or it lives in the session of the process that took
                // it (etcd, ZooKeeper), which no other process can release (3).
                Ok(false) => match app.client.inspect(&req.resource_id).await {
                    Ok(Some(h)) if h.owner == owner => status(3),
                    Ok(_) => status(1),
                    Err(_) => status(3),
                },
                Err(_) => status(3),
            }
        }
        Ok(Some(_)) => status(2),
        Err(_) => status(3),
    }
}
