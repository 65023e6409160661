//! The address ranges no sandbox reaches, whatever its egress policy, and the operator's
//! exceptions to them.
//!
//! [`PRIVATE_RANGES`] are the networks a node's own surroundings live in: RFC 1918, shared
//! address space (CGNAT), loopback, link-local (cloud metadata), "this network", multicast
//! and reserved. The instance table drops every packet from a slot to them (the nft set
//! `private_ranges`), and the DNS forwarder's hook withholds answers naming them, so an
//! allowed name cannot be pointed at them either (DNS rebinding). An operator whose sandboxes
//! must reach an internal network lists it in `--sandbox-reach` ([`super::NetConfig`]'s
//! `sandbox_reach`, the nft set `sandbox_reach`): that lifts only this fixed deny, the
//! sandbox's own egress policy still decides.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::NetError;

/// An IPv4 network `a.b.c.d/len` (host bits zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Net {
    network: Ipv4Addr,
    prefix_len: u8,
}

impl Ipv4Net {
    /// The network `network/prefix_len`; `network` must have no bits set past the prefix.
    pub fn try_new(network: Ipv4Addr, prefix_len: u8) -> Result<Self, NetError> {
        if prefix_len > 32 {
            return Err(NetError::InvalidConfig(format!(
                "prefix length /{prefix_len} is longer than 32"
            )));
        }
        let net = Self {
            network,
            prefix_len,
        };
        if u32::from(network) & !net.mask() != 0 {
            return Err(NetError::InvalidConfig(format!(
                "{network}/{prefix_len} has host bits set (the network is {}/{prefix_len})",
                Ipv4Addr::from(u32::from(network) & net.mask())
            )));
        }
        Ok(net)
    }

    const fn of(a: u8, b: u8, c: u8, d: u8, prefix_len: u8) -> Self {
        Self {
            network: Ipv4Addr::new(a, b, c, d),
            prefix_len,
        }
    }

    /// The first address.
    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    /// The prefix length.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// Whether `addr` lies inside.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & self.mask() == u32::from(self.network)
    }

    fn mask(&self) -> u32 {
        u32::MAX
            .checked_shl(32 - u32::from(self.prefix_len))
            .unwrap_or(0)
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix_len)
    }
}

impl FromStr for Ipv4Net {
    type Err = NetError;

    /// `a.b.c.d/len`, or a bare address for `/32`.
    fn from_str(s: &str) -> Result<Self, NetError> {
        let invalid =
            || NetError::InvalidConfig(format!("{s:?} is not an IPv4 network a.b.c.d/len"));
        let (addr, len) = match s.trim().split_once('/') {
            Some((addr, len)) => (addr, len.parse::<u8>().map_err(|_| invalid())?),
            None => (s.trim(), 32),
        };
        Self::try_new(addr.parse().map_err(|_| invalid())?, len)
    }
}

impl TryFrom<String> for Ipv4Net {
    type Error = NetError;

    fn try_from(s: String) -> Result<Self, NetError> {
        s.parse()
    }
}

impl From<Ipv4Net> for String {
    fn from(net: Ipv4Net) -> String {
        net.to_string()
    }
}

/// Networks no sandbox reaches unless the operator lists them in `sandbox_reach`. Sorted and
/// disjoint (one nft interval set).
pub const PRIVATE_RANGES: [Ipv4Net; 9] = [
    // "This network" (RFC 791): 0.0.0.0 means the local host to many stacks.
    Ipv4Net::of(0, 0, 0, 0, 8),
    // RFC 1918.
    Ipv4Net::of(10, 0, 0, 0, 8),
    // Shared address space (RFC 6598): carrier-grade NAT, also used by overlay networks.
    Ipv4Net::of(100, 64, 0, 0, 10),
    // Loopback: the host's own services.
    Ipv4Net::of(127, 0, 0, 0, 8),
    // Link-local: cloud metadata services (169.254.169.254) hand out credentials.
    Ipv4Net::of(169, 254, 0, 0, 16),
    // RFC 1918.
    Ipv4Net::of(172, 16, 0, 0, 12),
    // RFC 1918.
    Ipv4Net::of(192, 168, 0, 0, 16),
    // Multicast.
    Ipv4Net::of(224, 0, 0, 0, 4),
    // Reserved, and the limited broadcast address 255.255.255.255.
    Ipv4Net::of(240, 0, 0, 0, 4),
];

