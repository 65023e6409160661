//! Cluster membership: how a `fastbox node` joins a server, holds its lease by heartbeats,
//! and who may call the control API ([`ControlPlane`]).
//!
//! A node joins with the cluster's join token ([`Registration`]); the server answers two
//! credentials made for that node alone ([`Registered`]): the one the server presents to
//! the node, and the one the node presents back. A node holds a lease it renews with
//! heartbeats ([`Heartbeat`] answered by [`Renewal`]). A node that cannot renew freezes its
//! sandboxes before the lease runs out; the server declares it lost only after the lease plus
//! a margin ([`LeaseTerms`]).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::wire::NodeStatus;

/// A node id: 1 to 63 characters of `[a-z0-9-]`, not starting with `-`.
pub fn check_node_id(id: &str) -> Result<(), MembershipError> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && !id.starts_with('-')
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    match ok {
        true => Ok(()),
        false => Err(MembershipError::Invalid(format!(
            "node id {id:?}: 1 to 63 characters of a-z, 0-9 and '-', not starting with '-'"
        ))),
    }
}

/// What a node tells the server when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub node_id: String,
    /// Base URL of the node API (the server calls it).
    pub url: String,
    /// `host:port` clients reach the node proxy at (sandbox endpoints point there).
    pub proxy_public: String,
    /// For an `https://` URL: the pin (SHA-256 hex, [`crate::remote::tls::CertPin`]) of the
    /// node API's certificate, the only one the server accepts from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_pin: Option<String>,
}

/// How long a lease lasts and how often a node renews it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseTerms {
    /// A renewal holds for this long from the moment the node sent its heartbeat.
    pub lease_ms: u64,
    /// The node sends a heartbeat this often.
    pub heartbeat_ms: u64,
}

impl LeaseTerms {
    /// When a node must have frozen its sandboxes, counted from the send of its last
    /// renewed heartbeat: a fifth of the lease (at least 500 ms) before the lease ends, so a
    /// slow freeze still ends before the server can declare the node lost (the lease plus
    /// its margin).
    pub fn fence_after_ms(&self) -> u64 {
        let safety = (self.lease_ms / 5).max(500);
        self.lease_ms.saturating_sub(safety)
    }
}

/// The server's answer to a registration: the node's two credentials (64 hex digits each;
/// `crate::remote::Credential` parses them), its lease terms, and the server's route signing
/// keys (the text of its key file), so the node proxy verifies the routes the server signs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    pub server_to_node: String,
    pub node_to_server: String,
    pub terms: LeaseTerms,
    #[serde(default)]
    pub route_keys: Option<String>,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("terms", &self.terms)
            .finish_non_exhaustive()
    }
}

/// What a heartbeat says of the route signing keys a node holds: SHA-256 (hex) of their key
/// file's text.
pub fn route_keys_digest(file_text: &str) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(file_text.as_bytes()))
}

/// A node's heartbeat: its status (capacity, warm pools, memory).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub status: NodeStatus,
    /// SHA-256 (hex) of the route signing keys the node holds (their key file's text).
    #[serde(default)]
    pub route_keys_sha256: Option<String>,
}

/// The server's answer to a heartbeat.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Renewal {
    pub terms: LeaseTerms,
    /// The server had declared the node lost since its last renewal: the sandboxes it ran
    /// then are Failed (`NODE_LOST`) and the server removes them.
    pub was_lost: bool,
    /// How many times the server ever declared the node lost (kept across restarts of
    /// either side). A node that froze its sandboxes (fenced) thaws them only when this is
    /// the count it knew before the fence.
    #[serde(default)]
    pub losses: u64,
    /// The server's route signing keys, when the node's differ (rotated or retired since).
    #[serde(default)]
    pub route_keys: Option<String>,
}

impl std::fmt::Debug for Renewal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewal")
            .field("terms", &self.terms)
            .field("was_lost", &self.was_lost)
            .field("losses", &self.losses)
            .field(
                "route_keys",
                &self.route_keys.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Who presented a credential to the control API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A registered node, by id.
    Node(String),
    /// A node joining with the cluster's join token (it may only register).
    Joining,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum MembershipError {
    /// The request is malformed (a bad node id, URL or address).
    #[error("{0}")]
    Invalid(String),
    /// Registration is not possible here (no join token: static nodes only).
    #[error("{0}")]
    Refused(String),
    /// The node is not registered (revoked, or another server's).
    #[error("node {0} is not registered with this server")]
    Unknown(String),
    /// The server could not decide now (its state store did not answer): the node tries
    /// again (the control API answers 503, which a node treats as an unanswered call).
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Failed(String),
}

/// The server's side of the control API besides egress and access: who calls, which
/// sandboxes a node may ask about, registration and heartbeats.
#[async_trait]
pub trait ControlPlane: Send + Sync {
    /// Who `presented` (the `X-Fastbox-Credential` value) belongs to, compared in constant
    /// time; `None`: nobody.
    fn authenticate(&self, presented: &[u8]) -> Option<Caller>;

    /// Whether node `node_id` holds sandbox `sandbox_id` (the egress and access routes
    /// answer a node only about its own sandboxes).
    fn holds(&self, node_id: &str, sandbox_id: &str) -> bool;

    /// A node joins: `caller` [`Caller::Joining`] for a name not registered, or the node
    /// itself ([`Caller::Node`] of the same name) registering again (its old credentials stop
    /// working). The join token never takes over a registered name.
    async fn register(
        &self,
        caller: &Caller,
        registration: Registration,
    ) -> Result<Registered, MembershipError>;

    /// Node `node_id` renews its lease.
    async fn heartbeat(
        &self,
        node_id: &str,
        heartbeat: Heartbeat,
    ) -> Result<Renewal, MembershipError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_short_dns_labels() {
        for good in ["a", "node-1", "n0", &"x".repeat(63)] {
            assert!(check_node_id(good).is_ok(), "{good}");
        }
        for bad in ["", "-a", "A", "a_b", "a.b", "a/b", &"x".repeat(64), "é"] {
            assert!(check_node_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_node_fences_well_before_its_lease_ends() {
        let terms = LeaseTerms {
            lease_ms: 10_000,
            heartbeat_ms: 1_000,
        };
        assert_eq!(terms.fence_after_ms(), 8_000);
        let short = LeaseTerms {
            lease_ms: 2_000,
            heartbeat_ms: 250,
        };
        assert_eq!(short.fence_after_ms(), 1_500);
    }

    #[test]
    fn debug_never_shows_credentials() {
        let r = Registered {
            server_to_node: "s".repeat(64),
            node_to_server: "n".repeat(64),
            terms: LeaseTerms {
                lease_ms: 1,
                heartbeat_ms: 1,
            },
            route_keys: Some("0:kkkkkk".into()),
        };
        let shown = format!("{r:?}");
        assert!(
            !shown.contains("sss") && !shown.contains("nnn") && !shown.contains("kkk"),
            "{shown}"
        );
        let renewal = Renewal {
            terms: r.terms,
            was_lost: false,
            losses: 0,
            route_keys: r.route_keys.clone(),
        };
        let shown = format!("{renewal:?}");
        assert!(!shown.contains("kkk"), "{shown}");
    }
}
