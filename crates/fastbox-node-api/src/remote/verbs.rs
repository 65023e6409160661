//! The verbs of the node API and their arguments as JSON objects, shared by the router and
//! the client so both sides read the same names.

use fastbox_egress_policy::EgressPolicy;
use serde::{Deserialize, Serialize};

use crate::recipe::GoldenRecipe;
use crate::wire::{
    CheckpointFetch, NodePlacement, PlaceSpec, RegistryCredentials, RestoreSpec, SandboxTokens,
    SnapshotSource,
};

/// How long a verb may take (see [`super::Timeouts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pace {
    /// A question the node answers from memory (seconds).
    Quick,
    /// Removals and policies (minutes).
    Moderate,
    /// Starts, checkpoints and image pulls.
    Long,
    /// Template builds.
    Build,
}

macro_rules! verbs {
    ($($verb:ident = $name:literal, $pace:ident;)*) => {
        /// A route `POST /node/v1/{name}`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Verb {
            $($verb,)*
        }

        impl Verb {
            /// The route's last segment: the method's name.
            pub(super) fn name(self) -> &'static str {
                match self {
                    $(Verb::$verb => $name,)*
                }
            }

            pub(super) fn pace(self) -> Pace {
                match self {
                    $(Verb::$verb => Pace::$pace,)*
                }
            }

            pub(super) fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($name => Some(Verb::$verb),)*
                    _ => None,
                }
            }
        }
    };
}

verbs! {
    Admit = "admit", Quick;
    ReleaseSlot = "release_slot", Quick;
    ClaimSlot = "claim_slot", Quick;
    ReleaseUnusedAdmission = "release_unused_admission", Quick;
    ResolveImage = "resolve_image", Long;
    Place = "place", Long;
    CloneSnapshot = "clone_snapshot", Long;
    Resume = "resume", Long;
    IsAlive = "is_alive", Quick;
    Adopt = "adopt", Moderate;
    Remove = "remove", Moderate;
    ReleaseKeepingAddress = "release_keeping_address", Moderate;
    Pause = "pause", Long;
    FinishInterruptedPause = "finish_interrupted_pause", Long;
    StageSnapshot = "stage_snapshot", Long;
    CommitSnapshot = "commit_snapshot", Long;
    HasSnapshot = "has_snapshot", Quick;
    FetchCheckpoint = "fetch_checkpoint", Long;
    RemoveSnapshot = "remove_snapshot", Moderate;
    DiscardInterruptedSnapshot = "discard_interrupted_snapshot", Moderate;
    SnapshotKeys = "snapshot_keys", Quick;
    BuildTemplate = "build_template", Build;
    RemoveTemplate = "remove_template", Moderate;
    SetEgressPolicy = "set_egress_policy", Moderate;
    Status = "status", Quick;
}

// The arguments of each verb, by the method's parameter names.

/// `admit`, `snapshot_keys`, `status`.
#[derive(Serialize, Deserialize)]
pub(super) struct NoArgs {}

/// `release_slot`, `claim_slot`.
#[derive(Serialize, Deserialize)]
pub(super) struct SlotArgs {
    pub slot: u32,
}

/// `release_unused_admission`.
#[derive(Serialize, Deserialize)]
pub(super) struct UnusedAdmissionArgs {
    pub slot: u32,
    pub min_age_ms: u64,
}

#[derive(Serialize, Deserialize)]
pub(super) struct ResolveImageArgs {
    pub reference: String,
    pub auth: Option<RegistryCredentials>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct PlaceArgs {
    pub spec: PlaceSpec,
    pub slot: u32,
}

/// `clone_snapshot`, `resume`.
#[derive(Serialize, Deserialize)]
pub(super) struct RestoreArgs {
    pub key: String,
    pub spec: RestoreSpec,
    pub slot: u32,
}

#[derive(Serialize, Deserialize)]
pub(super) struct IsAliveArgs {
    pub placement: NodePlacement,
}

#[derive(Serialize, Deserialize)]
pub(super) struct AdoptArgs {
    pub id: String,
    pub placement: NodePlacement,
    pub tokens: SandboxTokens,
    pub policy: EgressPolicy,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub credential_proxy: bool,
}

#[derive(Serialize, Deserialize)]
pub(super) struct RemoveArgs {
    pub id: String,
    pub placement: Option<NodePlacement>,
    pub slot: Option<u32>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct ReleaseKeepingAddressArgs {
    pub id: String,
    pub placement: Option<NodePlacement>,
    pub slot: u32,
}

#[derive(Serialize, Deserialize)]
pub(super) struct PauseArgs {
    pub id: String,
    pub source: SnapshotSource,
}

#[derive(Serialize, Deserialize)]
pub(super) struct SourceArgs {
    pub source: SnapshotSource,
}

#[derive(Serialize, Deserialize)]
pub(super) struct StageArgs {
    pub source: SnapshotSource,
    pub short_freeze: bool,
}

#[derive(Serialize, Deserialize)]
pub(super) struct CommitArgs {
    pub key: String,
    pub placement: NodePlacement,
}

/// `has_snapshot`, `remove_snapshot`, `discard_interrupted_snapshot`, `remove_template`.
#[derive(Serialize, Deserialize)]
pub(super) struct KeyArgs {
    pub key: String,
}

#[derive(Serialize, Deserialize)]
pub(super) struct FetchArgs {
    pub key: String,
    pub manifest: String,
    pub execd_token: String,
    #[serde(default)]
    pub fetch: CheckpointFetch,
}

#[derive(Serialize, Deserialize)]
pub(super) struct BuildArgs {
    pub key: String,
    pub image: String,
    pub recipe: GoldenRecipe,
}

#[derive(Serialize, Deserialize)]
pub(super) struct PolicyArgs {
    pub id: String,
    pub policy: EgressPolicy,
}
