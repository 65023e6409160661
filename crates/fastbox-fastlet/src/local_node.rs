//! [`LocalNode`]: the in-process node, the [`NodeAgent`] that `fastbox up` hands the lifecycle
//! server. Every call is a direct call into this process's [`Fastlet`] (no extra hop), its
//! blocking work on a thread of its own ([`crate::blocking`]), as the server ran it before the
//! node boundary existed.
//!
//! Besides the fastlet it holds what the boundary keeps on the node side between calls: the
//! images it resolved (a start names its image by digest), the live snapshots staged and not
//! yet committed (a fork's clones restore from them), and the node proxy, which is attached
//! after the node exists (it needs the server's egress and access operations).

mod convert;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use async_trait::async_trait;
use axum::body::Body;
use axum::response::Response;
use fastbox_egress::EgressPolicy;
use fastbox_image::{NoProgress, RegistryAuth, ResolvedImage};
use fastbox_node_api::recipe::{GoldenRecipe, isolation_key};
use fastbox_node_api::wire::{
    Adoption, CheckpointFetch, ImageInfo, NodePlacement, NodeStatus, PlaceSpec, Placed,
    ProxyRefusal, RegistryCredentials, RemoveReport, RestoreSpec, SandboxTokens, SnapshotReport,
    SnapshotSource, TemplateBuilt, Unsigned, UnusedAdmission,
};
use fastbox_node_api::{NodeAgent, NodeError, NodeErrorKind, NodeResult};
use http::{HeaderName, Request};

pub use convert::{to_node_placement, to_placement};

use crate::agent::{Fastlet, PlaceRequest, Placement, StartReport};
use crate::blocking;
use crate::node_proxy::NodeProxy;
use crate::snapshot::StagedSnapshot;
use crate::template::Template;

/// Images kept resolved for starts (by digest). A start whose image is no longer here (after
/// a restart, or after this many others) resolves it again.
pub const RESOLVED_IMAGES: usize = 64;

/// How long an admission waits for a slot that a teardown in flight is about to release,
/// before the node answers that it is full (no wait when no teardown is pending).
pub const ADMISSION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Between two admission attempts while teardowns are pending.
const ADMISSION_RETRY: std::time::Duration = std::time::Duration::from_millis(10);

/// The in-process node: a [`Fastlet`] behind the [`NodeAgent`] boundary.
pub struct LocalNode {
    fastlet: Arc<Fastlet>,
    node_id: String,
    /// The node proxy, once [`LocalNode::attach_proxy`] gave it.
    proxy: OnceLock<NodeProxy>,
    /// What [`NodeAgent::resolve_image`] answered, by digest.
    images: Mutex<ResolvedImages>,
    /// Live snapshots staged and not yet committed, by key.
    staged: Mutex<HashMap<String, StagedSnapshot>>,
    /// Slots admitted that no call named since, and when (`NodeStatus::unused_admissions`).
    admitted: Mutex<BTreeMap<u32, Instant>>,
    /// The node's delivery counters, when it has any (`NodeStatus::delivery`).
    delivery: Option<DeliveryCounters>,
    /// Starts, pauses, live snapshots, releases and removals of the sandbox in one slot run
    /// one after the other ([`LocalNode::in_turn`]).
    one_at_a_time: crate::one_at_a_time::OneAtATime,
}

/// Reads a node's delivery counters by name.
pub type DeliveryCounters = Arc<dyn Fn() -> Option<BTreeMap<String, u64>> + Send + Sync>;

impl LocalNode {
    /// The node `node_id` running `fastlet`. Its node proxy is attached afterwards.
    pub fn new(fastlet: Arc<Fastlet>, node_id: String) -> Self {
        Self {
            fastlet,
            node_id,
            proxy: OnceLock::new(),
            images: Mutex::new(ResolvedImages::default()),
            staged: Mutex::new(HashMap::new()),
            admitted: Mutex::new(BTreeMap::new()),
            delivery: None,
            one_at_a_time: Default::default(),
        }
    }

    /// The same, reporting the delivery counters `counters` reads in its status.
    pub fn with_delivery(mut self, counters: DeliveryCounters) -> Self {
        self.delivery = Some(counters);
        self
    }

