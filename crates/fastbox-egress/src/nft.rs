//! A slot's egress enforcement as `nft -f` text, in the instance table.
//!
//! The instance table (`fastbox_runtime::net::nft`) already accepts established and related
//! traffic, drops what no policy may allow (other slots, host addresses, link-local, IPv6),
//! and then looks the slot's interface up in the verdict map `slot_egress`. Per slot this
//! module adds:
//!
//! ```text
//! set learned_{ifname} { type ipv4_addr; flags timeout; size 16384; }   # from DNS answers
//! chain egress_{ifname} {
//!     meta l4proto { tcp, udp } th dport 853 drop                      # DNS over TLS
//!     ip daddr 203.0.113.7 accept                                      # address rules,
//!     ip daddr 198.51.100.0/24 drop                                    #   in policy order
//!     ip daddr @learned_{ifname} accept                                # deny default only
//!     drop                                                             # the default
//! }
//! slot_egress: "{ifname}" : jump egress_{ifname}
//! ```
//!
//! Only new connections reach the chain (the table accepted established ones before), so
//! the chain decides per connection. Every script is one `nft -f` transaction: a replace
//! flushes and refills the chain and the set in the same transaction, so there is no moment
//! without rules; a removal first adds what it deletes, so it succeeds whether or not the
//! slot had a policy.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Duration;

use fastbox_runtime::net::nft::{CREDENTIAL_PROXY_SLOTS, SLOT_EGRESS_MAP};

use crate::policy::{Action, EgressPolicy};

/// Most addresses a slot's learned set holds (the set's `size`; a full set makes the DNS
/// answer that would overflow it fail with SERVFAIL).
pub const MAX_LEARNED: usize = 16384;

/// The DNS-over-TLS port, always dropped.
pub const DOT_PORT: u16 = 853;

/// Name of the slot's chain.
pub fn chain_name(ifname: &str) -> String {
    format!("egress_{ifname}")
}

/// Name of the slot's set of addresses learned from DNS answers.
pub fn learned_set_name(ifname: &str) -> String {
    format!("learned_{ifname}")
}

/// Installs or replaces the slot's policy: chain, set (holding `learned`, each with its
/// remaining time) and map element, in one transaction.
pub fn apply_script(
    table: &str,
    ifname: &str,
    policy: &EgressPolicy,
    learned: &[(Ipv4Addr, Duration)],
) -> String {
    let chain = chain_name(ifname);
    let set = learned_set_name(ifname);
    let mut s = declare(table, ifname);
    writeln!(s, "flush chain inet {table} {chain}").unwrap();
    writeln!(s, "flush set inet {table} {set}").unwrap();
    s.push_str(&learn_script(table, ifname, learned));
    let rule = |s: &mut String, body: &str| {
        writeln!(s, "add rule inet {table} {chain} {body}").unwrap();
    };
    rule(
        &mut s,
        &format!("meta l4proto {{ tcp, udp }} th dport {DOT_PORT} drop"),
    );
    for r in policy.rules().iter().filter(|r| r.target.is_address()) {
        rule(
            &mut s,
            &format!("ip daddr {} {}", r.target, verdict(r.action)),
        );
    }
    if policy.default_action() == Action::Deny {
        rule(&mut s, &format!("ip daddr @{set} accept"));
    }
    rule(&mut s, verdict(policy.default_action()));
    writeln!(
        s,
        "add element inet {table} {SLOT_EGRESS_MAP} {{ \"{ifname}\" : jump {chain} }}"
    )
    .unwrap();
    s
}

/// Adds (or extends) learned addresses; empty when there is nothing to add.
pub fn learn_script(table: &str, ifname: &str, learned: &[(Ipv4Addr, Duration)]) -> String {
    if learned.is_empty() {
        return String::new();
    }
    let elements: Vec<String> = learned
        .iter()
        .map(|(addr, timeout)| format!("{addr} timeout {}s", whole_seconds(*timeout)))
        .collect();
    format!(
        "add element inet {table} {} {{ {} }}\n",
        learned_set_name(ifname),
        elements.join(", ")
    )
}

/// Puts the slot in the instance's set of slots whose HTTPS goes to the credential proxy
/// (`on`), or takes it out; succeeds whether or not it was there (a removal adds first).
pub fn credential_proxy_script(table: &str, ifname: &str, on: bool) -> String {
    let element = format!("inet {table} {CREDENTIAL_PROXY_SLOTS} {{ \"{ifname}\" }}");
    match on {
        true => format!("add element {element}\n"),
        false => format!("add element {element}\ndelete element {element}\n"),
    }
}

