//! One sandbox's cgroup: `{prefix}/{id}` in every managed hierarchy.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::root::{Hierarchy, validate_id, validate_prefix};
use super::{
    CPU_PERIOD_US, CgroupError, CgroupLimits, CgroupRoot, CgroupVersion, Controller, DEVICE_RULES,
    MIN_CPU_MILLIS, device_bpf, fs as cgfs,
};

/// How long [`Cgroup::kill_all`] waits for the group to empty.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long [`Cgroup::remove`] retries while exiting tasks still hold the group.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long [`Cgroup::freeze`] and [`Cgroup::thaw`] wait for the state to settle.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest cpu limit accepted: 10 000 CPUs (far below the kernel's quota ceiling).
const MAX_CPU_MILLIS: u64 = 10_000_000;

/// One sandbox's cgroup.
#[derive(Debug, Clone)]
pub struct Cgroup {
    root: CgroupRoot,
    prefix: String,
    id: String,
}

/// What CRIU's `--cgroup-root [controller:]/path` needs for one hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriuCgroupRoot {
    /// The v1 hierarchy as CRIU names it (`memory`, `cpu,cpuacct`); `None` on v2.
    pub controller: Option<String>,
    /// The cgroup's path inside the hierarchy (as `/proc/<pid>/cgroup` shows it).
    pub path: PathBuf,
}

impl CriuCgroupRoot {
    /// The `--cgroup-root` argument value.
    pub fn to_arg(&self) -> String {
        match &self.controller {
            Some(c) => format!("{c}:{}", self.path.display()),
            None => self.path.display().to_string(),
        }
    }
}

/// `cgroup.procs` files opened in advance, so that a child can join the cgroup between
/// `fork` and `exec` without allocating (see [`ProcsFiles::join_current`]).
#[derive(Debug)]
pub struct ProcsFiles {
    files: Vec<File>,
}

impl ProcsFiles {
    /// Moves the calling process into the cgroup (`0` written to each `cgroup.procs` means
    /// "the writer"). Async-signal-safe: one `write(2)` per hierarchy, no allocation; fit for
    /// `pre_exec` and for a freshly forked child. Must run before the process unshares its
    /// cgroup namespace.
    pub fn join_current(&self) -> io::Result<()> {
        for mut file in &self.files {
            file.write_all(b"0")?;
        }
        Ok(())
    }
}

impl Cgroup {
    /// Creates `{prefix}/{id}` in every hierarchy of `root` and applies `limits`. Missing
    /// prefix directories are created (v1 cpuset: with the parent's cpus and mems; v2: with
    /// cpu, memory and pids enabled in each ancestor's `cgroup.subtree_control`). The device
    /// allow-list is applied ([`Cgroup::apply_device_policy`]). An existing `{prefix}/{id}` is
    /// an error; on any failure nothing created here is left behind.
    pub fn create(
        root: &CgroupRoot,
        prefix: &str,
        id: &str,
        limits: &CgroupLimits,
    ) -> Result<Cgroup, CgroupError> {
        validate_prefix(prefix)?;
        validate_id(id)?;
        validate_limits(limits)?;
        let cgroup = Cgroup {
            root: root.clone(),
            prefix: prefix.to_string(),
            id: id.to_string(),
        };
        cgroup.require_controllers(limits)?;
        let mut created: Vec<PathBuf> = Vec::new();
        let result = cgroup.make(&mut created).and_then(|()| {
            cgroup.configure_defaults()?;
            cgroup.set_limits(limits)
        });
        if let Err(e) = result {
            for dir in created.iter().rev() {
                let _ = cgfs::rmdir_tree(dir, root.kernel());
            }
            return Err(e);
        }
        tracing::debug!(cgroup = %cgroup.rel().display(), ?limits, "cgroup created");
        Ok(cgroup)
    }

    /// Renames the cgroup to `{prefix}/{new_id}` in every hierarchy, processes and limits
    /// included (cgroup v1 allows it; v2 refuses, and the caller then makes a new one).
    /// Hierarchies renamed before a failure are renamed back.
    pub fn rename(self, new_id: &str) -> Result<Cgroup, CgroupError> {
        validate_id(new_id)?;
        let renamed = Cgroup {
            id: new_id.to_string(),
            ..self.clone()
        };
        let hierarchies = self.root.hierarchies();
        for (i, h) in hierarchies.iter().enumerate() {
            let (from, to) = (self.leaf(h), renamed.leaf(h));
            if let Err(source) = std::fs::rename(&from, &to) {
                for done in &hierarchies[..i] {
                    let _ = std::fs::rename(renamed.leaf(done), self.leaf(done));
                }
                return Err(CgroupError::Io {
                    op: "rename",
                    path: from,
                    source,
                });
            }
        }
        Ok(renamed)
    }

