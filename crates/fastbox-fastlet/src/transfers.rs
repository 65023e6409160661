//! Sandboxes started before their memory is in place (`docs/snapshots.md`, "Lazy
//! restores").
//!
//! A clone of a snapshot, or a resume, whose checkpoint holds at least
//! [`crate::FastletConfig::lazy_restore_min_bytes`] of memory is restored with `criu restore
//! --lazy-pages` from the checkpoint's own pages images ([`LazyPages::local`]): the sandbox
//! runs once everything but its memory is restored, and a `criu lazy-pages` daemon copies the
//! memory in (on a page fault first, every other page in the background). This module keeps
//! the transfers that still run:
//!
//! - a dump of the sandbox (snapshot, pause, fork) waits for its transfer
//!   ([`Transfers::wait_for_sandbox`]): a dump before then would miss the pages not copied yet;
//! - removing the checkpoint waits for the transfers that read it
//!   ([`Transfers::wait_for_source`]); the first removal after a transfer from it failed
//!   keeps it ([`Transfers::take_failure`]), so the sandbox can be resumed from it again;
//! - a failed transfer has killed the sandbox (its missing pages would read as zeros);
//! - while a transfer runs, the sandbox's directory holds [`MARKER`], which names the
//!   daemon's process. A daemon reading a local checkpoint finishes its transfer when this
//!   process dies; one that fails freezes the sandbox (its guard). So a restart that finds
//!   the mark ([`Mark::read`]) waits for that daemon, then adopts the sandbox unless it is
//!   frozen; a frozen one is resumed again from its checkpoint (a resume) or failed and
//!   removed (a clone).
//!
//! [`LazyPages::local`]: fastbox_runtime::lazy::restore::LazyPages::local

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use fastbox_runtime::lazy::daemon::DaemonProcess;
use fastbox_runtime::lazy::restore::LazyTransfer;

use crate::remote_pages::RemotePages;

/// The file a sandbox's directory holds while its memory is copied in.
pub const MARKER: &str = "lazy-transfer";

/// What [`MARKER`] records: the checkpoint the memory comes from and the daemon copying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mark {
    pub source: String,
    /// `None` when it could not be recorded: nothing then tells a finished transfer from
    /// one cut short.
    pub daemon: Option<DaemonProcess>,
}

impl Mark {
    /// The mark of the sandbox in `dir`, if its transfer had not ended when it was last seen.
    pub fn read(dir: &Path) -> Option<Self> {
        let text = std::fs::read_to_string(dir.join(MARKER)).ok()?;
        let mut lines = text.lines();
        let source = lines.next().unwrap_or_default().to_string();
        let daemon = lines.next().and_then(DaemonProcess::parse);
        Some(Self { source, daemon })
    }

    fn write(&self, dir: &Path) -> std::io::Result<()> {
        let daemon = self.daemon.map(DaemonProcess::to_line).unwrap_or_default();
        std::fs::write(dir.join(MARKER), format!("{}\n{daemon}\n", self.source))
    }

    /// Removes the mark of the sandbox in `dir`.
    pub fn clear(dir: &Path) {
        let _ = std::fs::remove_file(dir.join(MARKER));
    }
}

/// The transfers still running, by sandbox id.
#[derive(Default)]
pub struct Transfers {
    running: Mutex<HashMap<String, Arc<Running>>>,
    /// Snapshots whose last transfer failed (a later success from them clears it).
    failed: Mutex<std::collections::HashSet<String>>,
    /// Checkpoints a restore is about to read, until its transfer is tracked
    /// ([`Transfers::begin_read`]).
    starting: Mutex<std::collections::HashSet<String>>,
}

/// A restore's claim on reading checkpoint `source`: no other restore may read it until
/// this is dropped (after the restore's transfer is tracked, or the restore failed).
pub struct ReadClaim {
    transfers: Arc<Transfers>,
    source: String,
}

impl Drop for ReadClaim {
    fn drop(&mut self) {
        self.transfers
            .starting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.source);
    }
}

/// One transfer: the snapshot it reads and, once it ended, how.
struct Running {
    source: String,
    outcome: Mutex<Option<Result<(), String>>>,
    ended: Condvar,
}

impl Running {
    fn wait(&self) -> Result<(), String> {
        let mut outcome = self.outcome.lock().expect("transfer lock");
        loop {
            if let Some(outcome) = outcome.as_ref() {
                return outcome.clone();
            }
            outcome = self.ended.wait(outcome).expect("transfer lock");
        }
    }
}

