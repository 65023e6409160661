//! Where live snapshots write their files while the sandbox is frozen
//! (`docs/snapshots.md`): the instance's own tmpfs at `/dev/shm/fastbox-<prefix>-staging`,
//! with transparent huge pages (`huge=always`). CRIU splices every memory page of the
//! sandbox into an image file there. On a tmpfs of 4 KiB pages, allocating the file's pages
//! dominates that copy; with 2 MiB pages, a 256 MiB dump froze its sandbox for about 137
//! instead of 188 ms here. Where the mount cannot be made, the directory is used as it is,
//! on `/dev/shm`.
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
    /// The staging area of `prefix`: its huge-page tmpfs, mounted now unless it already is.
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
                Some("mode=0700,huge=always"),
            )
            .inspect_err(
                |e| tracing::info!(dir = %root.display(), error = %e, "staging without huge pages"),
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
    if mounted && let Err(e) = umount2(root, MntFlags::MNT_DETACH) {
        tracing::warn!(dir = %root.display(), error = %e, "could not unmount the staging area");
    }
    let _ = std::fs::remove_dir_all(root);
}
