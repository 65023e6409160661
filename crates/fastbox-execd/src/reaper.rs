//! The one place that collects child exit statuses.
//!
//! As PID 1 of a pid namespace (or a child subreaper) execd inherits every orphan, and each
//! must be reaped or it stays a zombie. If several parts of execd each called waitpid on
//! "their" children, a `waitpid(-1)` for orphans would steal statuses the command runner is
//! waiting for. So there is exactly one reaper: a task woken by SIGCHLD that calls waitpid and
//! hands each status to whoever registered that pid. Children are spawned with
//! `std::process::Command` (whose `Child` never waits on drop) through [`Reaper::spawn`] and
//! their status is awaited through the returned [`ExitWaiter`], never `Child::wait`. Nothing
//! in execd may call `Command::status()` or `output()`: those wait on their own.
//!
//! The registry lock is held from before fork until the pid is registered, and the reaper
//! takes it before dispatching, so a child that exits instantly is never mistaken for an
//! orphan. In [`ReapScope::Registered`] mode (tests, or execd running under another init)
//! only registered pids are waited for, so the statuses of unrelated children are untouched.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Notify, oneshot};

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Exited(i32),
    Signaled(i32),
}

impl ExitStatus {
    /// The shell convention: the exit code, or 128 + the signal number.
    pub fn code(self) -> i32 {
        match self {
            ExitStatus::Exited(c) => c,
            ExitStatus::Signaled(s) => 128 + s,
        }
    }

    pub fn success(self) -> bool {
        self == ExitStatus::Exited(0)
    }

    /// The text Go's `ExitError` prints, which the reference execd puts in tracebacks.
    pub fn describe(self) -> String {
        match self {
            ExitStatus::Exited(c) => format!("exit status {c}"),
            ExitStatus::Signaled(s) => match nix::sys::signal::Signal::try_from(s) {
                Ok(nix::sys::signal::Signal::SIGKILL) => "signal: killed".to_string(),
                Ok(sig) => format!(
                    "signal: {}",
                    sig.as_str().trim_start_matches("SIG").to_lowercase()
                ),
                Err(_) => format!("signal: {s}"),
            },
        }
    }
}

/// Which children the reaper waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReapScope {
    /// `waitpid(-1)`: execd is PID 1 or a subreaper and must reap orphans too.
    AnyChild,
    /// Only pids spawned through the reaper.
    Registered,
}

/// Resolves to a child's exit status once the reaper has collected it.
pub struct ExitWaiter(oneshot::Receiver<ExitStatus>);

impl Future for ExitWaiter {
    type Output = ExitStatus;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<ExitStatus> {
        // The reaper never drops a registered sender without sending, unless execd is
        // shutting down; report that as a kill.
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or(ExitStatus::Signaled(libc::SIGKILL)))
    }
}

#[derive(Clone)]
pub struct Reaper {
    inner: Arc<Inner>,
}

struct Inner {
    waiters: Mutex<HashMap<i32, oneshot::Sender<ExitStatus>>>,
    scope: ReapScope,
    kick: Notify,
}

impl Reaper {
    /// Installs the SIGCHLD handler and starts the reaper task. Must run inside a tokio runtime.
    pub fn start(scope: ReapScope) -> std::io::Result<Self> {
        let mut sigchld = signal(SignalKind::child())?;
        let inner = Arc::new(Inner {
            waiters: Mutex::new(HashMap::new()),
            scope,
            kick: Notify::new(),
        });
        let task_inner = Arc::clone(&inner);
        tokio::spawn(async move {
            loop {
                task_inner.reap();
                tokio::select! {
                    s = sigchld.recv() => if s.is_none() { return },
                    _ = task_inner.kick.notified() => {},
                }
            }
        });
        Ok(Reaper { inner })
    }

