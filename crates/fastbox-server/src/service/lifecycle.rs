//! The sandbox table (in memory, written through to the state store) and the API's
//! operations on it. Mutations write the record durably before anything acts on it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use chrono::{DateTime, Utc};
use fastbox_api::lifecycle::{
    CreateSandboxRequest, DiagnosticContentResponse, Endpoint, ListSandboxesResponse,
    PaginationInfo, Sandbox, SandboxState, SandboxStatus, StringMap,
};
use fastbox_api::limits::EXECD_PORT;
use fastbox_image::ImageConfig;
use fastbox_node_api::control::{EGRESS_AUTH_HEADER, EGRESS_PORT, SECURE_ACCESS_HEADER};
use fastbox_node_api::wire::NodePlacement;
use fastbox_node_api::{NodeAgent, NodeErrorKind};
use fastbox_proxy::{RouteKeys, RouteSigner, to_b36};

use crate::cluster::Cluster;
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::nodes::Nodes;
use crate::record::SandboxRecord;
use crate::store::Store;

use super::execd_logs;
use super::idempotency::KeyedCreate;
use super::plan::{Rules, plan, plan_from_snapshot, plan_from_template};

/// How often a call in flight looks whether its node was declared lost.
const LOSS_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// How often a caller waiting for a sandbox's state looks again.
const STATE_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// How often a write that meets a change made elsewhere is decided again before it fails.
const MAX_CONFLICTS: usize = 32;

/// The execd header that carries the per-sandbox token.
pub const EXECD_TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

/// Whether the server is ready (`/health`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Starting(String),
    Ready,
}

pub struct Lifecycle {
    pub(super) cfg: ServerConfig,
    pub(super) store: Store,
    pub(super) records: Mutex<HashMap<String, SandboxRecord>>,
    /// Sandboxes with a create or removal task running; the reconciler leaves them alone.
    pub(super) busy: Mutex<HashSet<String>>,
    /// Creates whose request waits for its answer ([`Lifecycle::answer_create`]).
    pub(super) create_answers: super::answers::CreateAnswers,
    /// Slots admitted on a node (node, slot) whose holder is not recorded yet: never given
    /// back as forgotten ([`Lifecycle::admitting`]).
    pub(super) admitting: Mutex<HashSet<(String, u32)>>,
    /// Sandboxes of a node that registered again whose recovery waits for the operation
    /// they had in flight ([`Lifecycle::recover_node`]).
    pub(super) deferred_recovery: Mutex<HashSet<String>>,
    /// The nodes sandboxes run on.
    pub(super) nodes: Nodes,
    /// How image references are read (a local one is refused outside
    /// `--allow-local-images`).
    pub(super) images: ImageConfig,
    /// The route signing keys (followed as the key file is rotated).
    pub(super) keys: RouteKeys,
    health: RwLock<Health>,
    /// Templates of the templates API, written through to the store.
    pub(super) templates: Mutex<HashMap<String, fastbox_api::templates::Template>>,
    /// Held while an egress policy changes (`service::egress`), so changes never interleave.
    pub(super) policy_changes: tokio::sync::Mutex<()>,
    /// Start phases for `GET /metrics`.
    pub(super) start_metrics: crate::metrics::StartMetrics,
    pub(super) create_metrics: crate::metrics::CreateMetrics,
    /// Snapshots, written through to the store.
    pub(super) snapshots: Mutex<HashMap<String, crate::record::SnapshotRecord>>,
    /// Registered nodes (`service::membership`), written through to the store.
    pub(super) members: Mutex<HashMap<String, super::membership::Member>>,
    /// The cluster's join token (`None`: no registrations).
    pub(super) join_token: RwLock<Option<fastbox_node_api::remote::Credential>>,
    /// Held while a registration or revocation changes the members, so they never interleave.
    pub(super) membership_changes: Mutex<()>,
    /// This server among those sharing the state store.
    pub(super) cluster: Arc<Cluster>,
    /// The store's revision before the records were loaded: the watch goes on from the
    /// next one ([`Lifecycle::follow_store`]).
    pub(super) loaded_at: fastbox_state::Revision,
    /// When the old idempotency keys were last collected.
    pub(super) idempotency_collected: Mutex<Option<std::time::Instant>>,
    /// The store's revision noted last, and when (`service::history`).
    pub(super) history_mark: Mutex<Option<(std::time::Instant, fastbox_state::Revision)>>,
}

