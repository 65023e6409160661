//! The sandbox starter, run in a fresh single-threaded process (the `fastbox` binary
//! re-executed in helper mode, never a fork of a multi-threaded server).
//!
//! The helper (already in the sandbox's cgroup) joins the sandbox's network namespace, unshares the mount, pid, ipc,
//! uts, cgroup and time namespaces and forks the sandbox's init. The init becomes a session
//! leader (PID 1 in its pid namespace), sets up its root (mounts.rs), hardens itself
//! (hardening.rs) and execs execd with stdio on `/dev/null`: a tree CRIU can dump and restore.
//! The helper reports the init's pid (or the first error) and exits, so the init is reparented
//! and the helper leaves nothing behind.

mod hardening;
mod mounts;

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

use nix::sched::{CloneFlags, setns};
use nix::unistd::{ForkResult, Pid, fork, setsid};
use serde::{Deserialize, Serialize};

/// The argument that switches the `fastbox` binary into helper mode.
pub const HELPER_ARG: &str = "__sandbox-init";

/// `CLONE_NEWTIME` (not in nix 0.29).
const CLONE_NEWTIME: libc::c_int = 0x80;

/// What the helper needs; sent as JSON on its stdin.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitConfig {
    /// The mounted overlay that becomes `/`.
    pub root: PathBuf,
    /// Network namespace file to join.
    pub netns: PathBuf,
    pub hostname: String,
    /// Host path of the execd binary, bind-mounted read-only at `spec::EXECD_SANDBOX_PATH`.
    pub execd_host: PathBuf,
    /// argv of the init (execd and its arguments).
    pub argv: Vec<String>,
    /// Environment of the init (`KEY=VALUE`).
    pub env: Vec<String>,
    /// Keep `CAP_MKNOD`: only where a devices cgroup confines which nodes can be opened
    /// (cgroup v1); on v2 a sandbox with `CAP_MKNOD` could make and open a host disk's node.
    pub keep_mknod: bool,
    /// A sandbox offering isolated sessions: the seccomp variant that lets execd build them
    /// ([`crate::seccomp::isolation_policy`]) and the hidden read-only `/proc` their own
    /// `/proc` mounts need ([`ISOLATION_PROC`]).
    #[serde(default)]
    pub isolation: bool,
}

/// Where an isolation sandbox keeps a read-only `/proc` without masks, covered by an empty
/// read-only tmpfs at [`ISOLATION_DIR`]: the kernel lets a process in a user namespace mount
/// a new `/proc` only where one is already fully visible, and the sandbox's own has masks.
/// Nothing in the sandbox can reach it by path (it is covered, and no workload can unmount);
/// sessions' own mount namespaces cover the cover with their staging tmpfs.
pub const ISOLATION_DIR: &str = "/.fastbox/iso";
pub const ISOLATION_PROC: &str = "/.fastbox/iso/proc";

/// The helper's one-line answer on stdout.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InitReport {
    Started { pid: i32 },
    Failed { error: String },
}

/// Entry point of helper mode. Never returns.
pub fn helper_main() -> ! {
    let report = match run_helper() {
        Ok(pid) => InitReport::Started { pid },
        Err(error) => InitReport::Failed { error },
    };
    let code = matches!(report, InitReport::Failed { .. }) as i32;
    let mut out = std::io::stdout().lock();
    let _ = serde_json::to_writer(&mut out, &report);
    let _ = out.write_all(b"\n");
    let _ = out.flush();
    std::process::exit(code)
}

fn run_helper() -> Result<i32, String> {
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .map_err(|e| format!("read init config: {e}"))?;
    let config: InitConfig =
        serde_json::from_str(&input).map_err(|e| format!("parse init config: {e}"))?;

    // The caller has put this process into the sandbox's cgroup before sending the config.
    hardening::protect_from_oom()?;
    let netns = fs::File::open(&config.netns)
        .map_err(|e| format!("open netns {}: {e}", config.netns.display()))?;
    setns(&netns, CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("join netns {}: {e}", config.netns.display()))?;
    drop(netns);

    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP
        | CLONE_NEWTIME;
    // SAFETY: unshare has no memory-safety preconditions; this process is single-threaded.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(format!(
            "unshare namespaces: {}",
            std::io::Error::last_os_error()
        ));
    }

    // Everything the child needs is prepared before the fork.
    let prepared = Prepared::try_new(&config)?;
    let (err_read, err_write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;

    // SAFETY: the helper is single-threaded, so the child may run arbitrary code.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Child => {
            drop(err_read);
            let error = child_main(&config, &prepared);
            let mut pipe = fs::File::from(err_write);
            let _ = pipe.write_all(error.as_bytes());
            // SAFETY: _exit is always safe; skip destructors and atexit handlers of the parent.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => {
            drop(err_write);
            wait_for_exec(err_read, child)
        }
    }
}

/// Reads the child's error pipe: EOF without data means its exec succeeded.
fn wait_for_exec(err_read: OwnedFd, child: Pid) -> Result<i32, String> {
    let mut message = String::new();
    let _ = fs::File::from(err_read).read_to_string(&mut message);
    if message.is_empty() {
        Ok(child.as_raw())
    } else {
        let _ = nix::sys::wait::waitpid(child, None);
        Err(message)
    }
}

/// Values computed before the fork (allocation-heavy work stays out of the child's path).
struct Prepared {
    argv: Vec<CString>,
    env: Vec<CString>,
    seccomp: seccompiler::BpfProgram,
}

impl Prepared {
    fn try_new(config: &InitConfig) -> Result<Self, String> {
        let cstrings = |v: &[String]| {
            v.iter()
                .map(|s| CString::new(s.as_str()).map_err(|_| format!("NUL byte in {s:?}")))
                .collect::<Result<Vec<_>, _>>()
        };
        if config.argv.is_empty() {
            return Err("empty init argv".into());
        }
        Ok(Self {
            argv: cstrings(&config.argv)?,
            env: cstrings(&config.env)?,
            seccomp: hardening::seccomp_program(config.isolation)?,
        })
    }
}

/// The sandbox init: returns only with an error message.
fn child_main(config: &InitConfig, prepared: &Prepared) -> String {
    if let Err(e) = setsid() {
        return format!("setsid: {e}");
    }
    if let Err(e) = mounts::setup_root(config) {
        return e;
    }
    if let Err(e) = nix::unistd::sethostname(&config.hostname) {
        return format!("sethostname: {e}");
    }
    if let Err(e) = redirect_stdio() {
        return e;
    }
    if let Err(e) = hardening::apply(&prepared.seccomp, config.keep_mknod) {
        return e;
    }
    let err = nix::unistd::execve(&prepared.argv[0], &prepared.argv, &prepared.env)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    format!("exec {}: {err}", config.argv[0])
}

/// stdio to `/dev/null` (the sandbox's own), every other descriptor close-on-exec.
fn redirect_stdio() -> Result<(), String> {
    let null = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| format!("open /dev/null: {e}"))?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors; `null` stays valid for the call.
        if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
            return Err(format!("dup2 stdio: {}", std::io::Error::last_os_error()));
        }
    }
    // SAFETY: close_range only changes descriptor flags.
    unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    Ok(())
}
