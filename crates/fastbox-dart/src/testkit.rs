//! Test helpers (feature `testkit`): an origin that counts its block reads and can be slow.
//!
//! [`CountingOrigin`] wraps a real [`LocalStore`] and delegates everything to it; block
//! reads are counted (per digest too), and with [`CountingOrigin::slow`] its `stream_block`
//! hands a block on in pieces with a pause before each, recording when each fetch ended, so
//! a test can see a requester's first byte arrive before the origin fetch finished.

use std::collections::HashMap;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fastbox_artifact::{ArtifactStore, Digest, LocalStore, StoreError};

/// A [`LocalStore`] origin that counts block reads and optionally streams slowly.
#[derive(Debug)]
pub struct CountingOrigin {
    inner: LocalStore,
    piece: usize,
    pause: Duration,
    reads: AtomicU64,
    reads_by_block: Mutex<HashMap<Digest, u64>>,
    finished: Mutex<HashMap<Digest, Instant>>,
}

impl CountingOrigin {
    /// Count reads of `inner`, streaming each block in one piece without pause.
    pub fn new(inner: LocalStore) -> Self {
        CountingOrigin {
            inner,
            piece: usize::MAX,
            pause: Duration::ZERO,
            reads: AtomicU64::new(0),
            reads_by_block: Mutex::new(HashMap::new()),
            finished: Mutex::new(HashMap::new()),
        }
    }

    /// Stream blocks in pieces of `piece` bytes, sleeping `pause` before each.
    pub fn slow(mut self, piece: usize, pause: Duration) -> Self {
        self.piece = piece.max(1);
        self.pause = pause;
        self
    }

    /// The wrapped store (to seed it without counting).
    pub fn inner(&self) -> &LocalStore {
        &self.inner
    }

    /// Block reads so far (`get_block` and `stream_block`).
    pub fn block_reads(&self) -> u64 {
        self.reads.load(Ordering::SeqCst)
    }

    /// Reads of one block so far.
    pub fn reads_of(&self, digest: &Digest) -> u64 {
        lock(&self.reads_by_block).get(digest).copied().unwrap_or(0)
    }

    /// When the last `stream_block` of `digest` returned, if one did.
    pub fn finished_at(&self, digest: &Digest) -> Option<Instant> {
        lock(&self.finished).get(digest).copied()
    }

    fn count(&self, digest: &Digest) {
        self.reads.fetch_add(1, Ordering::SeqCst);
        *lock(&self.reads_by_block).entry(*digest).or_insert(0) += 1;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ArtifactStore for CountingOrigin {
    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.count(digest);
        self.inner.get_block(digest)
    }

    fn stream_block(
        &self,
        digest: &Digest,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<u64, StoreError> {
        self.count(digest);
        let result = self.inner.get_block(digest).and_then(|bytes| {
            for piece in bytes.chunks(self.piece) {
                std::thread::sleep(self.pause);
                sink(piece).map_err(|source| StoreError::Io {
                    op: "pass on",
                    location: format!("block {digest}"),
                    source,
                })?;
            }
            Ok(bytes.len() as u64)
        });
        lock(&self.finished).insert(*digest, Instant::now());
        result
    }

    fastbox_artifact::forward_store!(inner; put_block, has_block, delete_block, list_blocks, manifests, index);
}
