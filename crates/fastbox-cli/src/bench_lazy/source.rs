//! The block source of both restore modes: blocks read from the artifact store (verified by
//! the store's read), each after a fixed delay that stands for the latency of a remote origin
//! or peer, and counted. A full zero block is not fetched (as `fastbox_artifact::materialize`
//! leaves it a hole): it costs no delay and is not counted.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fastbox_artifact::{ArtifactStore, BLOCK_SIZE, Digest, zero_block_digest};
use fastbox_runtime::lazy::blocks::{BlockSource, SourceError};
use fastbox_runtime::lazy::restore::Fetched;

/// Blocks of `store`, `delay` per block, counted (see the module docs).
pub struct DelayedSource {
    store: Arc<dyn ArtifactStore>,
    delay: Duration,
    blocks: AtomicU64,
    bytes: AtomicU64,
}

impl DelayedSource {
    pub fn new(store: Arc<dyn ArtifactStore>, delay: Duration) -> Self {
        Self {
            store,
            delay,
            blocks: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Blocks fetched so far, and their bytes.
    pub fn fetched(&self) -> Fetched {
        Fetched {
            blocks: self.blocks.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }
}

impl BlockSource for DelayedSource {
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
        let digest = Digest::from_hex(digest)?;
        if digest == zero_block_digest() {
            return Ok(vec![0; BLOCK_SIZE]);
        }
        std::thread::sleep(self.delay);
        let bytes = self.store.get_block(&digest)?;
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }
}

/// `after - before`, field by field.
pub fn since(after: Fetched, before: Fetched) -> Fetched {
    Fetched {
        blocks: after.blocks.saturating_sub(before.blocks),
        bytes: after.bytes.saturating_sub(before.bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_artifact::LocalStore;
    use std::time::Instant;

    #[test]
    fn blocks_are_delayed_verified_and_counted_and_zero_blocks_are_free() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LocalStore::open(dir.path()).unwrap());
        let block = b"some block".to_vec();
        let digest = Digest::of(&block);
        store.put_block(&digest, &block).unwrap();
        let source = DelayedSource::new(store, Duration::from_millis(30));

        let clock = Instant::now();
        assert_eq!(source.get_block(&digest.to_hex()).unwrap(), block);
        assert!(clock.elapsed() >= Duration::from_millis(30));
        let zero = source.get_block(&zero_block_digest().to_hex()).unwrap();
        assert_eq!(zero.len(), BLOCK_SIZE);
        assert!(zero.iter().all(|b| *b == 0));
        assert_eq!(
            source.fetched(),
            Fetched {
                blocks: 1,
                bytes: block.len() as u64
            }
        );
        let missing = Digest::of(b"not stored").to_hex();
        assert!(source.get_block(&missing).is_err());
        assert!(source.get_block("not a digest").is_err());
        assert_eq!(source.fetched().blocks, 1);
        assert_eq!(
            since(source.fetched(), Fetched::default()),
            source.fetched()
        );
    }
}
