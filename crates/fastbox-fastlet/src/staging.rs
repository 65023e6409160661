//! Where live snapshots write their files while the sandbox is frozen
//! (`docs/snapshots.md`): the instance's own tmpfs at `/dev/shm/fastbox-<prefix>-staging`
//! (a directory of `/dev/shm` where the mount cannot be made). CRIU splices every memory page
//! of the sandbox into an image file there, so the freeze never waits for a disk.
//!
//! Transparent huge pages (`huge=always`) were measured twice and left off:
//! - they lowered the median freeze of a 256 MiB dump (161-180 against 190-202 ms here), but
//!   the first dump of every new sandbox then froze it for about a second;
//! - fresh 2 MiB pages are slow to come by in this virtual machine: its kernel hands free
//!   memory back to the host (`page_reporting.page_reporting_order=11`), and touching it
//!   again costs about 3.5 ms per MiB;
//! - a reserve of warm huge pages, freed right before each dump and written again after it,
//!   cut CRIU's page writing of a plain 256 MiB process from 125-140 to about 85 ms, but in
//!   fastbox the freeze only went from 173-188 to 141-159 ms (p50 149), still with 0.7-1 s
//!   outliers, for 300 MiB of memory held at all times. Not worth it.
//!
//! The mount lives as long as the instance: it is made at start and removed by
//! [`Staging::unmount`] at shutdown and by [`purge`], so `fastbox leftovers` shows it only
//! while the instance runs.

use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// The staging area of one instance.
#[derive(Debug)]
pub struct Staging {
    root: PathBuf,
    mounted: bool,
}

/// The staging mount point of instance `prefix`.
pub fn root(prefix: &str) -> PathBuf {
    PathBuf::from(format!("/dev/shm/fastbox-{prefix}-staging"))
}

impl Staging {
    /// The staging area of `prefix`: its tmpfs, mounted now unless it already is.
    pub fn open(prefix: &str) -> Self {
        let root = root(prefix);
        if let Err(e) = std::fs::create_dir_all(&root) {
            tracing::warn!(dir = %root.display(), error = %e, "no staging directory");
        }
        let mounted = fastbox_runtime::rootfs::is_mount_point(&root)
            || mount(
                Some("tmpfs"),
                &root,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                Some("mode=0700,huge=never"),
            )
            .inspect_err(
                |e| tracing::info!(dir = %root.display(), error = %e, "staging in /dev/shm itself"),
            )
            .is_ok();
        Self { root, mounted }
    }

    /// Where the snapshot `key` stages its files.
    pub fn dir(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    /// Removes what interrupted snapshots left; returns how many.
    pub fn purge_entries(&self) -> usize {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return 0;
        };
        entries
            .flatten()
            .filter(|e| std::fs::remove_dir_all(e.path()).is_ok())
            .count()
    }

    /// Removes the mount and the directory (at shutdown: nothing is staged then).
    pub fn unmount(&self) {
        release(&self.root, self.mounted);
    }
}

/// Removes the staging area of a stopped instance `prefix`.
pub fn purge(prefix: &str) {
    let root = root(prefix);
    release(&root, fastbox_runtime::rootfs::is_mount_point(&root));
}

fn release(root: &Path, mounted: bool) {
    // Unmounted already when an earlier release (a drain before the shutdown) ran.
    if mounted
        && fastbox_runtime::rootfs::is_mount_point(root)
        && let Err(e) = umount2(root, MntFlags::MNT_DETACH)
    {
        tracing::warn!(dir = %root.display(), error = %e, "could not unmount the staging area");
    }
    let _ = std::fs::remove_dir_all(root);
}
