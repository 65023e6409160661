//! Where the registry client may connect: never into the operator's own networks unless the
//! operator says so.
//!
//! An API caller names the registry host (`10.0.0.5:5000/x`), and the registry names its token
//! realm and the targets of its redirects: without a check, a pull is a request forgery into
//! whatever the server can reach (cloud metadata at 169.254.169.254, a Docker socket on
//! 127.0.0.1:2375, the office network). So every connection of the registry client is checked
//! against [`SPECIAL_RANGES`] (private, loopback, link-local, CGNAT, unique-local,
//! unspecified, multicast, reserved, and IPv6 forms embedding such an IPv4 address):
//!
//! - host names are checked at connect time, on the addresses they resolve to
//!   ([`GuardedResolver`]), so a name that resolves to a public address when looked at and to
//!   a private one when connected to (DNS rebinding) gains nothing; addresses in refused
//!   ranges are dropped, and a name left with none is refused;
//! - literal addresses, which never reach a resolver, are checked on the URL before the
//!   request is sent ([`AddressPolicy::check_url`]) and on every redirect hop
//!   ([`redirect_policy`]).
//!
//! The operator's exceptions: networks listed in `ImageConfig::registry_allow_private`, and
//! the registries the operator configured by name (`insecure_registries` entries and
//! `docker_hub_endpoint`): those are reached wherever they resolve, at their configured port.

use std::fmt;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use serde::{Deserialize, Serialize};

/// An IPv4 or IPv6 network: `a.b.c.d/len`, `x:y::/len`; a bare address is one host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IpNet {
    network: IpAddr,
    prefix_len: u8,
}

impl IpNet {
    /// The network `network/prefix_len`; `network` must have no bits set past the prefix.
    pub fn try_new(network: IpAddr, prefix_len: u8) -> Result<Self, String> {
        let max = if network.is_ipv4() { 32 } else { 128 };
        if prefix_len > max {
            return Err(format!(
                "prefix length /{prefix_len} is longer than {max} for {network}"
            ));
        }
        let net = IpNet {
            network,
            prefix_len,
        };
        let masked = net.masked(network);
        if masked != network {
            return Err(format!(
                "{network}/{prefix_len} has host bits set (the network is {masked}/{prefix_len})"
            ));
        }
        Ok(net)
    }

    const fn v4(a: u8, b: u8, c: u8, d: u8, prefix_len: u8) -> Self {
        IpNet {
            network: IpAddr::V4(Ipv4Addr::new(a, b, c, d)),
            prefix_len,
        }
    }

    const fn v6(bits: u128, prefix_len: u8) -> Self {
        IpNet {
            network: IpAddr::V6(Ipv6Addr::from_bits(bits)),
            prefix_len,
        }
    }

    /// The first address.
    pub fn network(&self) -> IpAddr {
        self.network
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// Whether `addr` lies inside (an IPv4 network holds no IPv6 address and the reverse).
    pub fn contains(&self, addr: IpAddr) -> bool {
        addr.is_ipv4() == self.network.is_ipv4() && self.masked(addr) == self.network
    }

    fn masked(&self, addr: IpAddr) -> IpAddr {
        match addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                IpAddr::V4(Ipv4Addr::from_bits(a.to_bits() & mask))
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from_bits(a.to_bits() & mask))
            }
        }
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

impl FromStr for IpNet {
    type Err = String;

    /// `a.b.c.d/len`, `x::/len`, or a bare address for one host.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let invalid = || format!("{s:?} is not a network (a.b.c.d/len or x::/len)");
        let (addr, len) = match s.split_once('/') {
            Some((addr, len)) => (addr, Some(len.parse::<u8>().map_err(|_| invalid())?)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| invalid())?;
        let len = len.unwrap_or(if addr.is_ipv4() { 32 } else { 128 });
        IpNet::try_new(addr, len)
    }
}

impl TryFrom<String> for IpNet {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<IpNet> for String {
    fn from(net: IpNet) -> String {
        net.to_string()
    }
}

/// A special-purpose network no registry connection goes to unless allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialRange {
    pub net: IpNet,
    /// What the network is, for messages (`loopback`, `private (RFC 1918)`).
    pub what: &'static str,
}

