//! The access-token gate in front of every route, the proxy included.
//!
//! The token is the current [`Tenancy`](crate::tenancy::Tenancy)'s: a claim replaces it, and
//! from then on the old one is refused. It is compared in constant time so its value cannot be
//! learned byte by byte from response timing.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

pub const TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

pub async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let expected = state.tenancy.current().access_token.clone();
    if let Some(expected) = expected {
        let given = req
            .headers()
            .get(TOKEN_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if !constant_time_eq(given, expected.as_bytes()) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// Equality whose running time depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_contents_and_lengths() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
