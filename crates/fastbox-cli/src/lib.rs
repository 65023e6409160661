//! The `fastbox` command line as a library, so integration tests drive the same code.

pub mod bench;
pub mod execd_client;
pub mod local_sandbox;
pub mod paths;
pub mod sandbox_run;
