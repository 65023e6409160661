//! Background work (teardowns, spare slots, warm-pool refills) yields the cores to the creates
//! being answered: its threads run at nice [`BACKGROUND_NICE`]. On two cores, a burst of
//! creates otherwise shares them with the teardowns of the previous burst and the refills of
//! the pool it just emptied. A CRIU run takes the priority of the thread that starts it
//! (`fastbox_runtime::criu`), and CRIU gives the restored processes their own recorded one.
//! Teardowns and spare slots also hold off while starts are in flight ([`Starts`]), for a
//! bounded time and only while few teardowns are queued (or half the spares are left), so a
//! sustained load still gets its slots back.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The nice value of background threads.
pub const BACKGROUND_NICE: i32 = 10;

/// Makes the calling thread a background thread (Linux nice values are per thread).
pub fn enter() {
    // SAFETY: setpriority on the calling thread (who = 0) only changes its scheduling weight.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, BACKGROUND_NICE) };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "background thread keeps its priority");
    }
}

/// The starts (restores and claims for creates, resumes, clones) in flight on this node, so
/// that background work can hold off while a burst of them is being answered.
#[derive(Default)]
pub struct Starts {
    in_flight: Mutex<usize>,
    quiet: Condvar,
}

/// One start in flight; it ends when dropped.
pub struct StartGuard<'a>(&'a Starts);

impl Starts {
    /// Counts a start until the guard is dropped.
    pub fn begin(&self) -> StartGuard<'_> {
        *self.in_flight.lock().expect("starts lock") += 1;
        StartGuard(self)
    }

    /// Waits until no start is in flight, or `limit` passed; returns how long it waited.
    pub fn wait_quiet(&self, limit: Duration) -> Duration {
        let begun = Instant::now();
        let mut n = self.in_flight.lock().expect("starts lock");
        while *n > 0 {
            let left = limit.saturating_sub(begun.elapsed());
            if left.is_zero() {
                break;
            }
            n = self.quiet.wait_timeout(n, left).expect("starts lock").0;
        }
        begun.elapsed()
    }
}

impl Drop for StartGuard<'_> {
    fn drop(&mut self) {
        let mut n = self.0.in_flight.lock().expect("starts lock");
        *n -= 1;
        if *n == 0 {
            self.0.quiet.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Orderings, not timings: nothing in flight returns at once (well before the limit);
    /// a start in flight holds the wait to the limit (the wait measures itself); the end of
    /// the last start ends a wait, which returns only after it.
    #[test]
    fn waiting_for_quiet_ends_with_the_last_start_or_at_the_limit() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let starts = std::sync::Arc::new(Starts::default());
        assert!(starts.wait_quiet(Duration::from_secs(30)) < Duration::from_secs(30));
        let guard = starts.begin();
        let waited = starts.wait_quiet(Duration::from_millis(60));
        assert!(waited >= Duration::from_millis(60), "{waited:?}");
        let ended = std::sync::Arc::new(AtomicBool::new(false));
        let waiter = {
            let (starts, ended) = (starts.clone(), ended.clone());
            std::thread::spawn(move || {
                let waited = starts.wait_quiet(Duration::from_secs(60));
                (waited, ended.load(Ordering::SeqCst))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        ended.store(true, Ordering::SeqCst);
        drop(guard);
        let (waited, after_the_end) = waiter.join().unwrap();
        assert!(
            after_the_end,
            "the wait returned while the start was in flight"
        );
        assert!(
            waited < Duration::from_secs(60),
            "{waited:?}: held to the limit"
        );
    }

    #[test]
    fn a_background_thread_runs_at_the_background_nice_value_and_others_do_not() {
        let nice = || {
            // SAFETY: getpriority of the calling thread.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
        };
        let before = nice();
        let inside = std::thread::spawn(move || {
            super::enter();
            nice()
        })
        .join()
        .unwrap();
        assert_eq!(inside, super::BACKGROUND_NICE.max(before));
        assert_eq!(nice(), before, "only the calling thread changed");
    }
}
