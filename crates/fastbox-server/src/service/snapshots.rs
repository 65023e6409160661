//! Snapshots, pause, resume and fork (DESIGN §4, §5): each writes its intent durably
//! (`Creating`, `Pausing`, `Resuming`), answers 202, and a task does the node's part; after a
//! crash, [`Lifecycle::recover_snapshots`] and [`Lifecycle::recover_paused`] drive what was
//! interrupted to an end state (`Ready` or `Failed`; `Running`, `Paused` or `Failed`).

use std::sync::Arc;

use chrono::Utc;
use fastbox_api::lifecycle::{
    CreateSandboxRequest, CreateSandboxResponse, PaginationInfo, SandboxState,
};
use fastbox_api::snapshots::{
    ForkRequest, ForkResponse, ListSnapshotsResponse, Snapshot, SnapshotState, SnapshotStatus,
};
use fastbox_node_api::wire::{
    CheckpointFetch, NodePlacement, Placed, RestoreSpec, SandboxSettings, SnapshotReport,
    SnapshotSource,
};
use fastbox_node_api::{NodeAgent, NodeError, NodeErrorKind, NodeResult};

use crate::config::ResourcePolicy;
use crate::error::ApiError;
use crate::record::{MovedFrom, SandboxRecord, SnapshotRecord};

use super::converge::{PROCESS_LOST, START_FAILED};
use super::lifecycle::{Lifecycle, not_running};
use super::plan::{CreatePlan, Rules, plan_from_snapshot, recorded_limits};

/// A live snapshot dumped (staged on its node under the snapshot's id) and not yet kept:
/// the placement it was taken of.
struct Staged {
    placement: NodePlacement,
}

/// Reasons recorded on sandboxes and snapshots.
pub const PAUSE_FAILED: &str = "PAUSE_FAILED";
pub const RESUME_FAILED: &str = "RESUME_FAILED";
pub const SNAPSHOT_FAILED: &str = "SNAPSHOT_FAILED";
pub const INTERRUPTED: &str = "INTERRUPTED";

/// How long a create from a snapshot that is still being taken waits for it.
pub const SNAPSHOT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Most sandboxes one fork makes.
pub const MAX_FORK: u32 = 64;
/// Longest snapshot name.
const MAX_NAME_LEN: usize = 128;

/// `GET /v1/snapshots` filters.
#[derive(Debug, Clone, Default)]
pub struct SnapshotQuery {
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    /// `None`: any state; otherwise the states to match (none, when every state the
    /// client named is unknown here).
    pub states: Option<Vec<SnapshotState>>,
    pub page: u32,
    pub page_size: u32,
}

/// Names of the node checkpoints of pauses start with this.
pub const PAUSE_KEY_PREFIX: &str = "pause-";

/// A new name for the node checkpoint a pause of sandbox `id` writes: every pause has its
/// own, so removing the last one's after a resume never races with the next pause.
fn new_pause_key(id: &str) -> String {
    format!(
        "{PAUSE_KEY_PREFIX}{id}-{}",
        &super::lifecycle::random_token()[..8]
    )
}

impl Lifecycle {
    pub(super) fn snapshot_record(&self, id: &str) -> Result<SnapshotRecord, ApiError> {
        self.snapshots
            .lock()
            .expect("snapshots lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::SnapshotNotFound(id.to_string()))
    }

    /// The node snapshot `id`'s checkpoint is on (`None`: the first node).
    pub(super) fn snapshot_node(&self, id: &str) -> Result<Option<String>, ApiError> {
        Ok(self.snapshot_record(id)?.node)
    }

    /// The nodes a sandbox created from snapshot `id` may go to, in order: the one that holds
    /// it (unless lost), then, once it is published, the others as a create ranks them (they
    /// fetch it from the artifact store first).
    pub(super) fn snapshot_candidates(
        &self,
        id: &str,
    ) -> Result<Vec<Arc<dyn NodeAgent>>, ApiError> {
        let snapshot = self.snapshot_record(id)?;
        let mut candidates: Vec<Arc<dyn NodeAgent>> = Vec::new();
        let holder = self.node(snapshot.node.as_deref());
        if let Ok(holder) = &holder {
            candidates.push(holder.clone());
        }
        // A clone mounts the source's volumes, which are its node's.
        if snapshot.manifest.is_some() && snapshot.volumes.is_empty() {
            for node in self.nodes.ranked(None) {
                if !candidates.iter().any(|c| c.node_id() == node.node_id()) {
                    candidates.push(node);
                }
            }
        }
        match (candidates.is_empty(), holder) {
            (true, Err(e)) => Err(e),
            _ => Ok(candidates),
        }
    }

    fn update_snapshot(
        &self,
        id: &str,
        change: impl FnOnce(&mut SnapshotRecord),
    ) -> Result<SnapshotRecord, ApiError> {
        let mut snapshots = self.snapshots.lock().expect("snapshots lock");
        let current = snapshots
            .get(id)
            .ok_or_else(|| ApiError::SnapshotNotFound(id.to_string()))?;
        let mut next = current.clone();
        change(&mut next);
        self.store.put_snapshot(&next)?;
        snapshots.insert(id.to_string(), next.clone());
        Ok(next)
    }

    /// A snapshot sandboxes can be created from, or why not (404 unknown, 409 not `Ready`).
    /// One still being taken is waited for (up to [`SNAPSHOT_WAIT`]), so a create can follow
    /// the snapshot's 202 at once.
    pub(super) async fn ready_snapshot(&self, id: &str) -> Result<SnapshotRecord, ApiError> {
        let deadline = tokio::time::Instant::now() + SNAPSHOT_WAIT;
        let mut snapshot = self.snapshot_record(id)?;
        while snapshot.state() == SnapshotState::Creating && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            snapshot = self.snapshot_record(id)?;
        }
        if snapshot.state() != SnapshotState::Ready {
            return Err(ApiError::Conflict(format!(
                "snapshot {id} is {}, not Ready",
                snapshot.state()
            )));
        }
        Ok(snapshot)
    }

