//! A handle on a child process that survives its pid being reused: a pidfd (Linux 5.3+).
//!
//! A watcher thread that kills a process at a deadline races with the thread that reaps it:
//! once reaped, its pid may name another process. A pidfd opened while the child is not yet
//! reaped always refers to that child; signalling it after its end fails with `ESRCH`
//! instead of reaching a stranger, and it becomes readable when the child exits, so a wait
//! can have a timeout without polling.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// A pidfd of one process.
#[derive(Debug)]
pub struct PidFd(OwnedFd);

impl PidFd {
    /// Opens a pidfd for `pid`, which must be a child of this process that is not reaped yet
    /// (otherwise the pid may already name another process).
    pub fn open(pid: u32) -> io::Result<Self> {
        let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
        // SAFETY: the descriptor was just returned by the kernel and is owned by nobody else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Waits until the process exits or `timeout` passes (`None`: no limit). True when it
    /// exited (it is then a zombie until its parent reaps it).
    pub fn wait_exit(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let mut poll = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            let millis = match deadline {
                None => -1,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    // Rounded up: a wait never ends before its timeout.
                    i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
                }
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut poll, 1, millis) };
            match n {
                n if n > 0 => return Ok(true),
                0 => return Ok(false),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// Sends SIGKILL; a process that already ended is not an error.
    pub fn kill(&self) -> io::Result<()> {
        // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo, no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Instant;

    #[test]
    fn waits_time_out_and_kills_end_the_process() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pidfd = PidFd::open(child.id()).unwrap();
        let clock = Instant::now();
        assert!(!pidfd.wait_exit(Some(Duration::from_millis(50))).unwrap());
        assert!(clock.elapsed() >= Duration::from_millis(50));
        pidfd.kill().unwrap();
        assert!(pidfd.wait_exit(Some(Duration::from_secs(10))).unwrap());
        let status = child.wait().unwrap();
        assert!(!status.success());
        // Reaped: signalling it again reaches nobody and is no error.
        pidfd.kill().unwrap();
    }

    #[test]
    fn a_process_that_exits_wakes_the_wait() {
        let mut child = Command::new("true").spawn().unwrap();
        let pidfd = PidFd::open(child.id()).unwrap();
        assert!(pidfd.wait_exit(None).unwrap());
        assert!(child.wait().unwrap().success());
    }
}
