//! The router: every route of the execd API, the fastbox extensions, and the access-token
//! layer in front of all of them. Kept apart from `main` so tests drive it without a socket.

use axum::Router;
use axum::http::Uri;
use axum::middleware;
use axum::routing::{any, get};

use crate::error::ApiError;
use crate::state::AppState;
use crate::{auth, claim, code, command, entrypoint, files, metrics, proxy, pty, session};

/// The complete execd HTTP API.
pub fn app(state: AppState) -> Router {
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
        .route("/v1/isolated", any(not_supported))
        .route("/v1/isolated/{*rest}", any(not_supported))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ))
        .with_state(state)
}

async fn ping() {}

async fn not_supported(uri: Uri) -> ApiError {
    ApiError::NotSupported(uri.path().to_string())
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::RouteNotFound(uri.path().to_string())
}
