//! The sandbox root: an overlay whose lower layer is the image rootfs and whose upper layer
//! lives on a per-sandbox, size-limited filesystem (a sparse ext4 image on a loop device), so
//! a full sandbox gets ENOSPC inside while the host disk is untouched.
//!
//! The overlay is mounted here, in the host mount namespace, and handed to the sandbox as its
//! root: a restore can then be pointed at a new root (`criu restore --root`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{command} failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("mount {what} at {path}: {source}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        source: nix::Error,
    },
    #[error("image rootfs {0} does not exist")]
    MissingLower(PathBuf),
}

/// The mounted root of one sandbox.
#[derive(Debug, Clone)]
pub struct Rootfs {
    /// The overlay mount point: the sandbox's `/`.
    pub root: PathBuf,
    /// The overlay's upper directory (the sandbox's changes).
    pub upper: PathBuf,
    layer_mount: PathBuf,
    layer_image: PathBuf,
}

/// A sparse file of `bytes` at `path` (made anew) with an empty ext4 file system on it, no
/// journal and nothing reserved: a writable layer, a named volume.
pub fn make_ext4_image(path: &Path, bytes: u64) -> Result<(), RootfsError> {
    let image = fs::File::create(path).map_err(io("create", path))?;
    image.set_len(bytes).map_err(io("size", path))?;
    drop(image);
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal", "-m", "0"])
        .args(["-E", "lazy_itable_init=1,nodiscard"])
        .arg(path))
}

impl Rootfs {
    /// Paths used for the sandbox directory `dir` (nothing is created).
    pub fn at(dir: &Path) -> Self {
        let layer_mount = dir.join("layer");
        Self {
            root: dir.join("rootfs"),
            upper: layer_mount.join("upper"),
            layer_image: dir.join("layer.img"),
            layer_mount,
        }
    }

    /// Create the writable layer (`disk_bytes` large) and mount the overlay over `lower`.
    /// `seed_upper`, when given, is copied into the new upper layer first (a restore of a
    /// sandbox whose writable layer was saved).
    pub fn create(
        dir: &Path,
        lower: &Path,
        disk_bytes: u64,
        seed_upper: Option<&Path>,
    ) -> Result<Self, RootfsError> {
        if !lower.is_dir() {
            return Err(RootfsError::MissingLower(lower.to_path_buf()));
        }
        Self::create_layer(dir, disk_bytes)?;
        Self::mount_over(dir, lower, seed_upper)
    }

    /// Only the writable layer of `dir`: a sparse ext4 image of `disk_bytes`, mounted, with
    /// an empty upper and work directory. The slow half of [`Rootfs::create`], done ahead of
    /// demand for spare slots; [`Rootfs::mount_over`] finishes it.
    pub fn create_layer(dir: &Path, disk_bytes: u64) -> Result<Self, RootfsError> {
        let this = Self::at(dir);
        create_dir(dir)?;
        make_ext4_image(&this.layer_image, disk_bytes)?;
        create_dir(&this.layer_mount)?;
        crate::loopdev::mount_image(
            &this.layer_image,
            &this.layer_mount,
            "ext4",
            // The layer is the tenant's: nothing on it is a device or a set-id program for
            // the host.
            MsFlags::MS_NOATIME | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        )
        .map_err(io("mount", &this.layer_image))?;
        create_dir(&this.layer_mount.join("work"))?;
        create_dir(&this.upper)?;
        Ok(this)
    }

    /// Mount the overlay of `dir` over `lower`, on the writable layer made by
    /// [`Rootfs::create_layer`], with the contents of `seed_upper` copied into its upper
    /// layer first.
    pub fn mount_over(
        dir: &Path,
        lower: &Path,
        seed_upper: Option<&Path>,
    ) -> Result<Self, RootfsError> {
        if !lower.is_dir() {
            return Err(RootfsError::MissingLower(lower.to_path_buf()));
        }
        let this = Self::at(dir);
        if let Some(seed) = seed_upper {
            crate::tree_copy::copy_contents(seed, &this.upper).map_err(|source| {
                RootfsError::Io {
                    what: "copy the writable layer",
                    path: seed.to_path_buf(),
                    source,
                }
            })?;
        }
        create_dir(&this.root)?;
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            this.upper.display(),
            this.layer_mount.join("work").display()
        );
        mount(
            Some("overlay"),
            &this.root,
            Some("overlay"),
            // Device nodes an image ships, or a sandbox makes, open nothing: the sandbox's
            // devices are those of its own `/dev`, a mount of its own.
            MsFlags::MS_NODEV,
            Some(options.as_str()),
        )
        .map_err(|source| RootfsError::Mount {
            what: "overlay",
            path: this.root.clone(),
            source,
        })?;
        Ok(this)
    }

    /// The lower layer (the image rootfs) of the mounted overlay, from the mount table.
    pub fn lower(&self) -> Option<PathBuf> {
        let table = fs::read_to_string("/proc/self/mountinfo").ok()?;
        let wanted = self.root.to_string_lossy();
        table
            .lines()
            .filter(|l| l.split(' ').nth(4).map(unescape_mount_path).as_deref() == Some(&*wanted))
            .filter_map(|l| l.rsplit(' ').next())
            .flat_map(|opts| opts.split(','))
            .find_map(|o| o.strip_prefix("lowerdir="))
            .map(|l| PathBuf::from(unescape_mount_path(l)))
    }

    /// Unmount the overlay and the writable layer and delete the sandbox's files.
    /// Idempotent: missing pieces are skipped.
    pub fn destroy(&self) -> Result<(), RootfsError> {
        for point in [&self.root, &self.layer_mount] {
            unmount_if_mounted(point)?;
        }
        for file in [&self.layer_image] {
            if let Err(e) = fs::remove_file(file)
                && e.kind() != io::ErrorKind::NotFound
            {
                return Err(RootfsError::Io {
                    what: "remove",
                    path: file.clone(),
                    source: e,
                });
            }
        }
        for dir in [&self.root, &self.layer_mount] {
            let _ = fs::remove_dir(dir);
        }
        Ok(())
    }
}

/// Detach-unmount `path` if something is mounted there.
pub(crate) fn unmount_if_mounted(path: &Path) -> Result<(), RootfsError> {
    if !is_mount_point(path) {
        return Ok(());
    }
    umount2(path, MntFlags::MNT_DETACH).map_err(|source| RootfsError::Mount {
        what: "unmount",
        path: path.to_path_buf(),
        source,
    })
}

/// True when `path` is listed as a mount point in this process's mount table.
pub fn is_mount_point(path: &Path) -> bool {
    let wanted = path.to_string_lossy();
    mount_points().iter().any(|p| *p == wanted)
}

/// Mount points under `/proc/self/mountinfo` containing `needle` (leak checks by prefix).
pub fn mounts_containing(needle: &str) -> Vec<String> {
    mount_points()
        .into_iter()
        .filter(|p| p.contains(needle))
        .collect()
}

/// Every mount point of this mount namespace, from `/proc/self/mountinfo` (escapes decoded).
pub fn mount_points() -> Vec<String> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .collect()
}

fn unescape_mount_path(p: &str) -> String {
    p.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn create_dir(path: &Path) -> Result<(), RootfsError> {
    fs::create_dir_all(path).map_err(io("create", path))
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> RootfsError {
    let path = path.to_path_buf();
    move |source| RootfsError::Io { what, path, source }
}

fn run(cmd: &mut Command) -> Result<(), RootfsError> {
    let command = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| RootfsError::Command {
        command: command.clone(),
        stderr: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(RootfsError::Command {
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}
