//! Artifacts: templates, snapshots and checkpoints in one content-addressed shape.
//!
//! An artifact is a directory tree (a packed rootfs image, a writable layer, CRIU image
//! files) plus what a restore needs to know about it. It is stored as three kinds of object
//! (`docs/artifacts.md` shows the layout on disk):
//!
//! 1. **Blocks.** Every regular file is cut into 4 MiB blocks ([`BLOCK_SIZE`]), the last one
//!    shorter; empty files have none. A block is named by the blake3 digest of its bytes, in
//!    lowercase hex ([`Digest`]), so identical blocks are stored once across files and
//!    artifacts.
//! 2. **The manifest** (`manifest.json`, [`Manifest`]): `format_version`, `block_size`,
//!    `kind` (`template` | `snapshot` | `checkpoint`), `runtime` (`{"kind":
//!    "linux-namespaces"}`; a microVM kind will be a sibling variant), `execd_digest`, `host`
//!    (kernel release, CRIU version, architecture, CPU feature flags: see [`HostFacts`]),
//!    `lineage` (source image reference and digest, parent manifest), `created_at`, an opaque
//!    `policy` the server fills, `labels`, the optional `rootfs` (which file is the packed
//!    rootfs, and its [`PackFormat`]), and `files`: every entry in tree order with its
//!    relative path, permission bits and kind (`file` with size and block digests, `dir`,
//!    `symlink` with target). Its digest is blake3 of its canonical JSON bytes (keys sorted,
//!    no whitespace). It is **written last**: a manifest exists only when all its blocks do,
//!    so its presence is the commit point.
//! 3. **The index**: `key -> manifest digest` entries ([`IndexKey`]: an image reference, a
//!    template id), created only if absent, so concurrent publishes of one key converge on
//!    one entry.
//!
//! [`ArtifactStore`] is the interface every backend implements (verified reads, verified
//! idempotent puts, a conditional index, listings for garbage collection); [`LocalStore`] is
//! the local directory backend. [`publish`] and [`publish_index`] turn a directory into an
//! artifact (the loser of an index race removes what only it added; the remaining race with
//! other keys is described in the `publish` module), [`materialize`] rebuilds the tree, and
//! [`pack_rootfs`] makes the rootfs image reproducibly (erofs, or canonical tar).
//!
//! Architecture invariant: this crate knows nothing of sandboxes, CRIU or HTTP. It moves
//! trees in and out of stores and reads no environment variables; the host facts it records
//! are read from `/proc` only when the caller asks ([`HostFacts::detect`]).

mod block;
mod cache;
mod canonical;
mod digest;
mod entry;
mod gc;
mod host;
mod manifest;
mod materialize;
mod pack;
mod publish;
mod store;
mod tree;

pub use block::{BLOCK_SIZE, Block, BlockReader, block_count, block_len, zero_block_digest};
pub use cache::{
    BlockCache, CacheError, CacheStats, CachedStore, CachedStoreStats, FLUSH_INTERVAL,
    PROTECTED_SHARE_PERCENT, PinError,
};
pub use digest::{Digest, DigestError};
pub use entry::{EntryError, EntryKind, FileEntry, MODE_MASK, tree_order};
pub use gc::{
    DEFAULT_GRACE, GcError, GcOptions, GcReport, Roots, SweepTally, Tally, collect_garbage,
};
pub use host::{HostFacts, HostFactsError};
pub use manifest::{
    ArtifactKind, FORMAT_VERSION, Lineage, Manifest, ManifestError, ManifestMeta, RootfsImage,
    Runtime, SourceImage,
};
pub use materialize::{
    LeftOut, MaterializeError, MaterializeStats, materialize, materialize_except, read_manifest,
};
pub use pack::{PackError, PackFormat, PackedRootfs, pack_rootfs};
pub use publish::{
    IndexOutcome, IndexedPublish, NoProgress, PublishError, PublishProgress, PublishStats,
    Published, publish, publish_index,
};
pub use store::{
    ArtifactStore, DelayedStore, IndexCreate, IndexKey, IndexKeyError, LocalStore, MAX_KEY_LEN,
    ObjectKind, StoreError, Stored, StoredObject, verify_block_put, verify_read,
};
pub use tree::TreeError;
