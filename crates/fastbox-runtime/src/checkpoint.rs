//! Checkpoint a sandbox (CRIU images + its writable layer) and restore one into a new slot,
//! root and cgroup. The checkpoint directory is self-describing (`checkpoint.json`), so a
//! restore needs only the directory, the image rootfs and the execd of the recorded digest.
//! [`restore_lazy`] restores one whose memory is not local yet (see [`crate::lazy`]).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cgroup::{Cgroup, CgroupError, CgroupLimits, CgroupRoot};
use crate::criu::{Criu, CriuError, DumpRequest, RestoreRequest};
use crate::criu_stats::DumpStats;
use crate::execd_binary::ExecdBinary;
use crate::image_stream;
use crate::lazy::restore::{Fetched, LazyError, LazyPages, LazySession, LazyTransfer};
use crate::post_dump::{PostDumpError, PostDumpHook};
use crate::rootfs::{Rootfs, RootfsError};
use crate::sandbox::{SandboxHandle, process_start_ticks};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint of {id}: {source}")]
    Criu { id: String, source: CriuError },
    #[error("checkpoint of {id}: rootfs: {source}")]
    Rootfs { id: String, source: RootfsError },
    #[error("checkpoint of {id}: cgroup: {source}")]
    Cgroup { id: String, source: CgroupError },
    #[error("checkpoint of {id}: {what} {path}: {source}")]
    Io {
        id: String,
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("checkpoint {0} has no readable checkpoint.json")]
    BadMetadata(PathBuf),
    #[error("checkpoint needs execd {digest}, which is not in the store")]
    MissingExecd { digest: String },
    #[error("lazy restore of {id}: {source}")]
    Lazy { id: String, source: LazyError },
    #[error("checkpoint of {id}: {source}")]
    Stream {
        id: String,
        source: image_stream::StreamError,
    },
    #[error("checkpoint of {id}: {source}")]
    PostDump { id: String, source: PostDumpError },
    #[error(
        "checkpoint of {id}: {why}, which CRIU cannot checkpoint; end the sandbox's isolated sessions first"
    )]
    NestedUserNamespace { id: String, why: String },
}

/// Why the tree under `init` cannot be dumped, if a process of it is in another user
/// namespace than `init`'s (an isolated session's): CRIU refuses such trees half-way, so a
/// dump is refused before. A tree this cannot walk is refused too.
pub fn nested_user_namespace(init: i32) -> Option<String> {
    let ns = |pid: i32| fs::read_link(format!("/proc/{pid}/ns/user")).ok();
    let Some(own) = ns(init) else {
        return Some(format!(
            "the user namespace of its init {init} cannot be read"
        ));
    };
    let mut pending = vec![init];
    let mut seen = 0usize;
    while let Some(pid) = pending.pop() {
        seen += 1;
        if seen > 1 << 16 {
            return Some("it has more than 65536 processes to check for user namespaces".into());
        }
        if pid != init && ns(pid).is_some_and(|n| n != own) {
            return Some(format!(
                "process {pid} runs in a user namespace of its own (an isolated session)"
            ));
        }
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
            pending.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    None
}

/// What `checkpoint.json` records.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The sandbox the checkpoint was taken of.
    pub source_id: String,
    /// Digest of the execd binary inside the images (restored with exactly that one).
    pub execd_digest: String,
    /// CRIU version that wrote the images.
    pub criu_version: String,
    /// The image rootfs the sandbox's overlay had as its lower layer.
    #[serde(default)]
    pub lower: Option<PathBuf>,
}

/// A restore's CRIU log, pidfile and statistics, in the new sandbox's directory.
const RESTORE_WORK_DIR: &str = "criu-work";
/// The log of a lazy restore's `criu lazy-pages`, in the new sandbox's directory (the work
/// directory goes when the restore returns; the daemon runs on).
const LAZY_PAGES_LOG: &str = "criu-lazy-pages.log";

