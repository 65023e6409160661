//! The enforcer's lifecycle on the real nft table: what DNS answers put in a slot's learned
//! set (and for how long), that learned addresses are per slot, what a replace keeps, what
//! fails closed, and that removal leaves nothing.
//!
//! Privileged (root, `ip`, `nft`, `conntrack`); skipped with the reason printed otherwise.

mod common;

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use common::*;
use fastbox_egress::learned::{MIN_HOLD, SLACK};
use fastbox_egress::nft::{chain_name, learned_set_name};
use fastbox_egress::testkit::{Resolution, echo};
use fastbox_egress::{Action, EgressEnforcer, EgressError, EgressPolicy, Mode, SlotRef};
use fastbox_runtime::net::dns_forwarder::{DnsHook, QueryVerdict};

fn policy(default: Action, rules: &[(&str, &str)]) -> EgressPolicy {
    EgressPolicy::from_pairs(default, rules).unwrap()
}

fn nft(args: &[&str]) -> Result<String, String> {
    let out = Command::new("nft").args(args).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// The elements of a slot's learned set: address and timeout in seconds, from `nft -j`.
fn learned_set(lab: &Lab, ifname: &str) -> Vec<(Ipv4Addr, u64)> {
    let json = nft(&[
        "-j",
        "list",
        "set",
        "inet",
        &lab.prefix,
        &learned_set_name(ifname),
    ])
    .expect("list set");
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let set = doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|item| item.get("set"))
        .expect("a set");
    let mut elements: Vec<(Ipv4Addr, u64)> = set["elem"]
        .as_array()
        .map(|elems| {
            elems
                .iter()
                .map(|e| {
                    let e = &e["elem"];
                    (
                        e["val"].as_str().unwrap().parse().unwrap(),
                        e["timeout"].as_u64().unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    elements.sort();
    elements
}

#[test]
fn enforcement_lifecycle_on_the_real_table() {
    let Some(lab) = Lab::start('0') else {
        return;
    };
    let first = policy(
        Action::Deny,
        &[("allow", ALLOWED.0), ("allow", SHORT.0), ("allow", NEVER.0)],
    );
    let a = lab.slot(0, &first);
    let b = lab.slot(1, &first);
    let ref_a = SlotRef::from(&a);

    // Answers open their addresses for max(TTL, 60 s), plus the write slack.
    let mut pa = Probe::new("slot a", &lab, &a);
    let started = Instant::now();
    pa.resolves(ALLOWED);
    let learning = started.elapsed();
    let started = Instant::now();
    pa.resolves(ALLOWED);
    eprintln!(
        "resolve through the proxy: {learning:?} when the answer is written to the set, {:?} when the set holds it already",
        started.elapsed()
    );
    pa.resolves(SHORT);
    assert_eq!(pa.failures, Vec::<String>::new());
    let hold = |ttl: u64| ttl.max(MIN_HOLD.as_secs()) + SLACK.as_secs();
    assert_eq!(
        learned_set(&lab, &a.host_if),
        [
            (lab.inet(ALLOWED.1), hold(300)),
            (lab.inet(SHORT.1), hold(5))
        ]
    );
    // Learned addresses are the slot's own: b learned nothing.
    assert!(learned_set(&lab, &b.host_if).is_empty());
    let mut pb = Probe::new("slot b", &lab, &b);
    pb.dropped(lab.inet(ALLOWED.1), PORT);
    let mut open = pa
        .connects(lab.inet(ALLOWED.1), PORT)
        .expect("a reaches ALLOWED");
    assert_eq!(pb.failures, Vec::<String>::new());

    // A replace keeps what the new policy still allows (open connection included) and
    // forgets the rest.
    let second = policy(
        Action::Deny,
        &[("allow", ALLOWED.0), ("allow", "*.wild.test")],
    );
    lab.enforcer.apply(&ref_a, &second).unwrap();
    assert_eq!(echo(&mut open, "still\n").unwrap(), "still\n");
    assert_eq!(
        learned_set(&lab, &a.host_if)
            .iter()
            .map(|e| e.0)
            .collect::<Vec<_>>(),
        [lab.inet(ALLOWED.1)]
    );
    pa.connects(lab.inet(ALLOWED.1), PORT);
    pa.dropped(lab.inet(SHORT.1), PORT);
    pa.refused(SHORT.0);
    assert_eq!(pa.failures, Vec::<String>::new());
    assert_eq!(lab.enforcer.policy(a.address), Some(second.clone()));
    assert_eq!(
        lab.enforcer.policy(a.address).unwrap().mode(),
        Mode::Enforcing
    );

    // Names that are not slot interfaces of the instance are refused before nft runs.
    for ifname in ["eth0", "lo", &format!("{}_up", lab.prefix), "x-0"] {
        let err = lab
            .enforcer
            .apply(
                &SlotRef {
                    ifname: ifname.into(),
                    address: a.address,
                },
                &second,
            )
            .unwrap_err();
        assert!(
            matches!(err, EgressError::NotASlot { .. }),
            "{ifname}: {err}"
        );
    }
    // Another slot cannot take an address that still has a policy.
    let err = lab
        .enforcer
        .apply(
            &SlotRef {
                ifname: b.host_if.clone(),
                address: a.address,
            },
            &second,
        )
        .unwrap_err();
    assert!(matches!(err, EgressError::AddressInUse { .. }), "{err}");

    // Fail closed: without the instance table, apply of a policy that needs rules fails,
    // and the slot stays without a policy: its DNS is refused. (Allow-all needs no rules.)
    let orphan_prefix = "fbzq0x9y";
    let orphan = Arc::new(EgressEnforcer::try_new(orphan_prefix).unwrap());
    let orphan_slot = SlotRef {
        ifname: format!("{orphan_prefix}-0"),
        address: Ipv4Addr::new(10, 219, 0, 1),
    };
    let err = orphan
        .apply(&orphan_slot, &EgressPolicy::deny_all())
        .unwrap_err();
    assert!(matches!(err, EgressError::Nft { .. }), "{err}");
    assert_eq!(orphan.policy(orphan_slot.address), None);
    assert_eq!(
        orphan.on_query(orphan_slot.address.into(), ALLOWED.0),
        QueryVerdict::Refuse
    );

    // Removal: chain, set and map element go; the slot's DNS is refused; twice is fine.
    lab.enforcer.remove(&ref_a).unwrap();
    lab.enforcer.remove(&ref_a).unwrap();
    assert!(
        nft(&[
            "list",
            "chain",
            "inet",
            &lab.prefix,
            &chain_name(&a.host_if)
        ])
        .is_err()
    );
    assert!(
        nft(&[
            "list",
            "set",
            "inet",
            &lab.prefix,
            &learned_set_name(&a.host_if)
        ])
        .is_err()
    );
    let map = nft(&["list", "map", "inet", &lab.prefix, "slot_egress"]).unwrap();
    assert!(!map.contains(&format!("\"{}\"", a.host_if)), "{map}");
    assert!(map.contains(&format!("\"{}\"", b.host_if)), "{map}");
    assert_eq!(pa.resolve(ALLOWED.0), Resolution::NXDOMAIN);
    assert_eq!(lab.enforcer.policy(a.address), None);
    // And a fresh apply works again.
    lab.apply(&a, &EgressPolicy::allow_all()).unwrap();
    pa.resolves(ALLOWED);
    pa.connects(lab.inet(NEVER.1), PORT);
    assert_eq!(pa.failures, Vec::<String>::new());

    drop(open);
    lab.close();
}
