//! [`Delivery`]: a node's artifact store, reading blocks through its delivery group.
//!
//! A block read goes, in order:
//! 1. **local** ([`NodeBlocks::get_local`]): a cache hit;
//! 2. **the owner**, when another node owns the block (rendezvous over the current
//!    membership): it answers from its blocks or fetches the block from the origin once
//!    for the whole group and streams it while still receiving;
//! 3. **the other members that hold it**, in rank order, asked with `?local=1` (also when
//!    this node is the owner: after a membership change a peer may hold a block its new
//!    owner does not; each such ask that finds nothing is one small 404);
//! 4. **the origin**, through the node's single flight, which the peer server shares: if
//!    this node is the owner, that is the group's one origin fetch of the block; otherwise
//!    it is a fallback (`fallbacks_to_origin`).
//!
//! Peers whose circuit breaker is open are skipped; a failed request is logged, counted and
//! recorded on the peer's breaker, and the next source is tried. Every block from a peer or
//! the origin is verified against its digest before use (`bytes_verified`) and kept
//! locally. Concurrent reads of one missing block on one node share one trip (a read
//! flight); the origin fetch is further shared with the peer server's requesters.
//!
//! Everything else (puts, manifests, the index, listings, deletes) goes to the origin.
//! Manifests are not cached: they are small, read once per restore, and the origin is the
//! authority on which still exist (garbage collection deletes them).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fastbox_artifact::{
    ArtifactStore, Digest, IndexCreate, IndexKey, StoreError, Stored, StoredObject,
};

use crate::auth::{DEFAULT_MAX_SKEW, GroupSecret};
use crate::breaker::{BreakerConfig, Breakers, Recorded};
use crate::client::{PeerClient, PeerTimeouts};
use crate::counters::{CounterSnapshot, Counters};
use crate::flight::{Flight, FlightFailure, FlightTable, OriginFlights, Sourced};
use crate::membership::{Member, Membership, NodeId};
use crate::node::NodeCore;
use crate::node_blocks::NodeBlocks;
use crate::protocol::FetchMode;
use crate::server::PeerState;

/// How a node takes part in its delivery group.
#[derive(Debug, Clone)]
pub struct DartConfig {
    /// This node's id (it owns blocks only if it is in `members` under this id).
    pub node: NodeId,
    /// The group, this node included.
    pub members: Membership,
    /// The group secret.
    pub secret: GroupSecret,
    /// Peer request timeouts.
    pub timeouts: PeerTimeouts,
    /// Per-peer circuit breakers.
    pub breaker: BreakerConfig,
    /// Largest accepted clock distance of a signed request (default 60 s).
    pub max_skew: Duration,
}

impl DartConfig {
    /// A configuration with the default timeouts, breaker and skew.
    pub fn new(node: NodeId, members: Membership, secret: GroupSecret) -> Self {
        DartConfig {
            node,
            members,
            secret,
            timeouts: PeerTimeouts::default(),
            breaker: BreakerConfig::default(),
            max_skew: DEFAULT_MAX_SKEW,
        }
    }
}

/// A node's view of the artifact store: its own blocks, its peers', then the origin.
pub struct Delivery {
    core: Arc<NodeCore>,
    origin: Arc<dyn ArtifactStore>,
    client: PeerClient,
    breakers: Breakers,
    reads: FlightTable,
}

impl Delivery {
    /// A node reading through `blocks` (what it holds), its peers, and `origin`.
    pub fn new(
        config: DartConfig,
        blocks: Arc<dyn NodeBlocks>,
        origin: Arc<dyn ArtifactStore>,
    ) -> Self {
        let counters = Arc::new(Counters::default());
        let flights = Arc::new(OriginFlights::new(
            origin.clone(),
            blocks.clone(),
            counters.clone(),
        ));
        let client = PeerClient::new(config.node.clone(), config.secret.clone(), config.timeouts);
        let core = NodeCore::new(
            config.node,
            config.members,
            blocks,
            flights,
            counters,
            config.secret,
            config.max_skew,
        );
        Delivery {
            core: Arc::new(core),
            origin,
            client,
            breakers: Breakers::new(config.breaker),
            reads: FlightTable::default(),
        }
    }

    /// This node's id.
    pub fn node(&self) -> &NodeId {
        &self.core.id
    }

    /// The state the peer server of this node runs on (see [`crate::router`]).
    pub fn peer_state(&self) -> PeerState {
        PeerState {
            core: self.core.clone(),
        }
    }

    /// The current membership.
    pub fn members(&self) -> Arc<Membership> {
        self.core.membership()
    }

    /// Replace the membership (nodes joined or left). Reads already running finish with the
    /// list they started with; the breakers of members that left are forgotten.
    pub fn set_members(&self, members: Membership) {
        self.breakers.retain(|peer| members.get(peer).is_some());
        self.core.set_membership(members);
    }

    /// The counters now.
    pub fn counters(&self) -> CounterSnapshot {
        self.core.counters.snapshot()
    }

