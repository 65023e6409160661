//! What a sandbox start needs, decided by the caller: the runtime takes no decisions of
//! policy, it only applies a spec.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::cgroup::CgroupLimits;

// The execd port and the defaults of a create (disk, pids): defined in `fastbox_api::limits`
// (the server decides them without the runtime).
pub use fastbox_api::limits::{DEFAULT_DISK_BYTES, DEFAULT_PIDS, EXECD_PORT};

/// Where the execd binary appears inside the sandbox (a read-only bind mount).
pub const EXECD_SANDBOX_PATH: &str = "/.fastbox/execd";

/// The sandbox start request, already validated and resolved by the caller.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Unique id; appears (with the instance prefix) in every host-wide name.
    pub id: String,
    /// Per-instance prefix of host-wide names (cgroups, netns, veths, nft tables).
    pub prefix: String,
    /// The unpacked image rootfs: the overlay's read-only lower layer.
    pub lower: PathBuf,
    /// The sandbox's own directory (writable layer, mount points, logs).
    pub dir: PathBuf,
    /// Hostname inside the sandbox's UTS namespace.
    pub hostname: String,
    /// Path of the netns file (`/run/netns/NAME`) the sandbox joins.
    pub netns: PathBuf,
    /// `/etc/resolv.conf` contents written into the writable layer, if any.
    pub resolv_conf: Option<String>,
    /// The content-addressed execd binary on the host.
    pub execd: crate::execd_binary::ExecdBinary,
    /// Offer isolated sessions ([`crate::init::InitConfig::isolation`]; execd gets
    /// `--isolation`).
    pub isolation: bool,
    /// Extra arguments given to execd (before `--`).
    pub execd_args: Vec<String>,
    /// The entrypoint execd supervises; empty for none.
    pub entrypoint: Vec<String>,
    /// Environment of execd and the processes it starts (`KEY=VALUE`).
    pub env: Vec<String>,
    /// cgroup limits.
    pub limits: CgroupLimits,
    /// Size of the writable layer in bytes (ENOSPC inside the sandbox beyond it).
    pub disk_bytes: u64,
}
