//! The instance's nftables table, as `nft -f` text.
//!
//! One `table inet {prefix}` holds every rule of the instance. Rules match slot traffic by
//! the interface wildcard `"{prefix}-*"`, so creating a slot adds no rule: the fixed denies
//! cover it the moment its veth exists. The per-slot extension point is the verdict map
//! `slot_egress` (interface name -> `jump <chain>`), consulted after the fixed denies; the
//! egress layer adds one chain and one map element per slot.
//!
//! The first rule a slot's forwarded packet meets drops it when its destination is in the
//! interval set `private_ranges` ([`super::ranges::PRIVATE_RANGES`]) and not in the set
//! `sandbox_reach` (the operator's exceptions): on every packet, not only a connection's
//! first, so no tracked flow and no policy rule ever reaches those ranges.
//!
//! A slot's new connections also meet its limits ([`super::SlotLimits`]), keyed by its source
//! address in dynamic sets: at most `max_connections` forwarded connections tracked at once
//! (`ct count over N`, set `slot_conns`) and, unless turned off, `new_connections_per_second`
//! (with a burst) new connections, forwarded or DNS flows to the forwarder alike (`limit rate
//! over`, set `slot_rate`); a connection over either is dropped. DNS flows are not counted
//! against `max_connections` (a busy resolver keeps hundreds of short UDP entries; the
//! forwarder caps each client itself), only rate-limited, which also bounds the conntrack
//! entries they make. The limits come after the fixed denies, so only connections that could
//! pass count, and after `ct state established,related accept`, so open connections are never
//! cut.
//!
//! Installing replaces the whole table in one transaction (`add table; delete table;
//! table { .. }` in a single `nft -f`), so a re-install never opens a window without rules.

use std::fmt::Write as _;

use super::NetConfig;
use super::names::slot_ifname_glob;
use super::ranges::{Ipv4Net, PRIVATE_RANGES};

/// Name of the verdict map keyed by slot interface name (the per-slot egress hook).
pub const SLOT_EGRESS_MAP: &str = "slot_egress";

/// Name of the interval set of [`PRIVATE_RANGES`].
pub const PRIVATE_SET: &str = "private_ranges";

/// Name of the interval set of the operator's exceptions ([`NetConfig::sandbox_reach`]).
pub const REACH_SET: &str = "sandbox_reach";

/// Name of the dynamic set counting each slot's tracked connections.
pub const CONNS_SET: &str = "slot_conns";

/// Name of the dynamic set holding each slot's new-connection rate limiter.
pub const RATE_SET: &str = "slot_rate";

/// Name of the set of slot interfaces whose HTTPS goes to the node's credential proxy.
pub const CREDENTIAL_PROXY_SLOTS: &str = "credential_proxy_slots";

