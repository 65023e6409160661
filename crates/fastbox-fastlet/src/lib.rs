//! fastbox-fastlet: the node agent. It owns this node's capacity (network slots), starts and
//! removes sandboxes with the runtime, re-adopts them after a restart, and serves the node
//! proxy through which clients reach sandbox ports. [`LocalNode`] is it behind the node
//! boundary (`fastbox_node_api::NodeAgent`), as the lifecycle server calls it in process.

pub mod agent;
pub mod artifact;
pub mod background;
pub mod blocking;
pub mod credential_proxy;
pub mod execd_client;
pub mod fence;
pub mod from_artifact;
pub mod host;
pub mod kept_slots;
pub mod local_node;
pub mod memory;
pub mod named_volumes;
pub mod node_proxy;
pub mod node_store;
pub mod object_volumes;
pub mod one_at_a_time;
pub mod phases;
pub mod pool;
pub mod reaper;
pub mod remote_pages;
pub mod slots;
pub mod snapshot;
pub mod spares;
pub mod staging;
pub mod template;
pub mod transfers;
pub mod volumes;
pub mod warmup;

pub use agent::{
    Adoption, Fastlet, FastletConfig, FastletError, PlaceRequest, Placement, RemoveReport, Route,
    SandboxTokens, StartMode, StartReport,
};
/// The default of [`FastletConfig::lazy_restore_min_bytes`], decided with the other limits
/// in `fastbox_api::limits` (so the lifecycle server reads it without this crate).
pub use fastbox_api::limits::DEFAULT_LAZY_RESTORE_MIN_BYTES;
pub use local_node::LocalNode;
