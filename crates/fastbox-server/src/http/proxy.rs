//! The server proxy, `/v1/sandboxes/{id}/proxy/{port}/...`: the API key or a signed route
//! admits a request; the API key never reaches the sandbox. A `secureAccess` sandbox's ports
//! also need its access token (`OpenSandbox-Secure-Access`) unless the route is signed: the
//! node proxy's rules (`fastbox_fastlet::node_proxy::access`), which this proxy routes
//! through, with the same failure counters.

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use fastbox_fastlet::node_proxy::{NodeProxyError, Unsigned};

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
    if state.lifecycle.get(&id).is_err() {
        return Err(ApiError::SandboxNotFound(id));
    }
    let proxied = state
        .node_proxy
        .proxy_to_sandbox(&id, port, &rest, unsigned, &[API_KEY], req)
        .await;
    proxied.or_else(|e| {
        Err(match e {
            NodeProxyError::Unsigned => ApiError::MissingApiKey,
            NodeProxyError::Forbidden(e) => ApiError::Forbidden(e.to_string()),
            NodeProxyError::NotRunning(id) => ApiError::NotReady {
                id,
                state: "not running".into(),
            },
            NodeProxyError::BadRoute(p) => ApiError::InvalidParameter(p),
            NodeProxyError::Upstream(e) => ApiError::Upstream(e.to_string()),
            // The node proxy's own answers, in the same `{code, message}` envelope (429
            // with `Retry-After`).
            e @ (NodeProxyError::Unauthorized(_) | NodeProxyError::TooManyFailures(_)) => {
                return Ok(e.into_response());
            }
        })
    })
}
