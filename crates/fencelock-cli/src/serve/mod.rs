//! `fencelock serve`: a lock sidecar for applications in any language, over HTTP.
//!
//! One [`Client`] serves every application. A lease lives only while its application shows
//! it is alive (see `leases`); the JSON API, Dapr's lock API and the dashboard share one
//! router, one auth check and one set of metrics. The OpenAPI document is built from the
//! handlers' own annotations by `utoipa-axum`'s router, so a route cannot be served without
//! being documented.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::response::IntoResponse;
use clap::Args;
use fencelock::Client;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::signal::unix::{signal, SignalKind};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::{exit, BackendArg, Exit};

mod api;
mod auth;
mod browser;
mod dapr;
mod dashboard;
mod fence;
mod http;
mod leases;
mod openapi;
mod views;

#[derive(Args, Debug)]
#[command(
    after_help = "Without --auth-file the server listens on loopback addresses only. \
    See docs/sidecar.md for the API, the auth file and the dashboard."
)]
pub struct ServeArgs {
    #[command(flatten)]
    backend: BackendArg,
    /// Address to listen on (IP:PORT; port 0 takes a free port, printed on stderr).
    #[arg(long, default_value = "127.0.0.1:7878")]
    listen: String,
    /// Bearer tokens and the name prefixes each may use (format in docs/sidecar.md). Re-read
    /// on SIGHUP. Required to listen on an address other than loopback.
    #[arg(long, value_name = "FILE")]
    auth_file: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Where the fence endpoint keeps the highest token per resource: memory (lost on
    /// restart; for tests and demos), redis://host:port or postgres://user@host/db.
    #[arg(long, default_value = "memory", value_name = "memory|URL")]
    fence: String,
    /// Deadline of every request (acquire: its wait plus this); at least 100ms.
    #[arg(long, default_value = "10s", value_parser = crate::parse_duration)]
    request_timeout: Duration,
    /// Another URL the sidecar is reached by (a DNS name, a proxy in front of it), such as
    /// https://locks.example.com; repeatable. Requests naming another host, or sent by pages
    /// of another origin, are refused (docs/sidecar.md, "Browsers").
    #[arg(long, value_name = "URL")]
    public_url: Vec<String>,
}

/// The shortest `--request-timeout`: a deadline shorter than an engine round trip only turns
/// every request into a 503.
const MIN_REQUEST_TIMEOUT: Duration = Duration::from_millis(100);

/// What every handler shares.
pub struct AppState {
    pub client: Client,
    pub registry: Arc<leases::Registry>,
    pub auth: Option<auth::AuthFile>,
    pub fence: fence::Fence,
    pub metrics: PrometheusHandle,
    pub request_timeout: Duration,
}

/// The OpenAPI document's frame; the paths come from the router.
#[derive(OpenApi)]
#[openapi(
    info(title = "fencelock serve", description = "Distributed locks with fencing tokens, over HTTP: \
        blocking acquire, leases kept alive by an event stream or keep-alives, the stuck-lock \
        runbook, a fence, and Dapr's lock API."),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The API routes and their OpenAPI document, from one list.
fn api_router() -> OpenApiRouter<Arc<AppState>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(api::acquire))
        .routes(routes!(api::lease))
        .routes(routes!(api::keepalive))
        .routes(routes!(api::extend))
        .routes(routes!(api::release))
        .routes(routes!(api::events))
        .routes(routes!(api::inspect))
        .routes(routes!(api::list))
        .routes(routes!(api::audit))
        .routes(routes!(api::force_release))
        .routes(routes!(api::fence))
        .routes(routes!(api::metrics_text))
        .routes(routes!(dapr::lock))
        .routes(routes!(dapr::unlock))
}

