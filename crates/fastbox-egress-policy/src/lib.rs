//! The egress policy of one sandbox: a default action and ordered rules.
//!
//! This crate is the policy model only (pure: no I/O, no runtime), so the lifecycle server
//! can validate and store policies without reaching the node's runtime. Enforcing a policy
//! (per-slot nft chains, the DNS forwarder's hook) is `fastbox-egress`, which re-exports this
//! crate as `fastbox_egress::policy`.
//!
//! A policy is validated once, when it is built ([`EgressPolicy::try_new`] or from the wire
//! type, see [`wire`]); afterwards it is only read. Decisions:
//! - **names** (what the DNS forwarder may resolve): the first rule whose name or wildcard
//!   target matches decides; no match means the default ([`EgressPolicy::decide_name`]);
//! - **addresses** (per packet): the first address or network rule that contains the
//!   destination decides ([`EgressPolicy::decide_address`]); otherwise, under a deny default,
//!   only addresses the forwarder learned from allowed names pass; under an allow default,
//!   everything passes.
//!
//! So address rules are evaluated before what DNS learned: `deny 203.0.113.0/24` blocks
//! that network even when an allowed name resolves into it. See `docs/egress.md`.

mod target;
pub mod wire;

use std::fmt;
use std::net::Ipv4Addr;

use serde::Serialize;

pub use target::{Ipv4Net, MAX_LABEL_LEN, MAX_NAME_LEN, Target};
pub use wire::rules_from_wire;

/// Most rules a policy may hold. Address rules are one nft rule each, evaluated in order
/// for every new connection, so the list stays short; OpenSandbox's sidecar allows 4096.
pub const MAX_RULES: usize = 256;

/// What a rule (or the default) does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Let it through.
    Allow,
    /// Refuse the name (NXDOMAIN) or drop the packet.
    Deny,
}

impl Action {
    /// Parses `allow` or `deny` (any case, surrounding blanks ignored).
    pub fn parse(raw: &str) -> Option<Self> {
        match raw.trim().to_ascii_lowercase().as_str() {
            "allow" => Some(Action::Allow),
            "deny" => Some(Action::Deny),
            _ => None,
        }
    }

    /// `allow` or `deny`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allow => "allow",
            Action::Deny => "deny",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One rule: an action on a target.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    /// What a match does.
    pub action: Action,
    /// What it matches.
    pub target: Target,
}

impl Rule {
    /// Parses a rule from its wire strings; `index` is its position, for errors.
    pub fn parse(index: usize, action: &str, target: &str) -> Result<Self, PolicyError> {
        let action = Action::parse(action).ok_or_else(|| PolicyError::BadAction {
            index,
            action: action.to_owned(),
        })?;
        Ok(Self {
            action,
            target: Target::parse(index, target)?,
        })
    }
}

/// The policy's shape, as the egress API's `PolicyStatusResponse.mode` reports it (the
/// same derivation as OpenSandbox's egress sidecar).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Default allow, no rules.
    AllowAll,
    /// Default deny, no rules.
    DenyAll,
    /// Anything with rules.
    Enforcing,
}

impl Mode {
    /// `allow_all`, `deny_all` or `enforcing`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::AllowAll => "allow_all",
            Mode::DenyAll => "deny_all",
            Mode::Enforcing => "enforcing",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A validated egress policy. Build it with [`EgressPolicy::try_new`], the constructors,
/// or from the wire type ([`wire`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EgressPolicy {
    default: Action,
    rules: Vec<Rule>,
}

impl Default for EgressPolicy {
    /// Allow everything: the policy of a sandbox created without one.
    fn default() -> Self {
        Self::allow_all()
    }
}

impl EgressPolicy {
    /// Allow everything (except what the instance table always denies).
    pub fn allow_all() -> Self {
        Self {
            default: Action::Allow,
            rules: Vec::new(),
        }
    }

