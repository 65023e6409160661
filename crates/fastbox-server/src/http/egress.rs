//! `/sandboxes/{id}/networkpolicy`: the egress policy of a sandbox through the lifecycle API
//! (the same operations as `GET/PATCH/DELETE /policy` on port 18080, plus `PUT`).

use axum::Json;
use axum::extract::State;
use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::{ErrorResponse, NetworkPolicy, NetworkRule};
use fastbox_node_api::control::PolicyChange;

use crate::error::ApiError;

use super::AppState;
use super::extract::{ApiJson, ApiPath};

#[utoipa::path(get, path = "/sandboxes/{id}/networkpolicy", responses(
    (status = 200, body = PolicyStatusResponse), (status = 404, body = ErrorResponse)))]
pub async fn get(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<PolicyStatusResponse>, ApiError> {
    Ok(Json(state.lifecycle.network_policy(&id)?))
}

/// Replaces the whole policy.
#[utoipa::path(put, path = "/sandboxes/{id}/networkpolicy", request_body = NetworkPolicy,
    responses((status = 200, body = PolicyStatusResponse), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn replace(
    state: State<AppState>,
    id: ApiPath<String>,
    ApiJson(policy): ApiJson<NetworkPolicy>,
) -> Result<Json<PolicyStatusResponse>, ApiError> {
    change(state, id, PolicyChange::Replace(policy)).await
}

/// Merges rules in front of the current ones (the first rule of a target wins).
#[utoipa::path(patch, path = "/sandboxes/{id}/networkpolicy", request_body = Vec<NetworkRule>,
    responses((status = 200, body = PolicyStatusResponse), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn patch(
    state: State<AppState>,
    id: ApiPath<String>,
    ApiJson(rules): ApiJson<Vec<NetworkRule>>,
) -> Result<Json<PolicyStatusResponse>, ApiError> {
    change(state, id, PolicyChange::Patch(rules)).await
}

/// Removes the rules of the given targets (unknown targets are ignored).
#[utoipa::path(delete, path = "/sandboxes/{id}/networkpolicy", request_body = Vec<String>,
    responses((status = 200, body = PolicyStatusResponse), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn delete(
    state: State<AppState>,
    id: ApiPath<String>,
    ApiJson(targets): ApiJson<Vec<String>>,
) -> Result<Json<PolicyStatusResponse>, ApiError> {
    change(state, id, PolicyChange::Delete(targets)).await
}

async fn change(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    change: PolicyChange,
) -> Result<Json<PolicyStatusResponse>, ApiError> {
    Ok(Json(
        state.lifecycle.change_network_policy(id, change).await?,
    ))
}
