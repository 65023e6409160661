//! The agent's side of the fence guard: starting it, renewing, the takeover, releasing.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fastbox_fastlet::fence::CgroupSource;
use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::{FenceGuardError, FencedMarker, Identity, LOCK_FILE, MAX_LINE, SUBCOMMAND};

/// How long [`FenceGuard::spawn`] waits for `ready`.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the first [`FenceGuard::renew`] waits for `armed`.
const ARMED_TIMEOUT: Duration = Duration::from_secs(5);

/// What [`FenceGuard::spawn`] starts.
#[derive(Debug, Clone)]
pub struct FenceGuardConfig {
    pub data_dir: PathBuf,
    pub prefix: String,
    pub cgroups: CgroupSource,
    /// The `fastbox` executable (by default this process's).
    pub exe: PathBuf,
}

impl FenceGuardConfig {
    /// The guard of the node of `data_dir` and `prefix`, on the detected cgroups, run from
    /// this process's executable.
    pub fn new(data_dir: &Path, prefix: &str) -> Result<Self, FenceGuardError> {
        Ok(FenceGuardConfig {
            data_dir: data_dir.to_path_buf(),
            prefix: prefix.to_string(),
            cgroups: CgroupSource::Detect,
            exe: std::env::current_exe().map_err(FenceGuardError::Exe)?,
        })
    }
}

/// The agent's handle on its running guard. Dropping it closes the pipe, as the agent's end
/// does (a pending deadline is then fenced at).
#[derive(Debug)]
pub struct FenceGuard {
    pid: u32,
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    /// The guard's stdout until it said `armed` (then closed).
    unarmed: Mutex<Option<ChildStdout>>,
    lock_path: PathBuf,
}

