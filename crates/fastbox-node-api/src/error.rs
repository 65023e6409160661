//! A node's refusal or failure, as the server sees it: a kind (what the server does about
//! it; the server maps kinds to API errors in one place) and the node's message.

use serde::{Deserialize, Serialize};

/// What went wrong on (or on the way to) a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct NodeError {
    pub kind: NodeErrorKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeErrorKind {
    /// No free slot: refused before any side effect (another node may take it).
    NoCapacity,
    /// The image reference is malformed, or the image cannot be had.
    BadImage,
    /// The sandbox or checkpoint named is not on this node.
    NotFound,
    /// The operation was tried and failed; the message says how.
    Failed,
    /// The node could not be reached, or did not answer in time: whether the operation
    /// happened is unknown (never a reason to place the sandbox elsewhere).
    Unreachable,
}

impl NodeError {
    pub fn new(kind: NodeErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(NodeErrorKind::Failed, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(NodeErrorKind::NotFound, message)
    }
}

pub type NodeResult<T> = Result<T, NodeError>;
