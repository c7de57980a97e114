//! What the OpenAPI document says of every route alike, added to the handlers' own annotations
//! from the router's structure, so that it cannot drift from what the middleware does: the
//! bearer token (on the authenticated routes only, never on the public pages), and the
//! refusals of the middleware (401, 403, 413, 415, 421, 503).

use utoipa::openapi::path::Operation;
use utoipa::openapi::security::SecurityRequirement;
use utoipa::openapi::{Content, OpenApi, Ref, RefOr, Response, ResponseBuilder};

use super::dapr::is_dapr;

/// Every operation of `doc`, with its path and whether its method may carry a body.
fn operations(doc: &mut OpenApi) -> Vec<(String, bool, &mut Operation)> {
    let mut out = Vec::new();
    for (path, item) in doc.paths.paths.iter_mut() {
        let item = &mut *item;
        let ops = [
            (false, item.get.as_mut()),
            (true, item.post.as_mut()),
            (true, item.put.as_mut()),
            (true, item.patch.as_mut()),
            (true, item.delete.as_mut()),
        ];
        for (body, op) in ops {
            if let Some(op) = op {
                out.push((path.clone(), body, op));
            }
        }
    }
    out
}

/// An error answer of the route's shape: `ErrorBody`, or Dapr's `DaprError` on its routes.
fn error(path: &str, description: &str) -> RefOr<Response> {
    let schema = if is_dapr(path) {
        "DaprError"
    } else {
        "ErrorBody"
    };
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                Content::new(Some(Ref::from_schema_name(schema))),
            )
            .build(),
    )
}

/// Adds `code` to `op` if the handler did not document it; if it did, appends `more` to its
/// description (the same status for another reason).
fn add(path: &str, op: &mut Operation, code: &str, description: &str, more: Option<&str>) {
    match op.responses.responses.get_mut(code) {
        None => {
            op.responses
                .responses
                .insert(code.to_owned(), error(path, description));
        }
        Some(RefOr::T(r)) => {
            if let Some(more) = more {
                r.description = format!("{}; {more}", r.description.trim_end_matches('.'));
            }
        }
        Some(RefOr::Ref(_)) => {}
    }
}

/// The routes behind the bearer token: they need it, and answer 401 without a valid one (with
/// an auth file), 503 when the deadline passes or the engine fails (not the event stream,
/// which has no deadline).
pub fn authenticated(doc: &mut OpenApi) {
    for (path, _, op) in operations(doc) {
        op.security = Some(vec![SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
        add(
            &path,
            op,
            "401",
            "`unauthorized`: no valid bearer token (when the sidecar has an auth file)",
            None,
        );
        if !path.ends_with("/events") {
            add(
                &path,
                op,
                "503",
                "`engine`, `deadline` (--request-timeout) or `shutting_down`",
                None,
            );
        }
    }
}

/// What the checks of `browser` refuse on every route, and the body limit on routes with a
/// body.
pub fn refusals(doc: &mut OpenApi) {
    for (path, with_body, op) in operations(doc) {
        add(
            &path,
            op,
            "421",
            "`misdirected`: a `Host` this sidecar is not served as (its listen address, or a \
             --public-url)",
            None,
        );
        add(
            &path,
            op,
            "403",
            "`cross_origin`: an `Origin` other than the sidecar's own",
            Some("or `cross_origin`: an `Origin` other than the sidecar's own"),
        );
        add(&path, op, "400", "`invalid_input`: no `Host` header", None);
        if with_body {
            add(
                &path,
                op,
                "415",
                "`content_type`: a body or a `Content-Type` other than `application/json`",
                None,
            );
        }
        if op.request_body.is_some() {
            add(&path, op, "413", "`too_large`: a body over 64 KiB", None);
        }
    }
}
