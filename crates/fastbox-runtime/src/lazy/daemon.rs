//! `criu lazy-pages`, run beside a `criu restore --lazy-pages`, fed by a [`PageServer`] over a
//! socket pair.
//!
//! The daemon listens on `lazy-pages.socket` in its work directory; the restore (run with the
//! same work directory) connects there and hands over one userfaultfd per restored task. The
//! daemon then resolves the tasks' page faults and copies every remaining lazy page in the
//! background, asking the page server for each, and exits 0 once every page is in place.
//! The page server is not a TCP listener: it gets the daemon's requests on one end of a
//! socket pair whose other end the daemon inherits (`--page-server --ps-socket`), so no other
//! process on the host can read a checkpoint's memory through it.
//!
//! **A failed daemon corrupts memory silently**: when it exits early, the kernel unregisters
//! its userfaultfds and every page not yet copied reads as zeros. [`LazyDaemon::wait`] reports
//! such an end; the caller must then kill the restored sandbox (the watcher of
//! [`super::restore`] does).
//!
//! The daemon is a child of the calling process, outside the sandbox's cgroup: its memory is
//! the node's, and a sandbox that kills its own processes cannot end it. Its privileged tests
//! (real CRIU) are in `tests/lazy.rs`.

use std::io::Read as _;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use super::pidfd::PidFd;
use super::server::{PageServer, ServeError, ServeStats};

/// The descriptor number of the page-server socket in the daemon.
const PS_FD: i32 = 3;
/// The descriptor number on which the daemon reports that it listens (CRIU's `--status-fd`).
const STATUS_FD: i32 = 4;
/// The daemon's nice value once its restore is done ([`LazyDaemon::yield_cpu`]): its
/// background copy yields to restores and to the sandboxes' own work (10 clones of a
/// 256 MiB snapshot at once answered in 2.7 s at nice 0 on two cores: ten daemons copying
/// 2.5 GiB crowded out the restores and the faults of the clones' first requests). Until
/// then it runs at its starter's priority: a daemon started at nice 10 next to eight others
/// copying took up to 85 ms to listen, and the restore waited for it.
pub const DAEMON_NICE: i32 = 10;
/// The socket the restore connects to, in the shared work directory (CRIU's name).
pub const SOCKET_NAME: &str = "lazy-pages.socket";

/// Why the daemon could not be run, or did not finish its work.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("criu lazy-pages: {what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("criu lazy-pages exited before listening ({status}); log {log}:\n{tail}")]
    NotReady {
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("criu lazy-pages failed ({status}); log {log}:\n{tail}")]
    Failed {
        status: ExitStatus,
        log: PathBuf,
        tail: String,
    },
    #[error("the page transfer did not finish within {after:?}: criu lazy-pages was killed")]
    TimedOut { after: Duration },
    #[error("lazy page server: {0}")]
    Serve(#[from] ServeError),
    #[error("the lazy page server thread panicked")]
    ServerPanicked,
}

/// What a lazy restore's page transfer did.
#[derive(Debug, Clone)]
pub struct LazyReport {
    pub served: ServeStats,
}

/// A running `criu lazy-pages` and its page server; dropping it kills the daemon.
#[derive(Debug)]
pub struct LazyDaemon {
    child: Option<Child>,
    /// The daemon's pidfd, opened before it could be reaped: waits with a timeout.
    pidfd: PidFd,
    server: Option<JoinHandle<Result<ServeStats, ServeError>>>,
    log: PathBuf,
}

