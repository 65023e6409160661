//! What a sandbox costs in memory: the sum over its processes of `/proc/<pid>/smaps_rollup`.
//! Private pages are the sandbox's own (what an idle pooled sandbox really costs); PSS splits
//! shared pages (the image's files, pages CRIU restored copy-on-write) between their users.

use std::path::Path;

use fastbox_runtime::cgroup::{Cgroup, CgroupRoot};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("sandbox {0} has no cgroup")]
    NoCgroup(String),
    #[error("processes of sandbox {id}: {source}")]
    Procs {
        id: String,
        source: fastbox_runtime::cgroup::CgroupError,
    },
}

/// Memory of one sandbox, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryUse {
    pub processes: usize,
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    /// `Private_Clean` + `Private_Dirty`: pages no other process maps.
    pub private_bytes: u64,
}

impl MemoryUse {
    fn add(&mut self, rollup: &str) {
        for line in rollup.lines() {
            let mut parts = line.split_whitespace();
            let (Some(key), Some(kb)) = (parts.next(), parts.next()) else {
                continue;
            };
            let Ok(kb) = kb.parse::<u64>() else { continue };
            match key {
                "Rss:" => self.rss_bytes += kb * 1024,
                "Pss:" => self.pss_bytes += kb * 1024,
                "Private_Clean:" | "Private_Dirty:" => self.private_bytes += kb * 1024,
                _ => {}
            }
        }
    }
}

/// The memory of sandbox `id` of instance `prefix` (processes that exit meanwhile are
/// skipped).
pub fn sandbox_memory(
    cgroups: &CgroupRoot,
    prefix: &str,
    id: &str,
) -> Result<MemoryUse, MemoryError> {
    let cgroup =
        Cgroup::open(cgroups, prefix, id).ok_or_else(|| MemoryError::NoCgroup(id.to_string()))?;
    let pids = cgroup.procs().map_err(|source| MemoryError::Procs {
        id: id.to_string(),
        source,
    })?;
    let mut used = MemoryUse::default();
    for pid in pids {
        let path = Path::new("/proc")
            .join(pid.to_string())
            .join("smaps_rollup");
        if let Ok(rollup) = std::fs::read_to_string(path) {
            used.processes += 1;
            used.add(&rollup);
        }
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollups_add_up_per_field() {
        let rollup = "00400000-7ffd [rollup]\nRss:                1000 kB\nPss:                 400 kB\nPss_Dirty:           100 kB\nShared_Clean:        600 kB\nPrivate_Clean:        50 kB\nPrivate_Dirty:       150 kB\n";
        let mut used = MemoryUse::default();
        used.add(rollup);
        used.add(rollup);
        assert_eq!(used.rss_bytes, 2000 * 1024);
        assert_eq!(used.pss_bytes, 800 * 1024);
        assert_eq!(used.private_bytes, 400 * 1024);
    }

    #[test]
    fn our_own_process_has_private_memory() {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
        let mut used = MemoryUse::default();
        used.add(&rollup);
        assert!(used.private_bytes > 0 && used.rss_bytes >= used.private_bytes);
    }
}
