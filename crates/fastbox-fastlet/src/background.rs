//! Background work (teardowns, spare slots, warm-pool refills) yields the cores to the creates
//! being answered: its threads run at nice [`BACKGROUND_NICE`]. On two cores, a burst of
//! creates otherwise shares them with the teardowns of the previous burst and the refills of
//! the pool it just emptied. A CRIU run takes the priority of the thread that starts it
//! (`fastbox_runtime::criu`), and CRIU gives the restored processes their own recorded one.

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

#[cfg(test)]
mod tests {
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
