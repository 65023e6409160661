//! What wraps every request: the request id (echoed or generated, on every response) and
//! API-key authentication.

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

use super::AppState;

pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub const API_KEY: HeaderName = HeaderName::from_static("open-sandbox-api-key");

/// Echoes `X-Request-ID`, or sets a new one, on every response.
pub async fn request_id(req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 200)
        .cloned()
        .unwrap_or_else(|| {
            HeaderValue::from_str(&uuid::Uuid::new_v4().simple().to_string()).expect("hex")
        });
    let mut response = next.run(req).await;
    response.headers_mut().insert(REQUEST_ID, id);
    response
}

/// Set on answers made from the server's last known state while the state store cannot be
/// reached.
pub const STALE: HeaderName = HeaderName::from_static("x-fastbox-stale");

/// Marks the answers to reads `X-Fastbox-Stale: true` while the state store is unreachable
/// (changes are refused with 503 meanwhile).
pub async fn stale(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let read = req.method() == axum::http::Method::GET;
    let mut response = next.run(req).await;
    if read && state.lifecycle.state_unreachable() {
        response
            .headers_mut()
            .insert(STALE, HeaderValue::from_static("true"));
    }
    response
}

/// Paths anyone may call.
fn is_public(path: &str) -> bool {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    matches!(path, "/health" | "/version" | "/openapi.json")
}

/// `^(/v1)?/sandboxes/{id}/proxy/{port}(/|$)`: the server proxy checks its own credentials
/// (the API key or a signed route).
pub fn is_proxy(path: &str) -> bool {
    let path = path.strip_prefix("/v1").unwrap_or(path);
    let mut parts = path.trim_start_matches('/').splitn(5, '/');
    parts.next() == Some("sandboxes")
        && parts.next().is_some_and(|id| !id.is_empty())
        && parts.next() == Some("proxy")
        && parts
            .next()
            .is_some_and(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

/// Checks `OPEN-SANDBOX-API-KEY` against the configured key.
pub fn check_key(state: &AppState, req: &Request) -> Result<(), ApiError> {
    match req.headers().get(&API_KEY) {
        None => Err(ApiError::MissingApiKey),
        Some(v) if constant_time_eq(v.as_bytes(), state.api_key.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::InvalidApiKey),
    }
}

pub async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if is_public(path) || is_proxy(path) {
        return next.run(req).await;
    }
    match check_key(&state, &req) {
        Ok(()) => next.run(req).await,
        Err(e) => {
            // Read (a bounded amount of) the body first: answering before it is consumed
            // makes the connection unusable for the client's next request.
            let _ = axum::body::to_bytes(req.into_body(), DRAIN_LIMIT).await;
            e.into_response()
        }
    }
}

/// Most of a refused request's body read before answering.
const DRAIN_LIMIT: usize = 1 << 20;

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_and_public_paths() {
        assert!(is_proxy("/v1/sandboxes/abc/proxy/44772"));
        assert!(is_proxy("/sandboxes/abc/proxy/44772/ping"));
        assert!(!is_proxy("/v1/sandboxes/abc/proxy/x/ping"));
        assert!(!is_proxy("/v1/sandboxes/abc/endpoints/44772"));
        assert!(!is_proxy("/v1/sandboxes//proxy/1"));
        assert!(is_public("/health") && is_public("/v1/health"));
        assert!(!is_public("/v1/sandboxes"));
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
