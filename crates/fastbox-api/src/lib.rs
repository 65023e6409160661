//! fastbox-api: wire types only (serde, no I/O).

pub mod egress;
pub mod lifecycle;
pub mod limits;
pub mod metadata;
pub mod net;
pub mod quantity;
pub mod snapshots;
pub mod templates;
