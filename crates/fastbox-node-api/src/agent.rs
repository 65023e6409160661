//! [`NodeAgent`]: everything the lifecycle server asks of a node. The server owns intent
//! (records, states, which node a sandbox is on); the node owns what runs: slots, pools, the
//! runtime's handles, checkpoints on its disk, its DNS forwarder and egress enforcement.
//!
//! Calls name a sandbox by id and hand back the [`NodePlacement`] the node answered at the
//! start; a node refuses what it does not hold ([`NodeErrorKind::NotFound`]). Every call is
//! safe to repeat after a failure whose outcome is unknown ([`NodeErrorKind::Unreachable`]):
//! removals and releases are idempotent, and a start into a slot the node already filled
//! for the same id answers that start.
//!
//! [`NodeErrorKind::NotFound`]: crate::NodeErrorKind::NotFound
//! [`NodeErrorKind::Unreachable`]: crate::NodeErrorKind::Unreachable

use async_trait::async_trait;
use axum::body::Body;
use axum::response::Response;
use fastbox_egress_policy::EgressPolicy;
use http::{HeaderName, Request};

use crate::error::NodeResult;
use crate::recipe::GoldenRecipe;
use crate::wire::{
    Adoption, CheckpointFetch, ImageInfo, NodePlacement, NodeStatus, PlaceSpec, Placed,
    ProxyRefusal, RegistryCredentials, RemoveReport, RestoreSpec, SandboxTokens, SnapshotReport,
    SnapshotSource, TemplateBuilt, Unsigned,
};

#[async_trait]
pub trait NodeAgent: Send + Sync {
    /// The node's name (unique in a cluster).
    fn node_id(&self) -> &str;

    // Admission.

    /// A free slot for a sandbox about to be recorded: now, or, while slots are being
    /// released by teardowns in flight, one of those within a few seconds. Refused with
    /// [`crate::NodeErrorKind::NoCapacity`] when the node is full.
    async fn admit(&self) -> NodeResult<u32>;

    /// Gives back a slot [`NodeAgent::admit`] handed out and no start used.
    async fn release_slot(&self, slot: u32);

    /// Takes slot `slot` again after a restart (a record holds it). Idempotent.
    async fn claim_slot(&self, slot: u32);

    /// Gives back slot `slot` only if it is still an admission that no call used since and
    /// that is at least `min_age_ms` old (one [`crate::wire::NodeStatus::unused_admissions`]
    /// reported): a report that is stale by now frees nothing. True if it gave it back.
    async fn release_unused_admission(&self, slot: u32, min_age_ms: u64) -> bool;

    // Images.

    /// Whether `reference` is a well-formed image reference (no I/O).
    fn check_image(&self, reference: &str) -> NodeResult<()>;

    /// Pulls (or finds in the node's cache) image `reference`.
    async fn resolve_image(
        &self,
        reference: &str,
        auth: Option<RegistryCredentials>,
    ) -> NodeResult<ImageInfo>;

    // Starts.

    /// Starts `spec` in slot `slot` (admitted), or claims a pre-restored sandbox of the
    /// template and gives `slot` back (the placement names the slot it runs in).
    async fn place(&self, spec: PlaceSpec, slot: u32) -> NodeResult<Placed>;

