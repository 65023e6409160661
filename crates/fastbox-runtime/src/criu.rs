//! CRIU, driven through its command line: version checks, dump and restore of a sandbox's
//! process tree. The CLI keeps the full log of every run next to the images, which is what
//! makes failures debuggable.
//!
//! A sandbox lives in a network namespace and behind a read-only execd bind mount that both
//! come from the host. CRIU runs inside the sandbox's network namespace (dump and restore),
//! so the namespace is not part of a checkpoint: a dump neither walks the host's conntrack
//! table for it (twice, about 13 ms of the freeze here) nor runs the network lock and unlock
//! actions, and a restore's tasks are born in the slot's namespace. The execd mount is dumped
//! as an *external* resource with a fixed key and supplied anew at restore
//! (`--external mnt[..]`), so a checkpoint can be restored into another slot, another root
//! and with exactly the execd binary it was taken with. Checkpoints taken before CRIU joined
//! the namespace name it as external (`net[<inode>]:fastbox-net`); a restore still hands it
//! over (`--inherit-fd`) for them.

use std::ffi::OsString;
use std::fs;
use std::io;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Instant;

use crate::spec::EXECD_SANDBOX_PATH;

/// The oldest CRIU that works on the kernels fastbox runs on (DESIGN §7).
pub const MIN_VERSION: (u32, u32) = (4, 2);
/// The command that installs a suitable CRIU.
pub const SETUP_COMMAND: &str = "scripts/setup.sh";

const NETNS_KEY: &str = "fastbox-net";
const EXECD_KEY: &str = "fastbox-execd";
/// The descriptor number under which the target network namespace is passed to a restore.
const NETNS_FD: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("criu not found at {0}: run {SETUP_COMMAND} to install CRIU >= 4.2")]
    Missing(PathBuf),
    #[error("criu {found} at {path} is too old: fastbox needs CRIU >= 4.2 (run {SETUP_COMMAND})")]
    TooOld { path: PathBuf, found: String },
    #[error("could not read the version of {path}: {output}")]
    Version { path: PathBuf, output: String },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("criu {action} failed ({status}); log {log}:\n{tail}")]
    Failed {
        action: &'static str,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("criu restore wrote no pidfile {0}")]
    NoPid(PathBuf),
    #[error("criu {action} did not finish by its deadline and was killed; log {log}")]
    DeadlineExceeded { action: &'static str, log: PathBuf },
}

/// A CRIU binary known to be new enough.
#[derive(Debug, Clone)]
pub struct Criu {
    /// The CRIU given (a binary, or the wrapper script of a private installation).
    pub path: PathBuf,
    pub version: String,
    /// What runs it: `path`, or the wrapper's own command line (see [`direct_argv`]).
    argv: Vec<OsString>,
    /// Where CRIU's kernel-feature cache lives when `/run` cannot hold it (see [`kdat`] and
    /// [`Criu::with_private_run`]).
    kdat_run: Option<std::ffi::CString>,
}

/// What a dump needs to know about the sandbox.
#[derive(Debug, Clone)]
pub struct DumpRequest<'a> {
    pub init_pid: i32,
    pub netns: &'a Path,
    pub images: &'a Path,
    /// Keep the sandbox running after the dump (a live snapshot) instead of killing it.
    pub leave_running: bool,
    /// An executable CRIU runs once the images are written, while the tree is still frozen
    /// (CRIU's `post-dump` action; CRIU runs it for its other actions too, naming the action
    /// in `CRTOOLS_SCRIPT_ACTION`): what must be captured consistently with memory.
    pub post_dump: Option<&'a Path>,
    /// Mounts of the sandbox that come from the host (its volumes), each dumped as an
    /// external resource under a key: `(mount path inside the sandbox, key)`. A restore
    /// supplies a source for each key ([`RestoreRequest::external_mounts`]).
    pub external_mounts: &'a [(String, String)],
    /// Hand the images to a streamer listening in `images` (`--stream`,
    /// [`crate::image_stream`]). CRIU then writes no `stats-dump`: its log is written at
    /// the info level, whose timestamps give the freeze ([`crate::criu_stats::frozen_from_log`]).
    pub stream: bool,
}

/// What a restore needs: the images, and the new home of the tree.
#[derive(Debug, Clone)]
pub struct RestoreRequest<'a> {
    /// The checkpoint images; only read, so many restores can share them.
    pub images: &'a Path,
    /// Where CRIU writes its log and the pidfile (private to this restore).
    pub work_dir: &'a Path,
    /// The mounted overlay that becomes the restored tree's root.
    pub root: &'a Path,
    /// The network namespace file of the target slot.
    pub netns: &'a Path,
    /// The execd binary on the host (same digest as at dump time).
    pub execd_host: &'a Path,
    /// `cgroup.procs` files the restored tree is put into.
    pub cgroup_procs: Vec<PathBuf>,
    /// Close established TCP connections instead of restoring them (clones).
    pub tcp_close: bool,
    /// Restore lazily (`--lazy-pages`): a `criu lazy-pages` daemon listening in `work_dir`
    /// ([`crate::lazy::daemon::LazyDaemon`]) supplies the tasks' private memory on demand.
    pub lazy_pages: bool,
    /// Kill the CRIU run if it has not ended by then (`None`: no limit). A lazy restore
    /// whose pages never come waits forever otherwise.
    pub deadline: Option<Instant>,
    /// The source of each external mount the dump named: `(key, host directory)`, bind
    /// mounted by CRIU (with the flags the source's mount has).
    pub external_mounts: &'a [(String, PathBuf)],
}

