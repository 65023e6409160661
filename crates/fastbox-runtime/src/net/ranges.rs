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
//!
//! The values ([`Ipv4Net`], [`PRIVATE_RANGES`], [`is_denied`]) are defined in
//! `fastbox_api::net`, so the server can parse and check them without the runtime; they are
//! re-exported here at their old paths.

pub use fastbox_api::net::{Ipv4Net, PRIVATE_RANGES, is_denied};
