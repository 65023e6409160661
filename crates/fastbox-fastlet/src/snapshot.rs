//! Snapshots, pause and resume on this node (DESIGN §4).
//!
//! A snapshot of a sandbox is a checkpoint directory like a golden template's, kept under
//! `DATA_DIR/snapshots/<key>/` and committed by its `template.json` (written last), whose
//! golden token is the sandbox's execd token at the time. Three operations make one:
//!
//! - a **live snapshot** freezes the sandbox only for the dump: CRIU writes the images and the
//!   writable layer is copied into the memory-backed staging area ([`crate::staging`]) while
//!   the tree is frozen ([`Fastlet::stage_snapshot`]); then the tree runs on, and the staged
//!   files are copied to disk, committed and published ([`Fastlet::commit_snapshot`]). A
//!   fork's clones restore from the staged files in between ([`StagedSnapshot::template`]);
//! - a **pause** dumps the sandbox (which ends it) straight to disk, flushes it, and then
//!   releases everything the sandbox held except its slot index, i.e. its address;
//! - a **resume** restores the pause's checkpoint into that slot again, with the sandbox's own
//!   id, token and established connections.
//!
//! Clones of a snapshot ([`Fastlet::clone_snapshot`]) are restores into new slots that get a
//! new hostname, identity files and execd token; their processes run on as they were.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use fastbox_artifact::{ArtifactKind, IndexKey};
use fastbox_runtime::checkpoint::{self, CheckpointOptions, CheckpointReport};
use fastbox_runtime::criu_stats::DumpStats;
use fastbox_runtime::sandbox;

use crate::agent::{Fastlet, FastletError, PlaceRequest, Placement, StartMode, StartReport};
use crate::host::HostError;
use crate::template::{self, Template};
use crate::transfers::Transfers;

/// Where node snapshot `key` lives.
pub fn snapshot_dir(data_dir: &Path, key: &str) -> PathBuf {
    data_dir.join("snapshots").join(key)
}

/// What taking a snapshot cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotReport {
    /// How long the sandbox's processes were stopped (CRIU's `frozen_time`), when known.
    pub frozen_ms: Option<f64>,
    /// The `criu dump` run.
    pub dump_ms: f64,
    /// Moving the staged files to disk and flushing them.
    pub persist_ms: f64,
    /// The whole operation, until committed.
    pub total_ms: f64,
    /// Publishing it into the artifact store (part of `total_ms`).
    pub publish_ms: f64,
    /// Its manifest in the artifact store (blake3, hex).
    pub manifest: Option<String>,
    /// Size of the checkpoint (memory images and writable layer).
    pub bytes: u64,
    /// CRIU's `stats-dump`.
    pub stats: Option<DumpStats>,
    /// Whether the images were streamed into memory ([`Fastlet::stage_snapshot`]).
    pub streamed: bool,
}

impl SnapshotReport {
    fn of(report: &CheckpointReport, total_ms: f64) -> Self {
        Self {
            frozen_ms: report
                .dumped
                .stats
                .map(|s| s.frozen_time_us as f64 / 1000.0),
            dump_ms: report.dumped.dump.as_secs_f64() * 1000.0,
            persist_ms: report.persist.as_secs_f64() * 1000.0,
            total_ms,
            publish_ms: 0.0,
            manifest: None,
            bytes: report.bytes,
            stats: report.dumped.stats,
            streamed: report.dumped.streamed,
        }
    }

    /// `frozen 84.1 ms, dump 97.0 ms, persist 120.3 ms, publish 80.2 ms, total 310.0 ms,
    /// 262.4 MiB` and `, streamed` for a streamed dump (the benchmark parses it).
    pub fn summary(&self) -> String {
        let frozen = self
            .frozen_ms
            .map(|f| format!("frozen {f:.1} ms, "))
            .unwrap_or_default();
        format!(
            "{frozen}dump {:.1} ms, persist {:.1} ms, publish {:.1} ms, total {:.1} ms, {:.1} MiB{}",
            self.dump_ms,
            self.persist_ms,
            self.publish_ms,
            self.total_ms,
            self.bytes as f64 / (1024.0 * 1024.0),
            if self.streamed { ", streamed" } else { "" }
        )
    }
}

