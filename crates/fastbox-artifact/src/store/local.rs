//! The local directory backend: the artifact store of a single machine.
//!
//! ```text
//! <root>/blocks/ab/abcdef...        one file per block, named by its digest (fan-out on the
//!                                   first two hex digits)
//! <root>/manifests/<digest>.json    one file per manifest
//! <root>/index/<escaped key>        "<manifest digest>\n"
//! <root>/tmp/                       staging files, renamed or linked into place
//! ```
//!
//! Every object is written to a temporary file in `tmp/` (same filesystem), fsynced, then
//! moved into place with `renameat2(RENAME_NOREPLACE)` (or `link`, where the filesystem lacks
//! it), which fails when the name exists: that makes a put create-if-absent, tells exactly one
//! of several concurrent writers that it added the object, and makes index creation
//! conditional. The parent directory is fsynced afterwards, so a block is durable before the
//! manifest that lists it is written. No locks: several processes may share one store.
//! Stored files are read-only (0444).

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::{UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;
use tempfile::NamedTempFile;

use super::{
    ArtifactStore, IndexCreate, IndexKey, ObjectKind, StoreError, Stored, StoredObject,
    verify_block_put, verify_read,
};
use crate::digest::Digest;

const BLOCKS: &str = "blocks";
const MANIFESTS: &str = "manifests";
const INDEX: &str = "index";
const TMP: &str = "tmp";
const MANIFEST_SUFFIX: &str = ".json";
/// How often a conditional index create retries when the entry it lost to is deleted before
/// it can be read.
const INDEX_CREATE_ATTEMPTS: usize = 16;

/// An artifact store in a local directory. See the module docs for the layout.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    /// Open the store at `dir`, creating its directories when missing.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let root = dir.as_ref().to_path_buf();
        for sub in [BLOCKS, MANIFESTS, INDEX, TMP] {
            let path = root.join(sub);
            fs::create_dir_all(&path).map_err(io_error("create", &path))?;
        }
        Ok(LocalStore { root })
    }

    /// The store's directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a block is (or would be) stored.
    pub fn block_path(&self, digest: &Digest) -> PathBuf {
        let hex = digest.to_hex();
        self.root.join(BLOCKS).join(&hex[..2]).join(hex)
    }

    /// Where a manifest is (or would be) stored.
    pub fn manifest_path(&self, digest: &Digest) -> PathBuf {
        self.root
            .join(MANIFESTS)
            .join(format!("{digest}{MANIFEST_SUFFIX}"))
    }

    /// Where an index entry is (or would be) stored.
    pub fn index_path(&self, key: &IndexKey) -> PathBuf {
        self.root.join(INDEX).join(key.escaped())
    }

    /// Write `bytes` to a read-only, fsynced temporary file in `tmp/`.
    fn stage(&self, bytes: &[u8]) -> Result<NamedTempFile, StoreError> {
        let dir = self.root.join(TMP);
        let mut tmp = tempfile::Builder::new()
            .prefix("stage-")
            .tempfile_in(&dir)
            .map_err(io_error("create a temporary file in", &dir))?;
        let path = tmp.path().to_path_buf();
        tmp.write_all(bytes).map_err(io_error("write", &path))?;
        tmp.as_file()
            .set_permissions(fs::Permissions::from_mode(0o444))
            .map_err(io_error("chmod", &path))?;
        tmp.as_file().sync_all().map_err(io_error("fsync", &path))?;
        Ok(tmp)
    }

    /// Store `bytes` at `path` unless an object of that size is there already.
    fn put_object(&self, path: &Path, bytes: &[u8]) -> Result<Stored, StoreError> {
        let replaced_corrupt = match refresh_if_present(path, bytes.len() as u64)? {
            Presence::Present => return Ok(Stored::AlreadyPresent),
            Presence::Absent => false,
            Presence::RemovedCorrupt => true,
        };
        let parent = path.parent().expect("object paths have a parent");
        fs::create_dir_all(parent).map_err(io_error("create", parent))?;
        let staged = self.stage(bytes)?;
        match staged.persist_noclobber(path) {
            Ok(_) => {
                sync_dir(parent)?;
                // A repaired object was referenced before this put: never report it as ours.
                Ok(if replaced_corrupt {
                    Stored::AlreadyPresent
                } else {
                    Stored::Added
                })
            }
            // A concurrent writer of the same content got there first.
            Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => Ok(Stored::AlreadyPresent),
            Err(e) => Err(io_error("move into place", path)(e.error)),
        }
    }

    fn read_object(
        &self,
        kind: ObjectKind,
        digest: &Digest,
        path: &Path,
    ) -> Result<Vec<u8>, StoreError> {
        match fs::read(path) {
            Ok(bytes) => verify_read(kind, digest, bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(StoreError::NotFound {
                kind,
                digest: *digest,
            }),
            Err(e) => Err(io_error("read", path)(e)),
        }
    }
}