    /// Runs `work` on a thread of its own ([`blocking::run`]) in the turn of the sandbox in
    /// slot `slot`. The turn moves into the thread: when this call is dropped (a remote
    /// server hung up or died mid-call) the work goes on, and the next operation on the slot
    /// still waits for it to end.
    async fn in_turn<T, F>(&self, slot: Option<u32>, name: &str, work: F) -> T
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let turn = match slot {
            Some(slot) => Some(self.one_at_a_time.turn(slot).await),
            None => None,
        };
        blocking::run(name, move || {
            let _turn = turn;
            work()
        })
        .await
    }

    /// Slot `slot` was admitted now.
    fn admitted(&self, slot: u32) {
        self.admitted
            .lock()
            .expect("admitted lock")
            .insert(slot, Instant::now());
    }

    /// A call named slot `slot`: its admission, if any, is used.
    fn used(&self, slot: u32) {
        self.admitted.lock().expect("admitted lock").remove(&slot);
    }

    /// The fastlet behind this node (its background threads, recovery and shutdown are
    /// `fastbox up`'s business, not the server's).
    pub fn fastlet(&self) -> &Arc<Fastlet> {
        &self.fastlet
    }

    /// Attaches the node proxy through which [`NodeAgent::proxy`] forwards. Before it is
    /// attached, proxying is refused. Only the first proxy attached is kept.
    pub fn attach_proxy(&self, proxy: NodeProxy) {
        if self.proxy.set(proxy).is_err() {
            tracing::warn!(node = %self.node_id, "a node proxy is attached already: the new one is ignored");
        }
    }

    /// The image of `spec`: the one [`NodeAgent::resolve_image`] resolved, or, when it is no
    /// longer held (a restart since), resolved again from its canonical reference, which
    /// must still be the same image.
    async fn image_of(&self, spec: &PlaceSpec) -> NodeResult<ResolvedImage> {
        if let Some(image) = self
            .images
            .lock()
            .expect("images lock")
            .get(&spec.image.digest)
        {
            return Ok(image);
        }
        let fastlet = self.fastlet.clone();
        let reference = spec.image.canonical_reference.clone();
        let image = blocking::run("fastbox-image", move || {
            fastlet.resolve_image(&reference, None, &NoProgress)
        })
        .await?;
        if image.digest != spec.image.digest {
            return Err(NodeError::new(
                NodeErrorKind::BadImage,
                format!(
                    "{}: the image changed since it was resolved ({} then, {} now)",
                    spec.image.canonical_reference, spec.image.digest, image.digest
                ),
            ));
        }
        self.images.lock().expect("images lock").put(image.clone());
        Ok(image)
    }

    /// Takes staged snapshot `key` out of the map; it is dropped (its staged files removed
    /// once no clone reads them) off the async threads.
    async fn drop_staged(&self, key: &str) {
        let staged = self.staged.lock().expect("staged lock").remove(key);
        if let Some(staged) = staged {
            blocking::run("fastbox-snapshot", move || drop(staged)).await;
        }
    }
}

/// A started sandbox as the boundary carries it.
fn placed(started: (Placement, StartReport)) -> NodeResult<Placed> {
    let (placement, report) = started;
    Ok(Placed {
        placement: to_node_placement(&placement)?,
        report: convert::start_report(&report),
    })
}

/// What the fastlet needs to restore checkpoint `checkpoint` (a snapshot's or a pause's) as
/// `spec.id`: its rootfs is the checkpoint's, and nothing is started next to execd.
fn restore_request(spec: &RestoreSpec, checkpoint: &Template) -> PlaceRequest {
    PlaceRequest {
        id: spec.id.clone(),
        rootfs: checkpoint.rootfs.clone(),
        entrypoint: Vec::new(),
        env: spec.env.clone(),
        limits: spec.common.limits,
        disk_bytes: spec.common.disk_bytes,
        execd_token: spec.common.tokens.execd.clone(),
        egress_token: spec.common.tokens.egress.clone(),
        policy: spec.common.policy.clone(),
        volumes: spec.volumes.clone(),
        volume_keys: Default::default(),
        credential_proxy: spec.common.credential_proxy,
    }
}