/// Whether a sandbox may never reach `addr`: it lies in one of [`PRIVATE_RANGES`] and in no
/// network of `reach` (the operator's `sandbox_reach`).
pub fn is_denied(addr: Ipv4Addr, reach: &[Ipv4Net]) -> bool {
    PRIVATE_RANGES.iter().any(|net| net.contains(addr))
        && !reach.iter().any(|net| net.contains(addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_parse_print_and_refuse_host_bits() {
        assert_eq!(net("10.200.0.0/24").to_string(), "10.200.0.0/24");
        assert_eq!(net("10.1.2.3").to_string(), "10.1.2.3/32");
        assert_eq!(net(" 0.0.0.0/0 ").to_string(), "0.0.0.0/0");
        for bad in [
            "10.0.0.1/24",
            "10.0.0.0/33",
            "10.0.0/8",
            "x/8",
            "10.0.0.0/",
            "::1/128",
        ] {
            assert!(bad.parse::<Ipv4Net>().is_err(), "{bad} accepted");
        }
        let err = "10.0.0.1/24".parse::<Ipv4Net>().unwrap_err().to_string();
        assert!(err.contains("10.0.0.0/24"), "{err}");
        let json: Ipv4Net = serde_json::from_str("\"172.16.0.0/12\"").unwrap();
        assert_eq!(serde_json::to_string(&json).unwrap(), "\"172.16.0.0/12\"");
    }

    #[test]
    fn contains_respects_the_prefix() {
        let n = net("10.200.0.0/24");
        assert!(n.contains(ip("10.200.0.0")) && n.contains(ip("10.200.0.255")));
        assert!(!n.contains(ip("10.200.1.0")) && !n.contains(ip("10.199.255.255")));
        assert!(net("0.0.0.0/0").contains(ip("255.255.255.255")));
        assert!(net("10.1.2.3/32").contains(ip("10.1.2.3")));
        assert!(!net("10.1.2.3/32").contains(ip("10.1.2.4")));
    }

    #[test]
    fn private_ranges_are_sorted_disjoint_and_aligned() {
        for pair in PRIVATE_RANGES.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            let a_last = u32::from(a.network()) | !a.mask();
            assert!(a_last < u32::from(b.network()), "{a} and {b}");
        }
        for r in PRIVATE_RANGES {
            assert!(Ipv4Net::try_new(r.network(), r.prefix_len()).is_ok(), "{r}");
        }
    }

    #[test]
    fn private_and_special_addresses_are_denied_unless_reached() {
        for denied in [
            "0.0.0.0",
            "10.0.0.1",
            "10.200.0.1",
            "100.64.0.1",
            "100.127.255.254",
            "127.0.0.1",
            "127.1.2.3",
            "169.254.169.254",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "224.0.0.251",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
        ] {
            assert!(is_denied(ip(denied), &[]), "{denied}");
        }
        for open in [
            "1.1.1.1",
            "100.63.255.255",
            "100.128.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.0.2.1",
            "198.51.100.7",
            "203.0.113.9",
            "223.255.255.255",
        ] {
            assert!(!is_denied(ip(open), &[]), "{open}");
        }
        let reach = [net("10.200.0.0/24"), net("169.254.169.254")];
        assert!(!is_denied(ip("10.200.0.1"), &reach));
        assert!(is_denied(ip("10.200.1.1"), &reach));
        assert!(!is_denied(ip("169.254.169.254"), &reach));
        assert!(is_denied(ip("169.254.169.253"), &reach));
    }
}