impl ArtifactStore for LocalStore {
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError> {
        verify_block_put(digest, bytes)?;
        self.put_object(&self.block_path(digest), bytes)
    }

    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.read_object(ObjectKind::Block, digest, &self.block_path(digest))
    }

    fn has_block(&self, digest: &Digest) -> Result<bool, StoreError> {
        exists(&self.block_path(digest))
    }

    fn delete_block(&self, digest: &Digest) -> Result<(), StoreError> {
        remove(&self.block_path(digest))
    }

    fn list_blocks(&self) -> Result<Vec<StoredObject>, StoreError> {
        let mut blocks = Vec::new();
        let fanouts = read_dir_names(&self.root.join(BLOCKS))?;
        for fanout in fanouts.into_iter().filter(|n| is_fanout(n)) {
            let dir = self.root.join(BLOCKS).join(&fanout);
            for name in read_dir_names(&dir)? {
                match Digest::from_hex(&name) {
                    Ok(digest) if name.starts_with(&fanout) => {
                        blocks.extend(stored_object(digest, &dir.join(&name))?);
                    }
                    _ => tracing::debug!(path = %dir.join(&name).display(), "not a block, skipped"),
                }
            }
        }
        Ok(blocks)
    }

    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError> {
        let digest = Digest::of(bytes);
        let stored = self.put_object(&self.manifest_path(&digest), bytes)?;
        Ok((digest, stored))
    }

    fn get_manifest(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.read_object(ObjectKind::Manifest, digest, &self.manifest_path(digest))
    }

    fn has_manifest(&self, digest: &Digest) -> Result<bool, StoreError> {
        exists(&self.manifest_path(digest))
    }

    fn delete_manifest(&self, digest: &Digest) -> Result<(), StoreError> {
        remove(&self.manifest_path(digest))
    }

    fn list_manifests(&self) -> Result<Vec<StoredObject>, StoreError> {
        let dir = self.root.join(MANIFESTS);
        let mut manifests = Vec::new();
        for name in read_dir_names(&dir)? {
            let digest = name
                .strip_suffix(MANIFEST_SUFFIX)
                .and_then(|hex| Digest::from_hex(hex).ok());
            match digest {
                Some(digest) => manifests.extend(stored_object(digest, &dir.join(&name))?),
                None => {
                    tracing::debug!(path = %dir.join(&name).display(), "not a manifest, skipped")
                }
            }
        }
        Ok(manifests)
    }

    fn index_create_if_absent(
        &self,
        key: &IndexKey,
        digest: &Digest,
    ) -> Result<IndexCreate, StoreError> {
        let path = self.index_path(key);
        let parent = self.root.join(INDEX);
        for _ in 0..INDEX_CREATE_ATTEMPTS {
            let staged = self.stage(format!("{digest}\n").as_bytes())?;
            match staged.persist_noclobber(&path) {
                Ok(_) => {
                    sync_dir(&parent)?;
                    return Ok(IndexCreate::Created);
                }
                Err(e) if e.error.kind() == io::ErrorKind::AlreadyExists => {
                    // Lost to an existing entry; if it was deleted before we read it, retry.
                    if let Some(existing) = self.index_get(key)? {
                        return Ok(IndexCreate::Exists(existing));
                    }
                }
                Err(e) => return Err(io_error("create index entry", &path)(e.error)),
            }
        }
        Err(io_error("create index entry", &path)(io::Error::other(
            "the entry kept being created and deleted concurrently",
        )))
    }

    fn index_get(&self, key: &IndexKey) -> Result<Option<Digest>, StoreError> {
        let path = self.index_path(key);
        let content = match fs::read_to_string(&path) {
            Ok(content) => content,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error("read", &path)(e)),
        };
        Digest::from_hex(content.trim_end_matches('\n'))
            .map(Some)
            .map_err(|_| StoreError::CorruptIndex {
                key: key.clone(),
                content,
            })
    }

    fn index_delete(&self, key: &IndexKey) -> Result<(), StoreError> {
        remove(&self.index_path(key))
    }

    fn list_index(&self) -> Result<Vec<(IndexKey, Digest)>, StoreError> {
        let mut entries = Vec::new();
        for name in read_dir_names(&self.root.join(INDEX))? {
            let Ok(key) = IndexKey::from_escaped(&name) else {
                tracing::debug!(name, "not an index entry, skipped");
                continue;
            };
            // An entry deleted since the directory was read is simply not listed.
            if let Some(digest) = self.index_get(&key)? {
                entries.push((key, digest));
            }
        }
        Ok(entries)
    }
}

