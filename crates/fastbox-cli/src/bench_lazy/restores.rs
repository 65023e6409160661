//! One timed restore of the published checkpoint, either way:
//!
//! - [`Mode::Full`]: pull every file of the artifact, then `checkpoint::restore` (the
//!   restore every fastbox start makes);
//! - [`Mode::Lazy`]: pull every file but the pages images, then `checkpoint::restore_lazy`
//!   with the pages images fed from the same block source.
//!
//! The clock starts when the restore is requested, with nothing of the checkpoint on the
//! node but a spare slot made ahead, as `fastbox up` keeps them (network slot, empty
//! writable layer, cgroup with a CRIU launcher waiting in it), and stops when the holder answers,
//! when its checksum over all of its memory has been checked against the one taken before
//! the checkpoint, and when every block is local (the end of the pull, or of the lazy
//! transfer). The sandbox is removed afterwards, on failure too.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use fastbox_artifact::{BLOCK_SIZE, Manifest};
use fastbox_fastlet::execd_client::ExecdClient;
use fastbox_fastlet::host::{LocalHost, LocalSandbox, Spare};
use fastbox_fastlet::phases::Phases;
use fastbox_runtime::checkpoint::{PreparedRestore, RestoreTarget, restore, restore_lazy};
use fastbox_runtime::criu::Criu;
use fastbox_runtime::lazy::blocks::BlockSource;
use fastbox_runtime::lazy::restore::{Fetched, LazyPages, RemoteFile, TransferReport};
use fastbox_runtime::net::NetSlot;
use fastbox_runtime::sandbox::SandboxHandle;
use fastbox_runtime::spec::{DEFAULT_DISK_BYTES, EXECD_PORT};

use super::holder;
use super::pull::pull;
use super::source::{StoreBlocks, since};

/// The slot every timed restore goes into (one at a time; the source sandbox used 0).
const SLOT: u32 = 1;
/// The longest a `criu restore --lazy-pages` may run.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest a lazy transfer may take.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(900);
/// The longest the holder may take to answer, and to compute its checksum, after a restore.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// How a restore gets the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Full,
    Lazy,
}

impl Mode {
    fn letter(self) -> char {
        match self {
            Mode::Full => 'f',
            Mode::Lazy => 'l',
        }
    }
}

/// What every restore shares.
pub struct Plan<'a> {
    pub host: &'a LocalHost,
    pub criu: &'a Criu,
    pub manifest: &'a Manifest,
    pub source: &'a Arc<StoreBlocks>,
    /// The rootfs with the holder (the overlay's lower layer).
    pub rootfs: &'a Path,
    /// Where the execd of the checkpoint is (`ExecdBinary::import`).
    pub execd_store: &'a Path,
    /// The run's directory: each restore pulls into a directory of its own below it.
    pub dir: &'a Path,
    pub fetch_workers: usize,
    /// The holder's checksum before the checkpoint.
    pub reference: u64,
}

/// One timed restore.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub mode: Mode,
    /// Restore requested -> the holder answers.
    #[serde(rename = "answer_ms", serialize_with = "super::report::as_ms")]
    pub answer: Duration,
    /// Restore requested -> the holder's full-memory checksum received and checked.
    #[serde(rename = "checksum_ms", serialize_with = "super::report::as_ms")]
    pub checksum: Duration,
    /// Restore requested -> every block local (the pull's end; the lazy transfer's end).
    #[serde(rename = "all_local_ms", serialize_with = "super::report::as_ms")]
    pub all_local: Duration,
    /// The runtime's restore call (writable layer, cgroup, lazy preparation, `criu restore`).
    #[serde(rename = "restore_call_ms", serialize_with = "super::report::as_ms")]
    pub restore_call: Duration,
    /// The `criu restore` process.
    #[serde(rename = "criu_ms", serialize_with = "super::report::as_ms")]
    pub criu: Duration,
    /// Of the restore call, a lazy restore's preparation: its pages images made, the blocks
    /// the restore reads itself fetched, the daemon started.
    #[serde(
        rename = "lazy_prepare_ms",
        serialize_with = "super::report::as_ms_opt"
    )]
    pub lazy_prepare: Option<Duration>,
    /// Fetched before `criu restore` started.
    pub before_restore: Fetched,
    /// Fetched in all.
    pub fetched: Fetched,
    /// Whether both checksums the holder gave equal the one taken before the checkpoint.
    pub checksum_ok: bool,
    /// The lazy transfer's page server: pages sent to the daemon, and answers shorter than
    /// asked (their blocks were not local yet).
    pub pages_served: Option<u64>,
    pub short_answers: Option<u64>,
}

