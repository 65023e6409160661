//! Network slots: a network namespace with a veth pair, addresses, routes and NAT.
//!
//! A sandbox lives in a **slot**: a named netns (`/run/netns/{prefix}-{index}`) whose
//! `eth0` is one end of a veth pair; the other end stays on the host with the slot's
//! gateway address. Each slot owns a `/31` of the instance's pool ([`Ipv4Pool`]). One nft
//! table per instance ([`HostNetwork`]) confines every slot by interface-name wildcard:
//! no sandbox reaches another, the host (except the DNS forwarder), or the private,
//! loopback, link-local and other special ranges of [`ranges`] (unless the operator lists
//! them in [`NetConfig::sandbox_reach`]); everything else leaves masqueraded. DNS goes to a
//! [`DnsForwarder`].
//!
//! Why subprocesses: `ip` and `nft` (text through `nft -f -`) keep this module small and
//! its effects readable in `ip`/`nft` terms; each costs a few milliseconds. They are
//! behind the [`NetSys`] seam, so a netlink backend can replace them. `ip netns exec` is
//! never used (its mount namespace breaks CRIU): namespaces are entered with `setns` on a
//! dedicated thread ([`in_netns`]) or `ip -netns NAME`, which only moves the `ip` process.
//!
//! Every host-wide name carries the instance prefix, so instances and parallel tests never
//! collide, and [`HostNetwork::leaked`] can prove nothing is left behind. See
//! `docs/networking.md` for the naming scheme, the table, and what is denied and why.

pub mod dns_forwarder;
mod host;
pub mod names;
pub mod netns;
pub mod nft;
mod pool;
pub mod ranges;
pub mod route;
mod sys;

use std::io;

use serde::{Deserialize, Serialize};

pub use dns_forwarder::{DnsForwarder, DnsForwarderConfig, parse_resolv_conf, system_upstreams};
pub use host::{
    HostNetwork, IP_FORWARD, Leftovers, NetSlot, leaked_with, purge_with, resolv_conf_for,
};
pub use netns::{enter_netns, in_netns, netns_inode};
pub use pool::{Ipv4Pool, SLOT_PREFIX_LEN, SlotAddresses};
pub use ranges::{Ipv4Net, PRIVATE_RANGES};
pub use sys::{NetSys, RealNetSys};

/// An instance's network configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// Per-instance prefix of every host-wide name: 1..=8 bytes of `[a-z0-9]`, starting
    /// with a letter (see [`names`]).
    pub prefix: String,
    /// Addresses for slots; must not overlap another instance's pool or a host network.
    #[serde(default)]
    pub pool: Ipv4Pool,
    /// Port of the running DNS forwarder that the table redirects port 53 to.
    pub dns_port: u16,
    /// Networks inside [`PRIVATE_RANGES`] that sandboxes may reach after all (the operator's
    /// `--sandbox-reach`): they lift only that fixed deny, each sandbox's egress policy
    /// still applies. Empty by default.
    #[serde(default)]
    pub sandbox_reach: Vec<Ipv4Net>,
    /// What one slot may open: tracked connections at once and new ones per second.
    #[serde(default)]
    pub slot_limits: SlotLimits,
    /// Port of the node's credential proxy: the HTTPS of the slots in the set
    /// [`nft::CREDENTIAL_PROXY_SLOTS`] is redirected to it, and their QUIC dropped. None: no
    /// such rules.
    #[serde(default)]
    pub credential_proxy_port: Option<u16>,
}

impl NetConfig {
    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<(), NetError> {
        names::validate_prefix(&self.prefix)?;
        self.slot_limits.validate()
    }
}

/// Per-slot connection limits of the instance table, keyed by the slot's source address (the
/// table's anti-spoofing rule makes it the slot's own). They cover the connections a sandbox
/// opens to the outside and its DNS flows to the forwarder; connections of the host into the
/// sandbox (the node proxy) are not counted. A new connection over a limit is dropped
/// silently, as the fixed denies are; established ones are never touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlotLimits {
    /// Connections one slot may have tracked at once (conntrack entries the kernel still
    /// counts live: TCP until it closes, UDP until its entry expires). Default 1024.
    pub max_connections: u32,
    /// New connections one slot may open per second, on average; `0` turns the rate limit
    /// off. Default 500.
    pub new_connections_per_second: u32,
    /// How many new connections a slot may open at once above that rate (the token bucket's
    /// size). Default 1024.
    pub new_connections_burst: u32,
}