/// Paths inside a checkpoint directory.
pub fn images_dir(checkpoint: &Path) -> PathBuf {
    checkpoint.join("criu")
}
fn upper_dir(checkpoint: &Path) -> PathBuf {
    checkpoint.join("upper")
}

/// How a checkpoint is taken.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheckpointOptions<'a> {
    /// Keep the sandbox running (a live snapshot); otherwise the dump ends it.
    pub leave_running: bool,
    /// A memory-backed directory that the images and the writable layer are written to while
    /// the sandbox is frozen, then moved to `out` (`None`: written to `out` directly).
    pub staging: Option<&'a Path>,
    /// Flush `out` to disk before returning (`syncfs`).
    pub durable: bool,
    /// The sandbox's volumes, dumped as external mounts ([`DumpRequest::external_mounts`]).
    pub external_mounts: &'a [(String, String)],
}

/// What a checkpoint took and how big it is.
#[derive(Debug, Clone)]
pub struct CheckpointReport {
    /// The dump (its directory is where it was dumped).
    pub dumped: Dumped,
    /// Moving the staged files to `out` and flushing them.
    pub persist: Duration,
    /// Bytes of the checkpoint (images and writable layer).
    pub bytes: u64,
}

/// Dump `handle` into `out` (the sandbox is killed by the dump) and save its writable layer.
pub fn checkpoint(
    criu: &Criu,
    handle: &SandboxHandle,
    out: &Path,
) -> Result<CheckpointMeta, CheckpointError> {
    checkpoint_with(criu, handle, out, CheckpointOptions::default()).map(|r| r.dumped.meta)
}

/// Dump `handle` into `out` with its writable layer, which is copied while the tree is
/// frozen (CRIU's post-dump action), so files and memory are captured at the same instant.
pub fn checkpoint_with(
    criu: &Criu,
    handle: &SandboxHandle,
    out: &Path,
    opts: CheckpointOptions<'_>,
) -> Result<CheckpointReport, CheckpointError> {
    let dumped = dump_into(
        criu,
        handle,
        opts.staging.unwrap_or(out),
        DumpOptions {
            leave_running: opts.leave_running,
            stream: false,
            external_mounts: opts.external_mounts,
        },
    );
    let persisted = dumped.and_then(|dumped| persist(&dumped, out, opts.durable));
    if let Some(staging) = opts.staging {
        let _ = fs::remove_dir_all(staging);
    }
    persisted
}

/// How [`dump_into`] dumps.
#[derive(Debug, Clone, Copy, Default)]
pub struct DumpOptions<'a> {
    /// Keep the sandbox running (a live snapshot); otherwise the dump ends it.
    pub leave_running: bool,
    /// Capture the images into memory first ([`crate::image_stream`]).
    pub stream: bool,
    /// The sandbox's volumes ([`DumpRequest::external_mounts`]).
    pub external_mounts: &'a [(String, String)],
}

/// A checkpoint dumped into a directory ([`dump_into`]), not yet where it is kept.
#[derive(Debug, Clone)]
pub struct Dumped {
    /// The checkpoint directory, restorable as it is.
    pub dir: PathBuf,
    pub meta: CheckpointMeta,
    /// CRIU's own account (`stats-dump`): `frozen_time_us` is how long the tree was stopped.
    pub stats: Option<DumpStats>,
    /// The `criu dump` run: freeze, dump, the writable layer's copy, thaw or kill.
    pub dump: Duration,
    /// Whether CRIU streamed the images ([`crate::image_stream`]).
    pub streamed: bool,
}

