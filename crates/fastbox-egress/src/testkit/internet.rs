//! The test "internet": a network namespace routed from the host that plays the outside
//! world, with a DNS server and echo servers on many addresses.
//!
//! Layout, inside a test's own `10.a.b.0/24` (slots use the lower half):
//! - `10.a.b.252/30` is the uplink: `{prefix}_up` on the host (`.253`), `up0` in the
//!   namespace `{prefix}_inet` (`.254`);
//! - `10.a.b.128/26` are the internet's hosts ([`TestInternet::host`]): a `local` route on
//!   the namespace's `lo` makes every address of it answer, and the host routes it through
//!   the uplink;
//! - the DNS server ([`TestDnsServer`]) listens on `host(1):53`, UDP and TCP;
//! - echo servers ([`EchoServer`]) listen on every host address, on [`ECHO_PORTS`].
//!
//! The internet has no route back to the slots: replies only arrive when the host
//! masquerades, as for real destinations. Both names carry the test's prefix, so a purge of
//! the prefix (`HostNetwork::purge`) removes them too; dropping the [`TestInternet`] removes
//! them itself.

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
    /// Builds the internet for a test whose names start with `prefix` (an instance prefix)
    /// and whose addresses are `net.0/24` (`net` = the first three octets), serving `zone`.
    pub fn start(prefix: &str, net: [u8; 3], zone: Zone) -> Result<Self, InternetError> {
        let mut internet = Self {
            net,
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
        let hosts = format!("{}/26", self.addr(128));
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

    /// Internet host `n` (1..=62): `10.a.b.(128 + n)`.
    pub fn host(&self, n: u8) -> Ipv4Addr {
        assert!((1..=62).contains(&n), "internet hosts are 1..=62, not {n}");
        self.addr(128 + n)
    }

    /// The network `10.a.b.(128 + first)/len`, for CIDR rules.
    pub fn network(&self, first: u8, len: u8) -> String {
        format!("{}/{len}", self.addr(128 + first))
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
