//! Where the cgroup hierarchies are: detection from `/proc/self/mountinfo`, or a given
//! directory (the test seam).

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use super::{CgroupError, CgroupVersion, Controller, fs as cgfs};

const MOUNTINFO: &str = "/proc/self/mountinfo";
const SYS_FS_CGROUP: &str = "/sys/fs/cgroup";

/// The cgroup hierarchies of a host (or of a stand-in directory), with the version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot {
    version: CgroupVersion,
    hierarchies: Vec<Hierarchy>,
    /// False for a stand-in directory that is not a cgroup filesystem (unit tests).
    kernel: bool,
}

/// One mounted hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hierarchy {
    /// The controllers fastbox manages through this hierarchy.
    pub controllers: Vec<Controller>,
    /// The mount's own name for itself as CRIU and `/proc/<pid>/cgroup` spell it
    /// (`cpu,cpuacct`); empty on v2.
    pub name: String,
    /// Where it is mounted.
    pub mount: PathBuf,
    /// The mount's root inside the hierarchy (mountinfo's root field; `/` unless bind-mounted
    /// from a sub-cgroup).
    pub fs_root: PathBuf,
}

impl CgroupRoot {
    /// Finds the host's hierarchies. Pure v2 is chosen when `/sys/fs/cgroup` itself is
    /// cgroup2, or when no v1 hierarchy carries memory, cpu or pids (then the first cgroup2
    /// mount that has controllers). A hybrid host (v1 controllers plus an empty unified
    /// hierarchy, as systemd's "hybrid" mode mounts it) is v1.
    pub fn detect() -> Result<CgroupRoot, CgroupError> {
        let text = cgfs::read(Path::new(MOUNTINFO))?;
        let mounts = parse_mountinfo(&text);
        let has_controllers = |mount: &Path| {
            fs::read_to_string(mount.join("cgroup.controllers")).is_ok_and(|c| !c.trim().is_empty())
        };
        let (version, hierarchies) =
            choose(&mounts, &has_controllers).ok_or_else(|| CgroupError::NotMounted {
                path: PathBuf::from(MOUNTINFO),
            })?;
        let root = CgroupRoot {
            version,
            hierarchies,
            kernel: true,
        };
        tracing::debug!(?root, "detected cgroups");
        Ok(root)
    }

    /// The host's cgroup2 (unified) hierarchy as a v2 root, whatever [`CgroupRoot::detect`]
    /// chooses: on a pure v2 host the same one, on a hybrid host the unified hierarchy beside
    /// the v1 controllers (mounted without controllers, so no limits there, but cgroups, BPF
    /// device programs, freezing and killing work). `None` without a cgroup2 mount. For tests
    /// of the v2 code on hybrid hosts.
    pub fn unified() -> Result<Option<CgroupRoot>, CgroupError> {
        let text = cgfs::read(Path::new(MOUNTINFO))?;
        let mounts = parse_mountinfo(&text);
        let v2: Vec<&CgroupMount> = mounts.iter().filter(|m| m.v1_options.is_none()).collect();
        let Some(m) = v2
            .iter()
            .find(|m| m.mount_point == Path::new(SYS_FS_CGROUP))
            .or(v2.first())
        else {
            return Ok(None);
        };
        Ok(Some(CgroupRoot {
            version: CgroupVersion::V2,
            hierarchies: vec![Hierarchy {
                controllers: Controller::V2.to_vec(),
                name: String::new(),
                mount: m.mount_point.clone(),
                fs_root: m.fs_root.clone(),
            }],
            kernel: true,
        }))
    }

