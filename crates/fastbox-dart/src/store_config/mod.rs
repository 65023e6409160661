//! The configuration of a node's artifact store, as operators write it and before anything
//! runs: [`NodeStoreConfig`] (the origin's [`StoreLocation`], the node block cache's budget,
//! the node's [`DartSettings`] if it is in a delivery group).
//!
//! Pure configuration: parsing and checking, no server started and no block read. The one
//! act is [`StoreLocation::open`], which opens the origin. The node agent
//! (`fastbox_fastlet::node_store`) assembles the running layers (block cache, DART delivery,
//! peer server) from a [`NodeStoreConfig`]; the lifecycle server resolves one from its
//! settings without depending on the node agent.

mod dart_settings;
mod location;

pub use dart_settings::{DART_KEY_ENV, DartSettings, DartSettingsError};
pub use location::{LOCAL_STORE_DIR, LocationError, StoreLocation};

/// How a node reaches its artifacts.
#[derive(Debug, Clone)]
pub struct NodeStoreConfig {
    /// The origin.
    pub location: StoreLocation,
    /// Byte budget of the node block cache (a remote origin only).
    pub cache_budget: u64,
    /// The delivery group, if the node is in one (a remote origin only).
    pub dart: Option<DartSettings>,
}
