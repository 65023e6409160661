//! Publishing a directory tree as an artifact, and naming it in the index.
//!
//! [`publish`] walks the tree in tree order, cuts every regular file into blocks, stores the
//! blocks the store does not have, and writes the manifest last: the commit point. A publish
//! that fails before the manifest write removes the blocks it added and leaves nothing behind
//! (no manifest, so nothing can reference a partial artifact). A failed manifest write leaves
//! the blocks: the manifest may have been stored anyway (a remote store that timed out), and
//! removing its blocks could leave it dangling; garbage collection reclaims them if not.
//!
//! [`publish_index`] then creates the index entry conditionally. When two publishes of one
//! key race, exactly one creates the entry; the loser removes its own manifest (first, so it
//! never dangles) and then the blocks it added that the winner's manifest does not
//! reference.
//!
//! **The remaining race.** Blocks are shared by content across keys. While the loser is
//! publishing, a concurrent publish of *another* key may find one of the loser's new blocks
//! already present, skip uploading it, and reference it; the loser then removes it, and that
//! other manifest lists a block that is gone. Reads fail cleanly (`StoreError::NotFound`,
//! never bad bytes); publishing the same source again restores the block (puts are
//! idempotent and the manifest digest is unchanged). Garbage collection is the backstop:
//! its mark phase, which reads every manifest, reports manifests with missing blocks (and
//! drops them with their index entries, so the next build rebuilds them), and its sweep
//! removes blocks and unindexed manifests left by publishes that crashed, but only those
//! not written or re-put within a grace period (every put of a present object refreshes its
//! modification time), so publishes in flight keep their blocks.

use std::collections::{BTreeSet, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::block::BlockReader;
use crate::digest::Digest;
use crate::entry::{EntryKind, FileEntry, MODE_MASK};
use crate::manifest::{Manifest, ManifestError, ManifestMeta};
use crate::store::{ArtifactStore, IndexCreate, IndexKey, StoreError, Stored};
use crate::tree::{self, TreeEntry, TreeError};

/// Why a publish failed.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The source tree could not be walked.
    #[error("walk the source tree: {0}")]
    Tree(#[from] TreeError),
    /// A file name that is not UTF-8.
    #[error("{0}: the path is not UTF-8")]
    NonUtf8Path(PathBuf),
    /// A symlink target that is not UTF-8.
    #[error("{0}: the symlink target is not UTF-8")]
    NonUtf8Target(String),
    /// A socket, FIFO or device node.
    #[error("{path}: {kind} files cannot be published")]
    Unsupported { path: String, kind: &'static str },
    /// Reading a source file failed.
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file changed size while it was read.
    #[error("{path} changed while it was published: {expected} bytes listed, {read} read")]
    Changed {
        path: String,
        expected: u64,
        read: u64,
    },
    /// Storing a block failed.
    #[error("store a block of {path}: {source}")]
    StoreBlock { path: String, source: StoreError },
    /// Storing the manifest failed.
    #[error("store the manifest: {0}")]
    StoreManifest(StoreError),
    /// Creating the index entry failed (the manifest is stored, unindexed).
    #[error("index {key}: {source}")]
    Index { key: IndexKey, source: StoreError },
    /// The manifest could not be built.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// Receives progress of a publish. Both methods default to doing nothing.
pub trait PublishProgress: Sync {
    /// A regular file is about to be read.
    fn file(&self, _path: &str, _size: u64) {}
    /// A block of `len` bytes was handled; `added` when it was new to the store.
    fn block(&self, _len: usize, _added: bool) {}
}

/// Discards progress.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl PublishProgress for NoProgress {}

/// What a publish read and stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublishStats {
    /// Regular files.
    pub files: u64,
    /// Directories.
    pub dirs: u64,
    /// Symlinks.
    pub symlinks: u64,
    /// Blocks referenced by files (a block used twice counts twice).
    pub blocks: u64,
    /// Distinct blocks this publish added to the store.
    pub new_blocks: u64,
    /// Bytes of regular files.
    pub bytes: u64,
    /// Bytes of the blocks this publish added.
    pub new_bytes: u64,
}

/// A committed artifact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The manifest's digest.
    pub manifest: Digest,
    /// What was read and stored.
    pub stats: PublishStats,
}

/// How the conditional index create of [`publish_index`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexOutcome {
    /// This publish created the entry.
    Created,
    /// The entry already pointed at an identical manifest.
    AlreadyCurrent,
    /// Another publish created the entry first; this publish's manifest and the blocks only
    /// it added were removed.
    Lost {
        /// The manifest this publish had committed.
        ours: Digest,
        /// How many blocks it removed.
        removed_blocks: u64,
    },
}