impl Criu {
    /// Use the CRIU at `path`, refusing versions older than [`MIN_VERSION`].
    pub fn at(path: &Path) -> Result<Self, CriuError> {
        let argv = direct_argv(path).unwrap_or_else(|| vec![path.as_os_str().to_owned()]);
        let output = Command::new(&argv[0])
            .args(&argv[1..])
            .arg("--version")
            .output()
            .map_err(|_| CriuError::Missing(path.to_path_buf()))?;
        let text = String::from_utf8_lossy(&output.stdout).to_string();
        let version = parse_version(&text).ok_or_else(|| CriuError::Version {
            path: path.to_path_buf(),
            output: text.trim().to_string(),
        })?;
        let found = format!(
            "{}.{}{}",
            version.0,
            version.1,
            version.2.map(|p| format!(".{p}")).unwrap_or_default()
        );
        if (version.0, version.1) < MIN_VERSION {
            return Err(CriuError::TooOld {
                path: path.to_path_buf(),
                found,
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            version: found,
            argv,
            kdat_run: None,
        })
    }

    /// This CRIU with `dir` as its private `/run` when the host's `/run` is not a tmpfs, so
    /// CRIU keeps its kernel-feature cache there (see [`kdat`]). `dir` is a directory of the
    /// caller's own on a tmpfs, made and checked by it (the node's is
    /// `DATA_DIR/run/criu`, on the instance's tmpfs); it is opened without following a
    /// symlink. Without one (the host's `/run` is a tmpfs, or `dir` is not on one), CRIU
    /// runs with the host's `/run` and probes the kernel at every run when it cannot cache.
    pub fn with_private_run(mut self, dir: &Path) -> Result<Self, CriuError> {
        self.kdat_run = kdat::run_dir(dir)?;
        Ok(self)
    }

    /// A `criu` command; when `/run` is not a tmpfs, it runs in a private mount namespace
    /// whose `/run` is a tmpfs directory, so CRIU keeps its kernel-feature cache (see [`kdat`]).
    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.argv[0]);
        cmd.args(&self.argv[1..]);
        self.in_private_run(cmd)
    }

    /// `cmd`, run in CRIU's private `/run` where one is needed.
    fn in_private_run(&self, mut cmd: Command) -> Command {
        if let Some(dir) = self.kdat_run.clone() {
            // SAFETY: unshare and mount are async-signal-safe syscalls; the path was
            // allocated before the fork.
            unsafe {
                cmd.pre_exec(move || kdat::enter_private_run(&dir));
            }
        }
        cmd
    }

    /// A `criu` command for `criu lazy-pages`, the daemon of a lazy restore
    /// ([`crate::lazy::daemon::LazyDaemon::start`] adds its arguments): like every run, in
    /// CRIU's private `/run` where one is needed, so the daemon finds the kernel-feature cache
    /// instead of probing the kernel (130-490 ms here).
    ///
    /// With `freeze_on_failure` (a cgroup's freeze file and value), the daemon runs under
    /// `/bin/sh`, which writes the value there when the daemon fails, whoever is still
    /// around: if this process dies (`kill -9`), the daemon loses its page server and fails,
    /// and the restored sandbox stops instead of running on with zero pages. The descriptors
    /// the daemon inherits pass through the shell.
    pub fn lazy_pages_command(&self, freeze_on_failure: Option<(&Path, &str)>) -> Command {
        // A hangup does not end the daemon or its guard: they outlive whoever started them.
        const GUARD: &str = r#"trap '' HUP; file=$1 value=$2; shift 2; "$@"; status=$?; [ "$status" -eq 0 ] || echo "$value" > "$file"; exit "$status""#;
        match freeze_on_failure {
            None => self.command(),
            Some((file, value)) => {
                let mut sh = Command::new("/bin/sh");
                sh.args(["-c", GUARD, "sh"])
                    .arg(file)
                    .arg(value)
                    .args(&self.argv);
                self.in_private_run(sh)
            }
        }
    }

    /// Dump the tree rooted at the sandbox init into `images`.
    pub fn dump(&self, req: &DumpRequest<'_>) -> Result<(), CriuError> {
        fs::create_dir_all(req.images).map_err(|source| CriuError::Io {
            what: "create",
            path: req.images.to_path_buf(),
            source,
        })?;
        let netns = fs::File::open(req.netns).map_err(|source| CriuError::Io {
            what: "open",
            path: req.netns.to_path_buf(),
            source,
        })?;
        // The images directory is handed down as a descriptor and named by its
        // `/proc/self/fd` path: CRIU connects to the streamer's socket in it, and a socket's
        // path is at most 107 bytes, whatever the data directory's path is.
        let images = fs::File::open(req.images).map_err(|source| CriuError::Io {
            what: "open",
            path: req.images.to_path_buf(),
            source,
        })?;
        let mut cmd = self.command();
        let (netns_fd, images_fd) = (netns.as_raw_fd(), images.as_raw_fd());
        // SAFETY: setns, dup2 and fcntl are async-signal-safe; both descriptors were opened
        // before the fork and stay open until the run ends.
        unsafe {
            cmd.pre_exec(move || {
                join_netns(netns_fd)?;
                inherit_fd(images_fd, IMAGES_FD)
            });
        }
        cmd.arg("dump")
            .arg("--tree")
            .arg(req.init_pid.to_string())
            .arg("--images-dir")
            .arg(format!("/proc/self/fd/{IMAGES_FD}"))
            .args([
                "--log-file",
                "dump.log",
                if req.stream { "-v3" } else { "-v2" },
            ])
            .arg("--external")
            .arg(format!("mnt[{EXECD_SANDBOX_PATH}]:{EXECD_KEY}"))
            .args(COMMON_OPTIONS);
        for (mount_path, key) in req.external_mounts {
            cmd.arg("--external")
                .arg(format!("mnt[{mount_path}]:{key}"));
        }
        if req.leave_running {
            cmd.arg("--leave-running");
        }
        if let Some(script) = req.post_dump {
            cmd.arg("--action-script").arg(script);
        }
        if req.stream {
            cmd.arg("--stream");
        }
        let finished = run_recorded(cmd, req.images, None)?;
        drop((netns, images));
        check(finished.output, "dump", &req.images.join("dump.log"))
    }

    /// Restore `images` into the given root, network namespace and cgroups; returns the host
    /// pid of the restored init. With a `launcher` (made ahead for the same namespace and
    /// cgroups), CRIU starts in it and the cgroup join and fork are already done. A run still
    /// going at `req.deadline` is killed ([`CriuError::DeadlineExceeded`]).
    pub fn restore(
        &self,
        req: &RestoreRequest<'_>,
        launcher: Option<RestoreLauncher>,
    ) -> Result<i32, CriuError> {
        let pidfile = req.work_dir.join("restore.pid");
        let _ = fs::remove_file(&pidfile);
        let args = restore_args(req, &pidfile);
        let finished = match launcher {
            Some(launcher) => launcher.launch(&self.argv, &args, req.work_dir, req.deadline)?,
            None => {
                let joined = JoinedFds::open(req.netns, &req.cgroup_procs)?;
                let mut cmd = self.command();
                cmd.args(&args);
                joined.install(&mut cmd);
                let finished = run_recorded(cmd, req.work_dir, req.deadline)?;
                drop(joined);
                finished
            }
        };
        let log = req.work_dir.join("restore.log");
        if finished.killed_at_deadline {
            return Err(CriuError::DeadlineExceeded {
                action: "restore",
                log,
            });
        }
        check(finished.output, "restore", &log)?;
        let pid = fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| CriuError::NoPid(pidfile.clone()))?;
        Ok(pid)
    }

    /// A process made now that becomes `criu restore` later ([`Criu::restore`]): `helper`
    /// (the fastbox binary) run with [`LAUNCHER_ARG`], already in the cgroups of
    /// `cgroup_procs` and holding the network namespace `netns`. Joining a cgroup costs the
    /// first migration an RCU grace period (about 10 ms here), which a restore then does not
    /// pay, nor the fork and the helper's start.
    pub fn launcher(
        &self,
        helper: &Path,
        netns: &Path,
        cgroup_procs: &[PathBuf],
    ) -> Result<RestoreLauncher, CriuError> {
        let joined = JoinedFds::open(netns, cgroup_procs)?;
        // The command arrives on stdin; EOF without one (the launcher dropped) ends it.
        let mut cmd = Command::new(helper);
        cmd.arg(LAUNCHER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = &self.kdat_run {
            cmd.arg(std::ffi::OsStr::from_bytes(dir.as_bytes()));
        }
        joined.install(&mut cmd);
        let child = cmd.spawn().map_err(|source| CriuError::Io {
            what: "start",
            path: PathBuf::from("criu launcher"),
            source,
        })?;
        Ok(RestoreLauncher { child: Some(child) })
    }
}

