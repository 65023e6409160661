//! The address pool: one `/31` per slot, carved from an IPv4 prefix.
//!
//! Slot `i` owns the pair `base + 2i` (the gateway, on the host end of the veth) and
//! `base + 2i + 1` (the sandbox, on `eth0`). A `/31` is a point-to-point link (RFC 3021):
//! both addresses are usable, there is no network or broadcast address, so a `/16` holds
//! 32768 slots. The mapping is a pure function of the index, so a slot's addresses can be
//! recomputed after a restart and a resumed sandbox can be given the index it had.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::NetError;

/// Prefix length of one slot's point-to-point link.
pub const SLOT_PREFIX_LEN: u8 = 31;

/// Shortest pool prefix accepted: keeps slot indexes within five base-36 digits, so
/// interface names stay within 15 bytes (see [`super::names`]).
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
    pub fn try_new(base: Ipv4Addr, prefix_len: u8) -> Result<Self, NetError> {
        if !(MIN_POOL_PREFIX_LEN..=SLOT_PREFIX_LEN).contains(&prefix_len) {
            return Err(NetError::InvalidConfig(format!(
                "pool prefix length /{prefix_len} outside /{MIN_POOL_PREFIX_LEN}../{SLOT_PREFIX_LEN}"
            )));
        }
        let host_bits = u32::MAX >> prefix_len;
        if u32::from(base) & host_bits != 0 {
            return Err(NetError::InvalidConfig(format!(
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
    pub fn slot(&self, index: u32) -> Result<SlotAddresses, NetError> {
        if index >= self.capacity() {
            return Err(NetError::IndexOutOfPool {
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
    type Err = NetError;

    fn from_str(s: &str) -> Result<Self, NetError> {
        let invalid =
            || NetError::InvalidConfig(format!("pool {s:?} is not an IPv4 prefix a.b.c.d/n"));
        let (base, len) = s.split_once('/').ok_or_else(invalid)?;
        let base: Ipv4Addr = base.parse().map_err(|_| invalid())?;
        let len: u8 = len.parse().map_err(|_| invalid())?;
        Self::try_new(base, len)
    }
}

impl TryFrom<String> for Ipv4Pool {
    type Error = NetError;

    fn try_from(s: String) -> Result<Self, NetError> {
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
            Err(NetError::IndexOutOfPool {
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
