//! A file that is filled block by block while it is read: the local copy of a checkpoint's
//! `pages-N.img` during a lazy restore.
//!
//! The file is cut into fixed-size blocks (DART's 4 MiB), each named by the digest a
//! [`BlockSource`] fetches it by. It starts as a sparse file of its full size; a block is
//! fetched at most once (concurrent readers of one block wait for the one fetch), written at
//! its offset, and only then marked ready. A reader therefore never sees the zeros of an
//! unfilled hole: [`LazyFile::read_at`] waits for the blocks it covers. Background workers
//! ([`LazyFile::prefetch`], or [`prefetch_files`] for several files sharing one set of
//! workers) fetch every block in order, so the file ends complete and a later restore of the
//! same checkpoint reads it like any other.
//!
//! A failed fetch fails every present and later reader of that block: the caller must then
//! abandon the restore (see the module docs of `lazy`).

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::demand::DEMAND;

/// What a fetch error carries.
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Where blocks come from: the node cache, a peer or the origin (DART). Implementations
/// verify what they return against the digest; they may block for as long as a fetch takes.
pub trait BlockSource: Send + Sync {
    /// The bytes of block `digest`.
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError>;
}

/// The source of a file that is complete already ([`LazyFile::open_complete`]): never asked.
struct NoSource;

impl BlockSource for NoSource {
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
        Err(format!("block {digest} asked of a file that is complete").into())
    }
}

/// Why a lazily filled file could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {blocks} blocks of {block_size} bytes cannot hold {size} bytes")]
    Shape {
        path: PathBuf,
        size: u64,
        block_size: u64,
        blocks: usize,
    },
    #[error("{path}: block {index} ({digest}): {message}")]
    Fetch {
        path: PathBuf,
        index: usize,
        digest: String,
        message: String,
    },
    #[error("{path}: read past the end ({end} > {size})")]
    OutOfRange { path: PathBuf, end: u64, size: u64 },
    #[error("{path}: fetching was cancelled")]
    Cancelled { path: PathBuf },
}

#[derive(Debug, Clone)]
enum BlockState {
    Missing,
    Fetching,
    Ready,
    Failed(String),
}

/// Counters of one [`LazyFile`].
#[derive(Debug, Default)]
pub struct FileStats {
    /// Blocks fetched from the source.
    pub fetched: AtomicU64,
    /// Bytes of the blocks fetched from the source.
    pub fetched_bytes: AtomicU64,
    /// Reads that had to wait for a block (fetched by themselves or by another thread).
    pub waited: AtomicU64,
}

/// A file of blocks, filled on demand and in the background (see the module docs).
pub struct LazyFile {
    path: PathBuf,
    file: File,
    size: u64,
    block_size: u64,
    digests: Vec<String>,
    source: Arc<dyn BlockSource>,
    state: Mutex<Vec<BlockState>>,
    changed: Condvar,
    cancelled: AtomicBool,
    pub stats: FileStats,
}

impl std::fmt::Debug for LazyFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyFile")
            .field("path", &self.path)
            .field("size", &self.size)
            .field("blocks", &self.digests.len())
            .finish_non_exhaustive()
    }
}

