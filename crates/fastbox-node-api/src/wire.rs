//! What travels between the server and a node: requests, placements and reports. Plain data
//! with serde, the same for the in-process node and a remote one.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use fastbox_api::limits::CgroupLimits;
use fastbox_egress_policy::EgressPolicy;
use serde::{Deserialize, Serialize};

use crate::recipe::GoldenRecipe;

/// Where a running sandbox lives. The server records it durably and hands it back on every
/// call about the sandbox; only the node reads `handle` (its runtime's handle: the server
/// never interprets it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodePlacement {
    /// The node's slot (its network slot: the address follows from it).
    pub slot: u32,
    pub address: Ipv4Addr,
    /// The node's own record of the sandbox's processes, opaque to the server.
    #[serde(default)]
    pub handle: NodeHandle,
}

/// A node's opaque handle of a sandbox (see [`NodePlacement::handle`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeHandle(pub serde_json::Value);

/// The per-sandbox secrets a node needs: execd's token (the node's calls to execd carry it)
/// and the egress token (port 18080 checks it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxTokens {
    pub execd: String,
    pub egress: String,
}

/// Registry credentials of a create.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredentials")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// An image a node resolved (and holds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// The reference as the caller wrote it.
    pub reference: String,
    /// The normalized reference (`docker.io/library/python:3.12`, `dir:/abs/path`).
    pub canonical_reference: String,
    /// Content address, `sha256:<hex>`.
    pub digest: String,
    /// The image's own `KEY=VALUE` environment.
    pub env: Vec<String>,
}

/// What a sandbox is started from, beyond its image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateChoice {
    /// The templates API's id: the golden checkpoint's name on the node.
    pub key: String,
    pub recipe: GoldenRecipe,
}

/// A start from an image (or a template of the templates API).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlaceSpec {
    pub id: String,
    /// As [`crate::NodeAgent::resolve_image`] answered it.
    pub image: ImageInfo,
    /// A template of the templates API; `None`: the image's own template.
    pub template: Option<TemplateChoice>,
    /// Whether a pre-restored sandbox may be claimed (`false`: restore now).
    pub use_pool: bool,
    /// Started next to execd (empty: none).
    pub entrypoint: Vec<String>,
    /// `KEY=VALUE`, after the image's own.
    pub env: Vec<String>,
    /// Mounted before the entrypoint starts (whether the sandbox is claimed from the warm
    /// pool or restored).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    /// The keys of its object-storage volumes, by volume name.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub volume_keys: std::collections::BTreeMap<String, ObjectStorageKeys>,
    /// Restored from the template's isolation variant (`bootstrap.execd.isolation=enable`):
    /// execd offers isolated sessions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub isolation: bool,
    #[serde(flatten)]
    pub common: SandboxSettings,
}

/// A volume of a sandbox: a directory the node binds at `mount_path` inside it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMount {
    /// Unique among the sandbox's volumes (a DNS label).
    pub name: String,
    pub source: VolumeSource,
    /// Absolute, inside the sandbox (resolved inside its root by the node).
    pub mount_path: String,
    #[serde(default)]
    pub read_only: bool,
    /// A relative directory of the source, mounted instead of the whole of it (resolved
    /// inside the source, created when missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
}

/// Where a volume's directory comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum VolumeSource {
    /// A directory of the node's host, under a directory its operator allows
    /// (`--allow-host-volume`).
    Host { path: String },
    /// A named volume the node keeps (the spec's `pvc`): made on first use when `create`,
    /// `size_bytes` large; removed with the sandbox whose create made it when
    /// `delete_on_termination`.
    #[serde(rename_all = "camelCase")]
    Named {
        name: String,
        create: bool,
        size_bytes: u64,
        delete_on_termination: bool,
    },
    /// A bucket of S3-compatible storage (the spec's `ossfs`), mounted by a FUSE client the
    /// node runs in the sandbox's own network namespace; the volume's `sub_path` is the
    /// bucket prefix. Its keys travel beside it, never in it ([`PlaceSpec::volume_keys`]).
    #[serde(rename_all = "camelCase")]
    ObjectStorage {
        bucket: String,
        /// `http://` or `https://` and a host, with an optional port.
        endpoint: String,
        /// FUSE client options the server allowed (`name` or `name=value`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        options: Vec<String>,
    },
}

/// The keys of an object-storage volume: given to the node with the place request only,
/// never recorded, never printed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectStorageKeys {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for ObjectStorageKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObjectStorageKeys(<redacted>)")
    }
}

/// What every start (from an image, a snapshot or a pause checkpoint) sets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSettings {
    pub limits: CgroupLimits,
    /// The writable layer's size (`None`: the node's default).
    pub disk_bytes: Option<u64>,
    pub tokens: SandboxTokens,
    pub policy: EgressPolicy,
    /// Created with `credentialProxy.enabled`: its HTTPS goes through the node's credential
    /// proxy, which injects what its Credential Vault binds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credential_proxy: bool,
}

