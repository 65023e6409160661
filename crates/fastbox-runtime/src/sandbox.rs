//! Start and stop one sandbox: guard, act, and roll back whatever was built when a step fails.

use std::fs;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cgroup::{Cgroup, CgroupError, CgroupRoot};
use crate::confine::{ConfineError, Dir};
use crate::init::{HELPER_ARG, InitConfig, InitReport};
use crate::rootfs::{Rootfs, RootfsError};
use crate::spec::{EXECD_PORT, EXECD_SANDBOX_PATH, SandboxSpec};

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {id}: rootfs: {source}")]
    Rootfs { id: String, source: RootfsError },
    #[error("sandbox {id}: cgroup: {source}")]
    Cgroup { id: String, source: CgroupError },
    #[error("sandbox {id}: {what}: {source}")]
    Io {
        id: String,
        what: String,
        source: io::Error,
    },
    #[error("sandbox {id}: start failed: {message}")]
    Start { id: String, message: String },
    /// The sandbox's tree refused a host write (a symlink, a node or a swap where fastbox
    /// writes): the tree is the tenant's, so this fails closed.
    #[error("sandbox {id}: {what}: {source}")]
    Confined {
        id: String,
        what: &'static str,
        source: ConfineError,
    },
    #[error("sandbox {id}: did not exit within {timeout:?} after SIGKILL")]
    StuckAfterKill { id: String, timeout: Duration },
}

/// A running sandbox as the runtime knows it; enough to stop, checkpoint or inspect it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxHandle {
    pub id: String,
    pub prefix: String,
    /// Host pid of the sandbox init (PID 1 inside).
    pub init_pid: i32,
    /// The init's start time (clock ticks after boot): guards against pid reuse.
    pub init_start_ticks: u64,
    /// The sandbox directory.
    pub dir: PathBuf,
    /// Digest of the execd binary it runs.
    pub execd_digest: String,
    /// The network namespace it lives in.
    pub netns: PathBuf,
}

impl SandboxHandle {
    /// A handle naming only what sandbox `id` owns by name (its directory and cgroup), for
    /// removing what an interrupted start left: no process is signalled through it, the
    /// cgroup kill takes whatever runs.
    pub fn unstarted(id: &str, prefix: &str, dir: PathBuf) -> Self {
        Self {
            id: id.to_string(),
            prefix: prefix.to_string(),
            init_pid: 0,
            init_start_ticks: u64::MAX,
            dir,
            execd_digest: String::new(),
            netns: PathBuf::new(),
        }
    }

    pub fn rootfs(&self) -> Rootfs {
        Rootfs::at(&self.dir)
    }

    /// Whether the init is still alive (and not a zombie).
    pub fn is_running(&self) -> bool {
        self.is_our_init() && process_state(self.init_pid).is_some_and(|s| s != 'Z' && s != 'X')
    }

    /// True while `init_pid` still names our init and not a process that reused the pid.
    fn is_our_init(&self) -> bool {
        process_start_ticks(self.init_pid) == Some(self.init_start_ticks)
    }
}

/// Start `spec` with the helper binary `helper` (the `fastbox` executable).
pub fn start(
    spec: &SandboxSpec,
    helper: &Path,
    cgroups: &CgroupRoot,
) -> Result<SandboxHandle, SandboxError> {
    let id = spec.id.clone();
    let rootfs =
        Rootfs::create(&spec.dir, &spec.lower, spec.disk_bytes, None).map_err(|source| {
            SandboxError::Rootfs {
                id: id.clone(),
                source,
            }
        })?;
    let result = write_identity(
        &rootfs.root,
        &spec.id,
        &spec.hostname,
        spec.resolv_conf.as_deref(),
    )
    .and_then(|()| {
        Cgroup::create(cgroups, &spec.prefix, &spec.id, &spec.limits).map_err(|source| {
            SandboxError::Cgroup {
                id: id.clone(),
                source,
            }
        })
    })
    .and_then(|cgroup| {
        let config = InitConfig {
            root: rootfs.root.clone(),
            netns: spec.netns.clone(),
            hostname: spec.hostname.clone(),
            execd_host: spec.execd.path.clone(),
            argv: execd_argv(spec),
            env: spec.env.clone(),
            keep_mknod: cgroups.version() == crate::cgroup::CgroupVersion::V1,
            isolation: spec.isolation,
        };
        run_helper(&id, helper, &config, &cgroup).inspect_err(|_| {
            let _ = cgroup.kill_all();
            let _ = cgroup.remove();
        })
    });
    match result {
        Ok(init_pid) => Ok(SandboxHandle {
            id,
            prefix: spec.prefix.clone(),
            init_pid,
            init_start_ticks: process_start_ticks(init_pid).unwrap_or_default(),
            dir: spec.dir.clone(),
            execd_digest: spec.execd.digest.clone(),
            netns: spec.netns.clone(),
        }),
        Err(e) => {
            let _ = rootfs.destroy();
            let _ = fs::remove_dir_all(&spec.dir);
            Err(e)
        }
    }
}

