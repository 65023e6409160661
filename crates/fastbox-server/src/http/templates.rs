//! `/templates...` handlers (the OpenSandbox 1.1.1 templates API).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use fastbox_api::lifecycle::ErrorResponse;
use fastbox_api::templates::{CreateTemplateRequest, ListTemplatesResponse, Template};

use crate::error::ApiError;

use super::AppState;
use super::extract::{ApiJson, ApiPath, QueryPairs};
use super::sandboxes::{page_of, parse_metadata_filter};

#[utoipa::path(post, path = "/templates", request_body = CreateTemplateRequest, responses(
    (status = 201, body = Template), (status = 400, body = ErrorResponse)))]
pub async fn create(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<CreateTemplateRequest>,
) -> Result<impl IntoResponse, ApiError> {
    let template = state.lifecycle.create_template(req)?;
    Ok((StatusCode::CREATED, Json(template)))
}

#[utoipa::path(get, path = "/templates", params(
    ("metadata" = Option<String>, Query), ("page" = Option<u32>, Query),
    ("pageSize" = Option<u32>, Query)), responses((status = 200, body = ListTemplatesResponse)))]
pub async fn list(
    State(state): State<AppState>,
    query: QueryPairs,
) -> Result<Json<ListTemplatesResponse>, ApiError> {
    let mut metadata = Vec::new();
    for m in query.all("metadata") {
        metadata.extend(parse_metadata_filter(m)?);
    }
    let (page, page_size) = page_of(&query)?;
    Ok(Json(
        state.lifecycle.list_templates(&metadata, page, page_size),
    ))
}

#[utoipa::path(get, path = "/templates/{id}", responses(
    (status = 200, body = Template), (status = 404, body = ErrorResponse)))]
pub async fn get(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Template>, ApiError> {
    Ok(Json(state.lifecycle.get_template(&id)?))
}

#[utoipa::path(delete, path = "/templates/{id}", responses(
    (status = 204), (status = 404, body = ErrorResponse)))]
pub async fn delete(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.delete_template(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
