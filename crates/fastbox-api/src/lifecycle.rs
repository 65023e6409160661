//! The OpenSandbox lifecycle API's wire types (`/v1/sandboxes...`), as the official 1.1.1 SDK
//! sends and parses them: camelCase JSON, and optional fields omitted when absent (the SDK
//! raises on a JSON `null` where it expects a value, so nothing here serializes `null`).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// String-to-string maps of the API (`env`, `metadata`, `resourceLimits`, `extensions`).
pub type StringMap = BTreeMap<String, String>;

/// `POST /v1/sandboxes`. Unknown fields are ignored, as the reference server does.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxRequest {
    pub image: Option<ImageSpec>,
    pub snapshot_id: Option<String>,
    pub template_id: Option<String>,
    /// Seconds until expiry, at least 60; `null` or absent: no automatic expiry.
    pub timeout: Option<i64>,
    pub resource_limits: Option<StringMap>,
    pub resource_requests: Option<StringMap>,
    pub env: Option<StringMap>,
    pub metadata: Option<StringMap>,
    pub entrypoint: Option<Vec<String>>,
    pub platform: Option<Platform>,
    pub network_policy: Option<NetworkPolicy>,
    #[schema(value_type = Option<Object>)]
    pub credential_proxy: Option<serde_json::Value>,
    pub secure_access: Option<bool>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub volumes: Option<Vec<serde_json::Value>>,
    #[schema(value_type = Option<Object>)]
    pub lifecycle: Option<serde_json::Value>,
    pub extensions: Option<StringMap>,
}

/// A container image and, for private registries, its credentials.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageSpec {
    pub uri: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ImageAuth>,
}

/// Registry credentials of an [`ImageSpec`]; never echoed back.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ImageAuth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
}

impl std::fmt::Debug for ImageAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageAuth")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Platform {
    pub os: String,
    pub arch: String,
}

/// Egress policy of a sandbox: a default action and ordered rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkPolicy {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<NetworkRule>>,
}

impl NetworkPolicy {
    /// `{}`, `allow` with no rules: the policy of a sandbox without one.
    pub fn is_allow_all(&self) -> bool {
        self.default_action.as_deref().is_none_or(|a| a == "allow")
            && self.egress.as_ref().is_none_or(Vec::is_empty)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NetworkRule {
    pub action: String,
    pub target: String,
}

/// The lifecycle states; clients tolerate states they do not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum SandboxState {
    Pending,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Terminated,
    Failed,
    /// A state this version does not know (from a newer or another server).
    #[serde(other)]
    Unknown,
}

impl SandboxState {
    /// The states fastbox itself reports.
    pub const ALL: [SandboxState; 8] = [
        Self::Pending,
        Self::Running,
        Self::Pausing,
        Self::Paused,
        Self::Resuming,
        Self::Stopping,
        Self::Terminated,
        Self::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Pausing => "Pausing",
            Self::Paused => "Paused",
            Self::Resuming => "Resuming",
            Self::Stopping => "Stopping",
            Self::Terminated => "Terminated",
            Self::Failed => "Failed",
            Self::Unknown => "Unknown",
        }
    }

    /// Parses a state name, case-insensitively (`running` and `Running` both work).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|st| st.as_str().eq_ignore_ascii_case(s))
    }

    /// No further transition happens by itself.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Terminated | Self::Failed)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxStatus {
    pub state: SandboxState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_at: Option<DateTime<Utc>>,
}

/// `202` answer to a create.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct CreateSandboxResponse {
    pub id: String,
    pub status: SandboxStatus,
    pub created_at: DateTime<Utc>,
    pub entrypoint: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

/// A sandbox as `GET /v1/sandboxes/{id}`, lists and the metadata patch return it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    pub status: SandboxStatus,
    pub entrypoint: Vec<String>,
    pub created_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extensions: Option<StringMap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
}

