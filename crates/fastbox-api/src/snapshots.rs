//! Snapshots (`/v1/sandboxes/{id}/snapshots`, `/v1/snapshots...`) and fastbox's native fork
//! (`POST /v1/sandboxes/{id}/fork`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::{CreateSandboxResponse, PaginationInfo, StringMap};

/// Where a snapshot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum SnapshotState {
    Creating,
    Ready,
    Failed,
    Deleting,
    /// A state this version does not know.
    #[serde(other)]
    Unknown,
}

impl SnapshotState {
    pub const ALL: [SnapshotState; 4] = [Self::Creating, Self::Ready, Self::Failed, Self::Deleting];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Creating => "Creating",
            Self::Ready => "Ready",
            Self::Failed => "Failed",
            Self::Deleting => "Deleting",
            Self::Unknown => "Unknown",
        }
    }

    /// Parses a state name, case-insensitively.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
    }
}

impl std::fmt::Display for SnapshotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    pub state: SnapshotState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<DateTime<Utc>>,
}

/// A point-in-time capture of a sandbox: memory, processes and writable layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub id: String,
    pub sandbox_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub status: SnapshotStatus,
    pub created_at: DateTime<Utc>,
}

/// `POST /v1/sandboxes/{id}/snapshots` (the body is optional).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListSnapshotsResponse {
    pub items: Vec<Snapshot>,
    pub pagination: PaginationInfo,
}

/// `POST /v1/sandboxes/{id}/fork`: `count` new sandboxes from one live snapshot of a running
/// sandbox (a fastbox extension).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForkRequest {
    pub count: u32,
    /// Metadata of the new sandboxes (default: the source's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<StringMap>,
    /// Lifetime of the new sandboxes in seconds (default: the source's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ForkResponse {
    /// The snapshot the sandboxes are restored from.
    pub snapshot_id: String,
    pub items: Vec<CreateSandboxResponse>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_speak_camel_case_and_omit_nulls() {
        let s = Snapshot {
            id: "s".into(),
            sandbox_id: "b".into(),
            name: None,
            status: SnapshotStatus {
                state: SnapshotState::Creating,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            created_at: DateTime::<Utc>::from_timestamp(0, 0).unwrap(),
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(text.contains("\"sandboxId\":\"b\"") && text.contains("\"Creating\""));
        assert!(!text.contains("null"), "{text}");
        assert_eq!(SnapshotState::parse("ready"), Some(SnapshotState::Ready));
        let unknown: SnapshotState = serde_json::from_str("\"Archived\"").unwrap();
        assert_eq!(unknown, SnapshotState::Unknown);
        assert!(serde_json::from_str::<CreateSnapshotRequest>("{\"nam\":1}").is_err());
    }
}
