//! The egress lab: one instance (nft table, DNS forwarder with the egress enforcer as its
//! hook, slots) in front of a test internet, all under one per-test prefix.
//!
//! Prefix tags: this crate's tests use `f` (egress_matrix.rs), `0` (enforcement.rs), `3`
//! (throughput.rs) and `1` (private_network.rs), and the two-character tags `xc` and `xd`
//! (tenant_limits.rs, `fastbox_testkit::run_prefix_pair`); see `fastbox_testkit::run_prefix`
//! for the letters other suites use. Addresses: `10.219.<tag byte>.0/24` for the slots (lower
//! half) and the uplink of the test internet, whose hosts are the suite's documentation-range
//! block (`testkit::hosts_block`): sandboxes never reach private ranges.

#![allow(dead_code)] // each test binary uses its own part

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use fastbox_egress::testkit::{
    DnsTransport, EchoServer, Reach, Resolution, TestInternet, Zone, connect_from, greeting,
    hosts_block, resolve_from,
};
use fastbox_egress::{EgressEnforcer, EgressError, EgressPolicy, SlotRef};
use fastbox_runtime::net::{
    DnsForwarder, DnsForwarderConfig, HostNetwork, Ipv4Net, NetConfig, NetSlot, SlotLimits,
    in_netns,
};

/// Names of the lab's zone and the internet host each resolves to.
pub const ALLOWED: (&str, u8) = ("allowed.test", 10);
pub const WILD_SUB: (&str, u8) = ("api.wild.test", 11);
pub const WILD_DEEP: (&str, u8) = ("deep.api.wild.test", 12);
pub const WILD_APEX: (&str, u8) = ("wild.test", 13);
pub const DENIED: (&str, u8) = ("denied.test", 14);
pub const NEVER: (&str, u8) = ("never.test", 15);
/// A name whose TTL (5 s) is below the 60 s floor.
pub const SHORT: (&str, u8) = ("short.test", 16);
/// TTL of every other name.
pub const TTL: u32 = 300;
/// An address rule's target host, and the first host of a /28 rule (hosts 32..=47).
pub const IP_HOST: u8 = 20;
pub const CIDR_FIRST: u8 = 32;
pub const CIDR_LEN: u8 = 28;
/// A host just outside the /28.
pub const OUTSIDE_CIDR: u8 = 48;
/// The echo port of every internet host.
pub const PORT: u16 = 80;

/// Why the lab cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    if let Some(reason) = fastbox_testkit::privileged_unavailable() {
        return Some(reason);
    }
    for (tool, arg) in [
        ("ip", "-V"),
        ("nft", "--version"),
        ("conntrack", "--version"),
    ] {
        match Command::new(tool).arg(arg).output() {
            Ok(out) if out.status.success() => {}
            _ => {
                return Some(format!(
                    "`{tool}` is not installed (scripts/setup.sh installs it)"
                ));
            }
        }
    }
    None
}

/// A running lab. Dropping it removes everything carrying its prefix, also after a failed
/// assertion; [`Lab::close`] does the same and checks that nothing is left.
pub struct Lab {
    pub prefix: String,
    pub internet: TestInternet,
    pub enforcer: Arc<EgressEnforcer>,
    pub host: HostNetwork,
    forwarder: DnsForwarder,
    _purge: PurgeOnDrop,
}

/// Removes everything carrying its prefix (`HostNetwork::purge`) when dropped, also after a
/// failed assertion.
pub struct PurgeOnDrop(pub String);

impl Drop for PurgeOnDrop {
    fn drop(&mut self) {
        if let Err(e) = HostNetwork::purge(&self.0) {
            eprintln!("purge of {} failed: {e}", self.0);
        }
    }
}

/// How [`Lab::start_custom`] builds a lab.
pub struct LabSetup {
    /// The instance prefix.
    pub prefix: String,
    /// The lab's own `/24` (first three octets): slots in `.0/25`, the internet's uplink.
    pub net: [u8; 3],
    /// The internet's hosts, a documentation-range `/26` (`testkit::hosts_block`).
    pub hosts: Ipv4Addr,
    /// The instance's `--sandbox-reach`.
    pub reach: Vec<Ipv4Net>,
    /// Names in the internet's zone beyond the lab's own.
    pub extra: Zone,
    /// The instance table's per-slot limits.
    pub slot_limits: SlotLimits,
    /// The port the table redirects credential-proxied slots' HTTPS to.
    pub credential_proxy_port: Option<u16>,
}

impl Lab {
    /// Starts the lab for test `tag`; `None` (reason printed) when it cannot run here.
    pub fn start(tag: char) -> Option<Lab> {
        Self::start_with(tag, Vec::new(), Zone::new())
    }

    /// [`Lab::start`] for an instance whose sandboxes may reach `reach` inside the private
    /// ranges (`--sandbox-reach`), with `extra` names in the internet's zone.
    pub fn start_with(tag: char, reach: Vec<Ipv4Net>, extra: Zone) -> Option<Lab> {
        Self::start_custom(LabSetup {
            prefix: fastbox_testkit::run_prefix(&tag.to_string()),
            net: [10, 219, tag as u8],
            hosts: hosts_block(tag),
            reach,
            extra,
            slot_limits: SlotLimits::default(),
            credential_proxy_port: None,
        })
    }

