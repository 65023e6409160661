//! What a node's reading side ([`crate::Delivery`]) and serving side ([`crate::router`])
//! share: its id, the current membership, its local blocks, the origin single flight, the
//! counters and the authentication settings.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use fastbox_artifact::Digest;

use crate::auth::GroupSecret;
use crate::counters::Counters;
use crate::flight::OriginFlights;
use crate::membership::{Membership, NodeId};
use crate::node_blocks::NodeBlocks;

/// One node's shared state.
pub(crate) struct NodeCore {
    pub(crate) id: NodeId,
    membership: RwLock<Arc<Membership>>,
    pub(crate) blocks: Arc<dyn NodeBlocks>,
    pub(crate) flights: Arc<OriginFlights>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) secret: GroupSecret,
    pub(crate) max_skew: Duration,
}

impl NodeCore {
    pub(crate) fn new(
        id: NodeId,
        membership: Membership,
        blocks: Arc<dyn NodeBlocks>,
        flights: Arc<OriginFlights>,
        counters: Arc<Counters>,
        secret: GroupSecret,
        max_skew: Duration,
    ) -> Self {
        NodeCore {
            id,
            membership: RwLock::new(Arc::new(membership)),
            blocks,
            flights,
            counters,
            secret,
            max_skew,
        }
    }

    /// The current membership (a snapshot: a concurrent replacement does not change it).
    pub(crate) fn membership(&self) -> Arc<Membership> {
        self.membership
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replace the membership.
    pub(crate) fn set_membership(&self, membership: Membership) {
        *self.membership.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(membership);
    }

    /// Whether this node owns `digest` under the current membership.
    pub(crate) fn is_owner(&self, digest: &Digest) -> bool {
        self.membership()
            .owner(digest)
            .is_some_and(|owner| owner.id == self.id)
    }
}