/// A waiting `criu restore` (see [`Criu::launcher`]); dropping it ends the process.
#[derive(Debug)]
pub struct RestoreLauncher {
    child: Option<std::process::Child>,
}

impl RestoreLauncher {
    /// Whether the process still waits for its command.
    pub fn is_waiting(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    fn launch(
        mut self,
        criu: &[OsString],
        args: &[OsString],
        pid_dir: &Path,
        deadline: Option<Instant>,
    ) -> Result<Finished, CriuError> {
        let io_err = |source| CriuError::Io {
            what: "start",
            path: PathBuf::from("criu launcher"),
            source,
        };
        let mut child = self
            .child
            .take()
            .ok_or_else(|| io_err(io::Error::other("the launcher was already used")))?;
        record_pid(pid_dir, child.id());
        take_callers_priority(child.id());
        let watchdog = match deadline.map(|d| Watchdog::arm(&child, d)).transpose() {
            Ok(watchdog) => watchdog,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io_err(e));
            }
        };
        let line = criu.iter().chain(args).fold(Vec::new(), |mut line, arg| {
            if !line.is_empty() {
                line.push(0);
            }
            line.extend_from_slice(arg.as_bytes());
            line
        });
        if let Some(mut stdin) = child.stdin.take()
            && let Err(e) = stdin.write_all(&line)
        {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io_err(e));
        }
        let output = child.wait_with_output().map_err(io_err)?;
        Ok(Finished::new(output, watchdog))
    }
}