/// Source ports the credential proxy's own connections from a slot use: they are not
/// redirected back to it. (A sandbox that picks one only skips the proxy's injection.)
pub const PROXY_SOURCE_PORTS: std::ops::RangeInclusive<u16> = 61000..=61999;

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
    let private = elements(&PRIVATE_RANGES);
    let reach = elements(&cfg.sandbox_reach);
    let limits = slot_limits(cfg);
    let (limit_sets, rate_rule) = (&limits.sets, &limits.rate_rule);
    let forward_limits = format!("{}{}", limits.count_rule, limits.rate_rule);
    let ProxyRules {
        redirect,
        input,
        slot_input,
        quic,
    } = credential_proxy_rules(cfg);
    format!(
        r#"table inet {table} {{
	# Per-slot egress policy: slot interface -> jump to that slot's chain.
	# Filled by the egress layer; consulted after the fixed denies.
	map {SLOT_EGRESS_MAP} {{
		type ifname : verdict
	}}

	# Private, shared (CGNAT), loopback, link-local, multicast and reserved networks: no
	# sandbox reaches them, whatever its policy ...
	set {PRIVATE_SET} {{
		type ipv4_addr
		flags interval
		{private}
	}}

	# ... except those the operator lists (--sandbox-reach), where the policy decides.
	set {REACH_SET} {{
		type ipv4_addr
		flags interval
		auto-merge
		{reach}
	}}
{limit_sets}

	# Slots created with credentialProxy: their HTTPS goes to the node's credential proxy.
	set {CREDENTIAL_PROXY_SLOTS} {{
		type ifname
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
		iifname "{slots}" meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}{redirect}
	}}

	# Traffic for the host itself.
	chain input {{
		type filter hook input priority filter; policy accept;
		iifname "{slots}" jump slot_input
		# The forwarder listens on 0.0.0.0: serve only slots and the host itself.
		meta l4proto {{ tcp, udp }} th dport {dns} iifname != "lo" drop{input}
	}}

	# A sandbox reaches no host address, except the DNS forwarder through the redirect.
	chain slot_input {{
		ct state established,related accept{rate_rule}
		meta l4proto {{ tcp, udp }} th dport {dns} ct status dnat accept{slot_input}
		drop
	}}

	chain forward {{
		type filter hook forward priority filter; policy accept;
		iifname "{slots}" jump slot_forward
		# Into a slot only replies are forwarded; the host reaches sandboxes directly.
		oifname "{slots}" ct state established,related accept
		oifname "{slots}" drop
	}}

	# Sandbox -> elsewhere: the private ranges on every packet, then established, the
	# other fixed denies that no policy overrides, the slot's egress policy, accept (NAT
	# below).
	chain slot_forward {{
		ip daddr @{PRIVATE_SET} ip daddr != @{REACH_SET} drop
		ct state established,related accept
		oifname "{slots}" drop
		fib daddr type {{ local, broadcast, multicast }} drop
		meta nfproto ipv6 drop
		# DNS over TLS: names are resolved through the forwarder, whatever the policy.
		meta l4proto {{ tcp, udp }} th dport 853 drop{quic}{forward_limits}
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

/// The credential proxy's rules, each a line with its leading newline (all empty without a
/// proxy port).
struct ProxyRules {
    /// `prerouting`: the listed slots' HTTPS and plain HTTP, but the proxy's own, to the proxy.
    redirect: String,
    /// `input`: nobody else reaches the proxy's port.
    input: String,
    /// `slot_input`: the redirected connections reach it.
    slot_input: String,
    /// `slot_forward`: no QUIC from the listed slots (clients fall back to TCP, which the
    /// proxy sees).
    quic: String,
}

fn credential_proxy_rules(cfg: &NetConfig) -> ProxyRules {
    let Some(port) = cfg.credential_proxy_port else {
        return ProxyRules {
            redirect: String::new(),
            input: String::new(),
            slot_input: String::new(),
            quic: String::new(),
        };
    };
    let (first, last) = (PROXY_SOURCE_PORTS.start(), PROXY_SOURCE_PORTS.end());
    ProxyRules {
        redirect: format!(
            "\n\t\tiifname @{CREDENTIAL_PROXY_SLOTS} tcp dport {{ 80, 443 }} tcp sport != {first}-{last} redirect to :{port}"
        ),
        input: format!("\n\t\ttcp dport {port} drop"),
        // Counted against the slot's connection cap, as its forwarded connections are.
        slot_input: format!(
            "\n\t\ttcp dport {port} ct status dnat ct state new add @{CONNS_SET} {{ ip saddr ct count over {max} }} drop\n\t\ttcp dport {port} ct status dnat accept",
            max = cfg.slot_limits.max_connections
        ),
        quic: format!("\n\t\tiifname @{CREDENTIAL_PROXY_SLOTS} udp dport 443 drop"),
    }
}

/// The per-slot limits as table text.
struct LimitText {
    /// Set declarations, at table level.
    sets: String,
    /// The connection count rule (`slot_forward`), a line with its leading newline.
    count_rule: String,
    /// The rate rule (`slot_forward` and `slot_input`), a line with its leading newline;
    /// empty when the rate limit is off.
    rate_rule: String,
}

/// The sets and rules of the per-slot limits. The sets hold one element per slot address,
/// so they are sized to the pool; the rate set's elements expire a minute after a slot's
/// last new connection (its bucket is full again by then).
fn slot_limits(cfg: &NetConfig) -> LimitText {
    let limits = &cfg.slot_limits;
    let size = cfg.pool.capacity();
    let max = limits.max_connections;
    let mut sets = format!(
        r#"
	# Per-slot limits, keyed by the slot's address: forwarded connections tracked at once ...
	set {CONNS_SET} {{
		type ipv4_addr
		size {size}
		flags dynamic
	}}
"#
    );
    let count_rule =
        format!("\n\t\tct state new add @{CONNS_SET} {{ ip saddr ct count over {max} }} drop");
    let mut rate_rule = String::new();
    if limits.new_connections_per_second > 0 {
        let (rate, burst) = (
            limits.new_connections_per_second,
            limits.new_connections_burst,
        );
        write!(
            sets,
            r#"
	# ... and new connections per second (forwarded and DNS).
	set {RATE_SET} {{
		type ipv4_addr
		size {size}
		flags dynamic,timeout
		timeout 60s
	}}
"#
        )
        .unwrap();
        rate_rule = format!(
            "\n\t\tct state new update @{RATE_SET} \
             {{ ip saddr limit rate over {rate}/second burst {burst} packets }} drop"
        );
    }
    LimitText {
        sets,
        count_rule,
        rate_rule,
    }
}

/// The `elements = { .. }` line of an interval set; empty for no networks (an empty set).
fn elements(nets: &[Ipv4Net]) -> String {
    if nets.is_empty() {
        return String::new();
    }
    let list: Vec<String> = nets.iter().map(Ipv4Net::to_string).collect();
    format!("elements = {{ {} }}", list.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::SlotLimits;

    fn cfg() -> NetConfig {
        NetConfig {
            prefix: "fbx1".into(),
            pool: "10.77.0.0/24".parse().unwrap(),
            dns_port: 40053,
            sandbox_reach: Vec::new(),
            slot_limits: SlotLimits::default(),
            credential_proxy_port: None,
        }
    }

    /// The body of chain `name` in `t`.
    fn chain<'a>(t: &'a str, name: &str) -> &'a str {
        let from = &t[t.find(&format!("chain {name} ")).unwrap()..];
        &from[..from.find("\n\t}").unwrap()]
    }

    /// The body of set `name` in `t`.
    fn set<'a>(t: &'a str, name: &str) -> &'a str {
        let from = &t[t.find(&format!("set {name} ")).unwrap()..];
        &from[..from.find("\n\t}").unwrap()]
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
        assert!(t.contains("ip daddr @private_ranges ip daddr != @sandbox_reach drop"));
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
        // The private ranges come first of all, before established flows are accepted.
        assert!(
            pos("ip daddr @private_ranges ip daddr != @sandbox_reach drop")
                < pos("ct state established,related accept")
        );
        assert!(pos("ct state established,related accept") < pos("oifname \"fbx1-*\" drop"));
        assert!(pos("oifname \"fbx1-*\" drop") < pos("vmap @slot_egress"));
        assert!(pos("@private_ranges") < pos("vmap @slot_egress"));
        assert!(pos("fib daddr type") < pos("vmap @slot_egress"));
        assert!(pos("th dport 853 drop") < pos("vmap @slot_egress"));
        assert!(pos("vmap @slot_egress") < pos("\t\taccept\n"));
    }

    #[test]
    fn the_private_set_holds_every_fixed_range_whatever_the_reach() {
        for reach in [vec![], vec!["10.200.0.0/24".parse().unwrap()]] {
            let t = table_text(&NetConfig {
                sandbox_reach: reach,
                ..cfg()
            });
            let private = set(&t, "private_ranges");
            assert!(private.contains("flags interval"), "{private}");
            assert!(
                private.contains(
                    "elements = { 0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, \
                     169.254.0.0/16, 172.16.0.0/12, 192.168.0.0/16, 224.0.0.0/4, 240.0.0.0/4 }"
                ),
                "{private}"
            );
        }
    }

    #[test]
    fn the_reach_set_is_empty_by_default_and_lists_the_operators_networks() {
        let t = table_text(&cfg());
        let reach = set(&t, "sandbox_reach");
        assert!(reach.contains("flags interval") && reach.contains("auto-merge"));
        assert!(!reach.contains("elements"), "{reach}");
        let t = table_text(&NetConfig {
            sandbox_reach: vec![
                "10.200.0.0/24".parse().unwrap(),
                "169.254.169.254".parse().unwrap(),
            ],
            ..cfg()
        });
        assert!(
            set(&t, "sandbox_reach").contains("elements = { 10.200.0.0/24, 169.254.169.254/32 }"),
            "{t}"
        );
        // Reach lifts only the private-range rule: it appears nowhere else.
        assert_eq!(t.matches("@sandbox_reach").count(), 1);
        assert!(!chain(&t, "slot_forward").contains("10.200.0.0"));
    }
    #[test]
    fn each_slot_is_limited_in_connections_and_new_connections_per_second() {
        let t = table_text(&cfg());
        let conns = set(&t, "slot_conns");
        assert!(
            conns.contains("type ipv4_addr")
                && conns.contains("size 128")
                && conns.contains("flags dynamic"),
            "one element per slot of the /24 pool: {conns}"
        );
        let rate = set(&t, "slot_rate");
        assert!(
            rate.contains("size 128") && rate.contains("flags dynamic,timeout"),
            "{rate}"
        );
        let count = "ct state new add @slot_conns { ip saddr ct count over 1024 } drop";
        let limit = "ct state new update @slot_rate \
                     { ip saddr limit rate over 500/second burst 1024 packets } drop";
        let established = "ct state established,related accept";
        // DNS flows are rate-limited, not counted; open connections pass first: a limit
        // never cuts them.
        let input = chain(&t, "slot_input");
        assert!(!input.contains("slot_conns"), "{input}");
        let pos = |needle: &str| input.find(needle).unwrap();
        assert!(pos(established) < pos(limit) && pos(limit) < pos("ct status dnat accept"));
        let forward = chain(&t, "slot_forward");
        let pos = |needle: &str| forward.find(needle).unwrap();
        assert!(pos(established) < pos(count) && pos(count) < pos(limit));
        // After every fixed deny, before the slot's policy.
        for deny in [
            "oifname \"fbx1-*\" drop",
            "fib daddr type",
            "ipv6 drop",
            "853 drop",
        ] {
            assert!(pos(deny) < pos(count), "{deny}");
        }
        assert!(pos(limit) < pos("vmap @slot_egress"));
    }

    #[test]
    fn the_limits_follow_the_config_and_the_rate_limit_can_be_off() {
        let t = table_text(&NetConfig {
            slot_limits: SlotLimits {
                max_connections: 8,
                new_connections_per_second: 20,
                new_connections_burst: 40,
            },
            ..cfg()
        });
        assert_eq!(
            t.matches("ct state new add @slot_conns { ip saddr ct count over 8 } drop")
                .count(),
            1
        );
        assert_eq!(
            t.matches("{ ip saddr limit rate over 20/second burst 40 packets } drop")
                .count(),
            2
        );
        let off = table_text(&NetConfig {
            slot_limits: SlotLimits {
                new_connections_per_second: 0,
                ..SlotLimits::default()
            },
            ..cfg()
        });
        assert!(
            !off.contains("slot_rate") && !off.contains("limit rate"),
            "{off}"
        );
        assert_eq!(off.matches("ct count over 1024").count(), 1);
    }

    #[test]
    fn the_credential_proxy_takes_its_slots_https_and_their_quic_is_dropped() {
        let without = table_text(&cfg());
        assert!(!without.contains("redirect to :40443"));
        assert!(without.contains("set credential_proxy_slots"));
        let t = table_text(&NetConfig {
            credential_proxy_port: Some(40443),
            ..cfg()
        });
        assert!(chain(&t, "prerouting").contains(
            "iifname @credential_proxy_slots tcp dport { 80, 443 } tcp sport != 61000-61999 redirect to :40443"
        ));
        let slot_input = chain(&t, "slot_input");
        let accept = slot_input
            .find("tcp dport 40443 ct status dnat accept")
            .unwrap();
        assert!(accept < slot_input.rfind("drop").unwrap());
        let input = chain(&t, "input");
        assert!(
            input.find("jump slot_input").unwrap() < input.find("tcp dport 40443 drop").unwrap(),
            "slots first, then nobody else"
        );
        let forward = chain(&t, "slot_forward");
        assert!(
            forward
                .find("iifname @credential_proxy_slots udp dport 443 drop")
                .unwrap()
                < forward.find("vmap").unwrap()
        );
    }

    /// The table with a proxy port is what `nft` takes (checked, never installed), when
    /// `nft` is there.
    #[test]
    fn the_table_with_a_credential_proxy_parses() {
        let script = install_script(&NetConfig {
            prefix: "fbxchk".into(),
            credential_proxy_port: Some(40443),
            ..cfg()
        });
        let checked = std::process::Command::new("nft")
            .args(["-c", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                child.stdin.take().unwrap().write_all(script.as_bytes())?;
                child.wait_with_output()
            });
        match checked {
            Ok(out) if out.status.success() => {}
            Ok(out) if String::from_utf8_lossy(&out.stderr).contains("Operation not permitted") => {
                eprintln!("skipped: nft -c needs CAP_NET_ADMIN here")
            }
            Ok(out) => panic!(
                "nft refused the table: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => eprintln!("skipped: no nft ({e})"),
        }
    }

    #[test]
    fn slot_input_ends_in_drop() {
        let t = table_text(&cfg());
        let body = chain(&t, "slot_input");
        assert_eq!(body.trim_end().lines().last().unwrap().trim(), "drop");
    }
}