const fn special(net: IpNet, what: &'static str) -> SpecialRange {
    SpecialRange { net, what }
}

/// The networks refused to registry connections by default: the same IPv4 list sandboxes
/// never reach (`docs/egress.md`), and their IPv6 counterparts. IPv6 addresses that embed an
/// IPv4 address (IPv4-mapped `::ffff:0:0/96`, IPv4-compatible `::/96`, NAT64 `64:ff9b::/96`,
/// 6to4 `2002::/16`) are judged by the IPv4 address they embed.
pub const SPECIAL_RANGES: [SpecialRange; 16] = [
    special(IpNet::v4(0, 0, 0, 0, 8), "\"this network\""),
    special(IpNet::v4(10, 0, 0, 0, 8), "private (RFC 1918)"),
    special(IpNet::v4(100, 64, 0, 0, 10), "shared address space (CGNAT)"),
    special(IpNet::v4(127, 0, 0, 0, 8), "loopback"),
    special(IpNet::v4(169, 254, 0, 0, 16), "link-local"),
    special(IpNet::v4(172, 16, 0, 0, 12), "private (RFC 1918)"),
    special(IpNet::v4(192, 168, 0, 0, 16), "private (RFC 1918)"),
    special(IpNet::v4(224, 0, 0, 0, 4), "multicast"),
    special(IpNet::v4(240, 0, 0, 0, 4), "reserved or broadcast"),
    special(IpNet::v6(0, 128), "unspecified"),
    special(IpNet::v6(1, 128), "loopback"),
    special(
        IpNet::v6(0x0064_ff9b_0001_0000_0000_0000_0000_0000, 48),
        "local-use NAT64",
    ),
    special(IpNet::v6(0xfc00 << 112, 7), "unique-local"),
    special(IpNet::v6(0xfe80 << 112, 10), "link-local"),
    special(IpNet::v6(0xfec0 << 112, 10), "site-local"),
    special(IpNet::v6(0xff00 << 112, 8), "multicast"),
];

/// The IPv4 address an IPv6 address stands for, in the forms a host or a translator may turn
/// into an IPv4 connection.
fn embedded_v4(addr: Ipv6Addr) -> Option<Ipv4Addr> {
    let bits = addr.to_bits();
    let low32 = Ipv4Addr::from_bits(bits as u32);
    if let Some(v4) = addr.to_ipv4_mapped() {
        return Some(v4);
    }
    // IPv4-compatible (deprecated), except :: and ::1 which are themselves.
    if bits >> 32 == 0 && bits > 1 {
        return Some(low32);
    }
    // NAT64 well-known prefix (RFC 6052).
    if bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000 {
        return Some(low32);
    }
    // 6to4 (RFC 3056): 2002:AABB:CCDD::/48.
    if bits >> 112 == 0x2002 {
        return Some(Ipv4Addr::from_bits((bits >> 80) as u32));
    }
    None
}

/// Why an address is special: its range, and the IPv4 address it was judged by when it
/// embeds one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Special {
    pub range: SpecialRange,
    pub embedded: Option<Ipv4Addr>,
}

impl fmt::Display for Special {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.range.what, self.range.net)?;
        if let Some(v4) = self.embedded {
            write!(f, ", as the IPv4 address {v4} it embeds")?;
        }
        Ok(())
    }
}

/// The special range `addr` lies in, `None` for an ordinary (public) address.
pub fn classify(addr: IpAddr) -> Option<Special> {
    let embedded = match addr {
        IpAddr::V6(v6) => embedded_v4(v6),
        IpAddr::V4(_) => None,
    };
    let judged = embedded.map_or(addr, IpAddr::V4);
    SPECIAL_RANGES
        .iter()
        .find(|r| r.net.contains(judged))
        .map(|&range| Special { range, embedded })
}

/// A registry the operator configured by name: `host` or `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ConfiguredHost {
    host: String,
    port: Option<u16>,
    entry: String,
}