/// The whole application: the authenticated API, and the public pages (health, the OpenAPI
/// document, the dashboard's page, which holds no data and asks for a token itself), all
/// behind the checks that keep other sites' pages out (`browser`).
fn app(state: Arc<AppState>, served: Arc<browser::Served>) -> axum::Router {
    let (api, mut doc) = api_router().split_for_parts();
    openapi::authenticated(&mut doc);
    let (public, public_doc) = OpenApiRouter::new()
        .routes(routes!(api::healthz))
        .routes(routes!(dashboard::page))
        .routes(routes!(openapi_json))
        .split_for_parts();
    doc.merge(public_doc);
    openapi::refusals(&mut doc);
    let doc = Arc::new(
        doc.to_json()
            .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}")),
    );
    let api = api.route_layer(middleware::from_fn_with_state(
        state.clone(),
        http::authenticate,
    ));
    api.merge(public)
        .layer(middleware::from_fn_with_state(served, browser::guard))
        .layer(axum::Extension(OpenApiText(doc)))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            http::deadline_and_metrics,
        ))
        .layer(DefaultBodyLimit::max(http::MAX_BODY))
        .fallback(|| async {
            http::ApiError::not_found("no such route; the API is described at /openapi.json")
        })
        .with_state(state)
}

#[derive(Clone)]
struct OpenApiText(Arc<String>);

/// This API's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", tag = api::TAG,
    responses((status = 200, description = "The OpenAPI document", content_type = "application/json", body = Object)))]
async fn openapi_json(
    axum::Extension(OpenApiText(doc)): axum::Extension<OpenApiText>,
) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        doc.as_str().to_owned(),
    )
}

fn usage(message: String) -> anyhow::Error {
    eprintln!("fencelock: {message}");
    Exit(exit::USAGE).into()
}

/// Installs the Prometheus recorder with the buckets `fencelock run --metrics-addr` uses.
fn recorder() -> Result<PrometheusHandle, String> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(fencelock::metrics::ACQUIRE_DURATION.into()),
            fencelock::metrics::ACQUIRE_DURATION_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(fencelock::metrics::HOLD_DURATION.into()),
                fencelock::metrics::HOLD_DURATION_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(http::REQUEST_DURATION.into()),
                http::REQUEST_BUCKETS,
            )
        })
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| e.to_string())?;
    fencelock::metrics::describe();
    http::describe();
    Ok(handle)
}

pub async fn serve(args: ServeArgs) -> Result<u8> {
    let addr: SocketAddr = args.listen.parse().map_err(|_| {
        usage(format!(
            "--listen {:?}: write IP:PORT, such as 127.0.0.1:7878",
            args.listen
        ))
    })?;
    if args.request_timeout < MIN_REQUEST_TIMEOUT {
        return Err(usage(format!(
            "--request-timeout {}: give at least 100ms; a shorter deadline answers every \
             request 503",
            crate::human_duration(args.request_timeout)
        )));
    }
    let public = args
        .public_url
        .iter()
        .map(|u| browser::PublicUrl::parse(u))
        .collect::<Result<Vec<_>, _>>()
        .map_err(usage)?;
    let auth = match &args.auth_file {
        Some(path) => Some(auth::AuthFile::load(path).map_err(usage)?),
        None if !addr.ip().is_loopback() => {
            return Err(usage(format!(
                "refusing to listen on {addr} without --auth-file: anyone who can reach it could \
                 take and release locks; listen on 127.0.0.1, or give an auth file"
            )))
        }
        None => None,
    };
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(http::tls::config(cert, key).map_err(usage)?),
        _ => None,
    };
    let metrics = recorder().map_err(|e| usage(format!("cannot set up metrics: {e}")))?;
    let client = crate::connect(&args.backend, "fencelock-serve").await?;
    let fence = fence::Fence::open(&args.fence, &args.backend.prefix, args.request_timeout)
        .await
        .map_err(|(kind, e)| {
            eprintln!("fencelock: {e}");
            let code = if kind == fencelock::ErrorKind::InvalidInput {
                exit::USAGE
            } else {
                exit::UNAVAILABLE
            };
            anyhow::Error::from(Exit(code))
        })?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| usage(format!("cannot listen on {addr} (--listen): {e}")))?;
    let local = listener.local_addr().map_err(|e| usage(e.to_string()))?;
    let state = Arc::new(AppState {
        client: client.clone(),
        registry: Arc::new(leases::Registry::new(identity(local))),
        auth,
        fence,
        metrics,
        request_timeout: args.request_timeout,
    });
    let served = Arc::new(browser::Served::new(local, tls.is_some(), &public));
    let scheme = if tls.is_some() { "https" } else { "http" };
    eprintln!(
        "fencelock: serving {} locks on {scheme}://{local}/ (dashboard at /, API at /openapi.json)",
        client.engine()
    );

    let (stopping, stopped) = tokio::sync::watch::channel(0u8);
    tokio::spawn(signals(state.clone(), stopping));
    let router = app(state.clone(), served);
    let mut on_signal = stopped.clone();
    let stop = async move {
        let _ = on_signal.wait_for(|n| *n > 0).await;
    };
    let served = async {
        match tls {
            Some(config) => {
                let listener = http::tls::TlsListener::new(listener, config)
                    .map_err(|e| usage(e.to_string()))?;
                axum::serve(listener, router)
                    .with_graceful_shutdown(stop)
                    .await
                    .map_err(fail_io)
            }
            None => axum::serve(listener, router)
                .with_graceful_shutdown(stop)
                .await
                .map_err(fail_io),
        }
    };
    // The server stops accepting at the signal; the leases are handed back meanwhile (see
    // `leases`), which ends their streams; connections still open after that (a long acquire
    // wait) are not waited for beyond a bound.
    let registry = state.registry.clone();
    let mut after_signal = stopped.clone();
    let bound = async move {
        let _ = after_signal.wait_for(|n| *n > 0).await;
        state.registry.shut_down(SHUTDOWN_LIMIT).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    tokio::pin!(served);
    let outcome = tokio::select! {
        out = &mut served => out,
        () = bound => Ok(()),
    };
    // Whichever finished first, every lease is handed back before the process exits.
    let done = registry.shut_down(SHUTDOWN_LIMIT).await;
    if let Some(until) = done.hold_until.filter(|u| *u > tokio::time::Instant::now()) {
        // Their locks live in this process's sessions: exiting now would free them before
        // their applications' validity ends.
        eprintln!(
            "fencelock: keeping the process up {} until the leases left to expire have; \
             a second SIGTERM or SIGINT exits now, which frees them on the engine at once",
            crate::human_duration(until.saturating_duration_since(tokio::time::Instant::now()))
        );
        let mut again = stopped;
        tokio::select! {
            () = tokio::time::sleep_until(until) => {}
            _ = again.wait_for(|n| *n > 1) => {}
        }
    }
    client.close().await;
    outcome?;
    eprintln!(
        "fencelock: stopped; {} leases released after their applications were told, {} left \
         held on the engine until their validity ends",
        done.released, done.left
    );
    Ok(0)
}

