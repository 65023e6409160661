//! The server proxy, `/v1/sandboxes/{id}/proxy/{port}/...`: the API key or a signed route
//! admits a request; the API key never reaches the sandbox. A `secureAccess` sandbox's ports
//! also need its access token (`OpenSandbox-Secure-Access`) unless the route is signed: the
//! node proxy's rules, which this proxy routes through (the sandbox's node proxy checks
//! them, with the same failure counters).

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use fastbox_api::lifecycle::ErrorResponse;
use fastbox_node_api::wire::{ProxyRefusal, Unsigned};

use crate::error::ApiError;

use super::AppState;
use super::extract::ApiPath;
use super::middleware::{API_KEY, check_key};

pub async fn server_proxy(
    State(state): State<AppState>,
    ApiPath((id, port)): ApiPath<(String, u16)>,
    req: Request,
) -> Result<Response, ApiError> {
    forward(state, id, port, String::new(), req).await
}

pub async fn server_proxy_rest(
    State(state): State<AppState>,
    ApiPath((id, port, rest)): ApiPath<(String, u16, String)>,
    req: Request,
) -> Result<Response, ApiError> {
    forward(state, id, port, format!("/{rest}"), req).await
}

async fn forward(
    state: AppState,
    id: String,
    port: u16,
    rest: String,
    req: Request,
) -> Result<Response, ApiError> {
    let unsigned = match check_key(&state, &req) {
        Ok(()) => Unsigned::Allowed,
        // A wrong key is refused outright; a missing one may be replaced by a signature.
        Err(ApiError::MissingApiKey) => Unsigned::Refused,
        Err(e) => return Err(e),
    };
    // The sandbox's own node's proxy (404 for an unknown sandbox).
    let node = state.lifecycle.node_of_sandbox(&id)?;
    let proxied = node
        .proxy(&id, port, &rest, unsigned, &[API_KEY], req)
        .await;
    proxied.or_else(|e| {
        Err(match e {
            ProxyRefusal::Unsigned => ApiError::MissingApiKey,
            ProxyRefusal::Forbidden(e) => ApiError::Forbidden(e),
            ProxyRefusal::NotRunning(id) => ApiError::NotReady {
                id,
                state: "not running".into(),
            },
            ProxyRefusal::BadRoute(p) => ApiError::InvalidParameter(p),
            ProxyRefusal::Upstream(e) => ApiError::Upstream(e),
            // The node proxy's own answers, passed on as they are.
            ProxyRefusal::Answered {
                status,
                code,
                message,
                retry_after_secs,
            } => return Ok(answered(status, code, message, retry_after_secs)),
        })
    })
}

/// The node proxy's own answer (401, 429), in the same `{code, message}` envelope, with
/// `Retry-After` when it gave one.
fn answered(status: u16, code: String, message: String, retry_after: Option<u64>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = (status, axum::Json(ErrorResponse { code, message })).into_response();
    if let Some(secs) = retry_after {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    response
}
