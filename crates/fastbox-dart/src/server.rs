//! The peer server: serves this node's blocks to the other members of its group.
//!
//! `GET /dart/v1/blocks/{digest}` (authenticated, see [`crate::auth`]):
//! 1. held locally: 200 with the block;
//! 2. otherwise, with `?local=1`: 404;
//! 3. otherwise, when this node owns the block under its current membership: join (or
//!    start) the block's single-flight origin fetch, wait for its first byte, then answer
//!    200 and stream the bytes received so far and each new piece as it arrives; the body
//!    breaks off if the fetch fails later, and a fetch that fails before its first byte
//!    is 404 (the origin has no such block) or 502;
//! 4. otherwise 404.
//!
//! A request from a peer never makes this node ask further peers: the worst a
//! disagreement about membership costs is a 404 and a requester that goes on to the next
//! peer or the origin, never a loop. Local reads and the origin fetch run on blocking
//! threads; the origin fetch is not tied to the request, so a requester that goes away
//! does not cancel the fetch for the others (or the copy this node keeps).
//!
//! `GET /dart/v1/health` answers `{"node":"<id>"}` without authentication.
//!
//! Errors become responses in one place: [`ServeError`]'s `IntoResponse`.

use std::io;
use std::sync::Arc;
use std::time::SystemTime;

use axum::Router;
use axum::body::Body;
use axum::extract::{OriginalUri, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use fastbox_artifact::Digest;

use crate::auth::{AuthError, NODE_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, verify};
use crate::counters::Counters;
use crate::flight::{Flight, FlightFailure, Joined, Progress};
use crate::node::NodeCore;
use crate::protocol::{BLOCK_ROUTE, HEALTH_PATH, LOCAL_ONLY_QUERY};

/// The state the peer server runs on: a handle on its node, from
/// [`crate::Delivery::peer_state`]. Cheap to clone.
#[derive(Clone)]
pub struct PeerState {
    pub(crate) core: Arc<NodeCore>,
}

/// Why a block request was not answered with the block.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The request is not authentic (401).
    #[error("unauthorized: {0}")]
    Unauthorized(#[from] AuthError),
    /// The path does not name a digest (400).
    #[error("{0:?} is not a block digest")]
    BadDigest(String),
    /// This node does not hold the block and will not fetch it (404).
    #[error("block {0} is not held here")]
    NotHeld(Digest),
    /// This node owns the block, but the origin has no such block (404).
    #[error("the origin has no block {0}")]
    OriginNotFound(Digest),
    /// This node's origin fetch failed before its first byte (502).
    #[error("the origin fetch of block {digest} failed: {message}")]
    OriginFailed {
        /// The block.
        digest: Digest,
        /// What happened.
        message: String,
    },
    /// A blocking task failed (500).
    #[error("internal error: {0}")]
    Internal(String),
}

impl ServeError {
    fn origin(digest: Digest, failure: FlightFailure) -> Self {
        match failure {
            FlightFailure::NotFound => ServeError::OriginNotFound(digest),
            other => ServeError::OriginFailed {
                digest,
                message: other.to_string(),
            },
        }
    }
}

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let status = match &self {
            ServeError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ServeError::BadDigest(_) => StatusCode::BAD_REQUEST,
            ServeError::NotHeld(_) => StatusCode::NOT_FOUND,
            ServeError::OriginNotFound(_) => StatusCode::NOT_FOUND,
            ServeError::OriginFailed { .. } => StatusCode::BAD_GATEWAY,
            ServeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status.is_server_error() || status == StatusCode::UNAUTHORIZED {
            tracing::warn!(status = status.as_u16(), error = %self, "peer request refused");
        }
        (status, self.to_string()).into_response()
    }
}

/// The peer server's routes. Serve them with [`crate::PeerServer`] or mount them in another
/// axum server (at the root: requests are signed over their full path).
pub fn router(state: PeerState) -> Router {
    Router::new()
        .route(BLOCK_ROUTE, get(get_block))
        .route(HEALTH_PATH, get(health))
        .with_state(state)
}

async fn health(State(state): State<PeerState>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        format!("{{\"node\":\"{}\"}}", state.core.id),
    )
        .into_response()
}

async fn get_block(
    State(state): State<PeerState>,
    Path(digest): Path<String>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
) -> Result<Response, ServeError> {
    let core = state.core;
    let path_and_query = uri.path_and_query().map_or(uri.path(), |pq| pq.as_str());
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let requester = verify(
        &core.secret,
        core.max_skew,
        path_and_query,
        [
            header(NODE_HEADER),
            header(TIMESTAMP_HEADER),
            header(SIGNATURE_HEADER),
        ],
        SystemTime::now(),
    )?;
    let digest = Digest::from_hex(&digest).map_err(|_| ServeError::BadDigest(digest))?;
    let local_only = uri
        .query()
        .is_some_and(|q| q.split('&').any(|pair| pair == LOCAL_ONLY_QUERY));
    tracing::debug!(block = %digest, peer = %requester, local_only, "block request");

    let blocks = core.blocks.clone();
    // `has_local` first: a probe for a block not held must not read (or count a cache miss).
    let local = tokio::task::spawn_blocking(move || {
        blocks
            .has_local(&digest)
            .then(|| blocks.get_local(&digest))
            .flatten()
    })
    .await
    .map_err(|e| ServeError::Internal(e.to_string()))?;
    if let Some(bytes) = local {
        Counters::bump(&core.counters.peer_served);
        return Ok(block_response(Body::from(bytes)));
    }
    if local_only || !core.is_owner(&digest) {
        return Err(ServeError::NotHeld(digest));
    }

    let flight = match core.flights.join(&digest) {
        Joined::Existing(flight) => flight,
        Joined::Started(flight) => {
            let (flights, driven) = (core.flights.clone(), flight.clone());
            // Detached: the fetch completes (and the block is kept) even if this request goes.
            drop(tokio::task::spawn_blocking(move || flights.drive(&driven)));
            flight
        }
    };
    flight
        .first_byte()
        .await
        .map_err(|failure| ServeError::origin(digest, failure))?;
    Counters::bump(&core.counters.peer_served);
    Ok(block_response(Body::from_stream(stream_flight(flight))))
}

fn block_response(body: Body) -> Response {
    ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
}

/// The flight's bytes as a body stream: what has arrived, then each new piece; an error
/// item (which aborts the response) if the fetch fails.
fn stream_flight(
    flight: Arc<Flight>,
) -> impl futures::Stream<Item = Result<bytes::Bytes, io::Error>> + Send {
    futures::stream::unfold(Some((flight, 0usize)), |state| async move {
        let (flight, offset) = state?;
        match flight.next_chunk(offset).await {
            Progress::Bytes(piece) => {
                let next = offset + piece.len();
                Some((Ok(piece), Some((flight, next))))
            }
            Progress::Done => None,
            Progress::Failed(failure) => Some((
                Err(io::Error::other(format!(
                    "the origin fetch of block {} failed: {failure}",
                    flight.digest()
                ))),
                None,
            )),
        }
    })
}
