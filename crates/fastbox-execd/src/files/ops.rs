//! The small synchronous filesystem verbs: delete, move, change permissions, make directories.
//! Each runs inside [`super::fsid::run`], so as the request's identity when it has one.

use std::io::ErrorKind;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::FilesError;
use super::mode::parse_mode;
use crate::identity::Accounts;

/// Mode and ownership as `/files/permissions`, `/directories` and uploads send them;
/// `owner`/`group` may be JSON null.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Permission {
    #[serde(default)]
    pub mode: Option<u32>,
    #[serde(default)]
    pub owner: Option<String>,
    #[serde(default)]
    pub group: Option<String>,
}

impl Permission {
    /// The mode as permission bits, `None` when absent or 0.
    pub fn mode_bits(&self) -> Result<Option<u32>, FilesError> {
        match self.mode {
            None | Some(0) => Ok(None),
            Some(m) => parse_mode(m).map(Some).ok_or_else(|| {
                FilesError::Invalid(format!("invalid mode {m}: digits must be octal"))
            }),
        }
    }

    /// Resolved `(uid, gid)` for chown; `None` for what is unchanged.
    pub fn owner_ids(&self, accounts: &Accounts) -> Result<(Option<u32>, Option<u32>), FilesError> {
        let uid = match self.owner.as_deref().filter(|s| !s.is_empty()) {
            Some(o) => Some(accounts.resolve_uid(o)?),
            None => None,
        };
        let gid = match self.group.as_deref().filter(|s| !s.is_empty()) {
            Some(g) => Some(accounts.resolve_gid(g)?),
            None => None,
        };
        Ok((uid, gid))
    }
}

pub fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> FilesError + '_ {
    move |source| FilesError::from_io(path, source)
}

/// Removes a file; a missing file is fine, a directory is refused.
pub fn delete_file(path: &Path) -> Result<(), FilesError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(FilesError::from_io(path, e)),
        Ok(m) if m.is_dir() => Err(FilesError::Invalid(format!(
            "path is a directory: {}",
            path.display()
        ))),
        Ok(_) => std::fs::remove_file(path).map_err(io_error(path)),
    }
}

/// `rm -rf`; a missing directory is fine.
pub fn delete_dir(path: &Path) -> Result<(), FilesError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        Err(e) => Err(FilesError::from_io(path, e)),
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(io_error(path)),
        Ok(_) => std::fs::remove_file(path).map_err(io_error(path)),
    }
}

/// Moves `src` to `dest`, creating `dest`'s parent; an existing `dest` is refused.
pub fn rename(src: &Path, dest: &Path) -> Result<(), FilesError> {
    std::fs::symlink_metadata(src).map_err(io_error(src))?;
    if std::fs::symlink_metadata(dest).is_ok() {
        return Err(FilesError::Invalid(format!(
            "destination path already exists: {}",
            dest.display()
        )));
    }
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent).map_err(io_error(parent))?;
    }
    std::fs::rename(src, dest).map_err(io_error(src))
}

/// Applies mode and ownership to an existing path.
pub fn set_permissions(
    path: &Path,
    perm: &Permission,
    accounts: &Accounts,
) -> Result<(), FilesError> {
    if let Some(bits) = perm.mode_bits()? {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits))
            .map_err(io_error(path))?;
    }
    let (uid, gid) = perm.owner_ids(accounts)?;
    if uid.is_some() || gid.is_some() {
        chown(path, uid, gid).map_err(io_error(path))?;
    }
    Ok(())
}

/// `mkdir -p`, giving the directories it creates the requested owner and group, and the mode
/// to the target when it did not exist before.
pub fn make_dir(path: &Path, perm: &Permission, accounts: &Accounts) -> Result<(), FilesError> {
    let created = create_dirs(path)?;
    let (uid, gid) = perm.owner_ids(accounts)?;
    for dir in &created {
        if uid.is_some() || gid.is_some() {
            chown(dir, uid, gid).map_err(io_error(dir))?;
        }
    }
    if created.last().is_some_and(|d| d == path)
        && let Some(bits) = perm.mode_bits()?
    {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits))
            .map_err(io_error(path))?;
    }
    Ok(())
}

/// Creates `path` and its missing ancestors; returns the directories created, outermost first.
pub fn create_dirs(path: &Path) -> Result<Vec<PathBuf>, FilesError> {
    let mut missing = Vec::new();
    let mut cur = Some(path);
    while let Some(p) = cur {
        if p.as_os_str().is_empty() || std::fs::metadata(p).is_ok() {
            break;
        }
        missing.push(p.to_path_buf());
        cur = p.parent();
    }
    missing.reverse();
    for dir in &missing {
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(FilesError::from_io(dir, e)),
        }
    }
    Ok(missing)
}
