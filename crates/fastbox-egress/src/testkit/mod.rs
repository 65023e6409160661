//! Test support for egress (feature `testkit`): a test "internet" and probes that make real
//! connection attempts and DNS queries from inside a slot.
//!
//! For privileged tests (root, `ip`, `nft`): build a [`TestInternet`] with a [`Zone`], point
//! the DNS forwarder's upstream at [`TestInternet::dns_addr`], and probe from a slot's
//! netns with [`connect_from`] and [`resolve_from`]. Every host-wide name carries the test's
//! prefix, so a purge of the prefix removes whatever a failed test left.

mod dns_server;
mod internet;
mod probe;
mod server;
pub mod sink;

pub use dns_server::{TestDnsServer, Zone, a_query};
pub use internet::{ECHO_PORTS, InternetError, TestInternet, hosts_block, unrouted};
pub use probe::{
    DNS_TIMEOUT, DROP_TIMEOUT, DnsTransport, READ_TIMEOUT, Reach, Resolution, connect_from, echo,
    greeting, resolve_from,
};
pub use server::{EchoServer, StopFlag, Stoppable};
