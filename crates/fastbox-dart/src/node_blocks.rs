//! What a node holds locally: the seam between DART and the node's block cache.
//!
//! DART reads a node's blocks through [`NodeBlocks`] and never looks at how they are
//! stored. The node block cache (`fastbox_artifact::BlockCache`, with a byte budget and
//! eviction) is the production implementation; a plain [`LocalStore`] directory is one too
//! (no budget, no eviction), which tests and single-purpose tools use.
//!
//! Contract: `get_local` returns only bytes that hash to the digest (a corrupt local copy is
//! reported as absent, so DART fetches the block again); `insert_local` is best effort: a
//! node that cannot cache a block still delivers it, and the failure is logged.

use fastbox_artifact::{ArtifactStore, BlockCache, Digest, LocalStore, StoreError};

/// The blocks a node holds locally.
pub trait NodeBlocks: Send + Sync {
    /// The block's bytes, verified against `digest`, or None when not held (or corrupt).
    fn get_local(&self, digest: &Digest) -> Option<Vec<u8>>;
    /// Whether the block is held (not verified).
    fn has_local(&self, digest: &Digest) -> bool;
    /// Keep a verified block; failures are logged, never returned.
    fn insert_local(&self, digest: &Digest, bytes: &[u8]);
}

impl NodeBlocks for LocalStore {
    fn get_local(&self, digest: &Digest) -> Option<Vec<u8>> {
        match self.get_block(digest) {
            Ok(bytes) => Some(bytes),
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(block = %digest, error = %e, "local block unreadable; fetching it again");
                None
            }
        }
    }

    fn has_local(&self, digest: &Digest) -> bool {
        self.has_block(digest).unwrap_or(false)
    }

    fn insert_local(&self, digest: &Digest, bytes: &[u8]) {
        if let Err(e) = self.put_block(digest, bytes) {
            tracing::warn!(block = %digest, error = %e, "could not keep a block locally");
        }
    }
}

/// The node's block cache: what a fastlet serves its peers from.
impl NodeBlocks for BlockCache {
    fn get_local(&self, digest: &Digest) -> Option<Vec<u8>> {
        self.get(digest).unwrap_or_else(|e| {
            tracing::warn!(block = %digest, error = %e, "block cache unreadable; fetching the block again");
            None
        })
    }

    fn has_local(&self, digest: &Digest) -> bool {
        self.contains(digest)
    }

    fn insert_local(&self, digest: &Digest, bytes: &[u8]) {
        if let Err(e) = self.insert(digest, bytes) {
            tracing::warn!(block = %digest, error = %e, "could not keep a block in the cache");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_local_store_holds_inserted_blocks_and_hides_corrupt_ones() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let bytes = b"block bytes".to_vec();
        let digest = Digest::of(&bytes);
        assert!(!store.has_local(&digest));
        assert_eq!(store.get_local(&digest), None);
        store.insert_local(&digest, &bytes);
        assert!(store.has_local(&digest));
        assert_eq!(store.get_local(&digest), Some(bytes.clone()));

        let path = store.block_path(&digest);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(&path, b"block bytez").unwrap();
        assert_eq!(
            store.get_local(&digest),
            None,
            "corrupt copies are not returned"
        );
    }

    #[test]
    fn inserting_bytes_of_another_digest_is_refused_quietly() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let digest = Digest::of(b"one");
        store.insert_local(&digest, b"two");
        assert!(!store.has_local(&digest));
    }
}