    /// The counters as Prometheus text lines labelled with this node's id.
    pub fn metrics_text(&self) -> String {
        self.counters().to_prometheus(&self.core.id)
    }

    /// Whether the breaker of `peer` is open (or half-open) now.
    pub fn breaker_open(&self, peer: &NodeId) -> bool {
        self.breakers.is_open(peer)
    }

    /// Ask one peer; `Some` only for a verified block (which is then kept locally).
    fn ask_peer(&self, peer: &Member, digest: &Digest, mode: FetchMode) -> Option<Vec<u8>> {
        let counters = &self.core.counters;
        if !self.breakers.allow(&peer.id, Instant::now()) {
            return None;
        }
        match self.client.fetch(peer, digest, mode) {
            Ok(Some(bytes)) => {
                self.breakers.record_success(&peer.id);
                Counters::bump(&counters.peer_fetches);
                Counters::add(&counters.bytes_verified, bytes.len() as u64);
                self.core.blocks.insert_local(digest, &bytes);
                Some(bytes)
            }
            Ok(None) => {
                self.breakers.record_success(&peer.id);
                None
            }
            Err(e) => {
                tracing::warn!(node = %self.core.id, peer = %peer.id, block = %digest, error = %e, "peer fetch failed");
                Counters::bump(&counters.peer_failures);
                if self.breakers.record_failure(&peer.id, Instant::now()) == Recorded::Tripped {
                    tracing::warn!(node = %self.core.id, peer = %peer.id, "peer breaker opened");
                    Counters::bump(&counters.breaker_trips);
                }
                None
            }
        }
    }

    /// The block from this node's own blocks (a cache hit).
    fn read_local(&self, digest: &Digest) -> Option<Vec<u8>> {
        let bytes = self.core.blocks.get_local(digest)?;
        Counters::bump(&self.core.counters.cache_hits);
        Some(bytes)
    }

    /// A block this node does not hold: from the peers, else the origin. It is kept locally:
    /// a peer's copy before this returns, the origin's by its flight right after it ends.
    fn fetch_missing(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        let membership = self.core.membership();
        let ranked = membership.ranked(digest);
        for (rank, peer) in ranked.iter().enumerate() {
            if peer.id == self.core.id {
                continue;
            }
            let mode = if rank == 0 {
                FetchMode::AsOwner
            } else {
                FetchMode::LocalOnly
            };
            if let Some(bytes) = self.ask_peer(peer, digest, mode) {
                return Ok(bytes);
            }
        }
        if ranked.first().is_some_and(|owner| owner.id != self.core.id) {
            Counters::bump(&self.core.counters.fallbacks_to_origin);
        }
        self.core.flights.fetch(digest)
    }
}

impl ArtifactStore for Delivery {
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError> {
        self.origin.put_block(digest, bytes)
    }

    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.read_local(digest) {
            return Ok(bytes);
        }
        let source = |flight: &Flight| {
            // The previous read flight may have kept the block since we looked.
            let (bytes, sourced) = match self.read_local(digest) {
                Some(bytes) => (bytes, Sourced::AlreadyKept),
                None => (
                    self.fetch_missing(digest)
                        .map_err(|e| FlightFailure::from_store(&e))?,
                    Sourced::Fetched,
                ),
            };
            flight.append(&bytes);
            Ok(sourced)
        };
        // fetch_missing keeps the block itself.
        self.reads.fetch(digest, source, |_| {})
    }

    fn has_block(&self, digest: &Digest) -> Result<bool, StoreError> {
        if self.core.blocks.has_local(digest) {
            return Ok(true);
        }
        self.origin.has_block(digest)
    }

    fn delete_block(&self, digest: &Digest) -> Result<(), StoreError> {
        self.origin.delete_block(digest)
    }

    fn list_blocks(&self) -> Result<Vec<StoredObject>, StoreError> {
        self.origin.list_blocks()
    }

    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError> {
        self.origin.put_manifest(bytes)
    }

    fn get_manifest(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.origin.get_manifest(digest)
    }

    fn has_manifest(&self, digest: &Digest) -> Result<bool, StoreError> {
        self.origin.has_manifest(digest)
    }

    fn delete_manifest(&self, digest: &Digest) -> Result<(), StoreError> {
        self.origin.delete_manifest(digest)
    }

    fn list_manifests(&self) -> Result<Vec<StoredObject>, StoreError> {
        self.origin.list_manifests()
    }

    fn index_create_if_absent(
        &self,
        key: &IndexKey,
        digest: &Digest,
    ) -> Result<IndexCreate, StoreError> {
        self.origin.index_create_if_absent(key, digest)
    }

    fn index_get(&self, key: &IndexKey) -> Result<Option<Digest>, StoreError> {
        self.origin.index_get(key)
    }

    fn index_delete(&self, key: &IndexKey) -> Result<(), StoreError> {
        self.origin.index_delete(key)
    }

    fn list_index(&self) -> Result<Vec<(IndexKey, Digest)>, StoreError> {
        self.origin.list_index()
    }
}