impl LazyFile {
    /// Creates `path` (which must not exist) as a sparse file of `size` bytes whose blocks of
    /// `block_size` bytes (the last one shorter) are `digests`, fetched from `source`.
    pub fn create(
        path: &Path,
        size: u64,
        block_size: u64,
        digests: Vec<String>,
        source: Arc<dyn BlockSource>,
    ) -> Result<Self, BlockError> {
        if block_size == 0 || size.div_ceil(block_size) != digests.len() as u64 {
            return Err(BlockError::Shape {
                path: path.to_path_buf(),
                size,
                block_size,
                blocks: digests.len(),
            });
        }
        let io_err = |what| {
            move |source| BlockError::Io {
                what,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io_err("create"))?;
        file.set_len(size).map_err(io_err("size"))?;
        let state = vec![BlockState::Missing; digests.len()];
        Ok(Self {
            path: path.to_path_buf(),
            file,
            size,
            block_size,
            digests,
            source,
            state: Mutex::new(state),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
            stats: FileStats::default(),
        })
    }

    /// Opens `path`, a complete file already here (a checkpoint on this node), read-only:
    /// every read is served from it, nothing is ever fetched.
    pub fn open_complete(path: &Path) -> Result<Self, BlockError> {
        let io_err = |what| {
            move |source| BlockError::Io {
                what,
                path: path.to_path_buf(),
                source,
            }
        };
        let file = File::open(path).map_err(io_err("open"))?;
        let size = file.metadata().map_err(io_err("stat"))?.len();
        // One block of the whole file (none for an empty one), ready from the start.
        let blocks = usize::from(size > 0);
        Ok(Self {
            path: path.to_path_buf(),
            file,
            size,
            block_size: size.max(1),
            digests: vec![String::new(); blocks],
            source: Arc::new(NoSource),
            state: Mutex::new(vec![BlockState::Ready; blocks]),
            changed: Condvar::new(),
            cancelled: AtomicBool::new(false),
            stats: FileStats::default(),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Fetches (or waits for) every block that `range` touches, as a fault: while it waits,
    /// the node's background fetches start nothing new (see [`super::demand`]).
    pub fn ensure(&self, range: Range<u64>) -> Result<(), BlockError> {
        self.ensure_as(range, Caller::Reader)
    }

    /// As [`LazyFile::ensure`], for a reader that is no fault (the lazy-pages daemon copying
    /// the rest in the background): it does not hold the background back.
    pub fn ensure_in_background(&self, range: Range<u64>) -> Result<(), BlockError> {
        self.ensure_as(range, Caller::Background)
    }

    fn ensure_as(&self, range: Range<u64>, caller: Caller) -> Result<(), BlockError> {
        if range.end > self.size {
            return Err(BlockError::OutOfRange {
                path: self.path.clone(),
                end: range.end,
                size: self.size,
            });
        }
        self.blocks_of(range)
            .try_for_each(|i| self.ensure_block(i, caller))
    }

    /// How many bytes from `offset` (at most `max`) are in blocks already here, without
    /// fetching anything.
    pub fn ready_len(&self, offset: u64, max: u64) -> u64 {
        let state = self.lock();
        let end = (offset + max).min(self.size);
        let mut at = offset;
        while at < end {
            let i = (at / self.block_size) as usize;
            if !matches!(state[i], BlockState::Ready) {
                break;
            }
            at = (i as u64 + 1) * self.block_size;
        }
        at.min(end).saturating_sub(offset)
    }

    /// Reads `buf.len()` bytes at `offset`, fetching the blocks they lie in first.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        self.ensure(offset..offset + buf.len() as u64)?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|source| BlockError::Io {
                what: "read",
                path: self.path.clone(),
                source,
            })
    }

    /// Whether every block is here.
    pub fn is_complete(&self) -> bool {
        self.lock().iter().all(|s| matches!(s, BlockState::Ready))
    }

    /// Stops background fetching; blocks being fetched finish, waiting readers are not
    /// affected.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Starts `workers` threads that fetch every missing block, in file order.
    pub fn prefetch(self: &Arc<Self>, workers: usize) -> Prefetch {
        prefetch_files(std::slice::from_ref(self), workers)
    }

    /// The number of blocks.
    pub fn blocks(&self) -> usize {
        self.digests.len()
    }

    /// The indices of the blocks that bytes `range` lie in (empty for an empty range).
    pub fn blocks_of(&self, range: Range<u64>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        let first = (range.start / self.block_size) as usize;
        let last = ((range.end - 1) / self.block_size) as usize;
        first..(last + 1).min(self.digests.len())
    }

    /// Blocks fetched and their bytes so far.
    pub fn fetched(&self) -> (u64, u64) {
        (
            self.stats.fetched.load(Ordering::Relaxed),
            self.stats.fetched_bytes.load(Ordering::Relaxed),
        )
    }

    fn is_ready(&self, index: usize) -> bool {
        matches!(self.lock()[index], BlockState::Ready)
    }

    fn lock(&self) -> MutexGuard<'_, Vec<BlockState>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ensure_block(&self, index: usize, caller: Caller) -> Result<(), BlockError> {
        let mut state = self.lock();
        let mut waited = false;
        // A reader that has to wait holds the background back until its block is here.
        let mut counted = None;
        loop {
            if caller == Caller::Reader
                && counted.is_none()
                && matches!(state[index], BlockState::Fetching | BlockState::Missing)
            {
                counted = Some(DEMAND.begin());
            }
            match &state[index] {
                BlockState::Ready => {
                    if waited {
                        self.stats.waited.fetch_add(1, Ordering::Relaxed);
                    }
                    return Ok(());
                }
                BlockState::Failed(message) => return Err(self.fetch_error(index, message)),
                BlockState::Fetching => {
                    waited = true;
                    state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                BlockState::Missing => {
                    state[index] = BlockState::Fetching;
                    break;
                }
            }
        }
        drop(state);
        let result = self.fetch(index);
        let mut state = self.lock();
        state[index] = match &result {
            Ok(()) => BlockState::Ready,
            Err(message) => BlockState::Failed(message.clone()),
        };
        self.changed.notify_all();
        drop(state);
        self.stats.fetched.fetch_add(1, Ordering::Relaxed);
        result.map_err(|message| self.fetch_error(index, &message))
    }

    /// Fetches block `index` and writes it in place.
    fn fetch(&self, index: usize) -> Result<(), String> {
        let offset = index as u64 * self.block_size;
        let want = self.block_size.min(self.size - offset);
        let bytes = self
            .source
            .get_block(&self.digests[index])
            .map_err(|e| e.to_string())?;
        if bytes.len() as u64 != want {
            return Err(format!("{} bytes, expected {want}", bytes.len()));
        }
        self.file
            .write_all_at(&bytes, offset)
            .map_err(|e| format!("write: {e}"))?;
        self.stats.fetched_bytes.fetch_add(want, Ordering::Relaxed);
        Ok(())
    }

    fn fetch_error(&self, index: usize, message: &str) -> BlockError {
        BlockError::Fetch {
            path: self.path.clone(),
            index,
            digest: self.digests[index].clone(),
            message: message.to_string(),
        }
    }
}

/// Who asks for a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Caller {
    /// A read ([`LazyFile::ensure`]): a fault, or a restore that needs the block now.
    Reader,
    /// The background fill: it lets waiting readers go first (see [`super::demand`]).
    Background,
}

