//! Packing a rootfs directory into one reproducible image file.
//!
//! A template's rootfs travels as a single file of the artifact: an **erofs** image, which
//! the kernel mounts read-only as the overlay's lower layer without unpacking, or a
//! **canonical tar** where `mkfs.erofs` is missing (unpacked before use). Both are
//! reproducible: the same tree (names, contents, modes, ownership, xattrs, symlinks, device
//! nodes, hard links) gives the same bytes, whatever order the directory was written in and
//! whatever its timestamps, so re-packing an unchanged rootfs produces the same blocks and
//! costs no storage.
//!
//! - erofs: `mkfs.erofs -T0 -U<nil uuid>` (every timestamp 0, a fixed filesystem UUID,
//!   uncompressed); erofs-utils sorts directory entries itself. Checked with erofs-utils 1.5.
//! - tar: GNU format, entries in tree order, mtime 0, numeric uid/gid kept but user and group
//!   names empty, xattrs as PAX `SCHILY.xattr.*` records, hard links as link entries to the
//!   first path in tree order; sockets are skipped.
//!
//! Ownership is kept in both formats: image layers own files as specific users (a database's
//! data directory), and a rootfs unpacked as root records them.

mod erofs;
mod tar;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::tree::TreeError;

/// Why a rootfs could not be packed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The rootfs could not be walked.
    #[error("walk the rootfs: {0}")]
    Tree(#[from] TreeError),
    /// The output would be written into the tree being packed.
    #[error("output {out} is inside the rootfs {rootfs}")]
    OutputInsideRootfs { out: PathBuf, rootfs: PathBuf },
    /// `mkfs.erofs` is not installed.
    #[error("mkfs.erofs is not installed (Debian: erofs-utils); pack as tar instead")]
    ErofsToolMissing,
    /// `mkfs.erofs` failed.
    #[error("mkfs.erofs failed ({status}): {stderr}")]
    Erofs { status: String, stderr: String },
    /// A file changed size while it was packed.
    #[error("{path} changed while it was packed: {expected} bytes listed, {read} read")]
    Changed {
        path: PathBuf,
        expected: u64,
        read: u64,
    },
    /// Reading the tree or writing the image failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How a rootfs is packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackFormat {
    /// An uncompressed erofs image, mounted read-only.
    Erofs,
    /// A canonical tar archive, unpacked before use.
    Tar,
}

impl PackFormat {
    /// Erofs where `mkfs.erofs` can be run, tar otherwise.
    pub fn best_available() -> Self {
        if erofs::available() {
            PackFormat::Erofs
        } else {
            PackFormat::Tar
        }
    }
}

/// A packed rootfs image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedRootfs {
    /// How it was packed.
    pub format: PackFormat,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Pack the tree at `rootfs` into `out` (replaced atomically when it exists; written via a
/// temporary file beside it).
pub fn pack_rootfs(
    rootfs: &Path,
    out: &Path,
    format: PackFormat,
) -> Result<PackedRootfs, PackError> {
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| PackError::Io { op, path, source }
    };
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let rootfs_real = fs::canonicalize(rootfs).map_err(io("resolve", rootfs))?;
    let parent_real = fs::canonicalize(parent).map_err(io("resolve", parent))?;
    if parent_real.starts_with(&rootfs_real) {
        return Err(PackError::OutputInsideRootfs {
            out: out.to_path_buf(),
            rootfs: rootfs.to_path_buf(),
        });
    }
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    let mut staged = tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempfile_in(parent)
        .map_err(io("create a temporary file in", parent))?;
    match format {
        PackFormat::Erofs => erofs::write(&rootfs_real, staged.path())?,
        PackFormat::Tar => tar::write(&rootfs_real, staged.as_file_mut())?,
    }
    let file = staged.as_file();
    file.set_permissions(fs::Permissions::from_mode(0o644))
        .map_err(io("chmod", staged.path()))?;
    file.sync_all().map_err(io("fsync", staged.path()))?;
    let bytes = file.metadata().map_err(io("stat", staged.path()))?.len();
    staged.persist(out).map_err(|e| PackError::Io {
        op: "move into place",
        path: out.to_path_buf(),
        source: e.error,
    })?;
    Ok(PackedRootfs { format, bytes })
}
