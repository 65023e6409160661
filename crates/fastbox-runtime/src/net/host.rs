//! The host side of an instance's network: the nft table, IP forwarding, and slots.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::names::{SANDBOX_IFNAME, owned_by, slot_name};
use super::pool::SLOT_PREFIX_LEN;
use super::route::DefaultRoute;
use super::sys::{NetSys, RealNetSys};
use super::{NetConfig, NetError, netns, nft};

/// Host-wide IPv4 forwarding switch. Turned on, never off: other instances and other
/// software may rely on it.
pub const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// One instance's network on this host. Dropping it changes nothing on the host (slots
/// and rules outlive a restart of the process); [`HostNetwork::teardown`] removes it all.
pub struct HostNetwork {
    cfg: NetConfig,
    sys: Arc<dyn NetSys>,
}

/// A network slot: a named netns with `eth0` inside, wired by a veth to the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetSlot {
    /// Slot index in the pool.
    pub index: u32,
    /// Netns name (`{prefix}-{index base 36}`), also the host end of the veth.
    pub name: String,
    /// The netns file to open and `setns(CLONE_NEWNET)` into: `/run/netns/{name}`.
    pub netns_path: PathBuf,
    /// Host end of the veth, in the host netns.
    pub host_if: String,
    /// The sandbox's address on `eth0`.
    pub address: Ipv4Addr,
    /// The host end's address: default gateway and DNS server of the sandbox.
    pub gateway: Ipv4Addr,
    /// Prefix length of the link (31).
    pub prefix_len: u8,
}

/// Host objects carrying an instance prefix (see [`super::names::owned_by`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// Named network namespaces (files or mounts under `/run/netns`).
    pub netns: Vec<String>,
    /// Interfaces in the host namespace.
    pub links: Vec<String>,
    /// nft tables, as `family name`.
    pub nft_tables: Vec<String>,
}

impl Leftovers {
    /// Nothing left.
    pub fn is_empty(&self) -> bool {
        self.netns.is_empty() && self.links.is_empty() && self.nft_tables.is_empty()
    }
}

impl fmt::Display for Leftovers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "netns {:?}, links {:?}, nft tables {:?}",
            self.netns, self.links, self.nft_tables
        )
    }
}

impl NetSlot {
    /// `resolv.conf` for the sandbox: the gateway, where the DNS redirect waits.
    pub fn resolv_conf(&self) -> String {
        resolv_conf_for(self)
    }

    /// Inode of the slot's netns, for CRIU's `--external net[<inode>]:<key>`.
    pub fn netns_inode(&self) -> Result<u64, NetError> {
        netns::netns_inode(&self.netns_path)
    }
}

/// `resolv.conf` for a sandbox in `slot`.
pub fn resolv_conf_for(slot: &NetSlot) -> String {
    format!("nameserver {}\n", slot.gateway)
}

impl HostNetwork {
    /// Validates `cfg`, turns on IPv4 forwarding and (re)installs the instance's nft table
    /// atomically. `cfg.dns_port` must be the port of a running
    /// [`super::DnsForwarder`]. Existing slots of the instance are kept.
    pub fn try_new(cfg: NetConfig) -> Result<Self, NetError> {
        Self::with_sys(cfg, Arc::new(RealNetSys))
    }

    /// [`HostNetwork::try_new`] over another kernel seam (tests).
    pub fn with_sys(cfg: NetConfig, sys: Arc<dyn NetSys>) -> Result<Self, NetError> {
        cfg.validate()?;
        if cfg.dns_port == 0 {
            return Err(NetError::InvalidConfig(
                "dns_port must be the DNS forwarder's port, not 0".into(),
            ));
        }
        if sys.read_sysctl(IP_FORWARD)? != "1" {
            sys.write_sysctl(IP_FORWARD, "1")?;
        }
        sys.run("nft", &["-f", "-"], Some(&nft::install_script(&cfg)))?;
        tracing::debug!(prefix = %cfg.prefix, pool = %cfg.pool, dns_port = cfg.dns_port, sandbox_reach = ?cfg.sandbox_reach, "host network ready");
        Ok(Self { cfg, sys })
    }

    /// The configuration in force.
    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// Describes slot `index` (names, addresses) without touching the host.
    pub fn slot(&self, index: u32) -> Result<NetSlot, NetError> {
        let addrs = self.cfg.pool.slot(index)?;
        let name = slot_name(&self.cfg.prefix, index);
        Ok(NetSlot {
            index,
            netns_path: netns::netns_path(&name),
            host_if: name.clone(),
            name,
            address: addrs.address,
            gateway: addrs.gateway,
            prefix_len: SLOT_PREFIX_LEN,
        })
    }