impl ConfiguredHost {
    fn parse(entry: &str) -> Option<ConfiguredHost> {
        let entry = entry.trim();
        let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
            let (host, after) = rest.split_once(']')?;
            let port = match after.strip_prefix(':') {
                Some(p) => Some(p.parse().ok()?),
                None if after.is_empty() => None,
                None => return None,
            };
            (host, port)
        } else if entry.matches(':').count() == 1 {
            let (host, port) = entry.split_once(':')?;
            (host, Some(port.parse().ok()?))
        } else {
            (entry, None)
        };
        (!host.is_empty()).then(|| ConfiguredHost {
            host: normalize_host(host),
            port,
            entry: entry.to_owned(),
        })
    }
}

/// Lower case, without IPv6 brackets or a trailing dot.
fn normalize_host(host: &str) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Why a connection was refused before it was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The host is, or resolves only to, addresses in special ranges.
    Address {
        host: String,
        address: IpAddr,
        special: Special,
    },
    /// A host the operator configured at one port, asked for at another: its addresses are
    /// not checked, so only the configured port is trusted.
    Port {
        host: String,
        port: u16,
        entries: Vec<String>,
    },
}

impl Refusal {
    pub(crate) fn host(&self) -> &str {
        match self {
            Refusal::Address { host, .. } | Refusal::Port { host, .. } => host,
        }
    }

    /// What was refused: `127.0.0.1`, `localhost (127.0.0.1)`, `registry.local:6000`.
    pub(crate) fn target(&self) -> String {
        match self {
            Refusal::Address { host, address, .. } if host.parse::<IpAddr>().is_ok() => {
                address.to_string()
            }
            Refusal::Address { host, address, .. } => format!("{host} ({address})"),
            Refusal::Port { host, port, .. } if host.contains(':') => format!("[{host}]:{port}"),
            Refusal::Port { host, port, .. } => format!("{host}:{port}"),
        }
    }

    /// Why, and what the operator can do about it.
    pub(crate) fn reason(&self) -> String {
        match self {
            Refusal::Address {
                address, special, ..
            } => format!(
                "{address} is in {special}; registries, token realms and redirects in private, \
                 loopback, link-local and other special networks are refused unless the operator \
                 allows the network with the registry_allow_private setting \
                 (fastbox up --registry-allow-private CIDR)"
            ),
            Refusal::Port { host, entries, .. } => format!(
                "{host} is a configured registry only as {} (insecure_registries, \
                 docker_hub_endpoint); its other ports are refused",
                entries.join(", ")
            ),
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "refusing {}: {}", self.target(), self.reason())
    }
}

impl std::error::Error for Refusal {}

/// The operator's exceptions to the special ranges, and the check of hosts and addresses.
#[derive(Debug, Clone, Default)]
pub(crate) struct AddressPolicy {
    allow: Vec<IpNet>,
    configured: Vec<ConfiguredHost>,
}

