//! The instance's nftables table, as `nft -f` text.
//!
//! One `table inet {prefix}` holds every rule of the instance. Rules match slot traffic by
//! the interface wildcard `"{prefix}-*"`, so creating a slot adds no rule: the fixed denies
//! cover it the moment its veth exists. The per-slot extension point is the verdict map
//! `slot_egress` (interface name -> `jump <chain>`), consulted after the fixed denies; the
//! egress layer adds one chain and one map element per slot.
//!
//! Installing replaces the whole table in one transaction (`add table; delete table;
//! table { .. }` in a single `nft -f`), so a re-install never opens a window without rules.

use std::fmt::Write as _;

use super::NetConfig;
use super::names::slot_ifname_glob;

/// Name of the verdict map keyed by slot interface name (the per-slot egress hook).
pub const SLOT_EGRESS_MAP: &str = "slot_egress";

/// Link-local addresses (cloud metadata services live at 169.254.169.254).
pub const LINK_LOCAL: &str = "169.254.0.0/16";

/// `nft -f` input that atomically (re)creates the instance table.
pub fn install_script(cfg: &NetConfig) -> String {
    let mut s = String::new();
    let table = &cfg.prefix;
    // `add` makes the `delete` succeed when the table is new; all three lines are one
    // transaction.
    writeln!(s, "add table inet {table}").unwrap();
    writeln!(s, "delete table inet {table}").unwrap();
    s.push_str(&table_text(cfg));
    s
}

/// `nft -f` input that removes the instance table (fails if it does not exist).
pub fn delete_script(prefix: &str) -> String {
    format!("delete table inet {prefix}\n")
}

/// The table definition.
pub fn table_text(cfg: &NetConfig) -> String {
    let table = &cfg.prefix;
    let slots = slot_ifname_glob(&cfg.prefix);
    let pool = cfg.pool;
    let dns = cfg.dns_port;
    format!(
        r#"table inet {table} {{
	# Per-slot egress policy: slot interface -> jump to that slot's chain.
	# Filled by the egress layer; consulted after the fixed denies.
	map {SLOT_EGRESS_MAP} {{
		type ifname : verdict
	}}

	# Before anything else: slots speak IPv4 only, and only from their own address
	# (strict reverse-path check: the source must route back out of the same veth).
	chain antispoof {{
		type filter hook prerouting priority raw; policy accept;
		iifname "{slots}" meta nfproto ipv6 drop
		iifname "{slots}" fib saddr . iif oif missing drop
	}}

	# All DNS from a sandbox, whatever address it names, goes to the instance's forwarder.
	chain prerouting {{
		type nat hook prerouting priority dstnat; policy accept;
		iifname "{slots}" meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}
	}}

	# Traffic for the host itself.
	chain input {{
		type filter hook input priority filter; policy accept;
		iifname "{slots}" jump slot_input
		# The forwarder listens on 0.0.0.0: serve only slots and the host itself.
		meta l4proto {{ tcp, udp }} th dport {dns} iifname != "lo" drop
	}}

	# A sandbox reaches no host address, except the DNS forwarder through the redirect.
	chain slot_input {{
		ct state established,related accept
		meta l4proto {{ tcp, udp }} th dport {dns} ct status dnat accept
		drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifname "{slots}" jump slot_forward
		# Into a slot only replies are forwarded; the host reaches sandboxes directly.
		oifname "{slots}" ct state established,related accept
		oifname "{slots}" drop
	}}

	# Sandbox -> elsewhere: established first, fixed denies that no policy overrides,
	# then the slot's egress policy, then accept (NAT below).
	chain slot_forward {{
		ct state established,related accept
		oifname "{slots}" drop
		ip daddr {LINK_LOCAL} drop
		fib daddr type {{ local, broadcast, multicast }} drop
		meta nfproto ipv6 drop
		# DNS over TLS: names are resolved through the forwarder, whatever the policy.
		meta l4proto {{ tcp, udp }} th dport 853 drop
		iifname vmap @{SLOT_EGRESS_MAP}
		accept
	}}

	chain postrouting {{
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr {pool} oifname != "{slots}" masquerade
	}}
}}
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> NetConfig {
        NetConfig {
            prefix: "fbx1".into(),
            pool: "10.77.0.0/24".parse().unwrap(),
            dns_port: 40053,
        }
    }

    #[test]
    fn install_replaces_the_table_in_one_script() {
        let s = install_script(&cfg());
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "add table inet fbx1");
        assert_eq!(lines[1], "delete table inet fbx1");
        assert_eq!(lines[2], "table inet fbx1 {");
    }

    #[test]
    fn rules_match_slots_by_wildcard_and_name_the_pool_and_dns_port() {
        let t = table_text(&cfg());
        assert!(t.contains(
            r#"iifname "fbx1-*" meta l4proto { tcp, udp } th dport 53 redirect to :40053"#
        ));
        assert!(t.contains("ip saddr 10.77.0.0/24 oifname != \"fbx1-*\" masquerade"));
        assert!(t.contains("th dport 40053 ct status dnat accept"));
        assert!(t.contains("ip daddr 169.254.0.0/16 drop"));
        assert!(t.contains("iifname vmap @slot_egress"));
        assert!(!t.contains("fbx1_"), "non-slot names must not be matched");
    }

    #[test]
    fn fixed_denies_precede_the_egress_hook_and_the_accept() {
        let t = table_text(&cfg());
        let chain = &t[t.find("chain slot_forward").unwrap()..];
        let pos = |needle: &str| {
            chain
                .find(needle)
                .unwrap_or_else(|| panic!("{needle} missing"))
        };
        assert!(pos("ct state established,related accept") < pos("oifname \"fbx1-*\" drop"));
        assert!(pos("oifname \"fbx1-*\" drop") < pos("vmap @slot_egress"));
        assert!(pos("169.254.0.0/16 drop") < pos("vmap @slot_egress"));
        assert!(pos("fib daddr type") < pos("vmap @slot_egress"));
        assert!(pos("th dport 853 drop") < pos("vmap @slot_egress"));
        assert!(pos("vmap @slot_egress") < pos("\t\taccept\n"));
    }

    #[test]
    fn slot_input_ends_in_drop() {
        let t = table_text(&cfg());
        let chain = &t[t.find("chain slot_input").unwrap()..];
        let body = &chain[..chain.find("\n\t}").unwrap()];
        assert_eq!(body.trim_end().lines().last().unwrap().trim(), "drop");
    }
}
