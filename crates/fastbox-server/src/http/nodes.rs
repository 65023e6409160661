//! `/nodes...` handlers (fastbox's own): the nodes sandboxes run on, and revocation of a
//! registered one.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use fastbox_api::lifecycle::ErrorResponse;
use serde::Serialize;
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::nodes::NodeView;

use super::AppState;
use super::extract::ApiPath;

/// One node.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInfo {
    pub id: String,
    /// `static` (in process or configured: holds no lease), `ready`, `expired` (its lease ran
    /// out: nothing new goes there) or `lost`.
    pub state: String,
    /// `host:port` of its node proxy, for a registered node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<String>,
    /// Milliseconds until its lease runs out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_left_ms: Option<u64>,
    /// Its last report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_slots: Option<u32>,
    /// Pre-restored sandboxes waiting, all templates together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooled: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_available_bytes: Option<u64>,
    /// Sandboxes running there, by its last report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u32>,
    /// Sandboxes this server admitted into it since it started.
    pub admitted_total: u64,
    /// Its DART delivery counters by name (`peer_fetches`, `origin_fetches`, ...), when it
    /// delivers through DART.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery: Option<std::collections::BTreeMap<String, u64>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ListNodesResponse {
    pub items: Vec<NodeInfo>,
}

impl From<NodeView> for NodeInfo {
    fn from(view: NodeView) -> Self {
        let status = view.status.as_ref();
        Self {
            state: view.state_text().to_string(),
            id: view.id,
            proxy: view.proxy,
            lease_left_ms: view
                .lease_left
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            slots: status.map(|s| s.slots),
            free_slots: status.map(|s| s.free_slots),
            pooled: status.map(|s| s.pools.values().sum()),
            memory_available_bytes: status.and_then(|s| s.memory_available_bytes),
            sandboxes: status.and_then(|s| s.sandboxes),
            admitted_total: view.admitted_total,
            delivery: status.and_then(|s| s.delivery.clone()),
        }
    }
}

#[utoipa::path(get, path = "/nodes", responses((status = 200, body = ListNodesResponse)))]
pub async fn list(State(state): State<AppState>) -> Json<ListNodesResponse> {
    Json(ListNodesResponse {
        items: state
            .lifecycle
            .list_nodes()
            .into_iter()
            .map(NodeInfo::from)
            .collect(),
    })
}

#[utoipa::path(delete, path = "/nodes/{nodeId}", params(("nodeId" = String, Path)), responses(
    (status = 204), (status = 404, body = ErrorResponse), (status = 409, body = ErrorResponse)))]
pub async fn revoke(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    state.lifecycle.revoke_node(&id)?;
    Ok(StatusCode::NO_CONTENT)
}
