//! The test "internet": a network namespace routed from the host that plays the outside
//! world, with a DNS server and echo servers on many addresses.
//!
//! Layout:
//! - `10.a.b.252/30`, inside a test's own `10.a.b.0/24` (slots use the lower half), is the
//!   uplink: `{prefix}_up` on the host (`.253`), `up0` in the namespace `{prefix}_inet`
//!   (`.254`);
//! - the internet's hosts ([`TestInternet::host`]) are a `/26` of the documentation ranges
//!   (RFC 5737: 198.51.100.0/24, 203.0.113.0/24), one per test suite ([`hosts_block`]):
//!   sandboxes never reach the private ranges, so "the internet" must lie outside them. A
//!   `local` route on the namespace's `lo` makes every address of the block answer, and
//!   the host routes the block through the uplink;
//! - [`TestInternet::add_host`] gives the namespace more addresses (private ones, for tests
//!   of the fixed denies), each routed from the host the same way;
//! - the DNS server ([`TestDnsServer`]) listens on `host(1):53`, UDP and TCP;
//! - echo servers ([`EchoServer`]) listen on every address of the namespace, on
//!   [`ECHO_PORTS`].
//!
//! Every address of the internet lives in the namespace: a connection the firewall failed
//! to stop ends there, never on the machine's real network. The internet has no route back
//! to the slots: replies only arrive when the host masquerades, as for real destinations.
//! Both names carry the test's prefix, so a purge of the prefix (`HostNetwork::purge`)
//! removes them too (and the host's routes through the uplink with it); dropping the
//! [`TestInternet`] removes them itself.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};

use fastbox_runtime::net::{NetError, NetSys, RealNetSys, in_netns, netns};

use super::dns_server::{TestDnsServer, Zone};
use super::server::EchoServer;

/// Ports every internet host serves the echo protocol on: plain TCP and the DNS-over-TLS
/// port (so a blocked 853 is the firewall's doing, not a missing server).
pub const ECHO_PORTS: [u16; 2] = [80, 853];

/// Name of the interface in the namespace.
const INNER_IF: &str = "up0";

/// The documentation-range `/26` of the internet's hosts of test suite `tag` (the suite's
/// prefix tag, see `fastbox_testkit::run_prefix`), so suites running at once never route
/// the same addresses. Panics for a suite without a block: add it here.
///
/// | tag | suite | hosts |
/// |---|---|---|
/// | `0` | fastbox-egress `tests/enforcement.rs` | 198.51.100.0/26 |
/// | `f` | fastbox-egress `tests/egress_matrix.rs` | 198.51.100.64/26 |
/// | `3` | fastbox-egress `tests/throughput.rs` | 198.51.100.128/26 |
/// | `1` | fastbox-egress `tests/private_network.rs` | 198.51.100.192/26 |
/// | `m` | fastbox-cli `tests/egress_e2e.rs` | 203.0.113.0/26 |
///
/// Taken without this function: 203.0.113.64/26 (fastbox-runtime `tests/net_privileged.rs`),
/// 203.0.113.128/26 (`tests/tenant_limits.rs`, whose two-character tags have no `char`),
/// 203.0.113.192/26 (node addresses in `tests/private_network.rs`) and 198.18.0.0/16 (the
/// SDK suite's test internet, `tests/sdk/lab_internet.py`). 192.0.2.0/24 is
/// left alone: some machines (this project's CI among them) use it for their real network.
pub fn hosts_block(tag: char) -> Ipv4Addr {
    match tag {
        '0' => Ipv4Addr::new(198, 51, 100, 0),
        'f' => Ipv4Addr::new(198, 51, 100, 64),
        '3' => Ipv4Addr::new(198, 51, 100, 128),
        '1' => Ipv4Addr::new(198, 51, 100, 192),
        'm' => Ipv4Addr::new(203, 0, 113, 0),
        other => panic!("test suite {other:?} has no test internet block (testkit::hosts_block)"),
    }
}