/// Kill every process of the sandbox and remove its cgroup, mounts and files. Idempotent.
pub fn destroy(handle: &SandboxHandle, cgroups: &CgroupRoot) -> Result<(), SandboxError> {
    let id = handle.id.clone();
    stop_processes(handle, cgroups)?;
    handle
        .rootfs()
        .destroy()
        .map_err(|source| SandboxError::Rootfs {
            id: id.clone(),
            source,
        })?;
    match fs::remove_dir_all(&handle.dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(SandboxError::Io {
            id,
            what: format!("remove {}", handle.dir.display()),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// SIGKILL the init (which takes its whole pid namespace down), then anything left in the
/// cgroup; wait until the init is gone and remove the cgroup.
pub fn stop_processes(handle: &SandboxHandle, cgroups: &CgroupRoot) -> Result<(), SandboxError> {
    let id = handle.id.clone();
    let cgroup = Cgroup::open(cgroups, &handle.prefix, &handle.id);
    let pidfd = pidfd_open(handle.init_pid).filter(|_| handle.is_our_init());
    if let Some(pidfd) = pidfd {
        // SAFETY: pidfd_send_signal on a pidfd we own; no memory is passed.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                pidfd.as_raw_fd(),
                libc::SIGKILL,
                0,
                0,
            )
        };
        // A frozen tree (a fenced node's sandbox, a lazy clone whose daemon's guard froze
        // it): every process gets SIGKILL while frozen, then the group thaws, so none runs
        // code of its own again. Thawing it with only init killed let the others run until
        // init's end took them (a fenced sandbox ran again, briefly, on its node's return).
        if let Some(cgroup) = cgroup.as_ref().filter(|c| c.is_frozen().unwrap_or(false)) {
            let _ = cgroup.kill_all();
        }
        let timeout = Duration::from_secs(10);
        if !wait_pidfd(&pidfd, timeout) {
            return Err(SandboxError::StuckAfterKill { id, timeout });
        }
    }
    if let Some(cgroup) = cgroup {
        cgroup
            .kill_all()
            .and_then(|()| cgroup.remove())
            .map_err(|source| SandboxError::Cgroup { id, source })?;
    }
    Ok(())
}

/// The argv of the sandbox init: execd, its arguments, then the entrypoint after `--`.
fn execd_argv(spec: &SandboxSpec) -> Vec<String> {
    let mut argv = vec![
        EXECD_SANDBOX_PATH.to_string(),
        "--port".to_string(),
        EXECD_PORT.to_string(),
    ];
    argv.extend(spec.execd_args.iter().cloned());
    if spec.isolation {
        argv.push("--isolation".to_string());
    }
    if !spec.entrypoint.is_empty() {
        argv.push("--".to_string());
        argv.extend(spec.entrypoint.iter().cloned());
    }
    argv
}

/// `/etc/hostname`, `/etc/hosts` and `/etc/resolv.conf` of this sandbox, written into its
/// root through the confinement module: `/etc` is resolved inside the root (a symlinked
/// `/etc` or parent stays in the sandbox), and each file is replaced, never followed or
/// opened (a symlink, FIFO or device node there is replaced by a regular file).
fn write_identity(
    root: &Path,
    id: &str,
    hostname: &str,
    resolv_conf: Option<&str>,
) -> Result<(), SandboxError> {
    let confined = |what: &'static str| {
        let id = id.to_string();
        move |source| SandboxError::Confined { id, what, source }
    };
    let etc = Dir::open_root(root)
        .and_then(|root| root.create_dir_all("etc", 0o755))
        .map_err(confined("open /etc"))?;
    let hosts = format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n"
    );
    let mut files = vec![("hostname", format!("{hostname}\n")), ("hosts", hosts)];
    if let Some(resolv) = resolv_conf {
        files.push(("resolv.conf", resolv.to_string()));
    }
    for (name, content) in files {
        etc.write_file(name, content.as_bytes(), 0o644)
            .map_err(confined("write the identity files"))?;
    }
    Ok(())
}

