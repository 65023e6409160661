//! Egress policies of running sandboxes: the one implementation of "validate, apply live,
//! record" behind both the lifecycle API's `networkpolicy` routes and port 18080 (the node
//! proxy calls it through [`EgressApi`]). See `docs/egress.md` for the semantics.

use std::sync::Arc;

use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::{NetworkPolicy, SandboxState};
use fastbox_egress_policy::{EgressPolicy, Mode, rules_from_wire};
use fastbox_node_api::control::{EgressApi, EgressApiError, PolicyChange};
use fastbox_node_api::{NodeError, NodeErrorKind};

use crate::error::ApiError;
use crate::record::SandboxRecord;

use super::lifecycle::{Lifecycle, not_running};

/// The egress API's `enforcementMode`: DNS answers and nftables.
pub const ENFORCEMENT_MODE: &str = "dns+nft";
/// Where lifecycle API changes come from, for the sandbox's events.
pub const VIA_LIFECYCLE_API: &str = "the lifecycle API";

impl Lifecycle {
    /// `GET .../networkpolicy` and `GET /policy`: the recorded policy, which is the one in
    /// force while the sandbox runs.
    pub fn network_policy(&self, id: &str) -> Result<PolicyStatusResponse, ApiError> {
        Ok(status_of(&self.record(id)?.policy()))
    }

    /// `PUT/PATCH/DELETE .../networkpolicy` from the lifecycle API.
    pub async fn change_network_policy(
        self: &Arc<Self>,
        id: String,
        change: PolicyChange,
    ) -> Result<PolicyStatusResponse, ApiError> {
        self.change_policy(&id, change, VIA_LIFECYCLE_API).await
    }

    /// Computes the new policy from the recorded one, applies it live (connections it newly
    /// denies are cut) and records it with an event. Changes through this server are
    /// serialized; one through another server meanwhile makes the record differ from the
    /// policy the change was computed from: the change is computed again on the policy
    /// recorded now and applied again, so concurrent PATCHes merge instead of losing each
    /// other, and what runs is what is recorded.
    async fn change_policy(
        &self,
        id: &str,
        change: PolicyChange,
        via: &str,
    ) -> Result<PolicyStatusResponse, ApiError> {
        let _serial = self.policy_changes.lock().await;
        let mut record = self.record(id)?;
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.change_policy_once(&record, change.clone(), via).await {
                Err(ChangeOutcome::ChangedMeanwhile) if attempts < MAX_POLICY_ATTEMPTS => {
                    record = self.refresh(id)?;
                }
                Err(ChangeOutcome::ChangedMeanwhile) => {
                    return Err(ApiError::Conflict(format!(
                        "the egress policy of {id} kept changing through other servers: try again"
                    )));
                }
                Err(ChangeOutcome::Failed(e)) => return Err(e),
                Ok(next) => {
                    tracing::info!(sandbox = %id, via, policy = %describe(&next), "egress policy changed");
                    return Ok(status_of(&next));
                }
            }
        }
    }

    /// One attempt of [`Lifecycle::change_policy`] from `record`'s policy.
    async fn change_policy_once(
        &self,
        record: &SandboxRecord,
        change: PolicyChange,
        via: &str,
    ) -> Result<EgressPolicy, ChangeOutcome> {
        let id = record.id.as_str();
        if record.state() != SandboxState::Running {
            return Err(ChangeOutcome::Failed(not_running(
                record,
                ": its egress policy changes only while it runs",
            )));
        }
        let current = record.policy();
        let method = change.method();
        let next = next_policy(&current, change).map_err(ChangeOutcome::Failed)?;
        let node = self
            .node(record.node.as_deref())
            .map_err(ChangeOutcome::Failed)?;
        node.set_egress_policy(id, &next)
            .await
            .map_err(|e| ChangeOutcome::Failed(apply_error(record, e)))?;
        let mut changed_meanwhile = false;
        let written = self.update(id, |r| {
            if r.network_policy != record.network_policy {
                changed_meanwhile = true;
                return Err(ApiError::Conflict(format!(
                    "{id}: policy changed meanwhile"
                )));
            }
            r.network_policy = recorded(&next);
            r.event(
                "EgressPolicyChanged",
                &format!("{method} through {via}: {}", describe(&next)),
            );
            Ok(())
        });
        match written {
            Ok(_) => Ok(next),
            Err(e) => {
                // What runs must be what is recorded (and what a restart re-applies): put the
                // recorded policy back, as it is now.
                let now = self.refresh(id).map(|r| r.policy()).unwrap_or(current);
                if let Err(undo) = node.set_egress_policy(id, &now).await {
                    tracing::error!(sandbox = %id, error = %undo, "could not restore the recorded egress policy");
                }
                Err(match changed_meanwhile {
                    true => ChangeOutcome::ChangedMeanwhile,
                    false => ChangeOutcome::Failed(e),
                })
            }
        }
    }
}

/// How many times a policy change is computed again when other servers change the same
/// sandbox's policy meanwhile.
const MAX_POLICY_ATTEMPTS: u32 = 5;

/// Why an attempt of a policy change did not land.
enum ChangeOutcome {
    /// Another server recorded a change to the policy meanwhile: compute it again.
    ChangedMeanwhile,
    Failed(ApiError),
}

#[async_trait::async_trait]
impl EgressApi for Lifecycle {
    async fn policy(&self, id: &str) -> Result<PolicyStatusResponse, EgressApiError> {
        Ok(self.network_policy(id)?)
    }

