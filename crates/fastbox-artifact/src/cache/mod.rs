//! The node block cache: verified blocks in a directory with a byte budget.
//!
//! [`BlockCache`] keeps content-addressed objects (blocks, and the manifests
//! [`CachedStore`] caches beside them: both are named by the blake3 of their bytes, so they
//! share one namespace) in `<dir>/blocks/<2 hex>/<digest>`, each written to a staging file
//! and renamed into place, so no reader sees a partial file. The contract:
//!
//! - **Verified both ways.** [`BlockCache::insert`] refuses bytes that do not hash to the
//!   digest. [`BlockCache::get`] hashes every file it reads; a file that does not match
//!   (disk corruption, a torn write after a crash: block files are not fsynced) is removed,
//!   counted in [`CacheStats::corrupt_dropped`] and reported as a miss, so the caller fetches
//!   the block again. [`BlockCache::contains`] only looks at the index in memory.
//! - **A budget, and hot blocks stay.** The policy is a segmented LRU (`policy` module):
//!   admitted blocks enter *probation*; a hit promotes a block to *protected* (at most 80% of
//!   the budget, overflow demoted back to probation); eviction takes the least recently used
//!   block of probation first. A one-shot read of an artifact larger than the cache churns
//!   probation only: a block read twice before survives it. Inserting a block already cached
//!   is not an access. The cost: a block must be read twice to be protected, so a working
//!   set read exactly once per cycle, larger than probation, keeps missing (pin it instead).
//! - **Pins.** [`BlockCache::pin`] marks digests as held by a holder (a manifest digest, a
//!   sandbox id), whether cached yet or not: pinning an artifact's blocks before fetching
//!   them keeps its first blocks from being evicted by its last. Pinned blocks are never
//!   evicted; when pins alone exceed the budget the cache goes over budget
//!   ([`CacheStats::over_budget`], and a warning) rather than failing. Pins live in memory
//!   only: after a restart the owner pins again what it still uses (a fastlet re-pins the
//!   artifacts of the sandboxes it adopts).
//! - **Survives restarts.** Blocks stay on disk. The segment order is saved in
//!   `<dir>/state.json` (written atomically) by [`BlockCache::flush`], after changes at most
//!   [`FLUSH_INTERVAL`] apart (by the thread that made the change), and on drop.
//!   [`BlockCache::open`] rebuilds the index from the files, restores the saved order, and
//!   puts blocks the state does not know at the cold end of probation. A missing or corrupt
//!   state file costs only the order; a crash loses at most the last interval's reordering.
//! - **One owner.** The directory is locked (`flock`) while a cache has it open; a second
//!   open fails with [`CacheError::Busy`]. Within the process the cache is `Send + Sync`:
//!   share it as `Arc<BlockCache>`.
//!
//! Concurrency: file reads, writes to staging and hashing run outside the cache's lock;
//! the policy update and the renames and unlinks that keep disk and policy in step run
//! under it (they are metadata operations). A reader that finds a bad file removes the
//! entry only if it is still the admission it read (a generation check), so a concurrent
//! re-insert is never undone.

mod cached_store;
mod disk;
mod policy;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use cached_store::{CachedStore, CachedStoreStats, PinError};
pub use policy::PROTECTED_SHARE_PERCENT;

use crate::digest::Digest;
use disk::Disk;
use policy::Policy;