/// Gives process `pid` (a launcher made ahead by some other thread) the nice value of the
/// calling thread: a restore runs at the priority of whoever asked for it, a create's at full,
/// a background refill's lowered.
fn take_callers_priority(pid: u32) {
    // SAFETY: getpriority/setpriority only read and set scheduling weights. getpriority may
    // legitimately return -1, so errno is cleared first and checked after.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        if nice == -1 && *libc::__errno_location() != 0 {
            return;
        }
        libc::setpriority(libc::PRIO_PROCESS, pid, nice);
    }
}

impl Drop for RestoreLauncher {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The file a CRIU run records its pid in: the images directory of a dump, the work
/// directory of a restore.
const PID_FILE: &str = "criu.pid";

/// Runs `cmd` (CRIU) to its end, its pid recorded in `pid_dir` first: a CRIU run outlives a
/// crash of its caller, and the pid tells a later run to wait for it ([`wait_for_criu`]).
/// A run still going at `deadline` is killed.
fn run_recorded(
    mut cmd: Command,
    pid_dir: &Path,
    deadline: Option<Instant>,
) -> Result<Finished, CriuError> {
    let io_err = |what| {
        move |source| CriuError::Io {
            what,
            path: PathBuf::from("criu"),
            source,
        }
    };
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err("run"))?;
    record_pid(pid_dir, child.id());
    let watchdog = match deadline.map(|d| Watchdog::arm(&child, d)).transpose() {
        Ok(watchdog) => watchdog,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io_err("watch")(e));
        }
    };
    let output = child.wait_with_output().map_err(io_err("wait for"))?;
    Ok(Finished::new(output, watchdog))
}

/// A CRIU run that ended: its output, and whether its deadline ended it.
struct Finished {
    output: std::process::Output,
    /// Killed by its [`Watchdog`] (a run that succeeded as the deadline passed is not).
    killed_at_deadline: bool,
}

impl Finished {
    fn new(output: std::process::Output, watchdog: Option<Watchdog>) -> Self {
        let fired = watchdog.is_some_and(Watchdog::disarm);
        Self {
            killed_at_deadline: fired && !output.status.success(),
            output,
        }
    }
}

/// Kills a child process at a deadline unless disarmed first. It signals through a pidfd
/// ([`crate::lazy::pidfd`]), so a child that was reaped in the meantime is never confused
/// with a later process of the same pid.
struct Watchdog {
    disarm: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<bool>,
}

impl Watchdog {
    /// Arms the watchdog on `child`, which must not be reaped yet.
    fn arm(child: &std::process::Child, deadline: Instant) -> io::Result<Self> {
        let pidfd = crate::lazy::pidfd::PidFd::open(child.id())?;
        let (disarm, disarmed) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("criu-deadline".into())
            .spawn(move || {
                let left = deadline.saturating_duration_since(Instant::now());
                match disarmed.recv_timeout(left) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        let _ = pidfd.kill();
                        true
                    }
                    _ => false,
                }
            })?;
        Ok(Self { disarm, thread })
    }

    /// Stops the watchdog; true when it fired.
    fn disarm(self) -> bool {
        drop(self.disarm);
        self.thread.join().unwrap_or(false)
    }
}

/// Records the CRIU run's pid and its start time (`PID START`): pids wrap quickly on a busy
/// host, and a later process given the same pid must not pass for that run. Written whole
/// (a temporary file renamed), so a reader never sees it half written.
fn record_pid(dir: &Path, pid: u32) {
    let start = start_time(pid).unwrap_or_default();
    let tmp = dir.join(format!("{PID_FILE}.tmp"));
    if fs::write(&tmp, format!("{pid} {start}")).is_ok() {
        let _ = fs::rename(&tmp, dir.join(PID_FILE));
    }
}

/// Process `pid`'s start time (clock ticks after boot, `/proc/PID/stat` field 22) and its
/// state letter; `None` once it is gone.
fn stat_of(pid: u32) -> Option<(u64, char)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may hold spaces and parentheses.
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace();
    let state = rest.next()?.chars().next()?;
    // Field 22 overall: the 20th after the state.
    let start = rest.nth(18)?.parse().ok()?;
    Some((start, state))
}

fn start_time(pid: u32) -> Option<u64> {
    stat_of(pid).map(|(start, _)| start)
}