/// What [`refresh_if_present`] found.
enum Presence {
    /// Present with the expected size; its modification time is now.
    Present,
    /// Not there.
    Absent,
    /// There with the wrong size, and removed so it can be written again.
    RemovedCorrupt,
}

/// Whether an object of `len` bytes is at `path`; if so, touch it so garbage collection sees
/// it in use. Touching doubles as a re-check: an object removed since `stat` is absent.
fn refresh_if_present(path: &Path, len: u64) -> Result<Presence, StoreError> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Presence::Absent),
        Err(e) => return Err(io_error("stat", path)(e)),
    };
    if metadata.len() != len {
        tracing::warn!(path = %path.display(), size = metadata.len(), expected = len,
            "stored object has the wrong size; replacing it");
        remove(path)?;
        return Ok(Presence::RemovedCorrupt);
    }
    let now = TimeSpec::UTIME_NOW;
    match utimensat(
        None,
        path,
        &TimeSpec::UTIME_OMIT,
        &now,
        UtimensatFlags::NoFollowSymlink,
    ) {
        Ok(()) => Ok(Presence::Present),
        Err(nix::errno::Errno::ENOENT) => Ok(Presence::Absent),
        Err(e) => Err(io_error("touch", path)(e.into())),
    }
}

/// Whether `name` is a fan-out directory name: two lowercase hex digits.
fn is_fanout(name: &str) -> bool {
    name.len() == 2 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn exists(path: &Path) -> Result<bool, StoreError> {
    path.try_exists().map_err(io_error("stat", path))
}

fn remove(path: &Path) -> Result<(), StoreError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("remove", path)(e)),
    }
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("fsync", dir))
}

/// The names in `dir` (non-UTF-8 names are not ours and are skipped).
fn read_dir_names(dir: &Path) -> Result<Vec<String>, StoreError> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error("list", dir))? {
        let entry = entry.map_err(io_error("list", dir))?;
        if let Ok(name) = entry.file_name().into_string() {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The listing of one object, None when it was removed since its directory was read.
fn stored_object(digest: Digest, path: &Path) -> Result<Option<StoredObject>, StoreError> {
    let metadata = match fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("stat", path)(e)),
    };
    let modified = metadata.modified().map_err(io_error("stat", path))?;
    Ok(Some(StoredObject {
        digest,
        size: metadata.len(),
        modified,
    }))
}

/// Map an I/O error on `path` to a store error.
fn io_error<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        location: path.display().to_string(),
        source,
    }
}
