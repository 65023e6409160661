//! The artifact store: blocks and manifests by digest, and an index of names.
//!
//! [`ArtifactStore`] is the one interface every backend implements: the local directory
//! ([`LocalStore`]) today; an S3-compatible origin, a node block cache in front of another
//! store, and a peer-fetching store (DART) later, all holding the same format. It is
//! synchronous and object-safe (`&dyn ArtifactStore`).
//!
//! Contract, for every backend:
//! - **Verified reads.** `get_block` and `get_manifest` hash what they read and fail with
//!   [`StoreError::Corrupt`] when it does not match the name; callers never see bad bytes.
//! - **Verified, idempotent writes.** `put_block` refuses bytes that do not hash to the given
//!   digest; writing a present object again is a no-op that reports [`Stored::AlreadyPresent`]
//!   and refreshes the object's modification time (so a collector's grace period protects a
//!   publish that is still referencing it). [`Stored::Added`] is reported to at most one of
//!   several concurrent writers of the same object where the backend can tell; a publish
//!   only ever removes objects it was told it added.
//! - **Atomic objects.** An object is either absent or complete; a crash leaves no partial
//!   object under a final name.
//! - **Conditional index.** `index_create_if_absent` creates an entry only if the key has
//!   none, atomically; of several concurrent creators exactly one gets
//!   [`IndexCreate::Created`], the others see the winner's digest.
//! - **Listings for garbage collection** return every stored block and manifest with its size
//!   and modification time, and every index entry.

mod delayed;
mod forward;
mod key;
mod local;

use std::fmt;
use std::time::SystemTime;

pub use delayed::DelayedStore;
pub use key::{IndexKey, IndexKeyError, MAX_KEY_LEN};
pub use local::LocalStore;

use crate::block::BLOCK_SIZE;
use crate::digest::Digest;

/// The two kinds of content-addressed objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectKind {
    /// A block of a file.
    Block,
    /// A `manifest.json`.
    Manifest,
}

impl fmt::Display for ObjectKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ObjectKind::Block => "block",
            ObjectKind::Manifest => "manifest",
        })
    }
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No object under that digest.
    #[error("{kind} {digest} not found")]
    NotFound { kind: ObjectKind, digest: Digest },
    /// The stored bytes do not hash to their name.
    #[error("{kind} {digest} is corrupt: its content hashes to {actual}")]
    Corrupt {
        kind: ObjectKind,
        digest: Digest,
        actual: Digest,
    },
    /// A put whose bytes do not hash to the digest given.
    #[error("block bytes hash to {actual}, not to the digest given ({expected})")]
    DigestMismatch { expected: Digest, actual: Digest },
    /// A put of more than [`BLOCK_SIZE`] bytes.
    #[error("block {digest} has {len} bytes, more than the block size {BLOCK_SIZE}")]
    BlockTooLarge { digest: Digest, len: usize },
    /// An index entry whose content is not a digest.
    #[error("index entry {key} is corrupt: {content:?} is not a digest")]
    CorruptIndex { key: IndexKey, content: String },
    /// The backend failed.
    #[error("{op} {location}: {source}")]
    Io {
        op: &'static str,
        location: String,
        source: std::io::Error,
    },
}

/// What a put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// This put created the object.
    Added,
    /// The object was already there (possibly written concurrently by someone else).
    AlreadyPresent,
}

/// What a conditional index create did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexCreate {
    /// The entry did not exist and now points at the digest given.
    Created,
    /// The key already had an entry: the digest it points at (which may equal the one given).
    Exists(Digest),
}

/// A stored block or manifest, as listed for garbage collection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    /// Its name.
    pub digest: Digest,
    /// Its size in bytes.
    pub size: u64,
    /// When it was last written or re-put.
    pub modified: SystemTime,
}

