//! Named volumes (the lifecycle spec's `pvc` backend): volumes fastbox makes and keeps on
//! one node, each its own ext4 file system in a sparse image of its size, so a volume never
//! holds more than its quota.
//!
//! `DATA_DIR/volumes/NAME/` holds `disk.img`, the mount point `mnt` (the image mounted
//! `nosuid,nodev` through a loop device, as writable layers are) and the volume's contents in
//! `mnt/data`; `users/ID` marks each sandbox of this node that mounts it, and `delete-with`
//! names the sandbox whose end removes the volume (`deleteOnSandboxTermination` of the create
//! that made it). A volume is mounted on the host from its first use until it is deleted or
//! the instance is purged.
//!
//! Everything in a volume's directory is fastbox's own but `mnt/data`, the tenants': that is
//! opened with [`Dir`] (confined), and a volume is deleted by unmounting its file system first,
//! then removing fastbox's own files one by one, never by a recursive delete.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use fastbox_runtime::confine::Dir;

/// The directory of named volumes in a data directory.
pub const VOLUMES_DIR: &str = "volumes";
const IMAGE: &str = "disk.img";
const MOUNT: &str = "mnt";
const DATA: &str = "data";
const USERS: &str = "users";
const DELETE_WITH: &str = "delete-with";

/// Why a named volume could not be had or removed.
#[derive(Debug, thiserror::Error)]
pub enum NamedVolumeError {
    #[error("named volume {name} does not exist on this node (createIfNotExists is false)")]
    Missing { name: String },
    #[error("named volume {name}: {what} {path}: {source}")]
    Io {
        name: String,
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("named volume {name}: {source}")]
    Make {
        name: String,
        source: fastbox_runtime::rootfs::RootfsError,
    },
    #[error("named volume {name}: {source}")]
    Open {
        name: String,
        source: fastbox_runtime::confine::ConfineError,
    },
    #[error("named volume {name} is mounted by sandbox(es) {users}: delete them first")]
    InUse { name: String, users: String },
    #[error("named volume: {what} {text:?} is not a plain name (letters, digits, '-', '_')")]
    BadName { what: &'static str, text: String },
    #[error("named volume {name} does not exist on this node")]
    NotFound { name: String },
    #[error("named volume {name}: {size_bytes} bytes asked, the node's disk has {free_bytes} free")]
    NoRoom {
        name: String,
        size_bytes: u64,
        free_bytes: u64,
    },
}

/// A volume name or sandbox id as a file name of its own: never a path.
fn check_name(text: &str, what: &'static str) -> Result<(), NamedVolumeError> {
    let plain = !text.is_empty()
        && text.len() <= 128
        && !text.starts_with('.')
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    match plain {
        true => Ok(()),
        false => Err(NamedVolumeError::BadName {
            what,
            text: text.to_string(),
        }),
    }
}

/// A named volume as `fastbox volume list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    /// Its quota (the image's size).
    pub size_bytes: u64,
    /// Bytes its files take (while mounted; `None` otherwise).
    pub used_bytes: Option<u64>,
    /// Sandboxes of this node that mount it.
    pub users: Vec<String>,
}

/// The named volumes of one data directory.
#[derive(Debug)]
pub struct NamedVolumes {
    dir: PathBuf,
    /// Makes, mounts and deletions, one at a time.
    lock: Mutex<()>,
}

