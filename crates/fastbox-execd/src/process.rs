//! Launching children: the common setup every spawned process gets.
//!
//! Each child runs in its own process group (so a timeout or interrupt can kill everything it
//! started with one `kill(-pgid)`), gets `oom_score_adj` 0 back (execd itself runs at -1000 and
//! the value is inherited), optionally drops to another uid/gid, and never sees execd's access
//! token (the environment is always built explicitly). Everything done between fork and exec is
//! a plain syscall on memory prepared beforehand: no allocation, no locks.

use std::ffi::{CString, OsString};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{ChildStderr, ChildStdin, ChildStdout};

use crate::env::{self, EnvList};
use crate::identity::Credentials;
use crate::reaper::{ExitWaiter, Reaper};

/// The PATH used when the environment has none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where the child's standard streams go.
pub enum Stdio3 {
    /// stdout and stderr are pipes; stdin is a pipe when `stdin` is true, else empty.
    Pipes { stdin: bool },
    /// All three are this terminal, which also becomes the controlling tty of a new session.
    Tty(OwnedFd),
}

pub struct Launch {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: EnvList,
    pub cwd: Option<PathBuf>,
    pub user: Option<Credentials>,
    pub stdio: Stdio3,
}

/// A running child. Its exit status arrives through `exit`; its pid is also its process group.
pub struct Spawned {
    pub pid: i32,
    pub stdin: Option<ChildStdin>,
    pub stdout: Option<ChildStdout>,
    pub stderr: Option<ChildStderr>,
    pub exit: ExitWaiter,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("invalid argument: {0}")]
    Nul(#[from] std::ffi::NulError),
}

/// The filter every child gets on top of execd's own, once [`stack_default_filter`] ran.
static STACKED_FILTER: OnceLock<fastbox_seccomp::BpfProgram> = OnceLock::new();

/// In a sandbox offering isolated sessions execd holds the seccomp variant that lets it build
/// them; from here on every process it starts gets the default policy stacked on top (the
/// kernel applies the stricter answer of both), so workloads are filtered as in any sandbox.
pub fn stack_default_filter() -> Result<(), fastbox_seccomp::SeccompError> {
    let program = fastbox_seccomp::compile_default()?;
    let _ = STACKED_FILTER.set(program);
    Ok(())
}

/// The stacked filter, when there is one (see [`stack_default_filter`]).
pub fn stacked_filter() -> Option<&'static fastbox_seccomp::BpfProgram> {
    STACKED_FILTER.get()
}

/// Adds the stacked filter to `cmd` (for commands spawned without [`launch`]).
pub fn with_stacked_filter(cmd: &mut Command) -> &mut Command {
    if let Some(program) = stacked_filter() {
        // SAFETY: installing a prepared filter is one system call, async-signal-safe.
        unsafe {
            cmd.pre_exec(move || fastbox_seccomp::install(program).map_err(std::io::Error::other));
        }
    }
    cmd
}

/// Spawns `launch` through the reaper.
pub fn launch(reaper: &Reaper, launch: Launch) -> Result<Spawned, LaunchError> {
    let mut cmd = Command::new(&launch.program);
    cmd.args(&launch.args)
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k, v)));
    if let Some(cwd) = &launch.cwd {
        cmd.current_dir(cwd);
    }
    let tty = match launch.stdio {
        Stdio3::Pipes { stdin } => {
            // Not /dev/null: the sandbox's root filesystem may have no /dev at all. A pipe
            // whose write end is closed reads as EOF just the same.
            let stdin = if stdin {
                Stdio::piped()
            } else {
                let (reader, _writer) = std::io::pipe().map_err(|source| LaunchError::Spawn {
                    program: launch.program.to_string_lossy().into_owned(),
                    source,
                })?;
                Stdio::from(reader)
            };
            cmd.stdin(stdin)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            false
        }
        Stdio3::Tty(fd) => {
            let as_stdio = |fd: &OwnedFd| fd.try_clone().map(Stdio::from);
            let spawn_err = |source| LaunchError::Spawn {
                program: launch.program.to_string_lossy().into_owned(),
                source,
            };
            cmd.stdin(as_stdio(&fd).map_err(spawn_err)?)
                .stdout(as_stdio(&fd).map_err(spawn_err)?)
                .stderr(Stdio::from(fd));
            true
        }
    };
    let creds = launch.user.clone();
    let filter = stacked_filter();
    let oom_path = CString::new("/proc/self/oom_score_adj")?;
    // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
    // syscalls on data allocated before the fork (`creds`, `oom_path`).
    unsafe {
        cmd.pre_exec(move || {
            if tty {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::setpgid(0, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let fd = libc::open(oom_path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
            }
            if let Some(c) = &creds
                && (libc::setgroups(c.groups.len(), c.groups.as_ptr()) < 0
                    || libc::setgid(c.gid) < 0
                    || libc::setuid(c.uid) < 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(program) = filter {
                fastbox_seccomp::install(program).map_err(std::io::Error::other)?;
            }
            Ok(())
        });
    }
    let (mut child, exit) = reaper
        .spawn(&mut cmd)
        .map_err(|source| LaunchError::Spawn {
            program: launch.program.to_string_lossy().into_owned(),
            source,
        })?;
    let pid = child.id() as i32;
    // Converting std pipes to tokio ones cannot fail for fresh pipes; a failure would mean the
    // stream is simply unavailable.
    Ok(Spawned {
        pid,
        stdin: child
            .stdin
            .take()
            .and_then(|s| ChildStdin::from_std(s).ok()),
        stdout: child
            .stdout
            .take()
            .and_then(|s| ChildStdout::from_std(s).ok()),
        stderr: child
            .stderr
            .take()
            .and_then(|s| ChildStderr::from_std(s).ok()),
        exit,
    })
}

/// Sends `sig` to the process group `pgid`; a group that is already gone is not an error.
pub fn signal_group(pgid: i32, sig: Signal) {
    if pgid > 1 {
        let _ = killpg(Pid::from_raw(pgid), sig);
    }
}

/// Finds `name` in the PATH of `env`.
pub fn which(name: &str, env: &EnvList) -> Option<PathBuf> {
    let path = env::get(env, "PATH").unwrap_or(DEFAULT_PATH);
    path.split(':')
        .filter(|d| d.starts_with('/'))
        .map(|d| Path::new(d).join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The shell commands run under: bash when the sandbox has it, else `/bin/sh`.
pub fn shell(env: &EnvList) -> OsString {
    which("bash", env)
        .map(OsString::from)
        .unwrap_or_else(|| OsString::from("/bin/sh"))
}