/// Gives a running (restored) sandbox its own identity: `hostname` in its UTS namespace,
/// and `/etc/hostname`, `/etc/hosts` and (if given) `/etc/resolv.conf` in its writable layer.
pub fn set_identity(
    handle: &SandboxHandle,
    hostname: &str,
    resolv_conf: Option<&str>,
) -> Result<(), SandboxError> {
    let id = handle.id.clone();
    let io_err = |what: &str| {
        let id = id.clone();
        let what = what.to_string();
        move |source| SandboxError::Io { id, what, source }
    };
    if !handle.is_running() {
        return Err(SandboxError::Start {
            id,
            message: "set identity: the sandbox is not running".into(),
        });
    }
    let uts = fs::File::open(format!("/proc/{}/ns/uts", handle.init_pid))
        .map_err(io_err("open the UTS namespace"))?;
    let name = hostname.to_string();
    // setns acts on the calling thread: do it on a thread that exits afterwards.
    std::thread::spawn(move || -> io::Result<()> {
        nix::sched::setns(&uts, nix::sched::CloneFlags::CLONE_NEWUTS)?;
        nix::unistd::sethostname(&name)?;
        Ok(())
    })
    .join()
    .map_err(|_| io::Error::other("the hostname thread panicked"))
    .and_then(|r| r)
    .map_err(io_err("set the hostname"))?;
    write_identity(&handle.rootfs().root, &handle.id, hostname, resolv_conf)
}

/// Spawn the helper, put it into the cgroup, send the config and read its report.
fn run_helper(
    id: &str,
    helper: &Path,
    config: &InitConfig,
    cgroup: &Cgroup,
) -> Result<i32, SandboxError> {
    let start_err = |message: String| SandboxError::Start {
        id: id.to_string(),
        message,
    };
    let mut child = Command::new(helper)
        .arg(HELPER_ARG)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_clear()
        .spawn()
        .map_err(|e| start_err(format!("spawn helper {}: {e}", helper.display())))?;
    let joined = cgroup
        .add_pid(child.id() as i32)
        .map_err(|e| start_err(format!("join cgroup: {e}")));
    if let Err(e) = joined {
        let _ = child.kill();
        let _ = child.wait();
        return Err(e);
    }
    let payload = serde_json::to_vec(config).expect("init config serializes");
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(&payload);
    }
    let output = child
        .wait_with_output()
        .map_err(|e| start_err(format!("wait for helper: {e}")))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    match serde_json::from_str::<InitReport>(stdout.trim()) {
        Ok(InitReport::Started { pid }) => Ok(pid),
        Ok(InitReport::Failed { error }) => Err(start_err(error)),
        Err(_) => Err(start_err(format!(
            "helper exited with {} and no report; stderr: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        ))),
    }
}

/// A pidfd for `pid`, or None when it no longer exists.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes plain integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative return is a fresh descriptor we now own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Wait until the process behind `pidfd` has exited (and been reaped by its parent, or became
/// a zombie of a parent we do not control). Returns false on timeout.
pub(crate) fn wait_pidfd(pidfd: &OwnedFd, timeout: Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) if n > 0 => return true,
            Ok(_) if left.is_zero() => return false,
            _ => {}
        }
    }
}

/// The state letter of `/proc/<pid>/stat`, or None when the process does not exist.
pub(crate) fn process_state(pid: i32) -> Option<char> {
    stat_fields(pid)?.first()?.chars().next()
}

/// Field 22 of `/proc/<pid>/stat`: the start time in clock ticks after boot.
pub(crate) fn process_start_ticks(pid: i32) -> Option<u64> {
    stat_fields(pid)?.get(19)?.parse().ok()
}

/// The resident memory of process `root` and its descendants (`/proc/<pid>/statm`), in bytes.
pub fn tree_resident_bytes(root: i32) -> u64 {
    let pids: Vec<i32> = fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let parent = |pid: i32| stat_fields(pid).and_then(|f| f.get(1)?.parse::<i32>().ok());
    let parents: Vec<(i32, i32)> = pids
        .iter()
        .filter_map(|&pid| Some((pid, parent(pid)?)))
        .collect();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let p = tree[i];
        tree.extend(parents.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    tree.iter()
        .filter_map(|pid| {
            let statm = fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
            statm.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .sum::<u64>()
        * page
}

/// The fields of `/proc/<pid>/stat` after the command name (field 3 onwards).
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    Some(after.split_whitespace().map(str::to_string).collect())
}
