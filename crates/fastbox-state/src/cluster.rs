//! What servers sharing one store coordinate with: leases, claims bound to them, fencing.
//!
//! A server holds a lease ([`Coordinator::grant`], renewed by
//! [`Coordinator::keep_alive`]) and claims names with it: its presence
//! (`servers/ID`), the leadership of the reconcilers (`leader`). A claim goes when its
//! lease runs out, so a server that dies or is cut off loses its claims within the lease's
//! time to live, and another can take them.
//!
//! Leadership comes with a fencing token: the create revision of the `leader` key the leader
//! made. Writes made as the leader carry a [`Fence`]; the store refuses them
//! ([`crate::StateError::Fenced`]) once that key is gone or was made again by another
//! leader, so a leader that was paused or cut off and has not noticed yet can write nothing.
//!
//! Claims live under `PREFIX/_cluster/` (a watch reports them as table
//! [`CLUSTER_TABLE`]); they hold no secrets and are not sealed.

use std::time::Duration;

use crate::{Entry, Revision, StateError};

/// The table a watch reports coordination keys under.
pub const CLUSTER_TABLE: &str = "_cluster";

/// An etcd lease id.
pub type LeaseId = i64;

/// The leader's fencing token: the create revision of the claim `name` it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub name: String,
    pub token: Revision,
}

/// Who holds a claim, after an attempt to take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub value: Vec<u8>,
    /// The claim's create revision (a leader's fencing token).
    pub created: Revision,
    pub lease: LeaseId,
}

pub trait Coordinator: Send + Sync {
    /// A new lease that lives `ttl` unless renewed.
    fn grant(&self, ttl: Duration) -> Result<LeaseId, StateError>;

    /// Renews `lease`; false when it is gone (ran out, or revoked).
    fn keep_alive(&self, lease: LeaseId) -> Result<bool, StateError>;

    /// Ends `lease` now, and every claim bound to it.
    fn revoke(&self, lease: LeaseId) -> Result<(), StateError>;

    /// Claims `name` with `value` for `lease` unless someone holds it; returns the holder
    /// afterwards (this lease's claim, or the other one).
    fn claim(&self, name: &str, value: &[u8], lease: LeaseId) -> Result<Holder, StateError>;

    /// The claims under `prefix` (`servers/`): names relative to the coordination keys,
    /// each with its value and create revision.
    fn claims(&self, prefix: &str) -> Result<Vec<Entry>, StateError>;

    /// The store's current revision (a watch started after a full read goes on from the
    /// next one).
    fn revision(&self) -> Result<Revision, StateError>;

    /// Drops the history before `revision` (watches that lag behind it start over with a
    /// full read).
    fn compact(&self, revision: Revision) -> Result<(), StateError>;
}
