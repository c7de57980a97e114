//! The HTTP fence in front of an axum router: stale, missing and malformed tokens never reach
//! the handler.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::{Extension, Router};
use fencelock::fence::http::{
    apply_fencing_headers, AdmittedToken, FenceLayer, FENCING_RESOURCE, FENCING_TOKEN,
};
use fencelock::fence::MemoryFence;
use fencelock::FencingToken;
use tower::ServiceExt;

/// A router whose one handler counts its calls and echoes the token it was admitted with.
fn app(layer: FenceLayer) -> (Router, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let router = Router::new()
        .route(
            "/ledger",
            post(move |Extension(admitted): Extension<AdmittedToken>| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    format!("written with {} on {}", admitted.token, admitted.resource)
                }
            }),
        )
        .route_layer(layer);
    (router, calls)
}

fn request(headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::post("/ledger");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    req.body(Body::empty()).unwrap()
}

fn fenced(token: &str) -> Request<Body> {
    request(&[("Fencing-Resource", "ledger"), ("Fencing-Token", token)])
}

async fn send(app: &Router, req: Request<Body>) -> (StatusCode, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 64 * 1024)
        .await
        .unwrap();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test]
async fn a_stale_token_is_refused_before_the_handler_runs() {
    let (app, calls) = app(FenceLayer::new(Arc::new(MemoryFence::new())));

    let (status, body) = send(&app, fenced("7")).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, "written with 7 on ledger");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The same holder writes again with the token of its one grant.
    let (status, _) = send(&app, fenced("7")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    let (status, body) = send(&app, fenced("6")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains('6') && body.contains('7'), "{body}");
    assert!(body.contains("stale"), "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn missing_and_malformed_headers_are_refused_and_say_why() {
    let (app, calls) = app(FenceLayer::new(Arc::new(MemoryFence::new())));

    let (status, body) = send(&app, request(&[])).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body}");
    assert!(body.contains("Fencing-Token"), "{body}");

    let (status, body) = send(&app, request(&[("Fencing-Resource", "ledger")])).await;
    assert_eq!(status, StatusCode::PRECONDITION_REQUIRED, "{body}");

    let (status, body) = send(&app, fenced("abc")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("\"abc\""), "{body}");

    let (status, body) = send(&app, fenced("-1")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");

    let twice = request(&[
        ("Fencing-Resource", "ledger"),
        ("Fencing-Token", "7"),
        ("Fencing-Token", "6"),
    ]);
    let (status, body) = send(&app, twice).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("repeated"), "{body}");

    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_fixed_resource_makes_the_header_optional_but_binding() {
    let store = Arc::new(MemoryFence::new());
    let (app, calls) = app(FenceLayer::new(store.clone())
        .with_resource("ledger")
        .unwrap());

    let (status, body) = send(&app, request(&[("Fencing-Token", "3")])).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(store.highest("ledger"), Some(FencingToken::new(3)));

    let other = request(&[("Fencing-Resource", "payroll"), ("Fencing-Token", "9")]);
    let (status, body) = send(&app, other).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.contains("payroll"), "{body}");
    assert_eq!(store.highest("payroll"), None);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    assert!(FenceLayer::new(store).with_resource("").is_err());
}

#[tokio::test]
async fn the_client_helpers_headers_are_accepted() {
    let (app, calls) = app(FenceLayer::new(Arc::new(MemoryFence::new())));
    // A name that needs encoding: leading space, `%` and non-ASCII.
    let resource = " ledger 100% €";

    let mut req = request(&[]);
    apply_fencing_headers(req.headers_mut(), resource, FencingToken::new(12)).unwrap();
    assert!(req.headers().contains_key(FENCING_RESOURCE));
    assert_eq!(req.headers()[FENCING_TOKEN], "12");
    let (status, body) = send(&app, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, format!("written with 12 on {resource}"));

    let mut req = request(&[]);
    apply_fencing_headers(req.headers_mut(), resource, FencingToken::new(11)).unwrap();
    let (status, _) = send(&app, req).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let mut headers = axum::http::HeaderMap::new();
    assert!(apply_fencing_headers(&mut headers, "a\nb", FencingToken::new(1)).is_err());
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_redis_fence_refuses_a_stale_token_at_the_door() {
    use fencelock::fence::RedisFence;
    use fencelock_testkit::RedisServer;

    let mut server = RedisServer::start().unwrap();
    let store = RedisFence::connect(&server.url(), "fencelock:v1:")
        .await
        .unwrap();
    let (app, calls) = app(FenceLayer::new(Arc::new(store.clone())));

    assert_eq!(send(&app, fenced("7")).await.0, StatusCode::OK);
    assert_eq!(send(&app, fenced("7")).await.0, StatusCode::OK);
    let (status, body) = send(&app, fenced("6")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(body.contains('6') && body.contains('7'), "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        store.highest("ledger").await.unwrap(),
        Some(FencingToken::new(7))
    );

    // A fence that cannot check lets nothing through, and says a retry may help.
    server.kill();
    let (status, body) = send(&app, fenced("8")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