/// What failed while building the internet.
#[derive(Debug, thiserror::Error)]
pub enum InternetError {
    /// A command or a namespace step failed.
    #[error("test internet: network set-up failed")]
    Net(#[from] NetError),
    /// A server could not start.
    #[error("test internet: a server could not start")]
    Io(#[from] io::Error),
}

/// A running test internet. Dropping it stops the servers and removes the namespace and
/// the uplink.
pub struct TestInternet {
    net: [u8; 3],
    hosts: Ipv4Addr,
    ns_name: String,
    uplink: String,
    netns_path: PathBuf,
    servers: Option<Servers>,
}

struct Servers {
    dns: TestDnsServer,
    _echo: Vec<EchoServer>,
}

impl TestInternet {
    /// Builds the internet for a test whose names start with `prefix` (an instance prefix),
    /// whose own addresses are `net.0/24` (`net` = the first three octets; the uplink takes
    /// `.252/30`) and whose internet hosts are the `/26` at `hosts` ([`hosts_block`]),
    /// serving `zone`.
    pub fn start(
        prefix: &str,
        net: [u8; 3],
        hosts: Ipv4Addr,
        zone: Zone,
    ) -> Result<Self, InternetError> {
        assert_eq!(
            u32::from(hosts) & 63,
            0,
            "the hosts block {hosts} is not a /26"
        );
        let mut internet = Self {
            net,
            hosts,
            ns_name: format!("{prefix}_inet"),
            uplink: format!("{prefix}_up"),
            netns_path: PathBuf::new(),
            servers: None,
        };
        // On failure, Drop removes what was made.
        internet.wire()?;
        internet.servers = Some(internet.start_servers(zone)?);
        Ok(internet)
    }

    fn wire(&mut self) -> Result<(), InternetError> {
        let sys = RealNetSys;
        self.netns_path = netns::create(&self.ns_name)?;
        let (ns, up) = (&self.ns_name, &self.uplink);
        let (host_side, inner_side) = (self.addr(253), self.addr(254));
        let hosts = format!("{}/26", self.hosts);
        unrouted(&hosts)?;
        sys.run(
            "ip",
            &["-batch", "-"],
            Some(&format!(
                "link add {up} type veth peer name {INNER_IF} netns {ns}\n\
                 addr add {host_side}/30 dev {up}\n\
                 link set {up} up\n"
            )),
        )?;
        sys.run(
            "ip",
            &["-netns", ns, "-batch", "-"],
            Some(&format!(
                "link set lo up\n\
                 addr add {inner_side}/30 dev {INNER_IF}\n\
                 link set {INNER_IF} up\n\
                 route add local {hosts} dev lo\n"
            )),
        )?;
        sys.run(
            "ip",
            &[
                "route",
                "add",
                &hosts,
                "via",
                &inner_side.to_string(),
                "dev",
                up,
            ],
            None,
        )?;
        Ok(())
    }

    fn start_servers(&self, zone: Zone) -> Result<Servers, InternetError> {
        let dns_addr = self.dns_addr();
        let (udp, tcp) = in_netns(&self.netns_path, || {
            Ok::<_, io::Error>((UdpSocket::bind(dns_addr)?, TcpListener::bind(dns_addr)?))
        })??;
        let dns = TestDnsServer::serve(udp, tcp, zone)?;
        let echo = ECHO_PORTS
            .iter()
            .map(|&port| {
                let listener = in_netns(&self.netns_path, || {
                    TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
                })??;
                Ok(EchoServer::serve(listener)?)
            })
            .collect::<Result<Vec<_>, InternetError>>()?;
        Ok(Servers { dns, _echo: echo })
    }

    /// Internet host `n` (1..=62): the `n`-th address of the hosts block.
    pub fn host(&self, n: u8) -> Ipv4Addr {
        assert!((1..=62).contains(&n), "internet hosts are 1..=62, not {n}");
        Ipv4Addr::from(u32::from(self.hosts) + u32::from(n))
    }

    /// The network starting at host `first` with prefix length `len`, for CIDR rules.
    pub fn network(&self, first: u8, len: u8) -> String {
        format!(
            "{}/{len}",
            Ipv4Addr::from(u32::from(self.hosts) + u32::from(first))
        )
    }

    /// Gives the internet one more address, `addr` (e.g. a private one, to prove the fixed
    /// denies stop it): on the namespace's `lo`, so its echo servers answer there, and
    /// routed from the host through the uplink. The host must have no route of its own
    /// covering `addr` (checked: a test must not shadow the machine's real network). Gone
    /// with the internet.
    pub fn add_host(&self, addr: Ipv4Addr) -> Result<(), InternetError> {
        let sys = RealNetSys;
        let host = format!("{addr}/32");
        unrouted(&host)?;
        sys.run(
            "ip",
            &["-netns", &self.ns_name, "addr", "add", &host, "dev", "lo"],
            None,
        )?;
        sys.run(
            "ip",
            &[
                "route",
                "add",
                &host,
                "via",
                &self.addr(254).to_string(),
                "dev",
                &self.uplink,
            ],
            None,
        )?;
        Ok(())
    }

    /// The DNS server's address: `host(1):53`.
    pub fn dns_addr(&self) -> SocketAddr {
        SocketAddr::from((self.host(1), 53))
    }

    /// The DNS server (for the names it was asked).
    pub fn dns(&self) -> &TestDnsServer {
        &self.servers.as_ref().expect("servers run").dns
    }

    /// The host's address on the uplink: the source internet servers see after NAT.
    pub fn uplink_addr(&self) -> Ipv4Addr {
        self.addr(253)
    }

    /// The internet's network namespace.
    pub fn netns_path(&self) -> &Path {
        &self.netns_path
    }

    fn addr(&self, last: u8) -> Ipv4Addr {
        let [a, b, c] = self.net;
        Ipv4Addr::new(a, b, c, last)
    }
}

/// Fails unless the host routes nothing more specific than a default route to any address
/// of `net` (`a.b.c.d/len`), and has no address in it: a test's addresses must not shadow a
/// real network (192.0.2.0/24, say, is the real network of some machines).
pub fn unrouted(net: &str) -> Result<(), InternetError> {
    let sys = RealNetSys;
    let mut found = Vec::new();
    // Routes containing the network (`match`) and inside it (`root`), in every table (the
    // local table holds the host's own addresses).
    for selector in ["match", "root"] {
        let out = sys.run(
            "ip",
            &["-4", "route", "show", "table", "all", selector, net],
            None,
        )?;
        found.extend(
            out.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("default"))
                .map(str::to_owned),
        );
    }
    if found.is_empty() {
        Ok(())
    } else {
        Err(InternetError::Net(NetError::InvalidConfig(format!(
            "test internet addresses {net} are already routed on this host ({}): pick another block",
            found.join("; ")
        ))))
    }
}

impl Drop for TestInternet {
    fn drop(&mut self) {
        drop(self.servers.take());
        let sys = RealNetSys;
        if sys.link_exists(&self.uplink)
            && let Err(e) = sys.run("ip", &["link", "del", &self.uplink], None)
        {
            eprintln!("test internet: removing {} failed: {e}", self.uplink);
        }
        if let Err(e) = netns::remove(&self.ns_name) {
            eprintln!("test internet: removing {} failed: {e}", self.ns_name);
        }
    }
}