impl FenceGuard {
    /// Starts the guard and waits until it is ready.
    pub fn spawn(cfg: &FenceGuardConfig) -> Result<FenceGuard, FenceGuardError> {
        let data_dir =
            std::path::absolute(&cfg.data_dir).map_err(|cause| FenceGuardError::File {
                what: "resolve",
                path: cfg.data_dir.clone(),
                cause,
            })?;
        let mut command = Command::new(&cfg.exe);
        command
            .arg(SUBCOMMAND)
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--prefix")
            .arg(&cfg.prefix)
            .arg("--cgroups")
            .arg(cfg.cgroups.name())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .current_dir("/");
        // SAFETY: setsid(2) is async-signal-safe and touches no memory of the parent.
        unsafe {
            command.pre_exec(|| nix::unistd::setsid().map(drop).map_err(io::Error::from));
        }
        let mut child = command.spawn().map_err(|cause| FenceGuardError::Spawn {
            exe: cfg.exe.clone(),
            cause,
        })?;
        let (stdin, mut stdout) = (child.stdin.take(), child.stdout.take());
        let ready = match &mut stdout {
            Some(stdout) => read_line(stdout, READY_TIMEOUT),
            None => Err(io::Error::other("no pipe from the guard")),
        };
        let not_ready = match ready {
            Ok(Some(line)) if line == "ready" => None,
            Ok(Some(line)) => Some(format!("it said {line:?}")),
            Ok(None) => Some("it exited (its error is above)".to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = not_ready {
            let _ = child.kill();
            let _ = child.wait();
            return Err(FenceGuardError::NotReady(why));
        }
        Ok(FenceGuard {
            pid: child.id(),
            child: Some(child),
            stdin,
            unarmed: Mutex::new(stdout),
            lock_path: data_dir.join(LOCK_FILE),
        })
    }

    /// The guard's pid.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Tells the guard the lease was renewed: the node must be frozen at `fence_at` unless
    /// renewed again. The first renewal waits until the guard confirms it, then makes a
    /// previous agent's guard exit (see the module docs).
    pub fn renew(&self, fence_at: SystemTime) -> Result<(), FenceGuardError> {
        let millis = fence_at
            .duration_since(UNIX_EPOCH)
            .map_err(|_| FenceGuardError::BeforeEpoch)?
            .as_millis();
        let mut unarmed = self.unarmed.lock().unwrap_or_else(PoisonError::into_inner);
        self.say(&format!("renew {millis}\n"))?;
        if let Some(stdout) = unarmed.as_mut() {
            match read_line(stdout, ARMED_TIMEOUT) {
                Ok(Some(line)) if line == "armed" => {}
                Ok(Some(line)) => {
                    return Err(FenceGuardError::NotArmed(format!("it said {line:?}")));
                }
                Ok(None) => return Err(FenceGuardError::NotArmed("it exited".into())),
                Err(e) => return Err(FenceGuardError::NotArmed(e.to_string())),
            }
            *unarmed = None;
            if let Some(old) = take_over(&self.lock_path, self.pid) {
                tracing::info!(
                    old,
                    guard = self.pid,
                    "the previous agent's fence guard was told to exit: this one took over"
                );
            }
        }
        Ok(())
    }

    /// The agent stops on purpose. A pending deadline is still fenced at (nobody renews it
    /// any more) unless a newer agent takes over before.
    pub fn release(mut self) {
        if let Err(e) = self.say("release\n") {
            tracing::warn!("fence guard release: {e}");
        }
        self.stdin = None;
    }

    fn say(&self, line: &str) -> Result<(), FenceGuardError> {
        let mut stdin = self
            .stdin
            .as_ref()
            .ok_or_else(|| FenceGuardError::Write(io::ErrorKind::BrokenPipe.into()))?;
        // One short write: a line never interleaves with another.
        stdin
            .write_all(line.as_bytes())
            .map_err(FenceGuardError::Write)
    }
}

impl Drop for FenceGuard {
    fn drop(&mut self) {
        self.stdin = None;
        // The guard may live on until its deadline: reap it without waiting here.
        if let Some(mut child) = self.child.take() {
            let _ = std::thread::Builder::new()
                .name("fence-guard-reap".into())
                .spawn(move || child.wait());
        }
    }
}

/// The guard of `fastbox node`: warns when the previous run was fenced (the marker stays for
/// reconciliation), then starts the guard.
pub fn start_for_node(data_dir: &Path, prefix: &str) -> Result<FenceGuard, FenceGuardError> {
    match FencedMarker::read(data_dir) {
        Ok(None) => {}
        Ok(Some(m)) => tracing::warn!(
            fenced_at_unix_ms = m.fenced_at_unix_ms,
            deadline_unix_ms = m.deadline_unix_ms,
            frozen = m.frozen,
            errors = m.errors.len(),
            "this node was fenced: its sandboxes were frozen when its lease deadline passed ({}); \
             they stay frozen until reconciled with the server",
            m.reason
        ),
        Err(e) => tracing::warn!("this node was fenced, but its marker cannot be read: {e}"),
    }
    FenceGuard::spawn(&FenceGuardConfig::new(data_dir, prefix)?)
}

/// Sends the guard named in the lock file `SIGUSR1` when it is alive and not `own`; its pid
/// when it was sent.
fn take_over(lock_path: &Path, own: u32) -> Option<u32> {
    let old = Identity::parse(&fs::read_to_string(lock_path).ok()?)?;
    if old.pid == own {
        return None;
    }
    // The pidfd pins whatever process has the pid now; the start time then says it is the
    // guard the file names (a process that reused the pid started later).
    let pidfd = pidfd_open(old.pid).ok()?;
    if Identity::of(old.pid) != Some(old) {
        return None;
    }
    match pidfd_signal(&pidfd, libc::SIGUSR1) {
        Ok(()) => Some(old.pid),
        Err(e) => {
            tracing::debug!(old = old.pid, "previous fence guard: {e}");
            None
        }
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::other("pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: the descriptor was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn pidfd_signal(pidfd: &OwnedFd, signal: i32) -> io::Result<()> {
    // SAFETY: pidfd_send_signal with a valid pidfd, a signal number, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads one line (without its newline) from a pipe within `timeout`; `None` at end of file.
fn read_line(from: &mut ChildStdout, timeout: Duration) -> io::Result<Option<String>> {
    let deadline = Instant::now() + timeout;
    let mut line = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ));
        }
        // Rounded up: a wait never ends before its timeout.
        let millis = u16::try_from(left.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(from.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(millis)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let mut byte = [0u8];
        match from.read(&mut byte) {
            Ok(0) => return Ok(None),
            Ok(_) if byte[0] == b'\n' => return Ok(Some(String::from_utf8_lossy(&line).into())),
            Ok(_) if line.len() >= MAX_LINE => return Err(io::Error::other("line too long")),
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_file_names_its_holder_and_takeover_spares_its_own_guard() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(LOCK_FILE);
        fs::write(&path, "999999999 1 and an older, longer line\n").unwrap();
        let lock = super::super::guard::take_lock(&path).unwrap();
        let me = Identity::of(std::process::id()).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), me.line());
        // Never signals the named process when it is the caller's own guard.
        assert_eq!(take_over(&path, me.pid), None);
        drop(lock);
        // A stale identity (no such process or another start time) is never signalled.
        fs::write(&path, format!("{} {}\n", me.pid, me.start + 1)).unwrap();
        assert_eq!(take_over(&path, 0), None);
    }
}
