//! `/command`: one-shot commands, foreground (streamed) or background (logged), with status,
//! logs and interrupt.

pub mod request;
pub mod runner;
pub mod store;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::error::ApiError;
use crate::extract::{JsonBody, RequestError};
use crate::query::QueryPairs;
use crate::state::AppState;

use request::RunCommandRequest;

pub const TAIL_CURSOR_HEADER: &str = "EXECD-COMMANDS-TAIL-CURSOR";

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("invalid command request: {0}")]
    Invalid(String),
    #[error("command {0} not found")]
    NotFound(String),
    #[error("command {0} is not running in background")]
    NotBackground(String),
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/command", post(run_command).delete(interrupt_command))
        .route("/command/status/{id}", get(command_status))
        .route("/command/{id}/logs", get(command_logs))
}

async fn run_command(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<RunCommandRequest>,
) -> Result<Response, ApiError> {
    let spec = req.into_spec(&state)?;
    Ok(runner::run(&state, spec).await)
}

async fn interrupt_command(State(state): State<AppState>, uri: Uri) -> Result<(), ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let id = q
        .get("id")
        .filter(|s| !s.is_empty())
        .ok_or(RequestError::MissingQuery("id"))?;
    let record = state
        .commands
        .get(id)
        .ok_or_else(|| CommandError::NotFound(id.to_string()))?;
    record.interrupt();
    Ok(())
}

async fn command_status(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let record = state.commands.get(&id).ok_or(CommandError::NotFound(id))?;
    Ok(axum::Json(record.status()).into_response())
}

async fn command_logs(
    State(state): State<AppState>,
    Path(id): Path<String>,
    uri: Uri,
) -> Result<Response, ApiError> {
    let q = QueryPairs::from_uri(&uri);
    let cursor = match q.get("cursor").filter(|s| !s.is_empty()) {
        None => 0,
        Some(c) => c.parse::<u64>().map_err(|_| RequestError::BadQuery {
            name: "cursor",
            value: c.to_string(),
        })?,
    };
    let record = state
        .commands
        .get(&id)
        .ok_or_else(|| CommandError::NotFound(id.clone()))?;
    let log = record.log.as_ref().ok_or(CommandError::NotBackground(id))?;
    let (text, next) = log.read_from(cursor);
    let mut resp = text.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(TAIL_CURSOR_HEADER, HeaderValue::from(next));
    Ok(resp)
}
