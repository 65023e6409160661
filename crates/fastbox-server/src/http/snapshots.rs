//! Snapshots, pause/resume and fork handlers: each records its intent and answers 202 (the
//! node's part runs in the background); snapshot reads and deletes.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use fastbox_api::lifecycle::ErrorResponse;
use fastbox_api::snapshots::{
    CreateSnapshotRequest, ForkRequest, ForkResponse, ListSnapshotsResponse, Snapshot,
    SnapshotState,
};

use crate::error::ApiError;
use crate::service::SnapshotQuery;

use super::AppState;
use super::extract::{ApiJson, ApiPath, QueryPairs};
use super::sandboxes::{page_of, state_filter};

#[utoipa::path(post, path = "/sandboxes/{id}/snapshots", request_body = Option<CreateSnapshotRequest>,
    responses((status = 202, body = Snapshot), (status = 404, body = ErrorResponse),
    (status = 409, body = ErrorResponse)))]
pub async fn create(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    body: Bytes,
) -> Result<impl IntoResponse, ApiError> {
    // The body is optional.
    let req: CreateSnapshotRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CreateSnapshotRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::InvalidParameter(format!("invalid JSON body: {e}")))?
    };
    state
        .lifecycle
        .refuse_live_sessions(&id, "snapshotted")
        .await?;
    let snapshot = state.lifecycle.create_snapshot(&id, req.name)?;
    let location = format!("/v1/snapshots/{}", snapshot.id);
    Ok((
        StatusCode::ACCEPTED,
        [(header::LOCATION, location)],
        Json(snapshot),
    ))
}

#[utoipa::path(get, path = "/snapshots", params(
    ("sandboxId" = Option<String>, Query), ("name" = Option<String>, Query),
    ("state" = Option<Vec<String>>, Query, description = "repeatable state filter; an unknown state matches nothing"),
    ("page" = Option<u32>, Query), ("pageSize" = Option<u32>, Query)),
    responses((status = 200, body = ListSnapshotsResponse), (status = 400, body = ErrorResponse)))]
pub async fn list(
    State(state): State<AppState>,
    query: QueryPairs,
) -> Result<Json<ListSnapshotsResponse>, ApiError> {
    let states = state_filter(&query, SnapshotState::parse);
    let (page, page_size) = page_of(&query)?;
    let nonempty = |k: &str| query.get(k).filter(|v| !v.is_empty()).map(str::to_string);
    Ok(Json(state.lifecycle.list_snapshots(&SnapshotQuery {
        sandbox_id: nonempty("sandboxId"),
        name: nonempty("name"),
        states,
        page,
        page_size,
    })))
}

#[utoipa::path(get, path = "/snapshots/{id}", responses(
    (status = 200, body = Snapshot), (status = 404, body = ErrorResponse)))]
pub async fn get(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Snapshot>, ApiError> {
    Ok(Json(state.lifecycle.get_snapshot(&id)?))
}

#[utoipa::path(delete, path = "/snapshots/{id}", responses(
    (status = 204), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn delete(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/sandboxes/{id}/pause", responses(
    (status = 202), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn pause(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.refuse_live_sessions(&id, "paused").await?;
    state.lifecycle.pause(&id)?;
    Ok(StatusCode::ACCEPTED)
}

#[utoipa::path(post, path = "/sandboxes/{id}/resume", responses(
    (status = 202), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn resume(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.resume(&id)?;
    Ok(StatusCode::ACCEPTED)
}

#[utoipa::path(post, path = "/sandboxes/{id}/fork", request_body = ForkRequest, responses(
    (status = 202, body = ForkResponse), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse),
    (status = 429, body = ErrorResponse)))]
pub async fn fork(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<impl IntoResponse, ApiError> {
    state.lifecycle.refuse_live_sessions(&id, "forked").await?;
    let forked = state.lifecycle.fork(&id, req).await?;
    Ok((StatusCode::ACCEPTED, Json(forked)))
}
