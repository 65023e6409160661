//! The default route of a slot's namespace, set and removed over rtnetlink from a thread that
//! entered the namespace: what `ip -netns NAME route replace default via GW dev IF` does,
//! without starting a process (a claim changes it on the create path, where ten concurrent
//! `ip` processes cost each create tens of milliseconds on a small machine).

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

// rtnetlink constants (linux/rtnetlink.h, linux/netlink.h).
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_NOWHERE: u8 = 255;
const RTN_UNICAST: u8 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;

/// The change to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultRoute<'a> {
    /// Replace (or add) the default route via `gateway` on interface `ifname`.
    Via { gateway: Ipv4Addr, ifname: &'a str },
    /// Remove the default route; absent is fine.
    None,
}

/// Applies `route` in the network namespace at `netns`.
pub fn set_default_route(netns: &Path, route: DefaultRoute<'_>) -> io::Result<()> {
    let netns = std::fs::File::open(netns)?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns on a descriptor we own; only this thread changes namespace,
                // and it ends with the scope.
                if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
                    return Err(io::Error::last_os_error());
                }
                let message = match route {
                    DefaultRoute::Via { gateway, ifname } => {
                        replace_message(gateway, ifindex(ifname)?)
                    }
                    DefaultRoute::None => delete_message(),
                };
                match request(&message) {
                    Err(e)
                        if route == DefaultRoute::None && e.raw_os_error() == Some(libc::ESRCH) =>
                    {
                        Ok(())
                    }
                    other => other,
                }
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("route thread panicked")))
    })
}

fn ifindex(name: &str) -> io::Result<u32> {
    let c = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name; the call reads it only.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        index => Ok(index),
    }
}

/// `nlmsghdr` + `rtmsg` + attributes.
fn message(kind: u16, flags: u16, scope: u8, rtype: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(&0u32.to_ne_bytes()); // length, set below
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    // rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
    let protocol = if kind == RTM_NEWROUTE { RTPROT_BOOT } else { 0 };
    m.extend_from_slice(&[
        libc::AF_INET as u8,
        0,
        0,
        0,
        RT_TABLE_MAIN,
        protocol,
        scope,
        rtype,
    ]);
    m.extend_from_slice(&0u32.to_ne_bytes());
    for (kind, value) in attrs {
        let len = 4 + value.len();
        m.extend_from_slice(&(len as u16).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(value);
        m.resize(m.len().next_multiple_of(4), 0);
    }
    let len = m.len() as u32;
    m[..4].copy_from_slice(&len.to_ne_bytes());
    m
}

fn replace_message(gateway: Ipv4Addr, ifindex: u32) -> Vec<u8> {
    message(
        RTM_NEWROUTE,
        NLM_F_CREATE | NLM_F_REPLACE,
        RT_SCOPE_UNIVERSE,
        RTN_UNICAST,
        &[
            (RTA_GATEWAY, &gateway.octets()),
            (RTA_OIF, &ifindex.to_ne_bytes()),
        ],
    )
}

fn delete_message() -> Vec<u8> {
    message(RTM_DELROUTE, 0, RT_SCOPE_NOWHERE, 0, &[])
}

/// Sends one request on a new NETLINK_ROUTE socket and reads its acknowledgement.
fn request(message: &[u8]) -> io::Result<()> {
    // SAFETY: plain socket(2); the descriptor is owned right away.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: a zeroed sockaddr_nl addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: the buffer and address are valid for the call.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            message.as_ptr().cast(),
            message.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut reply = [0u8; 1024];
    // SAFETY: the buffer is valid for its length.
    let n = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            reply.as_mut_ptr().cast(),
            reply.len(),
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    ack_of(&reply[..n as usize])
}

/// The `NLMSG_ERROR` acknowledgement: error 0 is success.
fn ack_of(reply: &[u8]) -> io::Result<()> {
    if reply.len() < 20 {
        return Err(io::Error::other("short netlink reply"));
    }
    let kind = u16::from_ne_bytes([reply[4], reply[5]]);
    if kind != NLMSG_ERROR {
        return Err(io::Error::other(format!(
            "unexpected netlink reply type {kind}"
        )));
    }
    match i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]) {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_messages_carry_gateway_and_interface_aligned() {
        let m = replace_message(Ipv4Addr::new(10, 0, 0, 1), 7);
        assert_eq!(m.len(), 16 + 12 + 8 + 8);
        assert_eq!(
            u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(u16::from_ne_bytes([m[4], m[5]]), RTM_NEWROUTE);
        let flags = u16::from_ne_bytes([m[6], m[7]]);
        assert_eq!(
            flags,
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE
        );
        assert_eq!(m[16], libc::AF_INET as u8);
        assert_eq!(m[20], RT_TABLE_MAIN);
        assert_eq!(&m[28..36], &[8, 0, 5, 0, 10, 0, 0, 1]);
        assert_eq!(&m[36..40], &[8, 0, 4, 0]);
        assert_eq!(u32::from_ne_bytes(m[40..44].try_into().unwrap()), 7);
    }

    #[test]
    fn acknowledgements_map_to_errors() {
        let mut ack = vec![0u8; 36];
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert!(ack_of(&ack).is_ok());
        ack[16..20].copy_from_slice(&(-libc::ESRCH).to_ne_bytes());
        assert_eq!(ack_of(&ack).unwrap_err().raw_os_error(), Some(libc::ESRCH));
        assert!(ack_of(&ack[..8]).is_err());
    }
}