    /// Deny everything: no name resolves, no connection leaves.
    pub fn deny_all() -> Self {
        Self {
            default: Action::Deny,
            rules: Vec::new(),
        }
    }

    /// A policy of `default` and `rules` (in order); at most [`MAX_RULES`] rules.
    pub fn try_new(default: Action, rules: Vec<Rule>) -> Result<Self, PolicyError> {
        if rules.len() > MAX_RULES {
            return Err(PolicyError::TooManyRules {
                count: rules.len(),
                max: MAX_RULES,
            });
        }
        Ok(Self { default, rules })
    }

    /// A policy from `(action, target)` pairs in order, as a create request would give them.
    pub fn from_pairs(default: Action, rules: &[(&str, &str)]) -> Result<Self, PolicyError> {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, (action, target))| Rule::parse(i, action, target))
            .collect::<Result<Vec<_>, _>>()?;
        Self::try_new(default, rules)
    }

    /// The default action.
    pub fn default_action(&self) -> Action {
        self.default
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// `allow_all`, `deny_all` or `enforcing`.
    pub fn mode(&self) -> Mode {
        match (self.default, self.rules.is_empty()) {
            (Action::Allow, true) => Mode::AllowAll,
            (Action::Deny, true) => Mode::DenyAll,
            (_, false) => Mode::Enforcing,
        }
    }

    /// Whether the forwarder may resolve `name` (any case, trailing dot ignored): the first
    /// matching name or wildcard rule, else the default.
    pub fn decide_name(&self, name: &str) -> Action {
        let lower = name.to_ascii_lowercase();
        let name = lower.strip_suffix('.').unwrap_or(&lower);
        self.rules
            .iter()
            .find(|rule| rule.target.matches_name(name))
            .map_or(self.default, |rule| rule.action)
    }

    /// The first address or network rule containing `addr`, if any.
    pub fn decide_address(&self, addr: Ipv4Addr) -> Option<Action> {
        self.rules
            .iter()
            .find(|rule| rule.target.matches_address(addr))
            .map(|rule| rule.action)
    }

    /// Whether a new connection to `addr` passes, given whether the forwarder learned
    /// `addr` from an allowed name: the packet-level decision the nft chain implements.
    pub fn allows_connection(&self, addr: Ipv4Addr, learned: bool) -> bool {
        match self.decide_address(addr) {
            Some(action) => action == Action::Allow,
            None => self.default == Action::Allow || learned,
        }
    }

    /// The egress API's PATCH: `incoming` rules go first, in their order (the first rule of
    /// a target wins within them), followed by the existing rules whose target they do not
    /// name; the default action stays.
    pub fn patched(&self, incoming: Vec<Rule>) -> Result<Self, PolicyError> {
        let mut rules: Vec<Rule> = Vec::with_capacity(incoming.len() + self.rules.len());
        for rule in incoming.into_iter().chain(self.rules.iter().cloned()) {
            if !rules.iter().any(|r| r.target == rule.target) {
                rules.push(rule);
            }
        }
        Self::try_new(self.default, rules)
    }

    /// The egress API's DELETE: the rules whose target is one of `targets` (compared in
    /// canonical form: any case, trailing dot ignored) go; unknown targets are ignored, the
    /// default action stays.
    pub fn without_targets<S: AsRef<str>>(&self, targets: &[S]) -> Self {
        let gone: Vec<String> = targets
            .iter()
            .map(|t| {
                let lower = t.as_ref().trim().to_ascii_lowercase();
                lower.strip_suffix('.').unwrap_or(&lower).to_owned()
            })
            .collect();
        Self {
            default: self.default,
            rules: self
                .rules
                .iter()
                .filter(|r| !gone.contains(&r.target.to_string()))
                .cloned()
                .collect(),
        }
    }
}

