//! [`DelayedStore`]: a store whose block reads each wait a fixed time first, standing for the
//! latency of a remote origin in benchmarks and verification runs on one machine
//! (`fastbox verify cluster`). Everything else passes straight through.

use std::sync::Arc;
use std::time::Duration;

use super::{ArtifactStore, StoreError};
use crate::digest::Digest;

/// `inner`, every block read (`get_block`, `stream_block`) delayed by `delay`.
pub struct DelayedStore {
    inner: Arc<dyn ArtifactStore>,
    delay: Duration,
}

impl DelayedStore {
    pub fn new(inner: Arc<dyn ArtifactStore>, delay: Duration) -> Self {
        Self { inner, delay }
    }
}

impl ArtifactStore for DelayedStore {
    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        std::thread::sleep(self.delay);
        self.inner.get_block(digest)
    }
    fn stream_block(
        &self,
        digest: &Digest,
        sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u64, StoreError> {
        std::thread::sleep(self.delay);
        self.inner.stream_block(digest, sink)
    }
    crate::forward_store!(inner; put_block, has_block, delete_block, list_blocks, manifests, index);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LocalStore;
    use std::time::Instant;

    #[test]
    fn block_reads_wait_and_the_rest_passes_through() {
        let dir = tempfile::tempdir().unwrap();
        let inner: Arc<dyn ArtifactStore> = Arc::new(LocalStore::open(dir.path()).unwrap());
        let store = DelayedStore::new(inner.clone(), Duration::from_millis(40));
        let block = b"a block".to_vec();
        let digest = Digest::of(&block);
        store.put_block(&digest, &block).unwrap();
        assert!(inner.has_block(&digest).unwrap(), "written through");

        let clock = Instant::now();
        assert_eq!(store.get_block(&digest).unwrap(), block);
        assert!(clock.elapsed() >= Duration::from_millis(40));
        let clock = Instant::now();
        let mut streamed = Vec::new();
        store
            .stream_block(&digest, &mut |b| {
                streamed.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
        assert_eq!(streamed, block);
        assert!(clock.elapsed() >= Duration::from_millis(40));
        assert_eq!(store.list_blocks().unwrap().len(), 1);
    }
}