    /// `POST /v1/sandboxes/{id}/snapshots`: records the snapshot (`Creating`) and takes it in
    /// the background; the sandbox keeps running.
    pub fn create_snapshot(
        self: &Arc<Self>,
        sandbox_id: &str,
        name: Option<String>,
    ) -> Result<Snapshot, ApiError> {
        let snapshot = self.record_snapshot(sandbox_id, name)?;
        let this = self.clone();
        let id = snapshot.id.clone();
        tokio::spawn(async move { this.take_snapshot(&id).await });
        Ok(snapshot.to_wire())
    }

    /// Validates and records a `Creating` snapshot of running sandbox `sandbox_id`, which is
    /// busy until [`Lifecycle::take_snapshot`] ends.
    fn record_snapshot(
        &self,
        sandbox_id: &str,
        name: Option<String>,
    ) -> Result<SnapshotRecord, ApiError> {
        if let Some(name) = &name
            && (name.trim().is_empty() || name.len() > MAX_NAME_LEN)
        {
            return Err(ApiError::InvalidParameter(format!(
                "name must be 1 to {MAX_NAME_LEN} characters"
            )));
        }
        let source = self.record(sandbox_id)?;
        refuse_object_storage(&source, "snapshotted or forked")?;
        if source.state() != SandboxState::Running || source.placement.is_none() {
            return Err(not_running(
                &source,
                ": only a running sandbox is snapshotted",
            ));
        }
        if !self.claim(sandbox_id) {
            return Err(busy(sandbox_id));
        }
        if self.snapshotted_elsewhere(sandbox_id) {
            self.release(sandbox_id);
            return Err(busy(sandbox_id));
        }
        let now = Utc::now();
        let snapshot = SnapshotRecord {
            id: format!("snap_{}", uuid::Uuid::new_v4().simple()),
            sandbox_id: sandbox_id.to_string(),
            name,
            status: SnapshotStatus {
                state: SnapshotState::Creating,
                reason: None,
                message: None,
                last_transition_at: Some(now),
            },
            created_at: now,
            image: fastbox_api::lifecycle::ImageSpec {
                uri: source.image.uri.clone(),
                auth: None,
            },
            entrypoint: source.entrypoint.clone(),
            env: source.env.clone(),
            metadata: source.metadata.clone(),
            resource_limits: source.resource_limits.clone(),
            timeout_secs: source
                .expires_at
                .map(|t| (t - source.created_at).num_seconds()),
            network_policy: source.network_policy.clone(),
            execd_token: source.execd_token.clone(),
            report: None,
            secure_access: source.secure_access.is_some(),
            node: source.node.clone(),
            manifest: None,
            volumes: source.volumes.clone(),
            credential_proxy: source.credential_proxy,
            taken_by: Some(self.cluster.id().to_string()),
        };
        let stored = self.store.put_snapshot(&snapshot);
        if let Err(e) = stored {
            self.release(sandbox_id);
            return Err(e.into());
        }
        self.snapshots
            .lock()
            .expect("snapshots lock")
            .insert(snapshot.id.clone(), snapshot.clone());
        Ok(snapshot)
    }

    /// Takes recorded snapshot `id` of its (busy) source: `Ready` with what it cost, or
    /// `Failed` with why. Releases the source.
    async fn take_snapshot(self: &Arc<Self>, id: &str) -> SnapshotState {
        let staged = self.stage_snapshot(id, true).await;
        self.commit_snapshot(id, staged).await
    }

