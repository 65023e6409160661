//! Registered nodes: a `fastbox node` joins with the cluster's join token and gets two
//! credentials of its own; it holds a lease by heartbeats; a node whose lease ran out longer
//! ago than the margin is lost, and its running sandboxes fail (`NODE_LOST`). The control
//! API's side of it ([`ControlPlane`]): who calls, and which sandboxes a node may ask about.
//!
//! Nothing is reassigned on a call that timed out: only the lease decides. A lost node froze
//! its sandboxes before its lease ran out (its guard), so a sandbox never runs on two nodes;
//! paused sandboxes keep their checkpoint and stay `Paused`.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use chrono::Utc;
use fastbox_api::lifecycle::SandboxState;
use fastbox_node_api::membership::{
    Caller, ControlPlane, Heartbeat, MembershipError, Registered, Registration, Renewal,
    check_node_id, route_keys_digest,
};
use fastbox_node_api::remote::{Credential, NodeClient, Timeouts};
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::nodes::{NodeState, NodeView};
use crate::record::NodeRecord;

use super::lifecycle::Lifecycle;

/// The reason recorded on sandboxes that ran on a lost node.
pub const NODE_LOST: &str = "NODE_LOST";

/// A registered node as the server holds it in memory.
pub(super) struct Member {
    record: NodeRecord,
    /// SHA-256 of the credential it presents.
    node_to_server: [u8; 32],
}

impl Member {
    fn of(record: NodeRecord) -> Option<Self> {
        let digest = hex::decode(&record.node_to_server_sha256).ok()?;
        Some(Self {
            node_to_server: digest.try_into().ok()?,
            record,
        })
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// `a == b` in time independent of where they differ.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Lifecycle {
    /// Accepts registrations presenting `token` from now on (`None`: none).
    pub fn set_join_token(&self, token: Option<Credential>) {
        *self.join_token.write().expect("join token lock") = token;
    }

    /// The nodes registered before this start, each added with a fresh lease (to heartbeat
    /// again before it is lost). How many.
    pub fn load_registered_nodes(&self) -> Result<usize, ApiError> {
        let records = self.store.load_nodes()?;
        let mut loaded = 0;
        for record in records {
            match self.admit_member(record) {
                Ok(()) => loaded += 1,
                Err(e) => tracing::warn!(error = %e, "a registered node could not be loaded"),
            }
        }
        Ok(loaded)
    }

    /// Adds the node `record` names (its client, its lease) and keeps its credential's digest.
    fn admit_member(&self, record: NodeRecord) -> Result<(), ApiError> {
        let credential: Credential = record
            .server_to_node
            .parse()
            .map_err(|e| ApiError::Internal(format!("node {}: {e}", record.node_id)))?;
        let client = NodeClient::new(
            record.node_id.clone(),
            &record.url,
            credential,
            Timeouts::default(),
        )
        .map_err(|e| ApiError::InvalidParameter(format!("node {}: {e}", record.node_id)))?
        .with_image_config(self.images.clone());
        let member = Member::of(record.clone()).ok_or_else(|| {
            ApiError::Internal(format!("node {}: a bad credential digest", record.node_id))
        })?;
        let until = Instant::now() + self.lease_duration();
        self.nodes
            .add_leased(Arc::new(client), record.proxy_public.clone(), until);
        self.members
            .lock()
            .expect("members lock")
            .insert(record.node_id.clone(), member);
        Ok(())
    }

    fn lease_duration(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.cfg.leases.terms.lease_ms)
    }

    /// `GET /v1/nodes`: every node, with its lease and last report.
    pub fn list_nodes(&self) -> Vec<NodeView> {
        self.nodes.views()
    }

    /// `DELETE /v1/nodes/{id}`: revokes a registered node: its credentials stop working at
    /// once (it cannot renew, so its guard freezes its sandboxes) and its running sandboxes
    /// fail (`NODE_LOST`). The in-process node and configured ones cannot be revoked.
    pub fn revoke_node(&self, id: &str) -> Result<(), ApiError> {
        if !self.members.lock().expect("members lock").contains_key(id) {
            return Err(match self.nodes.get(Some(id)) {
                Ok(_) => ApiError::Conflict(format!(
                    "node {id} did not register: it is part of this server's configuration"
                )),
                Err(_) => ApiError::NodeNotFound(id.to_string()),
            });
        }
        self.store.remove_node(id)?;
        self.members.lock().expect("members lock").remove(id);
        self.nodes.remove(id);
        self.fail_sandboxes_of(id, &format!("node {id} was revoked"));
        tracing::warn!(node = %id, "node revoked");
        Ok(())
    }

    /// Declares lost the nodes whose lease ran out longer ago than the margin (one pass of
    /// the reconciler).
    pub(super) fn declare_lost_nodes(&self) {
        for id in self.nodes.newly_lost(self.cfg.leases.lost_margin) {
            tracing::error!(node = %id, "node lost: its lease ran out");
            self.fail_sandboxes_of(&id, &format!("node {id} was lost (its lease ran out)"));
        }
    }