/// The result of [`publish_index`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexedPublish {
    /// The manifest the index entry points at (the winner's, when this publish lost).
    pub manifest: Digest,
    /// How the index create ended.
    pub outcome: IndexOutcome,
    /// What this publish read and stored.
    pub stats: PublishStats,
}

/// Publish the tree at `src` (see the module docs).
pub fn publish<S: ArtifactStore + ?Sized>(
    store: &S,
    src: &Path,
    meta: ManifestMeta,
    progress: &dyn PublishProgress,
) -> Result<Published, PublishError> {
    Ok(publish_tracked(store, src, meta, progress)?.published)
}

/// Publish the tree at `src`, then point `key` at it unless the key already points at an
/// artifact; the loser of a race removes what only it added (see the module docs).
pub fn publish_index<S: ArtifactStore + ?Sized>(
    store: &S,
    key: &IndexKey,
    src: &Path,
    meta: ManifestMeta,
    progress: &dyn PublishProgress,
) -> Result<IndexedPublish, PublishError> {
    let tracked = publish_tracked(store, src, meta, progress)?;
    let ours = tracked.published.manifest;
    let created =
        store
            .index_create_if_absent(key, &ours)
            .map_err(|source| PublishError::Index {
                key: key.clone(),
                source,
            })?;
    let (manifest, outcome) = match created {
        IndexCreate::Created => (ours, IndexOutcome::Created),
        IndexCreate::Exists(existing) if existing == ours => (ours, IndexOutcome::AlreadyCurrent),
        IndexCreate::Exists(winner) => {
            let removed_blocks = abandon(store, &tracked, &winner);
            tracing::info!(%key, %winner, %ours, removed_blocks, "lost the index race");
            (
                winner,
                IndexOutcome::Lost {
                    ours,
                    removed_blocks,
                },
            )
        }
    };
    Ok(IndexedPublish {
        manifest,
        outcome,
        stats: tracked.published.stats,
    })
}

/// A publish and what it added, for the loser's clean-up.
struct Tracked {
    published: Published,
    manifest_stored: Stored,
    added_blocks: Vec<Digest>,
}

fn publish_tracked<S: ArtifactStore + ?Sized>(
    store: &S,
    src: &Path,
    meta: ManifestMeta,
    progress: &dyn PublishProgress,
) -> Result<Tracked, PublishError> {
    let mut upload = Upload {
        store,
        progress,
        seen: HashSet::new(),
        added: Vec::new(),
        stats: PublishStats::default(),
    };
    let files = match upload.entries(src) {
        Ok(files) => files,
        Err(e) => {
            remove_added(store, &upload.added, &BTreeSet::new());
            return Err(e);
        }
    };
    let bytes = match Manifest::try_new(meta, files).and_then(|m| m.to_bytes()) {
        Ok(bytes) => bytes,
        Err(e) => {
            remove_added(store, &upload.added, &BTreeSet::new());
            return Err(e.into());
        }
    };
    // The commit point. On failure the blocks stay (see the module docs).
    let (manifest, manifest_stored) = store
        .put_manifest(&bytes)
        .map_err(PublishError::StoreManifest)?;
    Ok(Tracked {
        published: Published {
            manifest,
            stats: upload.stats,
        },
        manifest_stored,
        added_blocks: upload.added,
    })
}

/// The state of one publish before its manifest is written.
struct Upload<'a, S: ?Sized> {
    store: &'a S,
    progress: &'a dyn PublishProgress,
    /// Blocks already handled by this publish (stored or found present).
    seen: HashSet<Digest>,
    /// Blocks this publish added to the store.
    added: Vec<Digest>,
    stats: PublishStats,
}

