//! A scenario's network on one machine (`verify p2p`, `verify cluster`): one bridge on the
//! host holding the host's address (the origin's, the server's), one network namespace per
//! node (its "host"), and optionally a test host, each joined to the bridge by a veth pair.
//! Every name starts with the run's prefix (`<prefix>-br`, `<prefix>-n<i>` for a node's
//! namespace, `<prefix>-t` for the test host's, `<ns>h` and `<ns>c` for the veth ends), so
//! a leak check by prefix finds them all ([`leftovers`]).
//!
//! Addresses come from `<base>.0.0/16`: the bridge is `<base>.0.1/24`, node `i` is
//! `<base>.0.<2+i>/24`, the test host `<base>.0.254/24`, and node `i`'s sandboxes take
//! `<base>.<1+i>.0/24`.

use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

use anyhow::{Context, bail};

/// The bridge, the namespaces and the veths of one run.
pub struct ScenarioNet {
    prefix: String,
    base: [u8; 2],
    nodes: usize,
    test_host: bool,
}

impl ScenarioNet {
    /// Creates the bridge and `nodes` namespaces. On failure, whatever was made is removed.
    pub fn create(prefix: &str, base: [u8; 2], nodes: usize) -> anyhow::Result<Self> {
        Self::build_all(prefix, base, nodes, false)
    }

    /// The same, with a test host ([`ScenarioNet::test_host_ip`]) on the bridge too.
    pub fn create_with_test_host(
        prefix: &str,
        base: [u8; 2],
        nodes: usize,
    ) -> anyhow::Result<Self> {
        Self::build_all(prefix, base, nodes, true)
    }

    fn build_all(
        prefix: &str,
        base: [u8; 2],
        nodes: usize,
        test_host: bool,
    ) -> anyhow::Result<Self> {
        let net = Self {
            prefix: prefix.to_string(),
            base,
            nodes,
            test_host,
        };
        if let Err(e) = net.build() {
            net.remove();
            return Err(e);
        }
        Ok(net)
    }

