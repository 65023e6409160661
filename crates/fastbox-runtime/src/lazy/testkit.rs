//! A [`BlockSource`] for tests: blocks held in memory, every fetch counted and delayed, and
//! optionally only some blocks served (an origin that fails for the rest). Used by the unit
//! tests of `lazy` and by `tests/lazy.rs` (feature `testkit`).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use super::blocks::{BlockSource, SourceError};

/// Blocks in memory, counting fetches per block, each fetch taking `delay`.
pub struct MemorySource {
    pub blocks: HashMap<String, Vec<u8>>,
    pub delay: Duration,
    /// When set, every other block fails to fetch ("origin unreachable").
    pub only: Option<HashSet<String>>,
    fetches: Mutex<HashMap<String, usize>>,
}

impl MemorySource {
    /// The source of `data` cut into `block_size` blocks, and their digests in order.
    pub fn of(data: &[u8], block_size: usize, delay: Duration) -> (Self, Vec<String>) {
        let mut blocks = HashMap::new();
        let digests = data
            .chunks(block_size)
            .map(|chunk| {
                let digest = blake3::hash(chunk).to_hex().to_string();
                blocks.insert(digest.clone(), chunk.to_vec());
                digest
            })
            .collect();
        let source = Self {
            blocks,
            delay,
            only: None,
            fetches: Mutex::new(HashMap::new()),
        };
        (source, digests)
    }

    /// Fetches so far, of every block.
    pub fn fetch_count(&self) -> usize {
        self.counts().values().sum()
    }

    /// Fetches so far of block `digest`.
    pub fn fetches_of(&self, digest: &str) -> usize {
        self.counts().get(digest).copied().unwrap_or(0)
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.fetches.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BlockSource for MemorySource {
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
        std::thread::sleep(self.delay);
        *self.counts().entry(digest.to_string()).or_default() += 1;
        if self
            .only
            .as_ref()
            .is_some_and(|only| !only.contains(digest))
        {
            return Err(format!("origin unreachable for {digest}").into());
        }
        self.blocks
            .get(digest)
            .cloned()
            .ok_or_else(|| format!("no block {digest}").into())
    }
}
