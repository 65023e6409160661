//! `/sandboxes...` handlers: parse, call the lifecycle service, answer with the exact status
//! the OpenSandbox SDK expects.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use fastbox_api::lifecycle::{
    CreateSandboxRequest, CreateSandboxResponse, DiagnosticContentResponse, Endpoint,
    ErrorResponse, ListSandboxesResponse, RenewSandboxExpirationRequest,
    RenewSandboxExpirationResponse, Sandbox, SandboxState,
};

use crate::error::ApiError;
use crate::service::{EndpointQuery, ListQuery};

use super::AppState;
use super::extract::{ApiJson, ApiPath, QueryPairs};

/// Largest `pageSize`.
const MAX_PAGE_SIZE: u32 = 200;

#[utoipa::path(post, path = "/sandboxes", request_body = CreateSandboxRequest, responses(
    (status = 202, body = CreateSandboxResponse), (status = 400, body = ErrorResponse),
    (status = 429, body = ErrorResponse)))]
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<impl IntoResponse, ApiError> {
    let req: CreateSandboxRequest = serde_json::from_value(body.clone())
        .map_err(|e| ApiError::InvalidParameter(format!("invalid JSON body: {e}")))?;
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(value) => Some(value.to_str().map_err(|_| {
            ApiError::InvalidParameter("Idempotency-Key: printable ASCII only".into())
        })?),
    };
    let (sandbox, replayed) = match key {
        None => (state.lifecycle.create(req).await?, false),
        // The request as parsed (keys in order), so a retry that only reorders them is the
        // same request.
        Some(key) => {
            let canonical = serde_json::to_vec(&body).expect("JSON");
            state.lifecycle.create_once(req, key, &canonical).await?
        }
    };
    let mut response = (
        StatusCode::ACCEPTED,
        Json(CreateSandboxResponse::from(sandbox)),
    )
        .into_response();
    if replayed {
        response.headers_mut().insert(
            IDEMPOTENT_REPLAYED,
            axum::http::HeaderValue::from_static("true"),
        );
    }
    Ok(response)
}

/// The header a client names a create with, so that retrying it never makes a second
/// sandbox.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Set on the answer to a retried create: the sandbox an earlier attempt made.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

#[utoipa::path(get, path = "/sandboxes", params(
    ("state" = Option<Vec<String>>, Query, description = "repeatable state filter; an unknown state matches nothing"),
    ("metadata" = Option<String>, Query, description = "url-encoded k=v&k2=v2"),
    ("page" = Option<u32>, Query), ("pageSize" = Option<u32>, Query)),
    responses((status = 200, body = ListSandboxesResponse), (status = 400, body = ErrorResponse)))]
pub async fn list(
    State(state): State<AppState>,
    query: QueryPairs,
) -> Result<Json<ListSandboxesResponse>, ApiError> {
    let states = state_filter(&query, SandboxState::parse);
    let mut metadata = Vec::new();
    for m in query.all("metadata") {
        metadata.extend(parse_metadata_filter(m)?);
    }
    let (page, page_size) = page_of(&query)?;
    Ok(Json(state.lifecycle.list(&ListQuery {
        states,
        metadata,
        page,
        page_size,
    })))
}

/// The `state` filters of a list: `None` when there are none. A state this server does not
/// know (an SDK may send any name) matches nothing; it is not an error.
pub fn state_filter<S>(query: &QueryPairs, parse: impl Fn(&str) -> Option<S>) -> Option<Vec<S>> {
    let named: Vec<&str> = query.all("state").collect();
    (!named.is_empty()).then(|| named.into_iter().filter_map(parse).collect())
}

/// `page` (from 1) and `pageSize` (1..200, default 20).
pub fn page_of(query: &QueryPairs) -> Result<(u32, u32), ApiError> {
    let page = query.number("page", 1u32)?;
    let page_size = query.number("pageSize", 20u32)?;
    if page < 1 {
        return Err(ApiError::InvalidParameter("page must be at least 1".into()));
    }
    if !(1..=MAX_PAGE_SIZE).contains(&page_size) {
        return Err(ApiError::InvalidParameter(format!(
            "pageSize must be 1..{MAX_PAGE_SIZE}"
        )));
    }
    Ok((page, page_size))
}

