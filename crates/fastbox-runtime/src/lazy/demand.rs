//! Faults first: a block a restored task is waiting for goes before the background fetch.
//!
//! Every lazy restore on a node fetches from the same peers and origin. A page fault waits
//! for exactly one block, while the background workers of every restore keep several blocks
//! in flight; a fault queued behind them waits for all of them. So each fault counts itself
//! here while it waits for its block ([`Demand::begin`]), and a background worker starts no
//! new fetch while any fault is waiting ([`Demand::wait_quiet`]), for at most a bounded time
//! so the background still makes progress under a steady stream of faults. Fetches already
//! under way finish: the gain is that the fault's own fetch meets fewer new competitors.
//!
//! The count is node-wide (one process serves every restore of its node), since the origin
//! and the network are shared by all of them.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The node's waiting faults (see the module docs).
pub(crate) static DEMAND: Demand = Demand::new();

/// A count of faults waiting for blocks, and a signal when it falls to zero.
pub(crate) struct Demand {
    waiting: Mutex<usize>,
    quiet: Condvar,
}

/// One waiting fault: counted until dropped.
pub(crate) struct Waiting<'a>(&'a Demand);

impl Demand {
    pub(crate) const fn new() -> Self {
        Self {
            waiting: Mutex::new(0),
            quiet: Condvar::new(),
        }
    }

    /// Counts one fault until the returned guard is dropped.
    pub(crate) fn begin(&self) -> Waiting<'_> {
        *self.lock() += 1;
        Waiting(self)
    }

    /// Returns once no fault is waiting, or after `max`: what a background worker calls
    /// before each fetch it starts.
    pub(crate) fn wait_quiet(&self, max: Duration) {
        let deadline = Instant::now() + max;
        let mut waiting = self.lock();
        while *waiting > 0 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            waiting = self
                .quiet
                .wait_timeout(waiting, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, usize> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = self.0.lock();
        *waiting -= 1;
        if *waiting == 0 {
            self.0.quiet.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_background_worker_waits_while_a_fault_waits_and_goes_on_after() {
        let demand = Arc::new(Demand::new());
        let fault = demand.begin();
        let worker = {
            let demand = Arc::clone(&demand);
            std::thread::spawn(move || {
                let started = Instant::now();
                demand.wait_quiet(Duration::from_secs(30));
                started.elapsed()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!worker.is_finished(), "the worker went ahead of a fault");
        drop(fault);
        // Let go by the fault's end, not by its bound.
        let waited = worker.join().unwrap();
        assert!(waited < Duration::from_secs(30), "{waited:?}");
    }

    #[test]
    fn a_worker_waits_no_longer_than_its_bound_and_not_at_all_when_quiet() {
        let demand = Demand::new();
        let started = Instant::now();
        demand.wait_quiet(Duration::from_secs(30));
        assert!(started.elapsed() < Duration::from_secs(30));
        let _fault = demand.begin();
        let started = Instant::now();
        demand.wait_quiet(Duration::from_millis(50));
        assert!(started.elapsed() >= Duration::from_millis(50));
    }
}