/// Removes the slot's map element, chain and set; succeeds also when they do not exist.
pub fn remove_script(table: &str, ifname: &str) -> String {
    let mut s = declare(table, ifname);
    writeln!(
        s,
        "add element inet {table} {SLOT_EGRESS_MAP} {{ \"{ifname}\" : jump {} }}",
        chain_name(ifname)
    )
    .unwrap();
    writeln!(
        s,
        "delete element inet {table} {SLOT_EGRESS_MAP} {{ \"{ifname}\" }}"
    )
    .unwrap();
    writeln!(s, "delete chain inet {table} {}", chain_name(ifname)).unwrap();
    writeln!(s, "delete set inet {table} {}", learned_set_name(ifname)).unwrap();
    s
}

/// `add` of the chain and the set: creates them, or does nothing if they exist.
fn declare(table: &str, ifname: &str) -> String {
    format!(
        "add chain inet {table} {}\n\
         add set inet {table} {} {{ type ipv4_addr; flags timeout; size {MAX_LEARNED}; }}\n",
        chain_name(ifname),
        learned_set_name(ifname),
    )
}

fn verdict(action: Action) -> &'static str {
    match action {
        Action::Allow => "accept",
        Action::Deny => "drop",
    }
}

/// nft timeouts in whole seconds, at least one (rounded up: never shorter than asked).
fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
        EgressPolicy::from_pairs(default, rules).unwrap()
    }

    fn rules_of(script: &str) -> Vec<&str> {
        script
            .lines()
            .filter_map(|l| l.strip_prefix("add rule inet fb1 egress_fb1-3 "))
            .collect()
    }

    #[test]
    fn a_deny_default_chain_drops_dot_then_follows_address_rules_then_learned_then_drops() {
        let p = policy(
            Action::Deny,
            &[
                ("allow", "api.example.com"),
                ("deny", "203.0.113.7"),
                ("allow", "203.0.113.0/24"),
                ("allow", "*.example.org"),
            ],
        );
        let s = apply_script("fb1", "fb1-3", &p, &[]);
        assert_eq!(
            rules_of(&s),
            [
                "meta l4proto { tcp, udp } th dport 853 drop",
                "ip daddr 203.0.113.7 drop",
                "ip daddr 203.0.113.0/24 accept",
                "ip daddr @learned_fb1-3 accept",
                "drop",
            ]
        );
    }

    #[test]
    fn an_allow_default_chain_ignores_learned_addresses_and_accepts() {
        let p = policy(
            Action::Allow,
            &[("deny", "10.9.0.0/16"), ("deny", "bad.example")],
        );
        let s = apply_script("fb1", "fb1-3", &p, &[]);
        assert_eq!(
            rules_of(&s),
            [
                "meta l4proto { tcp, udp } th dport 853 drop",
                "ip daddr 10.9.0.0/16 drop",
                "accept",
            ]
        );
    }

    #[test]
    fn a_replace_refills_chain_and_set_before_pointing_the_map_at_the_chain() {
        let learned = [
            (Ipv4Addr::new(192, 0, 2, 1), Duration::from_millis(59_001)),
            (Ipv4Addr::new(192, 0, 2, 2), Duration::from_secs(300)),
        ];
        let s = apply_script("fb1", "fb1-3", &EgressPolicy::deny_all(), &learned);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            &lines[..5],
            [
                "add chain inet fb1 egress_fb1-3",
                "add set inet fb1 learned_fb1-3 { type ipv4_addr; flags timeout; size 16384; }",
                "flush chain inet fb1 egress_fb1-3",
                "flush set inet fb1 learned_fb1-3",
                "add element inet fb1 learned_fb1-3 { 192.0.2.1 timeout 60s, 192.0.2.2 timeout 300s }",
            ]
        );
        assert_eq!(
            lines.last().unwrap(),
            &"add element inet fb1 slot_egress { \"fb1-3\" : jump egress_fb1-3 }"
        );
    }

    #[test]
    fn the_credential_proxy_set_is_joined_and_left_idempotently() {
        assert_eq!(
            credential_proxy_script("fb1", "fb1-3", true),
            "add element inet fb1 credential_proxy_slots { \"fb1-3\" }\n"
        );
        assert_eq!(
            credential_proxy_script("fb1", "fb1-3", false),
            "add element inet fb1 credential_proxy_slots { \"fb1-3\" }\n\
             delete element inet fb1 credential_proxy_slots { \"fb1-3\" }\n"
        );
    }

    #[test]
    fn learning_nothing_writes_nothing() {
        assert_eq!(learn_script("fb1", "fb1-3", &[]), "");
    }

    #[test]
    fn removal_declares_what_it_deletes_so_it_is_idempotent() {
        let s = remove_script("fb1", "fb1-3");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(
            lines,
            [
                "add chain inet fb1 egress_fb1-3",
                "add set inet fb1 learned_fb1-3 { type ipv4_addr; flags timeout; size 16384; }",
                "add element inet fb1 slot_egress { \"fb1-3\" : jump egress_fb1-3 }",
                "delete element inet fb1 slot_egress { \"fb1-3\" }",
                "delete chain inet fb1 egress_fb1-3",
                "delete set inet fb1 learned_fb1-3",
            ]
        );
    }
}
