//! Sandboxes never reach the private network: every check a real connection attempt or DNS
//! query from inside a slot, through the real nft table, DNS forwarder and conntrack.
//!
//! - Under every policy, allow-all included, private test hosts (10/8, 172.16/12,
//!   192.168/16, 100.64/10, 169.254.169.254) and the node's own addresses (one on an extra
//!   interface, one on the test internet's uplink) are dropped, while a documentation-range
//!   host of the test internet is reachable and DNS works. An explicit allow rule for a
//!   private address opens nothing.
//! - DNS rebinding: an allowed name answered with a private address (alone, or beside a
//!   public one) resolves to nothing, and its addresses never reach the slot's learned set.
//! - With `sandbox_reach` 10.200.0.0/24, 10.200.0.1 is reachable and resolvable (learned
//!   under a deny default), subject to the slot's policy; 10.200.1.1 stays dropped.
//! - A released slot's tracked connections are forgotten: an established entry outlives the
//!   slot's veth until `EgressEnforcer::forget_connections`.
//!
//! Every private test host is an address of the test internet's namespace, routed there
//! from the host (`TestInternet::add_host`), and reachable from the host itself (the positive
//! control): a failed block ends in that namespace, never on the machine's network. A
//! candidate address the host already routes is not used (a test must not shadow a real
//! network); a range without a free candidate is skipped with the reason printed.
//!
//! Privileged (root, `ip`, `nft`, `conntrack`); skipped with the reason printed otherwise.
//! Prefix tag `1`; slots 10.219.49.0/25, the internet's hosts 198.51.100.192/26
//! (`testkit::hosts_block`), the node's extra address 203.0.113.193. The two instances (without
//! and with `sandbox_reach`) run one after the other in one test: both route 10.200.0.1.

mod common;

use std::net::{Ipv4Addr, TcpStream};
use std::path::Path;
use std::process::Command;

use common::*;
use fastbox_egress::testkit::{
    READ_TIMEOUT, Resolution, Zone, echo, greeting, hosts_block, unrouted,
};
use fastbox_egress::{Action, EgressPolicy, SlotRef};
use fastbox_runtime::net::{Ipv4Net, NetSlot};

const TAG: char = '1';

/// The private test host of the brief, and what `sandbox_reach` opens.
const TEN: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 1);
const REACH: &str = "10.200.0.0/24";
/// A private host just outside that reach.
const TEN_OUTSIDE: Ipv4Addr = Ipv4Addr::new(10, 200, 1, 1);
/// The cloud metadata address.
const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// Candidate private test hosts per range, the first the host does not route is used.
const CANDIDATES: [(&str, &[Ipv4Addr]); 5] = [
    ("10.0.0.0/8", &[TEN]),
    (
        "172.16.0.0/12",
        &[
            Ipv4Addr::new(172, 16, 254, 1),
            Ipv4Addr::new(172, 27, 254, 1),
            Ipv4Addr::new(172, 30, 254, 1),
        ],
    ),
    (
        "192.168.0.0/16",
        &[
            Ipv4Addr::new(192, 168, 254, 1),
            Ipv4Addr::new(192, 168, 213, 1),
        ],
    ),
    (
        "100.64.0.0/10",
        &[
            Ipv4Addr::new(100, 64, 254, 1),
            Ipv4Addr::new(100, 99, 254, 1),
        ],
    ),
    ("169.254.0.0/16", &[METADATA]),
];

/// The node's own address on an extra interface the test adds: public to the firewall (a
/// documentation range), so only the host-address rules stop it.
const NODE_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 193);

/// Names of the extra zone: a private answer, and a private answer beside a public one.
const REBIND: &str = "rebind.test";
const MIXED: &str = "mixed.test";

fn inet_host(n: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(hosts_block(TAG)) + u32::from(n))
}

