//! Self-fencing: freezing every sandbox of this node at once, and thawing the ones the node
//! may run again.
//!
//! A node holds a lease at the server. When it cannot renew the lease, it must stop all its
//! sandboxes before the lease can expire, so that the server may declare the node lost (and
//! resume its paused sandboxes elsewhere) without any sandbox running twice. Stopping means
//! freezing: the processes stay, nothing runs, and the node thaws what it froze
//! ([`NodeCgroups::thaw`]) only when the server's count of its losses shows it was not
//! declared lost meanwhile. The guard
//! process of `fastbox node` (`fastbox-cli`'s `node::fence_guard`) calls
//! [`NodeCgroups::freeze_all`] when the lease's deadline passes.
//!
//! The node's sandbox groups are the fastlet's: `{prefix}/{id}` in every hierarchy of the
//! host's cgroup root, found as [`crate::host::LocalHost`] finds it ([`CgroupRoot::detect`]),
//! with the instance prefix of the node. Every directory directly under `{prefix}` is one
//! group: sandboxes, pooled sandboxes, spare slots' launchers, template builds. Names come
//! from listing the node's own `{prefix}` directory (a sandbox can only make groups inside
//! its own group, which a freeze of that group covers) and are checked by the runtime
//! ([`Cgroup::open`]) before any path is made of them. Freezing and thawing are the
//! runtime's: cgroup v1's freezer (`freezer.state`) or v2's `cgroup.freeze`; both freeze
//! every group nested in a frozen one.
//!
//! [`NodeCgroups::freeze_all`] first *requests* the freeze of every group (one write each,
//! so the whole node stops within milliseconds), then waits until the kernel reports each
//! one frozen, requesting again meanwhile (a v1 group stays `FREEZING` while a task is in an
//! uninterruptible sleep). A group that does not settle in time keeps its freeze requested:
//! unlike [`Cgroup::freeze`], which thaws a group it could not freeze, a fence never lets a
//! group run again. Errors are collected per group; one failure never stops the others.
//! Groups that appear while freezing (a start in flight) are frozen in a further round.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::path::PathBuf;
use std::str::FromStr;
use std::thread;
use std::time::{Duration, Instant};

use fastbox_runtime::cgroup::{Cgroup, CgroupError, CgroupRoot};

/// How long [`NodeCgroups::freeze_all`] waits for the requested freezes to settle.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);
/// How many times [`NodeCgroups::freeze_all`] lists the groups again for new ones.
const ROUNDS: usize = 3;

/// Errors say everything in their message (no separate source): they are collected per group
/// and written into the fence marker as lines.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("node prefix: {0}")]
    Prefix(String),
    #[error("cgroups: {0}")]
    Cgroups(CgroupError),
    #[error("no cgroup2 hierarchy on this host")]
    NoUnified,
    #[error("sandbox group {id}: {cause}")]
    Group { id: String, cause: CgroupError },
    #[error("sandbox group {id}: request the freeze in {}: {cause}", path.display())]
    Request {
        id: String,
        path: PathBuf,
        cause: io::Error,
    },
    #[error("sandbox group {id}: not frozen after {waited:?} (the freeze stays requested)")]
    NotSettled { id: String, waited: Duration },
    #[error("sandbox group {id}: the node has no such group")]
    NoGroup { id: String },
}

impl FenceError {
    /// The group the error is about, if one.
    pub fn id(&self) -> Option<&str> {
        match self {
            FenceError::Group { id, .. }
            | FenceError::Request { id, .. }
            | FenceError::NotSettled { id, .. }
            | FenceError::NoGroup { id } => Some(id),
            FenceError::Prefix(_) | FenceError::Cgroups(_) | FenceError::NoUnified => None,
        }
    }
}

/// Which cgroup hierarchies hold the node's sandboxes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CgroupSource {
    /// The host's, as the fastlet finds them ([`CgroupRoot::detect`]).
    #[default]
    Detect,
    /// The host's cgroup2 hierarchy even beside v1 controllers ([`CgroupRoot::unified`]):
    /// for tests of the v2 path on hybrid hosts.
    Unified,
}

