//! Real connection attempts and DNS queries from inside a network namespace (a slot's), each
//! on a fresh thread that joins the namespace and exits ([`in_netns`]). Sockets keep the
//! namespace they were made in, so a returned stream is used from any thread.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::time::Duration;

use fastbox_runtime::net::dns_forwarder::message;
use fastbox_runtime::net::in_netns;

use super::dns_server::a_query;

/// How long a connection attempt may take before we call it silently dropped (a handshake
/// over a veth takes well under a millisecond).
pub const DROP_TIMEOUT: Duration = Duration::from_millis(700);

/// How long a read from a connected server may take (generous: a loaded machine may be
/// slow to schedule the server's thread; a dropped connection is told apart by the read
/// failing at all).
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a DNS query may take (the forwarder may wait on an upstream).
pub const DNS_TIMEOUT: Duration = Duration::from_secs(3);

/// The outcome of a TCP connection attempt.
#[derive(Debug)]
pub enum Reach {
    /// The handshake completed.
    Connected(TcpStream),
    /// Nothing came back within [`DROP_TIMEOUT`]: a firewall drop.
    Dropped,
    /// Anything else (refused, unreachable, ...).
    Failed(io::Error),
}

impl Reach {
    /// Whether the handshake completed.
    pub fn is_connected(&self) -> bool {
        matches!(self, Reach::Connected(_))
    }

    /// Whether the attempt was silently dropped.
    pub fn is_dropped(&self) -> bool {
        matches!(self, Reach::Dropped)
    }

    /// The stream; panics with `what` and the outcome otherwise.
    #[track_caller]
    pub fn stream(self, what: &str) -> TcpStream {
        match self {
            Reach::Connected(s) => s,
            other => panic!("{what}: expected a connection, got {other:?}"),
        }
    }
}

/// A TCP connection attempt to `to` from inside `netns`.
pub fn connect_from(netns: &Path, to: SocketAddr) -> Reach {
    let attempt = in_netns(netns, || TcpStream::connect_timeout(&to, DROP_TIMEOUT));
    match attempt {
        Ok(Ok(stream)) => Reach::Connected(stream),
        Ok(Err(e)) if e.kind() == io::ErrorKind::TimedOut => Reach::Dropped,
        Ok(Err(e)) => Reach::Failed(e),
        Err(e) => Reach::Failed(io::Error::other(e)),
    }
}

/// The first line an echo server sends: the address it was reached at.
pub fn greeting(stream: &mut TcpStream) -> io::Result<String> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while stream.read(&mut byte)? == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    String::from_utf8(line).map_err(io::Error::other)
}

/// Sends `msg` and reads what comes back within [`READ_TIMEOUT`]: the echo, or an error
/// (timed out when the connection's packets are dropped).
pub fn echo(stream: &mut TcpStream, msg: &str) -> io::Result<String> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.write_all(msg.as_bytes())?;
    let mut buf = vec![0u8; msg.len()];
    stream.read_exact(&mut buf)?;
    String::from_utf8(buf).map_err(io::Error::other)
}

/// The outcome of a DNS query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// NOERROR with these A records (possibly none).
    Addresses(Vec<Ipv4Addr>),
    /// Another response code (3 = NXDOMAIN).
    Rcode(u8),
    /// No answer within [`DNS_TIMEOUT`].
    NoReply,
}

impl Resolution {
    /// NXDOMAIN.
    pub const NXDOMAIN: Resolution = Resolution::Rcode(message::NXDOMAIN);
}

/// How a query travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnsTransport {
    /// One datagram each way.
    Udp,
    /// Length-prefixed over a TCP connection.
    Tcp,
}

/// Asks `server` (any address: slots' port-53 traffic is redirected) for `name`'s A
/// records from inside `netns`.
pub fn resolve_from(
    netns: &Path,
    server: SocketAddr,
    name: &str,
    transport: DnsTransport,
) -> Resolution {
    let id = rand_id();
    let query = a_query(id, name);
    let reply = in_netns(netns, || match transport {
        DnsTransport::Udp => ask_udp(server, &query),
        DnsTransport::Tcp => ask_tcp(server, &query),
    });
    match reply {
        Ok(Ok(reply)) if reply.len() >= message::HEADER_LEN && reply[..2] == id.to_be_bytes() => {
            match reply[3] & 0x0f {
                0 => Resolution::Addresses(
                    message::a_records(&reply)
                        .map(|records| records.into_iter().map(|(a, _)| a).collect())
                        .unwrap_or_default(),
                ),
                rcode => Resolution::Rcode(rcode),
            }
        }
        _ => Resolution::NoReply,
    }
}

fn ask_udp(server: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    s.connect(server)?;
    s.set_read_timeout(Some(DNS_TIMEOUT))?;
    s.send(query)?;
    let mut buf = [0u8; 1500];
    let n = s.recv(&mut buf)?;
    Ok(buf[..n].to_vec())
}

fn ask_tcp(server: SocketAddr, query: &[u8]) -> io::Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&server, DNS_TIMEOUT)?;
    s.set_read_timeout(Some(DNS_TIMEOUT))?;
    let mut out = (query.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(query);
    s.write_all(&out)?;
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
    s.read_exact(&mut reply)?;
    Ok(reply)
}

/// A query id that differs between calls.
fn rand_id() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0x5a00);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