/// Waits (at most `timeout`) until the CRIU run that recorded its pid in `dir` (a dump's
/// images directory, a restore's work directory) no longer runs, e.g. one left behind by a
/// crash of the process that started it. True when none runs.
pub fn wait_for_criu(dir: &Path, timeout: std::time::Duration) -> bool {
    let recorded = fs::read_to_string(dir.join(PID_FILE)).unwrap_or_default();
    let mut fields = recorded.split_whitespace();
    let Some(pid) = fields.next().and_then(|p| p.parse::<u32>().ok()) else {
        return true;
    };
    // (A file of an older version holds the pid alone.)
    let started = fields.next().and_then(|s| s.parse::<u64>().ok());
    let deadline = std::time::Instant::now() + timeout;
    // The pid names that run while its process started when recorded, is a `criu` (not a
    // later reuse of the pid) and has not exited.
    let running = || {
        stat_of(pid).is_some_and(|(start, state)| {
            started.is_none_or(|s| s == start) && state != 'Z' && is_criu(pid)
        })
    };
    while running() {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Whether process `pid` is a CRIU: named `criu`, or run from a `criu` binary through a
/// private installation's dynamic loader (then its name is the loader's).
/// An idle launcher (`fastbox __criu-launcher …/run/criu`) is not one: it names CRIU's run
/// directory, and becomes CRIU only when given a command.
fn is_criu(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "criu")
        || fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|line| {
            let args: Vec<&[u8]> = line.split(|b| *b == 0).collect();
            !args.contains(&LAUNCHER_ARG.as_bytes())
                && args.iter().any(|arg| {
                    Path::new(std::ffi::OsStr::from_bytes(arg)).file_name() == Some("criu".as_ref())
                })
        })
}

/// Whether the dump into `images` finished successfully: CRIU writes its `stats-dump` last,
/// and only when the dump (its post-dump action included) succeeded.
pub fn dump_succeeded(images: &Path) -> bool {
    images.join(crate::criu_stats::DUMP_FILE).is_file()
}

/// Beside a private installation's wrapper script `bin/criu`: the command line the wrapper
/// executes, one argument per line, `{prefix}` standing for the installation directory
/// (`scripts/install-criu.sh` writes it).
const EXEC_ARGS_SUFFIX: &str = ".exec";

/// The command line that runs the CRIU of wrapper `path` without the wrapper's shell (a few
/// milliseconds a run), when the installation says what it is; `None` otherwise.
fn direct_argv(path: &Path) -> Option<Vec<OsString>> {
    let mut file = path.as_os_str().to_owned();
    file.push(EXEC_ARGS_SUFFIX);
    let text = fs::read_to_string(&file).ok()?;
    let prefix = fs::canonicalize(path)
        .ok()?
        .parent()?
        .parent()?
        .to_path_buf();
    let prefix = prefix.to_str()?;
    let argv: Vec<OsString> = text
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| OsString::from(l.replace("{prefix}", prefix)))
        .collect();
    Path::new(argv.first()?).is_file().then_some(argv)
}

/// The argument that makes the fastbox binary a CRIU launcher ([`launcher_main`]).
pub const LAUNCHER_ARG: &str = "__criu-launcher";

/// The launcher process (`fastbox __criu-launcher [KDAT_RUN_DIR]`): waits for a command on
/// stdin (the CRIU path and its arguments, NUL-separated, then EOF), enters CRIU's private
/// mount namespace when given its `/run` directory (now, so that it holds the mounts made
/// since the launcher started), and becomes CRIU. Exits 125 when it gets no command.
pub fn launcher_main() -> ! {
    use std::io::Read as _;
    let mut input = Vec::new();
    if std::io::stdin().read_to_end(&mut input).is_err() || input.is_empty() {
        std::process::exit(125);
    }
    let mut parts = input
        .split(|b| *b == 0)
        .map(|p| std::ffi::OsStr::from_bytes(p).to_os_string());
    let Some(criu) = parts.next() else {
        std::process::exit(125)
    };
    if let Some(dir) = std::env::args_os().nth(2)
        && let Ok(dir) = std::ffi::CString::new(dir.as_bytes())
        && let Err(e) = kdat::enter_private_run(&dir)
    {
        eprintln!("criu launcher: private /run: {e}");
        std::process::exit(125);
    }
    let e = Command::new(&criu).args(parts).exec();
    eprintln!("criu launcher: exec {}: {e}", criu.to_string_lossy());
    std::process::exit(127);
}

/// The arguments of `criu restore` for `req`.
fn restore_args(req: &RestoreRequest<'_>, pidfile: &Path) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = vec![
        "restore".into(),
        "--images-dir".into(),
        req.images.into(),
        "--work-dir".into(),
        req.work_dir.into(),
        "--log-file".into(),
        "restore.log".into(),
        "-v2".into(),
        "--root".into(),
        req.root.into(),
        // Only checkpoints that name the namespace as external use it (see the module doc).
        "--inherit-fd".into(),
        format!("fd[{NETNS_FD}]:{NETNS_KEY}").into(),
        "--external".into(),
        format!("mnt[{EXECD_KEY}]:{}", req.execd_host.display()).into(),
        "--restore-detached".into(),
        "--pidfile".into(),
        pidfile.into(),
    ];
    args.extend(COMMON_OPTIONS.iter().map(Into::into));
    for (key, source) in req.external_mounts {
        args.push("--external".into());
        let mut arg = std::ffi::OsString::from(format!("mnt[{key}]:"));
        arg.push(source.as_os_str());
        args.push(arg);
    }
    if req.tcp_close {
        args.push("--tcp-close".into());
    }
    if req.lazy_pages {
        args.push("--lazy-pages".into());
    }
    args
}