impl CgroupSource {
    pub fn name(self) -> &'static str {
        match self {
            CgroupSource::Detect => "detect",
            CgroupSource::Unified => "unified",
        }
    }
}

impl std::fmt::Display for CgroupSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CgroupSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "detect" => Ok(CgroupSource::Detect),
            "unified" => Ok(CgroupSource::Unified),
            other => Err(format!("{other:?}: expected `detect` or `unified`")),
        }
    }
}

/// What [`NodeCgroups::freeze_all`] did.
#[derive(Debug, Default)]
pub struct FreezeReport {
    /// The groups the kernel reports frozen, sorted.
    pub frozen: Vec<String>,
    /// One error per group that could not be frozen (or not in time).
    pub errors: Vec<FenceError>,
}

/// What [`NodeCgroups::thaw`] did.
#[derive(Debug, Default)]
pub struct ThawReport {
    /// The groups thawed, in the order asked.
    pub thawed: Vec<String>,
    /// One error per group that could not be thawed.
    pub errors: Vec<FenceError>,
}

/// The sandbox groups of one node: its cgroup root and instance prefix.
#[derive(Debug, Clone)]
pub struct NodeCgroups {
    root: CgroupRoot,
    prefix: String,
}

impl NodeCgroups {
    /// The groups of instance `prefix` under `root`. The prefix is an instance prefix
    /// (`fastbox_runtime::net::names::validate_prefix`): an invalid one would name no group
    /// and freeze nothing, so it is refused here.
    pub fn new(root: CgroupRoot, prefix: &str) -> Result<Self, FenceError> {
        fastbox_runtime::net::names::validate_prefix(prefix)
            .map_err(|e| FenceError::Prefix(e.to_string()))?;
        Ok(NodeCgroups {
            root,
            prefix: prefix.to_string(),
        })
    }

    /// The groups of instance `prefix` in the hierarchies `source` names.
    pub fn open(source: CgroupSource, prefix: &str) -> Result<Self, FenceError> {
        let root = match source {
            CgroupSource::Detect => CgroupRoot::detect().map_err(FenceError::Cgroups)?,
            CgroupSource::Unified => CgroupRoot::unified()
                .map_err(FenceError::Cgroups)?
                .ok_or(FenceError::NoUnified)?,
        };
        Self::new(root, prefix)
    }

    pub fn root(&self) -> &CgroupRoot {
        &self.root
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The names of the node's groups now, sorted.
    pub fn ids(&self) -> Vec<String> {
        group_names(&self.root, &self.prefix)
    }

    /// Freezes every group of the node (see the module docs); never stops at a failure.
    pub fn freeze_all(&self) -> FreezeReport {
        let mut report = FreezeReport::default();
        let mut seen: Vec<String> = Vec::new();
        for _ in 0..ROUNDS {
            let new: Vec<String> = self
                .ids()
                .into_iter()
                .filter(|id| !seen.contains(id))
                .collect();
            if new.is_empty() {
                break;
            }
            seen.extend(new.iter().cloned());
            let mut requested = Vec::new();
            for id in new {
                // A group removed since the listing runs nothing: not an error.
                let Some(cgroup) = Cgroup::open(&self.root, &self.prefix, &id) else {
                    continue;
                };
                match request_freeze(&cgroup) {
                    Ok(()) => requested.push(cgroup),
                    Err(e) => report.errors.push(e),
                }
            }
            self.settle(requested, &mut report);
        }
        report.frozen.sort();
        tracing::debug!(prefix = %self.prefix, frozen = report.frozen.len(), errors = report.errors.len(), "node frozen");
        report
    }

    /// Thaws the groups `ids` (a reconciliation's: those the node may run again). A name
    /// that is no group of the node is an error of its own; the others are thawed anyway.
    pub fn thaw<I, S>(&self, ids: I) -> ThawReport
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut report = ThawReport::default();
        for id in ids {
            let id = id.as_ref();
            let Some(cgroup) = Cgroup::open(&self.root, &self.prefix, id) else {
                report
                    .errors
                    .push(FenceError::NoGroup { id: id.to_string() });
                continue;
            };
            match cgroup.thaw() {
                Ok(()) => report.thawed.push(id.to_string()),
                Err(cause) => report.errors.push(FenceError::Group {
                    id: id.to_string(),
                    cause,
                }),
            }
        }
        report
    }

