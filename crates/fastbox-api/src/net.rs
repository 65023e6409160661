//! IPv4 networks and the slot address pool, as values: parsed, printed, serialized, checked.
//! No I/O; the runtime (`fastbox_runtime::net`, which re-exports these at their old paths)
//! turns them into interfaces, routes and nft sets.
//!
//! - [`Ipv4Net`]: a network `a.b.c.d/len` (host bits zero), e.g. an operator's
//!   `--sandbox-reach` entry.
//! - [`PRIVATE_RANGES`]: the networks a node's own surroundings live in: RFC 1918, shared
//!   address space (CGNAT), loopback, link-local (cloud metadata), "this network", multicast
//!   and reserved. No sandbox reaches them (the instance's nft set `private_ranges`, and the
//!   DNS forwarder's hook withholds answers naming them) unless the operator lists them in
//!   `sandbox_reach`, which lifts only this fixed deny; [`is_denied`] is that decision.
//! - [`Ipv4Pool`]: the prefix slots are carved from, one `/31` per slot. Slot `i` owns the
//!   pair `base + 2i` (the gateway, on the host end of the veth) and `base + 2i + 1` (the
//!   sandbox, on `eth0`). A `/31` is a point-to-point link (RFC 3021): both addresses are
//!   usable, there is no network or broadcast address, so a `/16` holds 32768 slots. The
//!   mapping is a pure function of the index, so a slot's addresses can be recomputed after a
//!   restart and a resumed sandbox can be given the index it had.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Why a network or pool is not acceptable, or a pool has no such slot (the runtime's
/// `NetError` wraps it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// The network or pool is unusable.
    #[error("invalid network config: {0}")]
    InvalidConfig(String),
    /// The pool has no slot with this index.
    #[error("slot index {index} is outside pool {pool} ({capacity} slots)")]
    IndexOutOfPool {
        /// Requested index.
        index: u32,
        /// The pool.
        pool: Ipv4Pool,
        /// Slots in the pool.
        capacity: u32,
    },
}

/// An IPv4 network `a.b.c.d/len` (host bits zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Net {
    network: Ipv4Addr,
    prefix_len: u8,
}

impl Ipv4Net {
    /// The network `network/prefix_len`; `network` must have no bits set past the prefix.
    pub fn try_new(network: Ipv4Addr, prefix_len: u8) -> Result<Self, AddrError> {
        if prefix_len > 32 {
            return Err(AddrError::InvalidConfig(format!(
                "prefix length /{prefix_len} is longer than 32"
            )));
        }
        let net = Self {
            network,
            prefix_len,
        };
        if u32::from(network) & !net.mask() != 0 {
            return Err(AddrError::InvalidConfig(format!(
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
    type Err = AddrError;

    /// `a.b.c.d/len`, or a bare address for `/32`.
    fn from_str(s: &str) -> Result<Self, AddrError> {
        let invalid =
            || AddrError::InvalidConfig(format!("{s:?} is not an IPv4 network a.b.c.d/len"));
        let (addr, len) = match s.trim().split_once('/') {
            Some((addr, len)) => (addr, len.parse::<u8>().map_err(|_| invalid())?),
            None => (s.trim(), 32),
        };
        Self::try_new(addr.parse().map_err(|_| invalid())?, len)
    }
}

impl TryFrom<String> for Ipv4Net {
    type Error = AddrError;

    fn try_from(s: String) -> Result<Self, AddrError> {
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

/// Prefix length of one slot's point-to-point link.
pub const SLOT_PREFIX_LEN: u8 = 31;

/// Shortest pool prefix accepted: keeps slot indexes within five base-36 digits, so
/// interface names stay within 15 bytes (see `fastbox_runtime::net::names`).
pub const MIN_POOL_PREFIX_LEN: u8 = 8;

/// An IPv4 prefix that slots are carved from, written `10.88.0.0/16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Pool {
    base: Ipv4Addr,
    prefix_len: u8,
}

/// The two addresses of one slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotAddresses {
    /// Host end of the veth; the sandbox's default gateway and DNS server.
    pub gateway: Ipv4Addr,
    /// The sandbox's address on `eth0`.
    pub address: Ipv4Addr,
}

impl Ipv4Pool {
    /// The pool `base/prefix_len`; `base` must have no bits set past the prefix.
    pub fn try_new(base: Ipv4Addr, prefix_len: u8) -> Result<Self, AddrError> {
        if !(MIN_POOL_PREFIX_LEN..=SLOT_PREFIX_LEN).contains(&prefix_len) {
            return Err(AddrError::InvalidConfig(format!(
                "pool prefix length /{prefix_len} outside /{MIN_POOL_PREFIX_LEN}../{SLOT_PREFIX_LEN}"
            )));
        }
        let host_bits = u32::MAX >> prefix_len;
        if u32::from(base) & host_bits != 0 {
            return Err(AddrError::InvalidConfig(format!(
                "pool base {base} has bits set past /{prefix_len}"
            )));
        }
        Ok(Self { base, prefix_len })
    }

    /// First address of the pool.
    pub fn base(&self) -> Ipv4Addr {
        self.base
    }

    /// Prefix length of the pool.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// Number of slots the pool holds (indexes `0..capacity`).
    pub fn capacity(&self) -> u32 {
        1u32 << (SLOT_PREFIX_LEN - self.prefix_len)
    }

    /// Addresses of slot `index`, or an error when the pool has no such slot.
    pub fn slot(&self, index: u32) -> Result<SlotAddresses, AddrError> {
        if index >= self.capacity() {
            return Err(AddrError::IndexOutOfPool {
                index,
                pool: *self,
                capacity: self.capacity(),
            });
        }
        let gateway = u32::from(self.base) + 2 * index;
        Ok(SlotAddresses {
            gateway: Ipv4Addr::from(gateway),
            address: Ipv4Addr::from(gateway + 1),
        })
    }

    /// The slot index that owns `addr` (as gateway or sandbox address), if inside the pool.
    pub fn index_of(&self, addr: Ipv4Addr) -> Option<u32> {
        self.contains(addr)
            .then(|| (u32::from(addr) - u32::from(self.base)) / 2)
    }

    /// Whether `addr` lies inside the pool.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        let mask = !(u32::MAX >> self.prefix_len);
        u32::from(addr) & mask == u32::from(self.base)
    }
}

impl Default for Ipv4Pool {
    /// `10.88.0.0/16`: 32768 slots.
    fn default() -> Self {
        Self {
            base: Ipv4Addr::new(10, 88, 0, 0),
            prefix_len: 16,
        }
    }
}

impl fmt::Display for Ipv4Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix_len)
    }
}

impl FromStr for Ipv4Pool {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        let invalid =
            || AddrError::InvalidConfig(format!("pool {s:?} is not an IPv4 prefix a.b.c.d/n"));
        let (base, len) = s.split_once('/').ok_or_else(invalid)?;
        let base: Ipv4Addr = base.parse().map_err(|_| invalid())?;
        let len: u8 = len.parse().map_err(|_| invalid())?;
        Self::try_new(base, len)
    }
}

