//! The egress matrix: every case a real connection attempt or DNS query from inside a slot,
//! against a test internet, through the real nft table, conntrack and DNS forwarder.
//!
//! Privileged (root, `ip`, `nft`, `conntrack`); skipped with the reason printed otherwise.
//! Each case runs on its own slot, concurrently; every failing case is reported at once.

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Instant;

use common::*;
use fastbox_egress::testkit::{DnsTransport, Resolution, echo, resolve_from};
use fastbox_egress::{Action, EgressPolicy};
use fastbox_runtime::net::NetSlot;

fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
    EgressPolicy::from_pairs(default, rules).unwrap()
}

type Case = fn(&mut Probe);

/// Deny default, one FQDN allowed: it resolves and connects; other names are refused, and
/// the address of a name never resolved through the proxy is dropped, also when the name
/// is allowed (until it is resolved).
fn deny_default_with_an_allowed_fqdn(p: &mut Probe) {
    let lab = p.lab;
    p.dropped(lab.inet(NEVER.1), PORT);
    p.resolves(ALLOWED);
    p.connects(lab.inet(ALLOWED.1), PORT);
    p.refused(DENIED.0);
    p.dropped(lab.inet(DENIED.1), PORT);
    p.resolves(NEVER);
    p.connects(lab.inet(NEVER.1), PORT);
}

fn deny_default_with_a_wildcard(p: &mut Probe) {
    let lab = p.lab;
    p.resolves(WILD_SUB);
    p.connects(lab.inet(WILD_SUB.1), PORT);
    p.resolves(WILD_DEEP);
    p.connects(lab.inet(WILD_DEEP.1), PORT);
    p.refused(WILD_APEX.0);
    p.dropped(lab.inet(WILD_APEX.1), PORT);
    p.refused(ALLOWED.0);
}

fn deny_default_with_an_ip(p: &mut Probe) {
    let lab = p.lab;
    p.connects(lab.inet(IP_HOST), PORT);
    p.dropped(lab.inet(IP_HOST + 1), PORT);
    p.refused(ALLOWED.0);
    p.dropped(lab.inet(ALLOWED.1), PORT);
}

fn deny_default_with_a_cidr(p: &mut Probe) {
    let lab = p.lab;
    p.connects(lab.inet(CIDR_FIRST), PORT);
    p.connects(lab.inet(CIDR_FIRST + 15), PORT);
    p.dropped(lab.inet(OUTSIDE_CIDR), PORT);
    p.dropped(lab.inet(CIDR_FIRST - 1), PORT);
}

/// Allow default with denied targets: denied names are refused, denied addresses and
/// networks dropped, everything else passes.
fn allow_default_with_denied_targets(p: &mut Probe) {
    let lab = p.lab;
    p.resolves(ALLOWED);
    p.connects(lab.inet(ALLOWED.1), PORT);
    p.refused(DENIED.0);
    p.refused(WILD_SUB.0);
    p.resolves(WILD_APEX);
    p.dropped(lab.inet(IP_HOST), PORT);
    p.dropped(lab.inet(CIDR_FIRST + 3), PORT);
    p.connects(lab.inet(OUTSIDE_CIDR), PORT);
    p.connects(lab.inet(NEVER.1), PORT);
}

fn deny_all(p: &mut Probe) {
    let lab = p.lab;
    for (name, _) in [ALLOWED, DENIED, WILD_SUB] {
        p.refused(name);
    }
    for n in [ALLOWED.1, IP_HOST, CIDR_FIRST, NEVER.1] {
        p.dropped(lab.inet(n), PORT);
    }
}

/// DNS to another resolver is still answered by the proxy (the real server would answer
/// DENIED and never answers 192.0.2.53), over UDP and TCP; DNS over TLS is dropped even to
/// an allowed address.
fn dns_elsewhere_is_proxied_and_dot_is_dropped(p: &mut Probe) {
    let lab = p.lab;
    let ns = &p.slot.netns_path;
    let real = lab.internet.dns_addr();
    let nowhere = SocketAddr::from((Ipv4Addr::new(192, 0, 2, 53), 53));
    for (server, transport) in [
        (real, DnsTransport::Udp),
        (real, DnsTransport::Tcp),
        (nowhere, DnsTransport::Udp),
        (nowhere, DnsTransport::Tcp),
    ] {
        let denied = resolve_from(ns, server, DENIED.0, transport);
        if denied != Resolution::NXDOMAIN {
            p.failures.push(format!(
                "{}: {DENIED:?} via {server} {transport:?}: {denied:?}",
                p.case
            ));
        }
        let allowed = resolve_from(ns, server, ALLOWED.0, transport);
        if allowed != Resolution::Addresses(vec![lab.inet(ALLOWED.1)]) {
            p.failures.push(format!(
                "{}: {ALLOWED:?} via {server} {transport:?}: {allowed:?}",
                p.case
            ));
        }
    }
    p.connects(lab.inet(ALLOWED.1), PORT);
    p.dropped(lab.inet(ALLOWED.1), 853);
    p.dropped(lab.inet(OUTSIDE_CIDR), 853);
    p.connects(lab.inet(OUTSIDE_CIDR), PORT);
}