    async fn change(
        &self,
        id: &str,
        change: PolicyChange,
        via: &str,
    ) -> Result<PolicyStatusResponse, EgressApiError> {
        Ok(self.change_policy(id, change, via).await?)
    }
}

/// What a record keeps: `None` for allow-all, otherwise the canonical wire form.
pub(super) fn recorded(policy: &EgressPolicy) -> Option<NetworkPolicy> {
    (policy.mode() != Mode::AllowAll).then(|| policy.to_wire())
}

/// The egress API's answer for `policy`.
pub fn status_of(policy: &EgressPolicy) -> PolicyStatusResponse {
    PolicyStatusResponse {
        status: Some("ok".into()),
        mode: Some(policy.mode().as_str().into()),
        enforcement_mode: Some(ENFORCEMENT_MODE.into()),
        reason: None,
        policy: Some(policy.to_wire()),
    }
}

/// `current` changed by `change`, validated; a 400 naming the rule otherwise.
fn next_policy(current: &EgressPolicy, change: PolicyChange) -> Result<EgressPolicy, ApiError> {
    let invalid = |e: fastbox_egress_policy::PolicyError| ApiError::InvalidParameter(e.to_string());
    match change {
        PolicyChange::Replace(wire) => EgressPolicy::from_wire(Some(&wire)).map_err(invalid),
        PolicyChange::Patch(rules) if rules.is_empty() => Err(ApiError::InvalidParameter(
            "PATCH needs at least one rule".into(),
        )),
        PolicyChange::Patch(rules) => {
            let rules = rules_from_wire(&rules).map_err(invalid)?;
            current.patched(rules).map_err(invalid)
        }
        PolicyChange::Delete(targets) if targets.is_empty() => Err(ApiError::InvalidParameter(
            "DELETE needs at least one target".into(),
        )),
        PolicyChange::Delete(targets) => Ok(current.without_targets(&targets)),
    }
}

fn apply_error(record: &super::super::record::SandboxRecord, e: NodeError) -> ApiError {
    match e.kind {
        NodeErrorKind::NotFound => not_running(record, " (not on this node)"),
        _ => e.into(),
    }
}

/// `enforcing, deny default, 2 rules` style.
fn describe(policy: &EgressPolicy) -> String {
    format!(
        "{}, {} default, {} rule(s)",
        policy.mode(),
        policy.default_action(),
        policy.rules().len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_api::lifecycle::NetworkRule;

    fn rule(action: &str, target: &str) -> NetworkRule {
        NetworkRule {
            action: action.into(),
            target: target.into(),
        }
    }

    fn deny_with(rules: &[NetworkRule]) -> EgressPolicy {
        EgressPolicy::from_wire(Some(&NetworkPolicy {
            default_action: Some("deny".into()),
            egress: Some(rules.to_vec()),
        }))
        .unwrap()
    }

    #[test]
    fn changes_merge_into_the_current_policy() {
        let current = deny_with(&[rule("allow", "a.test"), rule("allow", "b.test")]);
        let patched = next_policy(
            &current,
            PolicyChange::Patch(vec![rule("deny", "B.test."), rule("allow", "c.test")]),
        )
        .unwrap();
        let targets: Vec<String> = patched
            .rules()
            .iter()
            .map(|r| r.target.to_string())
            .collect();
        assert_eq!(targets, ["b.test", "c.test", "a.test"]);
        let deleted = next_policy(
            &patched,
            PolicyChange::Delete(vec!["a.test".into(), "x".into()]),
        )
        .unwrap();
        assert_eq!(deleted.rules().len(), 2);
        assert_eq!(deleted.default_action(), patched.default_action());
        let replaced =
            next_policy(&deleted, PolicyChange::Replace(NetworkPolicy::default())).unwrap();
        assert_eq!(replaced.mode(), Mode::AllowAll);
        assert_eq!(recorded(&replaced), None);
        assert_eq!(
            recorded(&EgressPolicy::deny_all())
                .unwrap()
                .default_action
                .as_deref(),
            Some("deny")
        );
    }

    #[test]
    fn bad_changes_are_400s_naming_the_rule() {
        let current = EgressPolicy::allow_all();
        for change in [
            PolicyChange::Patch(vec![]),
            PolicyChange::Delete(vec![]),
            PolicyChange::Patch(vec![rule("allow", "ok.test"), rule("maybe", "x.test")]),
            PolicyChange::Replace(NetworkPolicy {
                default_action: Some("deny".into()),
                egress: Some(vec![rule("allow", "10.0.0.1/24")]),
            }),
        ] {
            let e = next_policy(&current, change.clone()).unwrap_err();
            assert_eq!(
                e.status(),
                axum::http::StatusCode::BAD_REQUEST,
                "{change:?}: {e}"
            );
        }
        let e = next_policy(
            &current,
            PolicyChange::Patch(vec![rule("allow", "ok.test"), rule("maybe", "x.test")]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("egress[1]"), "{e}");
    }

    #[test]
    fn status_carries_mode_and_canonical_policy() {
        let status = status_of(&deny_with(&[rule("allow", "Example.ORG")]));
        assert_eq!(
            serde_json::to_value(&status).unwrap(),
            serde_json::json!({
                "status": "ok", "mode": "enforcing", "enforcementMode": "dns+nft",
                "policy": {"defaultAction": "deny", "egress": [{"action": "allow", "target": "example.org"}]}
            })
        );
    }
}