impl TryFrom<String> for Ipv4Pool {
    type Error = AddrError;

    fn try_from(s: String) -> Result<Self, AddrError> {
        s.parse()
    }
}

impl From<Ipv4Pool> for String {
    fn from(pool: Ipv4Pool) -> String {
        pool.to_string()
    }
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

    fn pool(s: &str) -> Ipv4Pool {
        s.parse().unwrap()
    }

    #[test]
    fn default_pool_is_10_88_slash_16_with_32768_slots() {
        let p = Ipv4Pool::default();
        assert_eq!(p.to_string(), "10.88.0.0/16");
        assert_eq!(p.capacity(), 32768);
    }

    #[test]
    fn slot_addresses_are_consecutive_pairs() {
        let p = Ipv4Pool::default();
        let s0 = p.slot(0).unwrap();
        assert_eq!(s0.gateway, Ipv4Addr::new(10, 88, 0, 0));
        assert_eq!(s0.address, Ipv4Addr::new(10, 88, 0, 1));
        let s1 = p.slot(1).unwrap();
        assert_eq!(s1.gateway, Ipv4Addr::new(10, 88, 0, 2));
        assert_eq!(s1.address, Ipv4Addr::new(10, 88, 0, 3));
        let s200 = p.slot(200).unwrap();
        assert_eq!(s200.gateway, Ipv4Addr::new(10, 88, 1, 144));
        let last = p.slot(32767).unwrap();
        assert_eq!(last.gateway, Ipv4Addr::new(10, 88, 255, 254));
        assert_eq!(last.address, Ipv4Addr::new(10, 88, 255, 255));
    }

    #[test]
    fn slot_outside_pool_is_rejected() {
        let p = pool("192.168.7.0/30");
        assert_eq!(p.capacity(), 2);
        assert!(p.slot(1).is_ok());
        assert!(matches!(
            p.slot(2),
            Err(AddrError::IndexOutOfPool {
                index: 2,
                capacity: 2,
                ..
            })
        ));
    }

    #[test]
    fn no_two_slots_share_an_address() {
        let p = pool("10.1.2.0/24");
        let mut seen = std::collections::HashSet::new();
        for i in 0..p.capacity() {
            let s = p.slot(i).unwrap();
            assert!(p.contains(s.gateway) && p.contains(s.address));
            assert!(seen.insert(s.gateway) && seen.insert(s.address));
        }
        assert_eq!(seen.len(), 256);
    }

    #[test]
    fn index_of_inverts_slot() {
        let p = pool("10.200.0.0/20");
        for i in [0, 1, 77, p.capacity() - 1] {
            let s = p.slot(i).unwrap();
            assert_eq!(p.index_of(s.gateway), Some(i));
            assert_eq!(p.index_of(s.address), Some(i));
        }
        assert_eq!(p.index_of(Ipv4Addr::new(10, 200, 16, 0)), None);
    }

    #[test]
    fn misaligned_or_out_of_range_pools_are_rejected() {
        for bad in [
            "10.88.0.1/16",
            "10.0.0.0/7",
            "10.0.0.0/32",
            "10.0.0.0",
            "x/16",
            "10.0.0.0/a",
        ] {
            assert!(bad.parse::<Ipv4Pool>().is_err(), "{bad} accepted");
        }
        assert!("10.0.0.0/8".parse::<Ipv4Pool>().is_ok());
        assert!("10.0.0.6/31".parse::<Ipv4Pool>().is_ok());
    }

    #[test]
    fn pool_round_trips_through_serde_as_a_string() {
        let p: Ipv4Pool = serde_json::from_str("\"10.9.0.0/24\"").unwrap();
        assert_eq!(p, pool("10.9.0.0/24"));
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"10.9.0.0/24\"");
        assert!(serde_json::from_str::<Ipv4Pool>("\"10.9.0.1/24\"").is_err());
    }
}
