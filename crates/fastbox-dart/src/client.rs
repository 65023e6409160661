//! The blocking client a node uses to ask its peers for blocks.
//!
//! Built on `ureq`, a small synchronous HTTP client with no async runtime inside: the
//! [`ArtifactStore`](fastbox_artifact::ArtifactStore) trait is synchronous and is called
//! from plain threads, `spawn_blocking` threads and threads that also run a tokio runtime's
//! peer server, and `reqwest::blocking` must not be created or dropped inside a runtime (it
//! starts and owns one of its own). `ureq` also has the per-phase timeouts this needs:
//! connect, first byte (the response head; the server answers only once it has the
//! block's first byte), stall (longest wait for any single read) and total. It never reads
//! proxy settings from the environment here (`proxy(None)`): peers are addressed directly.
//!
//! Every request is signed ([`crate::auth`]). The body is passed to a sink as it arrives,
//! capped at [`BLOCK_SIZE`], and its digest is checked when it ends: a caller must discard
//! what the sink was given when the call fails.

use std::io::{self, Read};
use std::time::{Duration, SystemTime};

use fastbox_artifact::{BLOCK_SIZE, Digest};

use crate::auth::{GroupSecret, sign};
use crate::membership::{Member, NodeId};
use crate::protocol::{FetchMode, block_path};

/// Size of the buffer a body is read through.
const READ_BUF: usize = 64 * 1024;

/// How long a peer request may take, phase by phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerTimeouts {
    /// Establishing the TCP connection (default 1 s).
    pub connect: Duration,
    /// From the request sent to the response head, which the server sends with the first
    /// byte of the block (default 5 s: an owner may be waiting on its origin).
    pub first_byte: Duration,
    /// Longest wait for any single read of the body (default 5 s).
    pub stall: Duration,
    /// The whole request, body included (default 30 s).
    pub total: Duration,
}

impl Default for PeerTimeouts {
    fn default() -> Self {
        PeerTimeouts {
            connect: Duration::from_secs(1),
            first_byte: Duration::from_secs(5),
            stall: Duration::from_secs(5),
            total: Duration::from_secs(30),
        }
    }
}

/// Why a request to a peer failed. "Not held" (404) is not a failure.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// Connecting, sending, a timeout, or the response head.
    #[error("peer {peer}: {source}")]
    Transport {
        /// The peer asked.
        peer: NodeId,
        /// What ureq reported.
        source: Box<ureq::Error>,
    },
    /// A status other than 200 and 404.
    #[error("peer {peer} answered {status}")]
    Status {
        /// The peer asked.
        peer: NodeId,
        /// The HTTP status.
        status: u16,
    },
    /// The body broke off or a read timed out.
    #[error("peer {peer}: reading the block: {source}")]
    Body {
        /// The peer asked.
        peer: NodeId,
        /// What the read reported.
        source: io::Error,
    },
    /// More than a block's worth of bytes.
    #[error("peer {peer} sent more than the block size ({BLOCK_SIZE} bytes)")]
    TooLarge {
        /// The peer asked.
        peer: NodeId,
    },
    /// The body does not hash to the digest asked for.
    #[error("peer {peer} sent bytes hashing to {actual}, not to {expected}")]
    Corrupt {
        /// The peer asked.
        peer: NodeId,
        /// The digest asked for.
        expected: Digest,
        /// What the bytes hash to.
        actual: Digest,
    },
    /// The caller's sink refused the bytes.
    #[error("passing on bytes from peer {peer}: {source}")]
    Sink {
        /// The peer asked.
        peer: NodeId,
        /// What the sink reported.
        source: io::Error,
    },
}

/// A signed, timed, verifying client of peer servers.
#[derive(Debug, Clone)]
pub struct PeerClient {
    agent: ureq::Agent,
    node: NodeId,
    secret: GroupSecret,
}

impl PeerClient {
    /// A client that signs as `node` with `secret`.
    pub fn new(node: NodeId, secret: GroupSecret, timeouts: PeerTimeouts) -> Self {
        let agent = ureq::Agent::config_builder()
            .proxy(None)
            .http_status_as_error(false)
            .max_redirects(0)
            .timeout_connect(Some(timeouts.connect))
            .timeout_recv_response(Some(timeouts.first_byte))
            .timeout_per_read(Some(timeouts.stall))
            .timeout_global(Some(timeouts.total))
            .build()
            .new_agent();
        PeerClient {
            agent,
            node,
            secret,
        }
    }

    /// Ask `peer` for a block, passing its bytes to `sink` as they arrive. `Ok(None)`: the
    /// peer does not hold it; `Ok(Some(len))`: all `len` bytes passed and verified.
    pub fn stream(
        &self,
        peer: &Member,
        digest: &Digest,
        mode: FetchMode,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<Option<u64>, PeerError> {
        let path = block_path(digest, mode);
        let signed = sign(&self.secret, &self.node, &path, SystemTime::now());
        let mut request = self.agent.get(format!("{}{path}", peer.base_url()));
        for (name, value) in signed.pairs() {
            request = request.header(name, value);
        }
        let transport = |source| PeerError::Transport {
            peer: peer.id.clone(),
            source: Box::new(source),
        };
        let response = request.call().map_err(transport)?;
        match response.status().as_u16() {
            200 => {}
            404 => return Ok(None),
            status => {
                return Err(PeerError::Status {
                    peer: peer.id.clone(),
                    status,
                });
            }
        }
        let mut body = response.into_body().into_reader();
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; READ_BUF];
        let mut len = 0usize;
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(PeerError::Body {
                        peer: peer.id.clone(),
                        source,
                    });
                }
            };
            len += n;
            if len > BLOCK_SIZE {
                return Err(PeerError::TooLarge {
                    peer: peer.id.clone(),
                });
            }
            hasher.update(&buf[..n]);
            sink(&buf[..n]).map_err(|source| PeerError::Sink {
                peer: peer.id.clone(),
                source,
            })?;
        }
        let actual = Digest::from(hasher.finalize());
        if actual != *digest {
            return Err(PeerError::Corrupt {
                peer: peer.id.clone(),
                expected: *digest,
                actual,
            });
        }
        Ok(Some(len as u64))
    }

    /// Ask `peer` for a whole block: `Ok(None)` when it does not hold it.
    pub fn fetch(
        &self,
        peer: &Member,
        digest: &Digest,
        mode: FetchMode,
    ) -> Result<Option<Vec<u8>>, PeerError> {
        let mut bytes = Vec::new();
        let fetched = self.stream(peer, digest, mode, &mut |piece| {
            bytes.extend_from_slice(piece);
            Ok(())
        })?;
        Ok(fetched.map(|_| bytes))
    }
}