/// The fixed denies hold under any policy, even one allowing the whole pool and the host:
/// another slot, the host through the slot's gateway.
fn other_slots_and_the_host_stay_unreachable(p: &mut Probe) {
    let lab = p.lab;
    let other = lab.host.create_slot(20).expect("second slot");
    let other_server = Lab::echo_server_in(&other.netns_path);
    let host_server = Lab::echo_server_in(Path::new("/proc/self/ns/net"));
    let pool = lab.host.config().pool.to_string();
    let open = policy(
        Action::Allow,
        &[("allow", &pool), ("allow", &p.slot.gateway.to_string())],
    );
    lab.apply(p.slot, &open).expect("apply");
    p.dropped(other.address, other_server.addr().port());
    p.dropped(p.slot.gateway, host_server.addr().port());
    p.dropped(other.gateway, host_server.addr().port());
    p.connects(lab.inet(ALLOWED.1), PORT);
}

/// A live switch cuts the open connection the new policy denies and keeps the one it
/// allows; new connections follow the new policy at once.
fn a_live_switch_cuts_newly_denied_connections(p: &mut Probe) {
    let lab = p.lab;
    let (Some(mut cut), Some(mut kept)) = (
        p.connects(lab.inet(ALLOWED.1), PORT),
        p.connects(lab.inet(CIDR_FIRST + 1), PORT),
    ) else {
        return;
    };
    for (what, stream) in [
        ("before, to be cut", &mut cut),
        ("before, to be kept", &mut kept),
    ] {
        if echo(stream, "ping\n").ok().as_deref() != Some("ping\n") {
            p.failures.push(format!("{}: echo {what} failed", p.case));
        }
    }
    let network = lab.internet.network(CIDR_FIRST, CIDR_LEN);
    let switched = Instant::now();
    lab.apply(p.slot, &policy(Action::Deny, &[("allow", &network)]))
        .expect("switch policy");
    eprintln!("{}: switch applied in {:?}", p.case, switched.elapsed());
    if let Ok(reply) = echo(&mut cut, "after\n") {
        p.failures.push(format!(
            "{}: a newly denied connection still echoes {reply:?}",
            p.case
        ));
    }
    if echo(&mut kept, "after\n").ok().as_deref() != Some("after\n") {
        p.failures
            .push(format!("{}: an allowed connection was cut", p.case));
    }
    p.dropped(lab.inet(ALLOWED.1), PORT);
    p.refused(ALLOWED.0);
    p.connects(lab.inet(CIDR_FIRST + 2), PORT);
}

#[test]
fn egress_matrix() {
    let Some(lab) = Lab::start('f') else {
        return;
    };
    let ip = lab.inet(IP_HOST).to_string();
    let cidr = lab.internet.network(CIDR_FIRST, CIDR_LEN);
    let cases: Vec<(&str, EgressPolicy, Case)> = vec![
        (
            "deny default, allowed FQDN",
            policy(Action::Deny, &[("allow", ALLOWED.0), ("allow", NEVER.0)]),
            deny_default_with_an_allowed_fqdn,
        ),
        (
            "deny default, allowed wildcard",
            policy(Action::Deny, &[("allow", "*.wild.test")]),
            deny_default_with_a_wildcard,
        ),
        (
            "deny default, allowed IP",
            policy(Action::Deny, &[("allow", &ip)]),
            deny_default_with_an_ip,
        ),
        (
            "deny default, allowed CIDR",
            policy(Action::Deny, &[("allow", &cidr)]),
            deny_default_with_a_cidr,
        ),
        (
            "allow default, denied targets",
            policy(
                Action::Allow,
                &[
                    ("deny", DENIED.0),
                    ("deny", "*.wild.test"),
                    ("deny", &ip),
                    ("deny", &cidr),
                ],
            ),
            allow_default_with_denied_targets,
        ),
        ("deny all", EgressPolicy::deny_all(), deny_all),
        (
            "DNS elsewhere and DoT",
            policy(Action::Allow, &[("deny", DENIED.0)]),
            dns_elsewhere_is_proxied_and_dot_is_dropped,
        ),
        (
            "fixed denies",
            EgressPolicy::allow_all(),
            other_slots_and_the_host_stay_unreachable,
        ),
        (
            "live switch",
            EgressPolicy::allow_all(),
            a_live_switch_cuts_newly_denied_connections,
        ),
    ];
    let started = Instant::now();
    let slots: Vec<NetSlot> = cases
        .iter()
        .enumerate()
        .map(|(i, (_, policy, _))| lab.slot(i as u32, policy))
        .collect();
    let failures: Vec<String> = std::thread::scope(|scope| {
        let runs: Vec<_> = cases
            .iter()
            .zip(&slots)
            .map(|((name, _, case), slot)| {
                let lab = &lab;
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
    eprintln!("{} cases in {:?}", cases.len(), started.elapsed());
    assert!(
        failures.is_empty(),
        "failing cases:\n{}",
        failures.join("\n")
    );
    // DENIED was refused in every case that asked: it never reached the real DNS server.
    let asked = lab.internet.dns().asked();
    assert!(asked.iter().any(|n| n == ALLOWED.0), "{asked:?}");
    assert!(
        !asked.iter().any(|n| n == DENIED.0),
        "a refused name was forwarded: {asked:?}"
    );
    lab.close();
}