    /// The existing cgroup `{prefix}/{id}`, if any hierarchy has it (for recovery and
    /// teardown after a restart).
    pub fn open(root: &CgroupRoot, prefix: &str, id: &str) -> Option<Cgroup> {
        validate_prefix(prefix).ok()?;
        validate_id(id).ok()?;
        let cgroup = Cgroup {
            root: root.clone(),
            prefix: prefix.to_string(),
            id: id.to_string(),
        };
        cgroup
            .root
            .hierarchies()
            .iter()
            .any(|h| cgroup.leaf(h).is_dir())
            .then_some(cgroup)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn version(&self) -> CgroupVersion {
        self.root.version()
    }

    /// The cgroup's directory in every hierarchy.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.root
            .hierarchies()
            .iter()
            .map(|h| self.leaf(h))
            .collect()
    }

    /// The `cgroup.procs` file in every hierarchy: a process is in the sandbox's cgroup when
    /// its pid has been written to each.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.paths()
            .into_iter()
            .map(|p| p.join("cgroup.procs"))
            .collect()
    }

    /// Opens every `cgroup.procs` for writing, for [`ProcsFiles::join_current`] in a child.
    pub fn open_procs(&self) -> Result<ProcsFiles, CgroupError> {
        let files = self
            .procs_files()
            .iter()
            .map(|path| {
                let mut opts = OpenOptions::new();
                opts.write(true);
                if !self.root.kernel() {
                    opts.create(true).truncate(true);
                }
                opts.open(path).map_err(cgfs::io_err("open", path))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ProcsFiles { files })
    }

    /// Moves process `pid` (all its threads) into the cgroup, in every hierarchy. Do it
    /// before the process forks or unshares its cgroup namespace.
    pub fn add_pid(&self, pid: i32) -> Result<(), CgroupError> {
        let value = pid.to_string();
        for path in self.procs_files() {
            cgfs::write(&path, &value, self.root.kernel())?;
        }
        Ok(())
    }

    /// The processes (thread-group ids) in the cgroup, from every hierarchy, sorted.
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        let mut pids = Vec::new();
        for path in self.procs_files() {
            pids.extend(cgfs::read_pids(&path)?);
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// Applies `limits` (`None` fields become unlimited). Used by [`Cgroup::create`] and when
    /// a claimed slot gets the request's limits.
    pub fn set_limits(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        validate_limits(limits)?;
        self.require_controllers(limits)?;
        let kernel = self.root.kernel();
        match self.version() {
            CgroupVersion::V1 => {
                if let Some(dir) = self.dir_of(Controller::Cpu) {
                    let quota = limits
                        .cpu_millis
                        .map_or("-1".to_string(), |m| (m * CPU_PERIOD_US / 1000).to_string());
                    cgfs::write(
                        &dir.join("cpu.cfs_period_us"),
                        &CPU_PERIOD_US.to_string(),
                        kernel,
                    )?;
                    cgfs::write(&dir.join("cpu.cfs_quota_us"), &quota, kernel)?;
                }
                if let Some(h) = self.root.hierarchy_of(Controller::Memory) {
                    let value = limits
                        .memory_bytes
                        .map_or("-1".to_string(), |b| b.to_string());
                    let memsw = !kernel || h.mount.join("memory.memsw.limit_in_bytes").exists();
                    set_memory_v1(&self.leaf(h), &value, memsw, kernel)?;
                }
                if let Some(dir) = self.dir_of(Controller::Pids) {
                    let value = limits.pids.map_or("max".to_string(), |p| p.to_string());
                    cgfs::write(&dir.join("pids.max"), &value, kernel)?;
                }
            }
            CgroupVersion::V2 => {
                let dir = self.leaf(&self.root.hierarchies()[0]);
                let cpu = match limits.cpu_millis {
                    Some(m) => format!("{} {CPU_PERIOD_US}", m * CPU_PERIOD_US / 1000),
                    None => format!("max {CPU_PERIOD_US}"),
                };
                let memory = limits
                    .memory_bytes
                    .map_or("max".to_string(), |b| b.to_string());
                let pids = limits.pids.map_or("max".to_string(), |p| p.to_string());
                for (file, value) in [("cpu.max", cpu), ("memory.max", memory), ("pids.max", pids)]
                {
                    let path = dir.join(file);
                    // A controller not enabled here has no files; its limit was not asked
                    // for (require_controllers checked), so unlimited is already true.
                    if kernel && !path.exists() {
                        continue;
                    }
                    cgfs::write(&path, &value, kernel)?;
                }
                // No swap: only present when the kernel accounts swap.
                let swap = dir.join("memory.swap.max");
                if !kernel || swap.exists() {
                    cgfs::write(&swap, "0", kernel)?;
                }
            }
        }
        tracing::debug!(cgroup = %self.rel().display(), ?limits, "cgroup limits set");
        Ok(())
    }

    /// Stops every task of the group (v1 `freezer.state`, v2 `cgroup.freeze`) and waits until
    /// the kernel reports the group frozen.
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_frozen(true)
    }

    /// Resumes a frozen group.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    /// Whether the kernel reports the group frozen.
    pub fn is_frozen(&self) -> Result<bool, CgroupError> {
        match self.version() {
            CgroupVersion::V1 => {
                let dir = self.require_dir(Controller::Freezer)?;
                Ok(cgfs::read(&dir.join("freezer.state"))?.trim() == "FROZEN")
            }
            CgroupVersion::V2 => {
                let dir = self.leaf(&self.root.hierarchies()[0]);
                let events = dir.join("cgroup.events");
                match cgfs::read_optional(&events)? {
                    Some(content) => Ok(cgfs::keyed_value(&content, "frozen") == Some(1)),
                    // A stand-in directory cannot report; take the requested state.
                    None if !self.root.kernel() => {
                        Ok(cgfs::read(&dir.join("cgroup.freeze"))?.trim() == "1")
                    }
                    None => Err(CgroupError::Parse {
                        path: events,
                        content: String::new(),
                    }),
                }
            }
        }
    }

    /// The file that freezes or thaws the group and the value to write to it (v1
    /// `freezer.state`, v2 `cgroup.freeze`), for a process that must freeze it without
    /// this one (see `lazy::daemon`).
    pub fn freeze_control(&self, frozen: bool) -> Result<(PathBuf, &'static str), CgroupError> {
        Ok(match self.version() {
            CgroupVersion::V1 => (
                self.require_dir(Controller::Freezer)?.join("freezer.state"),
                if frozen { "FROZEN" } else { "THAWED" },
            ),
            CgroupVersion::V2 => (
                self.leaf(&self.root.hierarchies()[0]).join("cgroup.freeze"),
                if frozen { "1" } else { "0" },
            ),
        })
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let kernel = self.root.kernel();
        let (path, value) = self.freeze_control(frozen)?;
        let op = if frozen { "freeze" } else { "thaw" };
        let start = Instant::now();
        let mut pause = Backoff::new();
        loop {
            // v1 may stay FREEZING when a task is in an uninterruptible sleep; writing again
            // retries the freeze (as runc does).
            cgfs::write(&path, value, kernel)?;
            if self.is_frozen()? == frozen {
                tracing::debug!(cgroup = %self.rel().display(), op, elapsed = ?start.elapsed());
                return Ok(());
            }
            if start.elapsed() > FREEZE_TIMEOUT {
                if frozen {
                    let _ = self.set_frozen(false);
                }
                return Err(CgroupError::Timeout {
                    op,
                    path,
                    waited: start.elapsed(),
                });
            }
            pause.sleep();
        }
    }

    /// Kills every process in the group and waits until it is empty. v2 with `cgroup.kill`
    /// (Linux 5.14+) kills atomically; otherwise every pid in `cgroup.procs` gets SIGKILL,
    /// with the group frozen first where a freezer exists so nothing forks in between,
    /// repeated until the group is empty.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        let kernel = self.root.kernel();
        let start = Instant::now();
        let kill_file = match self.version() {
            CgroupVersion::V2 => {
                let f = self.leaf(&self.root.hierarchies()[0]).join("cgroup.kill");
                (!kernel || f.exists()).then_some(f)
            }
            CgroupVersion::V1 => None,
        };
        let mut frozen = kill_file.is_none()
            && self.root.hierarchy_of(Controller::Freezer).is_some()
            && self.open_exists()
            && !self.procs()?.is_empty()
            && self.freeze().is_ok();
        let mut pause = Backoff::new();
        let mut rounds = 0u32;
        loop {
            let pids = self.procs()?;
            if pids.is_empty() {
                break;
            }
            match &kill_file {
                // Once, and again every 20 rounds in case something slipped in.
                Some(f) if rounds.is_multiple_of(20) => cgfs::write(f, "1", kernel)?,
                Some(_) => {}
                None => {
                    for pid in pids {
                        // SAFETY: kill(2) with a pid and a signal number; no memory involved.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                    if frozen {
                        // Frozen tasks act on SIGKILL once thawed.
                        self.thaw()?;
                        frozen = false;
                    }
                }
            }
            if start.elapsed() > KILL_TIMEOUT {
                return Err(CgroupError::Timeout {
                    op: "kill all in",
                    path: self.paths().remove(0),
                    waited: start.elapsed(),
                });
            }
            rounds += 1;
            pause.sleep();
        }
        if frozen {
            self.thaw()?;
        }
        tracing::debug!(cgroup = %self.rel().display(), elapsed = ?start.elapsed(), "cgroup emptied");
        Ok(())
    }

    /// Removes the cgroup (nested cgroups first) from every hierarchy, retrying briefly while
    /// exiting tasks still hold it. Idempotent. The prefix directories stay (see
    /// [`super::remove_prefix`]).
    pub fn remove(&self) -> Result<(), CgroupError> {
        let start = Instant::now();
        for h in self.root.hierarchies() {
            let dir = self.leaf(h);
            let mut pause = Backoff::new();
            loop {
                match cgfs::rmdir_tree(&dir, self.root.kernel()) {
                    Ok(()) => break,
                    Err(CgroupError::Io { source, .. })
                        if source.raw_os_error() == Some(libc::EBUSY)
                            && start.elapsed() < REMOVE_TIMEOUT =>
                    {
                        pause.sleep()
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        tracing::debug!(cgroup = %self.rel().display(), "cgroup removed");
        Ok(())
    }

    /// Applies the device allow-list ([`super::DEVICE_RULES`]; [`Cgroup::create`] does): on
    /// v1 `devices.deny a` then each rule to `devices.allow` (when the devices controller is
    /// managed), on v2 the rules as a BPF device program attached to the cgroup, replacing any
    /// device program attached to it before (on the kernel only: a stand-in directory gets
    /// nothing). Idempotent: a cgroup adopted after a restart can get it again.
    pub fn apply_device_policy(&self) -> Result<(), CgroupError> {
        let kernel = self.root.kernel();
        match self.version() {
            CgroupVersion::V1 => {
                if let Some(dir) = self.dir_of(Controller::Devices) {
                    cgfs::write(&dir.join("devices.deny"), "a", kernel)?;
                    for rule in DEVICE_RULES {
                        cgfs::write(&dir.join("devices.allow"), rule, kernel)?;
                    }
                }
            }
            CgroupVersion::V2 if kernel => {
                device_bpf::attach(&self.leaf(&self.root.hierarchies()[0]))?;
            }
            CgroupVersion::V2 => {}
        }
        Ok(())
    }

    /// The ids of the BPF device programs attached to this cgroup itself (not inherited from
    /// its ancestors): one after [`Cgroup::create`] on v2; none on v1 or a stand-in directory.
    pub fn device_programs(&self) -> Result<Vec<u32>, CgroupError> {
        if self.version() != CgroupVersion::V2 || !self.root.kernel() {
            return Ok(Vec::new());
        }
        device_bpf::attached(&self.leaf(&self.root.hierarchies()[0]))
    }

    /// How many processes the OOM killer has killed in this group (v1 `memory.oom_control`
    /// `oom_kill`, Linux 4.13+; v2 `memory.events` `oom_kill`, including nested groups).
    pub fn memory_events_oom_kills(&self) -> Result<u64, CgroupError> {
        let (dir, file) = match self.version() {
            CgroupVersion::V1 => (self.require_dir(Controller::Memory)?, "memory.oom_control"),
            CgroupVersion::V2 => (self.leaf(&self.root.hierarchies()[0]), "memory.events"),
        };
        self.read_keyed(&dir.join(file), "oom_kill")
    }

    /// CPU time used by the group so far (v1 `cpuacct.usage`, v2 `cpu.stat` `usage_usec`).
    pub fn cpu_usage(&self) -> Result<Duration, CgroupError> {
        match self.version() {
            CgroupVersion::V1 => {
                let path = self.require_dir(Controller::Cpuacct)?.join("cpuacct.usage");
                let content = cgfs::read(&path)?;
                let nanos = content.trim().parse().map_err(|_| CgroupError::Parse {
                    path: path.clone(),
                    content: content.clone(),
                })?;
                Ok(Duration::from_nanos(nanos))
            }
            CgroupVersion::V2 => {
                let path = self.leaf(&self.root.hierarchies()[0]).join("cpu.stat");
                self.read_keyed(&path, "usage_usec")
                    .map(Duration::from_micros)
            }
        }
    }

    /// Memory charged to the group now, in bytes (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`).
    pub fn memory_current(&self) -> Result<u64, CgroupError> {
        let path = match self.version() {
            CgroupVersion::V1 => self
                .require_dir(Controller::Memory)?
                .join("memory.usage_in_bytes"),
            CgroupVersion::V2 => self
                .leaf(&self.root.hierarchies()[0])
                .join("memory.current"),
        };
        let content = cgfs::read(&path)?;
        content
            .trim()
            .parse()
            .map_err(|_| CgroupError::Parse { path, content })
    }

    /// The `--cgroup-root` values for CRIU, one per hierarchy (v2: one without controller).
    pub fn criu_cgroup_roots(&self) -> Vec<CriuCgroupRoot> {
        self.root
            .hierarchies()
            .iter()
            .map(|h| CriuCgroupRoot {
                controller: match self.version() {
                    CgroupVersion::V1 => Some(h.name.clone()),
                    CgroupVersion::V2 => None,
                },
                path: h.fs_root.join(self.rel()),
            })
            .collect()
    }

    // ---- helpers

    fn rel(&self) -> PathBuf {
        Path::new(&self.prefix).join(&self.id)
    }

    fn leaf(&self, h: &Hierarchy) -> PathBuf {
        h.mount.join(self.rel())
    }

    fn dir_of(&self, controller: Controller) -> Option<PathBuf> {
        self.root.hierarchy_of(controller).map(|h| self.leaf(h))
    }

    fn require_dir(&self, controller: Controller) -> Result<PathBuf, CgroupError> {
        self.dir_of(controller)
            .ok_or_else(|| CgroupError::ControllerMissing {
                controller,
                root: self.root.display_path(),
            })
    }

    fn open_exists(&self) -> bool {
        self.paths().iter().any(|p| p.is_dir())
    }

    fn read_keyed(&self, path: &Path, key: &str) -> Result<u64, CgroupError> {
        let content = cgfs::read(path)?;
        cgfs::keyed_value(&content, key).ok_or_else(|| CgroupError::Parse {
            path: path.to_path_buf(),
            content,
        })
    }

    /// Errors unless every controller a requested limit needs is available.
    fn require_controllers(&self, limits: &CgroupLimits) -> Result<(), CgroupError> {
        let needed = [
            (limits.cpu_millis.is_some(), Controller::Cpu),
            (limits.memory_bytes.is_some(), Controller::Memory),
            (limits.pids.is_some(), Controller::Pids),
        ];
        for (wanted, controller) in needed {
            if !wanted {
                continue;
            }
            let available = match self.version() {
                CgroupVersion::V1 => self.root.hierarchy_of(controller).is_some(),
                CgroupVersion::V2 => {
                    let mount = &self.root.hierarchies()[0].mount;
                    v2_available(mount, self.root.kernel()).contains(&controller)
                }
            };
            if !available {
                return Err(CgroupError::ControllerMissing {
                    controller,
                    root: self.root.display_path(),
                });
            }
        }
        Ok(())
    }

    /// Creates the prefix directories and the cgroup in every hierarchy, recording what it
    /// created in `created` (deepest last).
    fn make(&self, created: &mut Vec<PathBuf>) -> Result<(), CgroupError> {
        let kernel = self.root.kernel();
        for h in self.root.hierarchies() {
            let cpuset = h.controllers.contains(&Controller::Cpuset);
            let mut dir = h.mount.clone();
            let components: Vec<&str> = self.prefix.split('/').chain([self.id.as_str()]).collect();
            let last = components.len() - 1;
            for (i, component) in components.into_iter().enumerate() {
                if self.version() == CgroupVersion::V2 {
                    enable_v2_controllers(&dir, kernel)?;
                }
                let parent = dir.clone();
                dir.push(component);
                let new = cgfs::mkdir(&dir)?;
                if i == last {
                    if !new {
                        return Err(CgroupError::Exists { path: dir });
                    }
                    created.push(dir.clone());
                }
                if cpuset {
                    copy_cpuset(&parent, &dir, kernel)?;
                }
            }
        }
        Ok(())
    }

    /// Settings every sandbox gets regardless of its limits: the device allow-list and, on
    /// v1, the OOM killer switched on (v1 inherits `oom_kill_disable` from the parent).
    fn configure_defaults(&self) -> Result<(), CgroupError> {
        self.apply_device_policy()?;
        if self.version() == CgroupVersion::V1
            && let Some(dir) = self.dir_of(Controller::Memory)
        {
            cgfs::write(&dir.join("memory.oom_control"), "0", self.root.kernel())?;
        }
        Ok(())
    }
}

fn validate_limits(limits: &CgroupLimits) -> Result<(), CgroupError> {
    let invalid = |what, value, reason| {
        Err(CgroupError::InvalidLimit {
            what,
            value,
            reason,
        })
    };
    if let Some(m) = limits.cpu_millis {
        if m < MIN_CPU_MILLIS {
            return invalid(
                "cpu",
                m,
                "below 10 millicores (the kernel's 1 ms per 100 ms)",
            );
        }
        if m > MAX_CPU_MILLIS {
            return invalid("cpu", m, "above 10000 cpus");
        }
    }
    if limits.memory_bytes == Some(0) {
        return invalid("memory", 0, "zero bytes");
    }
    if limits.pids == Some(0) {
        return invalid("pids", 0, "zero tasks");
    }
    Ok(())
}

/// v1 memory: `limit_in_bytes` and, with swap accounting, `memsw.limit_in_bytes` to the same
/// value (no swap). The kernel keeps memsw >= limit at every step, so when raising, memsw
/// goes first.
fn set_memory_v1(dir: &Path, value: &str, memsw: bool, kernel: bool) -> Result<(), CgroupError> {
    let limit = dir.join("memory.limit_in_bytes");
    let memsw_path = dir.join("memory.memsw.limit_in_bytes");
    if !memsw {
        return cgfs::write(&limit, value, kernel);
    }
    match cgfs::write(&limit, value, kernel) {
        Ok(()) => cgfs::write(&memsw_path, value, kernel),
        Err(CgroupError::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            cgfs::write(&memsw_path, value, kernel)?;
            cgfs::write(&limit, value, kernel)
        }
        Err(e) => Err(e),
    }
}

/// The controllers of `Controller::V2` that `dir` can enable for its children.
fn v2_available(dir: &Path, kernel: bool) -> Vec<Controller> {
    match std::fs::read_to_string(dir.join("cgroup.controllers")) {
        Ok(content) => content
            .split_whitespace()
            .filter_map(Controller::from_name)
            .filter(|c| Controller::V2.contains(c))
            .collect(),
        // A stand-in directory below its root has no such file: assume all.
        Err(_) if !kernel => Controller::V2.to_vec(),
        Err(_) => Vec::new(),
    }
}

/// Enables cpu, memory and pids (where available) for the children of `dir`.
fn enable_v2_controllers(dir: &Path, kernel: bool) -> Result<(), CgroupError> {
    let path = dir.join("cgroup.subtree_control");
    let enabled = cgfs::read_optional(&path)?.unwrap_or_default();
    let enabled: Vec<&str> = enabled
        .split_whitespace()
        .map(|c| c.trim_start_matches('+'))
        .collect();
    let missing: Vec<String> = v2_available(dir, kernel)
        .into_iter()
        .filter(|c| !enabled.contains(&c.name()))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    cgfs::write(&path, &missing.join(" "), kernel)
}

/// v1 cpuset starts empty and refuses tasks until it has cpus and mems: copy the parent's.
fn copy_cpuset(parent: &Path, dir: &Path, kernel: bool) -> Result<(), CgroupError> {
    for file in ["cpuset.cpus", "cpuset.mems"] {
        let current = cgfs::read_optional(&dir.join(file))?.unwrap_or_default();
        if !current.trim().is_empty() {
            continue;
        }
        let Some(value) = cgfs::read_optional(&parent.join(file))? else {
            continue;
        };
        let value = value.trim();
        if !value.is_empty() {
            cgfs::write(&dir.join(file), value, kernel)?;
        }
    }
    Ok(())
}

/// Sleeps 1 ms, then longer, up to 50 ms per step.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(Duration::from_millis(1))
    }

    fn sleep(&mut self) {
        thread::sleep(self.0);
        self.0 = (self.0 * 2).min(Duration::from_millis(50));
    }
}
