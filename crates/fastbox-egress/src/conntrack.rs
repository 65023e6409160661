//! Connection tracking entries of a slot, through the `conntrack` tool (conntrack-tools).
//!
//! The instance table accepts established traffic before any policy is consulted, so a
//! policy change only reaches open connections when their entries go: the enforcer lists
//! the slot's entries (original source = the slot's address) and deletes those to
//! destinations the new policy denies. A deleted TCP entry turns the connection's next
//! packet into a new one, which the slot's chain then drops.
//!
//! Entries outlive the slot's veth (an established TCP entry lives for days), so a released
//! slot's entries are all deleted ([`forget_address`]): the next sandbox given the address
//! must not inherit a flow that skips its policy.

use std::net::Ipv4Addr;

use fastbox_runtime::net::{Ipv4Net, NetError, NetSys};

/// The tool.
pub const CONNTRACK: &str = "conntrack";

/// What failed.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// The tool is not installed.
    #[error(
        "`conntrack` is not installed (the Debian package `conntrack`; scripts/setup.sh installs it): egress policy changes could not cut open connections"
    )]
    Missing,
    /// The tool ran and failed.
    #[error("conntrack failed")]
    Command(#[source] NetError),
}

/// One tracked connection, in its original direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flow {
    /// `tcp`, `udp`, `icmp`, ...
    pub proto: String,
    /// Where the slot sent it.
    pub dst: Ipv4Addr,
    /// The destination port, for protocols with ports.
    pub dport: Option<u16>,
}

/// Fails with [`ConntrackError::Missing`] unless the tool runs.
pub fn check_installed(sys: &dyn NetSys) -> Result<(), ConntrackError> {
    run(sys, &["--version"]).map(drop)
}

/// The IPv4 connections whose original source is `src`.
pub fn flows_from(sys: &dyn NetSys, src: Ipv4Addr) -> Result<Vec<Flow>, ConntrackError> {
    let out = run(sys, &["-L", "-f", "ipv4", "-s", &src.to_string()])?;
    Ok(parse_flows(&out))
}

/// Deletes every entry from `src` to `dst`; none left to delete is not an error.
pub fn delete(sys: &dyn NetSys, src: Ipv4Addr, dst: Ipv4Addr) -> Result<(), ConntrackError> {
    let args = [
        "-D",
        "-f",
        "ipv4",
        "-s",
        &src.to_string(),
        "-d",
        &dst.to_string(),
    ];
    delete_matching(sys, &args)
}

/// Deletes every IPv4 entry whose original source or original destination is `addr`: the
/// flows a slot's sandbox opened (outbound, and DNS redirected to the forwarder) and those
/// opened to it (the node proxy's). None to delete is not an error.
pub fn forget_address(sys: &dyn NetSys, addr: Ipv4Addr) -> Result<(), ConntrackError> {
    let addr = addr.to_string();
    for direction in ["-s", "-d"] {
        delete_matching(sys, &["-D", "-f", "ipv4", direction, &addr])?;
    }
    Ok(())
}

/// [`forget_address`] for every address of `net` (an instance's whole pool, when it goes).
pub fn forget_network(sys: &dyn NetSys, net: Ipv4Net) -> Result<(), ConntrackError> {
    let net = net.to_string();
    for direction in ["-s", "-d"] {
        delete_matching(sys, &["-D", "-f", "ipv4", direction, &net])?;
    }
    Ok(())
}

fn delete_matching(sys: &dyn NetSys, args: &[&str]) -> Result<(), ConntrackError> {
    match run(sys, args) {
        // conntrack exits 1 when it deleted nothing (the connection ended meanwhile).
        Err(ConntrackError::Command(NetError::Command { stderr, .. }))
            if stderr.contains("0 flow entries have been deleted") =>
        {
            Ok(())
        }
        other => other.map(drop),
    }
}

fn run(sys: &dyn NetSys, args: &[&str]) -> Result<String, ConntrackError> {
    sys.run(CONNTRACK, args, None).map_err(|e| match e {
        NetError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            ConntrackError::Missing
        }
        other => ConntrackError::Command(other),
    })
}

/// Entries in `conntrack -L` text form: `tcp 6 431999 ESTABLISHED src=.. dst=.. sport=..
/// dport=.. src=.. ..`; the first `dst=` and `dport=` are the original direction's.
pub fn parse_flows(text: &str) -> Vec<Flow> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let proto = words.next()?.to_owned();
            let mut dst = None;
            let mut dport = None;
            for word in words {
                match word.split_once('=') {
                    Some(("dst", v)) if dst.is_none() => dst = v.parse().ok(),
                    Some(("dport", v)) if dport.is_none() => dport = v.parse().ok(),
                    _ => {}
                }
            }
            Some(Flow {
                proto,
                dst: dst?,
                dport,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flows_are_read_in_their_original_direction() {
        let text = "\
tcp      6 431999 ESTABLISHED src=10.66.0.1 dst=198.51.100.7 sport=40000 dport=80 src=198.51.100.7 dst=10.0.0.2 sport=80 dport=40000 [ASSURED] mark=0 use=1
udp      17 29 src=10.66.0.1 dst=192.0.2.53 sport=5353 dport=53 [UNREPLIED] src=10.66.0.0 dst=10.66.0.1 sport=40053 dport=5353 mark=0 use=1
icmp     1 29 src=10.66.0.1 dst=203.0.113.9 type=8 code=0 id=7 src=203.0.113.9 dst=10.0.0.2 type=0 code=0 id=7 mark=0 use=1
garbage line
";
        let flows = parse_flows(text);
        assert_eq!(
            flows,
            [
                Flow {
                    proto: "tcp".into(),
                    dst: Ipv4Addr::new(198, 51, 100, 7),
                    dport: Some(80)
                },
                Flow {
                    proto: "udp".into(),
                    dst: Ipv4Addr::new(192, 0, 2, 53),
                    dport: Some(53)
                },
                Flow {
                    proto: "icmp".into(),
                    dst: Ipv4Addr::new(203, 0, 113, 9),
                    dport: None
                },
            ]
        );
    }
}
