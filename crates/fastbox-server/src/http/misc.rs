//! Health, version, the OpenAPI document, the metrics sink, and the routes this server does
//! not offer yet.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use fastbox_api::lifecycle as wire;
use utoipa::OpenApi;

use crate::service::Health;

use super::AppState;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "fastbox lifecycle API",
        description = "OpenSandbox-compatible sandbox lifecycle API"
    ),
    paths(
        health,
        version,
        metrics_event,
        super::sandboxes::create,
        super::sandboxes::list,
        super::sandboxes::get,
        super::sandboxes::delete,
        super::sandboxes::patch_metadata,
        super::sandboxes::renew,
        super::sandboxes::endpoint,
        super::sandboxes::diagnostics_logs,
        super::sandboxes::diagnostics_events,
        super::templates::create,
        super::templates::list,
        super::templates::get,
        super::templates::delete,
        super::egress::get,
        super::egress::replace,
        super::egress::patch,
        super::egress::delete,
        super::snapshots::create,
        super::snapshots::list,
        super::snapshots::get,
        super::snapshots::delete,
        super::snapshots::pause,
        super::snapshots::resume,
        super::snapshots::fork,
        super::nodes::list,
        super::nodes::revoke,
    ),
    components(schemas(
        super::nodes::NodeInfo,
        super::nodes::ListNodesResponse,
        wire::CreateSandboxRequest,
        wire::CreateSandboxResponse,
        wire::Sandbox,
        wire::SandboxStatus,
        wire::SandboxState,
        wire::ListSandboxesResponse,
        wire::PaginationInfo,
        wire::Endpoint,
        wire::RenewSandboxExpirationRequest,
        wire::RenewSandboxExpirationResponse,
        wire::ErrorResponse,
        wire::DiagnosticContentResponse,
        wire::HealthResponse,
        wire::VersionResponse,
        wire::NetworkPolicy,
        wire::NetworkRule,
        fastbox_api::egress::PolicyStatusResponse,
        fastbox_api::snapshots::Snapshot,
        fastbox_api::snapshots::SnapshotStatus,
        fastbox_api::snapshots::SnapshotState,
        fastbox_api::snapshots::CreateSnapshotRequest,
        fastbox_api::snapshots::ListSnapshotsResponse,
        fastbox_api::snapshots::ForkRequest,
        fastbox_api::snapshots::ForkResponse,
    ))
)]
pub struct ApiDoc;

/// Ready once the default images are prepared and sandboxes are recovered.
#[utoipa::path(get, path = "/health", responses(
    (status = 200, body = wire::HealthResponse), (status = 503, body = wire::HealthResponse)))]
pub async fn health(State(state): State<AppState>) -> impl IntoResponse {
    match state.lifecycle.health() {
        Health::Ready => (
            StatusCode::OK,
            Json(wire::HealthResponse {
                status: "healthy".into(),
                message: None,
            }),
        ),
        Health::Starting(message) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(wire::HealthResponse {
                status: "starting".into(),
                message: Some(message),
            }),
        ),
    }
}

#[utoipa::path(get, path = "/version", responses((status = 200, body = wire::VersionResponse)))]
pub async fn version() -> Json<wire::VersionResponse> {
    Json(wire::VersionResponse {
        version: env!("CARGO_PKG_VERSION").to_string(),
    })
}

pub async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    let mut doc = ApiDoc::openapi();
    // Every route is served under /v1 as well as at the root.
    let paths = std::mem::take(&mut doc.paths.paths);
    for (path, item) in paths {
        doc.paths.paths.insert(format!("/v1{path}"), item);
    }
    Json(doc)
}

/// The SDK's fire-and-forget create metrics: accepted and logged.
#[utoipa::path(post, path = "/metrics/events", responses((status = 204)))]
pub async fn metrics_event(body: axum::body::Bytes) -> StatusCode {
    if let Ok(event) = serde_json::from_slice::<serde_json::Value>(&body) {
        tracing::debug!(%event, "client metrics event");
    }
    StatusCode::NO_CONTENT
}

/// Start phases as Prometheus histograms (`fastbox_start_phase_seconds`).
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.lifecycle.metrics_text(),
    )
}
