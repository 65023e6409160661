//! The kernel seam of the network module: subprocesses (`ip`, `nft`), named namespaces,
//! host sysctls and interface listing. [`RealNetSys`] does the real thing; unit tests use
//! a recording fake, so the order of operations and the clean-up on failure are tested
//! without root.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::route::DefaultRoute;
use super::{NetError, netns};

/// What the network module asks of the host.
pub trait NetSys: Send + Sync {
    /// Runs `program args..` with `stdin` piped in; returns stdout, or
    /// [`NetError::Command`] with stderr when it exits non-zero.
    fn run(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError>;
    /// Creates the named netns (IPv6 off inside); returns its path.
    fn create_netns(&self, name: &str) -> Result<PathBuf, NetError>;
    /// Removes the named netns; absent is fine.
    fn remove_netns(&self, name: &str) -> Result<(), NetError>;
    /// Whether a netns file (or mount) named `name` exists.
    fn netns_exists(&self, name: &str) -> bool;
    /// Whether the host namespace has an interface `name`.
    fn link_exists(&self, name: &str) -> bool;
    /// Names of the named network namespaces.
    fn list_netns(&self) -> Result<Vec<String>, NetError>;
    /// Names of the network interfaces in the host namespace.
    fn list_links(&self) -> Result<Vec<String>, NetError>;
    /// Writes a `/proc/sys` knob of the host namespace.
    fn write_sysctl(&self, path: &str, value: &str) -> Result<(), NetError>;
    /// Reads a `/proc/sys` knob of the host namespace.
    fn read_sysctl(&self, path: &str) -> Result<String, NetError>;
    /// Sets or removes the default route inside the named netns (an absent route is fine
    /// to remove). By default through `ip`; the real host uses rtnetlink.
    fn set_default_route(&self, netns: &str, route: DefaultRoute<'_>) -> Result<(), NetError> {
        match route {
            DefaultRoute::Via { gateway, ifname } => {
                let gateway = gateway.to_string();
                let args = [
                    "-netns", netns, "route", "replace", "default", "via", &gateway, "dev", ifname,
                ];
                self.run("ip", &args, None).map(drop)
            }
            DefaultRoute::None => self
                .run("ip", &["-netns", netns, "route", "del", "default"], None)
                .map(drop),
        }
    }
}

/// The host itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct RealNetSys;

impl NetSys for RealNetSys {
    fn run(&self, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, NetError> {
        let command = command_line(program, args);
        let spawn_err = |source| NetError::Spawn {
            command: command.clone(),
            source,
        };
        let mut child = Command::new(program)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().expect("stdin is piped");
            // A failed write shows up as the command's own error below.
            let _ = pipe.write_all(input.as_bytes());
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(NetError::Command {
                command,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    fn create_netns(&self, name: &str) -> Result<PathBuf, NetError> {
        netns::create(name)
    }

    fn remove_netns(&self, name: &str) -> Result<(), NetError> {
        netns::remove(name)
    }

    fn netns_exists(&self, name: &str) -> bool {
        netns::netns_path(name).symlink_metadata().is_ok()
    }

    fn link_exists(&self, name: &str) -> bool {
        // Asked of the calling thread's network namespace (an ioctl on a socket there), not
        // of /sys/class/net, which shows the namespace sysfs was mounted in: a node agent run
        // in a namespace of its own would see the host's links there.
        nix::net::if_::if_nametoindex(name).is_ok()
    }

    fn list_links(&self) -> Result<Vec<String>, NetError> {
        // The calling thread's network namespace, as for `link_exists`.
        let path = "/proc/thread-self/net/dev";
        let text = std::fs::read_to_string(path).map_err(|source| NetError::Io {
            path: path.into(),
            source,
        })?;
        let mut names = links_of_net_dev(&text);
        names.sort();
        Ok(names)
    }

    fn list_netns(&self) -> Result<Vec<String>, NetError> {
        netns::list()
    }

    fn write_sysctl(&self, path: &str, value: &str) -> Result<(), NetError> {
        netns::write_sysctl(Path::new(path), value).map_err(|source| NetError::Io {
            path: path.into(),
            source,
        })
    }

    fn read_sysctl(&self, path: &str) -> Result<String, NetError> {
        netns::read_sysctl(Path::new(path)).map_err(|source: io::Error| NetError::Io {
            path: path.into(),
            source,
        })
    }

    fn set_default_route(&self, name: &str, route: DefaultRoute<'_>) -> Result<(), NetError> {
        super::route::set_default_route(&netns::netns_path(name), route).map_err(|source| {
            NetError::Netns {
                name: name.to_string(),
                op: "set the default route",
                source,
            }
        })
    }
}

/// The interface names of a `/proc/net/dev` listing (two header lines, then `name: counters`).
fn links_of_net_dev(text: &str) -> Vec<String> {
    text.lines()
        .skip(2)
        .filter_map(|line| line.split_once(':'))
        .map(|(name, _)| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .collect()
}

/// `program arg1 arg2` for error messages.
pub fn command_line(program: &str, args: &[&str]) -> String {
    std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_listings_give_the_interface_names() {
        let text = "Inter-|   Receive                            |  Transmit\n \
                    face |bytes    packets errs drop fifo frame compressed multicast|bytes\n    \
                    lo:  123 4 0 0 0 0 0 0 123 4 0 0 0 0 0 0\n\
                    fb1-3h: 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        assert_eq!(links_of_net_dev(text), ["lo", "fb1-3h"]);
    }

    #[test]
    fn the_links_listed_are_those_of_this_namespace() {
        let links = RealNetSys.list_links().unwrap();
        assert!(links.iter().any(|l| l == "lo"), "{links:?}");
        assert!(RealNetSys.link_exists("lo"));
        assert!(!RealNetSys.link_exists("fbnosuchlink0"));
    }
}