    /// The first half of [`Lifecycle::take_snapshot`]: the dump of recorded snapshot `id`'s
    /// (busy) source into the staging area (`short_freeze`: see
    /// [`NodeAgent::stage_snapshot`]). Releases the source once it ran.
    ///
    /// [`NodeAgent::stage_snapshot`]: fastbox_node_api::NodeAgent::stage_snapshot
    async fn stage_snapshot(
        self: &Arc<Self>,
        id: &str,
        short_freeze: bool,
    ) -> Result<Staged, String> {
        let snapshot = self.snapshot_record(id).map_err(|e| e.to_string())?;
        let source = self.record(&snapshot.sandbox_id);
        let staged = match source {
            Ok(source) if source.placement.is_some() => {
                let on = source.node.clone();
                let source = snapshot_source(&snapshot.id, &source).expect("placed");
                match self.node(on.as_deref()) {
                    Ok(node) => node
                        .stage_snapshot(&source, short_freeze)
                        .await
                        .map(|()| Staged {
                            placement: source.placement,
                        })
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            _ => Err(format!(
                "sandbox {} is no longer running",
                snapshot.sandbox_id
            )),
        };
        self.release(&snapshot.sandbox_id);
        staged
    }

    /// The second half of [`Lifecycle::take_snapshot`]: the staged snapshot kept on disk
    /// and published, and the records updated (`Ready`, or `Failed` with why).
    async fn commit_snapshot(
        self: &Arc<Self>,
        id: &str,
        staged: Result<Staged, String>,
    ) -> SnapshotState {
        let snapshot = self.snapshot_record(id).ok();
        let sandbox_id = snapshot.as_ref().map(|s| s.sandbox_id.clone());
        let node = snapshot.and_then(|s| s.node);
        let taken = match (staged, self.node(node.as_deref())) {
            (Ok(Staged { placement }), Ok(node)) => node
                .commit_snapshot(id, &placement)
                .await
                .map_err(|e| e.to_string()),
            (Ok(_), Err(e)) => Err(e.to_string()),
            (Err(message), _) => Err(message),
        };
        let updated = self.update_snapshot(id, |s| match &taken {
            Ok(report) => {
                s.report = Some(report.summary.clone());
                s.manifest = report.manifest.clone();
                s.transition(SnapshotState::Ready, None, &report.summary);
            }
            Err(message) => s.transition(SnapshotState::Failed, Some(SNAPSHOT_FAILED), message),
        });
        if let Some(sandbox_id) = sandbox_id {
            let _ = self.update(&sandbox_id, |r| {
                match &taken {
                    Ok(report) => r.event("Snapshotted", &format!("{id}: {}", report.summary)),
                    Err(message) => r.event("SnapshotFailed", &format!("{id}: {message}")),
                }
                Ok(())
            });
        }
        match updated {
            Ok(s) => s.state(),
            Err(e) => {
                tracing::warn!(snapshot = %id, error = %e, "could not record the snapshot");
                SnapshotState::Failed
            }
        }
    }

    /// `GET /v1/snapshots`: filtered, newest first, paginated.
    pub fn list_snapshots(&self, q: &SnapshotQuery) -> ListSnapshotsResponse {
        let mut items: Vec<Snapshot> = self
            .snapshots
            .lock()
            .expect("snapshots lock")
            .values()
            .filter(|s| q.sandbox_id.as_ref().is_none_or(|id| *id == s.sandbox_id))
            .filter(|s| q.name.is_none() || q.name == s.name)
            .filter(|s| {
                q.states
                    .as_ref()
                    .is_none_or(|states| states.contains(&s.state()))
            })
            .map(SnapshotRecord::to_wire)
            .collect();
        items.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
        let (pagination, range) = PaginationInfo::of(q.page, q.page_size, items.len());
        ListSnapshotsResponse {
            items: items[range].to_vec(),
            pagination,
        }
    }

    /// `GET /v1/snapshots/{id}`.
    pub fn get_snapshot(&self, id: &str) -> Result<Snapshot, ApiError> {
        Ok(self.snapshot_record(id)?.to_wire())
    }

    /// `DELETE /v1/snapshots/{id}`: `Deleting` (durable), then its files go and the record
    /// with them. Sandboxes restored from it keep running. A snapshot still being taken
    /// cannot be deleted (409).
    pub async fn delete_snapshot(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let snapshot = self.snapshot_record(id)?;
        if snapshot.state() == SnapshotState::Creating {
            return Err(ApiError::Conflict(format!(
                "snapshot {id} is still being taken"
            )));
        }
        self.update_snapshot(id, |s| s.transition(SnapshotState::Deleting, None, ""))?;
        self.finish_snapshot_delete(id).await
    }

    async fn finish_snapshot_delete(&self, id: &str) -> Result<(), ApiError> {
        self.node(self.snapshot_node(id)?.as_deref())?
            .remove_snapshot(id)
            .await
            .map_err(|e| ApiError::Internal(format!("remove snapshot files: {e}")))?;
        self.store.remove_snapshot(id)?;
        self.snapshots.lock().expect("snapshots lock").remove(id);
        Ok(())
    }

    /// `POST /v1/sandboxes/{id}/pause`: `Pausing` now; `Paused` once the checkpoint is on
    /// disk and the runtime released.
    pub fn pause(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        refuse_object_storage(&self.record(id)?, "paused")?;
        let key = new_pause_key(id);
        self.begin(
            id,
            SandboxState::Running,
            SandboxState::Pausing,
            "pause requested",
            |r| {
                r.paused_checkpoint = Some(key.clone());
                r.resume_after_pause = false;
            },
        )?;
        let this = self.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            this.run_pause(&id).await;
            this.release(&id);
            this.resume_if_asked(&id);
        });
        Ok(())
    }

    /// `POST /v1/sandboxes/{id}/resume`: `Resuming` now; `Running` once restored. Asked while
    /// the sandbox is `Pausing`, the resume is accepted and runs once the pause ends.
    pub fn resume(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        if self.record(id)?.state() == SandboxState::Pausing {
            // Set only while it is Pausing, in the same write that sees it so.
            let record = self.update(id, |r| {
                if r.state() == SandboxState::Pausing && !r.resume_after_pause {
                    r.resume_after_pause = true;
                    r.event("ResumeRequested", "it resumes once its pause ends");
                }
                Ok(())
            })?;
            if record.resume_after_pause {
                // The pause may have ended since: then it starts now.
                self.resume_if_asked(id);
                return Ok(());
            }
            // The pause ended between the look and the write: an ordinary resume.
        }
        self.start_resume(id)
    }

    /// A resume of a `Paused` sandbox that is not busy: `Resuming` now (a resume asked during
    /// its pause is thereby done), restored in the background.
    fn start_resume(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        self.begin(
            id,
            SandboxState::Paused,
            SandboxState::Resuming,
            "resume requested",
            |r| r.resume_after_pause = false,
        )?;
        let this = self.clone();
        let id = id.to_string();
        tokio::spawn(async move { this.resume_and_release(&id).await });
        Ok(())
    }

    /// The resume asked for during a pause, once that pause ended (see
    /// [`SandboxRecord::resume_after_pause`]): started when the sandbox is `Paused` and not
    /// busy (whether it started), forgotten when the pause failed or the sandbox went
    /// elsewhere. Called when a pause lets the sandbox go, after a resume is asked, and by
    /// the reconciler (a pause a restart finished).
    pub(super) fn resume_if_asked(self: &Arc<Self>, id: &str) -> bool {
        let Ok(record) = self.record(id) else {
            return false;
        };
        match record.state() {
            _ if !record.resume_after_pause => false,
            // Not yet, or busy still: asked again later.
            SandboxState::Pausing => false,
            SandboxState::Paused => self.start_resume(id).is_ok(),
            _ => {
                let _ = self.update(id, |r| {
                    if !matches!(r.state(), SandboxState::Pausing | SandboxState::Paused) {
                        r.resume_after_pause = false;
                    }
                    Ok(())
                });
                false
            }
        }
    }

    /// [`Lifecycle::run_resume`] of a busy sandbox, then not busy. A resume its node's loss
    /// cut short is settled after the release, so the sandbox is never `Paused` yet busy.
    pub(super) async fn resume_and_release(self: &Arc<Self>, id: &str) {
        let cut = self.run_resume(id).await;
        self.release(id);
        if cut == ResumeEnd::NodeLost {
            self.settle_lost_resume(id);
        }
    }

