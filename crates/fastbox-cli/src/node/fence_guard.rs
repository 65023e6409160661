//! The self-fencing guard of `fastbox node`: a small process that outlives the node agent
//! and freezes every sandbox of the node ([`fastbox_fastlet::fence`]) when the agent's lease
//! deadline passes without a renewal, even when the agent was killed with SIGKILL. The
//! server may then declare the node lost (its running sandboxes fail, its paused ones resume
//! elsewhere): none runs twice.
//!
//! # Protocol
//!
//! **Start.** The agent runs its own executable as `fastbox node-fence-guard --data-dir DIR
//! --prefix P` (hidden) through [`FenceGuard::spawn`]: in a session of its own (`setsid`, so
//! a signal to the agent's process group, Ctrl-C included, does not reach it), in `/`, with
//! stdin a pipe from the agent, stdout a pipe to the agent and the agent's stderr. The guard
//! opens the node's cgroups, then writes `ready`; `spawn` returns once it has read it (an
//! error otherwise: a node must not run without its guard).
//!
//! **Renewals.** Each time its lease is renewed the agent writes `renew <fence_at>` (Unix
//! milliseconds, [`FenceGuard::renew`]): when the node must be frozen, that is before the
//! lease can expire at the server, with room left for the freeze. Each renewal replaces the
//! deadline, even with an earlier one. The guard converts the deadline once, on receipt, to
//! its monotonic clock and fences when either clock reaches it: a wall clock stepped forward
//! fences early, one stepped back does not delay the fence. After the first renewal the
//! guard writes `armed`. Before it, the guard never fences.
//!
//! **Fencing.** At the deadline the guard freezes every sandbox group of the node's prefix,
//! writes the marker `DATA_DIR/fenced` ([`FencedMarker`], JSON: when, the deadline, what was
//! frozen, what failed), logs it as an error and exits. The marker stays for the next agent
//! start, which warns about it ([`start_for_node`]); reconciliation with the server will use
//! it to thaw what the node still owns.
//!
//! **The agent ends.** End of file on stdin (the agent exited or was killed) and the line
//! `release` (a stop on purpose, [`FenceGuard::release`]) change nothing about a pending
//! deadline: nobody can renew it any more, so the guard fences at it, unless a newer agent
//! takes over first. Without a pending deadline the guard exits at once. Lines after
//! `release` are ignored.
//!
//! **Takeover.** The guard of a data directory holds `flock` on `DATA_DIR/fence-guard.lock`,
//! which names it (`<pid> <start time in clock ticks>`). A new agent's guard waits for the
//! lock in the background, guarding from its own first renewal, lock or not. When the new
//! guard has said `armed`, the new agent's first [`FenceGuard::renew`] sends the guard the
//! lock file names (when alive and not its own) `SIGUSR1` through a pidfd, after checking its
//! start time, so a reused pid is never signalled. On `SIGUSR1` a guard exits without
//! fencing, unless its deadline has passed (then it fences: early rather than late). One
//! agent per data directory.
//!
//! **Signals.** `SIGTERM` or `SIGINT` stop the guard: with a pending deadline it fences at
//! once (it could not keep watching), otherwise it exits. `SIGHUP` is ignored. A service
//! manager that stops the node by killing its whole cgroup (systemd's default) thus fences
//! an armed node at its stop; `SIGKILL` alone ends the guard without fencing.
//!
//! Here: the marker, the lock file's identity line and the errors; `handle.rs`: the agent's
//! side ([`FenceGuard`]); `guard.rs`: the guard process ([`run`]).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use fastbox_fastlet::fence::FenceError;
use serde::{Deserialize, Serialize};

mod guard;
mod handle;

pub use guard::{FenceGuardArgs, run};
pub use handle::{FenceGuard, FenceGuardConfig, start_for_node};

/// The hidden subcommand the guard runs as.
pub const SUBCOMMAND: &str = "node-fence-guard";
/// The marker a fence leaves in the data directory.
pub const MARKER_FILE: &str = "fenced";
/// The lock the guard of a data directory holds.
pub const LOCK_FILE: &str = "fence-guard.lock";
/// The longest line either side reads.
const MAX_LINE: usize = 128;