/// `GET /v1/sandboxes` filters.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// `None`: any state; otherwise the states to match (none, when every state the
    /// client named is unknown here).
    pub states: Option<Vec<SandboxState>>,
    pub metadata: Vec<(String, String)>,
    pub page: u32,
    pub page_size: u32,
}

/// `GET /v1/sandboxes/{id}/endpoints/{port}` parameters.
#[derive(Debug, Clone, Default)]
pub struct EndpointQuery {
    pub use_server_proxy: bool,
    /// Unix seconds: a signed route expiring then.
    pub expires: Option<u64>,
    /// `host[:port]` the client reached the API at (for server-proxy endpoints).
    pub api_host: Option<String>,
}

impl Lifecycle {
    /// A server with one node.
    pub fn new(
        cfg: ServerConfig,
        store: Store,
        node: Arc<dyn NodeAgent>,
        images: ImageConfig,
        keys: RouteKeys,
    ) -> Result<Arc<Self>, ApiError> {
        Self::with_nodes(cfg, store, Nodes::single(node), images, keys)
    }

    /// A server alone with the nodes `nodes`.
    pub fn with_nodes(
        cfg: ServerConfig,
        store: Store,
        nodes: Nodes,
        images: ImageConfig,
        keys: RouteKeys,
    ) -> Result<Arc<Self>, ApiError> {
        Self::in_cluster(cfg, store, nodes, images, keys, Arc::new(Cluster::alone()))
    }

    /// A server with the nodes `nodes`, one of `cluster`'s servers sharing `store`.
    pub fn in_cluster(
        cfg: ServerConfig,
        store: Store,
        nodes: Nodes,
        images: ImageConfig,
        keys: RouteKeys,
        cluster: Arc<Cluster>,
    ) -> Result<Arc<Self>, ApiError> {
        let loaded_at = store.revision()?;
        let records = store
            .load()?
            .into_iter()
            .map(|r| (r.id.clone(), r))
            .collect();
        let templates = store
            .load_templates()?
            .into_iter()
            .map(|t| (t.template_id.clone(), t))
            .collect();
        let snapshots = store
            .load_snapshots()?
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect();
        Ok(Arc::new(Self {
            cfg,
            snapshots: Mutex::new(snapshots),
            templates: Mutex::new(templates),
            store,
            records: Mutex::new(records),
            busy: Mutex::new(HashSet::new()),
            create_answers: Default::default(),
            admitting: Mutex::new(HashSet::new()),
            deferred_recovery: Mutex::new(HashSet::new()),
            policy_changes: tokio::sync::Mutex::new(()),
            start_metrics: Default::default(),
            create_metrics: Default::default(),
            nodes,
            members: Mutex::new(HashMap::new()),
            join_token: RwLock::new(None),
            membership_changes: Mutex::new(()),
            cluster,
            loaded_at,
            idempotency_collected: Mutex::new(None),
            history_mark: Mutex::new(None),
            images,
            keys,
            health: RwLock::new(Health::Starting("starting".into())),
        }))
    }

    /// `GET /metrics` in the Prometheus text format.
    pub fn metrics_text(&self) -> String {
        self.start_metrics.render() + &self.create_metrics.render()
    }

    pub fn config(&self) -> &ServerConfig {
        &self.cfg
    }

    /// The nodes sandboxes run on.
    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// Node `id` (`None`: the first node, which records without a node name are on). A
    /// lost node is asked nothing until it renews its lease (503).
    pub fn node(&self, id: Option<&str>) -> Result<Arc<dyn NodeAgent>, ApiError> {
        let node = self.nodes.get(id)?;
        if self.nodes.is_lost(id) {
            return Err(ApiError::NodeUnavailable(format!(
                "node {} is lost (its lease ran out)",
                node.node_id()
            )));
        }
        Ok(node)
    }

    /// Resolves once node `id` is declared lost or is gone (never for the server's own
    /// node): a call to it still in flight is then given up. The node froze whatever that
    /// call started before its lease could run out, and removes it when it is back.
    pub(super) async fn until_lost(&self, id: Option<&str>) {
        while self.node(id).is_ok() {
            tokio::time::sleep(LOSS_POLL).await;
        }
    }

    /// The node sandbox `id` is on.
    pub fn node_of_sandbox(&self, id: &str) -> Result<Arc<dyn NodeAgent>, ApiError> {
        self.node(self.record(id)?.node.as_deref())
    }

    /// The route signing keys in force.
    pub fn signer(&self) -> Arc<RouteSigner> {
        self.keys.current()
    }