/// Dumps `handle` into checkpoint directory `dir` with its writable layer, which is copied
/// while the tree is frozen (CRIU's post-dump action), so files and memory are captured at
/// the same instant. With `leave_running` the sandbox runs on; otherwise the dump ends it.
/// With `stream`, the images are captured into memory ([`crate::image_stream`]) and written
/// to `dir` once the tree runs again: a shorter freeze, a longer dump. When this fails, the
/// caller removes `dir`.
pub fn dump_into(
    criu: &Criu,
    handle: &SandboxHandle,
    dir: &Path,
    opts: DumpOptions<'_>,
) -> Result<Dumped, CheckpointError> {
    let DumpOptions {
        leave_running,
        stream,
        external_mounts,
    } = opts;
    let id = handle.id.clone();
    let io_err = |what: &'static str, path: &Path| {
        let (id, path) = (id.clone(), path.to_path_buf());
        move |source| CheckpointError::Io {
            id,
            what,
            path,
            source,
        }
    };
    if let Some(why) = nested_user_namespace(handle.init_pid) {
        return Err(CheckpointError::NestedUserNamespace { id, why });
    }
    fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let images = images_dir(dir);
    let rootfs = handle.rootfs();
    // The metadata goes first: a dump that outlives a crash of this process is complete
    // with it (see [`is_complete`]).
    let meta = CheckpointMeta {
        source_id: id.clone(),
        execd_digest: handle.execd_digest.clone(),
        criu_version: criu.version.clone(),
        lower: rootfs.lower(),
    };
    let path = dir.join("checkpoint.json");
    fs::write(
        &path,
        serde_json::to_vec_pretty(&meta).expect("metadata serializes"),
    )
    .map_err(io_err("write", &path))?;
    let clock = Instant::now();
    // Memory touched ahead for what the tree holds, and a margin; a plain dump for a small
    // tree, or when the host has not that much to spare.
    let stream_bytes = stream.then(|| {
        let bytes = crate::sandbox::tree_resident_bytes(handle.init_pid);
        bytes + bytes / 16 + (16 << 20)
    });
    let capture = stream_bytes
        .filter(|&bytes| bytes >= STREAM_MIN_BYTES && image_stream::fits(bytes))
        .and_then(|bytes| {
            image_stream::Capture::start(&images, bytes)
                .inspect_err(|e| tracing::warn!(sandbox = %id, error = %e, "dumping without the image streamer"))
                .ok()
        });
    // The writable layer is copied at CRIU's post-dump action, while the tree is frozen; a
    // streamed dump first waits there until the streamer holds every page.
    let hook = {
        let drain = capture.as_ref().map(image_stream::Capture::drain);
        let (upper, copy) = (rootfs.upper.clone(), upper_dir(dir));
        let source_id = id.clone();
        PostDumpHook::start(dir, move || {
            let id = source_id;
            if let Some(drain) = drain {
                drain.wait().map_err(|source| CheckpointError::Stream {
                    id: id.clone(),
                    source,
                })?;
            }
            fs::create_dir(&copy)
                .map_err(|source| CheckpointError::Io {
                    id: id.clone(),
                    what: "create",
                    path: copy.clone(),
                    source,
                })
                .and_then(|()| copy_tree(&id, &upper, &copy))
        })
        .map_err(|source| CheckpointError::PostDump {
            id: id.clone(),
            source,
        })?
    };
    let dumped = criu.dump(&DumpRequest {
        init_pid: handle.init_pid,
        netns: &handle.netns,
        images: &images,
        leave_running,
        post_dump: Some(&hook.script()),
        stream: capture.is_some(),
        external_mounts,
    });
    let post_dump = hook.finish();
    let written = match (dumped, capture) {
        (Err(source), _) => Err(match post_dump {
            // The action's own failure says more than CRIU's exit status.
            Some(Err(failed)) => failed,
            _ => CheckpointError::Criu {
                id: id.clone(),
                source,
            },
        }),
        (Ok(()), None) => Ok(false),
        (Ok(()), Some(capture)) => {
            capture
                .finish()
                .map(|_| true)
                .map_err(|source| CheckpointError::Stream {
                    id: id.clone(),
                    source,
                })
        }
    };
    let dump = clock.elapsed();
    let streamed = written?;
    let stats = if streamed {
        crate::criu_stats::frozen_from_log(&images.join("dump.log"))
    } else {
        crate::criu_stats::read_dump_stats(&images).ok()
    };
    Ok(Dumped {
        dir: dir.to_path_buf(),
        meta,
        stats,
        dump,
        streamed,
    })
}