    /// Creates slot `index`: netns (IPv6 off, `lo` up), veth (`eth0` inside, host end
    /// outside, IPv6 off on both), addresses and the default route. Fails with
    /// [`NetError::SlotExists`] if any piece of the slot exists, touching nothing; on any
    /// other failure removes what it made.
    pub fn create_slot(&self, index: u32) -> Result<NetSlot, NetError> {
        let slot = self.slot(index)?;
        let started = Instant::now();
        if self.sys.netns_exists(&slot.name) || self.sys.link_exists(&slot.host_if) {
            return Err(NetError::SlotExists { name: slot.name });
        }
        if let Err(error) = self.wire(&slot) {
            if let Err(cleanup) = self.destroy_slot(&slot) {
                tracing::warn!(slot = %slot.name, error = %cleanup, "clean-up after a failed create failed");
            }
            return Err(error);
        }
        tracing::debug!(slot = %slot.name, address = %slot.address, elapsed_us = started.elapsed().as_micros() as u64, "slot created");
        Ok(slot)
    }

    fn wire(&self, slot: &NetSlot) -> Result<(), NetError> {
        let NetSlot {
            name,
            host_if,
            address,
            gateway,
            prefix_len,
            ..
        } = slot;
        self.sys.create_netns(name)?;
        // addrgenmode none: no IPv6 link-local address before IPv6 is switched off.
        let host = format!(
            "link add {host_if} type veth peer name {SANDBOX_IFNAME} netns {name}\n\
             link set {host_if} addrgenmode none\n\
             addr add {gateway}/{prefix_len} dev {host_if}\n\
             link set {host_if} up\n"
        );
        self.sys.run("ip", &["-batch", "-"], Some(&host))?;
        self.disable_host_ipv6(host_if)?;
        let inside = format!(
            "link set lo up\n\
             addr add {address}/{prefix_len} dev {SANDBOX_IFNAME}\n\
             link set {SANDBOX_IFNAME} up\n\
             route add default via {gateway} dev {SANDBOX_IFNAME}\n"
        );
        self.sys
            .run("ip", &["-netns", name, "-batch", "-"], Some(&inside))?;
        Ok(())
    }

    fn disable_host_ipv6(&self, host_if: &str) -> Result<(), NetError> {
        match self.sys.write_sysctl(
            &format!("/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6"),
            "1",
        ) {
            // No IPv6 on the host at all.
            Err(NetError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                Ok(())
            }
            other => other,
        }
    }

    /// Cuts the slot's sandbox off from everything but its own link (pooled sandboxes, until
    /// they are claimed): its default route goes. The host still reaches it on the /31, and
    /// nothing inside can put the route back (sandboxes have no `CAP_NET_ADMIN`).
    pub fn deny_egress(&self, slot: &NetSlot) -> Result<(), NetError> {
        self.sys.set_default_route(&slot.name, DefaultRoute::None)
    }

    /// Undoes [`HostNetwork::deny_egress`]: the default route via the gateway again.
    pub fn allow_egress(&self, slot: &NetSlot) -> Result<(), NetError> {
        let route = DefaultRoute::Via {
            gateway: slot.gateway,
            ifname: SANDBOX_IFNAME,
        };
        self.sys.set_default_route(&slot.name, route)
    }

    /// Removes the slot: the veth (both ends) and the netns. Idempotent. Processes still
    /// inside the netns keep it alive (without network) until they exit.
    pub fn destroy_slot(&self, slot: &NetSlot) -> Result<(), NetError> {
        delete_link(self.sys.as_ref(), &slot.host_if)?;
        self.sys.remove_netns(&slot.name)?;
        tracing::debug!(slot = %slot.name, "slot destroyed");
        Ok(())
    }

