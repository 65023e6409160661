//! Rebuilding an artifact's tree from the store.
//!
//! [`materialize`] writes the tree into a hidden staging directory next to the destination
//! and renames it into place (without replacing anything), so the destination appears
//! complete or not at all. Blocks are fetched by several threads at once, each distinct block
//! once and written at every offset that holds it; every block is verified by the store's
//! read; every file's blocks must have the lengths its size implies. Full zero blocks are not fetched: they are left as
//! holes, so a sparse writable layer stays sparse. Files get their recorded permission bits
//! (setuid included); directories get theirs after their contents are written; ownership
//! is the calling process's and modification times are the time of writing (neither is part
//! of the format). The destination's own mode is 0755.

use std::collections::HashMap;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use nix::fcntl::{RenameFlags, renameat2};

use crate::block::{BLOCK_SIZE, block_len, zero_block_digest};
use crate::digest::Digest;
use crate::entry::EntryKind;
use crate::manifest::{Manifest, ManifestError};
use crate::store::{ArtifactStore, StoreError};

/// Why an artifact could not be read or materialized.
#[derive(Debug, thiserror::Error)]
pub enum MaterializeError {
    /// Reading a manifest or block failed (missing, corrupt, backend error).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The manifest is invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The destination already exists.
    #[error("{0} already exists")]
    DestinationExists(PathBuf),
    /// A block's length does not match its position in the file.
    #[error("{path}: block {index} ({digest}) has {actual} bytes, expected {expected}")]
    BlockLength {
        path: String,
        index: u64,
        digest: Digest,
        expected: usize,
        actual: usize,
    },
    /// Writing the tree failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What a materialization wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaterializeStats {
    /// Entries created (files, directories, symlinks).
    pub entries: u64,
    /// Blocks read from the store (a block a tree holds several times is read once).
    pub blocks_fetched: u64,
    /// Full zero blocks left as holes without a fetch.
    pub zero_blocks: u64,
    /// Bytes of regular files.
    pub bytes: u64,
}

/// Read, verify and validate the manifest stored under `digest`.
pub fn read_manifest<S: ArtifactStore + ?Sized>(
    store: &S,
    digest: &Digest,
) -> Result<Manifest, MaterializeError> {
    let bytes = store.get_manifest(digest)?;
    Ok(Manifest::from_slice(&bytes)?)
}

/// Rebuild the artifact `manifest` at `dest`, which must not exist (its parent must).
pub fn materialize<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Digest,
    dest: &Path,
) -> Result<MaterializeStats, MaterializeError> {
    materialize_except(store, manifest, dest, &|_| false).map(|(stats, _)| stats)
}

/// A regular file of an artifact that [`materialize_except`] did not write: its path in the
/// tree, its size and its blocks, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOut {
    pub path: String,
    pub size: u64,
    pub blocks: Vec<Digest>,
}

/// [`materialize`] without the regular files whose path `leave_out` accepts: those are not
/// in the tree, and are returned (in manifest order) for the caller to fetch later.
pub fn materialize_except<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Digest,
    dest: &Path,
    leave_out: &dyn Fn(&str) -> bool,
) -> Result<(MaterializeStats, Vec<LeftOut>), MaterializeError> {
    let manifest = read_manifest(store, manifest)?;
    if dest.symlink_metadata().is_ok() {
        return Err(MaterializeError::DestinationExists(dest.to_path_buf()));
    }
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = dest.file_name().unwrap_or_default().to_string_lossy();
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{name}.partial-"))
        .tempdir_in(parent)
        .map_err(io_error("create a staging directory in", parent))?;
    let (stats, left_out) = write_tree(store, &manifest, staging.path(), leave_out)?;
    renameat2(
        None,
        staging.path(),
        None,
        dest,
        RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|e| match e {
        nix::errno::Errno::EEXIST => MaterializeError::DestinationExists(dest.to_path_buf()),
        e => io_error("rename into place", dest)(e.into()),
    })?;
    // Renamed away: nothing left for the guard to remove.
    let _ = staging.keep();
    Ok((stats, left_out))
}

