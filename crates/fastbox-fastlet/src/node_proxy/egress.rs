//! Port 18080: OpenSandbox's egress API (`GET/PATCH/DELETE /policy`, compat §5), served by
//! the node proxy itself (fastbox runs no sidecar; the policy is enforced on the host side of
//! the sandbox's veth).
//!
//! Here: the `OPENSANDBOX-EGRESS-AUTH` check against the sandbox's egress token (the
//! endpoint's `headers` carry it), routing and bodies. The policy operations are the server's
//! [`EgressApi`] (a trait of the node boundary, `fastbox_node_api::control`, re-exported here
//! with its types), so a change made through this port is validated, applied and recorded by
//! the same code as one made through the lifecycle API's `networkpolicy` routes.

use std::sync::Arc;

use axum::body::{Body, to_bytes};
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::ErrorResponse;
pub use fastbox_node_api::control::{
    EGRESS_AUTH_HEADER, EGRESS_PORT, EgressApi, EgressApiError, PolicyChange, VIA_EGRESS_PORT,
};
use serde::de::DeserializeOwned;

use crate::Route;

/// Largest request body (256 rules of the longest names fit well within it).
const MAX_BODY: usize = 1 << 20;

/// Why a request to port 18080 was not answered with a policy.
#[derive(Debug, thiserror::Error)]
pub enum EgressRequestError {
    #[error("missing or wrong {EGRESS_AUTH_HEADER} header")]
    Unauthorized,
    #[error(
        "the egress endpoint serves /policy (GET, PATCH, DELETE) and /credential-vault, not {0}"
    )]
    NoRoute(String),
    #[error("/policy answers GET, PATCH and DELETE, not {0}")]
    MethodNotAllowed(Method),
    #[error("request body: {0}")]
    Body(String),
    #[error(transparent)]
    Refused(#[from] EgressApiError),
}

impl EgressRequestError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NoRoute(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::Body(_) => StatusCode::BAD_REQUEST,
            Self::Refused(e) => e.status,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::Unauthorized => "EGRESS::UNAUTHORIZED",
            Self::NoRoute(_) => "GENERAL::NOT_FOUND",
            Self::MethodNotAllowed(_) => "GENERAL::METHOD_NOT_ALLOWED",
            Self::Body(_) => "SANDBOX::INVALID_PARAMETER",
            Self::Refused(e) => e.code,
        }
    }
}

impl IntoResponse for EgressRequestError {
    fn into_response(self) -> Response {
        let body = ErrorResponse {
            code: self.code().to_string(),
            message: self.to_string(),
        };
        (self.status(), axum::Json(body)).into_response()
    }
}

/// Answers `req` (whose path after `/{id}/18080` is `path`) for sandbox `id`: its policy,
/// or its Credential Vault (`vault`, [`super::vault`]).
pub async fn serve(
    api: Arc<dyn EgressApi>,
    vault: super::vault::VaultCell,
    id: &str,
    route: &Route,
    path: &str,
    req: Request<Body>,
) -> Response {
    let presented = req
        .headers()
        .get(EGRESS_AUTH_HEADER)
        .map(|v| v.as_bytes())
        .unwrap_or_default();
    if !token_matches(presented, route.egress_token.as_bytes()) {
        return refused(req, EgressRequestError::Unauthorized)
            .await
            .into_response();
    }
    if path == super::vault::VAULT_PATH || path.starts_with("/credential-vault/") {
        return super::vault::serve(vault, route, path, req).await;
    }
    answer(api, id, path, req)
        .await
        .map(|status| axum::Json(status).into_response())
        .unwrap_or_else(IntoResponse::into_response)
}

async fn answer(
    api: Arc<dyn EgressApi>,
    id: &str,
    path: &str,
    req: Request<Body>,
) -> Result<PolicyStatusResponse, EgressRequestError> {
    if path != "/policy" {
        let why = EgressRequestError::NoRoute(path.to_string());
        return Err(refused(req, why).await);
    }
    let change = match req.method().clone() {
        Method::GET => return Ok(api.policy(id).await?),
        Method::PATCH => PolicyChange::Patch(body(req).await?),
        Method::DELETE => PolicyChange::Delete(body(req).await?),
        other => return Err(refused(req, EgressRequestError::MethodNotAllowed(other)).await),
    };
    // The implementation does its own blocking work (`nft`, `conntrack`) off this thread.
    Ok(api.change(id, change, VIA_EGRESS_PORT).await?)
}

/// `why`, once the request's body (at most [`MAX_BODY`]) is read: a refusal that left it
/// unread would end the connection, and the client's next request on it (a keep-alive client
/// reuses it) would fail without an answer.
async fn refused(req: Request<Body>, why: EgressRequestError) -> EgressRequestError {
    let _ = to_bytes(req.into_body(), MAX_BODY).await;
    why
}

/// A JSON body.
async fn body<T: DeserializeOwned>(req: Request<Body>) -> Result<T, EgressRequestError> {
    let bytes = to_bytes(req.into_body(), MAX_BODY)
        .await
        .map_err(|e| EgressRequestError::Body(e.to_string()))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| EgressRequestError::Body(format!("invalid JSON: {e}")))
}

/// Whether `presented` is `expected`, in time independent of where they differ. An empty
/// expected token (a sandbox recorded before egress tokens existed) matches nothing.
fn token_matches(presented: &[u8], expected: &[u8]) -> bool {
    !expected.is_empty()
        && presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_exactly_and_never_when_empty() {
        assert!(token_matches(b"abc", b"abc"));
        assert!(!token_matches(b"abd", b"abc"));
        assert!(!token_matches(b"ab", b"abc"));
        assert!(!token_matches(b"", b""));
    }
}
