//! The lifecycle API over HTTP: routes (under `/v1` and at the root, as the reference server
//! mounts them), middleware, and the OpenAPI document generated from the handlers.

mod egress;
mod extract;
pub mod middleware;
mod misc;
mod nodes;
mod proxy;
mod sandboxes;
mod snapshots;
mod templates;

use std::sync::Arc;

use axum::Router;
use axum::http::Method;
use axum::routing::{any, get, post};

use crate::error::ApiError;
use crate::service::Lifecycle;

/// What every handler sees.
#[derive(Clone)]
pub struct AppState {
    pub lifecycle: Arc<Lifecycle>,
    pub api_key: Arc<str>,
}

/// The routes of one mount point.
fn routes() -> Router<AppState> {
    Router::new()
        .route("/health", get(misc::health))
        .route("/version", get(misc::version))
        .route("/openapi.json", get(misc::openapi))
        .route("/sandboxes", post(sandboxes::create).get(sandboxes::list))
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route(
            "/sandboxes/{id}/metadata",
            axum::routing::patch(sandboxes::patch_metadata),
        )
        .route("/sandboxes/{id}/renew-expiration", post(sandboxes::renew))
        .route("/sandboxes/{id}/endpoints/{port}", get(sandboxes::endpoint))
        .route(
            "/sandboxes/{id}/diagnostics/logs",
            get(sandboxes::diagnostics_logs),
        )
        .route(
            "/sandboxes/{id}/diagnostics/events",
            get(sandboxes::diagnostics_events),
        )
        .route("/sandboxes/{id}/pause", post(snapshots::pause))
        .route("/sandboxes/{id}/resume", post(snapshots::resume))
        .route("/sandboxes/{id}/fork", post(snapshots::fork))
        .route("/sandboxes/{id}/snapshots", post(snapshots::create))
        .route(
            "/sandboxes/{id}/networkpolicy",
            get(egress::get)
                .put(egress::replace)
                .patch(egress::patch)
                .delete(egress::delete),
        )
        .route("/snapshots", get(snapshots::list))
        .route(
            "/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/templates", post(templates::create).get(templates::list))
        .route(
            "/templates/{id}",
            get(templates::get).delete(templates::delete),
        )
        .route("/nodes", get(nodes::list))
        .route("/nodes/{id}", axum::routing::delete(nodes::revoke))
        .route("/metrics/events", post(misc::metrics_event))
        .route("/metrics", get(misc::metrics))
        .route("/sandboxes/{id}/proxy/{port}", any(proxy::server_proxy))
        .route("/sandboxes/{id}/proxy/{port}/", any(proxy::server_proxy))
        .route(
            "/sandboxes/{id}/proxy/{port}/{*rest}",
            any(proxy::server_proxy_rest),
        )
}

/// The whole lifecycle API.
pub fn router(state: AppState) -> Router {
    Router::new()
        .nest("/v1", routes())
        .merge(routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::stale,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::auth,
        ))
        .layer(axum::middleware::from_fn(middleware::request_id))
        .with_state(state)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::MethodNotAllowed(method.to_string())
}

pub use misc::ApiDoc;