/// A [`SnapshotSource`] with the placement read as this node's, owned so it can move to a
/// runtime thread.
struct Source {
    key: String,
    placement: Placement,
    execd_token: String,
    image_reference: String,
    volumes: Vec<fastbox_node_api::wire::VolumeMount>,
}

impl Source {
    fn of(source: &SnapshotSource) -> NodeResult<Self> {
        Ok(Self {
            key: source.key.clone(),
            placement: to_placement(&source.placement)?,
            execd_token: source.execd_token.clone(),
            image_reference: source.image_reference.clone(),
            volumes: source.volumes.clone(),
        })
    }

    fn as_source(&self) -> crate::snapshot::SnapshotSource<'_> {
        crate::snapshot::SnapshotSource {
            key: &self.key,
            placement: &self.placement,
            execd_token: &self.execd_token,
            image_reference: &self.image_reference,
            volumes: &self.volumes,
        }
    }
}

/// The error of a checkpoint this node does not have.
fn no_checkpoint(what: &str, key: &str) -> NodeError {
    NodeError::not_found(format!("{what} {key}: this node does not have it"))
}

#[async_trait]
impl NodeAgent for LocalNode {
    fn node_id(&self) -> &str {
        &self.node_id
    }

    async fn admit(&self) -> NodeResult<u32> {
        let deadline = tokio::time::Instant::now() + ADMISSION_WAIT;
        loop {
            match self.fastlet.reserve_slot() {
                Ok(slot) => {
                    self.admitted(slot);
                    return Ok(slot);
                }
                Err(e)
                    if self.fastlet.teardowns_pending() == 0
                        || tokio::time::Instant::now() >= deadline =>
                {
                    return Err(e.into());
                }
                Err(_) => tokio::time::sleep(ADMISSION_RETRY).await,
            }
        }
    }

    /// The server gives back a slot it admitted and never used. Never one that holds
    /// something: a stale release (a server that was stopped, then woke up after another
    /// took its work over) would free the slot under its holder, whose address the next
    /// sandbox would then share. It waits for a start in the slot to end first.
    async fn release_slot(&self, slot: u32) {
        self.used(slot);
        let fastlet = self.fastlet.clone();
        self.in_turn(Some(slot), "fastbox-release", move || {
            match fastlet.slot_holder(slot) {
                Some(holder) => {
                    tracing::warn!(slot, holder = %holder, "a release of an admitted slot that holds a sandbox: refused")
                }
                None => fastlet.release_slot(slot),
            }
        })
        .await
    }

    async fn claim_slot(&self, slot: u32) {
        self.used(slot);
        self.fastlet.claim_slot(slot);
    }

    async fn release_unused_admission(&self, slot: u32, min_age_ms: u64) -> bool {
        let mut admitted = self.admitted.lock().expect("admitted lock");
        let old_enough = admitted
            .get(&slot)
            .is_some_and(|at| at.elapsed().as_millis() as u64 >= min_age_ms);
        if old_enough && self.fastlet.slot_holder(slot).is_none() {
            admitted.remove(&slot);
            // Under the lock: no call can use the admission meanwhile.
            self.fastlet.release_slot(slot);
        }
        old_enough
    }

    fn check_image(&self, reference: &str) -> NodeResult<()> {
        Ok(self.fastlet.check_image(reference)?)
    }

    async fn resolve_image(
        &self,
        reference: &str,
        auth: Option<RegistryCredentials>,
    ) -> NodeResult<ImageInfo> {
        let fastlet = self.fastlet.clone();
        let r = reference.to_string();
        let auth = auth.map(|a| RegistryAuth::new(a.username, a.password));
        let image = blocking::run("fastbox-image", move || {
            fastlet.resolve_image(&r, auth.as_ref(), &NoProgress)
        })
        .await?;
        let info = ImageInfo {
            reference: reference.to_string(),
            canonical_reference: image.canonical_reference.clone(),
            digest: image.digest.clone(),
            env: image.config.env.clone(),
        };
        self.images.lock().expect("images lock").put(image);
        Ok(info)
    }

