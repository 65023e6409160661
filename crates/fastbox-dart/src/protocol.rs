//! The peer protocol's paths, shared by the server and the client.
//!
//! ```text
//! GET /dart/v1/blocks/{digest}            the block; the owner fetches it from the origin on a miss
//! GET /dart/v1/blocks/{digest}?local=1    the block only if held locally, else 404
//! GET /dart/v1/health                     200 {"node":"<id>"}; no authentication
//! ```
//!
//! Block requests carry the signature headers of [`crate::auth`]. Answers: 200 with the
//! block's bytes (streamed, possibly chunked), 400 for a malformed digest, 401 for a
//! request that is not authentic, 404 when the block is not held (and this node is not its
//! owner, or `local=1` was asked), 502 when the owner's origin fetch failed before the first
//! byte. A body cut short means the fetch failed mid-way. The requester verifies the digest
//! of the whole body; nothing in the protocol is trusted before that.

use fastbox_artifact::Digest;

/// The route of a block, as axum spells it.
pub const BLOCK_ROUTE: &str = "/dart/v1/blocks/{digest}";
/// The health route.
pub const HEALTH_PATH: &str = "/dart/v1/health";
/// The query that restricts a block request to locally held blocks.
pub const LOCAL_ONLY_QUERY: &str = "local=1";

/// What a block request asks of the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchMode {
    /// The block, fetched from the origin if the peer owns it and does not hold it.
    AsOwner,
    /// The block only if the peer holds it (`?local=1`).
    LocalOnly,
}

/// The path and query of a block request, exactly as signed and sent.
pub fn block_path(digest: &Digest, mode: FetchMode) -> String {
    match mode {
        FetchMode::AsOwner => format!("/dart/v1/blocks/{digest}"),
        FetchMode::LocalOnly => format!("/dart/v1/blocks/{digest}?{LOCAL_ONLY_QUERY}"),
    }
}