/// Why a policy is not acceptable. Every message names the rule (by position) and says what
/// is wrong, so it can go back to the client as a 400.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// The default action is neither `allow` nor `deny`.
    #[error("defaultAction {0:?} must be \"allow\" or \"deny\"")]
    BadDefaultAction(String),
    /// A rule's action is neither `allow` nor `deny`.
    #[error("egress[{index}]: action {action:?} must be \"allow\" or \"deny\"")]
    BadAction {
        /// Position of the rule.
        index: usize,
        /// What was given.
        action: String,
    },
    /// A rule's target is not a name, wildcard, IPv4 address or IPv4 network.
    #[error("egress[{index}]: target {target:?} is invalid: {reason}")]
    BadTarget {
        /// Position of the rule.
        index: usize,
        /// What was given.
        target: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rule names an IPv6 address or network.
    #[error(
        "egress[{index}]: target {target:?} is IPv6; sandboxes have no IPv6, so only IPv4 targets are accepted"
    )]
    Ipv6Target {
        /// Position of the rule.
        index: usize,
        /// What was given.
        target: String,
    },
    /// A host name is longer than DNS allows.
    #[error("egress[{index}]: the host name is {len} bytes long; at most {max} are allowed")]
    NameTooLong {
        /// Position of the rule.
        index: usize,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// More rules than [`MAX_RULES`].
    #[error("{count} egress rules given; at most {max} are allowed")]
    TooManyRules {
        /// How many were given.
        count: usize,
        /// The limit.
        max: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(action: &str, target: &str) -> Rule {
        Rule::parse(0, action, target).unwrap()
    }

    fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
        EgressPolicy::from_pairs(default, rules).unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn the_first_matching_name_rule_wins_else_the_default() {
        let p = policy(
            Action::Deny,
            &[
                ("deny", "bad.example.com"),
                ("allow", "*.example.com"),
                ("allow", "example.org"),
                ("deny", "*.example.org"),
            ],
        );
        assert_eq!(p.decide_name("bad.example.com"), Action::Deny);
        assert_eq!(p.decide_name("good.example.com"), Action::Allow);
        assert_eq!(p.decide_name("Deep.Good.Example.COM."), Action::Allow);
        assert_eq!(
            p.decide_name("example.com"),
            Action::Deny,
            "apex is not matched"
        );
        assert_eq!(p.decide_name("example.org"), Action::Allow);
        assert_eq!(p.decide_name("www.example.org"), Action::Deny);
        assert_eq!(p.decide_name("other.net"), Action::Deny);
        let open = policy(Action::Allow, &[("deny", "*.example.com")]);
        assert_eq!(open.decide_name("a.example.com"), Action::Deny);
        assert_eq!(open.decide_name("example.com"), Action::Allow);
    }

    #[test]
    fn address_rules_decide_in_order_and_names_never_match_addresses() {
        let p = policy(
            Action::Deny,
            &[
                ("deny", "10.0.0.5"),
                ("allow", "10.0.0.0/24"),
                ("allow", "example.com"),
            ],
        );
        assert_eq!(p.decide_address(ip("10.0.0.5")), Some(Action::Deny));
        assert_eq!(p.decide_address(ip("10.0.0.6")), Some(Action::Allow));
        assert_eq!(p.decide_address(ip("10.0.1.1")), None);
        assert_eq!(
            p.decide_name("10.0.0.6"),
            Action::Deny,
            "addresses are not names"
        );
    }

    #[test]
    fn connections_pass_by_address_rule_then_learned_then_default() {
        let deny = policy(
            Action::Deny,
            &[("deny", "10.0.0.5"), ("allow", "10.0.1.0/24")],
        );
        assert!(
            !deny.allows_connection(ip("10.0.0.5"), true),
            "rule beats learned"
        );
        assert!(deny.allows_connection(ip("10.0.1.9"), false));
        assert!(deny.allows_connection(ip("10.0.2.1"), true));
        assert!(!deny.allows_connection(ip("10.0.2.1"), false));
        let allow = policy(Action::Allow, &[("deny", "10.0.0.0/8")]);
        assert!(!allow.allows_connection(ip("10.1.1.1"), true));
        assert!(allow.allows_connection(ip("192.0.2.1"), false));
    }

    #[test]
    fn mode_follows_the_default_and_whether_there_are_rules() {
        assert_eq!(EgressPolicy::allow_all().mode(), Mode::AllowAll);
        assert_eq!(EgressPolicy::deny_all().mode(), Mode::DenyAll);
        assert_eq!(
            policy(Action::Deny, &[("allow", "a.com")]).mode(),
            Mode::Enforcing
        );
        assert_eq!(
            policy(Action::Allow, &[("deny", "a.com")]).mode(),
            Mode::Enforcing
        );
        assert_eq!(EgressPolicy::default(), EgressPolicy::allow_all());
        assert_eq!(Mode::DenyAll.to_string(), "deny_all");
        assert_eq!(
            serde_json_string(&Mode::AllowAll),
            "\"allow_all\"".to_owned()
        );
    }

    fn serde_json_string<T: Serialize>(v: &T) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn more_than_the_limit_of_rules_is_an_error() {
        let rules = vec![rule("allow", "a.com"); MAX_RULES];
        assert!(EgressPolicy::try_new(Action::Deny, rules.clone()).is_ok());
        let mut over = rules;
        over.push(rule("allow", "b.com"));
        let err = EgressPolicy::try_new(Action::Deny, over).unwrap_err();
        assert_eq!(
            err,
            PolicyError::TooManyRules {
                count: MAX_RULES + 1,
                max: MAX_RULES
            }
        );
        assert_eq!(
            err.to_string(),
            "257 egress rules given; at most 256 are allowed"
        );
    }

    #[test]
    fn rules_with_bad_actions_name_their_position() {
        let err = Rule::parse(3, "block", "a.com").unwrap_err();
        assert_eq!(
            err.to_string(),
            "egress[3]: action \"block\" must be \"allow\" or \"deny\""
        );
        assert_eq!(
            Rule::parse(0, " ALLOW ", "a.com").unwrap().action,
            Action::Allow
        );
        assert!(Rule::parse(0, "", "a.com").is_err());
    }

    #[test]
    fn patch_puts_incoming_rules_first_and_replaces_same_targets() {
        let p = policy(
            Action::Deny,
            &[
                ("allow", "a.com"),
                ("allow", "b.com"),
                ("deny", "10.0.0.0/8"),
            ],
        );
        let patched = p
            .patched(vec![
                rule("deny", "B.com."),
                rule("allow", "c.com"),
                rule("allow", "b.com"), // a later duplicate within the patch loses
            ])
            .unwrap();
        let got: Vec<String> = patched
            .rules()
            .iter()
            .map(|r| format!("{} {}", r.action, r.target))
            .collect();
        assert_eq!(
            got,
            [
                "deny b.com",
                "allow c.com",
                "allow a.com",
                "deny 10.0.0.0/8"
            ]
        );
        assert_eq!(patched.default_action(), Action::Deny);
        let distinct = (0..MAX_RULES).map(|i| rule("allow", &format!("h{i}.com")));
        let full = EgressPolicy::try_new(Action::Deny, distinct.collect()).unwrap();
        assert!(matches!(
            full.patched(vec![rule("allow", "y.com")]),
            Err(PolicyError::TooManyRules { .. })
        ));
    }

    #[test]
    fn delete_removes_rules_by_canonical_target_and_ignores_unknown_ones() {
        let p = policy(
            Action::Allow,
            &[
                ("deny", "a.com"),
                ("deny", "*.b.com"),
                ("deny", "10.0.0.0/8"),
            ],
        );
        let left = p.without_targets(&["A.COM.", "*.b.com", "nothing.example", "10.0.0.0/8"]);
        assert!(left.rules().is_empty());
        assert_eq!(left.default_action(), Action::Allow);
        assert_eq!(left.mode(), Mode::AllowAll);
        assert_eq!(p.without_targets::<&str>(&[]), p);
    }
}
