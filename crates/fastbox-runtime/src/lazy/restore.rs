//! The page transfer of one lazy restore, around `criu restore --lazy-pages`
//! ([`crate::checkpoint::restore_lazy`] runs the steps in this order):
//!
//! 1. [`LazySession::start`], before CRIU: every pages image of [`LazyPages::files`] becomes a
//!    [`LazyFile`] in the images directory. A task's (one a task pagemap names) gets the
//!    blocks of its eager ranges now (the restore reads those itself); any other (shared
//!    memory) gets all of its blocks now. What has been fetched then is
//!    [`LazySession::fetched_before_restore`]. Then the background fetch of every remaining
//!    block starts ([`LazyPages::fetch_workers`] threads shared by all files) and the
//!    `criu lazy-pages` daemon starts listening in the restore's work directory.
//! 2. `criu restore --lazy-pages` runs, killed at [`LazySession::restore_deadline`]: a
//!    restore whose pages never come can wait until it is killed (seen here with a block
//!    source that fails).
//! 3. [`LazySession::watch`], after the restore succeeded: a thread waits for the daemon to
//!    end. If the transfer fails or outlives [`LazyPages::transfer_timeout`], the thread first
//!    runs the kill action it was given (the caller kills the sandbox: its untransferred pages
//!    now read as zeros), then cleans up. A daemon that ends successfully although a pages
//!    image is not complete (the tree died before it needed every page) fails the transfer
//!    too. [`LazyTransfer::wait`] returns the outcome; pauses, snapshots and forks of the
//!    sandbox must wait for it.
//!
//! **Contract:** every pages image of the checkpoint (`pages-*.img`) comes through
//! [`LazyPages::files`] and none is in the images directory beforehand. While a transfer runs
//! the images directory is private to it (its task pages images have holes); afterwards they
//! are complete, and a pages image that could not be completed (a failed restore or
//! transfer) is removed, so the directory never holds one with holes under its name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::blocks::{BlockError, BlockSource, LazyFile, Prefetch, prefetch_blocks, prefetch_files};
use super::daemon::{DaemonError, LazyDaemon};
use super::pagemap::{PagemapError, task_pagemaps};
use super::server::{PageServer, ServeStats};
use crate::criu::Criu;

/// A file of the checkpoint that is not local: its size and its blocks, in order, as the
/// artifact's manifest lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    pub size: u64,
    pub blocks: Vec<String>,
}

/// Where a lazy restore gets the checkpoint's memory, and its limits.
#[derive(Clone)]
pub struct LazyPages {
    /// Where blocks come from (the node cache, a peer, the origin: DART), verified.
    pub source: Arc<dyn BlockSource>,
    /// The size of every block of a file but the last (DART's 4 MiB).
    pub block_size: u64,
    /// The checkpoint's pages images by file name (`pages-3.img`) that are not local; see
    /// the module contract.
    pub files: BTreeMap<String, RemoteFile>,
    /// Pages images that are complete in the images directory already (a checkpoint on this
    /// node, [`LazyPages::local`]): served from there, nothing fetched. The restore still
    /// returns before the memory is copied in.
    pub complete: Vec<String>,
    /// Threads fetching blocks in the background (and the eager blocks before the restore).
    pub fetch_workers: usize,
    /// How long `criu restore` may run before it is killed.
    pub restore_timeout: Duration,
    /// How long the whole transfer may take, from [`LazySession::start`], before the
    /// sandbox is killed (`None`: no limit; the block source's own timeouts then bound it).
    pub transfer_timeout: Option<Duration>,
}

impl LazyPages {
    /// The pages of the checkpoint images in `images`, all of them on this node: a lazy
    /// restore of it returns once everything but the memory is restored, and the daemon
    /// copies the memory in from the local files while the sandbox runs.
    pub fn local(
        images: &Path,
        restore_timeout: Duration,
        transfer_timeout: Option<Duration>,
    ) -> std::io::Result<Self> {
        let mut complete: Vec<String> = std::fs::read_dir(images)?
            .map(|entry| entry.map(|e| e.file_name().to_string_lossy().into_owned()))
            .filter(|name| {
                name.as_ref()
                    .map_or(true, |n| n.starts_with("pages-") && n.ends_with(".img"))
            })
            .collect::<Result<_, _>>()?;
        complete.sort();
        Ok(Self {
            source: Arc::new(NoBlocks),
            block_size: 1,
            files: BTreeMap::new(),
            complete,
            fetch_workers: 1,
            restore_timeout,
            transfer_timeout,
        })
    }
}

/// The block source of [`LazyPages::local`]: there is nothing to fetch.
struct NoBlocks;

impl BlockSource for NoBlocks {
    fn get_block(&self, digest: &str) -> Result<Vec<u8>, super::blocks::SourceError> {
        Err(format!("block {digest}: the checkpoint is local, nothing is fetched").into())
    }
}

