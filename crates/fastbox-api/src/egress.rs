//! The OpenSandbox egress API's wire types (`specs/egress-api.yaml`): what `GET/PATCH/DELETE
//! /policy` on port 18080 and the lifecycle `networkpolicy` routes answer.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::lifecycle::NetworkPolicy;

/// The policy in force and how it is enforced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyStatusResponse {
    /// `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// `allow_all`, `deny_all` or `enforcing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// `dns` or `dns+nft`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<NetworkPolicy>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_form_is_camel_case_without_nulls() {
        let status = PolicyStatusResponse {
            status: Some("ok".into()),
            mode: Some("deny_all".into()),
            enforcement_mode: Some("dns+nft".into()),
            reason: None,
            policy: Some(NetworkPolicy {
                default_action: Some("deny".into()),
                egress: None,
            }),
        };
        assert_eq!(
            serde_json::to_string(&status).unwrap(),
            r#"{"status":"ok","mode":"deny_all","enforcementMode":"dns+nft","policy":{"defaultAction":"deny"}}"#
        );
    }
}