    fn build(&self) -> anyhow::Result<()> {
        let br = self.bridge();
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", self.origin_ip()),
            "dev",
            &br,
        ])?;
        ip(&["link", "set", &br, "up"])?;
        for (ns, addr) in self.hosts() {
            let (host, inner) = (format!("{ns}h"), format!("{ns}c"));
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &host, "type", "veth", "peer", "name", &inner])?;
            ip(&["link", "set", &host, "master", &br, "up"])?;
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    /// Every namespace of the run and its address on the bridge.
    fn hosts(&self) -> Vec<(String, Ipv4Addr)> {
        let mut hosts: Vec<_> = (0..self.nodes)
            .map(|i| (self.netns(i), self.node_ip(i)))
            .collect();
        if self.test_host {
            hosts.push((self.test_netns(), self.test_host_ip()));
        }
        hosts
    }

    /// The test host's address (with [`ScenarioNet::create_with_test_host`]).
    pub fn test_host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.base[0], self.base[1], 0, 254)
    }

    /// The test host's network namespace.
    pub fn test_netns(&self) -> String {
        format!("{}-t", self.prefix)
    }

    /// Cuts node `i` off from `peer` both ways (an nft table in the node's namespace drops
    /// every packet between them; the rest of the bridge stays reachable), or, with `cut`
    /// false, mends it.
    pub fn partition(&self, i: usize, peer: Ipv4Addr, cut: bool) -> anyhow::Result<()> {
        self.cut_with(
            i,
            &format!("ip saddr {peer} drop;"),
            &format!("ip daddr {peer} drop;"),
            cut,
        )
    }

    /// Cuts node `i`'s link (every packet in or out of its namespace but loopback's is
    /// dropped), or, with `cut` false, mends it.
    pub fn isolate(&self, i: usize, cut: bool) -> anyhow::Result<()> {
        self.cut_with(
            i,
            r#"iifname != "lo" drop;"#,
            r#"oifname != "lo" drop;"#,
            cut,
        )
    }

    /// An nft table in node `i`'s namespace with rule `inbound` on input and `outbound` on
    /// output, or with `cut` false, none.
    fn cut_with(&self, i: usize, inbound: &str, outbound: &str, cut: bool) -> anyhow::Result<()> {
        let table = format!("{}-cut", self.prefix);
        let script = match cut {
            true => format!(
                "table ip {table} {{\n\
                 chain in {{ type filter hook input priority -300; {inbound} }}\n\
                 chain out {{ type filter hook output priority -300; {outbound} }}\n\
                 }}\n"
            ),
            false => format!("delete table ip {table}\n"),
        };
        let mut nft = Command::new("nft");
        nft.args(["-f", "-"]);
        enter(&self.netns(i), &mut nft)?;
        let mut child = nft
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("run nft")?;
        std::io::Write::write_all(
            &mut child.stdin.take().context("nft's stdin")?,
            script.as_bytes(),
        )?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "nft in {}: {}",
                self.netns(i),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// The bridge's (and so the origin's) address.
    pub fn origin_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.base[0], self.base[1], 0, 1)
    }

    /// Node `i`'s address.
    pub fn node_ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(self.base[0], self.base[1], 0, 2 + i as u8)
    }

    /// Node `i`'s sandbox address pool.
    pub fn sandbox_pool(&self, i: usize) -> String {
        format!("{}.{}.{}.0/24", self.base[0], self.base[1], 1 + i)
    }

    /// The sandbox address pool of the run's template build.
    pub fn builder_pool(&self) -> String {
        format!("{}.{}.99.0/24", self.base[0], self.base[1])
    }

    /// Node `i`'s network namespace.
    pub fn netns(&self, i: usize) -> String {
        format!("{}-n{i}", self.prefix)
    }

    fn bridge(&self) -> String {
        format!("{}-br", self.prefix)
    }

    /// Makes `cmd` start in node `i`'s network namespace (and nothing else changed: the mount
    /// namespace stays the host's, so cgroups and mounts are the host's, as for a real node).
    pub fn enter(&self, i: usize, cmd: &mut Command) -> anyhow::Result<()> {
        enter(&self.netns(i), cmd)
    }

    /// Removes the namespaces (their veth ends go with them), the host ends and the bridge.
    pub fn remove(&self) {
        for (ns, _) in self.hosts() {
            let _ = ip(&["link", "del", &format!("{ns}h")]);
            let _ = ip(&["netns", "del", &ns]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

/// Makes `cmd` start in network namespace `netns` (named under `/run/netns`), nothing else
/// changed: the mount namespace stays the host's, so cgroups and mounts are the host's.
pub fn enter(netns: &str, cmd: &mut Command) -> anyhow::Result<()> {
    let path = format!("/run/netns/{netns}");
    let ns = File::open(&path).with_context(|| format!("open {path}"))?;
    // SAFETY: the closure runs in the forked child before exec and only calls setns(2),
    // which is async-signal-safe; `ns` is moved into the closure, so its descriptor stays
    // open until then.
    unsafe {
        cmd.pre_exec(move || {
            let fd = BorrowedFd::borrow_raw(ns.as_raw_fd());
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(std::io::Error::from)
        });
    }
    Ok(())
}

/// A port free on `ip` now.
pub fn free_port(ip: Ipv4Addr) -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .with_context(|| format!("find a free port on {ip}"))?
        .port())
}

/// Moves the calling thread into network namespace `netns`: what it binds or connects to
/// afterwards lives there.
pub fn enter_thread(netns: &str) -> anyhow::Result<()> {
    let path = format!("/run/netns/{netns}");
    let ns = File::open(&path).with_context(|| format!("open {path}"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("enter network namespace {netns}"))
}

/// The network namespaces and links whose names start with `prefix-` (a run's).
pub fn leftovers(prefix: &str) -> Vec<String> {
    let mine = |name: &str| name.starts_with(&format!("{prefix}-"));
    let mut found: Vec<String> = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| mine(n))
        .map(|n| format!("netns {n}"))
        .collect();
    found.extend(
        std::fs::read_dir("/sys/class/net")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| mine(n))
            .map(|n| format!("link {n}")),
    );
    found
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
