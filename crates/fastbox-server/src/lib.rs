//! fastbox-server: the OpenSandbox lifecycle API, the sandbox state machine and its
//! reconcilers, and the embedded state store. It reaches nodes only through
//! `fastbox-node-api`; the `fastbox` binary wires a node in (`fastbox up`: the in-process
//! one).

pub mod artifact_gc;
pub mod cluster;
pub mod config;
pub mod error;
pub mod http;
pub mod metrics;
pub mod nodes;
pub mod record;
pub mod service;
pub mod store;