    /// Spawns `cmd` and registers its pid before any status for it can be dispatched.
    pub fn spawn(&self, cmd: &mut Command) -> std::io::Result<(Child, ExitWaiter)> {
        let (tx, rx) = oneshot::channel();
        let child = {
            let mut waiters = self.inner.waiters.lock().unwrap_or_else(|e| e.into_inner());
            let child = cmd.spawn()?;
            waiters.insert(child.id() as i32, tx);
            child
        };
        // In Registered mode a SIGCHLD that arrived before the insert found nothing to wait
        // for; look again now.
        self.inner.kick.notify_one();
        Ok((child, ExitWaiter(rx)))
    }

    /// Registers the child `fork` makes (it returns the child's pid) before any status for
    /// it can be dispatched: for children made without `Command` (isolated sessions).
    pub fn fork_registered(
        &self,
        fork: impl FnOnce() -> std::io::Result<i32>,
    ) -> std::io::Result<(i32, ExitWaiter)> {
        let (tx, rx) = oneshot::channel();
        let pid = {
            let mut waiters = self.inner.waiters.lock().unwrap_or_else(|e| e.into_inner());
            let pid = fork()?;
            waiters.insert(pid, tx);
            pid
        };
        self.inner.kick.notify_one();
        Ok((pid, ExitWaiter(rx)))
    }

    /// Number of children currently awaited (for diagnostics and tests).
    pub fn pending(&self) -> usize {
        self.inner.waiters.lock().map(|w| w.len()).unwrap_or(0)
    }
}

impl Inner {
    fn reap(&self) {
        match self.scope {
            ReapScope::AnyChild => loop {
                match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                    Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
                    Err(Errno::EINTR) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "waitpid failed");
                        return;
                    }
                    Ok(status) => self.dispatch(status),
                }
            },
            ReapScope::Registered => {
                let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
                let pids: Vec<i32> = waiters.keys().copied().collect();
                for pid in pids {
                    let exited = match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
                        Ok(status) => to_exit(status),
                        // Someone else reaped it; nothing more will ever come.
                        Err(Errno::ECHILD) => Some(ExitStatus::Signaled(libc::SIGKILL)),
                        Err(_) => None,
                    };
                    if let Some(status) = exited
                        && let Some(tx) = waiters.remove(&pid)
                    {
                        let _ = tx.send(status);
                    }
                }
            }
        }
    }

    fn dispatch(&self, status: WaitStatus) {
        let (Some(pid), Some(exit)) = (status.pid(), to_exit(status)) else {
            return;
        };
        let waiter = self
            .waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid.as_raw());
        match waiter {
            Some(tx) => {
                let _ = tx.send(exit);
            }
            None => tracing::debug!(pid = pid.as_raw(), "reaped orphan"),
        }
    }
}

fn to_exit(status: WaitStatus) -> Option<ExitStatus> {
    match status {
        WaitStatus::Exited(_, code) => Some(ExitStatus::Exited(code)),
        WaitStatus::Signaled(_, sig, _) => Some(ExitStatus::Signaled(sig as i32)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_shell_convention() {
        assert_eq!(ExitStatus::Exited(3).code(), 3);
        assert_eq!(ExitStatus::Signaled(9).code(), 137);
        assert_eq!(ExitStatus::Signaled(9).describe(), "signal: killed");
        assert_eq!(ExitStatus::Signaled(15).describe(), "signal: term");
        assert_eq!(ExitStatus::Exited(2).describe(), "exit status 2");
    }

    #[tokio::test]
    async fn registered_children_get_their_status() {
        let reaper = Reaper::start(ReapScope::Registered).unwrap();
        let (_c, w) = reaper
            .spawn(Command::new("sh").args(["-c", "exit 7"]))
            .unwrap();
        let (_d, v) = reaper.spawn(&mut Command::new("true")).unwrap();
        assert_eq!(w.await, ExitStatus::Exited(7));
        assert_eq!(v.await, ExitStatus::Exited(0));
        assert_eq!(reaper.pending(), 0);
    }
}
