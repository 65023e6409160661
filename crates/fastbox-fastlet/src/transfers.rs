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
//!   ([`Transfers::wait_for_source`]);
//! - a failed transfer has killed the sandbox (its missing pages would read as zeros);
//! - while a transfer runs, the sandbox's directory holds [`MARKER`]. A sandbox found with it
//!   after a restart ([`interrupted`]) lost its page server with the process that ran it, so
//!   it is not adopted: the daemon's guard froze it, and the caller resumes it again from its
//!   checkpoint (a resume) or fails and removes it (a clone).
//!
//! [`LazyPages::local`]: fastbox_runtime::lazy::restore::LazyPages::local

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use fastbox_runtime::lazy::restore::LazyTransfer;

/// The file a sandbox's directory holds while its memory is copied in.
pub const MARKER: &str = "lazy-transfer";

/// Whether the sandbox in `dir` was left with its memory transfer unfinished.
pub fn interrupted(dir: &Path) -> bool {
    dir.join(MARKER).exists()
}

/// The transfers still running, by sandbox id.
#[derive(Default)]
pub struct Transfers {
    running: Mutex<HashMap<String, Arc<Running>>>,
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
    /// its `transfer` until it ends, then removes the mark.
    pub fn track(self: &Arc<Self>, id: &str, dir: &Path, source: &str, transfer: LazyTransfer) {
        let marker = dir.join(MARKER);
        if let Err(e) = std::fs::write(&marker, source) {
            tracing::warn!(sandbox = %id, error = %e, "could not mark the memory transfer");
        }
        let running = Arc::new(Running {
            source: source.to_string(),
            outcome: Mutex::new(None),
            ended: Condvar::new(),
        });
        self.lock().insert(id.to_string(), running.clone());
        let (this, id, clock) = (Arc::clone(self), id.to_string(), std::time::Instant::now());
        let spawned = std::thread::Builder::new()
            .name("fastbox-transfer".into())
            .spawn(move || {
                let outcome = transfer.wait().map(|report| {
                    tracing::info!(sandbox = %id, pages = report.served.pages, ms = clock.elapsed().as_millis() as u64, "memory copied in");
                });
                let outcome = outcome.map_err(|e| {
                    tracing::warn!(sandbox = %id, error = %e, "the memory transfer failed: the sandbox was killed");
                    format!("its memory transfer failed and it was killed: {e}")
                });
                end(&marker, &running, outcome);
                this.lock().remove(&id);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to watch a memory transfer");
        }
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
fn end(marker: &PathBuf, running: &Running, outcome: Result<(), String>) {
    let _ = std::fs::remove_file(marker);
    *running.outcome.lock().expect("transfer lock") = Some(outcome);
    running.ended.notify_all();
}