/// The smallest tree (resident bytes and margin) whose dump is streamed: below it the
/// streamer saves nothing and costs its fixed part (an idle Python, 25 MiB with the margin:
/// frozen 38.4 ms streamed and 40.5 ms plain, the dump 68.9 against 52.5 ms).
const STREAM_MIN_BYTES: u64 = 64 << 20;

/// Keeps checkpoint `dumped` in `out`: copied there when it was dumped elsewhere (the
/// copy stays), and flushed to disk with `durable`.
pub fn persist(
    dumped: &Dumped,
    out: &Path,
    durable: bool,
) -> Result<CheckpointReport, CheckpointError> {
    let id = &dumped.meta.source_id;
    let io_err = |what: &'static str| {
        move |source| CheckpointError::Io {
            id: id.clone(),
            what,
            path: out.to_path_buf(),
            source,
        }
    };
    let clock = Instant::now();
    if dumped.dir != out {
        fs::create_dir_all(out).map_err(io_err("create"))?;
        copy_tree(id, &dumped.dir, out)?;
    }
    if durable {
        sync_filesystem(out).map_err(io_err("flush"))?;
    }
    Ok(CheckpointReport {
        dumped: dumped.clone(),
        persist: clock.elapsed(),
        bytes: tree_bytes(out),
    })
}

/// Whether `checkpoint` holds a complete checkpoint (its metadata, and images of a dump that
/// succeeded), after waiting up to `wait` for a dump into it that may still run (one that
/// outlived a crash of the process that started it).
pub fn is_complete(checkpoint: &Path, wait: Duration) -> bool {
    let images = images_dir(checkpoint);
    crate::criu::wait_for_criu(&images, wait)
        && crate::criu::dump_succeeded(&images)
        && read_meta(checkpoint).is_ok()
        && upper_dir(checkpoint).is_dir()
}

/// Waits (at most `wait`) for a restore into sandbox directory `dir` that may still run
/// (one that outlived a crash of the process that started it). True when none runs.
pub fn wait_for_restore(dir: &Path, wait: Duration) -> bool {
    crate::criu::wait_for_criu(&dir.join(RESTORE_WORK_DIR), wait)
}

/// Reads `checkpoint.json` of a checkpoint directory.
pub fn read_meta(checkpoint: &Path) -> Result<CheckpointMeta, CheckpointError> {
    fs::read(checkpoint.join("checkpoint.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| CheckpointError::BadMetadata(checkpoint.to_path_buf()))
}

/// Flushes the filesystem holding `path` to disk.
fn sync_filesystem(path: &Path) -> io::Result<()> {
    let dir = fs::File::open(path)?;
    // SAFETY: syncfs on a descriptor this function owns.
    if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&dir)) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes of the regular files under `dir` (device nodes are never opened).
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

/// Where and how a checkpoint is restored.
#[derive(Debug, Clone)]
pub struct RestoreTarget<'a> {
    pub id: &'a str,
    pub prefix: &'a str,
    /// The image rootfs the checkpoint was taken over.
    pub lower: &'a Path,
    /// The new sandbox's directory.
    pub dir: &'a Path,
    pub netns: &'a Path,
    pub limits: &'a CgroupLimits,
    pub disk_bytes: u64,
    /// The execd store (`ExecdBinary::lookup`).
    pub execd_store: &'a Path,
    /// Close established TCP connections (a clone) instead of restoring them.
    pub tcp_close: bool,
    /// `dir` already holds a mounted writable layer of `disk_bytes`
    /// ([`Rootfs::create_layer`], a spare made ahead of demand): only the overlay is mounted.
    pub layer_ready: bool,
    /// The sources of the checkpoint's volumes ([`RestoreRequest::external_mounts`]).
    pub external_mounts: &'a [(String, PathBuf)],
}

