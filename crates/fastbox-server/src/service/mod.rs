//! The lifecycle service: sandbox records, their state machine, and the tasks that converge
//! them (create, delete, expiry, recovery after a restart), and live egress policy changes.

mod access;
mod answers;
mod artifact_refs;
mod converge;
mod egress;
mod execd_logs;
mod follow;
mod history;
pub mod idempotency;
mod isolated_sessions;
mod lifecycle;
pub mod local_images;
mod membership;
pub mod plan;
mod snapshots;
mod templates;
pub mod volumes;

pub use lifecycle::{EndpointQuery, Health, Lifecycle, ListQuery, random_token};
pub use membership::NODE_LOST;
pub use snapshots::{MAX_FORK, SnapshotQuery};
