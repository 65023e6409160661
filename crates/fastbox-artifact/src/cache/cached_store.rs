//! [`CachedStore`]: an [`ArtifactStore`] that serves blocks and manifests from a
//! [`BlockCache`] and fetches what it lacks from an upstream store.
//!
//! The upstream is the origin, or a peer-delivery layer in front of it. Reads
//! (`get_block`, `stream_block`, `get_manifest`) try the cache, then fetch from upstream
//! (which verifies) and insert what they fetched; a streamed fetch passes bytes on as they
//! arrive and inserts the block once the upstream has verified it. Manifests are cached in
//! the same cache as blocks (both are named by the blake3 of their bytes). Puts write
//! through: upstream first, then the cache. Deletes go upstream, then drop the cached copy.
//! `has_*` ask the cache, then upstream. The index and the listings are upstream's alone:
//! the cache holds objects, never names.
//!
//! The cache is best effort: a cache that cannot be read or written is logged and counted
//! ([`CachedStoreStats::cache_errors`]) and the operation goes on with upstream.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::BlockCache;
use crate::digest::Digest;
use crate::manifest::{Manifest, ManifestError};
use crate::store::{ArtifactStore, IndexCreate, IndexKey, StoreError, Stored, StoredObject};

/// Why [`CachedStore::pin_artifact`] failed.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// A manifest could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A manifest is invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
}

/// What a [`CachedStore`] served from where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CachedStoreStats {
    /// Blocks served from the cache.
    pub block_hits: u64,
    /// Blocks fetched from upstream.
    pub block_fetches: u64,
    /// Bytes of blocks fetched from upstream.
    pub fetched_bytes: u64,
    /// Manifests served from the cache.
    pub manifest_hits: u64,
    /// Manifests fetched from upstream.
    pub manifest_fetches: u64,
    /// Cache reads or writes that failed and were bypassed.
    pub cache_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    block_hits: AtomicU64,
    block_fetches: AtomicU64,
    fetched_bytes: AtomicU64,
    manifest_hits: AtomicU64,
    manifest_fetches: AtomicU64,
    cache_errors: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// A caching store in front of `upstream`. See the module docs.
pub struct CachedStore {
    cache: Arc<BlockCache>,
    upstream: Arc<dyn ArtifactStore>,
    counters: Counters,
}

impl std::fmt::Debug for CachedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CachedStore")
            .field("cache", &self.cache.dir())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl CachedStore {
    /// Serve from `cache`, fetching misses from `upstream`.
    pub fn new(cache: Arc<BlockCache>, upstream: Arc<dyn ArtifactStore>) -> Self {
        CachedStore {
            cache,
            upstream,
            counters: Counters::default(),
        }
    }

    /// The cache.
    pub fn cache(&self) -> &Arc<BlockCache> {
        &self.cache
    }

    /// The upstream store.
    pub fn upstream(&self) -> &Arc<dyn ArtifactStore> {
        &self.upstream
    }

    /// What was served from where so far.
    pub fn stats(&self) -> CachedStoreStats {
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CachedStoreStats {
            block_hits: read(&self.counters.block_hits),
            block_fetches: read(&self.counters.block_fetches),
            fetched_bytes: read(&self.counters.fetched_bytes),
            manifest_hits: read(&self.counters.manifest_hits),
            manifest_fetches: read(&self.counters.manifest_fetches),
            cache_errors: read(&self.counters.cache_errors),
        }
    }

    /// Pin, for `holder`, the artifact `manifest` in the cache: the manifest, its blocks,
    /// and those of its ancestors (`lineage.parent`, which a snapshot's restore needs),
    /// before they are fetched, so that fetching a large artifact never evicts its own
    /// first blocks. Reads the manifests (through the cache). Returns the digests pinned.
    pub fn pin_artifact(&self, holder: &str, manifest: &Digest) -> Result<usize, PinError> {
        let mut manifests = BTreeSet::new();
        let mut pinned = BTreeSet::new();
        let mut next = Some(*manifest);
        while let Some(digest) = next {
            if !manifests.insert(digest) {
                break;
            }
            pinned.insert(digest);
            // The manifest itself first: reading it below may insert it.
            self.cache.pin(holder, [digest]);
            let parsed = Manifest::from_slice(&self.get_manifest(&digest)?)?;
            let blocks = parsed.blocks();
            self.cache.pin(holder, blocks.iter().copied());
            pinned.extend(blocks);
            next = parsed.meta.lineage.parent;
        }
        Ok(pinned.len())
    }

    /// The cached bytes of `digest`, counting a hit; None on a miss or a cache error.
    fn cached(&self, digest: &Digest, hits: &AtomicU64) -> Option<Vec<u8>> {
        match self.cache.get(digest) {
            Ok(Some(bytes)) => {
                bump(hits, 1);
                Some(bytes)
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(%digest, error = %e, "block cache read failed; fetching upstream");
                bump(&self.counters.cache_errors, 1);
                None
            }
        }
    }

    /// Insert fetched or written bytes; a failure is logged, not returned.
    fn keep(&self, digest: &Digest, bytes: &[u8]) {
        if let Err(e) = self.cache.insert(digest, bytes) {
            tracing::warn!(%digest, error = %e, "block cache insert failed");
            bump(&self.counters.cache_errors, 1);
        }
    }

    /// Drop a deleted object's cached copy; a failure is logged, not returned.
    fn forget(&self, digest: &Digest) {
        if let Err(e) = self.cache.remove(digest) {
            tracing::warn!(%digest, error = %e, "block cache remove failed");
            bump(&self.counters.cache_errors, 1);
        }
    }

    fn fetched(&self, len: u64) {
        bump(&self.counters.block_fetches, 1);
        bump(&self.counters.fetched_bytes, len);
    }
}

