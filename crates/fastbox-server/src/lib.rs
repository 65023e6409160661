//! fastbox-server: the OpenSandbox lifecycle API, the sandbox state machine and its
//! reconcilers, the embedded state store, and `fastbox up` (everything on one machine).

pub mod artifact_gc;
pub mod config;
pub mod error;
pub mod http;
pub mod metrics;
pub mod record;
pub mod service;
pub mod store;
pub mod up;
