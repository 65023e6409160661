//! The cache directory on disk: block files, staging, the policy state file, the lock.
//!
//! ```text
//! <dir>/blocks/ab/abcdef...   one file per cached object, named by its digest
//! <dir>/tmp/                  staging files, renamed into place; emptied at open
//! <dir>/state.json            the policy's segment order (written atomically)
//! <dir>/lock                  flock(2)ed exclusively by the one open cache
//! ```
//!
//! Block files are not fsynced: after a crash a renamed file may hold garbage, which the
//! verification of every read catches (the block is dropped and fetched again). The state
//! file is fsynced before it is renamed into place, so a crash leaves the previous state or
//! the new one (and a missing or corrupt one costs only the segment order).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use tempfile::NamedTempFile;

use super::CacheError;
use super::policy::PolicyState;
use crate::digest::Digest;

const BLOCKS: &str = "blocks";
const TMP: &str = "tmp";
const STATE: &str = "state.json";
const LOCK: &str = "lock";

/// The cache directory and the exclusive lock that makes it ours.
#[derive(Debug)]
pub struct Disk {
    root: PathBuf,
    _lock: Flock<File>,
}

impl Disk {
    /// Open (creating) the directory at `root` and lock it; a leftover staging area is
    /// emptied.
    pub fn open(root: &Path) -> Result<Self, CacheError> {
        for sub in [BLOCKS, TMP] {
            let path = root.join(sub);
            fs::create_dir_all(&path).map_err(io_error("create", &path))?;
        }
        let lock_path = root.join(LOCK);
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_error("open", &lock_path))?;
        let lock =
            Flock::lock(lock_file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
                match errno {
                    nix::errno::Errno::EWOULDBLOCK => CacheError::Busy(root.to_path_buf()),
                    errno => io_error("lock", &lock_path)(errno.into()),
                }
            })?;
        let disk = Disk {
            root: root.to_path_buf(),
            _lock: lock,
        };
        disk.clear_staging()?;
        Ok(disk)
    }

    /// The cache directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a cached object is (or would be).
    pub fn block_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.to_hex();
        self.root.join(BLOCKS).join(&hex[..2]).join(hex)
    }

    /// Write `bytes` to a staging file (not yet visible under its name).
    pub fn stage(&self, bytes: &[u8]) -> Result<NamedTempFile, CacheError> {
        let dir = self.root.join(TMP);
        let mut staged = NamedTempFile::new_in(&dir).map_err(io_error("create a file in", &dir))?;
        staged
            .write_all(bytes)
            .map_err(io_error("write", staged.path()))?;
        Ok(staged)
    }

    /// Move a staged file to `digest`'s name (replacing a file of the same content).
    pub fn place(&self, staged: NamedTempFile, digest: &Digest) -> Result<(), CacheError> {
        let path = self.block_path(digest);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io_error("create", parent))?;
        }
        staged
            .persist(&path)
            .map(drop)
            .map_err(|e| io_error("move into place", &path)(e.error))
    }

    /// A cached object's bytes (unverified), None when the file is gone.
    pub fn read(&self, digest: &Digest) -> Result<Option<Vec<u8>>, CacheError> {
        let path = self.block_path(digest);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error("read", &path)(e)),
        }
    }

    /// Remove a cached object's file; an absent file is fine.
    pub fn remove(&self, digest: &Digest) -> Result<(), CacheError> {
        let path = self.block_path(digest);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_error("remove", &path)(e)),
        }
    }

    /// Every cached object on disk with its size. Files whose names are not digests under
    /// their fan-out directory are left alone.
    pub fn scan(&self) -> Result<Vec<(Digest, u64)>, CacheError> {
        let blocks = self.root.join(BLOCKS);
        let mut found = Vec::new();
        for fanout in dir_names(&blocks)? {
            if fanout.len() != 2 {
                continue;
            }
            let dir = blocks.join(&fanout);
            if !dir.is_dir() {
                continue;
            }
            for name in dir_names(&dir)? {
                let path = dir.join(&name);
                match Digest::from_hex(&name) {
                    Ok(digest) if name.starts_with(&fanout) => {
                        let metadata = match fs::symlink_metadata(&path) {
                            Ok(metadata) => metadata,
                            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                            Err(e) => return Err(io_error("stat", &path)(e)),
                        };
                        if metadata.is_file() {
                            found.push((digest, metadata.len()));
                        }
                    }
                    _ => tracing::debug!(path = %path.display(), "not a cached block, skipped"),
                }
            }
        }
        Ok(found)
    }

    /// The persisted policy state; None (with a warning) when it is missing or unreadable.
    pub fn read_state(&self) -> Option<PolicyState> {
        let path = self.root.join(STATE);
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e,
                    "cache state unreadable; every cached block starts in probation");
                return None;
            }
        };
        match serde_json::from_slice(&bytes) {
            Ok(state) => Some(state),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e,
                    "cache state corrupt; every cached block starts in probation");
                None
            }
        }
    }

    /// Write the policy state atomically (staged, fsynced, renamed).
    pub fn write_state(&self, state: &PolicyState) -> Result<(), CacheError> {
        let path = self.root.join(STATE);
        let bytes = serde_json::to_vec(state).map_err(|e| io_error("encode", &path)(e.into()))?;
        let staged = self.stage(&bytes)?;
        staged
            .as_file()
            .sync_all()
            .map_err(io_error("fsync", staged.path()))?;
        staged
            .persist(&path)
            .map(drop)
            .map_err(|e| io_error("move into place", &path)(e.error))
    }

    fn clear_staging(&self) -> Result<(), CacheError> {
        let dir = self.root.join(TMP);
        for name in dir_names(&dir)? {
            let path = dir.join(name);
            if let Err(e) = fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                return Err(io_error("remove", &path)(e));
            }
        }
        Ok(())
    }
}

/// The UTF-8 names in `dir` (others are not ours).
fn dir_names(dir: &Path) -> Result<Vec<String>, CacheError> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
        let entry = entry.map_err(io_error("list", dir))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    Ok(names)
}

/// Map an I/O error on `path` to a cache error.
fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}
