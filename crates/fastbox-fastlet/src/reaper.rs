//! Teardown after the processes: a removed sandbox's directory is renamed to
//! `DATA_DIR/sandboxes/reap-<slot>-<id>` (cheap, and crash-safe: a restart finds it by its
//! name) and queued here; one background thread unmounts its layers, deletes its files,
//! removes its network slot and only then frees the slot index. A removal thus ends, for the
//! caller, once every process is gone and the slot is queued for release.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};

/// Directory-name prefix of queued teardowns under `DATA_DIR/sandboxes`.
pub const REAP_ID_PREFIX: &str = "reap-";

/// One sandbox left to tear down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapJob {
    /// The renamed sandbox directory.
    pub dir: PathBuf,
    /// Its network slot, freed once everything else is gone.
    pub slot: Option<u32>,
}

impl ReapJob {
    /// The directory name of a queued teardown of `id` in `slot`.
    pub fn dir_name(slot: Option<u32>, id: &str) -> String {
        match slot {
            Some(index) => format!("{REAP_ID_PREFIX}{index}-{id}"),
            None => format!("{REAP_ID_PREFIX}x-{id}"),
        }
    }

    /// The slot of a queued teardown's directory name (`None`: not one, or without a slot).
    pub fn slot_of(dir_name: &str) -> Option<Option<u32>> {
        let rest = dir_name.strip_prefix(REAP_ID_PREFIX)?;
        let (slot, _) = rest.split_once('-')?;
        Some(slot.parse().ok())
    }
}

/// The queue and its worker; inactive (every [`Reaper::queue`] refused, so callers tear down
/// themselves) until [`Reaper::start`].
#[derive(Default)]
pub struct Reaper {
    tx: Mutex<Option<Sender<ReapJob>>>,
    pending: Arc<(Mutex<usize>, Condvar)>,
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

/// Teardowns that run at once.
pub const WORKERS: usize = 4;

impl Reaper {
    /// Starts [`WORKERS`] workers; `reap` does one teardown (errors are its to log). Most of
    /// a teardown is waiting for the kernel (unmounts, a namespace's veth going away), so
    /// several run at once.
    pub fn start(&self, reap: impl Fn(&ReapJob) + Send + Sync + 'static) {
        let (tx, rx): (Sender<ReapJob>, Receiver<ReapJob>) = channel();
        let rx = Arc::new(Mutex::new(rx));
        let reap = Arc::new(reap);
        let mut workers = self.workers.lock().expect("reaper lock");
        for i in 0..WORKERS {
            let (rx, reap, counter) = (rx.clone(), reap.clone(), self.pending.clone());
            let worker = std::thread::Builder::new()
                .name(format!("fastbox-reaper-{i}"))
                .spawn(move || {
                    crate::background::enter();
                    loop {
                        let job = rx.lock().expect("reaper lock").recv();
                        let Ok(job) = job else { return };
                        reap(&job);
                        let (count, done) = &*counter;
                        *count.lock().expect("reaper lock") -= 1;
                        done.notify_all();
                    }
                })
                .expect("spawn a reaper thread");
            workers.push(worker);
        }
        *self.tx.lock().expect("reaper lock") = Some(tx);
    }

    /// Queues `job`; false when the reaper was stopped (the caller reaps it itself).
    pub fn queue(&self, job: ReapJob) -> bool {
        let tx = self.tx.lock().expect("reaper lock");
        let Some(tx) = tx.as_ref() else {
            return false;
        };
        *self.pending.0.lock().expect("reaper lock") += 1;
        if tx.send(job).is_err() {
            *self.pending.0.lock().expect("reaper lock") -= 1;
            return false;
        }
        true
    }

    /// Teardowns queued and not finished.
    pub fn pending(&self) -> usize {
        *self.pending.0.lock().expect("reaper lock")
    }

    /// Waits until every queued teardown is done.
    pub fn flush(&self) {
        let (count, done) = &*self.pending;
        let mut n = count.lock().expect("reaper lock");
        while *n > 0 {
            n = done.wait(n).expect("reaper lock");
        }
    }

    /// Finishes the queue and stops the worker; later jobs are refused by [`Reaper::queue`].
    pub fn stop(&self) {
        drop(self.tx.lock().expect("reaper lock").take());
        for worker in self.workers.lock().expect("reaper lock").drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn directory_names_carry_the_slot() {
        assert_eq!(ReapJob::dir_name(Some(7), "abc-1"), "reap-7-abc-1");
        assert_eq!(ReapJob::slot_of("reap-7-abc-1"), Some(Some(7)));
        assert_eq!(ReapJob::dir_name(None, "abc"), "reap-x-abc");
        assert_eq!(ReapJob::slot_of("reap-x-abc"), Some(None));
        assert_eq!(ReapJob::slot_of("pool-1234"), None);
    }

    #[test]
    fn flush_waits_for_every_job_and_stop_refuses_new_ones() {
        let done = Arc::new(Mutex::new(Vec::new()));
        let seen = done.clone();
        let reaper = Reaper::default();
        assert!(!reaper.queue(ReapJob {
            dir: PathBuf::from("/nonexistent"),
            slot: None,
        }));
        reaper.start(move |job| {
            std::thread::sleep(Duration::from_millis(20));
            seen.lock().unwrap().push(job.slot);
        });
        for i in 0..3 {
            assert!(reaper.queue(ReapJob {
                dir: PathBuf::from("/nonexistent"),
                slot: Some(i),
            }));
        }
        reaper.flush();
        assert_eq!(reaper.pending(), 0);
        let mut done = done.lock().unwrap().clone();
        done.sort();
        assert_eq!(done, vec![Some(0), Some(1), Some(2)]);
        reaper.stop();
        assert!(!reaper.queue(ReapJob {
            dir: PathBuf::from("/nonexistent"),
            slot: None,
        }));
    }
}