/// How long the parts of one restore took.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreTimings {
    /// Writable layer and overlay mounted.
    pub rootfs: Duration,
    /// Cgroup created with its limits.
    pub cgroup: Duration,
    /// The `criu restore` run, from spawn to exit.
    pub criu: Duration,
    /// CRIU's own account of it (`stats-restore`): forking and restoring the tree; the
    /// rest of `criu` is CRIU starting, reading images and setting up namespaces.
    pub criu_stats: Option<crate::criu_stats::RestoreStats>,
}

/// A cgroup and a CRIU launcher made ahead of a restore (for a spare slot): the cgroup
/// under another name, the launcher already in it.
#[derive(Debug)]
pub struct PreparedRestore {
    pub cgroup: Cgroup,
    pub launcher: crate::criu::RestoreLauncher,
}

/// Restore the checkpoint at `checkpoint` as a new sandbox. With `prepared`, its cgroup is
/// renamed to the sandbox's and CRIU starts in its launcher; where that cannot be done (a
/// cgroup v2 host refuses renames; a launcher that died), the restore makes its own.
pub fn restore(
    criu: &Criu,
    cgroups: &CgroupRoot,
    checkpoint: &Path,
    target: &RestoreTarget<'_>,
    prepared: Option<PreparedRestore>,
) -> Result<(SandboxHandle, RestoreTimings), CheckpointError> {
    restore_with(criu, cgroups, checkpoint, target, prepared, None)
        .map(|restored| (restored.handle, restored.timings))
}

/// A sandbox restored by [`restore_lazy`]: it runs, its memory arrives in the background.
#[derive(Debug)]
pub struct LazyRestored {
    pub handle: SandboxHandle,
    pub timings: RestoreTimings,
    /// Before `criu restore`: the pages images made, the blocks the restore reads itself
    /// fetched, the background fetch and the `criu lazy-pages` daemon started.
    pub prepare: Duration,
    /// What had been fetched from the block source when `criu restore` started.
    pub fetched_before_restore: Fetched,
    /// The rest of the memory. Anything that dumps the sandbox (pause, snapshot, fork) must
    /// wait for it; when it fails, its watcher has killed the sandbox (every process of its
    /// cgroup), whose memory was no longer whole.
    pub transfer: LazyTransfer,
}

/// [`restore`] of a checkpoint whose pages images are not local: `pages` fetches them while
/// the sandbox already runs (`criu restore --lazy-pages`, see [`crate::lazy`] for the steps
/// and the contract on the images directory). Everything else of the checkpoint must be in
/// `checkpoint`.
pub fn restore_lazy(
    criu: &Criu,
    cgroups: &CgroupRoot,
    checkpoint: &Path,
    target: &RestoreTarget<'_>,
    prepared: Option<PreparedRestore>,
    pages: &LazyPages,
) -> Result<LazyRestored, CheckpointError> {
    let restored = restore_with(criu, cgroups, checkpoint, target, prepared, Some(pages))?;
    match restored.lazy {
        Some(lazy) => Ok(LazyRestored {
            handle: restored.handle,
            timings: restored.timings,
            prepare: lazy.prepare,
            fetched_before_restore: lazy.fetched_before_restore,
            transfer: lazy.transfer,
        }),
        // Not reached: `restore_with` watches every lazy restore it makes.
        None => Err(CheckpointError::Lazy {
            id: target.id.to_string(),
            source: LazyError::WatcherPanicked,
        }),
    }
}

/// What [`restore_with`] made.
struct Restored {
    handle: SandboxHandle,
    timings: RestoreTimings,
    lazy: Option<LazyParts>,
}

/// The lazy part of a restore (see [`LazyRestored`]).
struct LazyParts {
    prepare: Duration,
    fetched_before_restore: Fetched,
    transfer: LazyTransfer,
}

