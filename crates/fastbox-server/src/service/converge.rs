//! The tasks that move sandboxes to where their records say they should be: the create
//! (image, then start), removal, the periodic reconciler (expiry, lost processes, retries,
//! garbage collection) and recovery after a restart of the server.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::Utc;
use fastbox_api::lifecycle::SandboxState;
use fastbox_node_api::NodeResult;
use fastbox_node_api::wire::{
    Adoption, PlaceSpec, Placed, RegistryCredentials, SandboxSettings, TemplateChoice,
};
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::record::SandboxRecord;

use super::lifecycle::{Lifecycle, still_in};
use super::plan::{CreatePlan, recorded_limits};
use super::snapshots::RESUME_FAILED;

/// `extensions` key of a create: `"off"` restores on demand instead of taking a pooled
/// sandbox (benchmarks measure the restore path with it).
pub const POOL_EXTENSION: &str = "fastbox.io/pool";

/// Reasons recorded on failed sandboxes.
pub const IMAGE_FAILED: &str = "IMAGE_RESOLUTION_FAILED";
pub const START_FAILED: &str = "START_FAILED";
pub const PROCESS_LOST: &str = "PROCESS_LOST";
pub const EXPIRED: &str = "EXPIRED";

/// How long a start that ran keeps trying to record `Running` in a store that does not
/// answer, and how often.
const RUNNING_WRITE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);
const RUNNING_WRITE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// What the create task tells the waiting request about the image.
type ImageOutcome = Result<(), String>;