/// Errors say everything in their message (no separate source).
#[derive(Debug, thiserror::Error)]
pub enum FenceGuardError {
    #[error("locate the fastbox executable: {0}")]
    Exe(io::Error),
    #[error("start the fence guard {}: {cause}", exe.display())]
    Spawn { exe: PathBuf, cause: io::Error },
    #[error("the fence guard did not start: {0}")]
    NotReady(String),
    #[error("the fence guard did not confirm the first renewal: {0}")]
    NotArmed(String),
    #[error("write to the fence guard (is it gone?): {0}")]
    Write(io::Error),
    #[error("a fence deadline before 1970")]
    BeforeEpoch,
    #[error("the fence guard: {0}")]
    Cgroups(FenceError),
    #[error("block the guard's signals: {0}")]
    Signals(nix::Error),
    #[error("{what} {}: {cause}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        cause: io::Error,
    },
    #[error("fence marker {}: {cause}", path.display())]
    Marker {
        path: PathBuf,
        cause: serde_json::Error,
    },
}

/// What a fence left in `DATA_DIR/fenced`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FencedMarker {
    /// When the node was frozen (Unix milliseconds).
    pub fenced_at_unix_ms: u64,
    /// The deadline that passed without renewal (Unix milliseconds).
    pub deadline_unix_ms: u64,
    /// How many sandbox groups were frozen.
    pub frozen: usize,
    /// Their names.
    pub sandboxes: Vec<String>,
    /// One line per group that could not be frozen.
    pub errors: Vec<String>,
    /// Why the deadline passed: the agent was running, had ended, or the guard was stopped.
    pub reason: String,
}

impl FencedMarker {
    pub fn path(data_dir: &Path) -> PathBuf {
        data_dir.join(MARKER_FILE)
    }

    /// The marker of a previous fence, if any.
    pub fn read(data_dir: &Path) -> Result<Option<FencedMarker>, FenceGuardError> {
        let path = Self::path(data_dir);
        let text = match fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(cause) => {
                return Err(FenceGuardError::File {
                    what: "read",
                    path,
                    cause,
                });
            }
        };
        serde_json::from_slice(&text)
            .map(Some)
            .map_err(|cause| FenceGuardError::Marker { path, cause })
    }

    /// Writes the marker (mode 0600) through a temporary file renamed into place.
    pub fn write(&self, data_dir: &Path) -> Result<(), FenceGuardError> {
        let path = Self::path(data_dir);
        let tmp = data_dir.join(format!("{MARKER_FILE}.tmp"));
        let file_err = |what, path: &Path| {
            let path = path.to_path_buf();
            move |cause| FenceGuardError::File { what, path, cause }
        };
        let mut text =
            serde_json::to_vec_pretty(self).map_err(|cause| FenceGuardError::Marker {
                path: path.clone(),
                cause,
            })?;
        text.push(b'\n');
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(file_err("create", &tmp))?;
        file.write_all(&text).map_err(file_err("write", &tmp))?;
        file.sync_all().map_err(file_err("sync", &tmp))?;
        fs::rename(&tmp, &path).map_err(file_err("rename", &path))?;
        // Best effort: the rename itself made durable.
        let _ = File::open(data_dir).and_then(|dir| dir.sync_all());
        Ok(())
    }
}

/// A guard's identity in the lock file: pid and start time (clock ticks after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    pid: u32,
    start: u64,
}

impl Identity {
    fn of(pid: u32) -> Option<Identity> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Field 22 (`starttime`), counted after the command name's closing parenthesis.
        let start = stat.rsplit_once(')')?.1.split_whitespace().nth(19)?;
        Some(Identity {
            pid,
            start: start.parse().ok()?,
        })
    }

    fn parse(text: &str) -> Option<Identity> {
        let (pid, start) = text.lines().next()?.split_once(' ')?;
        Some(Identity {
            pid: pid.parse().ok()?,
            start: start.parse().ok()?,
        })
    }

    fn line(&self) -> String {
        format!("{} {}\n", self.pid, self.start)
    }
}

fn unix_millis(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_round_trip_and_name_live_processes() {
        let me = Identity::of(std::process::id()).unwrap();
        assert_eq!(Identity::parse(&me.line()), Some(me));
        assert_eq!(
            Identity::parse(&format!("{}stale tail", me.line())),
            Some(me)
        );
        assert_eq!(Identity::parse(""), None);
        assert_eq!(Identity::parse("12\n"), None);
    }

    #[test]
    fn markers_round_trip() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(FencedMarker::read(tmp.path()).unwrap(), None);
        let marker = FencedMarker {
            fenced_at_unix_ms: 2,
            deadline_unix_ms: 1,
            frozen: 1,
            sandboxes: vec!["sbx".into()],
            errors: vec![],
            reason: "test".into(),
        };
        marker.write(tmp.path()).unwrap();
        assert_eq!(FencedMarker::read(tmp.path()).unwrap(), Some(marker));
        fs::write(FencedMarker::path(tmp.path()), "{").unwrap();
        assert!(FencedMarker::read(tmp.path()).is_err());
    }
}