/// A restore of a checkpoint (a snapshot's or a pause's) as sandbox `id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreSpec {
    pub id: String,
    /// A resume on another node than the one its checkpoint was taken on: a new address,
    /// its TCP connections closed (clones are always so).
    #[serde(default)]
    pub moved: bool,
    /// `KEY=VALUE` of the sandbox's record (execd's environment for new commands).
    pub env: Vec<String>,
    /// The volumes the checkpoint was taken with (a resume of a pause mounts them again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
    #[serde(flatten)]
    pub common: SandboxSettings,
}

/// A running sandbox, as a checkpoint is taken of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotSource {
    /// The checkpoint's name on the node (the snapshot id, or a pause's key).
    pub key: String,
    pub placement: NodePlacement,
    pub execd_token: String,
    /// The image reference the sandbox was created from (kept with the checkpoint).
    pub image_reference: String,
    /// The sandbox's volumes: a pause dumps them as external mounts (its resume is given
    /// them again).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeMount>,
}

/// What a node fetches of a checkpoint published by another node
/// ([`crate::NodeAgent::fetch_checkpoint`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFetch {
    /// All of it: any number of restores (clones) may read it at once.
    #[default]
    Whole,
    /// All but its memory, which the one restore that follows (a resume) fetches on its
    /// page faults and in the background: the sandbox runs before its memory is local.
    MemoryOnFault,
}

/// How a start went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StartReport {
    /// `pool`, `restore`, `clone` or `resume`.
    pub source: String,
    /// Phases in order: (name, milliseconds, whether it details the phase before it).
    pub phases: Vec<PhaseTiming>,
    /// The whole start, in milliseconds.
    pub total_ms: f64,
    /// One line for the sandbox's events.
    pub summary: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseTiming {
    pub name: String,
    pub ms: f64,
    /// A part of the phase before it (measured by someone else), not counted in the total.
    pub detail: bool,
}

/// A started sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placed {
    pub placement: NodePlacement,
    pub report: StartReport,
}

/// How a removal went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveReport {
    pub processes_gone_ms: u64,
    pub total_ms: u64,
}

/// How a checkpoint went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReport {
    /// One line for the events (timings, size).
    pub summary: String,
    /// Its manifest in the artifact store (blake3, hex).
    pub manifest: Option<String>,
    /// Size of the checkpoint (memory images and writable layer).
    pub bytes: u64,
    /// Whether the images were streamed into memory while the sandbox was frozen.
    pub streamed: bool,
}

/// A template's golden checkpoint, built and published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateBuilt {
    /// `blake3:<hex>` of its manifest in the artifact store.
    pub manifest: String,
    pub build_ms: u64,
    pub publish_seconds: f64,
    pub blocks: u64,
    pub new_blocks: u64,
}

/// What a node made of a sandbox it was asked to take back after a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Adoption {
    /// Running and routable again.
    Adopted,
    /// Its processes are gone (or its egress policy could not be applied again).
    Gone,
    /// A sandbox whose memory was still being copied in when the last run ended: its
    /// missing pages would read as zeros (it is frozen).
    MemoryIncomplete,
}

/// A node's capacity and what it holds ready.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node_id: String,
    /// Slots of the node's address pool, and how many are free.
    pub slots: u32,
    pub free_slots: u32,
    /// Pre-restored sandboxes waiting, per template key.
    pub pools: BTreeMap<String, usize>,
    /// The host's available memory (`None`: not reported).
    #[serde(default)]
    pub memory_available_bytes: Option<u64>,
    /// Sandboxes running (pooled ones not counted; `None`: not reported). Slots also hold
    /// pooled sandboxes and spares, capacity made ahead: this is the node's load.
    #[serde(default)]
    pub sandboxes: Option<u32>,
    /// Slots admitted ([`crate::NodeAgent::admit`]) that no start, claim or release used
    /// since: the server gives back those it holds no record of (an answer it never got).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unused_admissions: Vec<UnusedAdmission>,
    /// The node's DART delivery counters (`cache_hits`, `peer_fetches`, `origin_fetches`,
    /// ...; each only grows), when it delivers through DART.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivery: Option<BTreeMap<String, u64>>,
}

/// A slot admitted and not used since, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnusedAdmission {
    pub slot: u32,
    pub age_ms: u64,
}

/// Whether a request without a route signature may pass the node proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unsigned {
    Allowed,
    Refused,
}

/// A request the node proxy did not forward, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ProxyRefusal {
    #[error("no route {0}: expected /{{sandbox id}}/{{port}}/...")]
    BadRoute(String),
    #[error("sandbox {0} is not running on this node")]
    NotRunning(String),
    #[error("route credential rejected: {0}")]
    Forbidden(String),
    #[error("this route needs a signature")]
    Unsigned,
    /// The node proxy's own answer (a secure sandbox's port without a valid credential: 401;
    /// too many failed checks: 429 with `Retry-After`), passed on as it is.
    #[error("{message}")]
    Answered {
        status: u16,
        code: String,
        message: String,
        retry_after_secs: Option<u64>,
    },
    #[error("sandbox port is unreachable: {0}")]
    Upstream(String),
}
