//! fastbox-api: wire types only (serde, no I/O).

pub mod quantity;