/// What a snapshot is taken of.
#[derive(Debug, Clone)]
pub struct SnapshotSource<'a> {
    /// The node snapshot's key (a snapshot id, or a pause checkpoint's name).
    pub key: &'a str,
    pub placement: &'a Placement,
    /// The sandbox's execd token (the clones' claim authenticates with it).
    pub execd_token: &'a str,
    /// The image reference the sandbox came from (for logs and the manifest).
    pub image_reference: &'a str,
    /// The sandbox's volumes, dumped as external mounts by a pause.
    pub volumes: &'a [fastbox_node_api::wire::VolumeMount],
}

/// How long recovery waits for a dump that outlived a crash.
const DUMP_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The snapshot `source` took, as a template whose checkpoint is in `checkpoint`.
fn template_of(
    source: &SnapshotSource<'_>,
    key: &str,
    checkpoint: PathBuf,
    meta: &checkpoint::CheckpointMeta,
    build_ms: u64,
) -> Result<Template, FastletError> {
    let rootfs = meta.lower.clone().ok_or_else(|| FastletError::Snapshot {
        key: source.key.to_string(),
        message: "the sandbox's image rootfs is not known".into(),
    })?;
    Ok(Template {
        key: key.to_string(),
        image_digest: String::new(),
        image_reference: source.image_reference.to_string(),
        rootfs,
        checkpoint,
        golden_token: source.execd_token.to_string(),
        build_ms,
    })
}

/// Commits the snapshot in `dir` (its `template.json`, written last).
fn commit(
    source: &SnapshotSource<'_>,
    dir: &Path,
    meta: &checkpoint::CheckpointMeta,
    build_ms: u64,
) -> Result<Template, FastletError> {
    let t = template_of(source, source.key, dir.join("checkpoint"), meta, build_ms)?;
    template::commit(dir, &t).map_err(|e| FastletError::Snapshot {
        key: source.key.to_string(),
        message: format!("commit: {e}"),
    })?;
    Ok(t)
}

/// The key under which the clones restored from a staged snapshot read it
/// ([`StagedSnapshot::template`]).
fn staged_key(key: &str) -> String {
    format!("{key}.staged")
}

/// A live snapshot dumped into the staging area and not yet on disk
/// ([`Fastlet::stage_snapshot`]). Clones restored from [`StagedSnapshot::template`] start
/// at once; [`Fastlet::commit_snapshot`] then keeps it. Dropping it removes the staged files
/// once no clone copies its memory in from them any more.
pub struct StagedSnapshot {
    template: Template,
    key: String,
    execd_token: String,
    dumped: checkpoint::Dumped,
    clock: std::time::Instant,
    transfers: Arc<Transfers>,
}

impl StagedSnapshot {
    /// The staged checkpoint, restorable as it is.
    pub fn template(&self) -> &Template {
        &self.template
    }

    /// The source as [`Fastlet::commit_snapshot`] names it (the placement is not needed).
    fn source<'a>(&'a self, placement: &'a Placement) -> SnapshotSource<'a> {
        SnapshotSource {
            key: &self.key,
            placement,
            execd_token: &self.execd_token,
            image_reference: &self.template.image_reference,
            volumes: &[],
        }
    }
}

impl std::fmt::Debug for StagedSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedSnapshot")
            .field("key", &self.key)
            .field("dir", &self.dumped.dir)
            .finish_non_exhaustive()
    }
}

impl Drop for StagedSnapshot {
    fn drop(&mut self) {
        let (dir, source) = (self.dumped.dir.clone(), self.template.key.clone());
        if !self.transfers.reads(&source) {
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        let transfers = Arc::clone(&self.transfers);
        let spawned = std::thread::Builder::new()
            .name("fastbox-staged".into())
            .spawn(move || {
                transfers.wait_for_source(&source);
                let _ = std::fs::remove_dir_all(&dir);
            });
        if let Err(e) = spawned {
            // Left to the next start's purge of the staging area.
            tracing::warn!(dir = %self.dumped.dir.display(), error = %e, "staged snapshot not removed");
        }
    }
}

impl Fastlet {
    /// A live snapshot of a running sandbox: [`Fastlet::stage_snapshot`], then
    /// [`Fastlet::commit_snapshot`].
    pub fn snapshot(
        &self,
        source: &SnapshotSource<'_>,
    ) -> Result<(Template, SnapshotReport), FastletError> {
        let staged = self.stage_snapshot(source, true)?;
        self.commit_snapshot(staged, source.placement)
    }

