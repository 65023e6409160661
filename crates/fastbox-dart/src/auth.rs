//! Peers authenticate each other with a group secret, which never crosses the wire.
//!
//! Every block request carries three headers:
//!
//! ```text
//! x-dart-node:       <node id of the requester>
//! x-dart-timestamp:  <Unix seconds when the request was signed>
//! x-dart-signature:  hex(HMAC-SHA256(secret, "dart-v1\n{node}\n{timestamp}\n{path_and_query}"))
//! ```
//!
//! The server recomputes the MAC (compared in constant time) and refuses the request with
//! 401 when a header is missing or malformed, when the signature does not match, or when the
//! timestamp is further than the allowed skew (default 60 s) from its own clock, in either
//! direction. The path and query are signed as sent (`/dart/v1/blocks/<digest>?local=1`),
//! so a signature cannot be moved to another block or have its `local=1` removed. What this
//! does not stop: a request captured on the wire can be replayed within the skew window
//! (it only reads a block, which the capturer already saw); use TLS or a private network
//! where that matters. The node id is authenticated, not authorized: any holder of the
//! secret may read, so a node not yet in a server's member list can still fetch from it.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::membership::NodeId;

/// The header naming the requesting node.
pub const NODE_HEADER: &str = "x-dart-node";
/// The header with the signing time (Unix seconds).
pub const TIMESTAMP_HEADER: &str = "x-dart-timestamp";
/// The header with the hex HMAC-SHA256 signature.
pub const SIGNATURE_HEADER: &str = "x-dart-signature";
/// Default largest accepted distance between a request's timestamp and the server's clock.
pub const DEFAULT_MAX_SKEW: Duration = Duration::from_secs(60);
/// Shortest group secret accepted (128 bits).
pub const MIN_SECRET_LEN: usize = 16;

/// Why a secret is refused or a request is not authentic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A secret shorter than [`MIN_SECRET_LEN`].
    #[error("the group secret has {0} bytes, fewer than {MIN_SECRET_LEN}")]
    SecretTooShort(usize),
    /// A required header is absent or not text.
    #[error("header {0} is missing")]
    MissingHeader(&'static str),
    /// The node header is not a node id.
    #[error("header {NODE_HEADER} is not a node id")]
    BadNode,
    /// The timestamp header is not a number.
    #[error("header {TIMESTAMP_HEADER} is not Unix seconds")]
    BadTimestamp,
    /// The timestamp is too far from the server's clock.
    #[error(
        "the request was signed {skew_secs} s away from this node's clock (at most {max_secs} s allowed)"
    )]
    Stale { skew_secs: u64, max_secs: u64 },
    /// The signature does not match.
    #[error("the signature does not match")]
    BadSignature,
}

/// The secret shared by the members of a delivery group, kept as a keyed HMAC state (the
/// raw bytes are not kept). `Debug` never shows it.
#[derive(Clone)]
pub struct GroupSecret(Hmac<Sha256>);

impl GroupSecret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes.
    pub fn try_new(bytes: impl Into<Vec<u8>>) -> Result<Self, AuthError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_LEN {
            return Err(AuthError::SecretTooShort(bytes.len()));
        }
        // HMAC accepts keys of every length; the error arm is there for the type only.
        let keyed = <Hmac<Sha256> as Mac>::new_from_slice(&bytes)
            .map_err(|_| AuthError::SecretTooShort(bytes.len()))?;
        Ok(GroupSecret(keyed))
    }

    fn mac(&self, node: &str, timestamp: u64, path_and_query: &str) -> Hmac<Sha256> {
        let mut mac = self.0.clone();
        mac.update(format!("dart-v1\n{node}\n{timestamp}\n{path_and_query}").as_bytes());
        mac
    }
}

impl fmt::Debug for GroupSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("GroupSecret(<redacted>)")
    }
}

/// The three authentication headers of one request, as (name, value) pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    /// `x-dart-node`.
    pub node: String,
    /// `x-dart-timestamp`.
    pub timestamp: String,
    /// `x-dart-signature`.
    pub signature: String,
}