    /// Whether another server takes a snapshot of sandbox `id` now (a snapshot or fork
    /// through it): its own `busy` mark is that server's only, so a pause, a resume or
    /// another snapshot here waits for it as one through that server would (until the
    /// snapshot is `Ready`: the end of its dump is not recorded, so this waits out its
    /// publication too).
    fn snapshotted_elsewhere(&self, id: &str) -> bool {
        let me = self.cluster.id();
        let taking: Vec<String> = self
            .snapshots
            .lock()
            .expect("snapshots lock")
            .values()
            .filter(|s| s.sandbox_id == id && s.state() == SnapshotState::Creating)
            .filter_map(|s| s.taken_by.clone())
            .filter(|by| by != me)
            .collect();
        taking.iter().any(|by| !self.cluster.is_gone(by))
    }

    /// Marks `id` busy and moves it from `from` to `to` durably, or says why not (404, 409).
    fn begin(
        &self,
        id: &str,
        from: SandboxState,
        to: SandboxState,
        message: &str,
        mut also: impl FnMut(&mut SandboxRecord),
    ) -> Result<(), ApiError> {
        let record = self.record(id)?;
        if record.state() != from {
            return Err(not_running(&record, &format!(": it must be {from}")));
        }
        if !self.claim(id) {
            return Err(busy(id));
        }
        if self.snapshotted_elsewhere(id) {
            self.release(id);
            return Err(busy(id));
        }
        let moved = self.update(id, |r| {
            if r.state() != from {
                return Err(not_running(r, &format!(": it must be {from}")));
            }
            r.transition(to, None, message);
            also(r);
            Ok(())
        });
        if moved.is_err() {
            self.release(id);
        }
        moved.map(drop)
    }

    /// The pause of a `Pausing` sandbox. A failed dump leaves the processes running: the
    /// sandbox is `Running` again, with the reason; if they are gone it is `Failed`.
    pub(super) async fn run_pause(self: &Arc<Self>, id: &str) {
        let Ok(record) = self.record(id) else { return };
        let Some(source) = record
            .paused_checkpoint
            .as_deref()
            .and_then(|key| snapshot_source(key, &record))
        else {
            self.fail_paused(id, "no placement or checkpoint name is recorded")
                .await;
            return;
        };
        let paused: NodeResult<SnapshotReport> = match self.node(record.node.as_deref()) {
            Ok(node) => tokio::select! {
                paused = node.pause(id, &source) => paused,
                // Its node is lost meanwhile: the sandbox failed with it.
                () = self.until_lost(record.node.as_deref()) => {
                    tracing::warn!(sandbox = %id, "its node was lost during the pause");
                    return;
                }
            },
            Err(e) => Err(NodeError::new(NodeErrorKind::Unreachable, e.to_string())),
        };
        match paused {
            Ok(report) => {
                let _ = self.update(id, |r| {
                    // Taken over meanwhile (this server passed for gone): the pause is the
                    // other server's to record.
                    self.still_acting(r)?;
                    r.placement = None;
                    r.paused_manifest = report.manifest.clone();
                    if r.state() == SandboxState::Pausing {
                        r.transition(SandboxState::Paused, None, &report.summary);
                    }
                    Ok(())
                });
            }
            Err(e) => self.pause_failed(id, &record, &e).await,
        }
    }

    async fn pause_failed(self: &Arc<Self>, id: &str, record: &SandboxRecord, e: &NodeError) {
        let alive = self.runs(record).await;
        tracing::warn!(sandbox = %id, error = %e, alive, "pause failed");
        if alive {
            let _ = self.update(id, |r| {
                self.still_acting(r)?;
                if r.state() == SandboxState::Pausing {
                    r.transition(SandboxState::Running, Some(PAUSE_FAILED), &e.to_string());
                }
                r.paused_checkpoint = None;
                Ok(())
            });
        } else {
            self.fail_paused(id, &e.to_string()).await;
        }
    }

    /// A sandbox whose pause or resume lost its processes: `Failed`, and whatever it held
    /// (its kept slot, its checkpoint) is removed. Nothing, when another server acts on it.
    async fn fail_paused(self: &Arc<Self>, id: &str, message: &str) {
        // Another server's operation (it took this one over): not this server's to end.
        if self.record(id).is_ok_and(|r| self.acted_on_elsewhere(&r)) {
            tracing::warn!(sandbox = %id, message, "another server acts on it: its failure is not recorded here");
            return;
        }
        let _ = self.update(id, |r| {
            if !r.state().is_final() && r.state() != SandboxState::Stopping {
                r.transition(SandboxState::Failed, Some(PROCESS_LOST), message);
            }
            Ok(())
        });
        self.remove_now(id).await;
    }

