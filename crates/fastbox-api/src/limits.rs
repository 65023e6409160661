//! What a sandbox is given, as the node applies it: its cgroup limits, the defaults of a
//! create that names none, the fixed port of its execd, and the default threshold of lazy
//! restores.
//!
//! These are decided by the lifecycle server and applied by the runtime
//! (`fastbox_runtime::cgroup`, `fastbox_runtime::spec`, which re-export them at their old
//! paths) or, the lazy threshold, by the node agent (`fastbox_fastlet` re-exports it); they
//! live here so the server needs nothing of the runtime or the node agent to decide them.

use serde::{Deserialize, Serialize};

/// The execd port inside every sandbox (OpenSandbox `DEFAULT_EXECD_PORT`).
pub const EXECD_PORT: u16 = 44772;

/// Default writable-layer size when the request names none (sparse: costs nothing unused).
pub const DEFAULT_DISK_BYTES: u64 = 10 * 1024 * 1024 * 1024;

/// Default pids limit: a fork bomb stops here.
pub const DEFAULT_PIDS: u64 = 1024;

/// The default of the node's `lazy_restore_min_bytes` (`FastletConfig::lazy_restore_min_bytes`;
/// the server's `lazy_restore_min_mib`): clones of a snapshot and resumes whose checkpoint's
/// pages images hold at least this many bytes start before their memory is in place. Below
/// it a whole restore takes about as long as a lazy one's set-up.
pub const DEFAULT_LAZY_RESTORE_MIN_BYTES: u64 = 64 << 20;

/// The limits of one sandbox. `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CgroupLimits {
    /// CPU time per wall-clock time in thousandths of a CPU (`500` = half a CPU), enforced
    /// with a 100 ms period. At least [`MIN_CPU_MILLIS`].
    pub cpu_millis: Option<u64>,
    /// Memory (RAM; no swap) in bytes; the OOM killer acts inside the group beyond it.
    pub memory_bytes: Option<u64>,
    /// Number of tasks (processes and threads).
    pub pids: Option<u64>,
}

/// The smallest cpu limit: the kernel refuses quotas below 1 ms per period.
pub const MIN_CPU_MILLIS: u64 = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_default_to_unlimited_and_refuse_unknown_fields() {
        let all: CgroupLimits = serde_json::from_str("{}").unwrap();
        assert_eq!(all, CgroupLimits::default());
        let some: CgroupLimits = serde_json::from_str(r#"{"pids":64,"cpu_millis":500}"#).unwrap();
        assert_eq!(
            some,
            CgroupLimits {
                cpu_millis: Some(500),
                memory_bytes: None,
                pids: Some(64),
            }
        );
        assert!(serde_json::from_str::<CgroupLimits>(r#"{"swap":1}"#).is_err());
    }
}
