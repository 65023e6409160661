//! The kernel interfaces a sandbox does not see: masked in every sandbox's `/proc` and `/sys`
//! by the runtime, and in every isolated session's own `/proc` by execd.

/// Files hidden behind `/dev/null` (runc's default `maskedPaths`, files).
pub const MASKED_FILES: &[&str] = &[
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/latency_stats",
    "/proc/interrupts",
];

/// Directories hidden behind an empty read-only directory (runc's `maskedPaths`,
/// directories; runc mounts an empty tmpfs, but every tmpfs costs a restore a `tar` process,
/// so fastbox binds [`EMPTY_DIR`] read-only instead).
pub const MASKED_DIRS: &[&str] = &[
    "/proc/acpi",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// An empty, read-only directory of the sandbox root, bound over the masked directories.
pub const EMPTY_DIR: &str = "/.fastbox/empty";