impl Default for SlotLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            new_connections_per_second: 500,
            new_connections_burst: 1024,
        }
    }
}

impl SlotLimits {
    /// Checks the limits are usable: a slot must be able to open at least one connection.
    pub fn validate(&self) -> Result<(), NetError> {
        if self.max_connections == 0 {
            return Err(NetError::InvalidConfig(
                "slot_limits.max_connections must be at least 1".into(),
            ));
        }
        if self.new_connections_per_second > 0 && self.new_connections_burst == 0 {
            return Err(NetError::InvalidConfig(
                "slot_limits.new_connections_burst must be at least 1 with a rate".into(),
            ));
        }
        Ok(())
    }
}

/// What failed in the network module.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// The configuration is unusable.
    #[error("invalid network config: {0}")]
    InvalidConfig(String),
    /// An address or pool error (a network that is not one, a slot outside the pool).
    #[error(transparent)]
    Addr(#[from] fastbox_api::net::AddrError),
    /// Some piece of the slot (netns or host interface) already exists.
    #[error("slot {name} already exists")]
    SlotExists {
        /// Slot name.
        name: String,
    },
    /// A command ran and failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status.
        status: String,
        /// Its stderr, trimmed.
        stderr: String,
    },
    /// A command could not be run.
    #[error("could not run `{command}`")]
    Spawn {
        /// The command line.
        command: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A step on a named network namespace failed.
    #[error("network namespace {name}: {op} failed")]
    Netns {
        /// Namespace name or path.
        name: String,
        /// The step.
        op: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Reading or writing a host file failed.
    #[error("{path}: i/o failed")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The DNS forwarder could not start.
    #[error("dns forwarder: {op} failed")]
    Dns {
        /// The step.
        op: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_with_the_default_pool_and_rejects_unknown_fields() {
        let cfg: NetConfig =
            serde_json::from_str(r#"{"prefix":"fb1a2b","dns_port":5353}"#).unwrap();
        assert_eq!(cfg.pool, Ipv4Pool::default());
        assert!(cfg.sandbox_reach.is_empty());
        assert_eq!(cfg.slot_limits, SlotLimits::default());
        assert!(cfg.validate().is_ok());
        let reach: NetConfig = serde_json::from_str(
            r#"{"prefix":"fb","dns_port":1,"sandbox_reach":["10.200.0.0/24"]}"#,
        )
        .unwrap();
        assert_eq!(reach.sandbox_reach, ["10.200.0.0/24".parse().unwrap()]);
        assert!(
            serde_json::from_str::<NetConfig>(r#"{"prefix":"fb","dns_port":1,"x":1}"#).is_err()
        );
        let bad: NetConfig = serde_json::from_str(r#"{"prefix":"FB","dns_port":1}"#).unwrap();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn slot_limits_default_per_field_and_refuse_a_zero_connection_cap() {
        assert_eq!(
            SlotLimits::default(),
            SlotLimits {
                max_connections: 1024,
                new_connections_per_second: 500,
                new_connections_burst: 1024,
            }
        );
        let cfg: NetConfig = serde_json::from_str(
            r#"{"prefix":"fb","dns_port":1,"slot_limits":{"max_connections":8}}"#,
        )
        .unwrap();
        assert_eq!(
            cfg.slot_limits,
            SlotLimits {
                max_connections: 8,
                ..SlotLimits::default()
            }
        );
        assert!(cfg.validate().is_ok());
        let off = SlotLimits {
            new_connections_per_second: 0,
            new_connections_burst: 0,
            ..SlotLimits::default()
        };
        assert!(off.validate().is_ok(), "no rate limit");
        for bad in [
            SlotLimits {
                max_connections: 0,
                ..SlotLimits::default()
            },
            SlotLimits {
                new_connections_burst: 0,
                ..SlotLimits::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(
            serde_json::from_str::<SlotLimits>(r#"{"max_connection":8}"#).is_err(),
            "unknown field"
        );
    }
}