/// `metadata=a%3Db%2520c` arrives decoded once as `a=b%20c`: parse it as a query string
/// (strictly: every pair needs `=`).
pub fn parse_metadata_filter(raw: &str) -> Result<Vec<(String, String)>, ApiError> {
    if raw.is_empty() {
        return Ok(Vec::new());
    }
    raw.split('&')
        .map(|pair| {
            if !pair.contains('=') {
                return Err(ApiError::InvalidParameter(format!(
                    "INVALID_METADATA_FORMAT: {pair:?} is not key=value"
                )));
            }
            let mut parsed = form_urlencoded::parse(pair.as_bytes()).into_owned();
            parsed.next().ok_or_else(|| {
                ApiError::InvalidParameter(format!("INVALID_METADATA_FORMAT: {pair:?}"))
            })
        })
        .collect()
}

#[utoipa::path(get, path = "/sandboxes/{id}", responses(
    (status = 200, body = Sandbox), (status = 404, body = ErrorResponse)))]
pub async fn get(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(state.lifecycle.get(&id)?))
}

#[utoipa::path(delete, path = "/sandboxes/{id}", responses(
    (status = 204), (status = 404, body = ErrorResponse)))]
pub async fn delete(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.delete(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(patch, path = "/sandboxes/{id}/metadata", request_body = Object, responses(
    (status = 200, body = Sandbox), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse)))]
pub async fn patch_metadata(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(patch): ApiJson<serde_json::Value>,
) -> Result<Json<Sandbox>, ApiError> {
    let serde_json::Value::Object(patch) = patch else {
        return Err(ApiError::InvalidParameter(
            "the metadata patch must be a JSON object".into(),
        ));
    };
    Ok(Json(state.lifecycle.patch_metadata(&id, patch)?))
}

#[utoipa::path(post, path = "/sandboxes/{id}/renew-expiration",
    request_body = RenewSandboxExpirationRequest, responses(
    (status = 200, body = RenewSandboxExpirationResponse), (status = 400, body = ErrorResponse),
    (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn renew(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<RenewSandboxExpirationRequest>,
) -> Result<Json<RenewSandboxExpirationResponse>, ApiError> {
    let expires_at = state.lifecycle.renew(&id, req.expires_at.to_utc())?;
    Ok(Json(RenewSandboxExpirationResponse { expires_at }))
}

#[utoipa::path(get, path = "/sandboxes/{id}/endpoints/{port}", params(
    ("use_server_proxy" = Option<bool>, Query), ("expires" = Option<String>, Query,
    description = "Unix seconds: a signed route valid until then")), responses(
    (status = 200, body = Endpoint), (status = 404, body = ErrorResponse)))]
pub async fn endpoint(
    State(state): State<AppState>,
    ApiPath((id, port)): ApiPath<(String, String)>,
    headers: HeaderMap,
    query: QueryPairs,
) -> Result<Json<Endpoint>, ApiError> {
    let port: u16 = port
        .parse()
        .map_err(|_| ApiError::InvalidParameter(format!("port {port:?} is not 1..65535")))?;
    let expires = match query.get("expires") {
        None | Some("") => None,
        Some(v) => Some(v.parse::<u64>().map_err(|_| {
            ApiError::InvalidParameter(format!("expires {v:?} is not a Unix time in seconds"))
        })?),
    };
    let q = EndpointQuery {
        use_server_proxy: query.flag("use_server_proxy")?,
        expires,
        api_host: headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string),
    };
    Ok(Json(state.lifecycle.endpoint(&id, port, &q).await?))
}

#[utoipa::path(get, path = "/sandboxes/{id}/diagnostics/logs",
    params(("scope" = Option<String>, Query, description = "container (default) or all")),
    responses((status = 200, body = DiagnosticContentResponse)))]
pub async fn diagnostics_logs(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    query: QueryPairs,
) -> Result<Json<DiagnosticContentResponse>, ApiError> {
    let scope = query.get("scope").unwrap_or("container");
    Ok(Json(state.lifecycle.diagnostics_logs(&id, scope).await?))
}

#[utoipa::path(get, path = "/sandboxes/{id}/diagnostics/events",
    params(("scope" = Option<String>, Query, description = "runtime (default) or all")),
    responses((status = 200, body = DiagnosticContentResponse)))]
pub async fn diagnostics_events(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    query: QueryPairs,
) -> Result<Json<DiagnosticContentResponse>, ApiError> {
    let scope = query.get("scope").unwrap_or("runtime");
    Ok(Json(state.lifecycle.diagnostics_events(&id, scope)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_filters_decode_once_more() {
        // The SDK's `a=b c` and `x=y&z` after the query string's own decoding.
        let pairs = parse_metadata_filter("a=b%20c&x=y%26z").unwrap();
        assert_eq!(
            pairs,
            vec![("a".into(), "b c".into()), ("x".into(), "y&z".into())]
        );
        assert!(parse_metadata_filter("novalue").is_err());
    }
}