impl std::fmt::Debug for LazyPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyPages")
            .field("block_size", &self.block_size)
            .field("files", &self.files.keys().collect::<Vec<_>>())
            .field("complete", &self.complete)
            .field("fetch_workers", &self.fetch_workers)
            .field("restore_timeout", &self.restore_timeout)
            .field("transfer_timeout", &self.transfer_timeout)
            .finish_non_exhaustive()
    }
}

/// Why a lazy restore's transfer could not start or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("pagemaps: {0}")]
    Pagemap(#[from] PagemapError),
    #[error("task {pid}'s pages image {name} is not among the lazily fetched files")]
    MissingPages { pid: u64, name: String },
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    #[error("{0} is not complete after the transfer")]
    Incomplete(PathBuf),
    #[error("the page transfer's watcher panicked")]
    WatcherPanicked,
}

/// Blocks and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Fetched {
    pub blocks: u64,
    pub bytes: u64,
}

impl Fetched {
    fn of(files: &[Arc<LazyFile>]) -> Self {
        files.iter().fold(Self::default(), |sum, file| {
            let (blocks, bytes) = file.fetched();
            Self {
                blocks: sum.blocks + blocks,
                bytes: sum.bytes + bytes,
            }
        })
    }
}

/// What a finished transfer did.
#[derive(Debug, Clone)]
pub struct TransferReport {
    /// The page server's account of the session.
    pub served: ServeStats,
    /// Fetched before `criu restore` started.
    pub before_restore: Fetched,
    /// Fetched in all.
    pub fetched: Fetched,
    /// From [`LazySession::start`] until every page was in place.
    pub took: Duration,
    /// When every page was in place.
    pub finished: Instant,
}

/// A started transfer: daemon listening, background fetch running. Dropping it (the restore
/// failed) kills the daemon, stops the fetch and removes the incomplete pages images.
#[derive(Debug)]
pub struct LazySession {
    daemon: Option<LazyDaemon>,
    files: Vec<Arc<LazyFile>>,
    prefetch: Option<Prefetch>,
    before_restore: Fetched,
    started: Instant,
    restore_timeout: Duration,
    transfer_timeout: Option<Duration>,
}

impl LazySession {
    /// Step 1 of the module docs, for the checkpoint images in `images` and the restore that
    /// will run with `work_dir` as its work directory. The daemon logs to `log`, and freezes
    /// the restored tree through `freeze_on_failure` when it fails with nobody watching
    /// ([`Criu::lazy_pages_command`]).
    pub fn start(
        criu: &Criu,
        images: &Path,
        work_dir: &Path,
        log: &Path,
        pages: &LazyPages,
        freeze_on_failure: Option<(&Path, &str)>,
    ) -> Result<Self, LazyError> {
        let started = Instant::now();
        let mut tasks: HashMap<String, (u64, _)> = task_pagemaps(images)?
            .into_iter()
            .map(|(pid, map)| (map.pages_file_name(), (pid, map)))
            .collect();
        let listed =
            |name: &String| pages.files.contains_key(name) || pages.complete.contains(name);
        if let Some((name, (pid, _))) = tasks.iter().find(|(n, _)| !listed(n)) {
            return Err(LazyError::MissingPages {
                pid: *pid,
                name: name.clone(),
            });
        }
        // Built field by field so that a failure half-way drops (and cleans up) what exists.
        let mut session = Self {
            daemon: None,
            files: Vec::new(),
            prefetch: None,
            before_restore: Fetched::default(),
            started,
            restore_timeout: pages.restore_timeout,
            transfer_timeout: pages.transfer_timeout,
        };
        let mut server = PageServer::new();
        let mut now: Vec<(Arc<LazyFile>, usize)> = Vec::new();
        for (name, remote) in &pages.files {
            let file = Arc::new(LazyFile::create(
                &images.join(name),
                remote.size,
                pages.block_size,
                remote.blocks.clone(),
                Arc::clone(&pages.source),
            )?);
            session.files.push(Arc::clone(&file));
            match tasks.remove(name) {
                Some((pid, map)) => {
                    for range in map.eager_ranges() {
                        now.extend(file.blocks_of(range).map(|i| (Arc::clone(&file), i)));
                    }
                    server.add_task(pid, Arc::new(map), file);
                }
                None => now.extend((0..file.blocks()).map(|i| (Arc::clone(&file), i))),
            }
        }
        for name in &pages.complete {
            let file = Arc::new(LazyFile::open_complete(&images.join(name))?);
            session.files.push(Arc::clone(&file));
            if let Some((pid, map)) = tasks.remove(name) {
                server.add_task(pid, Arc::new(map), file);
            }
        }
        prefetch_blocks(now, pages.fetch_workers).wait()?;
        session.before_restore = Fetched::of(&session.files);
        session.prefetch = Some(prefetch_files(&session.files, pages.fetch_workers));
        session.daemon = Some(LazyDaemon::start(
            criu.lazy_pages_command(freeze_on_failure),
            images,
            work_dir,
            log,
            // A checkpoint that is all here is read by the daemon itself: no page server
            // (half the copying: 89-135 against 165-734 ms for 256 MiB), and a daemon that
            // outlives this process still finishes its transfer.
            (!pages.files.is_empty()).then_some(server),
        )?);
        Ok(session)
    }