    pub fn health(&self) -> Health {
        self.health.read().expect("health lock").clone()
    }

    pub fn set_health(&self, health: Health) {
        *self.health.write().expect("health lock") = health;
    }

    /// True while the state store cannot be reached (reads answer from this server's last
    /// known state).
    pub fn state_unreachable(&self) -> bool {
        self.store.is_unreachable()
    }

    /// A copy of record `id`.
    pub(super) fn record(&self, id: &str) -> Result<SandboxRecord, ApiError> {
        self.records
            .lock()
            .expect("records lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::SandboxNotFound(id.to_string()))
    }

    /// Applies `change` to record `id` and writes it durably; returns the new record.
    pub(super) fn update(
        &self,
        id: &str,
        change: impl FnMut(&mut SandboxRecord) -> Result<(), ApiError>,
    ) -> Result<SandboxRecord, ApiError> {
        self.update_shown_first(id, change, false, |_| {})
    }

    /// [`Lifecycle::update`] whose change this server shows before it is durable: each
    /// version is in this server's cache (under the revision it was made from) while it is
    /// written, and `shown` is called once, with the first. So an answer given meanwhile
    /// (the create's, [`Lifecycle::answer_create`]) waits for no write, and this server's
    /// reads never go back to the version before. The write waits until the creates
    /// answering meanwhile have answered (a burst's `Running` writes go after it, together;
    /// `service::answers`). A write that fails for good puts that
    /// version back. Other servers see the change once it is durable, as always.
    pub(super) fn update_shown_first(
        &self,
        id: &str,
        mut change: impl FnMut(&mut SandboxRecord) -> Result<(), ApiError>,
        show_first: bool,
        mut shown: impl FnMut(&SandboxRecord),
    ) -> Result<SandboxRecord, ApiError> {
        let mut current = self.record(id)?;
        let mut conflicts = 0;
        let mut told = false;
        loop {
            let mut next = current.clone();
            change(&mut next)?;
            if next.state() != current.state() {
                next.acting = self.next_actor(&current, next.state());
            }
            if show_first {
                // Same revision as `current`: a later version (the watch's, a refresh's)
                // replaces it, and a change made from it here is a compare-and-swap on
                // `current`.
                self.replace_cached(&next);
                if !told {
                    told = true;
                    shown(&next);
                    // Written after the creates answering meanwhile (`answers`).
                    fastbox_state::off_worker(|| {
                        self.create_answers
                            .wait_all_answered(super::answers::RUNNING_WRITE_HOLD_OFF)
                    });
                }
            }
            // The write runs without the records lock: it is a compare-and-swap on the
            // version `next` was made from, so a change that landed meanwhile (here or on
            // another server) makes it fail instead of being overwritten.
            match self.store.put(&next) {
                Ok(revision) => {
                    next.revision = revision;
                    self.cache(&next, false);
                    if !told {
                        shown(&next);
                    }
                    return Ok(next);
                }
                // Changed elsewhere since this version was read: decide again on what the
                // store has now.
                Err(e) if e.is_conflict() && conflicts < MAX_CONFLICTS => {
                    conflicts += 1;
                    current = self.refresh(id)?;
                }
                Err(e) => {
                    if show_first {
                        self.replace_cached(&current);
                    }
                    return Err(e.into());
                }
            }
        }
    }

    /// Puts `record` in the cache in place of the version of the same revision (nothing
    /// when the cache holds a later one, or none).
    fn replace_cached(&self, record: &SandboxRecord) {
        let mut records = self.records.lock().expect("records lock");
        if let Some(cached) = records.get_mut(&record.id)
            && cached.revision == record.revision
        {
            *cached = record.clone();
        }
    }

    /// Writes a new record durably (a conflict: its id exists already), with a `guard`
    /// only while that holds.
    pub(super) fn insert(
        &self,
        mut record: SandboxRecord,
        guard: Option<&fastbox_state::Guard>,
    ) -> Result<(), ApiError> {
        record.revision = 0;
        record.acting = self.acting_in(record.state());
        record.revision = match guard {
            Some(guard) => self.store.create_under(&record, guard)?,
            None => self.store.put(&record)?,
        };
        self.cache(&record, true);
        Ok(())
    }

    /// Forgets record `id` entirely (whatever version the store has of it).
    pub(super) fn forget(&self, id: &str) -> Result<(), ApiError> {
        let mut current = match self.record(id) {
            Ok(record) => record,
            Err(ApiError::SandboxNotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut conflicts = 0;
        loop {
            match self.store.remove(&current) {
                Ok(()) => break,
                Err(e) if e.is_conflict() && conflicts < MAX_CONFLICTS => {
                    conflicts += 1;
                    match self.refresh(id) {
                        Ok(fresh) => current = fresh,
                        Err(ApiError::SandboxNotFound(_)) => return Ok(()),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        let mut records = self.records.lock().expect("records lock");
        if records
            .get(id)
            .is_some_and(|r| r.revision <= current.revision)
        {
            records.remove(id);
        }
        Ok(())
    }

    /// Who acts on record `current` once it enters `state`: [`Lifecycle::acting_in`], except
    /// that a delete during another live server's operation leaves the sandbox to that
    /// server (its task sees the delete when it ends, and removes the sandbox). Two servers
    /// never act on one sandbox at once: a removal here, while a create elsewhere still
    /// claimed, released the slot reserved for that create twice, and another sandbox got
    /// its address.
    fn next_actor(&self, current: &SandboxRecord, state: SandboxState) -> Option<String> {
        match &current.acting {
            Some(other)
                if state == SandboxState::Stopping
                    && other != self.cluster.id()
                    && !self.cluster.is_gone(other) =>
            {
                Some(other.clone())
            }
            _ => self.acting_in(state),
        }
    }

    /// Who acts on a sandbox entering `state`: this server while an operation of its runs
    /// (create, pause, resume, removal), nobody in a settled state.
    fn acting_in(&self, state: SandboxState) -> Option<String> {
        matches!(
            state,
            SandboxState::Pending
                | SandboxState::Pausing
                | SandboxState::Resuming
                | SandboxState::Stopping
        )
        .then(|| self.cluster.id().to_string())
    }

    /// This server among those sharing the state store.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    /// Puts `record` in the cache unless the cache holds a later version (writes may finish
    /// out of order); a record no longer cached (forgotten meanwhile) comes back only when
    /// `new`.
    fn cache(&self, record: &SandboxRecord, new: bool) {
        let mut records = self.records.lock().expect("records lock");
        match records.get(&record.id) {
            Some(cached) if cached.revision >= record.revision => {}
            None if !new => {}
            _ => {
                records.insert(record.id.clone(), record.clone());
            }
        }
    }

    /// Record `id` as the store has it now, into the cache (after a conflict).
    pub(super) fn refresh(&self, id: &str) -> Result<SandboxRecord, ApiError> {
        match self.store.reload(id)? {
            Some(fresh) => {
                let mut records = self.records.lock().expect("records lock");
                if records.get(id).is_none_or(|r| r.revision < fresh.revision) {
                    records.insert(id.to_string(), fresh.clone());
                }
                Ok(fresh)
            }
            None => {
                self.records.lock().expect("records lock").remove(id);
                Err(ApiError::SandboxNotFound(id.to_string()))
            }
        }
    }

    /// Marks `id` busy; false if it already was.
    pub(super) fn claim(&self, id: &str) -> bool {
        self.busy.lock().expect("busy lock").insert(id.to_string())
    }

    pub(super) fn release(&self, id: &str) {
        self.busy.lock().expect("busy lock").remove(id);
    }

    /// The placement of every sandbox placed on node `node_id` (the node tells what it
    /// holds from them: a pooled sandbox keeps its pool name after a claim).
    pub fn placements(&self, node_id: &str) -> Vec<NodePlacement> {
        self.snapshot()
            .into_iter()
            .filter(|r| self.node_name(r.node.as_deref()) == node_id)
            .filter_map(|r| r.placement)
            .collect()
    }

    pub(super) fn snapshot(&self) -> Vec<SandboxRecord> {
        self.records
            .lock()
            .expect("records lock")
            .values()
            .cloned()
            .collect()
    }

    /// `POST /v1/sandboxes`: validate, admit into a slot, record the intent, start.
    pub async fn create(self: &Arc<Self>, req: CreateSandboxRequest) -> Result<Sandbox, ApiError> {
        self.create_as(req, None).await
    }

    /// [`Lifecycle::create`] of the sandbox an idempotency key was recorded for (a new one
    /// when `None`).
    pub(super) async fn create_as(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
        keyed: Option<&KeyedCreate>,
    ) -> Result<Sandbox, ApiError> {
        let rules = Rules::of(&self.cfg);
        let plan = match (req.template_id.clone(), req.snapshot_id.clone()) {
            (Some(template_id), _) => {
                let template = self.ready_template(&template_id)?;
                plan_from_template(req, &template, &rules)?
            }
            (None, Some(snapshot_id)) => {
                let snapshot = self.ready_snapshot(&snapshot_id).await?;
                plan_from_snapshot(req, &snapshot, &rules)?
            }
            (None, None) => plan(req, &rules)?,
        };
        let began = std::time::Instant::now();
        let id = self.admit_and_record(&plan, keyed, true).await?;
        let recorded = std::time::Instant::now();
        self.start_create(id.clone(), plan).await?;
        self.create_metrics.observe("start", recorded.elapsed());
        self.create_metrics.observe("total", began.elapsed());
        Ok(self.record(&id)?.to_wire())
    }

    /// Admission and the durable intent of a create: a slot, then the `Pending` record that
    /// holds it (only while its idempotency key holds, for a `keyed` create). Returns the
    /// new sandbox's id. `timed`: its phases go to the create requests' metrics (a fork's
    /// clones are not create requests).
    pub(super) async fn admit_and_record(
        self: &Arc<Self>,
        plan: &super::plan::CreatePlan,
        keyed: Option<&KeyedCreate>,
        timed: bool,
    ) -> Result<String, ApiError> {
        let observe = |phase: &str, since: std::time::Instant| {
            if timed {
                self.create_metrics.observe(phase, since.elapsed());
            }
        };
        self.nodes
            .first()
            .check_image(&plan.image.uri)
            .map_err(|e| ApiError::InvalidParameter(format!("image: {e}")))?;
        // Every create comes here (from an image, a template, a snapshot, a fork): a local
        // image is refused unless the operator allows its directory now.
        self.check_local_image(&plan.image.uri)?;
        // Each sandbox its own token, clones of a secure sandbox included.
        let secure_access = match plan.secure_access {
            true => Some(crate::record::SecureAccess::generate().map_err(|e| {
                ApiError::Internal(format!("cannot generate an access token: {e}"))
            })?),
            false => None,
        };
        let admitting = std::time::Instant::now();
        let (node, slot) = self.admit(plan).await?;
        observe("admit", admitting);
        let id = keyed.map_or_else(|| uuid::Uuid::new_v4().to_string(), |k| k.id.clone());
        let now = Utc::now();
        let mut record = SandboxRecord {
            id: id.clone(),
            revision: 0,
            acting: None,
            image: plan.image.clone(),
            entrypoint: plan.entrypoint.clone(),
            env: plan.env.clone(),
            metadata: plan.metadata.clone(),
            resource_limits: plan.resource_limits.clone(),
            extensions: plan.extensions.clone(),
            created_at: now,
            expires_at: plan
                .timeout_secs
                .map(|t| now + chrono::Duration::seconds(t)),
            status: SandboxStatus {
                state: SandboxState::Pending,
                reason: None,
                message: None,
                last_transition_at: Some(now),
            },
            execd_token: random_token(),
            node: Some(node.node_id().to_string()),
            slot: Some(slot),
            placement: None,
            events: Vec::new(),
            template_id: plan.template_id.clone(),
            network_policy: super::egress::recorded(&plan.policy),
            egress_token: random_token(),
            snapshot_id: plan.snapshot_id.clone(),
            paused_checkpoint: None,
            paused_manifest: None,
            moved_from: Vec::new(),
            resume_after_pause: false,
            resumed_from: None,
            secure_access,
            volumes: plan.volumes.clone(),
            credential_proxy: plan.credential_proxy,
        };
        let from = match &plan.snapshot_id {
            Some(snapshot) => format!("snapshot {snapshot}"),
            None => format!("image {}", plan.image.uri),
        };
        record.event("Created", &format!("sandbox created from {from}"));
        let writing = std::time::Instant::now();
        let inserted = self.insert(record, keyed.map(|k| &k.guard));
        observe("intent", writing);
        match inserted {
            Ok(()) => Ok(id),
            // The store did not answer: the write may have landed all the same.
            Err(e @ ApiError::StoreUnavailable(_)) => match self.store.reload(&id) {
                Ok(Some(landed))
                    if landed.state() == SandboxState::Pending
                        && self.still_acting(&landed).is_ok() =>
                {
                    self.cache(&landed, true);
                    Ok(id)
                }
                // Not known, or taken over already: the slot stays with whatever record
                // holds it (an admission no record holds is given back by the reconciler).
                _ => Err(e),
            },
            Err(e) => {
                node.release_slot(slot).await;
                Err(e)
            }
        }
    }

    /// A slot for `plan` on the best node that has one: the snapshot's node for a create
    /// from a snapshot (its checkpoint is there), else the nodes as [`Nodes::ranked`] orders
    /// them, each asked in turn while the one before refuses (full, or not reached).
    async fn admit(
        &self,
        plan: &super::plan::CreatePlan,
    ) -> Result<(Arc<dyn NodeAgent>, u32), ApiError> {
        let candidates = match &plan.snapshot_id {
            Some(snapshot) => self.snapshot_candidates(snapshot)?,
            None => self.nodes.ranked(plan.template_id.as_deref()),
        };
        let mut refused = None;
        for node in candidates {
            match node.admit().await {
                Ok(slot) => {
                    self.nodes.admitted(node.node_id());
                    return Ok((node, slot));
                }
                Err(e)
                    if matches!(
                        e.kind,
                        NodeErrorKind::NoCapacity | NodeErrorKind::Unreachable
                    ) =>
                {
                    tracing::debug!(node = node.node_id(), error = %e, "admission refused; trying the next node");
                    refused = Some(e);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(refused.map_or_else(
            || ApiError::NodeUnavailable("no node to admit the sandbox into".into()),
            ApiError::from,
        ))
    }

    /// A caller's image reference naming a host path outside `--allow-local-images` is a 400
    /// (`service::local_images`).
    pub(super) fn check_local_image(&self, reference: &str) -> Result<(), ApiError> {
        super::local_images::check(reference, &self.cfg.allow_local_images, &self.images)
    }

    /// `GET /v1/sandboxes/{id}`.
    pub fn get(&self, id: &str) -> Result<Sandbox, ApiError> {
        Ok(self.record(id)?.to_wire())
    }

    /// `GET /v1/sandboxes`: filtered by state and metadata, newest first, paginated.
    pub fn list(&self, q: &ListQuery) -> ListSandboxesResponse {
        let mut matching: Vec<SandboxRecord> = self
            .snapshot()
            .into_iter()
            .filter(|r| {
                q.states
                    .as_ref()
                    .is_none_or(|states| states.contains(&r.state()))
            })
            .filter(|r| r.matches_metadata(&q.metadata))
            .collect();
        matching.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
        let (pagination, range) = PaginationInfo::of(q.page, q.page_size, matching.len());
        ListSandboxesResponse {
            items: matching[range].iter().map(SandboxRecord::to_wire).collect(),
            pagination,
        }
    }

    /// `DELETE /v1/sandboxes/{id}`: `Stopping` now, `Terminated` when the node has removed it.
    pub fn delete(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let record = self.update(id, |r| {
            if !r.state().is_final() && r.state() != SandboxState::Stopping {
                r.transition(SandboxState::Stopping, None, "deletion requested");
            }
            Ok(())
        })?;
        // (Unless another server's operation holds it: that server removes it.)
        if record.state() == SandboxState::Stopping
            && record.acting.as_deref() == Some(self.cluster.id())
        {
            self.start_removal(id);
        }
        Ok(())
    }

    /// Sandbox `id` once it runs: a `Pending` or `Resuming` one (or one asked to resume
    /// during its pause, until that resume starts) is waited for, up to `wait` (then `NotReady`); any other state that is not
    /// `Running` is refused at once.
    async fn running_within(
        &self,
        id: &str,
        wait: std::time::Duration,
    ) -> Result<SandboxRecord, ApiError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let record = self.record(id)?;
            // On its way to running: a resume asked during its pause counts.
            let coming =
                matches!(
                    record.state(),
                    SandboxState::Pending | SandboxState::Resuming
                ) || (matches!(record.state(), SandboxState::Pausing | SandboxState::Paused)
                    && record.resume_after_pause);
            match record.state() {
                SandboxState::Running => return Ok(record),
                _ if coming && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(STATE_POLL).await;
                }
                _ if coming => {
                    return Err(ApiError::NotReady {
                        id: id.to_string(),
                        state: record.state().to_string(),
                    });
                }
                _ => return Err(not_running(&record, "")),
            }
        }
    }

    /// `POST /v1/sandboxes/{id}/renew-expiration`: a new absolute expiry (may shorten it).
    pub fn renew(&self, id: &str, expires_at: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
        if expires_at <= Utc::now() {
            return Err(ApiError::InvalidParameter(format!(
                "expiresAt {} is in the past",
                expires_at.to_rfc3339()
            )));
        }
        let record = self.update(id, |r| {
            // Expiry keeps running while a sandbox is paused, and can be renewed then.
            if !matches!(
                r.state(),
                SandboxState::Pending
                    | SandboxState::Running
                    | SandboxState::Pausing
                    | SandboxState::Paused
                    | SandboxState::Resuming
            ) {
                return Err(not_running(r, ""));
            }
            r.expires_at = Some(expires_at);
            r.event(
                "Renewed",
                &format!("expires at {}", expires_at.to_rfc3339()),
            );
            Ok(())
        })?;
        Ok(record.expires_at.unwrap_or(expires_at))
    }

    /// `PATCH /v1/sandboxes/{id}/metadata`: a JSON merge patch (`null` removes a key).
    pub fn patch_metadata(
        &self,
        id: &str,
        patch: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Sandbox, ApiError> {
        let record = self.update(id, |r| {
            if r.state().is_final() {
                return Err(not_running(r, ""));
            }
            let mut next: StringMap = r.metadata.clone();
            for (key, value) in patch.clone() {
                match value {
                    serde_json::Value::Null => {
                        next.remove(&key);
                    }
                    serde_json::Value::String(v) => {
                        next.insert(key, v);
                    }
                    other => {
                        return Err(ApiError::InvalidParameter(format!(
                            "metadata.{key}: values must be strings or null, got {other}"
                        )));
                    }
                }
            }
            fastbox_api::metadata::validate(next.iter())
                .map_err(|e| ApiError::InvalidMetadata(e.to_string()))?;
            r.metadata = next;
            r.event("MetadataPatched", "");
            Ok(())
        })?;
        Ok(record.to_wire())
    }

    /// `GET /v1/sandboxes/{id}/endpoints/{port}`: a node-proxy route (signed when `expires`
    /// is given) or the server-proxy route; never the sandbox's own address.
    pub async fn endpoint(
        &self,
        id: &str,
        port: u16,
        q: &EndpointQuery,
    ) -> Result<Endpoint, ApiError> {
        if port == 0 {
            return Err(ApiError::InvalidParameter("port must be 1..65535".into()));
        }
        if q.use_server_proxy && q.expires.is_some() {
            return Err(ApiError::InvalidParameter(
                "use_server_proxy=true cannot be combined with expires".into(),
            ));
        }
        let record = self.running_within(id, self.cfg.endpoint_wait).await?;
        // The credential of the port, as OpenSandbox servers hand it out.
        let token = match port {
            EXECD_PORT => Some((EXECD_TOKEN_HEADER, &record.execd_token)),
            EGRESS_PORT => Some((EGRESS_AUTH_HEADER, &record.egress_token)),
            _ => None,
        };
        let mut headers: StringMap = token
            .filter(|(_, value)| !value.is_empty())
            .map(|(name, value)| (name.to_string(), value.clone()))
            .into_iter()
            .collect();
        // A secure sandbox's endpoints carry its access token (the SDK sends an endpoint's
        // headers with every request to it). A signed route is a credential by itself and
        // expires: it never carries the token, which does not.
        if let Some(secure) = &record.secure_access
            && q.expires.is_none()
        {
            headers.insert(
                SECURE_ACCESS_HEADER.to_string(),
                secure.expose().to_string(),
            );
        }
        let headers = (!headers.is_empty()).then_some(headers);
        let endpoint = if q.use_server_proxy {
            let host = q
                .api_host
                .clone()
                .unwrap_or_else(|| self.cfg.listen.to_string());
            format!("{host}/v1/sandboxes/{id}/proxy/{port}")
        } else {
            // The sandbox's own node's proxy.
            let node = self
                .nodes
                .proxy_of(record.node.as_deref())
                .unwrap_or_else(|| self.node_proxy_host(q.api_host.as_deref()));
            match q.expires {
                None => format!("{node}/{id}/{port}"),
                Some(expires) => {
                    let now = Utc::now().timestamp().max(0) as u64;
                    if expires <= now {
                        return Err(ApiError::InvalidParameter(format!(
                            "expires {expires} is not in the future"
                        )));
                    }
                    let max = self.cfg.route_max_lifetime.as_secs();
                    if expires - now > max {
                        return Err(ApiError::InvalidParameter(format!(
                            "expires {expires} is more than {max} s ahead (route_max_lifetime)"
                        )));
                    }
                    let sig = self
                        .route_signer_for(record.node.as_deref())
                        .sign(id, port, expires);
                    format!("{node}/{id}/{port}/{}/{sig}", to_b36(expires))
                }
            }
        };
        Ok(Endpoint { endpoint, headers })
    }

    /// `host:port` of the node proxy as clients should use it.
    fn node_proxy_host(&self, api_host: Option<&str>) -> String {
        if let Some(public) = &self.cfg.node_proxy_public {
            return public.clone();
        }
        let listen = self.cfg.node_proxy_listen;
        if listen.ip().is_unspecified() {
            // Listening everywhere: the host the client used for the API reaches us too.
            let host = api_host
                .and_then(|h| {
                    h.rsplit_once(':')
                        .map(|(h, _)| h.to_string())
                        .or(Some(h.to_string()))
                })
                .unwrap_or_else(|| "127.0.0.1".to_string());
            format!("{host}:{}", listen.port())
        } else {
            listen.to_string()
        }
    }

    /// `GET .../diagnostics/logs`: the entrypoint's output, from execd.
    pub async fn diagnostics_logs(
        &self,
        id: &str,
        scope: &str,
    ) -> Result<DiagnosticContentResponse, ApiError> {
        check_scope(scope, &["container", "all"])?;
        let record = self.record(id)?;
        let (content, warnings, truncated) = match (&record.placement, record.state()) {
            (Some(p), SandboxState::Running) => {
                match execd_logs::entrypoint_logs(p.address, &record.execd_token).await {
                    Ok((text, false)) => (text, None, false),
                    Ok((text, true)) => (
                        text,
                        Some(vec![format!(
                            "the log is longer than {} MiB; the rest was not read",
                            execd_logs::MAX_LOG_BYTES >> 20
                        )]),
                        true,
                    ),
                    Err(e) => (
                        String::new(),
                        Some(vec![format!("execd did not answer: {e}")]),
                        false,
                    ),
                }
            }
            _ => (
                String::new(),
                Some(vec![format!(
                    "the sandbox is {}; logs are kept only while it runs",
                    record.state()
                )]),
                false,
            ),
        };
        let mut answer = diagnostic(id, "logs", scope, content, warnings);
        answer.truncated = truncated;
        Ok(answer)
    }

    /// `GET .../diagnostics/events`: the sandbox's lifecycle events.
    pub fn diagnostics_events(
        &self,
        id: &str,
        scope: &str,
    ) -> Result<DiagnosticContentResponse, ApiError> {
        check_scope(scope, &["runtime", "all"])?;
        let record = self.record(id)?;
        Ok(diagnostic(id, "events", scope, record.events_text(), None))
    }
}

fn check_scope(scope: &str, known: &[&str]) -> Result<(), ApiError> {
    if known.contains(&scope) {
        Ok(())
    } else {
        Err(ApiError::InvalidParameter(format!(
            "DIAGNOSTICS_SCOPE_UNSUPPORTED: scope {scope:?} is not one of {known:?}"
        )))
    }
}

fn diagnostic(
    id: &str,
    kind: &str,
    scope: &str,
    content: String,
    warnings: Option<Vec<String>>,
) -> DiagnosticContentResponse {
    DiagnosticContentResponse {
        sandbox_id: id.to_string(),
        kind: kind.to_string(),
        scope: scope.to_string(),
        delivery: "inline".to_string(),
        content_type: "text/plain; charset=utf-8".to_string(),
        truncated: false,
        content_length: Some(content.len() as u64),
        content: Some(content),
        warnings,
    }
}

/// Refuses a change decided on sandbox `r` being `state` once it no longer is: another
/// server, or a client's delete, changed it meanwhile (a write retried on a newer version
/// of the record must not undo that).
pub(super) fn still_in(r: &SandboxRecord, state: SandboxState) -> Result<(), ApiError> {
    match r.state() == state {
        true => Ok(()),
        false => Err(ApiError::Conflict(format!(
            "sandbox {} is {} now, no longer {state}",
            r.id,
            r.state()
        ))),
    }
}

pub(super) fn not_running(r: &SandboxRecord, detail: &str) -> ApiError {
    // A failed sandbox says why (its status, as a GET shows it): the caller's next step.
    let reason = match (r.status.reason.as_deref(), r.status.message.as_deref()) {
        (Some(reason), Some(message)) if r.state() == SandboxState::Failed => {
            format!(" ({reason}: {message})")
        }
        (Some(reason), _) => format!(" ({reason})"),
        _ => String::new(),
    };
    ApiError::NotRunning {
        id: r.id.clone(),
        state: r.state().to_string(),
        detail: format!("{reason}{detail}"),
    }
}

/// 32 random bytes from getrandom(2), hex.
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("getrandom");
    hex::encode(bytes)
}