impl Lifecycle {
    /// Starts the create task of a recorded `Pending` sandbox and waits (bounded) for it: an
    /// image that fails quickly is the request's 400 (and the record is dropped); otherwise
    /// the answer is whatever state the sandbox reached in time.
    pub(super) async fn start_create(
        self: &Arc<Self>,
        id: String,
        plan: CreatePlan,
    ) -> Result<(), ApiError> {
        let (image_tx, mut image_rx) = oneshot::channel::<ImageOutcome>();
        let (done_tx, done_rx) = oneshot::channel::<()>();
        self.claim(&id);
        self.create_answers.insert(id.clone(), done_tx);
        let this = self.clone();
        let task_id = id.clone();
        tokio::spawn(async move {
            this.run_create(&task_id, plan, Some(image_tx)).await;
            // (Unless it was answered, and the sandbox given up, as it started.)
            let _ = this.answer_create(&task_id);
        });
        let outcome = match tokio::time::timeout(self.cfg.image_wait, &mut image_rx).await {
            Ok(Ok(outcome)) => Some(outcome),
            Ok(Err(_)) => None,
            Err(_) => {
                // Too slow to wait for: answer Pending, unless the outcome arrived just now.
                image_rx.close();
                image_rx.try_recv().ok()
            }
        };
        match outcome {
            Some(Err(message)) => {
                // The create task stopped at the image and left the record to us.
                let record = self.record(&id)?;
                if let Some(slot) = record.slot {
                    self.node(record.node.as_deref())?.release_slot(slot).await;
                }
                self.forget(&id)?;
                Err(ApiError::InvalidParameter(format!("image: {message}")))
            }
            Some(Ok(())) => {
                let _ = tokio::time::timeout(self.cfg.create_wait, done_rx).await;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Lets the request of create `id` answer (with the state its record shows now), and
    /// gives the sandbox up to other operations: once it runs, or its task ended. Once per
    /// create ([`Lifecycle::start_create`]); nothing for creates no request waits for (a
    /// restart's, a takeover's), which stay busy until their task ends.
    /// True when it did (the sandbox is no longer this task's alone).
    fn answer_create(&self, id: &str) -> bool {
        let waiter = self.create_answers.take(id);
        match waiter {
            Some(waiter) => {
                self.release(id);
                let _ = waiter.send(());
                true
            }
            None => false,
        }
    }

    /// The create: resolve the image, start in the reserved slot, record the placement. With
    /// `image_tx` a waiting request takes an image failure over (it answers 400).
    async fn run_create(
        self: &Arc<Self>,
        id: &str,
        plan: CreatePlan,
        image_tx: Option<oneshot::Sender<ImageOutcome>>,
    ) {
        if let Some(snapshot) = plan.snapshot_id.clone() {
            // Nothing to resolve: the snapshot holds the rootfs and the processes.
            if let Some(tx) = image_tx {
                let _ = tx.send(Ok(()));
            }
            self.run_clone(id, &snapshot, plan).await;
            return;
        }
        let auth = plan.image.auth.as_ref().and_then(|a| {
            Some(RegistryCredentials {
                username: a.username.clone()?,
                password: a.password.clone().unwrap_or_default(),
            })
        });
        let node = match self.record(id).and_then(|r| self.node(r.node.as_deref())) {
            Ok(node) => node,
            Err(e) => {
                // The record is gone (deleted) or names a node this server no longer has.
                if let Some(tx) = image_tx {
                    let _ = tx.send(Ok(()));
                }
                self.fail(id, START_FAILED, &e.to_string()).await;
                return;
            }
        };
        let resolved = node
            .resolve_image(&plan.image.uri, auth)
            .await
            .map_err(|e| e.to_string());
        let outcome = resolved.as_ref().map(drop).map_err(Clone::clone);
        let handed_over = match image_tx {
            Some(tx) => tx.send(outcome).is_ok(),
            None => false,
        };
        let image = match resolved {
            Ok(image) => image,
            Err(_) if handed_over => return,
            Err(message) => {
                self.fail(id, IMAGE_FAILED, &message).await;
                return;
            }
        };
        // Recorded with the start (one durable write less on the create path).
        let image_event = format!("{} ({})", image.canonical_reference, image.digest);
        let Ok(record) = self.record(id) else {
            return;
        };
        if record.state() != SandboxState::Pending {
            // Deleted or expired while the image was prepared (unless another server took
            // the create over meanwhile: the sandbox is its now).
            if self.still_acting(&record).is_ok() {
                self.remove_now(id).await;
            }
            return;
        }
        let Some(slot) = record.slot else {
            self.fail(id, START_FAILED, "no slot was reserved").await;
            return;
        };
        let recipe = match &plan.template_id {
            Some(template) => match self.golden_recipe_of(template) {
                Ok(recipe) => Some(recipe),
                Err(e) => {
                    self.fail(id, START_FAILED, &e.to_string()).await;
                    return;
                }
            },
            None => None,
        };
        let mut env = image.env.clone();
        env.extend(plan.env.iter().map(|(k, v)| format!("{k}={v}")));
        let spec = PlaceSpec {
            id: id.to_string(),
            image,
            // A template's entrypoint is its warm-up command: it runs in the golden
            // checkpoint already, so the claim starts nothing.
            entrypoint: match &recipe {
                Some(_) => Vec::new(),
                None => plan.entrypoint.clone(),
            },
            template: plan
                .template_id
                .clone()
                .zip(recipe)
                .map(|(key, recipe)| TemplateChoice { key, recipe }),
            use_pool: plan
                .extensions
                .as_ref()
                .and_then(|e| e.get(POOL_EXTENSION))
                .is_none_or(|v| v != "off"),
            env,
            volumes: plan.volumes.clone(),
            volume_keys: plan.volume_keys.clone(),
            // Validated when the create was planned.
            isolation: super::plan::isolation_of(plan.extensions.as_ref()).unwrap_or(false),
            common: SandboxSettings {
                limits: plan.limits,
                disk_bytes: plan.disk_bytes,
                tokens: record.tokens(),
                policy: plan.policy.clone(),
                credential_proxy: plan.credential_proxy,
            },
        };
        let placed = node.place(spec, slot).await;
        self.finish_start(id, slot, placed, Some(&image_event))
            .await;
    }

    /// Records how a start into reserved slot `slot` ended: `Running` at its placement (and
    /// the reserved slot released when it runs in another), or `Failed` with the error.
    /// Nothing, when another server took the create over meanwhile (this one was stopped or
    /// cut off long enough to pass for gone): the sandbox is that server's now, and its
    /// restart of the create removes what this start left on the node, by the sandbox's id.
    pub(super) async fn finish_start(
        self: &Arc<Self>,
        id: &str,
        slot: u32,
        placed: NodeResult<Placed>,
        image_event: Option<&str>,
    ) {
        match placed {
            Ok(Placed { placement, report }) => {
                self.start_metrics.record(&report);
                let address = placement.address;
                let node_name = self.record(id).ok().and_then(|r| r.node);
                // Answered (and no longer busy) once this server's cache shows it running,
                // before that is durable: a create waits for one durable write (its intent)
                // and one node call. Should this server die before the write lands, the
                // create is taken over from its intent like any unfinished one.
                // Meanwhile a change made here from the version shown (a delete, a pause)
                // may land first: it carries the placement, and this start is recorded.
                let mut recorded_meanwhile = false;
                let change = |r: &mut SandboxRecord| {
                    if r.placement.as_ref() == Some(&placement) {
                        recorded_meanwhile = true;
                        return Err(ApiError::Conflict(format!("{id} was changed meanwhile")));
                    }
                    self.still_acting(r)?;
                    if let Some(image_event) = image_event {
                        r.event("ImageReady", image_event);
                    }
                    r.slot = Some(placement.slot);
                    r.placement = Some(placement.clone());
                    r.event("Started", &report.summary);
                    if r.state() == SandboxState::Pending {
                        r.transition(
                            SandboxState::Running,
                            None,
                            &format!("started at {address}"),
                        );
                    }
                    Ok(())
                };
                let mut change = change;
                let mut answered = false;
                let mut updated = self.update_shown_first(id, &mut change, true, |_| {
                    answered = self.answer_create(id);
                });
                // Answered already: a store that does not answer now gets the write when it
                // answers again (for a while; after that, the create is restarted from its
                // intent by recovery, as one whose server died).
                let mut patience = RUNNING_WRITE_PATIENCE;
                while matches!(updated, Err(ApiError::StoreUnavailable(_))) && !patience.is_zero() {
                    tracing::warn!(sandbox = %id, "the state store does not answer: the start is written once it does");
                    tokio::time::sleep(RUNNING_WRITE_RETRY).await;
                    patience = patience.saturating_sub(RUNNING_WRITE_RETRY);
                    updated = self.update_shown_first(id, &mut change, true, |_| {});
                }
                if (updated.is_ok() || recorded_meanwhile) && placement.slot != slot {
                    // Claimed from the pool: the slot reserved at admission is not needed.
                    if let Ok(node) = self.node(node_name.as_deref()) {
                        self.nodes.claimed(node.node_id());
                        node.release_slot(slot).await;
                    }
                }
                if updated.is_ok_and(|r| r.state() != SandboxState::Running) {
                    // Deleted while it started: the removal was left to this task. Once the
                    // create has answered, the sandbox is not this task's alone any more:
                    // the removal is claimed like any other (one at a time).
                    match answered {
                        true => self.start_removal(id),
                        false => self.remove_now(id).await,
                    }
                }
            }
            Err(e) => match self.refresh(id).and_then(|r| self.still_acting(&r)) {
                Err(stale @ ApiError::Conflict(_)) => {
                    tracing::warn!(sandbox = %id, error = %e, "{stale}: its failed start is not recorded")
                }
                _ => self.fail(id, START_FAILED, &e.to_string()).await,
            },
        }
    }

    /// Conflict unless this server still acts on `r`: no other server took its operation
    /// over ([`Lifecycle::take_over`]), and the operation did not end meanwhile.
    pub(super) fn still_acting(&self, r: &SandboxRecord) -> Result<(), ApiError> {
        match r.acting.as_deref() {
            Some(me) if me == self.cluster.id() => Ok(()),
            Some(other) => Err(ApiError::Conflict(format!(
                "server {other} took the operation on sandbox {} over",
                r.id
            ))),
            None => Err(ApiError::Conflict(format!(
                "the operation on sandbox {} ended meanwhile ({})",
                r.id,
                r.state()
            ))),
        }
    }

    /// Records a failure and removes whatever the sandbox had on the node. A sandbox being
    /// deleted (`Stopping`) keeps going to `Terminated`, and one that ended stays as it
    /// ended: the failure is an event. Nothing, when another server acts on it.
    pub(super) async fn fail(self: &Arc<Self>, id: &str, reason: &str, message: &str) {
        tracing::warn!(sandbox = %id, reason, message, "sandbox failed");
        if self
            .update(id, |r| {
                // Another server's operation (it took this one over, or runs its own): the
                // failure is not this server's to record, nor the removal its to make.
                if self.acted_on_elsewhere(r) {
                    return Err(ApiError::Conflict(format!(
                        "{id} is another server's meanwhile"
                    )));
                }
                match r.state() {
                    SandboxState::Stopping => {
                        r.event("FailedWhileStopping", &format!("{reason}: {message}"))
                    }
                    // Ended meanwhile (a delete finished first): it stays as it ended.
                    state if state.is_final() => {
                        r.event("FailedAfterItsEnd", &format!("{reason}: {message}"))
                    }
                    _ => r.transition(SandboxState::Failed, Some(reason), message),
                }
                Ok(())
            })
            .is_ok()
        {
            self.remove_now(id).await;
        }
    }

    /// Spawns the removal of `id` unless a task already works on it.
    pub(super) fn start_removal(self: &Arc<Self>, id: &str) {
        if !self.claim(id) {
            return;
        }
        let this = self.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            this.remove_now(&id).await;
            this.release(&id);
        });
    }

    /// Removes the sandbox from its node; `Stopping` becomes `Terminated`, a failed sandbox
    /// keeps its state. A failing removal leaves the record as it was, for the reconciler to
    /// retry.
    pub(super) async fn remove_now(self: &Arc<Self>, id: &str) {
        let Ok(record) = self.record(id) else { return };
        if record.placement.is_none() && record.slot.is_none() && record.state().is_final() {
            return;
        }
        let removed = match self.node(record.node.as_deref()) {
            Ok(node) => node
                .remove(id, record.placement.as_ref(), record.slot)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if removed.is_ok() {
            self.drop_pause_checkpoint(id).await;
        }
        let result = self.update(id, |r| {
            match &removed {
                Ok(report) => {
                    r.placement = None;
                    r.slot = None;
                    let message = format!(
                        "processes gone after {} ms, slot and files released after {} ms",
                        report.processes_gone_ms, report.total_ms
                    );
                    if r.state().is_final() {
                        r.event("Removed", &message);
                    } else {
                        r.transition(SandboxState::Terminated, None, &message);
                    }
                }
                Err(e) => r.event("RemoveFailed", e),
            }
            Ok(())
        });
        if let Err(e) = result {
            tracing::warn!(sandbox = %id, error = %e, "could not record the removal");
        }
    }

    /// One pass of the reconciler.
    pub async fn reconcile(self: &Arc<Self>) {
        let now = Utc::now();
        let retention = chrono::Duration::from_std(self.cfg.retention).unwrap_or_default();
        self.declare_lost_nodes();
        self.collect_idempotency_keys();
        self.compact_history();
        self.release_forgotten_admissions().await;
        for node in self.nodes.take_rejoined() {
            // A node that registered again (it restarted) holds its sandboxes' slots until
            // it is told which are still its own.
            let (adopted, lost, restarted) = self.recover_node(&node).await;
            tracing::info!(node = %node, adopted, lost, restarted, "took back the sandboxes of a node that registered again");
        }
        self.recover_deferred().await;
        self.take_over_snapshots().await;
        for record in self.snapshot() {
            if self.busy.lock().expect("busy lock").contains(&record.id) {
                continue;
            }
            // Another server's operation: its own, while that server lives; the leader's
            // to finish once it is gone.
            if let Some(actor) = record.acting.as_deref()
                && actor != self.cluster.id()
            {
                if self.cluster.is_gone(actor) {
                    self.take_over(&record).await;
                }
                continue;
            }
            // Nothing is asked of a lost node until it renews its lease; what the server
            // decides alone (expiry, forgetting what holds nothing there) goes on.
            let lost = self.node_is_lost(record.node.as_deref());
            if !record.moved_from.is_empty() {
                self.clean_moved(&record.id).await;
            }
            // A resume asked for during a pause that ended without starting it (a restart,
            // or a race with the pause's end); not of a sandbox whose time is up. One that
            // starts is the resume's from here on.
            if record.resume_after_pause
                && record.expires_at.is_none_or(|t| t > now)
                && self.resume_if_asked(&record.id)
            {
                continue;
            }
            let id = record.id.as_str();
            match record.state() {
                SandboxState::Running | SandboxState::Pending | SandboxState::Paused
                    if record.expires_at.is_some_and(|t| t <= now) =>
                {
                    // Decided again on the version the write replaces: renewed meanwhile, or
                    // taken by another server's operation (a pause, a resume), it lives on.
                    let expired = self.update(id, |r| {
                        let still_expired = matches!(
                            r.state(),
                            SandboxState::Running | SandboxState::Pending | SandboxState::Paused
                        ) && r.expires_at.is_some_and(|t| t <= now)
                            && !self.acted_on_elsewhere(r);
                        if !still_expired {
                            return Err(ApiError::Conflict(format!("{} changed meanwhile", r.id)));
                        }
                        r.transition(SandboxState::Stopping, Some(EXPIRED), "the sandbox expired");
                        Ok(())
                    });
                    if expired.is_ok() && !lost {
                        self.start_removal(id);
                    }
                }
                // On a lost node only a final record that holds nothing there may go.
                state
                    if lost
                        && !(state.is_final()
                            && record.placement.is_none()
                            && record.slot.is_none()
                            && record.moved_from.is_empty()
                            && record.paused_checkpoint.is_none()
                            && record.resumed_from.is_none()) => {}
                SandboxState::Running
                    if record.placement.is_some() && !self.runs(&record).await =>
                {
                    // Killed because its memory never came (a lazy resume's transfer failed):
                    // paused again on the checkpoint it was resumed from, when that is kept.
                    if self.pause_again(&record).await {
                        continue;
                    }
                    let failed = self.update(id, |r| {
                        still_in(r, SandboxState::Running)?;
                        r.transition(
                            SandboxState::Failed,
                            Some(PROCESS_LOST),
                            "the sandbox's processes are gone",
                        );
                        Ok(())
                    });
                    if failed.is_ok() {
                        self.start_removal(id);
                    }
                }
                SandboxState::Stopping => self.start_removal(id),
                state
                    if state.is_final()
                        && (record.placement.is_some() || record.slot.is_some()) =>
                {
                    self.start_removal(id)
                }
                state
                    if state.is_final()
                        && record
                            .status
                            .last_transition_at
                            .is_some_and(|t| t + retention <= now) =>
                {
                    if let Err(e) = self.forget(id) {
                        tracing::warn!(sandbox = %id, error = %e, "garbage collection failed");
                    }
                }
                _ => {}
            }
        }
    }

    /// Whether `record`'s processes still run on its node (`false` without a placement;
    /// `true` on a node this server does not have: nothing is known of them).
    pub(super) async fn runs(&self, record: &SandboxRecord) -> bool {
        match (&record.placement, self.node(record.node.as_deref())) {
            (Some(p), Ok(node)) => node.is_alive(p).await,
            (Some(_), Err(_)) => true,
            (None, _) => false,
        }
    }

    /// Runs [`Lifecycle::reconcile`] forever, while this server leads the reconcilers, its
    /// writes fenced by the leadership (refused once it passed on).
    pub async fn reconcile_forever(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.cfg.reconcile_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !self.cluster.is_leader() {
                self.refresh_node_leases();
                self.finish_own_removals();
                continue;
            }
            let fence = self.cluster.fence();
            crate::store::FENCE.scope(fence, self.reconcile()).await;
        }
    }

    /// Starts the removals of this server's deletions that an operation of its held off (a
    /// delete during a pause this server drives): the leader leaves another live server's
    /// operations to it. A sandbox still busy is tried again at the next tick; nothing is
    /// asked of a lost node.
    fn finish_own_removals(self: &Arc<Self>) {
        let me = self.cluster.id();
        for record in self.snapshot() {
            if record.state() == SandboxState::Stopping
                && record.acting.as_deref() == Some(me)
                && !self.node_is_lost(record.node.as_deref())
            {
                self.start_removal(&record.id);
            }
        }
    }

    /// Finishes the operation a server that is gone left in flight on `record` (a create,
    /// pause, resume or removal), as a restart of that server would.
    async fn take_over(self: &Arc<Self>, record: &SandboxRecord) {
        let (id, gone) = (
            record.id.as_str(),
            record.acting.clone().unwrap_or_default(),
        );
        let me = self.cluster.id().to_string();
        let taken = self.update(id, |r| {
            if r.acting.as_deref() != Some(gone.as_str()) {
                return Err(ApiError::Conflict(format!("{id} changed hands")));
            }
            r.acting = Some(me.clone());
            r.event(
                "TakenOver",
                &format!("server {gone} is gone: server {me} finishes its operation"),
            );
            Ok(())
        });
        let Ok(record) = taken else {
            return;
        };
        tracing::warn!(sandbox = %id, server = %gone, state = %record.state(), "taking over the operation of a server that is gone");
        match record.state() {
            SandboxState::Stopping => self.start_removal(id),
            _ => {
                self.recover_records(|r| r.id == id).await;
            }
        }
    }

    /// After a restart: re-adopts sandboxes whose processes are alive, fails those whose
    /// processes are gone (`PROCESS_LOST`), and restarts interrupted creates from a clean
    /// slot. Returns (adopted, lost, restarted).
    /// Another server's operations in flight are left to it (or, once it is gone, to the
    /// leader).
    pub async fn recover(self: &Arc<Self>) -> (usize, usize, usize) {
        let me = self.cluster.id().to_string();
        let counts = self
            .recover_records(|r| r.acting.as_deref().is_none_or(|a| a == me))
            .await;
        self.recover_templates();
        counts
    }

    /// [`Lifecycle::recover`] for the sandboxes of node `node_id` (it restarted).
    pub async fn recover_node(self: &Arc<Self>, node_id: &str) -> (usize, usize, usize) {
        // A start, pause or resume still running ends by itself (its call to the node answers
        // or fails): recovering it now would run it twice. Its slot is claimed at once (the
        // restarted node must not hand it out), and it is recovered once the operation ended
        // ([`Lifecycle::recover_deferred`]). Running sandboxes are adopted whatever else
        // happens to them (an adoption changes nothing of theirs).
        let in_flight =
            |r: &SandboxRecord| r.state() != SandboxState::Running && self.operation_in_flight(r);
        let on_node = |r: &SandboxRecord| self.node_name(r.node.as_deref()) == node_id;
        for record in self
            .snapshot()
            .into_iter()
            .filter(|r| on_node(r) && in_flight(r))
        {
            if let (Ok(node), Some(slot)) = (self.node(record.node.as_deref()), record.slot) {
                node.claim_slot(slot).await;
            }
            self.deferred_recovery
                .lock()
                .expect("deferred lock")
                .insert(record.id);
        }
        self.recover_records(|r| on_node(r) && !in_flight(r)).await
    }

    /// Whether another server drives an operation on `r` (a create, pause, resume or
    /// removal through it): it ends it, or the leader takes it over once that server is gone.
    pub(super) fn acted_on_elsewhere(&self, r: &SandboxRecord) -> bool {
        r.acting.as_deref().is_some_and(|a| a != self.cluster.id())
    }

    /// Whether an operation on `r` runs: a task of this server's, or another server's.
    fn operation_in_flight(&self, r: &SandboxRecord) -> bool {
        self.busy.lock().expect("busy lock").contains(&r.id) || self.acted_on_elsewhere(r)
    }

    /// Recovers the sandboxes [`Lifecycle::recover_node`] deferred whose operation ended.
    async fn recover_deferred(self: &Arc<Self>) {
        let deferred: Vec<String> = {
            let deferred = self.deferred_recovery.lock().expect("deferred lock");
            deferred.iter().cloned().collect()
        };
        let ready: HashSet<String> = deferred
            .into_iter()
            .filter(|id| {
                !self.busy.lock().expect("busy lock").contains(id)
                    && !self.record(id).is_ok_and(|r| self.acted_on_elsewhere(&r))
            })
            .collect();
        self.deferred_recovery
            .lock()
            .expect("deferred lock")
            .retain(|id| !ready.contains(id));
        if !ready.is_empty() {
            self.recover_records(|r| ready.contains(&r.id)).await;
        }
    }

    async fn recover_records(
        self: &Arc<Self>,
        which: impl Fn(&SandboxRecord) -> bool,
    ) -> (usize, usize, usize) {
        let (mut adopted, mut lost, mut restarted) = (0, 0, 0);
        for record in self.snapshot().into_iter().filter(|r| which(r)) {
            let id = record.id.clone();
            let node = match self.node(record.node.as_deref()) {
                Ok(node) => node,
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "not recovered: its node is not known to this server");
                    continue;
                }
            };
            match (record.state(), &record.placement) {
                (SandboxState::Running, Some(p)) => {
                    let adoption = node
                        .adopt(
                            &id,
                            p,
                            &record.tokens(),
                            &record.policy(),
                            record.credential_proxy,
                        )
                        .await;
                    if adoption == Adoption::MemoryIncomplete
                        && let Some(record) = self.resume_again(&record, p.slot).await
                    {
                        restarted += 1;
                        self.recover_paused(record).await;
                        continue;
                    }
                    let lost_because = match adoption {
                        Adoption::Adopted => None,
                        Adoption::Gone => {
                            Some("the sandbox's processes were gone after a server restart")
                        }
                        Adoption::MemoryIncomplete => Some(
                            "the sandbox's memory was still being copied in when the server stopped",
                        ),
                    };
                    match lost_because {
                        None => {
                            adopted += 1;
                            let _ = self.update(&id, |r| {
                                r.event("Adopted", "re-adopted after a server restart");
                                // Its memory is in place: the checkpoint it was resumed
                                // from is no longer needed (removed as unreferenced).
                                r.resumed_from = None;
                                Ok(())
                            });
                        }
                        Some(message) => {
                            lost += 1;
                            let _ = self.update(&id, |r| {
                                // A deletion meanwhile goes on to its end.
                                if !r.state().is_final() && r.state() != SandboxState::Stopping {
                                    r.transition(SandboxState::Failed, Some(PROCESS_LOST), message);
                                }
                                Ok(())
                            });
                            // What is left (a frozen clone's processes too) goes now.
                            self.start_removal(&id);
                        }
                    }
                }
                (SandboxState::Pausing | SandboxState::Resuming, _) => {
                    restarted += 1;
                    self.recover_paused(record).await;
                }
                (SandboxState::Pending, _) => {
                    if let Some(slot) = record.slot {
                        node.claim_slot(slot).await;
                    }
                    restarted += 1;
                    self.restart_create(record);
                }
                _ => {
                    if let Some(slot) = record.placement.as_ref().map(|p| p.slot).or(record.slot) {
                        node.claim_slot(slot).await;
                    }
                }
            }
        }
        (adopted, lost, restarted)
    }

    /// A sandbox lazily resumed whose memory transfer a restart cut short: `Resuming` again
    /// from the checkpoint it was resumed from, when this node still has it (the caller
    /// then resumes it). `None` when it cannot be (a clone: it has no checkpoint of its own).
    async fn resume_again(&self, record: &SandboxRecord, slot: u32) -> Option<SandboxRecord> {
        let key = record.resumed_from.clone()?;
        if !self
            .node(record.node.as_deref())
            .ok()?
            .has_snapshot(&key)
            .await
        {
            return None;
        }
        self.update(&record.id, |r| {
            still_in(r, record.state())?;
            r.transition(
                SandboxState::Resuming,
                None,
                "a restart cut its memory transfer short: resuming it again",
            );
            r.paused_checkpoint = Some(key.clone());
            r.resumed_from = None;
            r.slot = Some(slot);
            Ok(())
        })
        .ok()
    }

    /// Sandbox `record`, whose processes are gone, `Paused` again on the checkpoint it was
    /// resumed from if its node still has it (its memory transfer failed, so the node kept
    /// it): what it left on the node goes, its slot (its address) stays. False otherwise.
    async fn pause_again(self: &Arc<Self>, record: &SandboxRecord) -> bool {
        let (Some(key), Some(placement)) = (&record.resumed_from, &record.placement) else {
            return false;
        };
        let Ok(node) = self.node(record.node.as_deref()) else {
            return false;
        };
        if !node.has_snapshot(key).await || !self.claim(&record.id) {
            return false;
        }
        // Read again from the store before the node is touched: another server may have
        // begun an operation on it since this pass began (a pause kills the processes too).
        let unchanged = self.refresh(&record.id).is_ok_and(|r| {
            r.state() == record.state() && r.acting.is_none() && r.placement == record.placement
        });
        if !unchanged {
            self.release(&record.id);
            return false;
        }
        let released = node
            .release_keeping_address(&record.id, Some(placement), placement.slot)
            .await;
        let paused = released.is_ok()
            && self
                .update(&record.id, |r| {
                    still_in(r, record.state())?;
                    r.transition(
                        SandboxState::Paused,
                        Some(RESUME_FAILED),
                        "its memory could not be fetched: paused again; resume it to retry",
                    );
                    r.paused_checkpoint = Some(key.clone());
                    r.resumed_from = None;
                    r.placement = None;
                    r.slot = Some(placement.slot);
                    Ok(())
                })
                .is_ok();
        self.release(&record.id);
        paused
    }

    /// A create interrupted by a crash: whatever it left is removed, then it runs again.
    fn restart_create(self: &Arc<Self>, record: SandboxRecord) {
        let id = record.id.clone();
        self.claim(&id);
        let this = self.clone();
        tokio::spawn(async move {
            // Whatever the interrupted start left goes; its slot stays the sandbox's (a
            // removal would give the slot back when its teardown ends: under the new start).
            let cleaned = match (this.node(record.node.as_deref()), record.slot) {
                (Ok(node), Some(slot)) => node
                    .release_keeping_address(&id, record.placement.as_ref(), slot)
                    .await
                    .map_err(|e| e.to_string()),
                (Ok(node), None) => node
                    .remove(&id, record.placement.as_ref(), None)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string()),
                (Err(e), _) => Err(e.to_string()),
            };
            let plan = recorded_limits(&record.resource_limits, &this.cfg.resources)
                .map(|(limits, disk_bytes)| CreatePlan {
                    image: record.image.clone(),
                    entrypoint: record.entrypoint.clone(),
                    env: record.env.clone(),
                    metadata: record.metadata.clone(),
                    resource_limits: record.resource_limits.clone(),
                    limits,
                    disk_bytes,
                    timeout_secs: None,
                    extensions: record.extensions.clone(),
                    template_id: record.template_id.clone(),
                    policy: record.policy(),
                    snapshot_id: record.snapshot_id.clone(),
                    secure_access: record.secure_access.is_some(),
                    volumes: record.volumes.clone(),
                    // Never recorded: a restarted create of object-storage volumes fails
                    // on the node, which has no keys for them.
                    volume_keys: Default::default(),
                    credential_proxy: record.credential_proxy,
                })
                // The operator may have withdrawn the image's directory since.
                .and_then(|plan| this.check_local_image(&plan.image.uri).map(|()| plan));
            match (cleaned, plan) {
                (Ok(()), Ok(plan)) => {
                    let _ = this.update(&id, |r| {
                        r.event(
                            "CreateRestarted",
                            "the create was interrupted by a server restart",
                        );
                        Ok(())
                    });
                    this.run_create(&id, plan, None).await;
                }
                (Err(e), _) => this.fail(&id, START_FAILED, &e).await,
                (_, Err(e)) => this.fail(&id, START_FAILED, &e.to_string()).await,
            }
            this.release(&id);
        });
    }
}