impl<S: ArtifactStore + ?Sized> Upload<'_, S> {
    fn entries(&mut self, src: &Path) -> Result<Vec<FileEntry>, PublishError> {
        tree::walk(src)?
            .iter()
            .map(|entry| self.entry(entry))
            .collect()
    }

    fn entry(&mut self, entry: &TreeEntry) -> Result<FileEntry, PublishError> {
        let path = entry
            .relative
            .to_str()
            .ok_or_else(|| PublishError::NonUtf8Path(entry.path.clone()))?
            .to_string();
        let file_type = entry.metadata.file_type();
        let mode = entry.metadata.permissions().mode() & MODE_MASK;
        let (mode, kind) = if file_type.is_dir() {
            self.stats.dirs += 1;
            (mode, EntryKind::Dir)
        } else if file_type.is_symlink() {
            self.stats.symlinks += 1;
            let target = std::fs::read_link(&entry.path).map_err(|source| PublishError::Read {
                path: entry.path.clone(),
                source,
            })?;
            let target = target
                .into_os_string()
                .into_string()
                .map_err(|_| PublishError::NonUtf8Target(path.clone()))?;
            (0o777, EntryKind::Symlink { target })
        } else if file_type.is_file() {
            (mode, self.file(&path, entry)?)
        } else {
            return Err(PublishError::Unsupported {
                path,
                kind: special_kind(&entry.metadata),
            });
        };
        Ok(FileEntry { path, mode, kind })
    }

    fn file(&mut self, path: &str, entry: &TreeEntry) -> Result<EntryKind, PublishError> {
        let size = entry.metadata.len();
        self.progress.file(path, size);
        let read_error = |source| PublishError::Read {
            path: entry.path.clone(),
            source,
        };
        let file = open_no_follow(&entry.path).map_err(read_error)?;
        let mut reader = BlockReader::new(file);
        let mut blocks = Vec::new();
        let mut read = 0u64;
        while let Some(block) = reader.next_block().map_err(read_error)? {
            let len = block.bytes.len();
            let mut added = false;
            if self.seen.insert(block.digest) {
                let stored =
                    self.store
                        .put_block(&block.digest, block.bytes)
                        .map_err(|source| PublishError::StoreBlock {
                            path: path.to_string(),
                            source,
                        })?;
                if stored == Stored::Added {
                    added = true;
                    self.added.push(block.digest);
                    self.stats.new_blocks += 1;
                    self.stats.new_bytes += len as u64;
                }
            }
            self.progress.block(len, added);
            blocks.push(block.digest);
            read += len as u64;
        }
        if read != size {
            return Err(PublishError::Changed {
                path: path.to_string(),
                expected: size,
                read,
            });
        }
        self.stats.files += 1;
        self.stats.blocks += blocks.len() as u64;
        self.stats.bytes += size;
        Ok(EntryKind::File { size, blocks })
    }
}

/// Undo a lost publish: its manifest first (so it never lists a removed block), then the
/// blocks it added that the winner does not reference. Best effort; returns the number of
/// blocks removed. Nothing is removed when the manifest was not this publish's own (an
/// identical manifest published by someone else) or the winner's cannot be read.
fn abandon<S: ArtifactStore + ?Sized>(store: &S, tracked: &Tracked, winner: &Digest) -> u64 {
    if tracked.manifest_stored != Stored::Added {
        return 0;
    }
    let winner_blocks = match store
        .get_manifest(winner)
        .map_err(|e| e.to_string())
        .and_then(|bytes| Manifest::from_slice(&bytes).map_err(|e| e.to_string()))
    {
        Ok(manifest) => manifest.blocks(),
        Err(error) => {
            tracing::warn!(%winner, error, "cannot read the winning manifest; leaving our blocks to garbage collection");
            return 0;
        }
    };
    let ours = tracked.published.manifest;
    if let Err(error) = store.delete_manifest(&ours) {
        tracing::warn!(manifest = %ours, %error, "cannot remove the losing manifest; leaving its blocks");
        return 0;
    }
    remove_added(store, &tracked.added_blocks, &winner_blocks)
}

/// Remove the blocks in `added` that `keep` does not list; failures are logged and left to
/// garbage collection. Returns how many were removed.
fn remove_added<S: ArtifactStore + ?Sized>(
    store: &S,
    added: &[Digest],
    keep: &BTreeSet<Digest>,
) -> u64 {
    let mut removed = 0;
    for digest in added.iter().filter(|d| !keep.contains(d)) {
        match store.delete_block(digest) {
            Ok(()) => removed += 1,
            Err(error) => tracing::warn!(block = %digest, %error, "cannot remove a block we added"),
        }
    }
    removed
}

/// Open a regular file for reading without following a symlink that replaced it since the
/// walk.
fn open_no_follow(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
}

/// A name for a file type that cannot be published.
fn special_kind(metadata: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let file_type = metadata.file_type();
    if file_type.is_socket() {
        "socket"
    } else if file_type.is_fifo() {
        "fifo"
    } else if file_type.is_char_device() {
        "character device"
    } else if file_type.is_block_device() {
        "block device"
    } else {
        "special"
    }
}
