//! The access-token gate in front of every route, the proxy included.
//!
//! The token is the current [`Tenancy`](crate::tenancy::Tenancy)'s: a claim or a rekey replaces
//! it, and from then on the old one is refused. execd keeps only its SHA-256 digest (the memory
//! of a template's execd is checkpointed and published, so the token itself must not be in it),
//! and compares digests in constant time.

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::Digest as _;

use crate::error::ApiError;
use crate::state::AppState;

pub const TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

/// An access token as execd holds it: its SHA-256 digest only.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AccessToken {
    digest: [u8; 32],
}

impl AccessToken {
    /// Keeps the digest of `token` and overwrites the token's bytes.
    pub fn from_secret(mut token: String) -> Self {
        let digest = sha2::Sha256::digest(token.as_bytes()).into();
        // SAFETY: zero bytes are valid UTF-8, so the string stays a string.
        unsafe { token.as_bytes_mut().fill(0) };
        AccessToken { digest }
    }

    /// Whether `given` is the token.
    pub fn matches(&self, given: &[u8]) -> bool {
        let digest: [u8; 32] = sha2::Sha256::digest(given).into();
        constant_time_eq(&digest, &self.digest)
    }
}

impl std::fmt::Debug for AccessToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccessToken(<digest>)")
    }
}

pub async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let expected = state.tenancy.current().access_token;
    if let Some(expected) = expected {
        let given = req
            .headers()
            .get(TOKEN_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if !expected.matches(given) {
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
    fn tokens_are_kept_as_digests() {
        let token = AccessToken::from_secret("s3cret-token".to_string());
        assert!(token.matches(b"s3cret-token"));
        assert!(!token.matches(b"s3cret-tokeN"));
        assert!(!token.matches(b""));
        assert!(!format!("{token:?}").contains("s3cret"));
    }

    #[test]
    fn compares_contents_and_lengths() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