    /// A lab as `setup` says; `None` (reason printed) when it cannot run here.
    pub fn start_custom(setup: LabSetup) -> Option<Lab> {
        if let Some(reason) = unavailable() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let LabSetup {
            prefix,
            net,
            hosts,
            reach,
            extra,
            slot_limits,
            credential_proxy_port,
        } = setup;
        assert!(prefix.len() <= 8, "prefix {prefix:?} is too long");
        let purge = PurgeOnDrop(prefix.clone());
        let internet = TestInternet::start(&prefix, net, hosts, zone_for(hosts).merged(extra))
            .expect("test internet");
        let enforcer = Arc::new(
            EgressEnforcer::try_new(&prefix)
                .expect("egress enforcer")
                .with_reach(reach.clone()),
        );
        let forwarder = DnsForwarder::start(
            DnsForwarderConfig::new(vec![internet.dns_addr()]).with_hook(enforcer.clone()),
        )
        .expect("dns forwarder");
        let [a, b, c] = net;
        let host = HostNetwork::try_new(NetConfig {
            prefix: prefix.clone(),
            pool: format!("{a}.{b}.{c}.0/25").parse().unwrap(),
            dns_port: forwarder.port(),
            sandbox_reach: reach,
            slot_limits,
            credential_proxy_port,
        })
        .expect("host network");
        eprintln!("lab {prefix}: slots {a}.{b}.{c}.0/25, internet {hosts}/26");
        Some(Lab {
            prefix,
            internet,
            enforcer,
            host,
            forwarder,
            _purge: purge,
        })
    }

    /// Internet host `n`.
    pub fn inet(&self, n: u8) -> Ipv4Addr {
        self.internet.host(n)
    }

    /// A new slot with `policy` applied.
    pub fn slot(&self, index: u32, policy: &EgressPolicy) -> NetSlot {
        let slot = self.host.create_slot(index).expect("slot");
        self.apply(&slot, policy).expect("apply policy");
        slot
    }

    pub fn apply(&self, slot: &NetSlot, policy: &EgressPolicy) -> Result<(), EgressError> {
        self.enforcer.apply(&SlotRef::from(slot), policy)
    }

    /// An echo server listening on 0.0.0.0 inside `netns`.
    pub fn echo_server_in(netns: &Path) -> EchoServer {
        let listener = in_netns(netns, || TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)))
            .unwrap()
            .unwrap();
        EchoServer::serve(listener).unwrap()
    }

    /// Removes everything and checks nothing with the prefix is left.
    pub fn close(self) {
        let prefix = self.prefix.clone();
        let Lab {
            internet,
            host,
            forwarder,
            ..
        } = self;
        drop(internet);
        drop(forwarder);
        host.teardown().expect("teardown");
        let left = HostNetwork::leaked(&prefix).unwrap();
        assert!(left.is_empty(), "left behind: {left}");
    }
}

fn zone_for(hosts: Ipv4Addr) -> Zone {
    let host = |n: u8| Ipv4Addr::from(u32::from(hosts) + u32::from(n));
    let mut zone = Zone::new();
    for (name, n) in [ALLOWED, WILD_SUB, WILD_DEEP, WILD_APEX, DENIED, NEVER] {
        zone = zone.with(name, &[host(n)], TTL);
    }
    zone.with(SHORT.0, &[host(SHORT.1)], 5)
}

/// Checks made from inside one slot; failures are collected, not raised, so a matrix
/// reports every failing case at once.
pub struct Probe<'a> {
    pub case: &'a str,
    pub lab: &'a Lab,
    pub slot: &'a NetSlot,
    pub failures: Vec<String>,
}

impl<'a> Probe<'a> {
    pub fn new(case: &'a str, lab: &'a Lab, slot: &'a NetSlot) -> Self {
        Self {
            case,
            lab,
            slot,
            failures: Vec::new(),
        }
    }

    fn fail(&mut self, what: String) {
        self.failures.push(format!("{}: {what}", self.case));
    }

    /// Resolves `name` through the slot's resolver (its gateway).
    pub fn resolve(&self, name: &str) -> Resolution {
        resolve_from(
            &self.slot.netns_path,
            SocketAddr::from((self.slot.gateway, 53)),
            name,
            DnsTransport::Udp,
        )
    }

    /// `name` resolves to internet host `n`.
    pub fn resolves(&mut self, (name, n): (&str, u8)) {
        let got = self.resolve(name);
        let want = Resolution::Addresses(vec![self.lab.inet(n)]);
        if got != want {
            self.fail(format!("resolve {name}: got {got:?}, want {want:?}"));
        }
    }

    /// `name` gets NXDOMAIN.
    pub fn refused(&mut self, name: &str) {
        let got = self.resolve(name);
        if got != Resolution::NXDOMAIN {
            self.fail(format!("resolve {name}: got {got:?}, want NXDOMAIN"));
        }
    }

    /// A connection to `addr:port` completes and reaches that address.
    pub fn connects(&mut self, addr: Ipv4Addr, port: u16) -> Option<std::net::TcpStream> {
        match connect_from(&self.slot.netns_path, SocketAddr::from((addr, port))) {
            Reach::Connected(mut stream) => match greeting(&mut stream) {
                Ok(g) if g == addr.to_string() => Some(stream),
                other => {
                    self.fail(format!("{addr}:{port}: greeting {other:?}"));
                    None
                }
            },
            other => {
                self.fail(format!(
                    "{addr}:{port}: expected a connection, got {other:?}"
                ));
                None
            }
        }
    }

    /// A connection attempt to `addr:port` is silently dropped.
    pub fn dropped(&mut self, addr: Ipv4Addr, port: u16) {
        let reach = connect_from(&self.slot.netns_path, SocketAddr::from((addr, port)));
        if !reach.is_dropped() {
            self.fail(format!("{addr}:{port}: expected a drop, got {reach:?}"));
        }
    }
}