impl AddressPolicy {
    /// `allow`: networks reachable despite being special. `configured`: `host[:port]` entries
    /// of registries the operator named (reached wherever they resolve).
    pub(crate) fn new<'a>(
        allow: &[IpNet],
        configured: impl IntoIterator<Item = &'a str>,
    ) -> AddressPolicy {
        AddressPolicy {
            allow: allow.to_vec(),
            configured: configured
                .into_iter()
                .filter_map(ConfiguredHost::parse)
                .collect(),
        }
    }

    /// The special range `addr` is refused for, `None` when it may be connected to.
    pub(crate) fn refused(&self, addr: IpAddr) -> Option<Special> {
        let special = classify(addr)?;
        let allowed = self.allow.iter().any(|net| {
            net.contains(addr)
                || special
                    .embedded
                    .is_some_and(|v4| net.contains(IpAddr::V4(v4)))
        });
        (!allowed).then_some(special)
    }

    fn configured_entries(&self, host: &str) -> Vec<&ConfiguredHost> {
        self.configured.iter().filter(|c| c.host == host).collect()
    }

    /// Checks a URL before a request or a redirect hop: literal addresses against the ranges;
    /// a configured host only at its configured port. Other names are checked when they
    /// resolve, by [`GuardedResolver`].
    pub(crate) fn check_url(&self, url: &Url) -> Result<(), Refusal> {
        let Some(host) = url.host_str() else {
            return Ok(());
        };
        let host = normalize_host(host);
        let port = url.port_or_known_default().unwrap_or(0);
        let literal = host.parse::<IpAddr>().ok();
        let entries = self.configured_entries(&host);
        if entries.iter().any(|c| c.port.is_none_or(|p| p == port)) {
            return Ok(());
        }
        match literal {
            Some(address) => match self.refused(address) {
                Some(special) => Err(Refusal::Address {
                    host,
                    address,
                    special,
                }),
                None => Ok(()),
            },
            None if !entries.is_empty() => Err(Refusal::Port {
                host,
                port,
                entries: entries.iter().map(|c| c.entry.clone()).collect(),
            }),
            None => Ok(()),
        }
    }

    /// The addresses of `host` a connection may use: all of them for a configured host, else
    /// those outside the refused ranges; none left is a refusal naming the first refused.
    pub(crate) fn filter(
        &self,
        host: &str,
        addrs: Vec<SocketAddr>,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        let host = normalize_host(host);
        if !self.configured_entries(&host).is_empty() {
            return Ok(addrs);
        }
        let mut first_refused = None;
        let kept: Vec<SocketAddr> = addrs
            .into_iter()
            .filter(|a| match self.refused(a.ip()) {
                Some(special) => {
                    first_refused.get_or_insert((a.ip(), special));
                    false
                }
                None => true,
            })
            .collect();
        match (kept.is_empty(), first_refused) {
            (true, Some((address, special))) => {
                tracing::warn!(host = %host, %address, "registry connection refused: special address");
                Err(Refusal::Address {
                    host,
                    address,
                    special,
                })
            }
            _ => Ok(kept),
        }
    }
}

/// The registry client's resolver: the system's (getaddrinfo, on a thread of its own), with
/// [`AddressPolicy::filter`] applied to every answer, at connect time.
pub(crate) struct GuardedResolver {
    policy: Arc<AddressPolicy>,
}

impl GuardedResolver {
    pub(crate) fn new(policy: Arc<AddressPolicy>) -> Self {
        GuardedResolver { policy }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let host = name.as_str().to_owned();
        let policy = self.policy.clone();
        Box::pin(on_thread(move || -> Result<Addrs, BoxError> {
            let addrs: Vec<SocketAddr> = (host.as_str(), 0).to_socket_addrs()?.collect();
            let kept = policy.filter(&host, addrs)?;
            Ok(Box::new(kept.into_iter()))
        }))
    }
}

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
}

/// A future of `work` run on a thread of its own (a blocking lookup must not stall the
/// client's runtime, whose timers enforce the request timeout).
struct OnThread<T>(Arc<Mutex<Slot<T>>>);

fn on_thread<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, BoxError> + Send + 'static,
) -> OnThread<Result<T, BoxError>> {
    let slot = Arc::new(Mutex::new(Slot {
        value: None,
        waker: None,
    }));
    let shared = slot.clone();
    let spawned = std::thread::Builder::new()
        .name("fastbox-dns".into())
        .spawn(move || {
            let value = work();
            let mut slot = shared.lock().unwrap_or_else(|e| e.into_inner());
            slot.value = Some(value);
            if let Some(waker) = slot.waker.take() {
                waker.wake();
            }
        });
    if let Err(e) = spawned {
        slot.lock().unwrap_or_else(|e| e.into_inner()).value = Some(Err(Box::new(e)));
    }
    OnThread(slot)
}