    /// What had been fetched when the session was ready for the restore: the eager blocks
    /// and the shared-memory images.
    pub fn fetched_before_restore(&self) -> Fetched {
        self.before_restore
    }

    /// When a `criu restore` starting now must have ended ([`LazyPages::restore_timeout`]).
    pub fn restore_deadline(&self) -> Instant {
        Instant::now() + self.restore_timeout
    }

    /// Step 3 of the module docs: watches the transfer of a restore that succeeded; `kill`
    /// (end the sandbox) runs first when the transfer fails.
    pub fn watch(mut self, kill: impl FnOnce() + Send + 'static) -> LazyTransfer {
        let daemon = self.daemon.take();
        if let Some(daemon) = &daemon {
            daemon.yield_cpu();
        }
        let daemon_process = daemon.as_ref().and_then(LazyDaemon::process);
        let mut prefetch = self.prefetch.take();
        let files = std::mem::take(&mut self.files);
        let (started, before_restore) = (self.started, self.before_restore);
        let timeout = self
            .transfer_timeout
            .map(|t| t.saturating_sub(started.elapsed()));
        let thread = std::thread::spawn(move || {
            let outcome = match daemon.map(|d| d.wait_timeout(timeout)) {
                Some(Ok(report)) => complete(prefetch.take(), &files).map(|()| report.served),
                Some(Err(e)) => Err(e.into()),
                None => Err(LazyError::WatcherPanicked),
            };
            match outcome {
                Ok(served) => Ok(TransferReport {
                    served,
                    before_restore,
                    fetched: Fetched::of(&files),
                    took: started.elapsed(),
                    finished: Instant::now(),
                }),
                Err(e) => {
                    // The sandbox goes first: its missing pages read as zeros now.
                    kill();
                    abandon(&files, prefetch);
                    Err(e)
                }
            }
        });
        LazyTransfer {
            thread: Some(thread),
            daemon: daemon_process,
        }
    }
}

impl Drop for LazySession {
    fn drop(&mut self) {
        drop(self.daemon.take());
        abandon(&self.files, self.prefetch.take());
    }
}

/// After the daemon succeeded: stops the background fetch (a tree that copied every page
/// read every block; one that did not has died, and needs no more) and waits for its workers;
/// Ok when every file is complete.
fn complete(prefetch: Option<Prefetch>, files: &[Arc<LazyFile>]) -> Result<(), LazyError> {
    files.iter().for_each(|f| f.cancel());
    if let Some(prefetch) = prefetch {
        // Cancelled workers report it; what matters is whether the files are complete.
        let _ = prefetch.wait();
    }
    match files.iter().find(|f| !f.is_complete()) {
        Some(file) => Err(LazyError::Incomplete(file.path().to_path_buf())),
        None => Ok(()),
    }
}

/// Stops the background fetch of `files`, waits for its workers (each finishes the block it
/// is on), then removes every file that is not complete.
fn abandon(files: &[Arc<LazyFile>], prefetch: Option<Prefetch>) {
    files.iter().for_each(|f| f.cancel());
    if let Some(prefetch) = prefetch {
        let _ = prefetch.wait();
    }
    for file in files.iter().filter(|f| !f.is_complete()) {
        let _ = std::fs::remove_file(file.path());
    }
}

/// The transfer of a lazily restored sandbox ([`LazySession::watch`]). Dropping it detaches
/// the watcher, which still kills the sandbox if the transfer fails.
#[derive(Debug)]
pub struct LazyTransfer {
    thread: Option<JoinHandle<Result<TransferReport, LazyError>>>,
    daemon: Option<crate::lazy::daemon::DaemonProcess>,
}

impl LazyTransfer {
    /// The process that runs the daemon (its guarding shell when it has one), to wait for
    /// when this process is gone: see [`crate::lazy::daemon::DaemonProcess`].
    pub fn daemon(&self) -> Option<crate::lazy::daemon::DaemonProcess> {
        self.daemon
    }

    /// Waits until every page is in place: Ok with what the transfer did, or the error that
    /// ended it (the sandbox was killed before this returns).
    pub fn wait(mut self) -> Result<TransferReport, LazyError> {
        let thread = self.thread.take().ok_or(LazyError::WatcherPanicked)?;
        thread.join().unwrap_or(Err(LazyError::WatcherPanicked))
    }

    /// Whether the transfer has ended (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}