    async fn place(&self, spec: PlaceSpec, slot: u32) -> NodeResult<Placed> {
        self.used(slot);
        let image = self.image_of(&spec).await?;
        let req = PlaceRequest {
            id: spec.id.clone(),
            rootfs: image.rootfs.clone(),
            entrypoint: spec.entrypoint,
            env: spec.env,
            limits: spec.common.limits,
            disk_bytes: spec.common.disk_bytes,
            execd_token: spec.common.tokens.execd,
            egress_token: spec.common.tokens.egress,
            policy: spec.common.policy,
            volumes: spec.volumes,
            volume_keys: spec.volume_keys,
            credential_proxy: spec.common.credential_proxy,
        };
        let (template_choice, use_pool) = (spec.template, spec.use_pool);
        let isolation = spec.isolation;
        let fastlet = self.fastlet.clone();
        let started = self
            .in_turn(Some(slot), "fastbox-place", move || {
                let template = match (&template_choice, isolation) {
                    (Some(choice), false) => {
                        fastlet.template_for(&choice.key, &image, &choice.recipe)?
                    }
                    (None, false) => fastlet.template(&image)?,
                    (choice, true) => {
                        let (key, mut recipe) = match choice {
                            Some(c) => (c.key.clone(), c.recipe.clone()),
                            None => (image.digest.clone(), crate::agent::image_recipe(&image)),
                        };
                        recipe.isolation = true;
                        fastlet.template_for(&isolation_key(&key), &image, &recipe)?
                    }
                };
                fastlet.register_template(&template);
                if use_pool && let Some(claimed) = fastlet.claim_pooled(&template, &req) {
                    return claimed;
                }
                fastlet.restore_from(&template, &req, slot)
            })
            .await?;
        placed(started)
    }

    async fn clone_snapshot(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        self.used(slot);
        // A fork's clones restore from the staged dump, before it is on disk.
        let staged = self
            .staged
            .lock()
            .expect("staged lock")
            .get(key)
            .map(|s| s.template().clone());
        let fastlet = self.fastlet.clone();
        let key = key.to_string();
        let started = self
            .in_turn(Some(slot), "fastbox-place", move || {
                let snapshot = staged
                    .or_else(|| fastlet.load_snapshot(&key))
                    .ok_or_else(|| no_checkpoint("snapshot", &key))?;
                let req = restore_request(&spec, &snapshot);
                Ok::<_, NodeError>(fastlet.clone_snapshot(&snapshot, &req, slot)?)
            })
            .await?;
        placed(started)
    }

    async fn resume(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        self.used(slot);
        let fastlet = self.fastlet.clone();
        let key = key.to_string();
        let started = self
            .in_turn(Some(slot), "fastbox-resume", move || {
                let checkpoint = fastlet
                    .load_snapshot(&key)
                    .ok_or_else(|| no_checkpoint("checkpoint", &key))?;
                let req = restore_request(&spec, &checkpoint);
                let resumed = match spec.moved {
                    true => fastlet.resume_moved(&checkpoint, &req, slot),
                    false => fastlet.resume(&checkpoint, &req, slot),
                };
                if resumed.is_err() {
                    // The slot (its address) stays the sandbox's for another resume.
                    let _ = fastlet.release_keeping_address(&spec.id, None, slot);
                }
                Ok::<_, NodeError>(resumed?)
            })
            .await?;
        placed(started)
    }

    async fn is_alive(&self, placement: &NodePlacement) -> bool {
        to_placement(placement).is_ok_and(|p| self.fastlet.is_alive(&p))
    }