impl LazyDaemon {
    /// Starts `criu` (a command running CRIU >= 4.2, to which the `lazy-pages` arguments are
    /// added) for the checkpoint in `images`, listening in `work_dir` (which the restore must
    /// use as its `--work-dir`), logging to `log`, and serves its page requests from `server`
    /// (`None`: the pages images in `images` are complete, and the daemon reads them itself).
    /// Returns once the daemon listens.
    /// The daemon runs in a process group of its own, which is what is killed (a guarded
    /// daemon, [`crate::criu::Criu::lazy_pages_command`], runs under a shell).
    pub fn start(
        mut criu: Command,
        images: &Path,
        work_dir: &Path,
        log: &Path,
        server: Option<PageServer>,
    ) -> Result<Self, DaemonError> {
        criu.process_group(0);
        let io_err = |what| move |source| DaemonError::Io { what, source };
        let (ours, theirs) = UnixStream::pair().map_err(io_err("socket pair"))?;
        let (mut ready_rx, ready_tx) = status_pipe().map_err(io_err("status pipe"))?;
        let (ps_raw, status_raw) = (theirs.as_raw_fd(), ready_tx.as_raw_fd());
        criu.arg("lazy-pages")
            .arg("--images-dir")
            .arg(images)
            .arg("--work-dir")
            .arg(work_dir)
            .arg("--log-file")
            .arg(log)
            .arg("-v2")
            .arg("--status-fd")
            .arg(STATUS_FD.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if server.is_some() {
            criu.args(["--page-server", "--ps-socket"])
                .arg(PS_FD.to_string());
        }
        // SAFETY: only dup2 (async-signal-safe) on descriptors that outlive the spawn; the
        // copies dup2 makes are not close-on-exec.
        unsafe {
            criu.pre_exec(move || {
                for (from, to) in [(ps_raw, PS_FD), (status_raw, STATUS_FD)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = criu.spawn().map_err(io_err("start"))?;
        drop((theirs, ready_tx));
        let pidfd = match PidFd::open(child.id()) {
            Ok(pidfd) => pidfd,
            Err(source) => {
                kill_group(&mut child);
                return Err(DaemonError::Io {
                    what: "watch",
                    source,
                });
            }
        };
        // CRIU writes one byte once its socket listens; EOF means it ended first.
        let mut byte = [0u8; 1];
        if !matches!(ready_rx.read(&mut byte), Ok(1)) {
            let status = child
                .wait()
                .map_or_else(|e| e.to_string(), |s| s.to_string());
            return Err(DaemonError::NotReady {
                status,
                log: log.to_path_buf(),
                tail: crate::criu::log_tail(log, ""),
            });
        }
        let server = server.map(|server| {
            std::thread::spawn(move || {
                let mut conn = ours;
                server.serve(&mut conn)
            })
        });
        Ok(Self {
            child: Some(child),
            pidfd,
            server,
            log: log.to_path_buf(),
        })
    }

    /// Waits until every lazy page is transferred (the daemon exits): Ok only when the
    /// daemon succeeded and its page server ended cleanly. On an error the restored tasks
    /// may hold zero pages where data was: kill them.
    pub fn wait(self) -> Result<LazyReport, DaemonError> {
        self.wait_timeout(None)
    }

    /// [`LazyDaemon::wait`] for at most `timeout` (`None`: no limit); a daemon still running
    /// then is killed ([`DaemonError::TimedOut`]).
    pub fn wait_timeout(mut self, timeout: Option<Duration>) -> Result<LazyReport, DaemonError> {
        let io_err = |source| DaemonError::Io {
            what: "wait",
            source,
        };
        let ended = self.pidfd.wait_exit(timeout).map_err(io_err)?;
        let Some(mut child) = self.child.take() else {
            return Err(DaemonError::ServerPanicked);
        };
        if !ended {
            kill_group(&mut child);
            return Err(DaemonError::TimedOut {
                after: timeout.unwrap_or_default(),
            });
        }
        let status = child.wait().map_err(io_err)?;
        let served = self
            .server
            .take()
            .map(|t| t.join().map_err(|_| DaemonError::ServerPanicked))
            .transpose()?
            .transpose()?
            .unwrap_or_default();
        if !status.success() {
            return Err(DaemonError::Failed {
                status,
                log: self.log.clone(),
                tail: crate::criu::log_tail(&self.log, ""),
            });
        }
        Ok(LazyReport { served })
    }

    /// Lowers the daemon (its whole process group) to [`DAEMON_NICE`]: called once the
    /// restore it serves is done, so that its background copy yields to other work. Best
    /// effort: a daemon left at its priority only runs faster.
    pub fn yield_cpu(&self) {
        if let Some(pid) = self.pid() {
            // SAFETY: setpriority on the process group the child leads.
            unsafe { libc::setpriority(libc::PRIO_PGRP, pid, DAEMON_NICE) };
        }
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The daemon's process, to find again after this process is gone.
    pub fn process(&self) -> Option<DaemonProcess> {
        let pid = i32::try_from(self.pid()?).ok()?;
        Some(DaemonProcess {
            pid,
            start_ticks: crate::sandbox::process_start_ticks(pid)?,
        })
    }
}

impl Drop for LazyDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
        // The server ends when the daemon's end of the socket pair closes.
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// A daemon's process (its guarding shell when it has one), by pid and start time: a
/// daemon that reads a local checkpoint finishes its transfer when the process that started
/// it dies, and whoever comes next waits for it ([`DaemonProcess::wait_gone`]) before it
/// looks at the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DaemonProcess {
    pub pid: i32,
    pub start_ticks: u64,
}

impl DaemonProcess {
    /// `pid start_ticks`, as [`DaemonProcess::parse`] reads it.
    pub fn to_line(self) -> String {
        format!("{} {}", self.pid, self.start_ticks)
    }

    pub fn parse(line: &str) -> Option<Self> {
        let (pid, ticks) = line.trim().split_once(' ')?;
        Some(Self {
            pid: pid.parse().ok()?,
            start_ticks: ticks.parse().ok()?,
        })
    }

    /// Whether the process still runs (a later process with its pid does not count).
    pub fn is_running(self) -> bool {
        crate::sandbox::process_start_ticks(self.pid) == Some(self.start_ticks)
            && crate::sandbox::process_state(self.pid).is_some_and(|s| s != 'Z' && s != 'X')
    }

    /// Waits (at most `timeout`) until the process is gone; true when it is.
    pub fn wait_gone(self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        while self.is_running() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }
}

/// Kills the daemon's process group (the daemon, and its guarding shell) and reaps it.
fn kill_group(child: &mut Child) {
    // SAFETY: a signal to the process group the child leads (made with `process_group(0)`).
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.kill();
    let _ = child.wait();
}

/// A close-on-exec pipe: (read end, write end).
fn status_pipe() -> std::io::Result<(std::fs::File, OwnedFd)> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    Ok((std::fs::File::from(read), write))
}