    /// The resume of a `Resuming` sandbox: its checkpoint restored into the slot it kept.
    /// On failure it is `Paused` again (the checkpoint stays), with the reason. A call its
    /// node's loss cut short is given up (the caller settles it once not busy).
    async fn run_resume(self: &Arc<Self>, id: &str) -> ResumeEnd {
        let Ok(record) = self.record(id) else {
            return ResumeEnd::Done;
        };
        let (Some(key), Some(slot)) = (record.paused_checkpoint.clone(), record.slot) else {
            self.fail_paused(id, "no checkpoint or slot is recorded for the resume")
                .await;
            return ResumeEnd::Done;
        };
        let (node, slot) = match self.node(record.node.as_deref()) {
            Ok(node) => (node, slot),
            // Its node is lost (or gone): another takes it, from the published checkpoint.
            Err(lost) => match self.move_paused(&record, &key).await {
                Ok(moved) => moved,
                Err(why) => {
                    // Left Paused: its node may be back later, or another may take it then.
                    let _ = self.update(id, |r| {
                        if r.state() == SandboxState::Resuming {
                            r.transition(
                                SandboxState::Paused,
                                Some(RESUME_FAILED),
                                &format!("{lost}; {why}"),
                            );
                        }
                        Ok(())
                    });
                    return ResumeEnd::Done;
                }
            },
        };
        // A checkpoint taken on the node it moved off: a new address there.
        let record = self.record(id).unwrap_or(record);
        let moved = record
            .moved_from
            .iter()
            .any(|m| m.checkpoint.as_deref() == Some(key.as_str()));
        let resumed = match restore_spec(&record, &self.cfg.resources) {
            Ok(mut spec) => {
                spec.moved = moved;
                tokio::select! {
                    resumed = node.resume(&key, spec, slot) => resumed,
                    // Its node is lost meanwhile: whatever the resume started there, the node's
                    // fence froze.
                    () = self.until_lost(record.node.as_deref()) => {
                        tracing::warn!(sandbox = %id, "its node was lost during the resume");
                        return ResumeEnd::NodeLost;
                    }
                }
            }
            Err(e) => Err(e),
        };
        match resumed {
            Ok(Placed { placement, report }) => {
                self.start_metrics.record(&report);
                let mut dropped = None;
                let updated = self.update(id, |r| {
                    // Decided on this version of the record (a conflict runs this again).
                    dropped = None;
                    if r.state() == SandboxState::Resuming {
                        r.placement = Some(placement.clone());
                        r.transition(SandboxState::Running, None, &report.summary);
                        dropped = r.paused_checkpoint.take();
                        r.resumed_from = dropped.clone();
                    }
                    Ok(())
                });
                // The checkpoint goes in the background once the sandbox's memory is in place
                // (the removal waits for a lazy resume's transfer): the sandbox runs, and the
                // next pause writes another one. A crash before it is gone leaves it to
                // [`Lifecycle::recover`] (a transfer cut short: resumed again from it) or to
                // [`Lifecycle::unreferenced_pauses`].
                if let (Ok(_), Some(key)) = (updated, dropped) {
                    let this = self.clone();
                    let id = id.to_string();
                    tokio::spawn(async move {
                        let removed = node.remove_snapshot(&key).await;
                        match removed {
                            Ok(()) => {
                                let _ = this.update(&id, |r| {
                                    if r.resumed_from.as_deref() == Some(key.as_str()) {
                                        r.resumed_from = None;
                                    }
                                    Ok(())
                                });
                            }
                            Err(e) => {
                                tracing::warn!(checkpoint = %key, error = %e, "could not remove a pause checkpoint");
                            }
                        }
                    });
                }
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "resume failed");
                let _ = self.update(id, |r| {
                    if r.state() == SandboxState::Resuming {
                        r.transition(SandboxState::Paused, Some(RESUME_FAILED), &e.to_string());
                    }
                    Ok(())
                });
            }
        }
        ResumeEnd::Done
    }

    /// A resume its node's loss cut short, once the sandbox is not busy: what
    /// [`Lifecycle::fail_sandboxes_of`] leaves to it.
    fn settle_lost_resume(&self, id: &str) {
        let _ = self.update(id, |r| {
            if r.state() == SandboxState::Resuming {
                let node = r.node.clone().unwrap_or_default();
                super::membership::resume_cut_by_loss(r, &format!("node {node} was lost"));
            }
            Ok(())
        });
    }

    /// Moves paused sandbox `record` (its checkpoint `key`) off its lost node: a slot on the
    /// best node that has one and fetches the published checkpoint, recorded with what the
    /// sandbox left behind. The resume then runs there (a new address).
    async fn move_paused(
        &self,
        record: &SandboxRecord,
        key: &str,
    ) -> Result<(Arc<dyn NodeAgent>, u32), String> {
        if !record.volumes.is_empty() {
            return Err(
                "its volumes are directories of its own node's host: it resumes only there".into(),
            );
        }
        let manifest = record
            .paused_manifest
            .clone()
            .ok_or("its checkpoint was not published: it resumes only on its own node")?;
        let from = self.node_name(record.node.as_deref());
        let mut refusals = Vec::new();
        for node in self.nodes.ranked(None) {
            if node.node_id() == from {
                continue;
            }
            let slot = match node.admit().await {
                Ok(slot) => slot,
                Err(e) => {
                    refusals.push(format!("node {}: {e}", node.node_id()));
                    continue;
                }
            };
            self.nodes.admitted(node.node_id());
            // The checkpoint may take a while to fetch: the slot is not recorded until then.
            let _admitting = self.admitting(node.node_id(), slot);
            if let Err(e) = node
                .fetch_checkpoint(
                    key,
                    &manifest,
                    &record.execd_token,
                    CheckpointFetch::MemoryOnFault,
                )
                .await
            {
                node.release_slot(slot).await;
                refusals.push(format!("node {}: {e}", node.node_id()));
                continue;
            }
            let to = node.node_id().to_string();
            let moved = self.update(&record.id, |r| {
                r.moved_from.push(MovedFrom {
                    node: r.node.take(),
                    slot: r.slot,
                    checkpoint: Some(key.to_string()),
                });
                r.node = Some(to.clone());
                r.slot = Some(slot);
                r.event(
                    "Moved",
                    &format!(
                        "node {from} is lost: resumed on node {to} from its published checkpoint"
                    ),
                );
                Ok(())
            });
            if let Err(e) = moved {
                node.release_slot(slot).await;
                return Err(e.to_string());
            }
            tracing::warn!(sandbox = %record.id, from = %from, to = %to, "a paused sandbox moves off a lost node");
            return Ok((node, slot));
        }
        Err(match refusals.is_empty() {
            true => "no other node is available".into(),
            false => format!("no other node could take it: {}", refusals.join("; ")),
        })
    }

    /// What sandbox `id` left on each lost node it moved off (its kept slot, its checkpoint),
    /// removed once that node is back; until then (or when that fails) it stays recorded. The
    /// sandbox is taken for the whole cleaning, so nothing moves it meanwhile.
    pub(super) async fn clean_moved(&self, id: &str) {
        if !self.claim(id) {
            return;
        }
        if let Ok(record) = self.record(id) {
            for moved in &record.moved_from {
                self.clean_one_move(&record, moved).await;
            }
        }
        self.release(id);
    }

    async fn clean_one_move(&self, record: &SandboxRecord, moved: &MovedFrom) {
        if self.node_is_lost(moved.node.as_deref()) {
            return;
        }
        let Ok(node) = self.node(moved.node.as_deref()) else {
            return;
        };
        let warn = |e: &dyn std::fmt::Display| {
            tracing::warn!(sandbox = %record.id, node = node.node_id(), error = %e, "could not remove what a moved sandbox left");
        };
        let same = |m: &MovedFrom| m.node == moved.node && m.checkpoint == moved.checkpoint;
        // 1. The slot it kept there, and what ran there. Back on that node since, its files
        //    there are the running sandbox's: only the slot is given back.
        let back_on_it =
            self.node_name(moved.node.as_deref()) == self.node_name(record.node.as_deref());
        if back_on_it {
            if let Some(slot) = moved.slot {
                node.release_slot(slot).await;
            }
        } else if let Err(e) = node.remove(&record.id, None, moved.slot).await {
            return warn(&e);
        }
        // Recorded at once: a retry never gives back a slot another sandbox took since.
        if moved.slot.is_some() {
            let _ = self.update(&record.id, |r| {
                r.moved_from
                    .iter_mut()
                    .filter(|m| same(m))
                    .for_each(|m| m.slot = None);
                Ok(())
            });
        }
        // 2. Its checkpoint there.
        if let Some(key) = &moved.checkpoint
            && let Err(e) = node.remove_snapshot(key).await
        {
            return warn(&e);
        }
        let _ = self.update(&record.id, |r| {
            r.moved_from.retain(|m| !same(m));
            r.event(
                "Cleaned",
                &format!("what it left on node {} is removed", node.node_id()),
            );
            Ok(())
        });
    }

    /// Removes the checkpoint a resumed (or removed) sandbox was paused in.
    pub(super) async fn drop_pause_checkpoint(&self, id: &str) {
        let Ok(record) = self.record(id) else { return };
        let Some(key) = record.paused_checkpoint else {
            return;
        };
        let removed = match self.node(record.node.as_deref()) {
            Ok(node) => node.remove_snapshot(&key).await,
            Err(e) => Err(NodeError::new(NodeErrorKind::Unreachable, e.to_string())),
        };
        match removed {
            Ok(()) => {
                let _ = self.update(id, |r| {
                    r.paused_checkpoint = None;
                    Ok(())
                });
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "could not remove a pause checkpoint")
            }
        }
    }

    /// The create of a sandbox recorded from a snapshot: a clone restored into its slot
    /// (from the staged dump while a fork's snapshot is not yet on disk: the node knows).
    pub(super) async fn run_clone(self: &Arc<Self>, id: &str, snapshot_id: &str, plan: CreatePlan) {
        let Ok(mut record) = self.record(id) else {
            return;
        };
        let Some(slot) = record.slot else {
            self.fail(id, START_FAILED, "no slot was reserved").await;
            return;
        };
        record.env = plan.env.clone();
        let node = match self.node(record.node.as_deref()) {
            Ok(node) => node,
            Err(e) => {
                self.fail(id, START_FAILED, &e.to_string()).await;
                return;
            }
        };
        // On another node than the snapshot's: fetched from the artifact store first.
        if let Err(e) = self.fetch_snapshot(&*node, snapshot_id).await {
            self.fail(id, START_FAILED, &e).await;
            return;
        }
        let placed = match restore_spec(&record, &self.cfg.resources) {
            Ok(mut spec) => {
                spec.common.policy = plan.policy.clone();
                spec.common.limits = plan.limits;
                spec.common.disk_bytes = plan.disk_bytes;
                node.clone_snapshot(snapshot_id, spec, slot).await
            }
            Err(e) => Err(e),
        };
        self.finish_start(id, slot, placed, None).await;
    }

    /// Makes snapshot `id` present on `node` when it is not the node that took it.
    async fn fetch_snapshot(&self, node: &dyn NodeAgent, id: &str) -> Result<(), String> {
        let snapshot = self.snapshot_record(id).map_err(|e| e.to_string())?;
        if self.node_name(snapshot.node.as_deref()) == node.node_id() {
            return Ok(());
        }
        let manifest = snapshot.manifest.as_deref().ok_or_else(|| {
            format!("snapshot {id} is not published: it restores only where it was taken")
        })?;
        node.fetch_checkpoint(id, manifest, &snapshot.execd_token, CheckpointFetch::Whole)
            .await
            .map_err(|e| e.to_string())
    }

    /// `POST /v1/sandboxes/{id}/fork`: one live snapshot of the sandbox, and `count` new
    /// sandboxes restored from it, recorded (`Pending`) before this answers.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        req: ForkRequest,
    ) -> Result<ForkResponse, ApiError> {
        if req.count == 0 || req.count > MAX_FORK {
            return Err(ApiError::InvalidParameter(format!(
                "count must be 1 to {MAX_FORK}, got {}",
                req.count
            )));
        }
        let snapshot = self.record_snapshot(id, Some(format!("fork of {id}")))?;
        let create = CreateSandboxRequest {
            snapshot_id: Some(snapshot.id.clone()),
            metadata: req.metadata.clone(),
            timeout: req.timeout,
            ..Default::default()
        };
        let planned = plan_from_snapshot(create, &snapshot, &Rules::of(&self.cfg));
        let mut clones = Vec::new();
        let admitted = match planned {
            Ok(plan) => {
                let mut result = Ok(());
                for _ in 0..req.count {
                    match self.admit_and_record(&plan, None, false).await {
                        Ok(clone) => clones.push(clone),
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
                result.map(|()| plan)
            }
            Err(e) => Err(e),
        };
        let plan = match admitted {
            Ok(plan) => plan,
            Err(e) => {
                // Nothing is started: the recorded clones and the snapshot go again.
                for clone in &clones {
                    self.fail(clone, START_FAILED, &format!("the fork was refused: {e}"))
                        .await;
                }
                self.release(id);
                let _ = self.update_snapshot(&snapshot.id, |s| {
                    s.transition(SnapshotState::Failed, Some(SNAPSHOT_FAILED), &e.to_string())
                });
                return Err(e);
            }
        };
        for clone in &clones {
            self.claim(clone);
        }
        let this = self.clone();
        let (snapshot_id, ids) = (snapshot.id.clone(), clones.clone());
        tokio::spawn(async move {
            let clock = std::time::Instant::now();
            // The clones restore from the staged dump, before the snapshot is on disk.
            // The fork waits for the whole dump: no streaming ahead of it.
            let staged = this.stage_snapshot(&snapshot_id, false).await;
            let staged_ms = clock.elapsed().as_secs_f64() * 1000.0;
            let is_staged = staged.is_ok();
            // Two restores per core: a restore also waits (for CRIU's helpers, the lazy
            // daemon, execd). Forks of 10 at 256 MiB here, p50 of 5: one per core 780 ms;
            // three on two cores 613-693 ms; two per core 560-632 ms; all ten 560-663 ms.
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            let permits = Arc::new(tokio::sync::Semaphore::new(cores * 2));
            let mut tasks = Vec::new();
            for clone in ids {
                let this = this.clone();
                let plan = plan.clone();
                let snapshot_id = snapshot_id.clone();
                let permits = permits.clone();
                tasks.push(tokio::spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    if is_staged {
                        this.run_clone(&clone, &snapshot_id, plan).await;
                    } else {
                        this.fail(&clone, START_FAILED, "the fork's snapshot failed")
                            .await;
                    }
                    this.release(&clone);
                }));
            }
            let count = tasks.len();
            for task in tasks {
                let _ = task.await;
            }
            let placed_ms = clock.elapsed().as_secs_f64() * 1000.0;
            tracing::info!(snapshot = %snapshot_id, count, staged_ms, placed_ms, "fork's clones placed");
            this.commit_snapshot(&snapshot_id, staged).await;
        });
        let items = clones
            .iter()
            .map(|c| {
                self.record(c)
                    .map(|r| CreateSandboxResponse::from(r.to_wire()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ForkResponse {
            snapshot_id: snapshot.id,
            items,
        })
    }

    /// Names of pause checkpoints no sandbox record names: what a crash between a resume and
    /// the removal of its checkpoint left (the caller removes them at start).
    pub fn unreferenced_pauses(&self, on_node: &[String]) -> Vec<String> {
        let named: std::collections::HashSet<String> = self
            .snapshot()
            .into_iter()
            .filter_map(|r| r.paused_checkpoint)
            .collect();
        on_node
            .iter()
            .filter(|k| k.starts_with(PAUSE_KEY_PREFIX) && !named.contains(*k))
            .cloned()
            .collect()
    }

    /// After a restart: snapshots being taken are taken again when their source still
    /// runs (`Failed` otherwise, or `Ready` when the node finished it), and deletions
    /// finish. A snapshot another server takes is left to it while it lives.
    pub async fn recover_snapshots(self: &Arc<Self>) {
        let all: Vec<SnapshotRecord> = self
            .snapshots
            .lock()
            .expect("snapshots lock")
            .values()
            .cloned()
            .collect();
        // (Asked of the store outside the lock: the watch waits on it.)
        for snapshot in all.into_iter().filter(|s| self.is_ours_to_recover(s)) {
            self.recover_snapshot(snapshot).await;
        }
    }

    /// Snapshots a server that is gone was taking (the leader's): taken over, then
    /// recovered as that server's restart would.
    pub(super) async fn take_over_snapshots(self: &Arc<Self>) {
        let me = self.cluster.id().to_string();
        let others: Vec<SnapshotRecord> = self
            .snapshots
            .lock()
            .expect("snapshots lock")
            .values()
            .filter(|s| {
                s.state() == SnapshotState::Creating
                    && s.taken_by.as_deref().is_some_and(|by| by != me)
            })
            .cloned()
            .collect();
        for snapshot in others.into_iter().filter(|s| self.is_ours_to_recover(s)) {
            tracing::warn!(snapshot = %snapshot.id, server = ?snapshot.taken_by, "taking over a snapshot of a server that is gone");
            self.recover_snapshot(snapshot).await;
        }
    }

    /// Whether this server recovers `snapshot`: anything but one another live server takes.
    fn is_ours_to_recover(&self, snapshot: &SnapshotRecord) -> bool {
        let me = self.cluster.id();
        snapshot.state() != SnapshotState::Creating
            || snapshot
                .taken_by
                .as_deref()
                .is_none_or(|by| by == me || self.cluster.is_gone(by))
    }

    /// [`Lifecycle::recover_snapshots`] of one snapshot.
    async fn recover_snapshot(self: &Arc<Self>, snapshot: SnapshotRecord) {
        let node = match self.node(snapshot.node.as_deref()) {
            Ok(node) => node,
            Err(e) => {
                tracing::warn!(snapshot = %snapshot.id, error = %e, "not recovered: its node is not known to this server");
                return;
            }
        };
        match snapshot.state() {
            SnapshotState::Creating => {
                // This server's from now on (a leader that sees the server that took it
                // gone does not take it over again).
                let me = self.cluster.id().to_string();
                if snapshot.taken_by.as_deref() != Some(me.as_str())
                    && self
                        .update_snapshot(&snapshot.id, |s| s.taken_by = Some(me))
                        .is_err()
                {
                    return;
                }
                if node.has_snapshot(&snapshot.id).await {
                    let _ = self.update_snapshot(&snapshot.id, |s| {
                        s.transition(SnapshotState::Ready, None, "finished before a restart")
                    });
                    return;
                }
                let runs = match self.record(&snapshot.sandbox_id) {
                    Ok(r) => r.state() == SandboxState::Running && self.runs(&r).await,
                    Err(_) => false,
                };
                node.discard_interrupted_snapshot(&snapshot.id).await;
                if runs && self.claim(&snapshot.sandbox_id) {
                    let this = self.clone();
                    tokio::spawn(async move { this.take_snapshot(&snapshot.id).await });
                } else {
                    let _ = self.update_snapshot(&snapshot.id, |s| {
                        s.transition(
                            SnapshotState::Failed,
                            Some(INTERRUPTED),
                            "interrupted by a restart, and its sandbox no longer runs",
                        )
                    });
                }
            }
            SnapshotState::Deleting => {
                if let Err(e) = self.finish_snapshot_delete(&snapshot.id).await {
                    tracing::warn!(snapshot = %snapshot.id, error = %e, "could not finish a snapshot deletion");
                }
            }
            _ => {}
        }
    }

    /// After a restart, a sandbox that was `Pausing` or `Resuming`: a pause whose checkpoint
    /// was committed ends `Paused` (the runtime released again); one that was not runs again
    /// while the processes live (`Failed` when they are gone). A resume starts over from a
    /// clean slot.
    pub(super) async fn recover_paused(self: &Arc<Self>, record: SandboxRecord) {
        let id = record.id.clone();
        let Ok(node) = self.node(record.node.as_deref()) else {
            tracing::warn!(sandbox = %id, "not recovered: its node is not known to this server");
            return;
        };
        if let Some(slot) = record.slot {
            node.claim_slot(slot).await;
        }
        self.claim(&id);
        let this = self.clone();
        tokio::spawn(async move {
            match record.state() {
                SandboxState::Pausing => this.recover_pause(&record, &*node).await,
                _ => {
                    if let Some(slot) = record.slot {
                        let _ = node.release_keeping_address(&id, None, slot).await;
                    }
                    let _ = this.update(&id, |r| {
                        r.placement = None;
                        r.event("ResumeRestarted", "the resume was interrupted by a restart");
                        Ok(())
                    });
                    this.resume_and_release(&id).await;
                    return;
                }
            }
            this.release(&id);
        });
    }

    async fn recover_pause(self: &Arc<Self>, record: &SandboxRecord, node: &dyn NodeAgent) {
        let id = record.id.as_str();
        let Some(key) = record.paused_checkpoint.clone() else {
            self.fail_paused(id, "the interrupted pause recorded no checkpoint name")
                .await;
            return;
        };
        // A dump may have outlived the crash: wait for it, and keep what it completed.
        let committed = match snapshot_source(&key, record) {
            Some(source) => node.finish_interrupted_pause(&source).await,
            None => node.has_snapshot(&key).await,
        };
        let alive = self.runs(record).await;
        match (committed, alive, record.slot) {
            (true, _, Some(slot)) => {
                let released = node
                    .release_keeping_address(id, record.placement.as_ref(), slot)
                    .await;
                let _ = self.update(id, |r| {
                    super::lifecycle::still_in(r, SandboxState::Pausing)?;
                    match &released {
                        Ok(()) => {
                            r.placement = None;
                            r.transition(
                                SandboxState::Paused,
                                None,
                                "the pause finished after a restart",
                            );
                        }
                        Err(e) => r.event("PauseRecoveryFailed", &e.to_string()),
                    }
                    Ok(())
                });
            }
            (false, true, _) => {
                let _ = self.update(id, |r| {
                    r.event("PauseRestarted", "the pause was interrupted by a restart");
                    Ok(())
                });
                self.run_pause(id).await;
            }
            _ => {
                let _ = node.remove_snapshot(&key).await;
                self.fail_paused(
                    id,
                    "the pause was interrupted by a restart and the sandbox's processes are gone",
                )
                .await;
            }
        }
    }
}

/// What the node needs to restore `record` from a checkpoint (a pause's or a snapshot's).
/// How a resume call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ResumeEnd {
    /// Answered (or never made), and the record says so.
    Done,
    /// Given up: the node was declared lost while it was in flight.
    NodeLost,
}

fn restore_spec(record: &SandboxRecord, resources: &ResourcePolicy) -> NodeResult<RestoreSpec> {
    let (limits, disk_bytes) = recorded_limits(&record.resource_limits, resources)
        .map_err(|e| NodeError::failed(e.to_string()))?;
    Ok(RestoreSpec {
        id: record.id.clone(),
        moved: false,
        env: record.env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
        volumes: record.volumes.clone(),
        common: SandboxSettings {
            limits,
            disk_bytes,
            tokens: record.tokens(),
            policy: record.policy(),
            credential_proxy: record.credential_proxy,
        },
    })
}

/// Running sandbox `record` as the source of checkpoint `key` (`None` without a placement).
fn snapshot_source(key: &str, record: &SandboxRecord) -> Option<SnapshotSource> {
    Some(SnapshotSource {
        key: key.to_string(),
        placement: record.placement.clone()?,
        execd_token: record.execd_token.clone(),
        image_reference: record.image.uri.clone(),
        volumes: record.volumes.clone(),
    })
}

/// 409 for a sandbox with an object-storage volume: its FUSE client's state is not part of a
/// checkpoint, and its keys are not kept to mount the bucket again.
fn refuse_object_storage(record: &SandboxRecord, what: &str) -> Result<(), ApiError> {
    match record.volumes.iter().find(|v| {
        matches!(
            v.source,
            fastbox_node_api::wire::VolumeSource::ObjectStorage { .. }
        )
    }) {
        Some(volume) => Err(ApiError::Conflict(format!(
            "sandbox {} cannot be {what}: its volume {} is object storage (ossfs), whose mount a checkpoint cannot hold",
            record.id, volume.name
        ))),
        None => Ok(()),
    }
}

fn busy(id: &str) -> ApiError {
    ApiError::Conflict(format!(
        "sandbox {id} is busy with another operation; retry when it is done"
    ))
}