fn write_tree<S: ArtifactStore + ?Sized>(
    store: &S,
    manifest: &Manifest,
    root: &Path,
    leave_out: &dyn Fn(&str) -> bool,
) -> Result<(MaterializeStats, Vec<LeftOut>), MaterializeError> {
    let mut stats = MaterializeStats::default();
    let mut left_out = Vec::new();
    let mut dirs = Vec::new();
    let mut files = Vec::new();
    for entry in &manifest.files {
        let path = root.join(&entry.path);
        match &entry.kind {
            EntryKind::Dir => {
                DirBuilder::new()
                    .mode(0o700)
                    .create(&path)
                    .map_err(io_error("create", &path))?;
                dirs.push((path, entry.mode));
            }
            EntryKind::File { size, blocks } if leave_out(&entry.path) => {
                left_out.push(LeftOut {
                    path: entry.path.clone(),
                    size: *size,
                    blocks: blocks.clone(),
                });
                continue;
            }
            EntryKind::File { size, blocks } => {
                create_file(&path, *size)?;
                files.push(FileJob {
                    name: &entry.path,
                    path,
                    mode: entry.mode,
                    size: *size,
                    blocks,
                });
                stats.bytes += size;
            }
            EntryKind::Symlink { target } => {
                std::os::unix::fs::symlink(target, &path).map_err(io_error("symlink", &path))?;
            }
        }
        stats.entries += 1;
    }
    let (fetched, zero) = fill_files(store, &files)?;
    stats.blocks_fetched = fetched;
    stats.zero_blocks = zero;
    for job in &files {
        set_mode(&job.path, job.mode)?;
    }
    // Deepest first, so a read-only directory is filled before it becomes read-only.
    for (path, mode) in dirs.iter().rev() {
        set_mode(path, *mode)?;
    }
    set_mode(root, 0o755)?;
    Ok((stats, left_out))
}

/// Threads fetching and writing a tree's blocks.
const FETCH_WORKERS: usize = 8;

/// A regular file of the tree, created at its size, to be filled block by block (opened
/// again for each block: a tree may hold more files than a process may keep open).
struct FileJob<'a> {
    name: &'a str,
    path: PathBuf,
    mode: u32,
    size: u64,
    blocks: &'a [Digest],
}

fn create_file(path: &Path, size: u64) -> Result<(), MaterializeError> {
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(io_error("create", path))?;
    // Holes where nothing is written: full zero blocks stay sparse.
    file.set_len(size).map_err(io_error("truncate", path))
}

/// Fetches every distinct block of `files` once, but full zero blocks (left as holes), with
/// [`FETCH_WORKERS`] threads, and writes it at each offset that holds it: (blocks fetched,
/// zero blocks). The first error stops the others.
fn fill_files<S: ArtifactStore + ?Sized>(
    store: &S,
    files: &[FileJob<'_>],
) -> Result<(u64, u64), MaterializeError> {
    let zero = zero_block_digest();
    // Each distinct block with every (file, index) it fills, in manifest order.
    let mut jobs: Vec<(Digest, Vec<(usize, usize)>)> = Vec::new();
    let mut by_digest: HashMap<Digest, usize> = HashMap::new();
    let mut zero_blocks = 0;
    for (f, job) in files.iter().enumerate() {
        for (index, digest) in job.blocks.iter().enumerate() {
            if *digest == zero && block_len(job.size, index as u64) == BLOCK_SIZE {
                zero_blocks += 1;
                continue;
            }
            let at = *by_digest.entry(*digest).or_insert_with(|| {
                jobs.push((*digest, Vec::new()));
                jobs.len() - 1
            });
            jobs[at].1.push((f, index));
        }
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..FETCH_WORKERS.min(jobs.len()) {
            scope.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let Some((digest, targets)) = jobs.get(next.fetch_add(1, Ordering::Relaxed))
                    else {
                        return;
                    };
                    if let Err(e) = write_block(store, files, digest, targets) {
                        failed.store(true, Ordering::Relaxed);
                        first_error
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(e);
                        return;
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok((jobs.len() as u64, zero_blocks)),
    }
}

/// Block `digest`, fetched (verified by the store) and written at each of `targets`
/// (file, block index).
fn write_block<S: ArtifactStore + ?Sized>(
    store: &S,
    files: &[FileJob<'_>],
    digest: &Digest,
    targets: &[(usize, usize)],
) -> Result<(), MaterializeError> {
    let bytes = store.get_block(digest)?;
    for &(f, index) in targets {
        let job = &files[f];
        let expected = block_len(job.size, index as u64);
        if bytes.len() != expected {
            return Err(MaterializeError::BlockLength {
                path: job.name.to_string(),
                index: index as u64,
                digest: *digest,
                expected,
                actual: bytes.len(),
            });
        }
        let file: File = OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&job.path)
            .map_err(io_error("open", &job.path))?;
        file.write_all_at(&bytes, index as u64 * BLOCK_SIZE as u64)
            .map_err(io_error("write", &job.path))?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<(), MaterializeError> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io_error("chmod", path))
}

/// Map an I/O error on `path` to a materialize error.
fn io_error<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> MaterializeError + 'a {
    move |source| MaterializeError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}
