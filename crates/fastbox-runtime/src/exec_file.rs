//! Writing a file that is executed soon after, without the "Text file busy" race.
//!
//! The kernel refuses to execute a file while any descriptor holds it open for writing
//! (`ETXTBSY`). A child forked by another thread while this process has such a file open
//! inherits that descriptor, and holds it until the child executes its program
//! (`O_CLOEXEC` only closes it then). fastbox forks children that do work before they
//! execute (CRIU restores entering their private `/run`, the lazy-pages daemon), so a file
//! written while one is being forked could not be run for as long as that child takes:
//! CRIU's post-dump action failed that way under a pool refill.
//!
//! [`write_executable`] writes from a thread with a descriptor table of its own
//! (`unshare(CLONE_FILES)`): the write descriptor never enters the table other threads
//! fork from, so no child can hold it.

use std::fs::OpenOptions;
use std::io::{self, Write as _};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::Path;

/// Writes `bytes` to `path` (created or truncated) with permission bits `mode`, from a
/// thread whose descriptor table no other thread forks from (see the module docs). Once it
/// returns, nothing holds `path` open for writing.
pub fn write_executable(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_FILES)?;
                let mut file = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(mode)
                    .open(path)?;
                file.write_all(bytes)?;
                file.set_permissions(std::fs::Permissions::from_mode(mode))?;
                #[cfg(test)]
                testing::while_open();
                Ok(())
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the writing thread panicked")))
    })
}

#[cfg(test)]
pub(crate) mod testing {
    use std::sync::Mutex;

    type Hook = Box<dyn Fn() + Send>;
    static WHILE_OPEN: Mutex<Option<Hook>> = Mutex::new(None);

    /// Runs `hook` in every [`super::write_executable`] while its file is open for writing,
    /// until `f` returns.
    pub fn with_hook<T>(hook: impl Fn() + Send + 'static, f: impl FnOnce() -> T) -> T {
        *WHILE_OPEN.lock().unwrap() = Some(Box::new(hook));
        let out = f();
        *WHILE_OPEN.lock().unwrap() = None;
        out
    }

    pub(super) fn while_open() {
        if let Some(hook) = WHILE_OPEN.lock().unwrap().as_ref() {
            hook();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd as _;
    use std::process::Command;
    use std::sync::mpsc;

    /// A child forked by another thread while the file is open for writing, and still
    /// before its exec, does not keep the file from running.
    #[test]
    fn a_child_forked_during_the_write_does_not_make_the_file_busy() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("action");
        let (release_rx, release_tx) = nix::unistd::pipe().unwrap();
        // The forking thread is this thread's (it shares the table other threads fork from);
        // a thread started from the writer would share the writer's table instead.
        let (ask_tx, ask_rx) = mpsc::channel::<()>();
        let (pid_tx, pid_rx) = mpsc::channel::<libc::pid_t>();
        let release_fd = release_rx.as_raw_fd();
        let forker = std::thread::spawn(move || {
            for () in ask_rx {
                // The child only reads and exits (async-signal-safe): it stands for a child
                // doing its work before it executes its program.
                // SAFETY: the child calls only async-signal-safe functions (read, _exit).
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    let mut b = [0u8; 1];
                    // SAFETY: a valid buffer of one byte; _exit never returns.
                    unsafe {
                        libc::read(release_fd, b.as_mut_ptr().cast(), 1);
                        libc::_exit(0);
                    }
                }
                pid_tx.send(pid).unwrap();
            }
        });
        let ask_tx = std::sync::Mutex::new(ask_tx);
        let pids = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&pids);
        let pid_rx = std::sync::Mutex::new(pid_rx);
        let written = testing::with_hook(
            move || {
                ask_tx.lock().unwrap().send(()).unwrap();
                let pid = pid_rx.lock().unwrap().recv().unwrap();
                seen.lock().unwrap().push(pid);
            },
            || write_executable(&script, b"#!/bin/sh\nexit 0\n", 0o700),
        );
        written.unwrap();
        let pids = pids.lock().unwrap().clone();
        assert_eq!(pids.len(), 1, "the hook forked once");
        assert!(pids[0] > 0, "fork failed");
        let ran = Command::new(&script).status();
        nix::unistd::write(&release_tx, b"x").unwrap();
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pids[0]), None);
        forker.join().unwrap();
        let status = ran.unwrap_or_else(|e| panic!("the written script could not run: {e}"));
        assert!(status.success());
        let mode = std::fs::metadata(&script).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }

    #[test]
    fn an_existing_file_is_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"a much longer previous content").unwrap();
        write_executable(&path, b"short", 0o555).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"short");
    }
}