    /// The first half of a live snapshot: the sandbox is frozen only while CRIU dumps its
    /// memory and its writable layer is copied, both into the memory-backed staging area;
    /// then it runs on. The staged checkpoint can be restored at once (a fork's clones do).
    ///
    /// With `short_freeze`, CRIU streams the images into memory touched ahead, and they are
    /// written out once the sandbox runs again ([`fastbox_runtime::image_stream`]): the
    /// freeze is about a third shorter, the whole dump longer (touching the memory, then
    /// writing the files), so a fork, which waits for the whole dump, does without.
    pub fn stage_snapshot(
        &self,
        source: &SnapshotSource<'_>,
        short_freeze: bool,
    ) -> Result<StagedSnapshot, FastletError> {
        let clock = std::time::Instant::now();
        let fail = |message: String| FastletError::Snapshot {
            key: source.key.to_string(),
            message,
        };
        self.wait_for_memory(source)?;
        let _ = std::fs::remove_dir_all(snapshot_dir(&self.config().data_dir, source.key));
        let staging = self.staging.dir(source.key);
        let dumped = checkpoint::dump_into(
            &self.config().criu,
            &source.placement.handle,
            &staging,
            checkpoint::DumpOptions {
                leave_running: true,
                stream: short_freeze,
                external_mounts: &crate::volumes::dump_keys(source.volumes),
            },
        )
        .map_err(|e| {
            let _ = std::fs::remove_dir_all(&staging);
            fail(e.to_string())
        })?;
        let key = staged_key(source.key);
        let template = template_of(source, &key, staging.clone(), &dumped.meta, 0);
        let template = template.inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&staging);
        })?;
        Ok(StagedSnapshot {
            template,
            key: source.key.to_string(),
            execd_token: source.execd_token.to_string(),
            dumped,
            clock,
            transfers: Arc::clone(&self.transfers),
        })
    }

    /// The second half of a live snapshot: the staged files are copied to
    /// `DATA_DIR/snapshots/<key>`, committed and published. The staged copy goes once no
    /// clone reads it any more. `placement` is the snapshotted sandbox's (for the logs).
    pub fn commit_snapshot(
        &self,
        staged: StagedSnapshot,
        placement: &Placement,
    ) -> Result<(Template, SnapshotReport), FastletError> {
        let source = staged.source(placement);
        let dir = snapshot_dir(&self.config().data_dir, source.key);
        let persisted = checkpoint::persist(&staged.dumped, &dir.join("checkpoint"), false);
        self.keep(&source, persisted, staged.clock, ArtifactKind::Snapshot)
    }

    /// Pauses a running sandbox: its checkpoint is written to disk and flushed (the dump ends
    /// its processes), then everything it held on this node is released except its slot
    /// index, which keeps its address for the resume.
    pub fn pause(
        &self,
        id: &str,
        source: &SnapshotSource<'_>,
    ) -> Result<(Template, SnapshotReport), FastletError> {
        let external_mounts = crate::volumes::dump_keys(source.volumes);
        let taken = self.take_snapshot(
            source,
            CheckpointOptions {
                leave_running: false,
                staging: None,
                durable: true,
                external_mounts: &external_mounts,
            },
        )?;
        self.release_keeping_address(id, Some(source.placement), source.placement.slot)?;
        Ok(taken)
    }

    /// Waits until the memory of `source` (a clone or resume still copying it in) is all
    /// there: a dump before then would miss the pages not copied yet.
    fn wait_for_memory(&self, source: &SnapshotSource<'_>) -> Result<(), FastletError> {
        self.transfers
            .wait_for_sandbox(&source.placement.handle.id)
            .map_err(|e| FastletError::Snapshot {
                key: source.key.to_string(),
                message: format!("the sandbox cannot be dumped: {e}"),
            })
    }

    fn take_snapshot(
        &self,
        source: &SnapshotSource<'_>,
        opts: CheckpointOptions<'_>,
    ) -> Result<(Template, SnapshotReport), FastletError> {
        let clock = std::time::Instant::now();
        self.wait_for_memory(source)?;
        let dir = snapshot_dir(&self.config().data_dir, source.key);
        let _ = std::fs::remove_dir_all(&dir);
        let taken = checkpoint::checkpoint_with(
            &self.config().criu,
            &source.placement.handle,
            &dir.join("checkpoint"),
            opts,
        );
        let kind = if opts.leave_running {
            ArtifactKind::Snapshot
        } else {
            ArtifactKind::Checkpoint
        };
        self.keep(source, taken, clock, kind)
    }

    /// Commits and publishes the checkpoint of `source` that `taken` wrote to its node
    /// directory (removed when anything failed).
    fn keep(
        &self,
        source: &SnapshotSource<'_>,
        taken: Result<CheckpointReport, checkpoint::CheckpointError>,
        clock: std::time::Instant,
        kind: ArtifactKind,
    ) -> Result<(Template, SnapshotReport), FastletError> {
        let fail = |message: String| FastletError::Snapshot {
            key: source.key.to_string(),
            message,
        };
        let dir = snapshot_dir(&self.config().data_dir, source.key);
        let report = match taken {
            Ok(report) => report,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(fail(e.to_string()));
            }
        };
        let committed = commit(
            source,
            &dir,
            &report.dumped.meta,
            clock.elapsed().as_millis() as u64,
        )
        .and_then(|t| {
            // Published before anything relies on it: a pause's runtime is released
            // only once its checkpoint is in the artifact store.
            let published = self.publish(&t, source.key, kind).map_err(fail)?;
            Ok((t, published))
        })
        .inspect_err(|_| {
            let _ = self.remove_snapshot(source.key);
        });
        let (t, published) = committed?;
        let mut report = SnapshotReport::of(&report, clock.elapsed().as_secs_f64() * 1000.0);
        report.publish_ms = published.seconds * 1000.0;
        report.manifest = Some(published.manifest.to_hex());
        let leave_running = kind == ArtifactKind::Snapshot;
        tracing::info!(key = %source.key, sandbox = %source.placement.handle.id, leave_running, report = %report.summary(), "snapshot taken");
        Ok((t, report))
    }

    /// After a crash during a pause of `source`: waits for a dump that outlived it, and
    /// commits the checkpoint when that dump completed; removes what is there otherwise.
    pub fn finish_interrupted_pause(&self, source: &SnapshotSource<'_>) -> Option<Template> {
        let dir = snapshot_dir(&self.config().data_dir, source.key);
        let checkpoint = dir.join("checkpoint");
        let done = self
            .load_snapshot(source.key)
            .or_else(|| {
                checkpoint::is_complete(&checkpoint, DUMP_WAIT)
                    .then(|| checkpoint::read_meta(&checkpoint).ok())
                    .flatten()
                    .and_then(|meta| commit(source, &dir, &meta, 0).ok())
            })
            // Published again when the crash came first (an unchanged one stores nothing).
            .filter(|t| {
                self.publish(t, source.key, ArtifactKind::Checkpoint)
                    .is_ok()
            });
        if done.is_none() {
            let _ = self.remove_snapshot(source.key);
        }
        done
    }

    /// After a crash during a live snapshot: waits for a dump that outlived it, then removes
    /// what it left (the snapshot is taken again or failed by the caller).
    pub fn discard_interrupted_snapshot(&self, key: &str) {
        let staging = self.staging.dir(key);
        checkpoint::is_complete(&staging, DUMP_WAIT);
        let _ = self.remove_snapshot(key);
    }

    /// The names of the snapshots and pause checkpoints on this node (committed or not).
    pub fn snapshot_keys(&self) -> Vec<String> {
        std::fs::read_dir(self.config().data_dir.join("snapshots"))
            .map(|entries| {
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The committed node snapshot `key`, if this node has it.
    pub fn load_snapshot(&self, key: &str) -> Option<Template> {
        template::load(&snapshot_dir(&self.config().data_dir, key))
    }

    /// Removes node snapshot `key` (committed or not) and its index entry in the artifact
    /// store (its blocks go with the store's garbage collection), once no clone reads its
    /// memory any more. Idempotent.
    pub fn remove_snapshot(&self, key: &str) -> std::io::Result<()> {
        // Clones still copying their memory in read it from the snapshot's files.
        self.transfers.wait_for_source(key);
        self.transfers.wait_for_source(&staged_key(key));
        if self.transfers.take_failure(key) {
            // The sandbox resumed from it was killed: it resumes from here again.
            return Err(std::io::Error::other(
                "the memory transfer of the sandbox resumed from it failed: kept to resume from again",
            ));
        }
        let _ = std::fs::remove_dir_all(self.staging.dir(key));
        let dir = snapshot_dir(&self.config().data_dir, key);
        // One materialized from another node's artifact has its lower layer mounted in it.
        crate::from_artifact::unmount_rootfs(&dir);
        if let Ok(index) = IndexKey::try_new(key) {
            self.artifact_store()
                .index_delete(&index)
                .map_err(std::io::Error::other)?;
        }
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Resumes paused sandbox `req.id` from its checkpoint `snapshot` into slot `slot` (the
    /// one it kept): same address, same token, same connections.
    pub fn resume(
        &self,
        snapshot: &Template,
        req: &PlaceRequest,
        slot: u32,
    ) -> Result<(Placement, StartReport), FastletError> {
        self.restore_as(snapshot, req, slot, StartMode::Resume)
    }

    /// [`Fastlet::resume`] of a sandbox paused on another node (its checkpoint fetched
    /// here): in slot `slot` at its address, its TCP connections closed.
    pub fn resume_moved(
        &self,
        snapshot: &Template,
        req: &PlaceRequest,
        slot: u32,
    ) -> Result<(Placement, StartReport), FastletError> {
        self.restore_as(snapshot, req, slot, StartMode::Moved)
    }

    /// A new sandbox `req.id` from `snapshot`: its processes as they were, with its own
    /// hostname, identity files, address and execd token; no entrypoint is started.
    pub fn clone_snapshot(
        &self,
        snapshot: &Template,
        req: &PlaceRequest,
        slot: u32,
    ) -> Result<(Placement, StartReport), FastletError> {
        self.restore_as(snapshot, req, slot, StartMode::Clone)
    }

    /// Releases what sandbox `id` holds on this node (processes, mounts, files, cgroup,
    /// network namespace and policy), synchronously, but keeps slot index `slot` taken: a
    /// paused sandbox keeps its address. Idempotent; works on what a crash left.
    pub fn release_keeping_address(
        &self,
        id: &str,
        placement: Option<&Placement>,
        slot: u32,
    ) -> Result<(), FastletError> {
        self.forget_route(id);
        let on_host = |source: HostError| FastletError::Remove {
            id: id.to_string(),
            source: Box::new(source),
        };
        self.remove_unrecorded_claims(id, placement)
            .map_err(on_host)?;
        self.claim_slot(slot);
        self.kept_slots().keep(slot, id);
        let handle = placement
            .map(|p| p.handle.clone())
            .unwrap_or_else(|| self.unstarted_handle(id));
        // A restore that outlived a crash would put processes back after this.
        checkpoint::wait_for_restore(&handle.dir, DUMP_WAIT);
        let host = &self.host;
        let released = sandbox::stop_processes(&handle, &host.cgroups)
            .and_then(|()| sandbox::destroy(&handle, &host.cgroups))
            .map_err(HostError::from)
            .and_then(|()| {
                // The index stays the sandbox's: its tracked connections stay for its resume
                // (they go when it is removed and the index is released).
                let net = host.network.slot(slot)?;
                host.release_network_keeping_flows(&net)
            });
        released.map_err(on_host)
    }

    /// Removes staging directories a crash left (live snapshots interrupted mid-dump).
    pub fn purge_staging(&self) -> usize {
        self.staging.purge_entries()
    }
}
