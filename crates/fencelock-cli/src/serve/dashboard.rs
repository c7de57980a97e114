//! The dashboard: one page of plain HTML, CSS and JavaScript, embedded in the binary (no
//! build step, no library). It reads the same JSON API as any client, with the same bearer
//! token, which it asks for when the server answers 401 and keeps for the browser tab only.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("dashboard.html");

/// The dashboard page (it holds no data; what it shows comes from the API).
#[utoipa::path(get, path = "/", tag = super::api::TAG,
    responses((status = 200, description = "The dashboard", content_type = "text/html", body = String)))]
pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // The page runs only its own script and talks only to this server.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'",
            ),
        ],
        PAGE,
    )
}