/// [`restore`], and with `lazy`, [`restore_lazy`]: the lazy session starts right before
/// `criu restore` and is watched once it succeeded.
fn restore_with(
    criu: &Criu,
    cgroups: &CgroupRoot,
    checkpoint: &Path,
    target: &RestoreTarget<'_>,
    prepared: Option<PreparedRestore>,
    lazy: Option<&LazyPages>,
) -> Result<Restored, CheckpointError> {
    let id = target.id.to_string();
    let meta = read_meta(checkpoint)?;
    let execd = ExecdBinary::lookup(target.execd_store, &meta.execd_digest).ok_or_else(|| {
        CheckpointError::MissingExecd {
            digest: meta.execd_digest.clone(),
        }
    })?;
    // CRIU only reads the images; its log and pidfile go to a private work directory, so one
    // checkpoint is restored many times, concurrently, without copies.
    let images = images_dir(checkpoint);
    let work_dir = target.dir.join(RESTORE_WORK_DIR);
    let mut timings = RestoreTimings::default();
    let clock = Instant::now();
    let seed = upper_dir(checkpoint);
    let rootfs = if target.layer_ready {
        Rootfs::mount_over(target.dir, target.lower, Some(&seed))
    } else {
        Rootfs::create(target.dir, target.lower, target.disk_bytes, Some(&seed))
    }
    .map_err(|source| {
        // Whatever part was made (a spare's layer included) goes with the failed restore.
        let _ = Rootfs::at(target.dir).destroy();
        let _ = fs::remove_dir_all(target.dir);
        CheckpointError::Rootfs {
            id: id.clone(),
            source,
        }
    })?;
    timings.rootfs = clock.elapsed();
    let result = fs::create_dir_all(&work_dir)
        .map_err(|source| CheckpointError::Io {
            id: id.clone(),
            what: "create",
            path: work_dir.clone(),
            source,
        })
        .and_then(|()| {
            let clock = Instant::now();
            let cgroup_err = |source| CheckpointError::Cgroup {
                id: id.clone(),
                source,
            };
            let (cgroup, launcher) = match adopt_prepared(prepared, target) {
                Some((cgroup, launcher)) => (cgroup, Some(launcher)),
                None => (
                    Cgroup::create(cgroups, target.prefix, target.id, target.limits)
                        .map_err(cgroup_err)?,
                    None,
                ),
            };
            timings.cgroup = clock.elapsed();
            let session = match lazy {
                None => None,
                Some(pages) => {
                    let clock = Instant::now();
                    let log = target.dir.join(LAZY_PAGES_LOG);
                    let freeze = cgroup.freeze_control(true).ok();
                    let guard = freeze
                        .as_ref()
                        .map(|(file, value)| (file.as_path(), *value));
                    match LazySession::start(criu, &images, &work_dir, &log, pages, guard) {
                        Ok(session) => Some((session, clock.elapsed())),
                        Err(source) => {
                            drop(launcher);
                            let _ = cgroup.kill_all();
                            let _ = cgroup.remove();
                            return Err(CheckpointError::Lazy {
                                id: id.clone(),
                                source,
                            });
                        }
                    }
                }
            };
            let clock = Instant::now();
            let restored = criu
                .restore(
                    &RestoreRequest {
                        images: &images,
                        work_dir: &work_dir,
                        root: &rootfs.root,
                        netns: target.netns,
                        execd_host: &execd.path,
                        cgroup_procs: cgroup.procs_files(),
                        tcp_close: target.tcp_close,
                        lazy_pages: session.is_some(),
                        deadline: session.as_ref().map(|(s, _)| s.restore_deadline()),
                        external_mounts: target.external_mounts,
                    },
                    launcher,
                )
                .map_err(|source| {
                    let _ = cgroup.kill_all();
                    let _ = cgroup.remove();
                    CheckpointError::Criu {
                        id: id.clone(),
                        source,
                    }
                });
            timings.criu = clock.elapsed();
            let init_pid = restored?;
            // Restored: from now on a failed transfer kills the sandbox.
            let lazy = session.map(|(session, prepare)| {
                let fetched_before_restore = session.fetched_before_restore();
                let victim = cgroup.clone();
                LazyParts {
                    prepare,
                    fetched_before_restore,
                    transfer: session.watch(move || {
                        let _ = victim.kill_all();
                    }),
                }
            });
            Ok((init_pid, lazy))
        });
    match result {
        Ok((init_pid, lazy)) => {
            timings.criu_stats = crate::criu_stats::read_restore_stats(&work_dir).ok();
            let _ = fs::remove_dir_all(&work_dir);
            let handle = SandboxHandle {
                id,
                prefix: target.prefix.to_string(),
                init_pid,
                init_start_ticks: process_start_ticks(init_pid).unwrap_or_default(),
                dir: target.dir.to_path_buf(),
                execd_digest: meta.execd_digest,
                netns: target.netns.to_path_buf(),
            };
            Ok(Restored {
                handle,
                timings,
                lazy,
            })
        }
        Err(e) => {
            let _ = rootfs.destroy();
            let _ = fs::remove_dir_all(target.dir);
            Err(e)
        }
    }
}

