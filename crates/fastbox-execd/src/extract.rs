//! Request extractors whose rejections use execd's `{code, message}` envelope.
//!
//! axum's own `Json` rejects with plain text and status 415/422; clients of this API expect
//! `400 INVALID_REQUEST_BODY` for any body they got wrong.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::ApiError;

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("error parsing request, MAYBE invalid body format: {0}")]
    Body(String),
    #[error("missing query parameter '{0}'")]
    MissingQuery(&'static str),
    #[error("invalid query parameter '{name}': {value}")]
    BadQuery { name: &'static str, value: String },
}

/// A JSON body; content type is not checked (some clients omit it).
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| RequestError::Body(e.to_string()))?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| RequestError::Body(e.to_string()).into())
    }
}

/// A JSON body that may be absent: an empty body yields `T::default()`.
pub struct OptionalJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| RequestError::Body(e.to_string()))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJson(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(OptionalJson)
            .map_err(|e| RequestError::Body(e.to_string()).into())
    }
}