/// How long a background worker holds back for waiting faults before it fetches anyway
/// (longer in unit tests, so a slow test machine cannot outlast it).
const MAX_YIELD: Duration = if cfg!(test) {
    Duration::from_secs(10)
} else {
    Duration::from_millis(100)
};

/// Starts `workers` threads that fetch every missing block of `files` in the background: the
/// files one after the other, each in block order, each fetch started only when no fault of
/// the node waits for a block (or after [`MAX_YIELD`]). A worker stops at the first error or
/// at a cancelled file.
pub fn prefetch_files(files: &[Arc<LazyFile>], workers: usize) -> Prefetch {
    start_workers(
        files
            .iter()
            .flat_map(|file| (0..file.blocks()).map(move |i| (Arc::clone(file), i)))
            .collect(),
        workers,
        Caller::Background,
    )
}

/// Starts `workers` threads that fetch the blocks `jobs` names (file, block index), in that
/// order, as readers do (the caller waits for them); blocks already here or being fetched
/// are not fetched again.
pub fn prefetch_blocks(jobs: Vec<(Arc<LazyFile>, usize)>, workers: usize) -> Prefetch {
    start_workers(jobs, workers, Caller::Reader)
}

fn start_workers(jobs: Vec<(Arc<LazyFile>, usize)>, workers: usize, caller: Caller) -> Prefetch {
    let workers = workers.max(1).min(jobs.len().max(1));
    let jobs = Arc::new(jobs);
    let next = Arc::new(AtomicUsize::new(0));
    let threads = (0..workers)
        .map(|_| {
            let (jobs, next) = (Arc::clone(&jobs), Arc::clone(&next));
            std::thread::spawn(move || {
                loop {
                    let Some((file, i)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return Ok(());
                    };
                    if file.cancelled.load(Ordering::Relaxed) {
                        return Err(BlockError::Cancelled {
                            path: file.path.clone(),
                        });
                    }
                    if caller == Caller::Background && !file.is_ready(*i) {
                        DEMAND.wait_quiet(MAX_YIELD);
                    }
                    file.ensure_block(*i, caller)?;
                }
            })
        })
        .collect();
    Prefetch { threads }
}