impl<T> Future for OnThread<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut slot = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match slot.value.take() {
            Some(value) => Poll::Ready(value),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Redirects are followed (up to 10) only to URLs [`AddressPolicy::check_url`] accepts; the
/// names among them are checked again when they resolve.
pub(crate) fn redirect_policy(policy: Arc<AddressPolicy>) -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= 10 {
            return attempt.error("more than 10 redirects");
        }
        if !matches!(attempt.url().scheme(), "http" | "https") {
            let scheme = attempt.url().scheme().to_owned();
            return attempt.error(format!("redirect to a {scheme}: url"));
        }
        match policy.check_url(attempt.url()) {
            Ok(()) => attempt.follow(),
            Err(refusal) => {
                tracing::warn!(target = %refusal.target(), "registry redirect refused");
                attempt.error(refusal)
            }
        }
    })
}

/// The refusal somewhere in an error's chain (a resolver's or a redirect policy's).
pub(crate) fn find_refusal<'e>(
    error: &'e (dyn std::error::Error + 'static),
) -> Option<&'e Refusal> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(r) = e.downcast_ref::<Refusal>() {
            return Some(r);
        }
        current = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn refused(s: &str) -> bool {
        classify(ip(s)).is_some()
    }

    #[test]
    fn every_special_ipv4_range_is_refused_with_its_edges() {
        for (inside, what) in [
            ("0.0.0.0", "this network"),
            ("0.255.255.255", "this network"),
            ("10.0.0.0", "RFC 1918"),
            ("10.255.255.255", "RFC 1918"),
            ("100.64.0.0", "CGNAT"),
            ("100.127.255.255", "CGNAT"),
            ("127.0.0.1", "loopback"),
            ("127.255.255.254", "loopback"),
            ("169.254.169.254", "link-local"),
            ("169.254.0.0", "link-local"),
            ("172.16.0.0", "RFC 1918"),
            ("172.31.255.255", "RFC 1918"),
            ("192.168.0.0", "RFC 1918"),
            ("192.168.255.255", "RFC 1918"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.255", "multicast"),
            ("240.0.0.1", "reserved"),
            ("255.255.255.255", "broadcast"),
        ] {
            let special = classify(ip(inside)).unwrap_or_else(|| panic!("{inside} not refused"));
            assert!(
                special.to_string().contains(what),
                "{inside}: {special} should say {what}"
            );
        }
        for outside in [
            "1.0.0.1",
            "9.255.255.255",
            "11.0.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "223.255.255.255",
            "8.8.8.8",
        ] {
            assert!(!refused(outside), "{outside} is public");
        }
    }

    #[test]
    fn every_special_ipv6_range_is_refused() {
        for (inside, what) in [
            ("::", "unspecified"),
            ("::1", "loopback"),
            ("fc00::", "unique-local"),
            ("fd12:3456::1", "unique-local"),
            ("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "unique-local"),
            ("fe80::1", "link-local"),
            ("febf:ffff::1", "link-local"),
            ("fec0::1", "site-local"),
            ("feff::1", "site-local"),
            ("ff02::1", "multicast"),
            ("64:ff9b:1::a", "NAT64"),
        ] {
            let special = classify(ip(inside)).unwrap_or_else(|| panic!("{inside} not refused"));
            assert!(
                special.to_string().contains(what),
                "{inside}: {special} should say {what}"
            );
            assert_eq!(special.embedded, None, "{inside}");
        }
        for outside in [
            "2001:4860:4860::8888",
            "fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
            "fe00::1",
            "fe7f:ffff::1",
            "::2:1:1",
            "2606:4700::1111",
        ] {
            assert!(!refused(outside), "{outside} is public");
        }
    }

    #[test]
    fn ipv6_forms_embedding_ipv4_are_judged_by_the_ipv4_address() {
        for (inside, v4) in [
            ("::ffff:127.0.0.1", "127.0.0.1"),
            ("::ffff:169.254.169.254", "169.254.169.254"),
            ("::ffff:10.1.2.3", "10.1.2.3"),
            ("::ffff:172.16.0.0", "172.16.0.0"),
            ("::ffff:0.0.0.0", "0.0.0.0"),
            ("::127.0.0.1", "127.0.0.1"),
            ("::10.0.0.1", "10.0.0.1"),
            ("64:ff9b::169.254.169.254", "169.254.169.254"),
            ("64:ff9b::192.168.1.1", "192.168.1.1"),
            ("2002:7f00:1::1", "127.0.0.1"),
            ("2002:a9fe:a9fe::", "169.254.169.254"),
        ] {
            let special = classify(ip(inside)).unwrap_or_else(|| panic!("{inside} not refused"));
            assert_eq!(special.embedded, Some(v4.parse().unwrap()), "{inside}");
            assert!(special.to_string().contains(v4), "{special}");
        }
        for outside in [
            "::ffff:8.8.8.8",
            "::ffff:172.15.255.255",
            "64:ff9b::8.8.4.4",
            "2002:808:808::1",
        ] {
            assert!(!refused(outside), "{outside} is public");
        }
    }

    #[test]
    fn networks_parse_check_host_bits_and_contain() {
        let net: IpNet = "10.0.0.0/8".parse().unwrap();
        assert!(net.contains(ip("10.200.1.1")));
        assert!(!net.contains(ip("11.0.0.0")));
        assert!(!net.contains(ip("::ffff:10.0.0.1")), "families never mix");
        let host: IpNet = "127.0.0.1".parse().unwrap();
        assert_eq!(host.to_string(), "127.0.0.1/32");
        assert!(host.contains(ip("127.0.0.1")) && !host.contains(ip("127.0.0.2")));
        let v6: IpNet = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fc00::1")));
        assert_eq!("::1".parse::<IpNet>().unwrap().to_string(), "::1/128");
        let all: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("1.2.3.4")));
        let err = "10.0.0.1/8".parse::<IpNet>().unwrap_err();
        assert!(
            err.contains("host bits") && err.contains("10.0.0.0/8"),
            "{err}"
        );
        for bad in ["10.0.0.0/33", "fd00::/129", "nope", "10.0.0.0/x", ""] {
            assert!(bad.parse::<IpNet>().is_err(), "{bad}");
        }
        let json = serde_json::to_string(&net).unwrap();
        assert_eq!(json, "\"10.0.0.0/8\"");
        assert_eq!(serde_json::from_str::<IpNet>(&json).unwrap(), net);
        assert!(serde_json::from_str::<IpNet>("\"10.0.0.1/8\"").is_err());
    }

    #[test]
    fn allowed_networks_lift_the_refusal_mapped_forms_included() {
        let policy = AddressPolicy::new(&["127.0.0.0/8".parse().unwrap()], []);
        assert_eq!(policy.refused(ip("127.0.0.1")), None);
        assert_eq!(policy.refused(ip("::ffff:127.0.0.1")), None);
        assert!(
            policy.refused(ip("::1")).is_some(),
            "IPv6 loopback not listed"
        );
        assert!(policy.refused(ip("10.0.0.1")).is_some());
        let policy = AddressPolicy::new(&["fd00::/8".parse().unwrap()], []);
        assert_eq!(policy.refused(ip("fd00::5")), None);
        assert!(policy.refused(ip("fc00::5")).is_some());
        assert_eq!(AddressPolicy::default().refused(ip("8.8.8.8")), None);
    }

    #[test]
    fn urls_with_literal_addresses_are_checked() {
        let policy = AddressPolicy::new(&[], ["registry.local:5000", "10.9.9.9:5000"]);
        let check = |u: &str| policy.check_url(&Url::parse(u).unwrap());
        for bad in [
            "http://127.0.0.1:5000/v2/",
            "http://10.0.0.5/",
            "https://169.254.169.254/latest/meta-data/",
            "http://[::1]:2375/",
            "http://[::ffff:169.254.169.254]/",
            "http://[fe80::1]/",
            "http://0.0.0.0/",
            // The url parser normalizes these IPv4 spellings to 127.0.0.1.
            "http://2130706433/",
            "http://0x7f.1/",
            "http://10.9.9.9:5001/",
        ] {
            let refusal = check(bad).expect_err(bad);
            assert!(
                matches!(refusal, Refusal::Address { .. }),
                "{bad}: {refusal}"
            );
            assert!(refusal.to_string().contains("registry_allow_private"));
        }
        assert!(
            check("http://2130706433/")
                .unwrap_err()
                .to_string()
                .contains("127.0.0.1")
        );
        for good in [
            "https://ghcr.io/v2/",
            "http://localhost:5000/", // a name: checked when it resolves
            "https://8.8.8.8/",
            "http://registry.local:5000/v2/",
            "http://REGISTRY.local.:5000/v2/",
            "http://10.9.9.9:5000/v2/",
        ] {
            assert_eq!(check(good), Ok(()), "{good}");
        }
        let refusal = check("http://registry.local:6379/").unwrap_err();
        assert!(
            matches!(refusal, Refusal::Port { port: 6379, .. }),
            "{refusal}"
        );
        assert!(
            refusal.to_string().contains("registry.local:5000"),
            "{refusal}"
        );
    }

    #[test]
    fn configured_hosts_parse_with_and_without_ports() {
        let p = |e: &str| ConfiguredHost::parse(e).map(|c| (c.host, c.port));
        assert_eq!(p("reg.local"), Some(("reg.local".into(), None)));
        assert_eq!(p("Reg.Local:5000"), Some(("reg.local".into(), Some(5000))));
        assert_eq!(p("[fd00::1]:5000"), Some(("fd00::1".into(), Some(5000))));
        assert_eq!(p("[fd00::1]"), Some(("fd00::1".into(), None)));
        assert_eq!(p("fd00::1"), Some(("fd00::1".into(), None)));
        assert_eq!(p("reg:notaport"), None);
        assert_eq!(p(""), None);
        let policy = AddressPolicy::new(&[], ["[fd00::1]:5000", "reg.local"]);
        let check = |u: &str| policy.check_url(&Url::parse(u).unwrap());
        assert_eq!(check("http://[fd00::1]:5000/"), Ok(()));
        assert!(check("http://[fd00::1]:5001/").is_err());
        assert_eq!(check("https://reg.local:1234/"), Ok(()));
    }

    #[test]
    fn resolved_addresses_are_filtered() {
        let sa = |s: &str| SocketAddr::new(ip(s), 0);
        let policy = AddressPolicy::new(&["192.168.5.0/24".parse().unwrap()], ["mirror.lan"]);
        // Mixed answers keep only the public (or allowed) addresses.
        let kept = policy
            .filter(
                "example.org",
                vec![
                    sa("10.0.0.1"),
                    sa("93.184.216.34"),
                    sa("::1"),
                    sa("192.168.5.7"),
                ],
            )
            .unwrap();
        assert_eq!(kept, vec![sa("93.184.216.34"), sa("192.168.5.7")]);
        // Nothing left: refused, naming the first refused address.
        let refusal = policy
            .filter("rebind.example", vec![sa("169.254.169.254"), sa("::1")])
            .unwrap_err();
        assert_eq!(refusal.target(), "rebind.example (169.254.169.254)");
        assert!(
            refusal.to_string().contains("link-local 169.254.0.0/16"),
            "{refusal}"
        );
        // A configured registry resolves wherever it points.
        assert_eq!(
            policy.filter("Mirror.LAN", vec![sa("10.1.1.1")]).unwrap(),
            vec![sa("10.1.1.1")]
        );
        assert_eq!(policy.filter("empty.example", vec![]).unwrap(), vec![]);
    }

    #[test]
    fn refusals_are_found_in_error_chains() {
        #[derive(Debug)]
        struct Outer(Box<dyn std::error::Error + Send + Sync>);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("outer")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&*self.0)
            }
        }
        let refusal = Refusal::Address {
            host: "x".into(),
            address: ip("10.0.0.1"),
            special: classify(ip("10.0.0.1")).unwrap(),
        };
        let e = Outer(Box::new(refusal.clone()));
        assert_eq!(find_refusal(&e), Some(&refusal));
        let plain = std::io::Error::other("nope");
        assert_eq!(find_refusal(&plain), None);
    }
}
