//! The address pool: one `/31` per slot, carved from an IPv4 prefix.
//!
//! Slot `i` owns the pair `base + 2i` (the gateway, on the host end of the veth) and
//! `base + 2i + 1` (the sandbox, on `eth0`). The pool is a value defined in
//! `fastbox_api::net` (the server configures it without the runtime), re-exported here.

pub use fastbox_api::net::{Ipv4Pool, SLOT_PREFIX_LEN, SlotAddresses};
