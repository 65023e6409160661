//! The one place where errors become HTTP responses.
//!
//! Every module has its own error enum saying what failed; [`ApiError`] gathers them and
//! [`ApiError::classify`] is the single table from error to status and `code`. Bodies are the
//! execd envelope `{"code": ..., "message": ...}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::claim::ClaimError;
use crate::code::CodeError;
use crate::command::CommandError;
use crate::extract::RequestError;
use crate::files::FilesError;
use crate::isolated::IsolatedError;
use crate::proxy::ProxyError;
use crate::pty::PtyError;
use crate::session::SessionError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("invalid or missing header X-EXECD-ACCESS-TOKEN")]
    Unauthorized,
    #[error("{0}")]
    IsolationUnavailable(String),
    #[error("route not found: {0}")]
    RouteNotFound(String),
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error(transparent)]
    Command(#[from] CommandError),
    #[error(transparent)]
    Files(#[from] FilesError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    #[error(transparent)]
    Code(#[from] CodeError),
    #[error(transparent)]
    Pty(#[from] PtyError),
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Isolated(#[from] IsolatedError),
}

#[derive(Serialize)]
struct Envelope<'a> {
    code: &'a str,
    message: String,
}

impl ApiError {
    /// Status and machine-readable code for every error execd can return.
    pub fn classify(&self) -> (StatusCode, &'static str) {
        use StatusCode as S;
        match self {
            ApiError::Unauthorized => (S::UNAUTHORIZED, "UNAUTHORIZED"),
            ApiError::IsolationUnavailable(_) => (S::SERVICE_UNAVAILABLE, "NOT_SUPPORTED"),
            ApiError::RouteNotFound(_) => (S::NOT_FOUND, "NOT_FOUND"),
            ApiError::Request(e) => match e {
                RequestError::Body(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                RequestError::MissingQuery(_) => (S::BAD_REQUEST, "MISSING_QUERY"),
                RequestError::BadQuery { .. } => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
            },
            ApiError::Command(e) => match e {
                CommandError::Invalid(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                CommandError::NotFound(_) => (S::NOT_FOUND, "CONTEXT_NOT_FOUND"),
                CommandError::NotBackground(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
            },
            ApiError::Files(e) => match e {
                FilesError::NotFound(_) => (S::NOT_FOUND, "FILE_NOT_FOUND"),
                FilesError::PermissionDenied(_) => (S::FORBIDDEN, "RUNTIME_ERROR"),
                FilesError::Invalid(_) | FilesError::Account(_) => {
                    (S::BAD_REQUEST, "INVALID_REQUEST_BODY")
                }
                FilesError::Upload(_) => (S::BAD_REQUEST, "INVALID_FILE"),
                FilesError::Metadata(_) => (S::BAD_REQUEST, "INVALID_FILE_METADATA"),
                FilesError::RangeNotSatisfiable { .. } => (S::RANGE_NOT_SATISFIABLE, "UNKNOWN"),
                FilesError::Identity(_) => (S::FORBIDDEN, "RUNTIME_ERROR"),
                FilesError::Io { .. } | FilesError::Internal(_) => {
                    (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR")
                }
            },
            ApiError::Session(e) => match e {
                SessionError::NotFound(_) => (S::NOT_FOUND, "SESSION_NOT_FOUND"),
                SessionError::Invalid(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                SessionError::Spawn(_) => (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR"),
            },
            ApiError::Code(e) => match e {
                CodeError::NotFound(_) => (S::NOT_FOUND, "CONTEXT_NOT_FOUND"),
                CodeError::UnsupportedLanguage(_) => (S::NOT_IMPLEMENTED, "NOT_SUPPORTED"),
                CodeError::Unavailable(_) => (S::SERVICE_UNAVAILABLE, "SERVICE_UNAVAILABLE"),
                CodeError::Invalid(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                CodeError::Spawn(_) => (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR"),
            },
            ApiError::Pty(e) => match e {
                PtyError::NotFound(_) => (S::NOT_FOUND, "CONTEXT_NOT_FOUND"),
                PtyError::AlreadyConnected(_) => (S::CONFLICT, "ALREADY_CONNECTED"),
                PtyError::Start(_) => (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR"),
            },
            ApiError::Claim(e) => match e {
                ClaimError::Invalid(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                ClaimError::AlreadyClaimed => (S::CONFLICT, "ALREADY_CLAIMED"),
                ClaimError::EntrypointStarted => (S::CONFLICT, "ENTRYPOINT_ALREADY_STARTED"),
                ClaimError::Trust(_) => (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR"),
            },
            ApiError::Isolated(e) => match e {
                IsolatedError::Invalid(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                IsolatedError::Unsupported(_) => (S::SERVICE_UNAVAILABLE, "NOT_SUPPORTED"),
                IsolatedError::NotFound(_) => (S::NOT_FOUND, "SESSION_NOT_FOUND"),
                IsolatedError::Ended(_) => (S::CONFLICT, "SESSION_ENDED"),
                IsolatedError::RunNotFound(_) => (S::NOT_FOUND, "NOT_FOUND"),
                IsolatedError::TooMany => (S::TOO_MANY_REQUESTS, "TOO_MANY_SESSIONS"),
                IsolatedError::Setup(_) => (S::INTERNAL_SERVER_ERROR, "RUNTIME_ERROR"),
                IsolatedError::Upstream(_) => (S::BAD_GATEWAY, "RUNTIME_ERROR"),
            },
            ApiError::Proxy(e) => match e {
                ProxyError::InvalidPort(_) => (S::BAD_REQUEST, "INVALID_REQUEST_BODY"),
                ProxyError::Connect { .. } | ProxyError::Upstream { .. } => {
                    (S::BAD_GATEWAY, "SERVICE_UNAVAILABLE")
                }
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.classify();
        if status.is_server_error() {
            tracing::warn!(error = %self, "request failed");
        } else {
            tracing::debug!(error = %self, "request rejected");
        }
        let mut resp = (
            status,
            axum::Json(Envelope {
                code,
                message: self.to_string(),
            }),
        )
            .into_response();
        if let ApiError::Files(FilesError::RangeNotSatisfiable { size }) = self
            && let Ok(v) = format!("bytes */{size}").parse()
        {
            resp.headers_mut()
                .insert(axum::http::header::CONTENT_RANGE, v);
        }
        resp
    }
}