/// The prepared cgroup renamed to the sandbox's, with its limits, and its waiting launcher;
/// `None` (everything prepared removed) when that fails.
fn adopt_prepared(
    prepared: Option<PreparedRestore>,
    target: &RestoreTarget<'_>,
) -> Option<(Cgroup, crate::criu::RestoreLauncher)> {
    let PreparedRestore {
        cgroup,
        mut launcher,
    } = prepared?;
    if !launcher.is_waiting() {
        let _ = cgroup.kill_all().and_then(|()| cgroup.remove());
        return None;
    }
    let spare = cgroup.clone();
    let renamed = match cgroup.rename(target.id) {
        Ok(renamed) => renamed,
        Err(e) => {
            tracing::debug!(sandbox = %target.id, error = %e, "prepared cgroup not renamed");
            drop(launcher);
            let _ = spare.kill_all().and_then(|()| spare.remove());
            return None;
        }
    };
    match renamed.set_limits(target.limits) {
        Ok(()) => Some((renamed, launcher)),
        Err(e) => {
            tracing::debug!(sandbox = %target.id, error = %e, "prepared cgroup without limits");
            drop(launcher);
            let _ = renamed.kill_all().and_then(|()| renamed.remove());
            None
        }
    }
}

/// Copies the contents of `from` into `to` as `cp -a` does (ownership, modes, xattrs, device
/// nodes and overlay whiteouts kept; see [`crate::tree_copy`]).
fn copy_tree(id: &str, from: &Path, to: &Path) -> Result<(), CheckpointError> {
    crate::tree_copy::copy_contents(from, to).map_err(|source| CheckpointError::Io {
        id: id.to_string(),
        what: "copy",
        path: from.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};

    use super::nested_user_namespace;

    /// A tree with a process in a user namespace of its own (as an isolated session's) is
    /// found; the same tree without one is not. Needs unprivileged user namespaces.
    #[test]
    fn a_nested_user_namespace_is_found() {
        let me = std::process::id() as i32;
        let mut plain = Command::new("sleep").arg("30").spawn().unwrap();
        assert_eq!(nested_user_namespace(me), None);
        assert!(
            nested_user_namespace(i32::MAX).is_some(),
            "an unreadable tree is refused"
        );
        let nested = Command::new("unshare")
            .args(["--user", "sleep", "30"])
            .stderr(Stdio::piped())
            .spawn();
        let Ok(mut nested) = nested else {
            plain.kill().unwrap();
            let _ = plain.wait();
            eprintln!("skipped: no unshare(1)");
            return;
        };
        let found = (0..100).find_map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            nested_user_namespace(me)
        });
        let _ = nested.kill();
        let _ = plain.kill();
        let status = nested.wait().unwrap();
        let _ = plain.wait();
        if found.is_none() && status.code() == Some(1) {
            eprintln!("skipped: user namespaces are not available here");
            return;
        }
        let found = found.unwrap();
        assert!(
            found.contains(&format!("process {} ", nested.id())),
            "{found}"
        );
    }
}
