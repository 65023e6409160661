//! What a node asks of the control plane: the policy operations behind port 18080 (a change
//! made from inside a sandbox is validated, applied and recorded by the server, like one made
//! through the lifecycle API) and which sandboxes' ports need a credential. The server
//! implements both; the in-process node calls it directly.

use async_trait::async_trait;
use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::{NetworkPolicy, NetworkRule};
pub use fastbox_proxy::access::AccessToken;
use http::StatusCode;

/// The OpenSandbox egress policy port.
pub const EGRESS_PORT: u16 = 18080;
/// The header that carries a sandbox's egress token.
pub const EGRESS_AUTH_HEADER: &str = "OPENSANDBOX-EGRESS-AUTH";
/// Where a change came from, for the sandbox's events.
pub const VIA_EGRESS_PORT: &str = "port 18080";
pub use fastbox_proxy::access::SECURE_ACCESS_HEADER;

/// A change of a sandbox's egress policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyChange {
    /// `PUT` (lifecycle API only): the whole policy.
    Replace(NetworkPolicy),
    /// `PATCH`: rules merged in front of the current ones (the first rule of a target wins).
    Patch(Vec<NetworkRule>),
    /// `DELETE`: the rules of these targets go; unknown targets are ignored.
    Delete(Vec<String>),
}

impl PolicyChange {
    /// The HTTP method that asks for it.
    pub fn method(&self) -> &'static str {
        match self {
            Self::Replace(_) => "PUT",
            Self::Patch(_) => "PATCH",
            Self::Delete(_) => "DELETE",
        }
    }
}

/// A refusal of the [`EgressApi`], already mapped to HTTP by its implementation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EgressApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

/// The policy operations behind port 18080 (the lifecycle server implements them: it owns
/// the records a change must be written to).
#[async_trait]
pub trait EgressApi: Send + Sync {
    /// The policy of sandbox `id`.
    async fn policy(&self, id: &str) -> Result<PolicyStatusResponse, EgressApiError>;

    /// Validates `change`, applies it live (on the sandbox's node) and records it; `via`
    /// names the path it came through (for the sandbox's events).
    async fn change(
        &self,
        id: &str,
        change: PolicyChange,
        via: &str,
    ) -> Result<PolicyStatusResponse, EgressApiError>;
}

/// How a sandbox's ports may be reached.
#[derive(Debug, Clone)]
pub enum SandboxAccess {
    /// By anyone who knows the URL (OpenSandbox's default).
    Open,
    /// With this token in `OpenSandbox-Secure-Access`, or a signed route.
    Secure(AccessToken),
}

/// What the node proxy asks the server about a sandbox's access (a remote node asks over
/// the network: see [`crate::remote`]).
#[async_trait]
pub trait AccessApi: Send + Sync {
    /// The access rule of sandbox `id`; `None` when there is no such sandbox (or, for a
    /// remote node, when the server could not be asked: the request is refused).
    async fn access(&self, id: &str) -> Option<SandboxAccess>;
}
