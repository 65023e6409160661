//! Request extractors whose rejections are API errors (400 `SANDBOX::INVALID_PARAMETER` in
//! the envelope), never a framework's plain-text 4xx.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A JSON body.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::InvalidParameter(format!("request body: {e}")))?;
        if bytes.is_empty() {
            return Err(ApiError::InvalidParameter("a JSON body is required".into()));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::InvalidParameter(format!("invalid JSON body: {e}")))
    }
}

/// Path parameters.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| ApiPath(p.0))
            .map_err(|e| ApiError::InvalidParameter(format!("path: {}", e.body_text())))
    }
}

/// The query string as ordered key/value pairs (repeated keys kept).
pub struct QueryPairs(pub Vec<(String, String)>);

impl QueryPairs {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A numeric parameter, or `default` when absent.
    pub fn number<N: std::str::FromStr>(&self, key: &str, default: N) -> Result<N, ApiError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| ApiError::InvalidParameter(format!("{key}={v:?} is not a number"))),
        }
    }

    /// A boolean parameter (`true`/`false`, `1`/`0`), or false when absent.
    pub fn flag(&self, key: &str) -> Result<bool, ApiError> {
        match self.get(key) {
            None => Ok(false),
            Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => Ok(true),
            Some(v) if v.eq_ignore_ascii_case("false") || v == "0" || v.is_empty() => Ok(false),
            Some(v) => Err(ApiError::InvalidParameter(format!(
                "{key}={v:?} is not a boolean"
            ))),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for QueryPairs {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let query = parts.uri.query().unwrap_or("");
        Ok(QueryPairs(
            form_urlencoded::parse(query.as_bytes())
                .into_owned()
                .collect(),
        ))
    }
}
