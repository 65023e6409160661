//! fastbox-api: wire types only (serde, no I/O).

pub mod lifecycle;
pub mod metadata;
pub mod quantity;
pub mod templates;