/// The network namespace and `cgroup.procs` files a restoring CRIU process joins before it
/// execs: it enters the namespace and also holds it as descriptor [`NETNS_FD`] (what
/// `--inherit-fd` hands to checkpoints that name the namespace as external), and writes its
/// own pid to each procs file.
struct JoinedFds {
    netns: fs::File,
    procs: Vec<fs::File>,
}

impl JoinedFds {
    fn open(netns: &Path, cgroup_procs: &[PathBuf]) -> Result<Self, CriuError> {
        let netns = fs::File::open(netns).map_err(|source| CriuError::Io {
            what: "open",
            path: netns.to_path_buf(),
            source,
        })?;
        let procs = cgroup_procs
            .iter()
            .map(|p| {
                fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|source| CriuError::Io {
                        what: "open",
                        path: p.clone(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { netns, procs })
    }

    /// Adds the joining to `cmd`'s child (the descriptors must outlive its spawn).
    fn install(&self, cmd: &mut Command) {
        let netns_fd = self.netns.as_raw_fd();
        let proc_fds: Vec<i32> = self.procs.iter().map(|f| f.as_raw_fd()).collect();
        // SAFETY: the closure only calls async-signal-safe functions (getpid, write, dup2)
        // on descriptors opened before the fork, and formats into a stack buffer.
        unsafe {
            cmd.pre_exec(move || {
                let mut buf = [0u8; 12];
                let text = format_pid(libc::getpid(), &mut buf);
                for fd in &proc_fds {
                    if libc::write(*fd, text.as_ptr().cast(), text.len()) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if libc::dup2(netns_fd, NETNS_FD) < 0 {
                    return Err(io::Error::last_os_error());
                }
                join_netns(netns_fd)
            });
        }
    }
}

/// Makes the calling process a member of the network namespace `fd` refers to. Called in a
/// forked child before it execs CRIU: async-signal-safe.
/// The descriptor number a dump's images directory has in CRIU.
const IMAGES_FD: i32 = 100;

/// In a child before exec: `fd` at number `target`, kept across the exec.
fn inherit_fd(fd: i32, target: i32) -> io::Result<()> {
    // SAFETY: dup2 and fcntl on descriptors the child inherited; no memory is passed.
    let r = unsafe {
        if fd == target {
            libc::fcntl(fd, libc::F_SETFD, 0)
        } else {
            libc::dup2(fd, target)
        }
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn join_netns(fd: i32) -> io::Result<()> {
    // SAFETY: setns only reads the descriptor.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Options every dump and restore shares.
const COMMON_OPTIONS: &[&str] = &[
    // Restored tasks go into the cgroup fastbox prepared; CRIU leaves cgroups alone.
    "--manage-cgroups=ignore",
    // Listening and established sockets of execd and user code.
    "--tcp-established",
    "--file-locks",
    // The slot's namespace is fresh and unshared: there is nothing to lock.
    "--network-lock",
    "skip",
];

/// Writes the decimal `pid` into `buf` and returns the used part (no allocation).
fn format_pid(pid: i32, buf: &mut [u8; 12]) -> &[u8] {
    let mut n = pid.unsigned_abs();
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Ok for a successful run; otherwise the error lines of its log.
fn check(output: std::process::Output, action: &'static str, log: &Path) -> Result<(), CriuError> {
    if output.status.success() {
        return Ok(());
    }
    Err(CriuError::Failed {
        action,
        status: output.status.to_string(),
        log: log.to_path_buf(),
        tail: log_tail(log, &String::from_utf8_lossy(&output.stderr)),
    })
}

/// What a CRIU log says about a failure: its error lines, else its last 15 lines (`fallback`,
/// e.g. the run's stderr, stands in for a log that cannot be read).
pub(crate) fn log_tail(log: &Path, fallback: &str) -> String {
    let text = fs::read_to_string(log).unwrap_or_else(|_| fallback.to_string());
    let tail: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") || l.contains("rror ("))
        .collect();
    if tail.is_empty() {
        text.lines()
            .rev()
            .take(15)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    } else {
        tail.join("\n")
    }
}

/// CRIU probes the kernel at every start (about 35 ms here: the compat vDSO alone forks a
/// helper) unless it finds its cache `/run/criu.kdat`, which it only writes when `/run` is a
/// tmpfs (the cache is per boot). On hosts whose `/run` is on disk, a directory of the
/// caller's own on a tmpfs (the node's `DATA_DIR/run/criu`, never a fixed name in a
/// world-writable place) is bound over `/run` in a mount namespace private to each CRIU run;
/// nothing else CRIU does touches `/run`.
mod kdat {
    use std::ffi::CString;
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;
    use std::time::{Duration, SystemTime};

    use super::CriuError;

    /// CRIU's temporary cache file; a crash between its create and rename leaves it behind,
    /// and CRIU then never writes the cache again (it creates it with `O_EXCL`).
    const STALE_TMP: &std::ffi::CStr = c"criu.kdat.tmp";

    fn is_tmpfs(path: &Path) -> bool {
        nix::sys::statfs::statfs(path)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
    }

    /// The directory to bind over `/run`: `dir`, or `None` when `/run` can hold the cache
    /// itself or `dir` is not on a tmpfs (CRIU then just probes every time). A cache file
    /// a crashed run left half-written is removed.
    pub(super) fn run_dir(dir: &Path) -> Result<Option<CString>, CriuError> {
        if is_tmpfs(Path::new("/run")) {
            return Ok(None);
        }
        let c = CString::new(dir.as_os_str().as_bytes()).map_err(|e| CriuError::Io {
            what: "open",
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
        // SAFETY: open(2) with a NUL-terminated path; the result is checked.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(CriuError::Io {
                what: "open CRIU's private /run",
                path: dir.to_path_buf(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: a descriptor just returned by open(2), owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let on_tmpfs = nix::sys::statfs::fstatfs(&fd)
            .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
        if !on_tmpfs {
            return Ok(None);
        }
        // SAFETY: an all-zero `stat` is a valid value for fstatat(2) to fill in.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstatat(2) on our directory descriptor, not following a symlink.
        let found = unsafe {
            libc::fstatat(
                fd.as_raw_fd(),
                STALE_TMP.as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        } == 0;
        let modified = SystemTime::UNIX_EPOCH + Duration::from_secs(st.st_mtime.max(0) as u64);
        let old = SystemTime::now()
            .duration_since(modified)
            .is_ok_and(|age| age > Duration::from_secs(30));
        if found && old {
            // SAFETY: unlinkat(2) of a name in our directory descriptor.
            unsafe { libc::unlinkat(fd.as_raw_fd(), STALE_TMP.as_ptr(), 0) };
        }
        Ok(Some(c))
    }

    /// In the forked child before exec: a private mount namespace (slave, so nothing
    /// propagates back to the host) whose `/run` is `dir`.
    pub(super) fn enter_private_run(dir: &CString) -> io::Result<()> {
        // SAFETY: plain syscalls on NUL-terminated strings that outlive the calls.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) < 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            ) < 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::mount(
                dir.as_ptr(),
                c"/run".as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) < 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// `Version: 4.2` or `Version: 4.2.1` in `criu --version` output.
fn parse_version(text: &str) -> Option<(u32, u32, Option<u32>)> {
    let line = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?;
    let mut parts = line.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some((parts.next()??, parts.next()??, parts.next().flatten()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_parse_from_criu_output() {
        assert_eq!(parse_version("Version: 4.2\n"), Some((4, 2, None)));
        assert_eq!(
            parse_version("Version: 3.17.1\nGitID: x\n"),
            Some((3, 17, Some(1)))
        );
        assert_eq!(parse_version("nonsense"), None);
    }

    #[test]
    fn pids_format_without_allocation() {
        let mut buf = [0u8; 12];
        assert_eq!(format_pid(1, &mut buf), b"1");
        assert_eq!(format_pid(4194304, &mut buf), b"4194304");
    }

    /// A shell that waits 30 s, `names` after its script in its command line, in a process
    /// group of its own (so [`kill_group`] takes its `sleep` too).
    fn shell_named(names: &[&str]) -> std::process::Child {
        use std::os::unix::process::CommandExt as _;
        Command::new("sh")
            .args(["-c", "sleep 30; true"])
            .args(names)
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    }

    fn kill_group(child: &mut std::process::Child) {
        let group = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL).unwrap();
        child.wait().unwrap();
    }

    /// Waits until process `pid` runs the program whose arguments hold `arg` (a spawned
    /// child shows the parent's command line until it has exec'd).
    fn wait_for_exec(pid: u32, arg: &str) {
        let deadline = Instant::now() + std::time::Duration::from_secs(5);
        while !fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|line| line.split(|b| *b == 0).any(|a| a == arg.as_bytes()))
        {
            assert!(Instant::now() < deadline, "{pid} never ran the command");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_recorded_pid_counts_only_for_the_process_that_had_it() {
        let dir = tempfile::tempdir().unwrap();
        // A live CRIU-looking process: its argv names a `criu`.
        let mut criu_like = shell_named(&["/x/bin/criu"]);
        wait_for_exec(criu_like.id(), "/x/bin/criu");
        record_pid(dir.path(), criu_like.id());
        let recorded = fs::read_to_string(dir.path().join(PID_FILE)).unwrap();
        assert_eq!(recorded.split_whitespace().count(), 2, "{recorded}");
        let wait = std::time::Duration::from_millis(200);
        assert!(!wait_for_criu(dir.path(), wait), "it runs");
        // The same pid with another start time: a later process that reused the pid.
        let pid = criu_like.id();
        fs::write(dir.path().join(PID_FILE), format!("{pid} 1")).unwrap();
        assert!(wait_for_criu(dir.path(), wait));
        kill_group(&mut criu_like);
        record_pid(dir.path(), pid);
        assert!(wait_for_criu(dir.path(), wait), "gone");
    }

    #[test]
    fn an_idle_launcher_is_not_a_criu() {
        let mut launcher = shell_named(&[LAUNCHER_ARG, "/var/lib/fastbox/run/criu"]);
        wait_for_exec(launcher.id(), LAUNCHER_ARG);
        assert!(!is_criu(launcher.id()));
        kill_group(&mut launcher);
    }

    #[test]
    fn a_run_past_its_deadline_is_killed_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let clock = Instant::now();
        let deadline = clock + std::time::Duration::from_millis(100);
        let finished = run_recorded(sleeper, dir.path(), Some(deadline)).unwrap();
        assert!(finished.killed_at_deadline);
        assert!(clock.elapsed() < std::time::Duration::from_secs(10));
        assert!(
            dir.path().join(PID_FILE).is_file(),
            "the run recorded its pid"
        );

        let far = Instant::now() + std::time::Duration::from_secs(30);
        let finished = run_recorded(Command::new("true"), dir.path(), Some(far)).unwrap();
        assert!(!finished.killed_at_deadline && finished.output.status.success());
        let finished = run_recorded(Command::new("false"), dir.path(), None).unwrap();
        assert!(!finished.killed_at_deadline && !finished.output.status.success());
    }

    #[test]
    fn lazy_restores_add_lazy_pages_and_nothing_else() {
        let path = Path::new("/x");
        let req = RestoreRequest {
            images: path,
            work_dir: path,
            root: path,
            netns: path,
            execd_host: path,
            cgroup_procs: Vec::new(),
            tcp_close: true,
            lazy_pages: false,
            deadline: None,
            external_mounts: &[],
        };
        let eager = restore_args(&req, path);
        assert!(!eager.iter().any(|a| a == "--lazy-pages"));
        let lazy = restore_args(
            &RestoreRequest {
                lazy_pages: true,
                ..req.clone()
            },
            path,
        );
        assert_eq!(lazy.len(), eager.len() + 1);
        assert_eq!(
            lazy.last().map(|a| a.as_os_str()),
            Some("--lazy-pages".as_ref())
        );
        let volumes = [("fastbox-vol-work".to_string(), PathBuf::from("/run/v/work"))];
        let with_volumes = restore_args(
            &RestoreRequest {
                external_mounts: &volumes,
                ..req
            },
            path,
        );
        let pair = ["--external", "mnt[fastbox-vol-work]:/run/v/work"];
        assert!(
            with_volumes
                .windows(2)
                .any(|w| w[0] == pair[0] && w[1] == pair[1]),
            "{with_volumes:?}"
        );
    }

    #[test]
    fn a_private_installation_runs_without_its_wrapper() {
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().canonicalize().unwrap();
        fs::create_dir_all(prefix.join("bin")).unwrap();
        fs::create_dir_all(prefix.join("lib64")).unwrap();
        fs::write(prefix.join("lib64/ld.so"), b"").unwrap();
        let wrapper = prefix.join("bin/criu");
        fs::write(&wrapper, b"#!/bin/sh\n").unwrap();
        assert_eq!(
            direct_argv(&wrapper),
            None,
            "no criu.exec: the wrapper runs"
        );
        fs::write(
            prefix.join("bin/criu.exec"),
            "{prefix}/lib64/ld.so\n--library-path\n{prefix}/usr/lib:{prefix}/lib\n--argv0\ncriu\n{prefix}/usr/sbin/criu\n",
        )
        .unwrap();
        let p = prefix.display();
        let expected: Vec<OsString> = [
            format!("{p}/lib64/ld.so"),
            "--library-path".into(),
            format!("{p}/usr/lib:{p}/lib"),
            "--argv0".into(),
            "criu".into(),
            format!("{p}/usr/sbin/criu"),
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        assert_eq!(direct_argv(&wrapper), Some(expected));
        fs::remove_file(prefix.join("lib64/ld.so")).unwrap();
        assert_eq!(
            direct_argv(&wrapper),
            None,
            "a loader that is gone: the wrapper runs"
        );
    }

    #[test]
    fn a_criu_behind_a_loader_counts_as_running() {
        let mut shell = Command::new("/bin/sh")
            .args(["-c", "read line", "/opt/criu/usr/sbin/criu"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let mut other = Command::new("/bin/sh")
            .args(["-c", "read line", "/opt/criu/usr/sbin/not-criu"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        assert!(is_criu(shell.id()), "an argument names a criu binary");
        assert!(!is_criu(other.id()));
        for child in [&mut shell, &mut other] {
            drop(child.stdin.take());
            child.wait().unwrap();
        }
        assert!(!is_criu(shell.id()), "gone");
    }

    #[test]
    fn missing_criu_names_the_setup_command() {
        let err = Criu::at(Path::new("/nonexistent/criu")).unwrap_err();
        assert!(err.to_string().contains(SETUP_COMMAND), "{err}");
    }
}