impl NamedVolumes {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join(VOLUMES_DIR),
            lock: Mutex::new(()),
        }
    }

    /// The contents of volume `name` for sandbox `user`, mounted now when it is not, made
    /// now (`size_bytes` large) when missing and `create`; `delete_with_user` makes the
    /// volume go with `user` when this call made it. Returns the directory, held open.
    pub fn open_for(
        &self,
        name: &str,
        user: &str,
        create: bool,
        size_bytes: u64,
        delete_with_user: bool,
    ) -> Result<Dir, NamedVolumeError> {
        check_name(name, "name")?;
        check_name(user, "sandbox id")?;
        let _one = self.lock.lock().expect("named volumes lock");
        let dir = self.dir.join(name);
        let io = |what, path: &Path| io_err(name, what, path);
        let image = dir.join(IMAGE);
        let made = !image.exists();
        if made {
            if !create {
                return Err(NamedVolumeError::Missing {
                    name: name.to_string(),
                });
            }
            // Its image is sparse, but it may fill up: never promise more than the disk has.
            make_private_dir(&self.dir).map_err(io("create", &self.dir))?;
            let free_bytes = nix::sys::statvfs::statvfs(&self.dir)
                .map(|st| st.blocks_available().saturating_mul(st.fragment_size()))
                .map_err(|e| io("stat", &self.dir)(std::io::Error::from(e)))?;
            if size_bytes > free_bytes {
                return Err(NamedVolumeError::NoRoom {
                    name: name.to_string(),
                    size_bytes,
                    free_bytes,
                });
            }
            make_private_dir(&dir).map_err(io("create", &dir))?;
            fastbox_runtime::rootfs::make_ext4_image(&image, size_bytes).map_err(|source| {
                NamedVolumeError::Make {
                    name: name.to_string(),
                    source,
                }
            })?;
            if delete_with_user {
                let path = dir.join(DELETE_WITH);
                std::fs::write(&path, user).map_err(io("write", &path))?;
            }
        }
        let mount = dir.join(MOUNT);
        if !crate::from_artifact::is_mount_point(&mount) {
            make_private_dir(&mount).map_err(io("create", &mount))?;
            fastbox_runtime::loopdev::mount_image(
                &image,
                &mount,
                "ext4",
                nix::mount::MsFlags::MS_NOATIME
                    | nix::mount::MsFlags::MS_NODEV
                    | nix::mount::MsFlags::MS_NOSUID,
            )
            .map_err(io("mount", &image))?;
        }
        let users = dir.join(USERS);
        make_private_dir(&users).map_err(io("create", &users))?;
        let marker = users.join(user);
        std::fs::write(&marker, b"").map_err(io("write", &marker))?;
        let root = Dir::open_root(&mount).map_err(|source| NamedVolumeError::Open {
            name: name.to_string(),
            source,
        })?;
        // The contents live one level down: the file system's own `lost+found` stays out of
        // the sandbox.
        root.own_dir(DATA, 0o755)
            .map_err(|source| NamedVolumeError::Open {
                name: name.to_string(),
                source,
            })
    }

    /// Sandbox `user` of this node ended: it no longer mounts any volume, and the volumes
    /// that were to go with a sandbox that ended (this one or an earlier one) and that no
    /// sandbox mounts any more are deleted. Returns the names of the deleted ones.
    pub fn user_ended(&self, user: &str) -> Vec<String> {
        if check_name(user, "sandbox id").is_err() {
            return Vec::new();
        }
        let mut deleted = Vec::new();
        for name in self.names() {
            let dir = self.dir.join(&name);
            let _ = std::fs::remove_file(dir.join(USERS).join(user));
            let goes = std::fs::read_to_string(dir.join(DELETE_WITH)).is_ok()
                && self.users_of(&name).is_empty();
            if goes {
                match self.delete(&name) {
                    Ok(()) => deleted.push(name),
                    Err(e) => {
                        tracing::warn!(volume = %name, error = %e, "a named volume that was to go with its sandbox stays")
                    }
                }
            }
        }
        deleted
    }

    /// Deletes volume `name` and its contents, unless a sandbox mounts it.
    pub fn delete(&self, name: &str) -> Result<(), NamedVolumeError> {
        check_name(name, "name")?;
        let _one = self.lock.lock().expect("named volumes lock");
        let dir = self.dir.join(name);
        let users = self.users_of(name);
        if !users.is_empty() {
            return Err(NamedVolumeError::InUse {
                name: name.to_string(),
                users: users.join(", "),
            });
        }
        let io = |what, path: &Path| io_err(name, what, path);
        if !dir.join(IMAGE).exists() {
            return Err(NamedVolumeError::NotFound {
                name: name.to_string(),
            });
        }
        let mount = dir.join(MOUNT);
        if crate::from_artifact::is_mount_point(&mount) {
            nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| io("unmount", &mount)(std::io::Error::from(e)))?;
        }
        // Only fastbox's own files, one by one: the contents went with the image.
        for file in [IMAGE, DELETE_WITH] {
            match std::fs::remove_file(dir.join(file)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("remove", &dir.join(file))(e));
                }
                _ => {}
            }
        }
        for sub in [USERS, MOUNT, ""] {
            let path = dir.join(sub);
            match std::fs::remove_dir(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("remove", &path)(e));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Every named volume of this node.
    pub fn list(&self) -> Vec<VolumeInfo> {
        self.names()
            .into_iter()
            .map(|name| {
                let dir = self.dir.join(&name);
                let mount = dir.join(MOUNT);
                VolumeInfo {
                    size_bytes: std::fs::metadata(dir.join(IMAGE)).map_or(0, |m| m.len()),
                    used_bytes: crate::from_artifact::is_mount_point(&mount)
                        .then(|| nix::sys::statvfs::statvfs(&mount).ok())
                        .flatten()
                        .map(|s| (s.blocks() - s.blocks_free()) * s.fragment_size()),
                    users: self.users_of(&name),
                    name,
                }
            })
            .collect()
    }

    /// Unmounts every named volume (a purge of the instance); their images stay.
    pub fn unmount_all(&self) {
        for name in self.names() {
            let mount = self.dir.join(&name).join(MOUNT);
            if crate::from_artifact::is_mount_point(&mount) {
                let _ = nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }

    fn names(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn users_of(&self, name: &str) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.dir.join(name).join(USERS)) else {
            return Vec::new();
        };
        let mut users: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        users.sort();
        users
    }
}

/// What a failed call on `path` of volume `name` doing `what` is.
fn io_err(
    name: &str,
    what: &'static str,
    path: &Path,
) -> impl FnOnce(std::io::Error) -> NamedVolumeError + use<> {
    let (name, path) = (name.to_string(), path.to_path_buf());
    move |source| NamedVolumeError::Io {
        name,
        what,
        path,
        source,
    }
}

fn make_private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}
