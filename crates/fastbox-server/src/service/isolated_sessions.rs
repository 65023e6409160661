//! Pause, snapshot and fork of a sandbox offering isolated sessions: refused (409) while its
//! execd reports live sessions, because CRIU cannot checkpoint the user namespaces they run
//! in. The node's checkpoint refuses the same on its own (a sandbox this check could not
//! reach); this check makes the answer synchronous and clear.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use fastbox_api::limits::EXECD_PORT;
use fastbox_node_api::wire::Unsigned;

use super::lifecycle::{EXECD_TOKEN_HEADER, Lifecycle};
use crate::error::ApiError;

/// How long execd has to list its sessions (an unreachable node delays the operation by
/// this much at most).
const TIMEOUT: Duration = Duration::from_secs(2);
/// The most of execd's answer that is read.
const MAX_ANSWER: usize = 1 << 20;

impl Lifecycle {
    /// `Conflict` when the execd of sandbox `id` reports live isolated sessions; `Ok`
    /// otherwise, and when execd does not answer (the node's check then decides). Every
    /// sandbox is asked, not only those created with the extension: a clone of an isolation
    /// sandbox offers sessions without naming it.
    pub async fn refuse_live_sessions(
        self: &Arc<Self>,
        id: &str,
        what: &str,
    ) -> Result<(), ApiError> {
        let record = self.record(id)?;
        if record.placement.is_none() {
            return Ok(());
        }
        // A node that cannot be asked: the operation itself says why.
        let Ok(node) = self.node(record.node.as_deref()) else {
            return Ok(());
        };
        let Ok(req) = Request::get("/v1/isolated/sessions")
            .header(EXECD_TOKEN_HEADER, record.tokens().execd)
            .body(Body::empty())
        else {
            return Ok(());
        };
        let asked = node.proxy(
            id,
            EXECD_PORT,
            "/v1/isolated/sessions",
            Unsigned::Allowed,
            &[],
            req,
        );
        let live = match tokio::time::timeout(TIMEOUT, asked).await {
            Ok(Ok(resp)) if resp.status().is_success() => {
                match axum::body::to_bytes(resp.into_body(), MAX_ANSWER).await {
                    Ok(bytes) => live_sessions(&bytes),
                    Err(_) => 0,
                }
            }
            _ => 0,
        };
        match live {
            0 => Ok(()),
            n => Err(ApiError::Conflict(format!(
                "sandbox {id} cannot be {what} while it has {n} live isolated session(s): CRIU cannot checkpoint their user namespaces; delete them first (DELETE /v1/isolated/session/{{id}} of its execd)"
            ))),
        }
    }
}

/// Sessions execd's `GET /v1/isolated/sessions` reports as active.
fn live_sessions(body: &[u8]) -> usize {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v["sessions"]
                .as_array()
                .map(|s| s.iter().filter(|s| s["status"] == "active").count())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_active_sessions_count() {
        let body = br#"{"sessions":[{"status":"active"},{"status":"dead"},{"status":"active"}]}"#;
        assert_eq!(live_sessions(body), 2);
        assert_eq!(live_sessions(b"{}"), 0);
        assert_eq!(live_sessions(b"not json"), 0);
    }
}