/// Restores the checkpoint once in `mode` (restore number `i`) and removes the sandbox.
pub fn restore_once(plan: &Plan<'_>, mode: Mode, i: usize) -> anyhow::Result<Sample> {
    let host = plan.host;
    let id = format!("{}-{}{i}", host.prefix, mode.letter());
    let mut spare = host.make_spare(SLOT, plan.criu)?;
    let sandbox_dir = fastbox_fastlet::agent::sandbox_dir(&host.data_dir, &id);
    if let Err(e) = std::fs::rename(&spare.dir, &sandbox_dir) {
        let _ = host.destroy_spare(&mut spare);
        return Err(anyhow::Error::from(e).context("move the spare's writable layer"));
    }
    let tree = plan.dir.join(format!("{}{i}", mode.letter()));
    // The pulled tree goes last: a lazy transfer reads from it until it ends.
    let sample = restore_and_measure(plan, mode, spare, &tree, &id);
    let _ = std::fs::remove_dir_all(&tree);
    sample.with_context(|| format!("{mode:?} restore {i}"))
}

/// [`restore_into`] the spare (its layer already in the sandbox's directory), then
/// [`measure`]; the sandbox is removed afterwards.
fn restore_and_measure(
    plan: &Plan<'_>,
    mode: Mode,
    spare: Spare,
    tree: &Path,
    id: &str,
) -> anyhow::Result<Sample> {
    let host = plan.host;
    let Spare { slot, prepared, .. } = spare;
    let execd = ExecdClient::new(format!("http://{}:{EXECD_PORT}", slot.address), None);
    let restored = execd
        .map_err(anyhow::Error::from)
        .and_then(|execd| Ok((execd, restore_into(plan, mode, &slot, prepared, tree, id)?)));
    let (execd, restored) = match restored {
        Ok(restored) => restored,
        Err(e) => {
            let _ = host.release_network(&slot);
            return Err(e);
        }
    };
    let sandbox = LocalSandbox {
        handle: restored.handle.clone(),
        execd,
        slot,
        phases: Phases::default(),
        transfer: None,
    };
    let measured = measure(plan, &sandbox, restored);
    let destroyed = host.destroy(&sandbox);
    let sample = measured?;
    destroyed.with_context(|| format!("remove {id}"))?;
    Ok(sample)
}

/// A sandbox restored and what it took so far.
struct Restored {
    mode: Mode,
    handle: SandboxHandle,
    start: Instant,
    restore_call: Duration,
    criu: Duration,
    lazy_prepare: Option<Duration>,
    pulled_at: Duration,
    before_restore: Fetched,
    fetched_before: Fetched,
    transfer: Option<fastbox_runtime::lazy::restore::LazyTransfer>,
}

/// The timed part up to the restore's return: the pull, then the runtime's restore.
fn restore_into(
    plan: &Plan<'_>,
    mode: Mode,
    slot: &NetSlot,
    prepared: Option<PreparedRestore>,
    tree: &Path,
    id: &str,
) -> anyhow::Result<Restored> {
    let source: Arc<dyn BlockSource> = plan.source.clone();
    let fetched_before = plan.source.fetched();
    let sandbox_dir = fastbox_fastlet::agent::sandbox_dir(&plan.host.data_dir, id);
    let checkpoint = tree.join("checkpoint");
    let start = Instant::now();
    let pulled = pull(plan.manifest, tree, &source, plan.fetch_workers, |path| {
        mode == Mode::Lazy && is_pages_image(path)
    })
    .and_then(|left_out| unpack_upper(&checkpoint).map(|()| left_out));
    let left_out = match pulled {
        Ok(left_out) => left_out,
        Err(e) => {
            discard_spare(prepared, &sandbox_dir);
            return Err(e);
        }
    };
    let pulled_at = start.elapsed();
    let pulled = since(plan.source.fetched(), fetched_before);
    let limits = Default::default();
    let target = RestoreTarget {
        id,
        prefix: &plan.host.prefix,
        lower: plan.rootfs,
        dir: &sandbox_dir,
        netns: &slot.netns_path,
        limits: &limits,
        disk_bytes: DEFAULT_DISK_BYTES,
        execd_store: plan.execd_store,
        tcp_close: true,
        layer_ready: true,
        external_mounts: &[],
    };
    let cgroups = &plan.host.cgroups;
    let call = Instant::now();
    let restored = match mode {
        Mode::Full => {
            let (handle, timings) = restore(plan.criu, cgroups, &checkpoint, &target, prepared)?;
            Restored {
                mode,
                handle,
                start,
                restore_call: call.elapsed(),
                criu: timings.criu,
                lazy_prepare: None,
                pulled_at,
                before_restore: pulled,
                fetched_before,
                transfer: None,
            }
        }
        Mode::Lazy => {
            let pages = LazyPages {
                source,
                block_size: BLOCK_SIZE as u64,
                files: pages_images(left_out)?,
                complete: Vec::new(),
                fetch_workers: plan.fetch_workers,
                restore_timeout: RESTORE_TIMEOUT,
                transfer_timeout: Some(TRANSFER_TIMEOUT),
            };
            let lazy = restore_lazy(plan.criu, cgroups, &checkpoint, &target, prepared, &pages)?;
            Restored {
                mode,
                handle: lazy.handle,
                start,
                restore_call: call.elapsed(),
                criu: lazy.timings.criu,
                lazy_prepare: Some(lazy.prepare),
                pulled_at,
                before_restore: Fetched {
                    blocks: pulled.blocks + lazy.fetched_before_restore.blocks,
                    bytes: pulled.bytes + lazy.fetched_before_restore.bytes,
                },
                fetched_before,
                transfer: Some(lazy.transfer),
            }
        }
    };
    Ok(restored)
}