    async fn adopt(
        &self,
        id: &str,
        placement: &NodePlacement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        credential_proxy: bool,
    ) -> Adoption {
        self.used(placement.slot);
        let placement = match to_placement(placement) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "not adopted");
                // Its slot is the record's all the same, until the record is removed.
                self.fastlet.claim_slot(placement.slot);
                return Adoption::Gone;
            }
        };
        let fastlet = self.fastlet.clone();
        let (id, tokens, policy) = (id.to_string(), tokens.clone(), policy.clone());
        // It may wait for a memory transfer the last run left, and applies the policy.
        blocking::run("fastbox-adopt", move || {
            fastlet.adopt(&id, &placement, &tokens, &policy, credential_proxy)
        })
        .await
    }

    async fn remove(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: Option<u32>,
    ) -> NodeResult<RemoveReport> {
        if let Some(slot) = slot.or(placement.map(|p| p.slot)) {
            self.used(slot);
        }
        // The slot the sandbox runs in (the placement's: a spare slot may stand in for the
        // one admitted), as a pause of it names it.
        let turn = placement.map(|p| p.slot).or(slot);
        let placement = placement.map(to_placement).transpose()?;
        let fastlet = self.fastlet.clone();
        let id = id.to_string();
        let removed = self
            .in_turn(turn, "fastbox-remove", move || {
                fastlet.remove(&id, placement.as_ref(), slot)
            })
            .await?;
        Ok(convert::remove_report(removed))
    }

    async fn release_keeping_address(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: u32,
    ) -> NodeResult<()> {
        self.used(slot);
        let turn = placement.map_or(slot, |p| p.slot);
        let placement = placement.map(to_placement).transpose()?;
        let fastlet = self.fastlet.clone();
        let id = id.to_string();
        Ok(self
            .in_turn(Some(turn), "fastbox-remove", move || {
                fastlet.release_keeping_address(&id, placement.as_ref(), slot)
            })
            .await?)
    }

    async fn pause(&self, id: &str, source: &SnapshotSource) -> NodeResult<SnapshotReport> {
        let turn = source.placement.slot;
        let source = Source::of(source)?;
        let fastlet = self.fastlet.clone();
        let id = id.to_string();
        let (_, report) = self
            .in_turn(Some(turn), "fastbox-pause", move || {
                fastlet.pause(&id, &source.as_source())
            })
            .await?;
        Ok(convert::snapshot_report(&report))
    }

    async fn finish_interrupted_pause(&self, source: &SnapshotSource) -> bool {
        let fastlet = self.fastlet.clone();
        let Ok(source) = Source::of(source) else {
            // Not a placement of this node: only a committed checkpoint counts.
            let key = source.key.clone();
            return blocking::run("fastbox-pause", move || fastlet.load_snapshot(&key))
                .await
                .is_some();
        };
        blocking::run("fastbox-pause", move || {
            fastlet
                .finish_interrupted_pause(&source.as_source())
                .is_some()
        })
        .await
    }

    async fn stage_snapshot(&self, source: &SnapshotSource, short_freeze: bool) -> NodeResult<()> {
        if self
            .staged
            .lock()
            .expect("staged lock")
            .contains_key(&source.key)
        {
            // Its staging directory is the staged one's: a second dump would overwrite it.
            return Err(NodeError::failed(format!(
                "snapshot {}: one is staged under this key already",
                source.key
            )));
        }
        let turn = source.placement.slot;
        let source = Source::of(source)?;
        let fastlet = self.fastlet.clone();
        let key = source.key.clone();
        let staged = self
            .in_turn(Some(turn), "fastbox-snapshot", move || {
                fastlet.stage_snapshot(&source.as_source(), short_freeze)
            })
            .await?;
        let earlier = self
            .staged
            .lock()
            .expect("staged lock")
            .insert(key.clone(), staged);
        if let Some(earlier) = earlier {
            // Staged concurrently under the same key: both dumps wrote one directory.
            tracing::warn!(snapshot = %key, "two snapshots were staged under one key at once");
            blocking::run("fastbox-snapshot", move || drop(earlier)).await;
        }
        Ok(())
    }

    async fn commit_snapshot(
        &self,
        key: &str,
        placement: &NodePlacement,
    ) -> NodeResult<SnapshotReport> {
        let placement = to_placement(placement)?;
        let staged = self
            .staged
            .lock()
            .expect("staged lock")
            .remove(key)
            .ok_or_else(|| NodeError::not_found(format!("snapshot {key}: none is staged")))?;
        let fastlet = self.fastlet.clone();
        let (_, report) = blocking::run("fastbox-snapshot", move || {
            fastlet.commit_snapshot(staged, &placement)
        })
        .await?;
        Ok(convert::snapshot_report(&report))
    }

    async fn has_snapshot(&self, key: &str) -> bool {
        self.fastlet.load_snapshot(key).is_some()
    }

    async fn fetch_checkpoint(
        &self,
        key: &str,
        manifest: &str,
        execd_token: &str,
        fetch: CheckpointFetch,
    ) -> NodeResult<()> {
        let digest = fastbox_artifact::Digest::from_hex(manifest)
            .map_err(|e| NodeError::failed(format!("manifest {manifest:?}: {e}")))?;
        let fastlet = self.fastlet.clone();
        let (k, token) = (key.to_string(), execd_token.to_string());
        blocking::run("fastbox-fetch", move || {
            let store = fastlet.artifact_store().clone();
            fastlet.snapshot_from_artifact(store.as_ref(), &digest, &k, &token, fetch)
        })
        .await
        .map(drop)
        .map_err(|e| NodeError::failed(format!("checkpoint {key}: {e}")))
    }

    async fn remove_snapshot(&self, key: &str) -> NodeResult<()> {
        self.drop_staged(key).await;
        let fastlet = self.fastlet.clone();
        let k = key.to_string();
        blocking::run("fastbox-snapshot", move || fastlet.remove_snapshot(&k))
            .await
            .map_err(|e| NodeError::failed(format!("snapshot {key}: remove its files: {e}")))
    }

    async fn discard_interrupted_snapshot(&self, key: &str) {
        self.drop_staged(key).await;
        let fastlet = self.fastlet.clone();
        let key = key.to_string();
        blocking::run("fastbox-snapshot", move || {
            fastlet.discard_interrupted_snapshot(&key)
        })
        .await;
    }

    async fn snapshot_keys(&self) -> Vec<String> {
        self.fastlet.snapshot_keys()
    }

    async fn build_template(
        &self,
        key: &str,
        image: &str,
        recipe: &GoldenRecipe,
    ) -> NodeResult<TemplateBuilt> {
        let fastlet = self.fastlet.clone();
        let (key, image, recipe) = (key.to_string(), image.to_string(), recipe.clone());
        let (golden, published) = blocking::run("fastbox-template", move || {
            let resolved = fastlet.resolve_image(&image, None, &NoProgress)?;
            let golden = fastlet.template_for(&key, &resolved, &recipe)?;
            let published = fastlet.publish_template(&golden, &key)?;
            fastlet.register_template(&golden);
            Ok::<_, crate::FastletError>((golden, published))
        })
        .await?;
        Ok(TemplateBuilt {
            manifest: format!("blake3:{}", published.manifest.to_hex()),
            build_ms: golden.build_ms,
            publish_seconds: published.seconds,
            blocks: published.stats.blocks,
            new_blocks: published.stats.new_blocks,
        })
    }

    async fn remove_template(&self, key: &str) -> NodeResult<()> {
        let fastlet = self.fastlet.clone();
        let k = key.to_string();
        blocking::run("fastbox-template", move || fastlet.remove_template(&k))
            .await
            .map_err(|e| NodeError::failed(format!("template {key}: remove its files: {e}")))
    }

    async fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> NodeResult<()> {
        let fastlet = self.fastlet.clone();
        let (id, policy) = (id.to_string(), policy.clone());
        Ok(blocking::run("egress-policy", move || {
            fastlet.set_egress_policy(&id, &policy)
        })
        .await?)
    }

    async fn proxy(
        &self,
        id: &str,
        port: u16,
        path: &str,
        unsigned: Unsigned,
        strip: &[HeaderName],
        req: Request<Body>,
    ) -> Result<Response, ProxyRefusal> {
        let Some(proxy) = self.proxy.get() else {
            return Err(ProxyRefusal::Upstream("node proxy not attached".into()));
        };
        Ok(proxy
            .proxy_to_sandbox(id, port, path, unsigned, strip, req)
            .await?)
    }

    async fn status(&self) -> NodeStatus {
        let (in_use, capacity) = self.fastlet.capacity();
        NodeStatus {
            node_id: self.node_id.clone(),
            slots: capacity,
            free_slots: capacity.saturating_sub(u32::try_from(in_use).unwrap_or(u32::MAX)),
            pools: self
                .fastlet
                .pool_sizes()
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
            memory_available_bytes: fastbox_runtime::image_stream::available_memory(),
            sandboxes: u32::try_from(self.fastlet.running_count()).ok(),
            unused_admissions: self
                .admitted
                .lock()
                .expect("admitted lock")
                .iter()
                .map(|(slot, at)| UnusedAdmission {
                    slot: *slot,
                    age_ms: at.elapsed().as_millis() as u64,
                })
                .collect(),
            delivery: self.delivery.as_ref().and_then(|read| read()),
        }
    }
}