/// Background fetching of [`LazyFile`]s ([`LazyFile::prefetch`], [`prefetch_files`]).
#[derive(Debug)]
pub struct Prefetch {
    threads: Vec<JoinHandle<Result<(), BlockError>>>,
}

impl Prefetch {
    /// Waits until every worker is done: Ok when the file is complete.
    pub fn wait(self) -> Result<(), BlockError> {
        let mut result = Ok(());
        for thread in self.threads {
            let outcome = thread.join().unwrap_or_else(|_| {
                Err(BlockError::Cancelled {
                    path: PathBuf::from("(a prefetch worker panicked)"),
                })
            });
            if result.is_ok() {
                result = outcome;
            }
        }
        result
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    pub(crate) use crate::lazy::testkit::MemorySource;

    pub(crate) fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 4096) as u8).collect()
    }

    #[test]
    fn reads_wait_for_their_blocks_and_each_block_is_fetched_once() {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(10 * 4096 + 100);
        let (source, digests) = MemorySource::of(&data, 4 * 4096, Duration::from_millis(30));
        let source = Arc::new(source);
        let file = Arc::new(
            LazyFile::create(
                &dir.path().join("pages-1.img"),
                data.len() as u64,
                4 * 4096,
                digests,
                source.clone(),
            )
            .unwrap(),
        );
        assert_eq!(file.ready_len(0, 4096), 0);
        // Eight readers of one range in the middle block race: one fetch, same bytes.
        let readers: Vec<_> = (0..8)
            .map(|_| {
                let file = Arc::clone(&file);
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 4096];
                    file.read_at(5 * 4096, &mut buf).unwrap();
                    buf
                })
            })
            .collect();
        for reader in readers {
            assert_eq!(reader.join().unwrap(), data[5 * 4096..6 * 4096]);
        }
        assert_eq!(source.fetch_count(), 1);
        assert_eq!(file.ready_len(4 * 4096, 1 << 20), 4 * 4096);
        // A read across a block boundary fetches both sides.
        let mut buf = vec![0u8; 8192];
        file.read_at(3 * 4096, &mut buf).unwrap();
        assert_eq!(buf, data[3 * 4096..5 * 4096]);
        assert_eq!(source.fetch_count(), 2);
        // The rest comes in the background; the file on disk ends identical.
        file.prefetch(2).wait().unwrap();
        assert!(file.is_complete());
        assert_eq!(source.fetch_count(), 3);
        assert_eq!(std::fs::read(file.path()).unwrap(), data);
        let mut tail = vec![0u8; 200];
        assert!(matches!(
            file.read_at(data.len() as u64 - 100, &mut tail),
            Err(BlockError::OutOfRange { .. })
        ));
    }

    /// Serves blocks from memory, logging each request; the first block asked is held until
    /// the test lets it go.
    struct HeldSource {
        inner: MemorySource,
        asked: Mutex<Vec<String>>,
        held: Mutex<bool>,
        let_go: Condvar,
    }

    impl BlockSource for HeldSource {
        fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
            let first = {
                let mut asked = self.asked.lock().unwrap();
                asked.push(digest.to_string());
                asked.len() == 1
            };
            if first {
                let mut held = self.held.lock().unwrap();
                while *held {
                    held = self.let_go.wait(held).unwrap();
                }
            }
            self.inner.get_block(digest)
        }
    }

    impl HeldSource {
        fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }

        /// The held fetch goes on.
        fn let_go(&self) {
            *self.held.lock().unwrap() = false;
            self.let_go.notify_all();
        }
    }

    /// A file of six 4 KiB blocks whose source holds the first fetch asked: its directory,
    /// data, block digests, source and the file.
    fn held_file() -> (
        tempfile::TempDir,
        Vec<u8>,
        Vec<String>,
        Arc<HeldSource>,
        Arc<LazyFile>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let data = pattern(6 * 4096);
        let (inner, digests) = MemorySource::of(&data, 4096, Duration::ZERO);
        let source = Arc::new(HeldSource {
            inner,
            asked: Mutex::new(Vec::new()),
            held: Mutex::new(true),
            let_go: Condvar::new(),
        });
        let file = Arc::new(
            LazyFile::create(
                &dir.path().join("pages-1.img"),
                data.len() as u64,
                4096,
                digests.clone(),
                source.clone(),
            )
            .unwrap(),
        );
        (dir, data, digests, source, file)
    }

    #[test]
    fn the_background_starts_no_fetch_while_a_reader_waits_for_its_block() {
        let (_dir, data, digests, source, file) = held_file();
        // A fault on block 3: its fetch is held at the source.
        let reader = {
            let file = Arc::clone(&file);
            std::thread::spawn(move || file.read_at(3 * 4096, &mut [0u8; 16]))
        };
        while source.asked().is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let background = file.prefetch(2);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(source.asked(), [digests[3].clone()]);
        source.let_go();
        reader.join().unwrap().unwrap();
        background.wait().unwrap();
        assert_eq!(std::fs::read(file.path()).unwrap(), data);
        assert_eq!(source.asked().len(), 6);
    }

    #[test]
    fn a_background_reader_holds_nothing_back() {
        let (_dir, data, _, source, file) = held_file();
        // The lazy-pages daemon copying block 3 in the background: its fetch is held, and the
        // background fetch of the other blocks goes on meanwhile.
        let copier = {
            let file = Arc::clone(&file);
            std::thread::spawn(move || file.ensure_in_background(3 * 4096..3 * 4096 + 16))
        };
        let background = file.prefetch(2);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while source.asked().len() < 6 {
            assert!(
                std::time::Instant::now() < deadline,
                "the background waited"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        source.let_go();
        copier.join().unwrap().unwrap();
        background.wait().unwrap();
        assert_eq!(std::fs::read(file.path()).unwrap(), data);
    }

    #[test]
    fn files_share_one_set_of_workers_and_count_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (pattern(3 * 4096 + 10), pattern(5 * 4096));
        let files: Vec<Arc<LazyFile>> = [("a", &a), ("b", &b)]
            .into_iter()
            .map(|(name, data)| {
                let (source, digests) = MemorySource::of(data, 4096, Duration::from_millis(1));
                Arc::new(
                    LazyFile::create(
                        &dir.path().join(name),
                        data.len() as u64,
                        4096,
                        digests,
                        Arc::new(source),
                    )
                    .unwrap(),
                )
            })
            .collect();
        prefetch_files(&files, 3).wait().unwrap();
        for (file, data) in files.iter().zip([&a, &b]) {
            assert!(file.is_complete());
            assert_eq!(&std::fs::read(file.path()).unwrap(), data);
            assert_eq!(
                file.stats.fetched.load(Ordering::Relaxed),
                file.blocks() as u64
            );
            assert_eq!(
                file.stats.fetched_bytes.load(Ordering::Relaxed),
                data.len() as u64
            );
        }
        // A cancelled file stops the workers that reach it.
        let (source, digests) = MemorySource::of(&a, 4096, Duration::ZERO);
        let cancelled = Arc::new(
            LazyFile::create(
                &dir.path().join("c"),
                a.len() as u64,
                4096,
                digests,
                Arc::new(source),
            )
            .unwrap(),
        );
        cancelled.cancel();
        assert!(matches!(
            cancelled.prefetch(2).wait(),
            Err(BlockError::Cancelled { .. })
        ));
        assert!(!cancelled.is_complete());
    }

    #[test]
    fn a_failed_fetch_fails_its_readers_and_never_shows_zeros() {
        struct Broken;
        impl BlockSource for Broken {
            fn get_block(&self, digest: &str) -> Result<Vec<u8>, SourceError> {
                Err(format!("origin unreachable for {digest}").into())
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let file = LazyFile::create(
            &dir.path().join("pages-1.img"),
            8192,
            4096,
            vec!["a".repeat(64), "b".repeat(64)],
            Arc::new(Broken),
        )
        .unwrap();
        let mut buf = [0u8; 16];
        let err = file.read_at(4096, &mut buf).unwrap_err();
        assert!(err.to_string().contains("origin unreachable"), "{err}");
        assert!(matches!(
            file.read_at(4100, &mut buf),
            Err(BlockError::Fetch { index: 1, .. })
        ));
        assert!(!file.is_complete());
    }

    #[test]
    fn a_block_list_that_does_not_fit_the_size_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (source, digests) = MemorySource::of(&[1u8; 10], 4, Duration::ZERO);
        let err =
            LazyFile::create(&dir.path().join("f"), 13, 4, digests, Arc::new(source)).unwrap_err();
        assert!(matches!(err, BlockError::Shape { .. }), "{err}");
    }
}