    /// The sandboxes on node `id` that ran or were about to: `Failed` (`NODE_LOST`). Paused
    /// ones keep their checkpoint and stay `Paused`. Nothing is asked of the node.
    fn fail_sandboxes_of(&self, id: &str, message: &str) {
        let first = self.nodes.first_id();
        for record in self.snapshot() {
            if record.node.as_deref().unwrap_or(&first) != id {
                continue;
            }
            let _ = self.update(&record.id, |r| {
                match r.state() {
                    SandboxState::Pending
                    | SandboxState::Running
                    | SandboxState::Pausing
                    | SandboxState::Resuming => {
                        r.transition(SandboxState::Failed, Some(NODE_LOST), message)
                    }
                    SandboxState::Paused => r.event("NodeLost", message),
                    _ => {}
                }
                Ok(())
            });
        }
    }

    /// Whether the records of node `id` are left alone (it is lost: nothing is asked of it
    /// until it renews its lease).
    pub(super) fn node_is_lost(&self, id: Option<&str>) -> bool {
        self.nodes.is_lost(id)
    }
}

#[async_trait]
impl ControlPlane for Lifecycle {
    fn authenticate(&self, presented: &[u8]) -> Option<Caller> {
        if let Some(token) = self.join_token.read().expect("join token lock").as_ref()
            && token.matches(presented)
        {
            return Some(Caller::Joining);
        }
        let digest = sha256(presented);
        let members = self.members.lock().expect("members lock");
        // Every member is compared, so the time taken does not tell which one matched.
        members
            .values()
            .filter(|m| same(&m.node_to_server, &digest))
            .map(|m| Caller::Node(m.record.node_id.clone()))
            .fold(None, |found, caller| found.or(Some(caller)))
    }

    fn holds(&self, node_id: &str, sandbox_id: &str) -> bool {
        let first = self.nodes.first_id();
        self.record(sandbox_id)
            .is_ok_and(|r| r.node.as_deref().unwrap_or(&first) == node_id)
    }

    async fn register(&self, registration: Registration) -> Result<Registered, MembershipError> {
        check_node_id(&registration.node_id)?;
        let id = registration.node_id.clone();
        let proxy = registration.proxy_public.trim();
        if proxy.is_empty() || proxy.contains('/') || !proxy.contains(':') {
            return Err(MembershipError::Invalid(format!(
                "proxy_public {proxy:?} is not host:port"
            )));
        }
        let registered_before = self.members.lock().expect("members lock").contains_key(&id);
        if !registered_before && self.nodes.get(Some(&id)).is_ok() {
            return Err(MembershipError::Refused(format!(
                "node id {id} is taken by a node of this server's configuration"
            )));
        }
        let fresh = || {
            Credential::generate().map_err(|e| MembershipError::Failed(format!("getrandom: {e}")))
        };
        let (server_to_node, node_to_server) = (fresh()?, fresh()?);
        let record = NodeRecord {
            node_id: id.clone(),
            url: registration.url.clone(),
            proxy_public: proxy.to_string(),
            server_to_node: server_to_node.to_string(),
            node_to_server_sha256: hex::encode(sha256(node_to_server.to_string().as_bytes())),
            registered_at: Utc::now(),
        };
        // Checked before it is kept: a URL the client refuses is the node's mistake.
        NodeClient::new(
            id.clone(),
            &record.url,
            server_to_node.clone(),
            Timeouts::default(),
        )
        .map_err(|e| MembershipError::Invalid(format!("url {:?}: {e}", record.url)))?;
        self.store
            .put_node(&record)
            .map_err(|e| MembershipError::Failed(e.to_string()))?;
        self.admit_member(record)
            .map_err(|e| MembershipError::Failed(e.to_string()))?;
        tracing::info!(node = %id, url = %registration.url, proxy, again = registered_before, "node registered");
        Ok(Registered {
            server_to_node: server_to_node.to_string(),
            node_to_server: node_to_server.to_string(),
            terms: self.cfg.leases.terms,
            route_keys: Some(self.keys.file_text()),
        })
    }

    async fn heartbeat(
        &self,
        node_id: &str,
        heartbeat: Heartbeat,
    ) -> Result<Renewal, MembershipError> {
        // Counted from now, which is after the node sent it: the node counts from its send,
        // so its own deadline always comes first.
        let until = Instant::now() + self.lease_duration();
        let was_lost = self
            .nodes
            .renew(node_id, until)
            .ok_or_else(|| MembershipError::Unknown(node_id.to_string()))?;
        self.nodes.report(heartbeat.status);
        if was_lost {
            tracing::warn!(node = %node_id, "a lost node renewed its lease: what it ran is removed");
        }
        let keys = self.keys.file_text();
        let held = heartbeat.route_keys_sha256.as_deref();
        let route_keys = (held != Some(route_keys_digest(&keys).as_str())).then_some(keys);
        Ok(Renewal {
            terms: self.cfg.leases.terms,
            was_lost,
            route_keys,
        })
    }
}

impl NodeView {
    /// The state as the API writes it.
    pub fn state_text(&self) -> &'static str {
        match self.state {
            NodeState::Static => "static",
            NodeState::Ready => "ready",
            NodeState::Expired => "expired",
            NodeState::Lost => "lost",
        }
    }
}