/// Images [`NodeAgent::resolve_image`] answered, by digest, at most [`RESOLVED_IMAGES`]: the
/// one used least recently goes first.
#[derive(Debug, Default)]
struct ResolvedImages {
    by_digest: HashMap<String, ResolvedImage>,
    /// Digests, least recently put or used first.
    order: VecDeque<String>,
}

impl ResolvedImages {
    fn get(&mut self, digest: &str) -> Option<ResolvedImage> {
        let image = self.by_digest.get(digest)?.clone();
        self.touch(digest);
        Some(image)
    }

    fn put(&mut self, image: ResolvedImage) {
        let digest = image.digest.clone();
        if self.by_digest.insert(digest.clone(), image).is_some() {
            self.touch(&digest);
            return;
        }
        self.order.push_back(digest);
        while self.order.len() > RESOLVED_IMAGES {
            if let Some(oldest) = self.order.pop_front() {
                self.by_digest.remove(&oldest);
            }
        }
    }

    /// Moves `digest` to the end of the queue.
    fn touch(&mut self, digest: &str) {
        if let Some(i) = self.order.iter().position(|d| d == digest) {
            let d = self.order.remove(i).expect("in range");
            self.order.push_back(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(digest: &str) -> ResolvedImage {
        ResolvedImage {
            rootfs: format!("/images/{digest}").into(),
            digest: digest.to_string(),
            reference: format!("img:{digest}"),
            canonical_reference: format!("img:{digest}"),
            served_by: None,
            manifest_digest: None,
            config: Default::default(),
            cached: true,
        }
    }

    #[test]
    fn resolved_images_are_bounded_and_keep_the_recently_used() {
        let mut images = ResolvedImages::default();
        for i in 0..RESOLVED_IMAGES {
            images.put(image(&format!("sha256:{i}")));
        }
        // Used now: kept when the next one comes in.
        assert!(images.get("sha256:0").is_some());
        images.put(image("sha256:new"));
        assert!(images.get("sha256:0").is_some());
        assert!(images.get("sha256:1").is_none());
        assert!(images.get("sha256:new").is_some());
        assert_eq!(images.by_digest.len(), RESOLVED_IMAGES);
        assert_eq!(images.order.len(), RESOLVED_IMAGES);
        // Put again: replaced, not counted twice.
        images.put(image("sha256:new"));
        assert_eq!(images.order.len(), RESOLVED_IMAGES);
    }

    #[test]
    fn restores_start_nothing_and_read_the_checkpoint_rootfs() {
        let spec = RestoreSpec {
            id: "sbx".into(),
            moved: false,
            env: vec!["A=1".into()],
            volumes: Vec::new(),
            common: fastbox_node_api::wire::SandboxSettings {
                limits: Default::default(),
                disk_bytes: Some(1 << 30),
                tokens: SandboxTokens {
                    execd: "e".into(),
                    egress: "g".into(),
                },
                policy: EgressPolicy::allow_all(),
                credential_proxy: false,
            },
        };
        let checkpoint = Template {
            key: "snap".into(),
            image_digest: String::new(),
            image_reference: "img".into(),
            rootfs: "/images/x".into(),
            checkpoint: "/snapshots/snap/checkpoint".into(),
            golden_token: "t".into(),
            build_ms: 0,
        };
        let req = restore_request(&spec, &checkpoint);
        assert_eq!(req.rootfs, checkpoint.rootfs);
        assert!(req.entrypoint.is_empty());
        assert_eq!(req.env, spec.env);
        assert_eq!(
            (req.execd_token.as_str(), req.egress_token.as_str()),
            ("e", "g")
        );
        assert_eq!(req.disk_bytes, Some(1 << 30));
    }
}
