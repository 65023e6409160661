//! Cgroup limits (v1 and v2): cpu, memory, pids, plus freezing, killing and accounting.
//!
//! A sandbox's cgroup is `{prefix}/{id}` under each hierarchy fastbox uses: on cgroup v1 the
//! `cpu`, `cpuacct`, `cpuset`, `memory`, `pids`, `freezer` and `devices` controllers (each
//! mounted on its own or co-mounted, as `mountinfo` says), on v2 the one unified directory.
//! The prefix is the fastbox instance's (host-wide names carry it, so leaks can be found and
//! instances cannot collide); it may have several components (`fastbox/slots`).
//!
//! **The kernel seam** is the cgroup filesystem itself: [`CgroupRoot::detect`] finds the real
//! mounts, [`CgroupRoot::at`] points at any directory shaped like them. Unit tests run against
//! a temporary directory (no root needed); on a directory that is not a cgroup filesystem,
//! files are created on write and removed before `rmdir`, which is the only difference.
//! `tests/cgroup_privileged.rs` runs the same code against the real kernel.
//!
//! What a sandbox starter must do, in order:
//! 1. [`Cgroup::create`] with the limits (before any sandbox process exists).
//! 2. Put the first sandbox process in **before** it unshares its cgroup namespace
//!    (`CLONE_NEWCGROUP` makes the *current* cgroup the namespace's root) and before it
//!    forks anything: from the parent with [`Cgroup::add_pid`] while the child waits, or from
//!    the child itself in `pre_exec` / after `fork` with [`ProcsFiles::join_current`] on files
//!    opened beforehand with [`Cgroup::open_procs`] (async-signal-safe, no allocation).
//! 3. Children inherit the cgroup; nothing else to do. CRIU restores into the same files
//!    ([`Cgroup::procs_files`]) or uses [`Cgroup::criu_cgroup_roots`].
//! 4. Teardown: [`Cgroup::kill_all`], then [`Cgroup::remove`].
//!
//! Limits: memory has no swap (v1 `memory.memsw.limit_in_bytes` = limit when swap accounting
//! exists, v2 `memory.swap.max` = 0) and the OOM killer stays on, killing inside the group
//! only (the v2 `memory.oom.group` stays 0, so one OOM does not take execd down with the
//! workload; execd protects itself with `oom_score_adj`).
//!
//! Devices: a sandbox may create device nodes but read and write only the standard
//! pseudo-devices ([`DEVICE_RULES`]); opening any other node is `EPERM`, whatever an image
//! ships. On v1 the devices controller enforces it (`devices.deny a`, then the rules in
//! `devices.allow`); v2 has no file interface for it, so the same rules are compiled into a
//! BPF program of type `BPF_PROG_TYPE_CGROUP_DEVICE` attached to the sandbox's cgroup
//! (`device_bpf.rs`; it needs no controller, so it works on a unified hierarchy without any;
//! attaching again leaves one program; a stand-in directory gets none). The sandbox's mounts
//! are also `nodev` (`rootfs.rs`, `init/mounts.rs`): two locks, either enough on its own.

mod device_bpf;
mod fs;
mod group;
mod root;

#[cfg(test)]
mod tests;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use group::{Cgroup, CriuCgroupRoot, ProcsFiles};
pub use root::{CgroupRoot, leaked, remove_prefix};

/// Which cgroup interface the host offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupVersion {
    /// One hierarchy per controller (or per co-mounted group of controllers).
    V1,
    /// The unified hierarchy.
    V2,
}

// The limits of one sandbox and the smallest cpu limit: defined in `fastbox_api::limits`
// (the server decides them without the runtime), applied here.
pub use fastbox_api::limits::{CgroupLimits, MIN_CPU_MILLIS};

/// The CFS period fastbox uses, in microseconds (the kernel's default).
pub const CPU_PERIOD_US: u64 = 100_000;

/// Device access a sandbox cgroup allows after denying everything, in the v1 `devices.allow`
/// syntax (`TYPE MAJOR:MINOR ACCESS`; on v2 compiled to the cgroup's BPF device program):
/// creating nodes (`m`) of any kind, and reading and writing only the pseudo-devices every
/// Linux userland expects (as runc's default).
pub const DEVICE_RULES: &[&str] = &[
    "c *:* m",
    "b *:* m",
    "c 1:3 rwm",   // /dev/null
    "c 1:5 rwm",   // /dev/zero
    "c 1:7 rwm",   // /dev/full
    "c 1:8 rwm",   // /dev/random
    "c 1:9 rwm",   // /dev/urandom
    "c 5:0 rwm",   // /dev/tty
    "c 5:2 rwm",   // /dev/ptmx
    "c 136:* rwm", // /dev/pts/*
];

/// A cgroup controller fastbox manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Controller {
    Cpu,
    Cpuacct,
    Cpuset,
    Memory,
    Pids,
    Freezer,
    Devices,
}

impl Controller {
    /// Every controller fastbox uses on cgroup v1.
    pub const V1: [Controller; 7] = [
        Controller::Cpu,
        Controller::Cpuacct,
        Controller::Cpuset,
        Controller::Memory,
        Controller::Pids,
        Controller::Freezer,
        Controller::Devices,
    ];

    /// The controllers fastbox enables on cgroup v2 (freezing is built in there, cpuacct is
    /// part of cpu, devices is BPF).
    pub const V2: [Controller; 3] = [Controller::Cpu, Controller::Memory, Controller::Pids];

    pub fn name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
            Controller::Cpuset => "cpuset",
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Freezer => "freezer",
            Controller::Devices => "devices",
        }
    }

    pub fn from_name(name: &str) -> Option<Controller> {
        Controller::V1.into_iter().find(|c| c.name() == name)
    }
}

impl std::fmt::Display for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("no usable cgroup filesystem (read {})", path.display())]
    NotMounted { path: PathBuf },
    #[error("cgroup controller {controller} is not available under {}", root.display())]
    ControllerMissing {
        controller: Controller,
        root: PathBuf,
    },
    #[error("invalid cgroup name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("cgroup {} already exists", path.display())]
    Exists { path: PathBuf },
    #[error("invalid {what} limit {value}: {reason}")]
    InvalidLimit {
        what: &'static str,
        value: u64,
        reason: &'static str,
    },
    #[error("{op} {}: not done after {waited:?}", path.display())]
    Timeout {
        op: &'static str,
        path: PathBuf,
        waited: Duration,
    },
    #[error("parse {}: unexpected content {content:?}", path.display())]
    Parse { path: PathBuf, content: String },
    #[error("invalid device rule {rule:?}: {reason}")]
    InvalidDeviceRule { rule: String, reason: &'static str },
    /// A `bpf(2)` call for the cgroup v2 device program failed; `log` is the verifier's log
    /// when the kernel refused to load the program.
    #[error("{op} the device program of {}: {source}{}", path.display(), verifier_log(log))]
    DeviceProgram {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
        log: String,
    },
}

fn verifier_log(log: &str) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!(" (verifier log: {log})")
    }
}