impl Transfers {
    /// Marks sandbox `id` (directory `dir`), restored from checkpoint `source`, and watches
    /// its `transfer` until it ends, then removes the mark. `whole_after` is the checkpoint
    /// directory of a source whose memory was fetched from the artifact store: when the
    /// transfer put every page in place, the checkpoint is whole ([`RemotePages::clear`]).
    pub fn track(
        self: &Arc<Self>,
        id: &str,
        dir: &Path,
        source: &str,
        transfer: LazyTransfer,
        whole_after: Option<PathBuf>,
    ) {
        let mark = Mark {
            source: source.to_string(),
            daemon: transfer.daemon(),
        };
        if let Err(e) = mark.write(dir) {
            tracing::warn!(sandbox = %id, error = %e, "could not mark the memory transfer");
        }
        let dir = dir.to_path_buf();
        let running = Arc::new(Running {
            source: source.to_string(),
            outcome: Mutex::new(None),
            ended: Condvar::new(),
        });
        self.lock().insert(id.to_string(), running.clone());
        let (this, sandbox, clock) = (Arc::clone(self), id.to_string(), std::time::Instant::now());
        let (watched, marked) = (running.clone(), dir.clone());
        let spawned = std::thread::Builder::new()
            .name("fastbox-transfer".into())
            .spawn(move || {
                let outcome = transfer.wait().map(|report| {
                    if let Some(checkpoint) = &whole_after {
                        RemotePages::clear(checkpoint);
                    }
                    tracing::info!(sandbox = %sandbox, ms = clock.elapsed().as_millis() as u64, fetched_blocks = report.fetched.blocks, "memory copied in");
                });
                let outcome = outcome.map_err(|e| {
                    tracing::warn!(sandbox = %sandbox, error = %e, "the memory transfer failed: the sandbox was killed");
                    format!("its memory transfer failed and it was killed: {e}")
                });
                {
                    let mut failed = this.failed.lock().unwrap_or_else(|e| e.into_inner());
                    match &outcome {
                        Ok(()) => failed.remove(&watched.source),
                        Err(_) => failed.insert(watched.source.clone()),
                    };
                }
                end(&marked, &watched, outcome);
                this.lock().remove(&sandbox);
            });
        if let Err(e) = spawned {
            // The transfer's own watcher still kills the sandbox if it fails; nothing can
            // wait for it any more, so nothing must.
            tracing::warn!(sandbox = %id, error = %e, "no thread to watch a memory transfer");
            end(
                &dir,
                &running,
                Err(format!("its memory transfer is not watched: {e}")),
            );
            self.lock().remove(id);
        }
    }

    /// Whether this run watches a memory transfer into sandbox `id` (its end, or its failure,
    /// is handled here).
    pub fn watches(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    /// How many transfers run.
    pub fn running(&self) -> usize {
        self.lock().len()
    }

    /// Waits until the memory transfer of sandbox `id` (if one runs) has ended: Ok when
    /// every page is in place, the reason otherwise (the sandbox was killed).
    pub fn wait_for_sandbox(&self, id: &str) -> Result<(), String> {
        let running = self.lock().get(id).cloned();
        running.map_or(Ok(()), |r| r.wait())
    }

    /// A claim on reading checkpoint `source`, unless a transfer reads it or another restore
    /// claimed it first.
    pub fn begin_read(self: &Arc<Self>, source: &str) -> Option<ReadClaim> {
        let mut starting = self.starting.lock().unwrap_or_else(|e| e.into_inner());
        if self.reads(source) || !starting.insert(source.to_string()) {
            return None;
        }
        Some(ReadClaim {
            transfers: Arc::clone(self),
            source: source.to_string(),
        })
    }

    /// Whether a transfer that reads snapshot `source` runs.
    pub fn reads(&self, source: &str) -> bool {
        self.lock().values().any(|r| r.source == source)
    }

    /// Whether the last transfer from snapshot `source` failed; the answer is given once
    /// (the first removal after a failure keeps the snapshot, a later one removes it).
    pub fn take_failure(&self, source: &str) -> bool {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(source)
    }

    /// Waits until every transfer that reads snapshot `source` has ended.
    pub fn wait_for_source(&self, source: &str) {
        let reading: Vec<Arc<Running>> = self
            .lock()
            .values()
            .filter(|r| r.source == source)
            .cloned()
            .collect();
        for running in reading {
            let _ = running.wait();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Running>>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Records how the transfer ended, after removing its mark.
fn end(dir: &Path, running: &Running, outcome: Result<(), String>) {
    Mark::clear(dir);
    *running.outcome.lock().expect("transfer lock") = Some(outcome);
    running.ended.notify_all();
}

#[cfg(test)]
mod claim_tests {
    use super::*;

    #[test]
    fn one_restore_at_a_time_reads_a_checkpoint() {
        let transfers = Arc::new(Transfers::default());
        let first = transfers.begin_read("pause-a").expect("free");
        assert!(transfers.begin_read("pause-a").is_none(), "claimed");
        let other = transfers.begin_read("pause-b");
        assert!(other.is_some(), "another checkpoint is free");
        drop(first);
        assert!(transfers.begin_read("pause-a").is_some(), "free again");
    }
}