fn extra_zone() -> Zone {
    Zone::new()
        .with(REBIND, &[TEN], 300)
        .with(MIXED, &[inet_host(IP_HOST), TEN], 300)
}

fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
    EgressPolicy::from_pairs(default, rules).unwrap()
}

/// The addresses in slot `ifname`'s learned set (`nft -j`); empty when it has none.
fn learned(lab: &Lab, ifname: &str) -> Vec<Ipv4Addr> {
    let out = Command::new("nft")
        .args([
            "-j",
            "list",
            "set",
            "inet",
            &lab.prefix,
            &fastbox_egress::nft::learned_set_name(ifname),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let set = doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|item| item.get("set"))
        .expect("a set")
        .clone();
    set["elem"]
        .as_array()
        .map(|elems| {
            elems
                .iter()
                .map(|e| e["elem"]["val"].as_str().unwrap().parse().unwrap())
                .collect()
        })
        .unwrap_or_default()
}

/// `conntrack -L` lines whose original `direction` (`-s` or `-d`) is `addr`.
fn tracked(direction: &str, addr: Ipv4Addr) -> Vec<String> {
    let out = Command::new("conntrack")
        .args(["-L", "-f", "ipv4", direction, &addr.to_string()])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Gives the internet one free candidate of every private range; the hosts used.
fn add_private_hosts(lab: &Lab) -> Vec<Ipv4Addr> {
    let mut used = Vec::new();
    for (range, candidates) in CANDIDATES {
        match candidates
            .iter()
            .find(|addr| unrouted(&format!("{addr}/32")).is_ok())
        {
            Some(&addr) => {
                lab.internet.add_host(addr).expect("private test host");
                used.push(addr);
            }
            None => eprintln!(
                "skipped: {range}: every candidate test host ({candidates:?}) is routed on this host"
            ),
        }
    }
    used
}

/// Every address is reachable from the host itself (it is routed into the internet's
/// namespace), so a drop from a slot is the firewall's doing.
fn assert_reachable_from_the_host(addrs: &[Ipv4Addr]) {
    for &addr in addrs {
        let mut stream = TcpStream::connect_timeout(&(addr, PORT).into(), READ_TIMEOUT)
            .unwrap_or_else(|e| panic!("positive control: the host cannot reach {addr}: {e}"));
        assert_eq!(greeting(&mut stream).unwrap(), addr.to_string());
    }
}

/// Runs each case on its own slot at once; every failure of every case, collected.
fn run_cases(lab: &Lab, cases: Vec<(&str, EgressPolicy, Case<'_>)>) -> Vec<String> {
    let slots: Vec<NetSlot> = cases
        .iter()
        .enumerate()
        .map(|(i, (_, policy, _))| lab.slot(i as u32, policy))
        .collect();
    let failures = std::thread::scope(|scope| {
        let runs: Vec<_> = cases
            .iter()
            .zip(&slots)
            .map(|((name, _, case), slot)| {
                scope.spawn(move || {
                    let mut probe = Probe::new(name, lab, slot);
                    case(&mut probe);
                    probe.failures
                })
            })
            .collect();
        runs.into_iter()
            .flat_map(|run| run.join().expect("case panicked"))
            .collect()
    });
    for slot in &slots {
        lab.enforcer.remove(&SlotRef::from(slot)).unwrap();
        lab.host.destroy_slot(slot).unwrap();
        lab.enforcer
            .forget_connections(&SlotRef::from(slot))
            .unwrap();
    }
    failures
}

type Case<'a> = Box<dyn Fn(&mut Probe) + Send + Sync + 'a>;

fn expect_resolution(p: &mut Probe, name: &str, want: Resolution) {
    let got = p.resolve(name);
    if got != want {
        p.failures.push(format!(
            "{}: resolve {name}: got {got:?}, want {want:?}",
            p.case
        ));
    }
}

fn expect_learned(p: &mut Probe, addr: Ipv4Addr, want: bool) {
    let set = learned(p.lab, &p.slot.host_if);
    if set.contains(&addr) != want {
        p.failures.push(format!(
            "{}: learned set {set:?} {} {addr}",
            p.case,
            if want { "lacks" } else { "holds" }
        ));
    }
}

/// Without `sandbox_reach`: nothing private, nothing of the node, whatever the policy.
fn without_reach() {
    let Some(lab) = Lab::start_with(TAG, Vec::new(), extra_zone()) else {
        return;
    };
    let private = add_private_hosts(&lab);
    assert!(private.contains(&TEN), "10.200.0.1 is routed on this host");
    // The node's own address on another interface, and a server on all of its addresses.
    unrouted(&format!("{NODE_ADDR}/32")).expect("the node address is free");
    // A veth pair, both ends on the host (kernels without the dummy module have veth: the
    // slots are veths).
    let dummy = format!("{}_dm", lab.prefix);
    let peer = format!("{}_dn", lab.prefix);
    for args in [
        vec!["link", "add", &dummy, "type", "veth", "peer", "name", &peer],
        vec!["addr", "add", "203.0.113.193/32", "dev", &dummy],
        vec!["link", "set", &dummy, "up"],
        vec!["link", "set", &peer, "up"],
    ] {
        let out = Command::new("ip").args(&args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
    }
    let node_server = Lab::echo_server_in(Path::new("/proc/self/ns/net"));
    let node_port = node_server.addr().port();
    TcpStream::connect((NODE_ADDR, node_port)).expect("positive control: the node address");
    TcpStream::connect((lab.internet.uplink_addr(), node_port))
        .expect("positive control: the uplink address");
    assert_reachable_from_the_host(&private);

    let public = lab.inet(ALLOWED.1);
    let explicit: Vec<(&str, String)> = private
        .iter()
        .map(|addr| ("allow", addr.to_string()))
        .collect();
    let mut explicit_rules: Vec<(&str, &str)> =
        explicit.iter().map(|(a, t)| (*a, t.as_str())).collect();
    explicit_rules.extend([("allow", REBIND), ("allow", MIXED), ("allow", ALLOWED.0)]);
    let private_ = &private;
    let blocked = move |p: &mut Probe| {
        for &addr in private_ {
            p.dropped(addr, PORT);
        }
        p.dropped(NODE_ADDR, node_port);
        p.dropped(p.lab.internet.uplink_addr(), node_port);
        p.dropped(p.slot.gateway, node_port);
    };
    let cases: Vec<(&str, EgressPolicy, Case<'_>)> = vec![
        (
            "allow-all",
            EgressPolicy::allow_all(),
            Box::new(move |p: &mut Probe| {
                blocked(p);
                p.connects(public, PORT);
                p.resolves(ALLOWED);
                // Rebinding under allow-all too: no private address in any answer.
                expect_resolution(p, REBIND, Resolution::Addresses(vec![]));
                expect_resolution(p, MIXED, Resolution::Addresses(vec![]));
            }),
        ),
        (
            "allow default with rules",
            policy(Action::Allow, &[("deny", "denied.test")]),
            Box::new(move |p: &mut Probe| {
                blocked(p);
                p.connects(public, PORT);
            }),
        ),
        (
            "deny default, private addresses and names allowed explicitly",
            policy(Action::Deny, &explicit_rules),
            Box::new(move |p: &mut Probe| {
                blocked(p);
                // An allowed name answered with a private address: no address, nothing
                // learned, no connection (also not to the public address beside it).
                expect_resolution(p, REBIND, Resolution::Addresses(vec![]));
                expect_resolution(p, MIXED, Resolution::Addresses(vec![]));
                expect_learned(p, TEN, false);
                expect_learned(p, inet_host(IP_HOST), false);
                p.dropped(inet_host(IP_HOST), PORT);
                // The positive control: an allowed public name is learned and connects.
                p.resolves(ALLOWED);
                expect_learned(p, public, true);
                p.connects(public, PORT);
            }),
        ),
    ];
    let failures = run_cases(&lab, cases);
    assert!(
        failures.is_empty(),
        "failing cases:\n{}",
        failures.join("\n")
    );

    // A released slot forgets its tracked connections: the next sandbox at its address
    // must not inherit an established flow (it passes the table before any policy).
    let slot = lab.slot(20, &EgressPolicy::allow_all());
    let slot_ref = SlotRef::from(&slot);
    let mut open = Probe::new("conntrack", &lab, &slot)
        .connects(public, PORT)
        .expect("an open connection");
    assert_eq!(echo(&mut open, "x\n").unwrap(), "x\n");
    let established = |addr| {
        tracked("-s", addr)
            .iter()
            .any(|l| l.contains("ESTABLISHED") && l.contains(&format!("dst={public} ")))
    };
    assert!(
        established(slot.address),
        "{:?}",
        tracked("-s", slot.address)
    );
    lab.enforcer.remove(&slot_ref).unwrap();
    lab.host.destroy_slot(&slot).unwrap();
    assert!(
        established(slot.address),
        "the entry outlives the veth (what the flush is for)"
    );
    lab.enforcer.forget_connections(&slot_ref).unwrap();
    assert_eq!(tracked("-s", slot.address), Vec::<String>::new());
    assert_eq!(tracked("-d", slot.address), Vec::<String>::new());
    drop(open);

    let out = Command::new("ip")
        .args(["link", "del", &dummy])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    drop(node_server);
    lab.close();
}

/// With `sandbox_reach` 10.200.0.0/24: 10.200.0.1 as the policy says, 10.200.1.1 never.
fn with_reach() {
    let reach: Vec<Ipv4Net> = vec![REACH.parse().unwrap()];
    let Some(lab) = Lab::start_with(TAG, reach, extra_zone()) else {
        return;
    };
    for addr in [TEN, TEN_OUTSIDE] {
        lab.internet.add_host(addr).expect("private test host");
    }
    assert_reachable_from_the_host(&[TEN, TEN_OUTSIDE]);
    let ten = TEN.to_string();
    let cases: Vec<(&str, EgressPolicy, Case<'_>)> = vec![
        (
            "allow-all, reach",
            EgressPolicy::allow_all(),
            Box::new(|p: &mut Probe| {
                p.connects(TEN, PORT);
                p.dropped(TEN_OUTSIDE, PORT);
                expect_resolution(p, REBIND, Resolution::Addresses(vec![TEN]));
                p.connects(p.lab.inet(ALLOWED.1), PORT);
            }),
        ),
        (
            "deny default, allowed name answered inside the reach",
            policy(Action::Deny, &[("allow", REBIND)]),
            Box::new(|p: &mut Probe| {
                p.dropped(TEN, PORT);
                expect_resolution(p, REBIND, Resolution::Addresses(vec![TEN]));
                expect_learned(p, TEN, true);
                p.connects(TEN, PORT);
                p.dropped(TEN_OUTSIDE, PORT);
            }),
        ),
        (
            "deny all, reach",
            EgressPolicy::deny_all(),
            Box::new(|p: &mut Probe| {
                // The reach lifts the fixed deny only: the policy still decides.
                p.dropped(TEN, PORT);
            }),
        ),
        (
            "deny default, the reached address allowed explicitly",
            policy(Action::Deny, &[("allow", &ten)]),
            Box::new(|p: &mut Probe| {
                p.connects(TEN, PORT);
                p.dropped(TEN_OUTSIDE, PORT);
            }),
        ),
    ];
    let failures = run_cases(&lab, cases);
    assert!(
        failures.is_empty(),
        "failing cases:\n{}",
        failures.join("\n")
    );
    lab.close();
}

#[test]
fn sandboxes_never_reach_the_private_network() {
    without_reach();
    with_reach();
}