    /// Waits until every requested group reports frozen, requesting again meanwhile.
    fn settle(&self, mut pending: Vec<Cgroup>, report: &mut FreezeReport) {
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        while !pending.is_empty() {
            let mut still = Vec::new();
            for cgroup in pending {
                match cgroup.is_frozen() {
                    Ok(true) => report.frozen.push(cgroup.id().to_string()),
                    Ok(false) => match request_freeze(&cgroup) {
                        Ok(()) => still.push(cgroup),
                        Err(e) => report.errors.push(e),
                    },
                    Err(_) if self.vanished(&cgroup) => {}
                    Err(cause) => report.errors.push(FenceError::Group {
                        id: cgroup.id().to_string(),
                        cause,
                    }),
                }
            }
            pending = still;
            if pending.is_empty() {
                break;
            }
            if start.elapsed() > SETTLE_TIMEOUT {
                report
                    .errors
                    .extend(pending.drain(..).map(|cgroup| FenceError::NotSettled {
                        id: cgroup.id().to_string(),
                        waited: start.elapsed(),
                    }));
                break;
            }
            thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    fn vanished(&self, cgroup: &Cgroup) -> bool {
        Cgroup::open(&self.root, &self.prefix, cgroup.id()).is_none()
    }
}

/// The names of the groups of instance `prefix`: the directories directly under `{prefix}`
/// in any hierarchy, sorted, once each.
pub fn group_names(cgroups: &CgroupRoot, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = fastbox_runtime::cgroup::leaked(cgroups, prefix)
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Writes the freeze request of `cgroup` (the runtime's [`Cgroup::freeze_control`]) once,
/// without waiting. The file exists on the kernel's filesystem; a stand-in directory gets it.
fn request_freeze(cgroup: &Cgroup) -> Result<(), FenceError> {
    let (path, value) = cgroup
        .freeze_control(true)
        .map_err(|cause| FenceError::Group {
            id: cgroup.id().to_string(),
            cause,
        })?;
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .and_then(|mut file| file.write_all(value.as_bytes()))
        .map_err(|cause| FenceError::Request {
            id: cgroup.id().to_string(),
            path,
            cause,
        })
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use fastbox_runtime::cgroup::{CgroupLimits, CgroupVersion, Controller};

    use super::*;

    /// A stand-in for `/sys/fs/cgroup` of a v1 host, every controller on its own.
    fn fake_v1(dir: &Path) -> CgroupRoot {
        for c in Controller::V1 {
            fs::create_dir(dir.join(c.name())).unwrap();
        }
        CgroupRoot::at(dir, CgroupVersion::V1).unwrap()
    }

    fn fake_v2(dir: &Path) -> CgroupRoot {
        CgroupRoot::at(dir, CgroupVersion::V2).unwrap()
    }

    fn create(root: &CgroupRoot, prefix: &str, id: &str) -> Cgroup {
        Cgroup::create(root, prefix, id, &CgroupLimits::default()).unwrap()
    }

    fn state(cgroup: &Cgroup) -> bool {
        cgroup.is_frozen().unwrap()
    }

    fn freezes_every_group_of_the_prefix_and_thaws_a_set(root: CgroupRoot) {
        let ids = ["pool-a1", "sbx1", "spare-0"];
        let groups: Vec<Cgroup> = ids.iter().map(|id| create(&root, "fb", id)).collect();
        let other = create(&root, "fbother", "sbx1");
        let node = NodeCgroups::new(root.clone(), "fb").unwrap();
        assert_eq!(node.ids(), ids);

        let report = node.freeze_all();
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.frozen, ids);
        assert!(groups.iter().all(state));
        // Another instance's group of the same name is not this node's.
        assert!(other.is_frozen().is_err() || !state(&other));

        // Freezing again is harmless: every group stays frozen.
        assert_eq!(node.freeze_all().frozen.len(), 3);

        let report = node.thaw(["sbx1", "spare-0"]);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        assert_eq!(report.thawed, ["sbx1", "spare-0"]);
        assert!(state(&groups[0]));
        assert!(!state(&groups[1]) && !state(&groups[2]));
    }

    #[test]
    fn v1_freezes_every_group_of_the_prefix_and_thaws_a_set() {
        let tmp = tempfile::tempdir().unwrap();
        freezes_every_group_of_the_prefix_and_thaws_a_set(fake_v1(tmp.path()));
        assert_eq!(
            fs::read_to_string(tmp.path().join("freezer/fb/pool-a1/freezer.state")).unwrap(),
            "FROZEN"
        );
    }

    #[test]
    fn v2_freezes_every_group_of_the_prefix_and_thaws_a_set() {
        let tmp = tempfile::tempdir().unwrap();
        freezes_every_group_of_the_prefix_and_thaws_a_set(fake_v2(tmp.path()));
        assert_eq!(
            fs::read_to_string(tmp.path().join("fb/pool-a1/cgroup.freeze")).unwrap(),
            "1"
        );
    }

    #[test]
    fn one_failing_group_does_not_stop_the_others() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fake_v1(tmp.path());
        let a = create(&root, "fb", "a");
        let c = create(&root, "fb", "c");
        // `b` exists in the cpu hierarchy only: its freezer file cannot be written.
        fs::create_dir(tmp.path().join("cpu/fb/b")).unwrap();
        let node = NodeCgroups::new(root, "fb").unwrap();
        let report = node.freeze_all();
        assert_eq!(report.frozen, ["a", "c"]);
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        assert_eq!(report.errors[0].id(), Some("b"));
        assert!(matches!(report.errors[0], FenceError::Request { .. }));
        assert!(state(&a) && state(&c));
    }

    #[test]
    fn thawing_names_that_are_no_group_of_the_node_fails_for_them_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fake_v2(tmp.path());
        let a = create(&root, "fb", "a");
        let node = NodeCgroups::new(root, "fb").unwrap();
        node.freeze_all();
        let report = node.thaw(["missing", "../fb/a", "a", "a/b"]);
        assert_eq!(report.thawed, ["a"]);
        let failed: Vec<Option<&str>> = report.errors.iter().map(FenceError::id).collect();
        assert_eq!(failed, [Some("missing"), Some("../fb/a"), Some("a/b")]);
        assert!(
            report
                .errors
                .iter()
                .all(|e| matches!(e, FenceError::NoGroup { .. }))
        );
        assert!(!state(&a));
    }

    #[test]
    fn a_node_without_groups_freezes_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let node = NodeCgroups::new(fake_v1(tmp.path()), "fb").unwrap();
        let report = node.freeze_all();
        assert!(report.frozen.is_empty() && report.errors.is_empty());
    }

    #[test]
    fn prefixes_that_are_no_instance_prefix_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = fake_v2(tmp.path());
        for bad in ["", "..", "fb/x", "Fb", "toolongprefix", "fb-1"] {
            assert!(
                matches!(
                    NodeCgroups::new(root.clone(), bad),
                    Err(FenceError::Prefix(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn cgroup_sources_parse_their_names() {
        for source in [CgroupSource::Detect, CgroupSource::Unified] {
            assert_eq!(source.name().parse::<CgroupSource>(), Ok(source));
        }
        assert!("v2".parse::<CgroupSource>().is_err());
    }
}
