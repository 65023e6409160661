//! The router: every route of the execd API, the fastbox extensions, and the access-token
//! layer in front of all of them. Kept apart from `main` so tests drive it without a socket.

use axum::Router;
use axum::http::Uri;
use axum::middleware;
use axum::routing::{any, get};

use crate::error::ApiError;
use crate::state::AppState;
use crate::{
    auth, claim, code, command, entrypoint, files, isolated, metrics, proxy, pty, session,
};

/// The complete execd HTTP API.
pub fn app(state: AppState) -> Router {
    let isolated = match state.config.isolation {
        true => isolated::routes(),
        false => Router::new()
            .route("/v1/isolated/capabilities", get(isolation_capabilities))
            .route("/v1/isolated", any(isolation_unavailable))
            .route("/v1/isolated/{*rest}", any(isolation_unavailable)),
    };
    Router::new()
        .route("/ping", get(ping))
        .merge(command::routes())
        .merge(files::routes())
        .merge(entrypoint::routes())
        .merge(claim::routes())
        .merge(session::routes())
        .merge(code::routes())
        .merge(metrics::routes())
        .merge(proxy::routes())
        .merge(pty::routes())
        .nest("/v1/filesystem/{uid}/{gid}", files::routes())
        .merge(isolated)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .with_state(state)
}

async fn ping() {}

/// Why this sandbox runs no isolated sessions (`GET /v1/isolated/capabilities`).
const ISOLATION_UNAVAILABLE: &str = "isolated sessions are offered only to sandboxes created with the extension bootstrap.execd.isolation=enable";

/// `GET /v1/isolated/capabilities`: what the spec answers when isolation is unavailable
/// (every other `/v1/isolated` route is then a 503 `NOT_SUPPORTED`).
async fn isolation_capabilities() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "available": false,
        "isolator": "none",
        "message": ISOLATION_UNAVAILABLE,
        "setpriv_available": false,
        "userns_available": false,
        "commit_supported": false,
        "diff_supported": false,
    }))
}

async fn isolation_unavailable(uri: Uri) -> ApiError {
    ApiError::IsolationUnavailable(format!("{}: {ISOLATION_UNAVAILABLE}", uri.path()))
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::RouteNotFound(uri.path().to_string())
}
