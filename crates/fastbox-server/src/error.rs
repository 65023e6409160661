//! The lifecycle API's errors and their one mapping to HTTP: a status and the
//! `{"code", "message"}` envelope every OpenSandbox client expects.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use fastbox_api::lifecycle::ErrorResponse;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidParameter(String),
    #[error("{0}")]
    InvalidMetadata(String),
    #[error("{0}")]
    NotSupported(String),
    /// A local image reference (`dir:`, `oci:`, `oci-archive:`, `docker-archive:`, a path)
    /// outside the operator's `--allow-local-images` directories. The message is the same
    /// whatever the reason (outside, missing, relative, none allowed), so the API is no
    /// oracle for the host's files.
    #[error(
        "image {reference:?}: local image references (dir:, oci:, oci-archive:, docker-archive:, paths) are accepted only for existing paths under a directory the operator allows with --allow-local-images; use a registry image"
    )]
    LocalImageRefused { reference: String },
    /// A limit above the operator's maximum (`--max-cpu`, ...).
    #[error(
        "resourceLimits.{resource} {requested:?} is above this server's maximum of {maximum} (the operator's {setting})"
    )]
    AboveMaximum {
        resource: String,
        requested: String,
        maximum: String,
        setting: &'static str,
    },
    /// A writable layer larger than the free space of the data directory's file system.
    #[error(
        "resourceLimits.{resource} {requested:?} is more than the {free} free on this server's disk; ask for less"
    )]
    InsufficientDisk {
        resource: String,
        requested: String,
        free: String,
    },
    #[error(
        "Authentication credentials are missing. Provide API key via OPEN-SANDBOX-API-KEY header."
    )]
    MissingApiKey,
    #[error("Authentication credentials are invalid.")]
    InvalidApiKey,
    #[error("{0}")]
    Forbidden(String),
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    #[error("node {0} not found")]
    NodeNotFound(String),
    #[error("sandbox {id} is not reachable yet (state {state})")]
    NotReady { id: String, state: String },
    #[error("sandbox {id} is {state}{detail}")]
    NotRunning {
        id: String,
        state: String,
        detail: String,
    },
    #[error("{0}")]
    Conflict(String),
    #[error("{message}")]
    Capacity { message: String, retry_after: u32 },
    #[error("no route {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("method {0} is not allowed here")]
    MethodNotAllowed(String),
    #[error("{0}")]
    NotImplemented(String),
    #[error("sandbox port is unreachable: {0}")]
    Upstream(String),
    /// A node did not answer: whether the operation happened is unknown.
    #[error("node unavailable: {0}")]
    NodeUnavailable(String),
    /// The state store did not answer: the change was not made.
    #[error("{0}; the change was not made, retry later")]
    StoreUnavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidParameter(_)
            | Self::InvalidMetadata(_)
            | Self::NotSupported(_)
            | Self::LocalImageRefused { .. }
            | Self::AboveMaximum { .. }
            // The request is what is wrong for this server (507 is WebDAV's; clients treat
            // a 5xx as a server fault worth retrying, which this is not).
            | Self::InsufficientDisk { .. } => StatusCode::BAD_REQUEST,
            Self::MissingApiKey | Self::InvalidApiKey => StatusCode::UNAUTHORIZED,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::SandboxNotFound(_)
            | Self::TemplateNotFound(_)
            | Self::SnapshotNotFound(_)
            | Self::NodeNotFound(_)
            | Self::NotReady { .. }
            | Self::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            Self::NotRunning { .. } | Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Capacity { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::Upstream(_) => StatusCode::BAD_GATEWAY,
            Self::NodeUnavailable(_) | Self::StoreUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidParameter(_)
            | Self::LocalImageRefused { .. }
            | Self::AboveMaximum { .. }
            | Self::InsufficientDisk { .. } => "SANDBOX::INVALID_PARAMETER",
            Self::InvalidMetadata(_) => "SANDBOX::INVALID_METADATA_LABEL",
            Self::NotSupported(_) => "SANDBOX::API_NOT_SUPPORTED",
            Self::MissingApiKey => "MISSING_API_KEY",
            Self::InvalidApiKey => "INVALID_API_KEY",
            Self::Forbidden(_) => "SANDBOX::FORBIDDEN",
            Self::SandboxNotFound(_) => "SANDBOX::NOT_FOUND",
            Self::TemplateNotFound(_) => "TEMPLATE::NOT_FOUND",
            Self::SnapshotNotFound(_) => "SNAPSHOT::NOT_FOUND",
            Self::NodeNotFound(_) => "NODE::NOT_FOUND",
            // The one code the SDK keeps polling on while a sandbox is being created.
            Self::NotReady { .. } => "KUBERNETES::POD_IP_NOT_AVAILABLE",
            Self::NotRunning { .. } => "SANDBOX::NOT_RUNNING",
            Self::Conflict(_) => "SANDBOX::CONFLICT",
            Self::Capacity { .. } => "SANDBOX::CAPACITY_EXHAUSTED",
            Self::RouteNotFound { .. } => "GENERAL::NOT_FOUND",
            Self::MethodNotAllowed(_) => "GENERAL::METHOD_NOT_ALLOWED",
            Self::NotImplemented(_) => "SANDBOX::API_NOT_SUPPORTED",
            Self::Upstream(_) => "SANDBOX::UPSTREAM_UNAVAILABLE",
            Self::NodeUnavailable(_) => "SANDBOX::NODE_UNAVAILABLE",
            Self::StoreUnavailable(_) => "GENERAL::STATE_STORE_UNAVAILABLE",
            Self::Internal(_) => "GENERAL::UNKNOWN_ERROR",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(code = self.code(), error = %self, "request failed");
        }
        let body = ErrorResponse {
            code: self.code().to_string(),
            message: self.to_string(),
        };
        let mut response = (status, axum::Json(body)).into_response();
        if let Self::Capacity { retry_after, .. } = self {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_str(&retry_after.to_string()).expect("digits"),
            );
        }
        response
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        use fastbox_state::StateError;
        match e {
            StoreError::State(StateError::Unavailable(message)) => Self::StoreUnavailable(message),
            StoreError::State(e @ StateError::Full(_)) => Self::StoreUnavailable(e.to_string()),
            StoreError::State(e @ StateError::Conflict { .. }) => Self::Conflict(format!(
                "{e}: it was changed by another server at the same time; retry"
            )),
            e => Self::Internal(e.to_string()),
        }
    }
}

/// A node's refusal or failure, by kind: a full node is a 429 (retry soon), a bad image the
/// caller's 400, a node that cannot be reached a 503; the rest is the server's 500.
impl From<crate::nodes::NodesError> for ApiError {
    fn from(e: crate::nodes::NodesError) -> Self {
        Self::NodeUnavailable(e.to_string())
    }
}

impl From<fastbox_node_api::NodeError> for ApiError {
    fn from(e: fastbox_node_api::NodeError) -> Self {
        use fastbox_node_api::NodeErrorKind as Kind;
        match e.kind {
            Kind::NoCapacity => ApiError::Capacity {
                message: e.message,
                retry_after: 5,
            },
            Kind::BadImage => ApiError::InvalidParameter(format!("image: {}", e.message)),
            Kind::Unreachable => ApiError::NodeUnavailable(e.message),
            Kind::NotFound | Kind::Failed => ApiError::Internal(e.message),
        }
    }
}

/// The egress API on port 18080 (served by the node proxy) answers with the same statuses and
/// codes as the lifecycle API.
impl From<ApiError> for fastbox_node_api::control::EgressApiError {
    fn from(e: ApiError) -> Self {
        Self {
            status: e.status(),
            code: e.code(),
            message: e.to_string(),
        }
    }
}