    /// [`HostNetwork::destroy_slot`] namespace first, for slots whose processes are gone:
    /// the kernel then destroys the veth pair in the background, batched with other
    /// namespaces (about 3 ms of the caller's time instead of about 30 ms for deleting the
    /// link). Returns once the host end is gone, so the slot's index can be reused; deletes
    /// it itself if it outlives [`LINK_GONE_WAIT`].
    pub fn destroy_slot_lazily(&self, slot: &NetSlot) -> Result<(), NetError> {
        self.sys.remove_netns(&slot.name)?;
        let deadline = Instant::now() + LINK_GONE_WAIT;
        while self.sys.link_exists(&slot.host_if) {
            if Instant::now() >= deadline {
                delete_link(self.sys.as_ref(), &slot.host_if)?;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        tracing::debug!(slot = %slot.name, "slot destroyed");
        Ok(())
    }

    /// Removes every slot of the instance, then its nft table (in that order: a slot never
    /// exists without the rules that confine it).
    pub fn teardown(self) -> Result<(), NetError> {
        purge_with(self.sys.as_ref(), &self.cfg.prefix)
    }

    /// What carries `prefix` on this host: for leak checks.
    pub fn leaked(prefix: &str) -> Result<Leftovers, NetError> {
        leaked_with(&RealNetSys, prefix)
    }

    /// Removes everything carrying `prefix` (links, netns, nft tables), e.g. after a crash
    /// or a failed test. Running sandboxes of that instance lose their network.
    pub fn purge(prefix: &str) -> Result<(), NetError> {
        purge_with(&RealNetSys, prefix)
    }
}

/// How long [`HostNetwork::destroy_slot_lazily`] lets the kernel remove a veth.
pub const LINK_GONE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn delete_link(sys: &dyn NetSys, name: &str) -> Result<(), NetError> {
    match sys.run("ip", &["link", "del", name], None) {
        Err(NetError::Command { stderr, .. }) if stderr.contains("Cannot find device") => Ok(()),
        other => other.map(drop),
    }
}

/// [`HostNetwork::leaked`] over a given seam.
pub fn leaked_with(sys: &dyn NetSys, prefix: &str) -> Result<Leftovers, NetError> {
    let owned = |names: Vec<String>| -> Vec<String> {
        names.into_iter().filter(|n| owned_by(prefix, n)).collect()
    };
    let tables = sys.run("nft", &["list", "tables"], None)?;
    let nft_tables = tables
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("table"), Some(family), Some(name)) if owned_by(prefix, name) => {
                    Some(format!("{family} {name}"))
                }
                _ => None,
            }
        })
        .collect();
    Ok(Leftovers {
        netns: owned(sys.list_netns()?),
        links: owned(sys.list_links()?),
        nft_tables,
    })
}