impl ArtifactStore for CachedStore {
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError> {
        let stored = self.upstream.put_block(digest, bytes)?;
        self.keep(digest, bytes);
        Ok(stored)
    }

    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.cached(digest, &self.counters.block_hits) {
            return Ok(bytes);
        }
        let bytes = self.upstream.get_block(digest)?;
        self.fetched(bytes.len() as u64);
        self.keep(digest, &bytes);
        Ok(bytes)
    }

    fn stream_block(
        &self,
        digest: &Digest,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u64, StoreError> {
        if let Some(bytes) = self.cached(digest, &self.counters.block_hits) {
            sink(&bytes).map_err(|source| StoreError::Io {
                op: "pass on",
                location: format!("block {digest}"),
                source,
            })?;
            return Ok(bytes.len() as u64);
        }
        let mut received = Vec::new();
        let len = self.upstream.stream_block(digest, &mut |chunk| {
            received.extend_from_slice(chunk);
            sink(chunk)
        })?;
        self.fetched(len);
        self.keep(digest, &received);
        Ok(len)
    }

    fn has_block(&self, digest: &Digest) -> Result<bool, StoreError> {
        Ok(self.cache.contains(digest) || self.upstream.has_block(digest)?)
    }

    fn delete_block(&self, digest: &Digest) -> Result<(), StoreError> {
        self.upstream.delete_block(digest)?;
        self.forget(digest);
        Ok(())
    }

    fn list_blocks(&self) -> Result<Vec<StoredObject>, StoreError> {
        self.upstream.list_blocks()
    }

    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError> {
        let (digest, stored) = self.upstream.put_manifest(bytes)?;
        self.keep(&digest, bytes);
        Ok((digest, stored))
    }

    fn get_manifest(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        if let Some(bytes) = self.cached(digest, &self.counters.manifest_hits) {
            return Ok(bytes);
        }
        let bytes = self.upstream.get_manifest(digest)?;
        bump(&self.counters.manifest_fetches, 1);
        self.keep(digest, &bytes);
        Ok(bytes)
    }

    fn has_manifest(&self, digest: &Digest) -> Result<bool, StoreError> {
        Ok(self.cache.contains(digest) || self.upstream.has_manifest(digest)?)
    }

    fn delete_manifest(&self, digest: &Digest) -> Result<(), StoreError> {
        self.upstream.delete_manifest(digest)?;
        self.forget(digest);
        Ok(())
    }

    fn list_manifests(&self) -> Result<Vec<StoredObject>, StoreError> {
        self.upstream.list_manifests()
    }

    fn index_create_if_absent(
        &self,
        key: &IndexKey,
        digest: &Digest,
    ) -> Result<IndexCreate, StoreError> {
        self.upstream.index_create_if_absent(key, digest)
    }

    fn index_get(&self, key: &IndexKey) -> Result<Option<Digest>, StoreError> {
        self.upstream.index_get(key)
    }

    fn index_delete(&self, key: &IndexKey) -> Result<(), StoreError> {
        self.upstream.index_delete(key)
    }

    fn list_index(&self) -> Result<Vec<(IndexKey, Digest)>, StoreError> {
        self.upstream.list_index()
    }
}