/// Blocks, manifests and the index. See the module docs for the contract.
pub trait ArtifactStore: Send + Sync {
    /// Store a block under its digest (verified against `bytes`).
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError>;
    /// A block's bytes, verified against its digest.
    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError>;
    /// Stream a block's bytes to `sink` as they arrive, hashing them on the way; the bytes
    /// are verified when the last one has passed, so a caller must discard what it was given
    /// when this returns an error ([`StoreError::Corrupt`] for bad bytes). Returns the length.
    /// The default reads the whole block with [`get_block`](Self::get_block) first; backends
    /// that receive blocks in pieces (an S3 origin, a peer) override it so that a relay can
    /// pass bytes on while it still receives them.
    fn stream_block(
        &self,
        digest: &Digest,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u64, StoreError> {
        let bytes = self.get_block(digest)?;
        sink(&bytes).map_err(|source| StoreError::Io {
            op: "pass on",
            location: format!("block {digest}"),
            source,
        })?;
        Ok(bytes.len() as u64)
    }
    /// Whether a block is stored (not verified).
    fn has_block(&self, digest: &Digest) -> Result<bool, StoreError>;
    /// Remove a block; removing an absent block succeeds.
    fn delete_block(&self, digest: &Digest) -> Result<(), StoreError>;
    /// Every stored block.
    fn list_blocks(&self) -> Result<Vec<StoredObject>, StoreError>;

    /// Store a manifest under the digest of `bytes`, returned with what the put did. Callers
    /// write a manifest only after every block it lists is stored.
    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError>;
    /// A manifest's bytes, verified against its digest.
    fn get_manifest(&self, digest: &Digest) -> Result<Vec<u8>, StoreError>;
    /// Whether a manifest is stored (not verified).
    fn has_manifest(&self, digest: &Digest) -> Result<bool, StoreError>;
    /// Remove a manifest; removing an absent manifest succeeds.
    fn delete_manifest(&self, digest: &Digest) -> Result<(), StoreError>;
    /// Every stored manifest.
    fn list_manifests(&self) -> Result<Vec<StoredObject>, StoreError>;

    /// Point `key` at `digest` unless it already points somewhere, atomically.
    fn index_create_if_absent(
        &self,
        key: &IndexKey,
        digest: &Digest,
    ) -> Result<IndexCreate, StoreError>;
    /// Where `key` points, if anywhere.
    fn index_get(&self, key: &IndexKey) -> Result<Option<Digest>, StoreError>;
    /// Remove `key`'s entry; removing an absent entry succeeds.
    fn index_delete(&self, key: &IndexKey) -> Result<(), StoreError>;
    /// Every index entry.
    fn list_index(&self) -> Result<Vec<(IndexKey, Digest)>, StoreError>;
}

/// Check a block before storing it: at most [`BLOCK_SIZE`] bytes that hash to `digest`.
/// Every backend's `put_block` calls this first.
pub fn verify_block_put(digest: &Digest, bytes: &[u8]) -> Result<(), StoreError> {
    if bytes.len() > BLOCK_SIZE {
        return Err(StoreError::BlockTooLarge {
            digest: *digest,
            len: bytes.len(),
        });
    }
    let actual = Digest::of(bytes);
    if actual != *digest {
        return Err(StoreError::DigestMismatch {
            expected: *digest,
            actual,
        });
    }
    Ok(())
}

/// Check bytes read back from a backend against their name. Every backend's `get_block` and
/// `get_manifest` pass what they read through this.
pub fn verify_read(
    kind: ObjectKind,
    digest: &Digest,
    bytes: Vec<u8>,
) -> Result<Vec<u8>, StoreError> {
    let actual = Digest::of(&bytes);
    if actual != *digest {
        return Err(StoreError::Corrupt {
            kind,
            digest: *digest,
            actual,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_verification_rejects_wrong_digests_and_oversized_blocks() {
        let digest = Digest::of(b"abc");
        assert!(verify_block_put(&digest, b"abc").is_ok());
        assert!(matches!(
            verify_block_put(&digest, b"abd"),
            Err(StoreError::DigestMismatch { .. })
        ));
        let big = vec![0u8; BLOCK_SIZE + 1];
        assert!(matches!(
            verify_block_put(&Digest::of(&big), &big),
            Err(StoreError::BlockTooLarge { .. })
        ));
    }

    #[test]
    fn read_verification_reports_the_actual_digest() {
        let digest = Digest::of(b"abc");
        match verify_read(ObjectKind::Block, &digest, b"abX".to_vec()) {
            Err(StoreError::Corrupt { actual, .. }) => assert_eq!(actual, Digest::of(b"abX")),
            other => panic!("expected corruption, got {other:?}"),
        }
    }

    #[test]
    fn the_trait_is_object_safe() {
        fn takes(_: &dyn ArtifactStore) {}
        let dir = tempfile::tempdir().unwrap();
        takes(&LocalStore::open(dir.path()).unwrap());
    }
}