/// What tells this sidecar from others for the owner values of Dapr locks: its host and the
/// address it listens on, which a restart on the same `--listen` address keeps.
fn identity(local: SocketAddr) -> String {
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{host} {local}")
}

/// How long a shutdown waits for the leases to be handed back.
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

fn fail_io(e: std::io::Error) -> anyhow::Error {
    eprintln!("fencelock: the server failed: {e}");
    Exit(exit::UNAVAILABLE).into()
}

/// Counts SIGTERM and SIGINT in `stopping` (the first stops the server, a second ends the wait
/// for leases left to expire); re-reads the auth file on SIGHUP.
async fn signals(state: Arc<AppState>, stopping: tokio::sync::watch::Sender<u8>) {
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        eprintln!(
            "fencelock: cannot install the signal handlers; SIGTERM will not hand the leases back"
        );
        return;
    };
    loop {
        let stop = tokio::select! {
            _ = term.recv() => true,
            _ = int.recv() => true,
            _ = hup.recv() => {
                if let Some(auth) = &state.auth {
                    match auth.reload() {
                        Ok(n) => {
                            let revoked = state.registry.revoke(|h| {
                                (!auth.allows(&h.principal, &h.resource)).then(|| format!(
                                    "the auth file no longer lets client {:?} use {:?}",
                                    h.principal, h.resource
                                ))
                            }).await;
                            eprintln!(
                                "fencelock: re-read {} ({n} clients; {revoked} leases revoked)",
                                auth.path().display()
                            );
                        }
                        Err(e) => eprintln!("fencelock: {e}; keeping the previous auth file"),
                    }
                }
                false
            }
        };
        if !stop {
            continue;
        }
        if *stopping.borrow() == 0 {
            eprintln!(
                "fencelock: stopping: telling the applications of {} leases; a lease is \
                 released once its application has closed its event stream after the notice, \
                 and left to expire otherwise",
                state.registry.all().len()
            );
        }
        stopping.send_modify(|n| *n = n.saturating_add(1));
    }
}