/// The timed part after the restore: the holder answers, its checksum, the transfer's end.
fn measure(plan: &Plan<'_>, sandbox: &LocalSandbox, restored: Restored) -> anyhow::Result<Sample> {
    let addr = SocketAddr::from((sandbox.slot.address, holder::PORT));
    let start = restored.start;
    let waited = holder::wait_answer(addr, Instant::now() + ANSWER_TIMEOUT);
    let answer = start.elapsed();
    let sums = waited.and_then(|()| holder::checksums(addr, ANSWER_TIMEOUT));
    let checksum = start.elapsed();
    // The transfer is waited for even when the holder failed: it must not outlive the sample.
    let transfer: Option<anyhow::Result<TransferReport>> = restored
        .transfer
        .map(|t| t.wait().context("the lazy transfer"));
    let all_local = match &transfer {
        Some(Ok(report)) => report.finished.saturating_duration_since(start),
        Some(Err(_)) => start.elapsed(),
        None => restored.pulled_at,
    };
    let (now, at_start) = sums?;
    let report = transfer.transpose()?;
    let fetched = since(plan.source.fetched(), restored.fetched_before);
    ensure!(
        report.is_some() == (restored.mode == Mode::Lazy),
        "a lazy restore without a transfer"
    );
    Ok(Sample {
        mode: restored.mode,
        answer,
        checksum,
        all_local,
        restore_call: restored.restore_call,
        criu: restored.criu,
        lazy_prepare: restored.lazy_prepare,
        before_restore: restored.before_restore,
        fetched,
        checksum_ok: now == plan.reference && at_start == plan.reference,
        pages_served: report.as_ref().map(|r| r.served.pages),
        short_answers: report.as_ref().map(|r| r.served.short_answers),
    })
}

/// Whether an artifact path is a CRIU pages image (`checkpoint/criu/pages-N.img`).
pub fn is_pages_image(path: &str) -> bool {
    path.strip_prefix("checkpoint/criu/")
        .is_some_and(|name| name.starts_with("pages-") && name.ends_with(".img"))
}

/// The pages images left out of a pull, by file name in the images directory.
fn pages_images(
    left_out: std::collections::BTreeMap<String, RemoteFile>,
) -> anyhow::Result<std::collections::BTreeMap<String, RemoteFile>> {
    left_out
        .into_iter()
        .map(|(path, file)| {
            let name = path
                .rsplit('/')
                .next()
                .filter(|_| is_pages_image(&path))
                .with_context(|| format!("{path} is not a pages image"))?;
            Ok((name.to_string(), file))
        })
        .collect()
}

/// What is left of a spare that no restore took: its launcher and cgroup, its writable layer
/// (already moved to `dir`).
fn discard_spare(prepared: Option<PreparedRestore>, dir: &Path) {
    if let Some(PreparedRestore { cgroup, launcher }) = prepared {
        drop(launcher);
        let _ = cgroup.kill_all().and_then(|()| cgroup.remove());
    }
    let _ = fastbox_runtime::rootfs::Rootfs::at(dir).destroy();
    let _ = std::fs::remove_dir_all(dir);
}

/// The published writable layer (`upper.tar`) unpacked to `upper`, as a node does.
fn unpack_upper(checkpoint: &Path) -> anyhow::Result<()> {
    let tar: PathBuf = checkpoint.join("upper.tar");
    fastbox_fastlet::artifact::unpack_canonical_tar(&tar, &checkpoint.join("upper"))?;
    std::fs::remove_file(&tar).with_context(|| format!("remove {}", tar.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_checkpoint_s_pages_images_are_lazy() {
        assert!(is_pages_image("checkpoint/criu/pages-1.img"));
        assert!(is_pages_image("checkpoint/criu/pages-12.img"));
        assert!(!is_pages_image("checkpoint/criu/pagemap-1.img"));
        assert!(!is_pages_image("checkpoint/upper.tar"));
        assert!(!is_pages_image("other/criu/pages-1.img"));
        let file = RemoteFile {
            size: 1,
            blocks: vec!["a".into()],
        };
        let named =
            pages_images([("checkpoint/criu/pages-3.img".to_string(), file.clone())].into())
                .unwrap();
        assert_eq!(named.keys().collect::<Vec<_>>(), ["pages-3.img"]);
        assert!(pages_images([("checkpoint/upper.tar".to_string(), file)].into()).is_err());
    }
}
