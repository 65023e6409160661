//! Conversions from and to the OpenSandbox wire type
//! ([`fastbox_api::lifecycle::NetworkPolicy`]).
//!
//! From the wire: no policy, `{}` and `{"defaultAction": "allow"}` mean allow-all; a
//! missing `defaultAction` next to rules means `deny` (the egress API: "Defaults to deny");
//! `{"defaultAction": "deny"}` with no rules denies everything. To the wire: the canonical
//! form, `defaultAction` always present, `egress` only when there are rules, targets in
//! canonical form (names lower-cased, no trailing dot).

use fastbox_api::lifecycle::{NetworkPolicy, NetworkRule};

use super::{Action, EgressPolicy, PolicyError, Rule};

impl TryFrom<&NetworkPolicy> for EgressPolicy {
    type Error = PolicyError;

    fn try_from(wire: &NetworkPolicy) -> Result<Self, PolicyError> {
        let rules = rules_from_wire(wire.egress.as_deref().unwrap_or_default())?;
        let default = match wire.default_action.as_deref() {
            Some(raw) => {
                Action::parse(raw).ok_or_else(|| PolicyError::BadDefaultAction(raw.to_owned()))?
            }
            None if rules.is_empty() => Action::Allow,
            None => Action::Deny,
        };
        EgressPolicy::try_new(default, rules)
    }
}

impl TryFrom<NetworkPolicy> for EgressPolicy {
    type Error = PolicyError;

    fn try_from(wire: NetworkPolicy) -> Result<Self, PolicyError> {
        Self::try_from(&wire)
    }
}

impl EgressPolicy {
    /// The policy of a create request or a PUT: `None` (no `networkPolicy`) is allow-all.
    pub fn from_wire(wire: Option<&NetworkPolicy>) -> Result<Self, PolicyError> {
        wire.map_or_else(|| Ok(Self::allow_all()), Self::try_from)
    }

    /// The canonical wire form (what `GET /policy` returns).
    pub fn to_wire(&self) -> NetworkPolicy {
        NetworkPolicy {
            default_action: Some(self.default_action().as_str().to_owned()),
            egress: (!self.rules().is_empty())
                .then(|| self.rules().iter().map(NetworkRule::from).collect()),
        }
    }
}

impl From<&EgressPolicy> for NetworkPolicy {
    fn from(policy: &EgressPolicy) -> Self {
        policy.to_wire()
    }
}

impl From<&Rule> for NetworkRule {
    fn from(rule: &Rule) -> Self {
        NetworkRule {
            action: rule.action.as_str().to_owned(),
            target: rule.target.to_string(),
        }
    }
}

/// Wire rules (a create request's `egress`, or a PATCH body), validated in order.
pub fn rules_from_wire(rules: &[NetworkRule]) -> Result<Vec<Rule>, PolicyError> {
    if rules.len() > super::MAX_RULES {
        return Err(PolicyError::TooManyRules {
            count: rules.len(),
            max: super::MAX_RULES,
        });
    }
    rules
        .iter()
        .enumerate()
        .map(|(index, r)| Rule::parse(index, &r.action, &r.target))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::Mode;
    use super::*;

    fn wire(json: &str) -> NetworkPolicy {
        serde_json::from_str(json).unwrap()
    }

    fn parse(json: &str) -> Result<EgressPolicy, PolicyError> {
        EgressPolicy::try_from(&wire(json))
    }

    #[test]
    fn empty_and_missing_policies_allow_all() {
        assert_eq!(
            EgressPolicy::from_wire(None).unwrap(),
            EgressPolicy::allow_all()
        );
        assert_eq!(parse("{}").unwrap().mode(), Mode::AllowAll);
        assert_eq!(parse(r#"{"egress":[]}"#).unwrap().mode(), Mode::AllowAll);
        assert_eq!(
            parse(r#"{"defaultAction":"allow"}"#).unwrap().mode(),
            Mode::AllowAll
        );
    }

    #[test]
    fn deny_without_rules_denies_all_and_rules_without_a_default_deny_the_rest() {
        assert_eq!(
            parse(r#"{"defaultAction":"deny"}"#).unwrap().mode(),
            Mode::DenyAll
        );
        let p = parse(r#"{"egress":[{"action":"allow","target":"example.org"}]}"#).unwrap();
        assert_eq!(p.default_action(), Action::Deny);
        assert_eq!(p.mode(), Mode::Enforcing);
    }

    #[test]
    fn errors_name_what_is_wrong() {
        assert_eq!(
            parse(r#"{"defaultAction":"block"}"#).unwrap_err(),
            PolicyError::BadDefaultAction("block".into())
        );
        let err = parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"a.com"},{"action":"allow","target":"2001:db8::1"}]}"#,
        )
        .unwrap_err();
        assert!(
            matches!(err, PolicyError::Ipv6Target { index: 1, .. }),
            "{err}"
        );
        let many: Vec<NetworkRule> = (0..=super::super::MAX_RULES)
            .map(|i| NetworkRule {
                action: "allow".into(),
                target: format!("h{i}.example.com"),
            })
            .collect();
        assert!(matches!(
            rules_from_wire(&many),
            Err(PolicyError::TooManyRules { count: 257, .. })
        ));
    }

    #[test]
    fn the_wire_form_is_canonical_and_round_trips() {
        let p = parse(
            r#"{"defaultAction":"DENY","egress":[{"action":"Allow","target":"API.Example.com."},{"action":"deny","target":"10.0.0.0/8"},{"action":"allow","target":"*.Example.org"}]}"#,
        )
        .unwrap();
        let out = serde_json::to_string(&p.to_wire()).unwrap();
        assert_eq!(
            out,
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"api.example.com"},{"action":"deny","target":"10.0.0.0/8"},{"action":"allow","target":"*.example.org"}]}"#
        );
        assert_eq!(EgressPolicy::try_from(p.to_wire()).unwrap(), p);
        for policy in [EgressPolicy::allow_all(), EgressPolicy::deny_all()] {
            assert_eq!(
                EgressPolicy::try_from(NetworkPolicy::from(&policy)).unwrap(),
                policy
            );
        }
        assert_eq!(
            serde_json::to_string(&EgressPolicy::allow_all().to_wire()).unwrap(),
            r#"{"defaultAction":"allow"}"#
        );
    }
}

/// A policy travels (to a node, in a record) in its canonical wire form, and is validated
/// again on the way in: an invalid one never deserializes.
impl serde::Serialize for EgressPolicy {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_wire().serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for EgressPolicy {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = NetworkPolicy::deserialize(deserializer)?;
        Self::from_wire(Some(&wire)).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod serde_tests {
    use super::*;

    #[test]
    fn a_policy_travels_as_its_wire_form_and_is_checked_on_the_way_in() {
        let wire: NetworkPolicy = serde_json::from_str(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"*.example.com"}]}"#,
        )
        .unwrap();
        let policy = EgressPolicy::from_wire(Some(&wire)).unwrap();
        let json = serde_json::to_string(&policy).unwrap();
        assert_eq!(serde_json::from_str::<EgressPolicy>(&json).unwrap(), policy);
        let bad = json.replace("*.example.com", "exa mple..com");
        assert!(serde_json::from_str::<EgressPolicy>(&bad).is_err(), "{bad}");
    }
}
