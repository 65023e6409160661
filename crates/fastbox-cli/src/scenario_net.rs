//! The scenario's network: one bridge on the host holding the origin's address, and one
//! network namespace per node, joined to the bridge by a veth pair. Every name starts with the
//! run's prefix (`<prefix>-br`, `<prefix>-n<i>` for a node's namespace, `<prefix>-n<i>h` and
//! `<prefix>-n<i>c` for its veth ends), so a leak check by prefix finds them all.
//!
//! Addresses come from `<base>.0.0/16`: the bridge is `<base>.0.1/24`, node `i` is
//! `<base>.0.<2+i>/24`, and node `i`'s sandboxes take `<base>.<1+i>.0/24`.

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
}

impl ScenarioNet {
    /// Creates the bridge and `nodes` namespaces. On failure, whatever was made is removed.
    pub fn create(prefix: &str, base: [u8; 2], nodes: usize) -> anyhow::Result<Self> {
        let net = Self {
            prefix: prefix.to_string(),
            base,
            nodes,
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
        for i in 0..self.nodes {
            let ns = self.netns(i);
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
                &format!("{}/24", self.node_ip(i)),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
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
        let path = format!("/run/netns/{}", self.netns(i));
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

    /// Removes the namespaces (their veth ends go with them), the host ends and the bridge.
    pub fn remove(&self) {
        for i in 0..self.nodes {
            let ns = self.netns(i);
            let _ = ip(&["link", "del", &format!("{ns}h")]);
            let _ = ip(&["netns", "del", &ns]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
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