/// How long policy changes may wait before they are written to the state file, unless
/// [`BlockCache::with_flush_interval`] says otherwise.
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(30);

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// Bytes offered to [`BlockCache::insert`] do not hash to the digest given.
    #[error("bytes hash to {actual}, not to the digest given ({expected})")]
    DigestMismatch { expected: Digest, actual: Digest },
    /// Another cache has the directory open.
    #[error("cache directory {0} is in use by another process or cache")]
    Busy(PathBuf),
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Counters and occupancy of a [`BlockCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// `get`s answered from the cache (verified).
    pub hits: u64,
    /// `get`s that found nothing usable (absent, vanished, or corrupt).
    pub misses: u64,
    /// Objects added by `insert`.
    pub inserts: u64,
    /// Objects evicted to stay within the budget.
    pub evictions: u64,
    /// Cached files that failed verification on read and were removed.
    pub corrupt_dropped: u64,
    /// Bytes cached.
    pub bytes: u64,
    /// Objects cached.
    pub blocks: u64,
    /// Bytes of probation (admitted, not yet read again).
    pub probation_bytes: u64,
    /// Bytes of protected (read at least twice).
    pub protected_bytes: u64,
    /// Bytes of cached objects some holder pins.
    pub pinned_bytes: u64,
    /// The byte budget.
    pub budget: u64,
    /// Whether pins hold the cache above its budget.
    pub over_budget: bool,
}

/// Event counters, updated without the policy lock.
#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    inserts: AtomicU64,
    evictions: AtomicU64,
    corrupt_dropped: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// The node's block cache. See the module docs for the contract.
#[derive(Debug)]
pub struct BlockCache {
    disk: Disk,
    policy: Mutex<Policy>,
    counters: Counters,
    /// Set by every policy change, cleared by a flush.
    dirty: AtomicBool,
    /// Serializes flushes; holds when the last one happened.
    last_flush: Mutex<Instant>,
    /// How long changes may wait for a flush.
    flush_interval: Duration,
    /// Whether the over-budget warning was given (reset once back within budget).
    warned_over_budget: AtomicBool,
}

/// Why a `get` found nothing usable.
#[derive(Debug, Clone, Copy)]
enum Unusable {
    /// The file is gone (removed behind the cache's back).
    Vanished,
    /// The file does not hash to its name.
    Corrupt,
}

impl BlockCache {
    /// Open the cache in `dir` (created when missing) with a budget of `budget_bytes`,
    /// rebuilding its index from the files and the saved segment order. Evicts at once when
    /// the directory holds more than the budget.
    pub fn open(dir: &Path, budget_bytes: u64) -> Result<BlockCache, CacheError> {
        let disk = Disk::open(dir)?;
        let on_disk = disk.scan()?;
        let state = disk.read_state();
        let policy = Policy::restore(budget_bytes, &on_disk, state.as_ref());
        let cache = BlockCache {
            disk,
            policy: Mutex::new(policy),
            counters: Counters::default(),
            dirty: AtomicBool::new(true),
            last_flush: Mutex::new(Instant::now()),
            flush_interval: FLUSH_INTERVAL,
            warned_over_budget: AtomicBool::new(false),
        };
        cache.settle(cache.policy());
        tracing::debug!(dir = %dir.display(), blocks = on_disk.len(), "block cache opened");
        Ok(cache)
    }

    /// Save the state after changes at most `interval` apart instead of [`FLUSH_INTERVAL`]
    /// (zero: after every change, which costs a state file write per insert and hit).
    pub fn with_flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = interval;
        self
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        self.disk.root()
    }

    /// Where the file of `digest` is (or would be); for diagnosis and tests.
    pub fn block_path(&self, digest: &Digest) -> PathBuf {
        self.disk.block_path(digest)
    }

    /// The bytes of `digest`, verified, recording a hit; None on a miss. A cached file that
    /// fails verification is removed and counted, and the call is a miss.
    pub fn get(&self, digest: &Digest) -> Result<Option<Vec<u8>>, CacheError> {
        let Some(generation) = self.policy().generation(digest) else {
            Counters::bump(&self.counters.misses, 1);
            return Ok(None);
        };
        let found = match self.disk.read(digest)? {
            None => Err(Unusable::Vanished),
            Some(bytes) if Digest::of(&bytes) != *digest => Err(Unusable::Corrupt),
            Some(bytes) => Ok(bytes),
        };
        match found {
            Ok(bytes) => {
                self.policy().touch(digest);
                Counters::bump(&self.counters.hits, 1);
                self.changed();
                Ok(Some(bytes))
            }
            Err(why) => {
                self.drop_unusable(digest, generation, why);
                Counters::bump(&self.counters.misses, 1);
                Ok(None)
            }
        }
    }

    /// Whether `digest` is cached (no verification, not an access).
    pub fn contains(&self, digest: &Digest) -> bool {
        self.policy().contains(digest)
    }

    /// Cache `bytes` under `digest` after checking that they hash to it, then evict what
    /// the budget requires. Inserting an object already cached changes nothing.
    pub fn insert(&self, digest: &Digest, bytes: &[u8]) -> Result<(), CacheError> {
        let actual = Digest::of(bytes);
        if actual != *digest {
            return Err(CacheError::DigestMismatch {
                expected: *digest,
                actual,
            });
        }
        if self.contains(digest) {
            return Ok(());
        }
        let staged = self.disk.stage(bytes)?;
        let mut policy = self.policy();
        // A concurrent insert of the same object won; the staging file is dropped.
        if policy.contains(digest) {
            return Ok(());
        }
        self.disk.place(staged, digest)?;
        policy.admit(digest, bytes.len() as u64);
        Counters::bump(&self.counters.inserts, 1);
        self.settle(policy);
        Ok(())
    }

    /// Remove `digest` from the cache (its file too). Returns whether it was cached.
    pub fn remove(&self, digest: &Digest) -> Result<bool, CacheError> {
        let mut policy = self.policy();
        if !policy.remove(digest, None) {
            return Ok(false);
        }
        let removed = self.disk.remove(digest);
        drop(policy);
        self.changed();
        removed.map(|()| true)
    }

    /// Pin `digests` for `holder` (added to what it already pins), cached or not: they are
    /// never evicted until the holder is unpinned.
    pub fn pin(&self, holder: &str, digests: impl IntoIterator<Item = Digest>) {
        self.policy().pin(holder, digests);
    }

    /// Drop every pin of `holder`, then evict what the budget requires.
    pub fn unpin(&self, holder: &str) {
        let mut policy = self.policy();
        policy.unpin(holder);
        self.settle(policy);
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> CacheStats {
        let (occupancy, budget) = {
            let policy = self.policy();
            (policy.occupancy(), policy.budget())
        };
        let read = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        CacheStats {
            hits: read(&self.counters.hits),
            misses: read(&self.counters.misses),
            inserts: read(&self.counters.inserts),
            evictions: read(&self.counters.evictions),
            corrupt_dropped: read(&self.counters.corrupt_dropped),
            bytes: occupancy.bytes,
            blocks: occupancy.blocks,
            probation_bytes: occupancy.probation_bytes,
            protected_bytes: occupancy.protected_bytes,
            pinned_bytes: occupancy.pinned_bytes,
            budget,
            over_budget: occupancy.bytes > budget,
        }
    }

    /// Write the segment order to the state file now.
    pub fn flush(&self) -> Result<(), CacheError> {
        let mut last_flush = self
            .last_flush
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        self.write_state(&mut last_flush)
    }

    /// The policy, even if a panicking thread poisoned its lock (every policy method leaves
    /// it consistent before anything can panic).
    fn policy(&self) -> MutexGuard<'_, Policy> {
        self.policy
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_state(&self, last_flush: &mut Instant) -> Result<(), CacheError> {
        // Cleared before the snapshot: a change made after it marks the cache dirty again.
        self.dirty.store(false, Ordering::Relaxed);
        let state = self.policy().state();
        if let Err(e) = self.disk.write_state(&state) {
            self.dirty.store(true, Ordering::Relaxed);
            return Err(e);
        }
        *last_flush = Instant::now();
        Ok(())
    }

    /// Note a policy change, and flush when the last flush is older than the flush interval
    /// (unless another thread is flushing).
    fn changed(&self) {
        self.dirty.store(true, Ordering::Relaxed);
        let Ok(mut last_flush) = self.last_flush.try_lock() else {
            return;
        };
        if last_flush.elapsed() < self.flush_interval {
            return;
        }
        if let Err(e) = self.write_state(&mut last_flush) {
            tracing::warn!(error = %e, "saving the block cache state failed; retried later");
        }
    }

    /// After a change of `policy`: evict what the budget requires (removing the files under
    /// the lock, so a concurrent insert of the same object cannot interleave), check the
    /// budget, release the lock, and note the change. [`BlockCache::changed`] may flush,
    /// which takes the lock: it is only ever called after the guard is dropped.
    fn settle(&self, mut policy: MutexGuard<'_, Policy>) {
        let victims = policy.evict_over_budget();
        for victim in &victims {
            if let Err(e) = self.disk.remove(victim) {
                // The file stays; the next open finds it and admits it again.
                tracing::warn!(block = %victim, error = %e, "removing an evicted block failed");
            }
        }
        Counters::bump(&self.counters.evictions, victims.len() as u64);
        self.check_budget(&policy);
        drop(policy);
        self.changed();
    }

    /// Drop the entry `generation` of `digest` whose file is gone or corrupt.
    fn drop_unusable(&self, digest: &Digest, generation: u64, why: Unusable) {
        let mut policy = self.policy();
        if !policy.remove(digest, Some(generation)) {
            // Re-admitted meanwhile with a new file: that one is checked on its own read.
            return;
        }
        match why {
            Unusable::Vanished => {
                tracing::warn!(block = %digest, "cached block file vanished; dropped");
            }
            Unusable::Corrupt => {
                tracing::warn!(block = %digest, "cached block is corrupt; dropped");
                if let Err(e) = self.disk.remove(digest) {
                    tracing::warn!(block = %digest, error = %e, "removing a corrupt block failed");
                }
                Counters::bump(&self.counters.corrupt_dropped, 1);
            }
        }
        drop(policy);
        self.changed();
    }

    /// Warn once when pins hold the cache over its budget; re-arm once back within it.
    fn check_budget(&self, policy: &Policy) {
        let over = policy.bytes() > policy.budget();
        if over && !self.warned_over_budget.swap(true, Ordering::Relaxed) {
            let occupancy = policy.occupancy();
            tracing::warn!(
                bytes = occupancy.bytes,
                budget = policy.budget(),
                pinned_bytes = occupancy.pinned_bytes,
                "pinned blocks hold the block cache over its budget"
            );
        } else if !over {
            self.warned_over_budget.store(false, Ordering::Relaxed);
        }
    }
}

impl Drop for BlockCache {
    fn drop(&mut self) {
        if !self.dirty.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "saving the block cache state at close failed");
        }
    }
}