    /// Restores snapshot `key` as a new sandbox in slot `slot`: from the staged dump of a
    /// fork when one is staged under `key`, else from the committed snapshot.
    async fn clone_snapshot(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed>;

    /// Restores pause checkpoint `key` as the sandbox it was, in the slot it kept. A failed
    /// resume leaves the slot kept and the checkpoint in place.
    async fn resume(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed>;

    /// Whether the sandbox at `placement` still runs.
    async fn is_alive(&self, placement: &NodePlacement) -> bool;

    /// Takes back, after a restart, a sandbox the server recorded running (its HTTPS through
    /// the node's credential proxy again when `credential_proxy`; its vault is not kept
    /// across the restart).
    async fn adopt(
        &self,
        id: &str,
        placement: &NodePlacement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        credential_proxy: bool,
    ) -> Adoption;

    // Ends.

    /// Removes sandbox `id` (its processes, files and slot; whatever of it is left).
    /// Idempotent.
    async fn remove(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: Option<u32>,
    ) -> NodeResult<RemoveReport>;

    /// Removes sandbox `id`'s processes and files but keeps its slot (and address) for a
    /// resume on this node.
    async fn release_keeping_address(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: u32,
    ) -> NodeResult<()>;

    // Checkpoints.

    /// Pauses: the checkpoint of `source` committed on the node, then its processes gone
    /// (its slot kept).
    async fn pause(&self, id: &str, source: &SnapshotSource) -> NodeResult<SnapshotReport>;

    /// After a restart, a pause that was interrupted: waits for a dump that outlived it and
    /// commits what it completed. Whether the checkpoint is there now.
    async fn finish_interrupted_pause(&self, source: &SnapshotSource) -> bool;

    /// The first half of a live snapshot: the dump into the node's staging area, the sandbox
    /// frozen only while it runs (`short_freeze`: streamed into memory, the shortest
    /// freeze). Clones may restore from it before it is committed.
    async fn stage_snapshot(&self, source: &SnapshotSource, short_freeze: bool) -> NodeResult<()>;

    /// The second half: the staged snapshot `key` kept on disk and published.
    async fn commit_snapshot(
        &self,
        key: &str,
        placement: &NodePlacement,
    ) -> NodeResult<SnapshotReport>;

    /// Whether checkpoint `key` is committed on this node.
    async fn has_snapshot(&self, key: &str) -> bool;

    /// Makes checkpoint `key` (a snapshot's or a pause's, published by the node that took it
    /// as `manifest`, `blake3` hex) committed on this node too, materialized from the
    /// artifact store; nothing to do when it is here. `execd_token` is the token of execd in
    /// it (the manifest confirms it). Then [`NodeAgent::clone_snapshot`] and
    /// [`NodeAgent::resume`] of `key` run here; with [`CheckpointFetch::MemoryOnFault`] its
    /// memory stays in the store until the resume that follows fetches it.
    async fn fetch_checkpoint(
        &self,
        key: &str,
        manifest: &str,
        execd_token: &str,
        fetch: CheckpointFetch,
    ) -> NodeResult<()>;

    /// Removes checkpoint `key` (committed or not), once no restore reads it. Idempotent.
    async fn remove_snapshot(&self, key: &str) -> NodeResult<()>;

    /// After a restart: whatever an interrupted snapshot `key` left goes.
    async fn discard_interrupted_snapshot(&self, key: &str);

    /// The names of the checkpoints on this node (committed or not).
    async fn snapshot_keys(&self) -> Vec<String>;

    // Templates.

    /// Builds template `key`'s golden checkpoint from `image` and `recipe`, and publishes it.
    async fn build_template(
        &self,
        key: &str,
        image: &str,
        recipe: &GoldenRecipe,
    ) -> NodeResult<TemplateBuilt>;

    /// Removes template `key`'s golden checkpoint and pool from the node.
    async fn remove_template(&self, key: &str) -> NodeResult<()>;

    // Egress and access.

    /// Applies `policy` to running sandbox `id` live (connections it newly denies are cut).
    async fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> NodeResult<()>;

    /// Forwards `req` to `port` of sandbox `id` through the node proxy; `path` is what
    /// follows `{id}/{port}` (optionally a route credential, then the sandbox path). `strip`
    /// names request headers that must not reach the sandbox.
    async fn proxy(
        &self,
        id: &str,
        port: u16,
        path: &str,
        unsigned: Unsigned,
        strip: &[HeaderName],
        req: Request<Body>,
    ) -> Result<Response, ProxyRefusal>;

    // Status.

    /// Capacity and what the node holds ready.
    async fn status(&self) -> NodeStatus;
}
