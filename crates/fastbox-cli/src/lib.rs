//! The `fastbox` command line as a library, so integration tests drive the same code.

pub mod artifacts;
pub mod bench;
pub mod bench_create;
pub mod bench_lazy;
pub mod bench_memory;
pub mod bench_runc;
pub mod bench_snapshot;
pub mod client;
pub mod node;
pub mod paths;
pub mod plaintext;
pub mod route_key;
pub mod sandbox_run;
pub mod scenario_net;
pub mod scenario_origin;
pub mod state;
pub mod up;
pub mod verify_cluster;
pub mod verify_p2p;
pub mod volume;

pub use fastbox_fastlet::execd_client;
/// One sandbox on this host without a server (kept under its old name for the CLI's users).
pub use fastbox_fastlet::host as local_sandbox;
