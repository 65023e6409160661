//! Egress policy for sandboxes: what a sandbox may reach, decided per slot.
//!
//! - [`policy`]: the policy model (default action, ordered rules on FQDNs, `*.` wildcards,
//!   IPv4 addresses and networks), its validation, and conversions from and to the
//!   OpenSandbox wire type; it is the crate `fastbox-egress-policy`, re-exported here.
//! - [`EgressEnforcer`]: enforces each slot's policy in the instance's nft table (a chain and
//!   a set of DNS-learned addresses per slot, see [`nft`]), cuts connections a policy change
//!   denies ([`conntrack`]), and is the DNS forwarder's [`DnsHook`]: it answers only names
//!   the slot may resolve and opens their addresses before the answer leaves.
//! - `testkit` (feature): a test "internet" and probes for privileged tests.
//!
//! `docs/egress.md` describes the semantics, the limits and what fails closed.
//!
//! [`DnsHook`]: fastbox_runtime::net::dns_forwarder::DnsHook

pub mod conntrack;
mod enforcer;
pub mod learned;
pub mod nft;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use fastbox_egress_policy as policy;

pub use enforcer::{EgressEnforcer, EgressError, SlotRef};
pub use policy::wire::rules_from_wire;
pub use policy::{Action, EgressPolicy, Mode, PolicyError, Rule, Target};