    /// Uses `path` as the root: for v2 the directory under which sandbox cgroups are made
    /// (the cgroup2 mount or a delegated sub-cgroup); for v1 a directory holding one
    /// directory (or symlink) per controller, like `/sys/fs/cgroup`. Controllers that are
    /// missing are simply not managed; asking for their limits is an error later.
    pub fn at(path: &Path, version: CgroupVersion) -> Result<CgroupRoot, CgroupError> {
        let hierarchies = match version {
            CgroupVersion::V2 => {
                fs::metadata(path).map_err(cgfs::io_err("stat", path))?;
                vec![Hierarchy {
                    controllers: Controller::V2.to_vec(),
                    name: String::new(),
                    mount: path.to_path_buf(),
                    fs_root: PathBuf::from("/"),
                }]
            }
            CgroupVersion::V1 => {
                // canonical directory -> controllers found there
                let mut dirs: Vec<(PathBuf, Vec<Controller>)> = Vec::new();
                for controller in Controller::V1 {
                    let candidate = path.join(controller.name());
                    let Ok(dir) = fs::canonicalize(&candidate) else {
                        continue;
                    };
                    if !dir.is_dir() {
                        continue;
                    }
                    match dirs.iter_mut().find(|(d, _)| *d == dir) {
                        Some((_, cs)) => cs.push(controller),
                        None => dirs.push((dir, vec![controller])),
                    }
                }
                if dirs.is_empty() {
                    return Err(CgroupError::NotMounted {
                        path: path.to_path_buf(),
                    });
                }
                dirs.into_iter()
                    .map(|(mount, controllers)| Hierarchy {
                        name: mount_name(&mount, &controllers),
                        controllers,
                        mount,
                        fs_root: PathBuf::from("/"),
                    })
                    .collect()
            }
        };
        let kernel = is_cgroupfs(&hierarchies[0].mount);
        Ok(CgroupRoot {
            version,
            hierarchies,
            kernel,
        })
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The directory of the hierarchy that carries `controller` (v2: the root directory for
    /// cpu, memory and pids).
    pub fn mount_of(&self, controller: Controller) -> Option<&Path> {
        self.hierarchy_of(controller).map(|h| h.mount.as_path())
    }

    pub(super) fn hierarchies(&self) -> &[Hierarchy] {
        &self.hierarchies
    }

    pub(super) fn hierarchy_of(&self, controller: Controller) -> Option<&Hierarchy> {
        self.hierarchies
            .iter()
            .find(|h| h.controllers.contains(&controller))
    }

    /// Whether this is the kernel's cgroup filesystem (false: a stand-in directory).
    pub(super) fn kernel(&self) -> bool {
        self.kernel
    }

    /// A path to name in errors about the whole root.
    pub(super) fn display_path(&self) -> PathBuf {
        match self.version {
            CgroupVersion::V2 => self.hierarchies[0].mount.clone(),
            CgroupVersion::V1 => self.hierarchies[0]
                .mount
                .parent()
                .unwrap_or(Path::new("/"))
                .to_path_buf(),
        }
    }
}

fn is_cgroupfs(path: &Path) -> bool {
    use nix::sys::statfs::{CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, statfs};
    statfs(path).is_ok_and(|s| {
        s.filesystem_type() == CGROUP_SUPER_MAGIC || s.filesystem_type() == CGROUP2_SUPER_MAGIC
    })
}

/// A v1 hierarchy's name: its directory's name when that lists controllers (`cpu,cpuacct`),
/// else the controllers fastbox found there.
fn mount_name(dir: &Path, controllers: &[Controller]) -> String {
    let base = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !base.is_empty() && base.split(',').all(|c| Controller::from_name(c).is_some()) {
        base.to_string()
    } else {
        controllers
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// One cgroup mount from mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CgroupMount {
    pub mount_point: PathBuf,
    pub fs_root: PathBuf,
    /// `None` for cgroup2; the super options' names (controllers, `name=...`) for v1.
    pub v1_options: Option<Vec<String>>,
}

/// The cgroup and cgroup2 mounts in a mountinfo text, in mount order.
pub(super) fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    text.lines()
        .filter_map(|line| {
            // id parent major:minor root mount-point options [optional...] - fstype source super
            let (left, right) = line.split_once(" - ")?;
            let left: Vec<&str> = left.split(' ').collect();
            let right: Vec<&str> = right.split(' ').collect();
            let (fs_root, mount_point) = (left.get(3)?, left.get(4)?);
            let fstype = *right.first()?;
            let v1_options = match fstype {
                "cgroup2" => None,
                "cgroup" => Some(
                    right
                        .get(2)
                        .unwrap_or(&"")
                        .split(',')
                        .filter(|o| !matches!(*o, "rw" | "ro" | ""))
                        .map(str::to_string)
                        .collect(),
                ),
                _ => return None,
            };
            Some(CgroupMount {
                mount_point: PathBuf::from(unescape(mount_point)),
                fs_root: PathBuf::from(unescape(fs_root)),
                v1_options,
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let code =
                (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(code);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Picks the version and hierarchies from the mounts (see [`CgroupRoot::detect`]).
pub(super) fn choose(
    mounts: &[CgroupMount],
    v2_has_controllers: &dyn Fn(&Path) -> bool,
) -> Option<(CgroupVersion, Vec<Hierarchy>)> {
    let v2_at = |m: &CgroupMount| {
        (
            CgroupVersion::V2,
            vec![Hierarchy {
                controllers: Controller::V2.to_vec(),
                name: String::new(),
                mount: m.mount_point.clone(),
                fs_root: m.fs_root.clone(),
            }],
        )
    };
    if let Some(m) = mounts
        .iter()
        .find(|m| m.v1_options.is_none() && m.mount_point == Path::new(SYS_FS_CGROUP))
    {
        return Some(v2_at(m));
    }

    // v1: the first mount of each controller; prefer mounts under /sys/fs/cgroup.
    let mut by_controller: BTreeMap<Controller, &CgroupMount> = BTreeMap::new();
    let preferred = mounts
        .iter()
        .filter(|m| m.mount_point.starts_with(SYS_FS_CGROUP))
        .chain(
            mounts
                .iter()
                .filter(|m| !m.mount_point.starts_with(SYS_FS_CGROUP)),
        );
    for m in preferred {
        for opt in m.v1_options.iter().flatten() {
            if let Some(c) = Controller::from_name(opt) {
                by_controller.entry(c).or_insert(m);
            }
        }
    }
    let essential = [Controller::Memory, Controller::Cpu, Controller::Pids];
    if essential.iter().any(|c| by_controller.contains_key(c)) {
        let mut hierarchies: Vec<Hierarchy> = Vec::new();
        for controller in Controller::V1 {
            let Some(m) = by_controller.get(&controller) else {
                continue;
            };
            match hierarchies.iter_mut().find(|h| h.mount == m.mount_point) {
                Some(h) => h.controllers.push(controller),
                None => hierarchies.push(Hierarchy {
                    controllers: vec![controller],
                    name: m
                        .v1_options
                        .iter()
                        .flatten()
                        .filter(|o| !o.contains('='))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(","),
                    mount: m.mount_point.clone(),
                    fs_root: m.fs_root.clone(),
                }),
            }
        }
        return Some((CgroupVersion::V1, hierarchies));
    }

    mounts
        .iter()
        .find(|m| m.v1_options.is_none() && v2_has_controllers(&m.mount_point))
        .map(v2_at)
}

/// Checks a prefix: one or more `/`-separated components of `[A-Za-z0-9_.-]`, none `.` or
/// `..`, no leading or trailing `/`.
pub(super) fn validate_prefix(prefix: &str) -> Result<(), CgroupError> {
    if prefix.is_empty() {
        return Err(invalid(prefix, "empty"));
    }
    prefix
        .split('/')
        .try_for_each(|c| validate_component(prefix, c))
}

/// Checks a sandbox id: one component of `[A-Za-z0-9_.-]`, not `.` or `..`.
pub(super) fn validate_id(id: &str) -> Result<(), CgroupError> {
    validate_component(id, id)
}

fn validate_component(name: &str, component: &str) -> Result<(), CgroupError> {
    if component.is_empty() {
        return Err(invalid(name, "empty path component"));
    }
    if component == "." || component == ".." {
        return Err(invalid(name, "`.` and `..` are not names"));
    }
    if !component
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Err(invalid(
            name,
            "only ASCII letters, digits, `_`, `.` and `-`",
        ));
    }
    Ok(())
}

fn invalid(name: &str, reason: &'static str) -> CgroupError {
    CgroupError::InvalidName {
        name: name.to_string(),
        reason,
    }
}

/// Cgroups left under `prefix` in any hierarchy: the directories inside `{prefix}` (one per
/// sandbox not removed). Empty prefix directories themselves are not leaks. An invalid prefix
/// has no cgroups.
pub fn leaked(root: &CgroupRoot, prefix: &str) -> Vec<PathBuf> {
    if validate_prefix(prefix).is_err() {
        return Vec::new();
    }
    let mut found: Vec<PathBuf> = root
        .hierarchies
        .iter()
        .filter_map(|h| fs::read_dir(h.mount.join(prefix)).ok())
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

/// Removes the (empty) `{prefix}` directories, deepest component first, in every hierarchy.
/// Components that still hold cgroups are left; that is not an error.
pub fn remove_prefix(root: &CgroupRoot, prefix: &str) -> Result<(), CgroupError> {
    validate_prefix(prefix)?;
    for h in &root.hierarchies {
        let mut rel = PathBuf::from(prefix);
        loop {
            let dir = h.mount.join(&rel);
            let has_children = match fs::read_dir(&dir) {
                Ok(entries) => entries
                    .filter_map(Result::ok)
                    .any(|e| e.file_type().is_ok_and(|t| t.is_dir())),
                Err(_) => false,
            };
            if has_children {
                break;
            }
            cgfs::rmdir_tree(&dir, root.kernel)?;
            if !rel.pop() || rel.as_os_str().is_empty() {
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This VM: v1 controllers, each on its own, plus an empty unified hierarchy.
    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    /// systemd's legacy layout: cpu and cpuacct co-mounted, with optional fields.
    const COMOUNTED: &str = "\
25 18 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/systemd rw,nosuid shared:10 - cgroup cgroup rw,xattr,name=systemd
29 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:13 - cgroup cgroup rw,cpu,cpuacct
30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid shared:14 - cgroup cgroup rw,memory
31 25 0:28 / /sys/fs/cgroup/pids rw,nosuid shared:15 - cgroup cgroup rw,pids
32 25 0:29 / /sys/fs/cgroup/freezer rw,nosuid shared:16 - cgroup cgroup rw,freezer
";

    const PURE_V2: &str = "\
22 1 0:21 / /proc rw - proc proc rw
26 24 0:23 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    fn no_v2_controllers(_: &Path) -> bool {
        false
    }

    #[test]
    fn hybrid_host_is_v1_with_each_controller_on_its_own() {
        let (version, hs) = choose(&parse_mountinfo(HYBRID), &no_v2_controllers).unwrap();
        assert_eq!(version, CgroupVersion::V1);
        assert_eq!(hs.len(), 7);
        let memory = hs
            .iter()
            .find(|h| h.controllers == [Controller::Memory])
            .unwrap();
        assert_eq!(memory.mount, Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(memory.name, "memory");
        assert!(hs.iter().all(|h| h.controllers.len() == 1));
    }

    #[test]
    fn comounted_cpu_and_cpuacct_share_one_hierarchy() {
        let (version, hs) = choose(&parse_mountinfo(COMOUNTED), &no_v2_controllers).unwrap();
        assert_eq!(version, CgroupVersion::V1);
        let cpu = hs
            .iter()
            .find(|h| h.controllers.contains(&Controller::Cpu))
            .unwrap();
        assert_eq!(cpu.controllers, [Controller::Cpu, Controller::Cpuacct]);
        assert_eq!(cpu.name, "cpu,cpuacct");
        assert_eq!(cpu.mount, Path::new("/sys/fs/cgroup/cpu,cpuacct"));
        // No cpuset and no devices mounted: not managed.
        assert!(
            !hs.iter()
                .any(|h| h.controllers.contains(&Controller::Cpuset))
        );
        assert_eq!(hs.len(), 4);
    }

    #[test]
    fn pure_v2_host_is_v2() {
        let (version, hs) = choose(&parse_mountinfo(PURE_V2), &no_v2_controllers).unwrap();
        assert_eq!(version, CgroupVersion::V2);
        assert_eq!(hs[0].mount, Path::new("/sys/fs/cgroup"));
        assert_eq!(hs[0].controllers, Controller::V2);
    }

    #[test]
    fn a_v2_mount_elsewhere_counts_only_without_v1_controllers_and_with_its_own() {
        let text = "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        assert!(choose(&parse_mountinfo(text), &no_v2_controllers).is_none());
        let (version, hs) = choose(&parse_mountinfo(text), &|_| true).unwrap();
        assert_eq!(version, CgroupVersion::V2);
        assert_eq!(hs[0].mount, Path::new("/sys/fs/cgroup/unified"));
        // With v1 controllers present the hybrid unified mount is ignored.
        let (version, _) = choose(&parse_mountinfo(HYBRID), &|_| true).unwrap();
        assert_eq!(version, CgroupVersion::V1);
    }

    #[test]
    fn no_cgroup_mounts_detects_nothing() {
        assert!(
            choose(
                &parse_mountinfo("22 1 0:21 / /proc rw - proc proc rw\n"),
                &|_| true
            )
            .is_none()
        );
    }

    #[test]
    fn mountinfo_escapes_and_bind_roots_are_decoded() {
        let text =
            "50 31 0:32 /kube\\040pods /sys/fs/cgroup/my\\040memory rw - cgroup cgroup rw,memory\n";
        let m = &parse_mountinfo(text)[0];
        assert_eq!(m.mount_point, Path::new("/sys/fs/cgroup/my memory"));
        assert_eq!(m.fs_root, Path::new("/kube pods"));
        assert_eq!(m.v1_options.as_deref(), Some(&["memory".to_string()][..]));
    }

    #[test]
    fn names_are_validated() {
        assert!(validate_prefix("fastbox").is_ok());
        assert!(validate_prefix("fastbox/slots-1").is_ok());
        assert!(validate_id("sbx_01.a-b").is_ok());
        for bad in ["", "/abs", "a//b", "a/", "..", "a/../b", "sp ace", "é"] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
        for bad in ["", "a/b", ".", "..", "x\n"] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        let err = validate_id("a/b").unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid cgroup name \"a/b\": only ASCII letters, digits, `_`, `.` and `-`"
        );
    }
}