/// [`HostNetwork::purge`] over a given seam.
pub fn purge_with(sys: &dyn NetSys, prefix: &str) -> Result<(), NetError> {
    super::names::validate_prefix(prefix)?;
    let found = leaked_with(sys, prefix)?;
    for link in &found.links {
        delete_link(sys, link)?;
    }
    for ns in &found.netns {
        sys.remove_netns(ns)?;
    }
    for table in &found.nft_tables {
        sys.run(
            "nft",
            &["-f", "-"],
            Some(&format!("delete table {table}\n")),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    use super::*;

    /// Records every call; keeps a tiny model of links, netns and tables.
    #[derive(Default)]
    struct FakeNetSys {
        calls: Mutex<Vec<String>>,
        links: Mutex<BTreeSet<String>>,
        netns: Mutex<BTreeSet<String>>,
        tables: Mutex<BTreeSet<String>>,
        /// A call whose recorded text contains this fails.
        fail_on: Mutex<Option<String>>,
    }

    impl FakeNetSys {
        fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }
        fn record(&self, call: String) -> Result<(), NetError> {
            self.calls.lock().unwrap().push(call.clone());
            match &*self.fail_on.lock().unwrap() {
                Some(pat) if call.contains(pat.as_str()) => Err(NetError::Command {
                    command: call,
                    status: "exit status: 1".into(),
                    stderr: "injected".into(),
                }),
                _ => Ok(()),
            }
        }
    }

    impl NetSys for FakeNetSys {
        fn run(
            &self,
            program: &str,
            args: &[&str],
            stdin: Option<&str>,
        ) -> Result<String, NetError> {
            let line = super::super::sys::command_line(program, args);
            let call = match stdin {
                Some(s) => format!("{line} <<{s}"),
                None => line,
            };
            self.record(call.clone())?;
            match (program, args) {
                ("ip", ["link", "del", name]) => {
                    if self.links.lock().unwrap().remove(*name) {
                        Ok(String::new())
                    } else {
                        Err(NetError::Command {
                            command: call,
                            status: "exit status: 1".into(),
                            stderr: format!("Cannot find device \"{name}\""),
                        })
                    }
                }
                ("ip", ["-batch", "-"]) => {
                    let first = stdin.unwrap().lines().next().unwrap();
                    let name = first.split_whitespace().nth(2).unwrap();
                    self.links.lock().unwrap().insert(name.to_owned());
                    Ok(String::new())
                }
                ("nft", ["list", "tables"]) => Ok(self
                    .tables
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|t| format!("table {t}\n"))
                    .collect()),
                ("nft", ["-f", "-"]) => {
                    let script = stdin.unwrap();
                    let mut tables = self.tables.lock().unwrap();
                    for line in script.lines() {
                        if let Some(t) = line.strip_prefix("delete table ") {
                            tables.remove(t);
                        } else if let Some(t) = line.strip_prefix("table ") {
                            tables.insert(t.trim_end_matches(" {").to_owned());
                        }
                    }
                    Ok(String::new())
                }
                _ => Ok(String::new()),
            }
        }
        fn create_netns(&self, name: &str) -> Result<PathBuf, NetError> {
            self.record(format!("create netns {name}"))?;
            self.netns.lock().unwrap().insert(name.to_owned());
            Ok(netns::netns_path(name))
        }
        fn remove_netns(&self, name: &str) -> Result<(), NetError> {
            self.record(format!("remove netns {name}"))?;
            self.netns.lock().unwrap().remove(name);
            Ok(())
        }
        fn netns_exists(&self, name: &str) -> bool {
            self.netns.lock().unwrap().contains(name)
        }
        fn link_exists(&self, name: &str) -> bool {
            self.links.lock().unwrap().contains(name)
        }
        fn list_netns(&self) -> Result<Vec<String>, NetError> {
            Ok(self.netns.lock().unwrap().iter().cloned().collect())
        }
        fn list_links(&self) -> Result<Vec<String>, NetError> {
            let mut links: Vec<String> = self.links.lock().unwrap().iter().cloned().collect();
            links.push("eth0".into());
            Ok(links)
        }
        fn write_sysctl(&self, path: &str, value: &str) -> Result<(), NetError> {
            self.record(format!("sysctl {path}={value}"))
        }
        fn read_sysctl(&self, _path: &str) -> Result<String, NetError> {
            Ok("0".into())
        }
    }

    fn cfg() -> NetConfig {
        NetConfig {
            prefix: "fbu".into(),
            pool: "10.66.0.0/24".parse().unwrap(),
            dns_port: 5300,
            sandbox_reach: Vec::new(),
            slot_limits: Default::default(),
            credential_proxy_port: None,
        }
    }

    fn host() -> (Arc<FakeNetSys>, HostNetwork) {
        let sys = Arc::new(FakeNetSys::default());
        let host = HostNetwork::with_sys(cfg(), sys.clone()).unwrap();
        sys.calls.lock().unwrap().clear();
        (sys, host)
    }

    #[test]
    fn try_new_enables_forwarding_then_installs_the_table() {
        let sys = Arc::new(FakeNetSys::default());
        HostNetwork::with_sys(cfg(), sys.clone()).unwrap();
        let calls = sys.calls();
        assert_eq!(calls[0], "sysctl /proc/sys/net/ipv4/ip_forward=1");
        assert!(
            calls[1].starts_with(
                "nft -f - <<add table inet fbu\ndelete table inet fbu\ntable inet fbu {"
            )
        );
        assert_eq!(
            sys.tables.lock().unwrap().iter().collect::<Vec<_>>(),
            ["inet fbu"]
        );
    }

    #[test]
    fn try_new_rejects_a_missing_dns_port_and_bad_prefixes() {
        let sys = Arc::new(FakeNetSys::default());
        let mut c = cfg();
        c.dns_port = 0;
        assert!(HostNetwork::with_sys(c, sys.clone()).is_err());
        let mut c = cfg();
        c.prefix = "fb-1".into();
        assert!(HostNetwork::with_sys(c, sys.clone()).is_err());
        assert!(sys.calls().is_empty(), "nothing may run before validation");
    }

    #[test]
    fn create_slot_makes_netns_then_veth_then_configures_inside() {
        let (sys, host) = host();
        let slot = host.create_slot(37).unwrap();
        assert_eq!(slot.name, "fbu-11");
        assert_eq!(slot.host_if, "fbu-11");
        assert_eq!(slot.netns_path, PathBuf::from("/run/netns/fbu-11"));
        assert_eq!(slot.gateway, Ipv4Addr::new(10, 66, 0, 74));
        assert_eq!(slot.address, Ipv4Addr::new(10, 66, 0, 75));
        assert_eq!(slot.resolv_conf(), "nameserver 10.66.0.74\n");
        let calls = sys.calls();
        assert_eq!(calls.len(), 4, "{calls:#?}");
        assert_eq!(calls[0], "create netns fbu-11");
        assert_eq!(
            calls[1],
            "ip -batch - <<link add fbu-11 type veth peer name eth0 netns fbu-11\n\
             link set fbu-11 addrgenmode none\n\
             addr add 10.66.0.74/31 dev fbu-11\n\
             link set fbu-11 up\n"
        );
        assert_eq!(
            calls[2],
            "sysctl /proc/sys/net/ipv6/conf/fbu-11/disable_ipv6=1"
        );
        assert_eq!(
            calls[3],
            "ip -netns fbu-11 -batch - <<link set lo up\n\
             addr add 10.66.0.75/31 dev eth0\n\
             link set eth0 up\n\
             route add default via 10.66.0.74 dev eth0\n"
        );
    }

    #[test]
    fn egress_is_denied_and_allowed_by_the_default_route() {
        let (sys, host) = host();
        let slot = host.slot(3).unwrap();
        host.deny_egress(&slot).unwrap();
        host.allow_egress(&slot).unwrap();
        let calls = sys.calls();
        assert_eq!(calls[calls.len() - 2], "ip -netns fbu-3 route del default");
        assert_eq!(
            calls[calls.len() - 1],
            format!(
                "ip -netns fbu-3 route replace default via {} dev eth0",
                slot.gateway
            )
        );
    }

    #[test]
    fn create_slot_failure_removes_what_it_made() {
        let (sys, host) = host();
        *sys.fail_on.lock().unwrap() = Some("-netns fbu-2".into());
        let err = host.create_slot(2).unwrap_err();
        assert!(matches!(err, NetError::Command { .. }), "{err}");
        let calls = sys.calls();
        assert_eq!(calls[calls.len() - 2], "ip link del fbu-2");
        assert_eq!(calls[calls.len() - 1], "remove netns fbu-2");
        assert!(leaked_with(sys.as_ref(), "fbu").unwrap().links.is_empty());
        assert!(leaked_with(sys.as_ref(), "fbu").unwrap().netns.is_empty());
    }

    #[test]
    fn create_slot_on_an_existing_slot_fails_and_leaves_it_alone() {
        let (sys, host) = host();
        host.create_slot(1).unwrap();
        sys.calls.lock().unwrap().clear();
        assert!(matches!(
            host.create_slot(1),
            Err(NetError::SlotExists { .. })
        ));
        assert!(sys.calls().is_empty(), "{:#?}", sys.calls());
    }

    #[test]
    fn create_slot_outside_the_pool_fails_before_touching_the_host() {
        let (sys, host) = host();
        assert!(matches!(
            host.create_slot(128),
            Err(NetError::Addr(
                fastbox_api::net::AddrError::IndexOutOfPool { .. }
            ))
        ));
        assert!(sys.calls().is_empty());
    }

    #[test]
    fn lazy_destroy_removes_the_namespace_and_deletes_a_lingering_link() {
        let (sys, host) = host();
        let slot = host.create_slot(2).unwrap();
        sys.calls.lock().unwrap().clear();
        // The fake never removes the link with the namespace: the wait runs out.
        host.destroy_slot_lazily(&slot).unwrap();
        let calls = sys.calls();
        assert_eq!(calls[0], "remove netns fbu-2");
        assert_eq!(calls.last().unwrap(), "ip link del fbu-2");
    }

    #[test]
    fn destroy_slot_is_idempotent() {
        let (_sys, host) = host();
        let slot = host.create_slot(0).unwrap();
        host.destroy_slot(&slot).unwrap();
        host.destroy_slot(&slot).unwrap();
    }

    #[test]
    fn teardown_removes_slots_before_the_table_and_only_owned_names() {
        let (sys, host) = host();
        host.create_slot(0).unwrap();
        host.create_slot(1).unwrap();
        sys.links.lock().unwrap().insert("fbu1-0".into()); // another instance
        sys.tables.lock().unwrap().insert("inet fbu1".into());
        sys.calls.lock().unwrap().clear();
        host.teardown().unwrap();
        let calls = sys.calls();
        let table_at = calls
            .iter()
            .position(|c| c.contains("delete table inet fbu\n"))
            .unwrap();
        let last_link = calls
            .iter()
            .rposition(|c| c.starts_with("ip link del"))
            .unwrap();
        assert!(last_link < table_at, "{calls:#?}");
        assert!(leaked_with(sys.as_ref(), "fbu").unwrap().is_empty());
        let other = leaked_with(sys.as_ref(), "fbu1").unwrap();
        assert_eq!(other.links, ["fbu1-0"]);
        assert_eq!(other.nft_tables, ["inet fbu1"]);
    }
}