impl SignedHeaders {
    /// The headers as (name, value) pairs, ready to add to a request.
    pub fn pairs(&self) -> [(&'static str, &str); 3] {
        [
            (NODE_HEADER, &self.node),
            (TIMESTAMP_HEADER, &self.timestamp),
            (SIGNATURE_HEADER, &self.signature),
        ]
    }
}

/// Sign a request for `path_and_query` from `node` at `at`.
pub fn sign(
    secret: &GroupSecret,
    node: &NodeId,
    path_and_query: &str,
    at: SystemTime,
) -> SignedHeaders {
    let timestamp = unix_secs(at);
    let signature = hex::encode(
        secret
            .mac(node.as_str(), timestamp, path_and_query)
            .finalize()
            .into_bytes(),
    );
    SignedHeaders {
        node: node.as_str().to_string(),
        timestamp: timestamp.to_string(),
        signature,
    }
}

/// Check a request's headers (`None` where absent) for `path_and_query` at time `now`;
/// returns the authenticated requester.
pub fn verify(
    secret: &GroupSecret,
    max_skew: Duration,
    path_and_query: &str,
    headers: [Option<&str>; 3],
    now: SystemTime,
) -> Result<NodeId, AuthError> {
    let [node, timestamp, signature] = headers;
    let node = node.ok_or(AuthError::MissingHeader(NODE_HEADER))?;
    let timestamp = timestamp.ok_or(AuthError::MissingHeader(TIMESTAMP_HEADER))?;
    let signature = signature.ok_or(AuthError::MissingHeader(SIGNATURE_HEADER))?;
    let node = NodeId::try_new(node).map_err(|_| AuthError::BadNode)?;
    let timestamp: u64 = timestamp.parse().map_err(|_| AuthError::BadTimestamp)?;
    let skew = unix_secs(now).abs_diff(timestamp);
    if skew > max_skew.as_secs() {
        return Err(AuthError::Stale {
            skew_secs: skew,
            max_secs: max_skew.as_secs(),
        });
    }
    let given = hex::decode(signature).map_err(|_| AuthError::BadSignature)?;
    secret
        .mac(node.as_str(), timestamp, path_and_query)
        .verify_slice(&given)
        .map_err(|_| AuthError::BadSignature)?;
    Ok(node)
}

fn unix_secs(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "/dart/v1/blocks/abc?local=1";

    fn secret(byte: u8) -> GroupSecret {
        GroupSecret::try_new(vec![byte; 32]).unwrap()
    }

    fn check(
        s: &GroupSecret,
        h: &SignedHeaders,
        path: &str,
        now: SystemTime,
    ) -> Result<NodeId, AuthError> {
        verify(
            s,
            DEFAULT_MAX_SKEW,
            path,
            [Some(&h.node), Some(&h.timestamp), Some(&h.signature)],
            now,
        )
    }

    #[test]
    fn a_signed_request_verifies_and_names_its_node() {
        let node = NodeId::try_new("a").unwrap();
        let now = SystemTime::now();
        let h = sign(&secret(1), &node, PATH, now);
        assert_eq!(check(&secret(1), &h, PATH, now), Ok(node));
        assert_eq!(h.signature.len(), 64);
    }

    #[test]
    fn wrong_secret_other_path_or_forged_node_fail() {
        let node = NodeId::try_new("a").unwrap();
        let now = SystemTime::now();
        let h = sign(&secret(1), &node, PATH, now);
        assert_eq!(
            check(&secret(2), &h, PATH, now),
            Err(AuthError::BadSignature)
        );
        assert_eq!(
            check(&secret(1), &h, "/dart/v1/blocks/abc", now),
            Err(AuthError::BadSignature)
        );
        let forged = SignedHeaders {
            node: "b".into(),
            ..h
        };
        assert_eq!(
            check(&secret(1), &forged, PATH, now),
            Err(AuthError::BadSignature)
        );
    }

    #[test]
    fn timestamps_beyond_the_skew_fail_both_ways() {
        let node = NodeId::try_new("a").unwrap();
        let now = SystemTime::now();
        let old = sign(&secret(1), &node, PATH, now - Duration::from_secs(61));
        let future = sign(&secret(1), &node, PATH, now + Duration::from_secs(61));
        let edge = sign(&secret(1), &node, PATH, now - Duration::from_secs(59));
        assert!(matches!(
            check(&secret(1), &old, PATH, now),
            Err(AuthError::Stale { .. })
        ));
        assert!(matches!(
            check(&secret(1), &future, PATH, now),
            Err(AuthError::Stale { .. })
        ));
        assert!(check(&secret(1), &edge, PATH, now).is_ok());
    }

    #[test]
    fn missing_or_malformed_headers_fail() {
        let s = secret(1);
        let now = SystemTime::now();
        let v = |h: [Option<&str>; 3]| verify(&s, DEFAULT_MAX_SKEW, PATH, h, now);
        assert_eq!(
            v([None, Some("1"), Some("00")]),
            Err(AuthError::MissingHeader(NODE_HEADER))
        );
        assert_eq!(
            v([Some("a"), None, Some("00")]),
            Err(AuthError::MissingHeader(TIMESTAMP_HEADER))
        );
        assert_eq!(
            v([Some("a"), Some("1"), None]),
            Err(AuthError::MissingHeader(SIGNATURE_HEADER))
        );
        assert_eq!(
            v([Some("a b"), Some("1"), Some("00")]),
            Err(AuthError::BadNode)
        );
        assert_eq!(
            v([Some("a"), Some("x"), Some("00")]),
            Err(AuthError::BadTimestamp)
        );
    }

    #[test]
    fn short_secrets_are_refused_and_never_printed() {
        assert_eq!(
            GroupSecret::try_new(vec![0; 15]).unwrap_err(),
            AuthError::SecretTooShort(15)
        );
        let s = GroupSecret::try_new(b"super-secret-value-123".to_vec()).unwrap();
        assert!(!format!("{s:?}").contains("super"));
    }
}