impl From<Sandbox> for CreateSandboxResponse {
    fn from(s: Sandbox) -> Self {
        Self {
            id: s.id,
            status: s.status,
            created_at: s.created_at,
            entrypoint: s.entrypoint,
            metadata: s.metadata,
            extensions: s.extensions,
            platform: s.platform,
            expires_at: s.expires_at,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PaginationInfo {
    pub page: u32,
    pub page_size: u32,
    pub total_items: u64,
    pub total_pages: u64,
    pub has_next_page: bool,
}

impl PaginationInfo {
    /// The page `page` (1-based) of `total` items, `page_size` per page, and the index range
    /// of its items.
    pub fn of(page: u32, page_size: u32, total: usize) -> (Self, std::ops::Range<usize>) {
        let size = page_size.max(1) as usize;
        let start = (page.max(1) as usize - 1).saturating_mul(size).min(total);
        let end = start.saturating_add(size).min(total);
        let total_pages = total.div_ceil(size) as u64;
        let info = Self {
            page,
            page_size,
            total_items: total as u64,
            total_pages,
            has_next_page: (page as u64) < total_pages,
        };
        (info, start..end)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ListSandboxesResponse {
    pub items: Vec<Sandbox>,
    pub pagination: PaginationInfo,
}

/// Where a client reaches a sandbox port: a scheme-less `host:port/path` and headers to send.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Endpoint {
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<StringMap>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RenewSandboxExpirationRequest {
    pub expires_at: DateTime<chrono::FixedOffset>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct RenewSandboxExpirationResponse {
    pub expires_at: DateTime<Utc>,
}

/// Every error of the lifecycle API: `{"code", "message"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub code: String,
    pub message: String,
}

/// `GET /v1/sandboxes/{id}/diagnostics/{logs,events}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticContentResponse {
    pub sandbox_id: String,
    /// `logs` or `events`.
    pub kind: String,
    pub scope: String,
    /// `inline` (fastbox always answers inline).
    pub delivery: String,
    pub content_type: String,
    pub truncated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_length: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
}

/// `GET /health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HealthResponse {
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// `GET /version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct VersionResponse {
    pub version: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_create_body_parses() {
        let body = r#"{"image":{"uri":"python:3.11"},"timeout":null,"resourceLimits":{"cpu":"500m","memory":"512Mi"},"entrypoint":["python","-m","http.server"],"networkPolicy":{"defaultAction":"deny","egress":[{"action":"allow","target":"example.org"}]},"secureAccess":false}"#;
        let req: CreateSandboxRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.image.unwrap().uri, "python:3.11");
        assert_eq!(req.timeout, None);
        assert!(!req.network_policy.unwrap().is_allow_all());
    }

    #[test]
    fn absent_optionals_are_omitted_never_null() {
        let s = Sandbox {
            id: "x".into(),
            status: SandboxStatus {
                state: SandboxState::Running,
                reason: None,
                message: None,
                last_transition_at: None,
            },
            entrypoint: vec!["tail".into()],
            created_at: Utc::now(),
            image: None,
            snapshot_id: None,
            platform: None,
            metadata: None,
            extensions: None,
            expires_at: None,
        };
        let text = serde_json::to_string(&s).unwrap();
        assert!(!text.contains("null"), "{text}");
        assert!(text.contains("\"createdAt\""));
    }

    #[test]
    fn unknown_states_are_tolerated() {
        let s: SandboxStatus = serde_json::from_str(r#"{"state":"Allocated"}"#).unwrap();
        assert_eq!(s.state, SandboxState::Unknown);
        assert_eq!(SandboxState::parse("running"), Some(SandboxState::Running));
        assert_eq!(SandboxState::parse("Unknown"), None);
    }

    #[test]
    fn allow_all_policies() {
        assert!(NetworkPolicy::default().is_allow_all());
        let allow = NetworkPolicy {
            default_action: Some("allow".into()),
            egress: Some(vec![]),
        };
        assert!(allow.is_allow_all());
        let deny_all = NetworkPolicy {
            default_action: Some("deny".into()),
            egress: None,
        };
        assert!(!deny_all.is_allow_all());
    }

    #[test]
    fn pagination_pages() {
        let (p, r) = PaginationInfo::of(2, 5, 12);
        assert_eq!((p.total_pages, p.has_next_page, r), (3, true, 5..10));
        let (p, r) = PaginationInfo::of(3, 5, 12);
        assert_eq!((p.has_next_page, r), (false, 10..12));
        let (p, r) = PaginationInfo::of(9, 5, 12);
        assert_eq!((p.has_next_page, r), (false, 12..12));
        let (p, r) = PaginationInfo::of(1, 20, 0);
        assert_eq!((p.total_pages, p.has_next_page, r), (0, false, 0..0));
    }

    #[test]
    fn image_auth_is_redacted_in_debug() {
        let a = ImageAuth {
            username: Some("u".into()),
            password: Some("hunter2".into()),
        };
        assert!(!format!("{a:?}").contains("hunter2"));
    }
}
