//! A small DNS relay for sandboxes: UDP and TCP on one port, answers from the host's
//! resolvers.
//!
//! Every sandbox's port-53 traffic is redirected here by the instance's nft table
//! (`redirect to :PORT`), so the forwarder must listen on `0.0.0.0`: the redirect rewrites
//! the destination to the gateway address of whichever slot the query came from. The
//! table drops traffic to the port that arrives from anywhere but slots and `lo`.
//!
//! The relay does not cache: it passes each query to the upstreams in order and returns the
//! first answer whose id matches (SERVFAIL when none answers). One thread polls both
//! listening sockets; each UDP query and each TCP connection is handled on its own
//! short-lived thread. Dropping the [`DnsForwarder`] stops it.
//!
//! **Limits.** Every sandbox's DNS lands here, so no client (source address: each sandbox
//! has its own) may take the forwarder from the others ([`limits`]):
//! - at most `max_tcp_per_client` open TCP connections per client (default 16): a new
//!   connection beyond is closed at once;
//! - at most `max_queries_per_client` queries in flight per client, UDP and TCP together
//!   (default 64): a query beyond is answered SERVFAIL at once, without asking an upstream;
//! - at most `max_in_flight` worker threads (UDP queries plus TCP connections) for all
//!   clients together (default 1024): beyond, UDP queries are dropped and new connections
//!   closed;
//! - a TCP client must send each complete query within `tcp_idle` (default 10 s) of the
//!   connection or of its previous answer, however it trickles the bytes, or the connection
//!   is closed; one message is at most 65535 bytes (its 16-bit length prefix).
//!
//! **Name policy.** Without a hook the relay does not parse messages at all. With a
//! [`DnsHook`] (`DnsForwarderConfig::hook`), each query's question is read ([`message`])
//! and the hook decides, by the query's source address (the sandbox's own: the redirect does
//! not change it) and the name, whether it is forwarded or refused with NXDOMAIN (refused
//! names never reach an upstream). Before an answer is returned, the hook sees its A records
//! and TTLs (so egress enforcement can open those addresses first); if it fails, the client
//! gets SERVFAIL instead of addresses it might not reach. The hook may also withhold an
//! answer (egress enforcement does for addresses in the fixed private ranges, against DNS
//! rebinding): the client then gets NOERROR without any record. A query whose question
//! cannot be read as a host name gets FORMERR.

pub mod limits;
pub mod message;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::NetError;
use limits::{Caps, Kind, Limits, Refused};
use message::HEADER_LEN;

/// Largest DNS message (TCP length prefix is 16 bits; EDNS UDP stays below).
const MAX_MESSAGE: usize = 65535;
/// Datagrams read per wake-up before the loop looks at the TCP listener again, so a flood of
/// UDP cannot keep it from accepting connections (and from stopping).
const UDP_BATCH: usize = 256;

/// What the hook says about a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueryVerdict {
    /// Ask the upstreams.
    Forward,
    /// Answer NXDOMAIN without asking anyone.
    Refuse,
}

/// What the hook says about an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerVerdict {
    /// Return the answer as the upstream gave it.
    Pass,
    /// Return NOERROR with no record at all ("no address for this name"): the answer named
    /// addresses the client must not be given.
    Withhold,
}

/// Why a hook could not take an answer in (the client then gets SERVFAIL).
pub type DnsHookError = Box<dyn std::error::Error + Send + Sync>;

/// Per-client name policy, consulted on every query once set (see the module docs). Called
/// from the forwarder's worker threads, concurrently.
pub trait DnsHook: Send + Sync {
    /// Whether `client` may resolve `name` (lower case, no trailing dot).
    fn on_query(&self, client: IpAddr, name: &str) -> QueryVerdict;

    /// The A records (address, TTL in seconds) of the answer to `client`'s query for `name`,
    /// before the answer is returned to it; called for every forwarded answer, also with no
    /// records. [`AnswerVerdict::Withhold`] empties the answer; an error turns it into
    /// SERVFAIL.
    fn on_answer(
        &self,
        client: IpAddr,
        name: &str,
        addresses: &[(Ipv4Addr, u32)],
    ) -> Result<AnswerVerdict, DnsHookError>;
}

/// How to run the forwarder.
#[derive(Clone)]
pub struct DnsForwarderConfig {
    /// Where to listen, UDP and TCP; port 0 picks a free port. Default `0.0.0.0:0`.
    pub listen: SocketAddr,
    /// Resolvers to ask, in order. Default: [`system_upstreams`].
    pub upstreams: Vec<SocketAddr>,
    /// How long to wait for one upstream before trying the next. Default 2 s.
    pub timeout: Duration,
    /// Worker threads, all clients together: UDP queries plus TCP connections served at once.
    /// Beyond, UDP queries are dropped and new TCP connections closed. Default 1024.
    pub max_in_flight: usize,
    /// Open TCP connections of one client (source address); a new one beyond is closed at
    /// once. Default 16.
    pub max_tcp_per_client: usize,
    /// Queries of one client in flight, UDP and TCP together; a query beyond is answered
    /// SERVFAIL at once, without asking an upstream. Default 64.
    pub max_queries_per_client: usize,
    /// How long a TCP client has to send each complete query, counted from the connection or
    /// from its previous answer (idle time and a slowly sent message alike); then the
    /// connection is closed. Default 10 s.
    pub tcp_idle: Duration,
    /// Name policy; `None` (the default) relays every query unread.
    pub hook: Option<Arc<dyn DnsHook>>,
}

impl fmt::Debug for DnsForwarderConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DnsForwarderConfig")
            .field("listen", &self.listen)
            .field("upstreams", &self.upstreams)
            .field("timeout", &self.timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_tcp_per_client", &self.max_tcp_per_client)
            .field("max_queries_per_client", &self.max_queries_per_client)
            .field("tcp_idle", &self.tcp_idle)
            .field("hook", &self.hook.as_ref().map(|_| "set"))
            .finish()
    }
}

impl DnsForwarderConfig {
    /// Listen on `0.0.0.0` on a free port, forwarding to `upstreams`.
    pub fn new(upstreams: Vec<SocketAddr>) -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)),
            upstreams,
            timeout: Duration::from_secs(2),
            max_in_flight: 1024,
            max_tcp_per_client: 16,
            max_queries_per_client: 64,
            tcp_idle: Duration::from_secs(10),
            hook: None,
        }
    }

    /// The same configuration with `hook` deciding names.
    pub fn with_hook(mut self, hook: Arc<dyn DnsHook>) -> Self {
        self.hook = Some(hook);
        self
    }
}

/// A running forwarder. Drop (or [`DnsForwarder::stop`]) stops it.
pub struct DnsForwarder {
    local: SocketAddr,
    /// Closing this wakes the loop, which then exits.
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl DnsForwarder {
    /// Binds UDP and TCP on `cfg.listen` (the same port for both) and starts serving.
    pub fn start(cfg: DnsForwarderConfig) -> Result<Self, NetError> {
        if cfg.upstreams.is_empty() {
            return Err(NetError::InvalidConfig(
                "dns forwarder needs at least one upstream".into(),
            ));
        }
        if cfg.max_in_flight == 0
            || cfg.max_tcp_per_client == 0
            || cfg.max_queries_per_client == 0
            || cfg.tcp_idle.is_zero()
        {
            return Err(NetError::InvalidConfig(
                "dns forwarder limits must be above zero".into(),
            ));
        }
        let (udp, tcp) = bind_pair(cfg.listen)?;
        let local = udp.local_addr().map_err(dns_err("local address"))?;
        udp.set_nonblocking(true)
            .map_err(dns_err("set nonblocking"))?;
        tcp.set_nonblocking(true)
            .map_err(dns_err("set nonblocking"))?;
        let (wake_read, wake_write) =
            nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| dns_err("pipe")(e.into()))?;
        let thread = std::thread::Builder::new()
            .name(format!("dns-fwd-{}", local.port()))
            .spawn(move || serve(Arc::new(udp), tcp, wake_read, Arc::new(cfg)))
            .map_err(dns_err("spawn"))?;
        tracing::debug!(%local, "dns forwarder started");
        Ok(Self {
            local,
            stop: Some(wake_write),
            thread: Some(thread),
        })
    }

    /// The port the nft redirect must target.
    pub fn port(&self) -> u16 {
        self.local.port()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stops serving and waits for the listening thread (in-flight queries finish on their
    /// own within the upstream timeout).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for DnsForwarder {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Nameservers named in resolv.conf text, on port 53. Scoped IPv6 addresses
/// (`fe80::1%eth0`) are skipped: without their zone they are unusable.
pub fn parse_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then_some(())?;
            let ip: std::net::IpAddr = words.next()?.parse().ok()?;
            Some(SocketAddr::new(ip, 53))
        })
        .collect()
}

/// The host's resolvers, from `/etc/resolv.conf`.
pub fn system_upstreams() -> Result<Vec<SocketAddr>, NetError> {
    let path = "/etc/resolv.conf";
    let text = std::fs::read_to_string(path).map_err(|source| NetError::Io {
        path: path.into(),
        source,
    })?;
    Ok(parse_resolv_conf(&text))
}

fn dns_err(op: &'static str) -> impl Fn(io::Error) -> NetError {
    move |source| NetError::Dns { op, source }
}

/// UDP and TCP on one port; with port 0 retries until a port is free for both.
fn bind_pair(listen: SocketAddr) -> Result<(UdpSocket, TcpListener), NetError> {
    let mut attempts = 0;
    loop {
        let udp = UdpSocket::bind(listen).map_err(dns_err("bind udp"))?;
        let port = udp.local_addr().map_err(dns_err("local address"))?.port();
        match TcpListener::bind(SocketAddr::new(listen.ip(), port)) {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e)
                if listen.port() == 0 && e.kind() == io::ErrorKind::AddrInUse && attempts < 20 =>
            {
                attempts += 1;
            }
            Err(e) => return Err(dns_err("bind tcp")(e)),
        }
    }
}

fn serve(udp: Arc<UdpSocket>, tcp: TcpListener, wake: OwnedFd, cfg: Arc<DnsForwarderConfig>) {
    let limits = Limits::new(Caps {
        global: cfg.max_in_flight,
        tcp_per_client: cfg.max_tcp_per_client,
        queries_per_client: cfg.max_queries_per_client,
    });
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let mut fds = [
            PollFd::new(udp.as_fd(), PollFlags::POLLIN),
            PollFd::new(tcp.as_fd(), PollFlags::POLLIN),
            PollFd::new(wake.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(Errno::EINTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "dns forwarder poll failed; stopping");
                return;
            }
        }
        let ready = |fd: &PollFd| fd.revents().is_some_and(|r| !r.is_empty());
        if ready(&fds[2]) {
            return;
        }
        let (udp_ready, tcp_ready) = (ready(&fds[0]), ready(&fds[1]));
        if udp_ready {
            drain_udp(&udp, &mut buf, &limits, &cfg);
        }
        if tcp_ready {
            drain_tcp(&tcp, &limits, &cfg);
        }
    }
}

/// Reads up to [`UDP_BATCH`] datagrams and hands each to a worker, within the limits.
fn drain_udp(
    udp: &Arc<UdpSocket>,
    buf: &mut [u8],
    limits: &Arc<Limits>,
    cfg: &Arc<DnsForwarderConfig>,
) {
    for _ in 0..UDP_BATCH {
        let (len, client) = match udp.recv_from(buf) {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                tracing::debug!(error = %e, "dns udp receive failed");
                return;
            }
        };
        if len < HEADER_LEN {
            continue;
        }
        let permit = match limits.acquire(client.ip(), Kind::UdpQuery) {
            Ok(permit) => permit,
            Err(Refused::Client) => {
                // This client's own budget: tell it at once (the socket does not block; a
                // reply that does not fit is dropped).
                tracing::debug!(%client, "dns client over its query limit; servfail");
                let _ = udp.send_to(&servfail(&buf[..len]), client);
                continue;
            }
            Err(Refused::Global) => {
                tracing::debug!(%client, "dns forwarder busy; query dropped");
                continue;
            }
        };
        let query = buf[..len].to_vec();
        let (udp, cfg) = (udp.clone(), cfg.clone());
        let spawned = std::thread::Builder::new()
            .name("dns-udp".into())
            .spawn(move || {
                let _permit = permit;
                let reply = respond(&query, client.ip(), &cfg, ask_upstreams_udp);
                if let Err(e) = udp.send_to(&reply, client) {
                    tracing::debug!(%client, error = %e, "dns udp reply failed");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "dns forwarder could not spawn a worker");
        }
    }
}

fn drain_tcp(tcp: &TcpListener, limits: &Arc<Limits>, cfg: &Arc<DnsForwarderConfig>) {
    loop {
        let (stream, client) = match tcp.accept() {
            Ok(got) => got,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) => {
                tracing::debug!(error = %e, "dns tcp accept failed");
                return;
            }
        };
        let permit = match limits.acquire(client.ip(), Kind::TcpConnection) {
            Ok(permit) => permit,
            Err(refused) => {
                tracing::debug!(%client, ?refused, "dns tcp connection over the limit; closed");
                drop(stream);
                continue;
            }
        };
        let (cfg, limits) = (cfg.clone(), limits.clone());
        let spawned = std::thread::Builder::new()
            .name("dns-tcp".into())
            .spawn(move || {
                let _permit = permit;
                if let Err(e) = serve_tcp_client(stream, client.ip(), &cfg, &limits) {
                    tracing::debug!(%client, error = %e, "dns tcp client ended");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "dns forwarder could not spawn a worker");
        }
    }
}

/// Serves one TCP client's queries, one at a time, until it closes, falls silent or trickles
/// a message past `tcp_idle`.
fn serve_tcp_client(
    mut stream: TcpStream,
    client: IpAddr,
    cfg: &DnsForwarderConfig,
    limits: &Arc<Limits>,
) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(cfg.tcp_idle))?;
    while let Some(query) = read_framed_by(&mut stream, Instant::now() + cfg.tcp_idle)? {
        if query.len() < HEADER_LEN {
            return Ok(());
        }
        let reply = match limits.acquire(client, Kind::TcpQuery) {
            Ok(_permit) => respond(&query, client, cfg, ask_upstreams_tcp),
            Err(_) => {
                tracing::debug!(%client, "dns client over its query limit; servfail");
                servfail(&query)
            }
        };
        write_framed(&mut stream, &reply)?;
    }
    Ok(())
}

/// The reply to `client`'s `query`: relayed through `ask` (one transport's upstream walk),
/// filtered by the hook when there is one.
fn respond(
    query: &[u8],
    client: IpAddr,
    cfg: &DnsForwarderConfig,
    ask: fn(&[u8], &DnsForwarderConfig) -> Option<Vec<u8>>,
) -> Vec<u8> {
    let Some(hook) = &cfg.hook else {
        return ask(query, cfg).unwrap_or_else(|| servfail(query));
    };
    let question = match message::question(query) {
        Ok(question) => question,
        Err(e) => {
            tracing::debug!(%client, error = %e, "dns query refused: unreadable question");
            return message::format_error(query);
        }
    };
    if hook.on_query(client, &question.name) == QueryVerdict::Refuse {
        tracing::debug!(%client, name = %question.name, "dns query refused by policy");
        return message::reply_with_rcode(query, question.end, message::NXDOMAIN);
    }
    let Some(reply) = ask(query, cfg) else {
        return servfail(query);
    };
    let learned = message::a_records(&reply)
        .map_err(DnsHookError::from)
        .and_then(|addresses| hook.on_answer(client, &question.name, &addresses));
    match learned {
        Ok(AnswerVerdict::Pass) => reply,
        Ok(AnswerVerdict::Withhold) => {
            message::reply_with_rcode(query, question.end, message::NOERROR)
        }
        Err(e) => {
            tracing::warn!(%client, name = %question.name, error = %e, "dns answer withheld (servfail)");
            servfail(query)
        }
    }
}

/// One length-prefixed DNS message, complete by `deadline`, or `None` at a clean end of
/// stream. Times out (`TimedOut`) at the deadline, however slowly the bytes come.
fn read_framed_by(stream: &mut TcpStream, deadline: Instant) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 2];
    if !read_full_by(stream, &mut len, deadline, true)? {
        return Ok(None);
    }
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    read_full_by(stream, &mut msg, deadline, false)?;
    Ok(Some(msg))
}

/// Fills `buf` by `deadline`. `false` when the stream ended before the first byte and
/// `clean_end` allows that; any other early end is `UnexpectedEof`.
fn read_full_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    clean_end: bool,
) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 && clean_end => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::ErrorKind::TimedOut.into());
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn write_framed(stream: &mut impl Write, msg: &[u8]) -> io::Result<()> {
    let len = u16::try_from(msg.len()).map_err(|_| io::Error::other("dns message too long"))?;
    let mut out = Vec::with_capacity(2 + msg.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
    stream.write_all(&out)
}

fn same_id(query: &[u8], reply: &[u8]) -> bool {
    reply.len() >= HEADER_LEN && reply[..2] == query[..2]
}

fn ask_upstreams_udp(query: &[u8], cfg: &DnsForwarderConfig) -> Option<Vec<u8>> {
    cfg.upstreams
        .iter()
        .find_map(|&upstream| match ask_udp(query, upstream, cfg.timeout) {
            Ok(reply) => Some(reply),
            Err(e) => {
                tracing::debug!(%upstream, error = %e, "dns upstream (udp) failed");
                None
            }
        })
}

fn ask_udp(query: &[u8], upstream: SocketAddr, timeout: Duration) -> io::Result<Vec<u8>> {
    let local: SocketAddr = match upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(local)?;
    sock.connect(upstream)?;
    sock.send(query)?;
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        sock.set_read_timeout(Some(left))?;
        let len = sock.recv(&mut buf)?;
        if same_id(query, &buf[..len]) {
            buf.truncate(len);
            return Ok(buf);
        }
    }
}

fn ask_upstreams_tcp(query: &[u8], cfg: &DnsForwarderConfig) -> Option<Vec<u8>> {
    cfg.upstreams
        .iter()
        .find_map(|&upstream| match ask_tcp(query, upstream, cfg.timeout) {
            Ok(reply) => Some(reply),
            Err(e) => {
                tracing::debug!(%upstream, error = %e, "dns upstream (tcp) failed");
                None
            }
        })
}

fn ask_tcp(query: &[u8], upstream: SocketAddr, timeout: Duration) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut stream = TcpStream::connect_timeout(&upstream, timeout)?;
    stream.set_write_timeout(Some(timeout))?;
    write_framed(&mut stream, query)?;
    let reply = read_framed_by(&mut stream, deadline)?.ok_or(io::ErrorKind::UnexpectedEof)?;
    if same_id(query, &reply) {
        Ok(reply)
    } else {
        Err(io::Error::other("reply id does not match the query"))
    }
}

/// The query turned into a SERVFAIL response (header flags rewritten, rest echoed).
fn servfail(query: &[u8]) -> Vec<u8> {
    let mut reply = query.to_vec();
    // QR = response, keep opcode and RD; RA set, RCODE = 2 (server failure).
    reply[2] = (reply[2] | 0x80) & 0xf9;
    reply[3] = 0x80 | 0x02;
    reply
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// One length-prefixed DNS message, or `None` at a clean end of stream.
    fn read_framed(stream: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
        let mut len = [0u8; 2];
        match stream.read_exact(&mut len) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let mut msg = vec![0u8; u16::from_be_bytes(len) as usize];
        stream.read_exact(&mut msg)?;
        Ok(Some(msg))
    }

    /// A query for `name` (type A, class IN) with id `id`.
    fn query(id: u16, name: &str) -> Vec<u8> {
        let mut q = Vec::new();
        q.extend_from_slice(&id.to_be_bytes());
        q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
        for label in name.split('.') {
            q.push(label.len() as u8);
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        q
    }

    /// The answer a fake upstream gives: the query with QR set and one A record.
    fn answer(q: &[u8], ip: [u8; 4]) -> Vec<u8> {
        let mut r = q.to_vec();
        r[2] |= 0x80;
        r[3] = 0x80;
        r[7] = 1; // ANCOUNT
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&ip);
        r
    }

    /// A fake upstream on 127.0.0.1 (UDP and TCP, same port) answering `ip` to anything.
    fn fake_upstream(ip: [u8; 4]) -> SocketAddr {
        counting_upstream(ip).0
    }

    /// [`fake_upstream`] that also counts the queries it got.
    fn counting_upstream(ip: [u8; 4]) -> (SocketAddr, Arc<AtomicUsize>) {
        let (udp, tcp) = bind_pair((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        let addr = udp.local_addr().unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let udp_asked = asked.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                udp_asked.fetch_add(1, Ordering::SeqCst);
                let _ = udp.send_to(&answer(&buf[..n], ip), from);
            }
        });
        let tcp_asked = asked.clone();
        std::thread::spawn(move || {
            for mut s in tcp.incoming().flatten() {
                while let Ok(Some(q)) = read_framed(&mut s) {
                    tcp_asked.fetch_add(1, Ordering::SeqCst);
                    let _ = write_framed(&mut s, &answer(&q, ip));
                }
            }
        });
        (addr, asked)
    }

    /// One answer a hook saw: client, name, A records.
    type SeenAnswer = (IpAddr, String, Vec<(Ipv4Addr, u32)>);

    /// A name policy that refuses one name, records what it sees, and can fail or withhold
    /// answers.
    #[derive(Default)]
    struct FakeHook {
        refuse: &'static str,
        fail_answers: bool,
        withhold: &'static str,
        queries: std::sync::Mutex<Vec<(IpAddr, String)>>,
        answers: std::sync::Mutex<Vec<SeenAnswer>>,
    }

    impl DnsHook for FakeHook {
        fn on_query(&self, client: IpAddr, name: &str) -> QueryVerdict {
            self.queries.lock().unwrap().push((client, name.to_owned()));
            if name == self.refuse {
                QueryVerdict::Refuse
            } else {
                QueryVerdict::Forward
            }
        }

        fn on_answer(
            &self,
            client: IpAddr,
            name: &str,
            addresses: &[(Ipv4Addr, u32)],
        ) -> Result<AnswerVerdict, DnsHookError> {
            if self.fail_answers {
                return Err("set is full".into());
            }
            self.answers
                .lock()
                .unwrap()
                .push((client, name.to_owned(), addresses.to_vec()));
            if name == self.withhold {
                return Ok(AnswerVerdict::Withhold);
            }
            Ok(AnswerVerdict::Pass)
        }
    }

    fn forwarder_with_hook(upstream: SocketAddr, hook: Arc<FakeHook>) -> DnsForwarder {
        let mut cfg = DnsForwarderConfig::new(vec![upstream]).with_hook(hook);
        cfg.listen = (Ipv4Addr::LOCALHOST, 0).into();
        cfg.timeout = Duration::from_millis(300);
        DnsForwarder::start(cfg).unwrap()
    }

    fn rcode(reply: &[u8]) -> u8 {
        reply[3] & 0x0f
    }

    #[test]
    fn a_hook_refuses_names_with_nxdomain_without_asking_upstream() {
        let (upstream, asked) = counting_upstream([192, 0, 2, 20]);
        let hook = Arc::new(FakeHook {
            refuse: "denied.test",
            ..FakeHook::default()
        });
        let fwd = forwarder_with_hook(upstream, hook.clone());
        let q = query(0x0707, "Denied.TEST");
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!((&r[..2], rcode(&r)), (&q[..2], message::NXDOMAIN));
        assert_eq!(&r[12..], &q[12..], "the question is echoed");
        let mut s = TcpStream::connect(fwd.local_addr()).unwrap();
        write_framed(&mut s, &q).unwrap();
        assert_eq!(
            rcode(&read_framed(&mut s).unwrap().unwrap()),
            message::NXDOMAIN
        );
        assert_eq!(
            asked.load(Ordering::SeqCst),
            0,
            "a refused name reached the upstream"
        );
        assert!(hook.answers.lock().unwrap().is_empty());
        let queries = hook.queries.lock().unwrap().clone();
        assert_eq!(queries.len(), 2);
        assert_eq!(
            queries[0],
            (IpAddr::from(Ipv4Addr::LOCALHOST), "denied.test".into())
        );
    }

    #[test]
    fn a_hook_sees_the_client_and_the_answer_before_the_client_does() {
        let hook = Arc::new(FakeHook::default());
        let fwd = forwarder_with_hook(fake_upstream([192, 0, 2, 21]), hook.clone());
        let q = query(0x0808, "ok.test");
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!(r, answer(&q, [192, 0, 2, 21]));
        // The hook ran before the reply was sent, so it is recorded by now.
        let mut s = TcpStream::connect(fwd.local_addr()).unwrap();
        write_framed(&mut s, &q).unwrap();
        assert_eq!(read_framed(&mut s).unwrap().unwrap(), r);
        let answers = hook.answers.lock().unwrap().clone();
        let want = (
            IpAddr::from(Ipv4Addr::LOCALHOST),
            "ok.test".to_owned(),
            vec![(Ipv4Addr::new(192, 0, 2, 21), 60)],
        );
        assert_eq!(answers, [want.clone(), want]);
    }

    #[test]
    fn a_failing_hook_turns_the_answer_into_servfail() {
        let hook = Arc::new(FakeHook {
            fail_answers: true,
            ..FakeHook::default()
        });
        let fwd = forwarder_with_hook(fake_upstream([192, 0, 2, 22]), hook);
        let r = ask_forwarder_udp(fwd.local_addr(), &query(9, "ok.test")).unwrap();
        assert_eq!(rcode(&r), 2, "SERVFAIL");
        assert_eq!(&r[12..], &query(9, "ok.test")[12..], "no answer records");
    }

    #[test]
    fn a_withheld_answer_becomes_noerror_without_records() {
        let hook = Arc::new(FakeHook {
            withhold: "rebind.test",
            ..FakeHook::default()
        });
        let fwd = forwarder_with_hook(fake_upstream([10, 200, 0, 1]), hook.clone());
        let q = query(0x0909, "rebind.test");
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!((&r[..2], rcode(&r)), (&q[..2], 0), "NOERROR");
        assert_eq!(
            &r[4..12],
            &[0, 1, 0, 0, 0, 0, 0, 0],
            "the question, no record"
        );
        assert_eq!(&r[12..], &q[12..], "the question is echoed");
        assert_eq!(message::a_records(&r).unwrap(), []);
        let mut s = TcpStream::connect(fwd.local_addr()).unwrap();
        write_framed(&mut s, &q).unwrap();
        assert_eq!(read_framed(&mut s).unwrap().unwrap(), r);
        // The hook saw the addresses; other names pass untouched.
        assert_eq!(
            hook.answers.lock().unwrap()[0].2,
            [(Ipv4Addr::new(10, 200, 0, 1), 60)]
        );
        let other = query(0x0a0a, "ok.test");
        assert_eq!(
            ask_forwarder_udp(fwd.local_addr(), &other).unwrap(),
            answer(&other, [10, 200, 0, 1])
        );
    }

    #[test]
    fn unreadable_questions_get_formerr_under_a_hook_and_pass_without_one() {
        let (upstream, asked) = counting_upstream([192, 0, 2, 23]);
        let hook = Arc::new(FakeHook::default());
        let fwd = forwarder_with_hook(upstream, hook.clone());
        let mut q = query(5, "a.b.test");
        q[13] = b'.'; // label "a" -> "."
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!((&r[..2], rcode(&r)), (&q[..2], message::FORMERR));
        assert!(hook.queries.lock().unwrap().is_empty());
        assert_eq!(asked.load(Ordering::SeqCst), 0);
        let plain = forwarder(vec![upstream]);
        assert_eq!(
            ask_forwarder_udp(plain.local_addr(), &q).unwrap(),
            answer(&q, [192, 0, 2, 23])
        );
    }

    fn forwarder(upstreams: Vec<SocketAddr>) -> DnsForwarder {
        let mut cfg = DnsForwarderConfig::new(upstreams);
        cfg.listen = (Ipv4Addr::LOCALHOST, 0).into();
        cfg.timeout = Duration::from_millis(300);
        DnsForwarder::start(cfg).unwrap()
    }

    fn ask_forwarder_udp(fwd: SocketAddr, q: &[u8]) -> io::Result<Vec<u8>> {
        let s = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(2)))?;
        s.send_to(q, fwd)?;
        let mut buf = [0u8; 512];
        let n = s.recv(&mut buf)?;
        Ok(buf[..n].to_vec())
    }

    #[test]
    fn forwards_udp_queries_and_returns_the_upstream_answer() {
        let fwd = forwarder(vec![fake_upstream([192, 0, 2, 7])]);
        let q = query(0x1234, "example.test");
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!(r, answer(&q, [192, 0, 2, 7]));
    }

    #[test]
    fn forwards_tcp_queries_several_per_connection() {
        let fwd = forwarder(vec![fake_upstream([192, 0, 2, 8])]);
        let mut s = TcpStream::connect(fwd.local_addr()).unwrap();
        for id in [1u16, 2, 3] {
            let q = query(id, "a.example.test");
            write_framed(&mut s, &q).unwrap();
            assert_eq!(
                read_framed(&mut s).unwrap().unwrap(),
                answer(&q, [192, 0, 2, 8])
            );
        }
    }

    #[test]
    fn falls_through_a_dead_upstream_to_the_next() {
        // A bound but silent UDP socket: the first upstream never answers.
        let silent = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let fwd = forwarder(vec![
            silent.local_addr().unwrap(),
            fake_upstream([192, 0, 2, 9]),
        ]);
        let q = query(7, "x.test");
        assert_eq!(
            ask_forwarder_udp(fwd.local_addr(), &q).unwrap(),
            answer(&q, [192, 0, 2, 9])
        );
    }

    #[test]
    fn answers_servfail_when_no_upstream_answers() {
        let silent = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let fwd = forwarder(vec![silent.local_addr().unwrap()]);
        let q = query(9, "x.test");
        let r = ask_forwarder_udp(fwd.local_addr(), &q).unwrap();
        assert_eq!(&r[..2], &q[..2]);
        assert_eq!(r[2] & 0x80, 0x80, "QR set");
        assert_eq!(r[3] & 0x0f, 2, "SERVFAIL");
    }

    #[test]
    fn drop_stops_serving() {
        let fwd = forwarder(vec![fake_upstream([192, 0, 2, 10])]);
        let addr = fwd.local_addr();
        drop(fwd);
        assert!(TcpStream::connect(addr).is_err(), "tcp still listening");
        let s = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        s.send_to(&query(1, "x.test"), addr).unwrap();
        assert!(s.recv(&mut [0u8; 512]).is_err(), "udp still answering");
    }

    #[test]
    fn resolv_conf_nameservers_become_upstreams_on_port_53() {
        let text = "# comment\nsearch example\nnameserver 10.255.255.53\nnameserver fe80::1%eth0\n\
                    nameserver   127.0.0.53  \noptions edns0\nnameserver bogus\nnameserver 2001:db8::53\n";
        let ups = parse_resolv_conf(text);
        let want: Vec<SocketAddr> = vec![
            "10.255.255.53:53".parse().unwrap(),
            "127.0.0.53:53".parse().unwrap(),
            "[2001:db8::53]:53".parse().unwrap(),
        ];
        assert_eq!(ups, want);
    }

    #[test]
    fn start_without_upstreams_is_an_error() {
        assert!(DnsForwarder::start(DnsForwarderConfig::new(vec![])).is_err());
    }

    #[test]
    fn start_with_a_zero_limit_is_an_error() {
        let upstream = vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 53))];
        for zero in [
            |c: &mut DnsForwarderConfig| c.max_in_flight = 0,
            |c: &mut DnsForwarderConfig| c.max_tcp_per_client = 0,
            |c: &mut DnsForwarderConfig| c.max_queries_per_client = 0,
            |c: &mut DnsForwarderConfig| c.tcp_idle = Duration::ZERO,
        ] {
            let mut cfg = DnsForwarderConfig::new(upstream.clone());
            zero(&mut cfg);
            assert!(DnsForwarder::start(cfg).is_err());
        }
    }

    #[test]
    fn the_defaults_cap_each_client_and_all_together() {
        let cfg = DnsForwarderConfig::new(vec![]);
        assert_eq!(
            (
                cfg.max_in_flight,
                cfg.max_tcp_per_client,
                cfg.max_queries_per_client,
                cfg.tcp_idle
            ),
            (1024, 16, 64, Duration::from_secs(10))
        );
    }

    /// A fake upstream on 127.0.0.1 (UDP only) that answers every query with `ip` after
    /// `delay`, each on its own thread, and counts the queries.
    fn slow_upstream(ip: [u8; 4], delay: Duration) -> (SocketAddr, Arc<AtomicUsize>) {
        let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = udp.local_addr().unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let counter = asked.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                counter.fetch_add(1, Ordering::SeqCst);
                let (reply, udp) = (answer(&buf[..n], ip), udp.try_clone().unwrap());
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    let _ = udp.send_to(&reply, from);
                });
            }
        });
        (addr, asked)
    }

    fn limited_forwarder(
        upstream: SocketAddr,
        limit: impl FnOnce(&mut DnsForwarderConfig),
    ) -> DnsForwarder {
        let mut cfg = DnsForwarderConfig::new(vec![upstream]);
        cfg.listen = (Ipv4Addr::LOCALHOST, 0).into();
        cfg.timeout = Duration::from_secs(5);
        limit(&mut cfg);
        DnsForwarder::start(cfg).unwrap()
    }

    /// Client `n`: the loopback address 127.0.0.`n` (each address is a client of its own).
    fn client_addr(n: u8) -> Ipv4Addr {
        Ipv4Addr::new(127, 0, 0, n)
    }

    fn client_udp(n: u8) -> UdpSocket {
        let s = UdpSocket::bind((client_addr(n), 0)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
        s
    }

    /// A TCP connection to `to` from client `n` (std cannot bind before connecting).
    fn client_tcp(n: u8, to: SocketAddr) -> TcpStream {
        use nix::sys::socket::{
            AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket,
        };
        use std::os::fd::AsRawFd;
        let sock = socket(
            AddressFamily::Inet,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let from = std::net::SocketAddrV4::new(client_addr(n), 0);
        bind(sock.as_raw_fd(), &SockaddrIn::from(from)).unwrap();
        let SocketAddr::V4(to) = to else {
            unreachable!()
        };
        connect(sock.as_raw_fd(), &SockaddrIn::from(to)).unwrap();
        let stream = TcpStream::from(sock);
        stream
            .set_read_timeout(Some(Duration::from_secs(4)))
            .unwrap();
        stream
    }

    /// Whether the forwarder closed `s` (end of stream or reset), rather than holding it.
    fn closed_by_forwarder(s: &mut TcpStream) -> bool {
        match s.read(&mut [0u8; 64]) {
            Ok(0) => true,
            Ok(n) => panic!("{n} unexpected bytes"),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => true,
            Err(e) => panic!("connection neither closed nor answered: {e}"),
        }
    }

    #[test]
    fn a_client_over_its_query_limit_gets_servfail_at_once_and_others_are_served() {
        let (upstream, asked) = slow_upstream([192, 0, 2, 30], Duration::from_millis(1500));
        let fwd = limited_forwarder(upstream, |c| c.max_queries_per_client = 4);
        let flooder = client_udp(2);
        for id in 0..20u16 {
            flooder
                .send_to(&query(id, "slow.test"), fwd.local_addr())
                .unwrap();
        }
        // The 16 queries beyond the limit are answered SERVFAIL before the upstream answers
        // any of the 4 it was given.
        let mut buf = [0u8; 512];
        let mut servfailed = Vec::new();
        for _ in 0..16 {
            let n = flooder.recv(&mut buf).unwrap();
            assert_eq!(rcode(&buf[..n]), 2, "SERVFAIL first");
            servfailed.push(u16::from_be_bytes([buf[0], buf[1]]));
        }
        servfailed.sort();
        assert_eq!(servfailed, (4..20).collect::<Vec<u16>>());
        // Another client has its own budget.
        let other = client_udp(3);
        other
            .send_to(&query(99, "slow.test"), fwd.local_addr())
            .unwrap();
        let n = other.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], answer(&query(99, "slow.test"), [192, 0, 2, 30]));
        for _ in 0..4 {
            let n = flooder.recv(&mut buf).unwrap();
            assert_eq!(rcode(&buf[..n]), 0, "the admitted queries are answered");
        }
        assert_eq!(
            asked.load(Ordering::SeqCst),
            5,
            "refused queries never went up"
        );
        // Once answered, the flooder's budget is back.
        flooder
            .send_to(&query(100, "slow.test"), fwd.local_addr())
            .unwrap();
        let n = flooder.recv(&mut buf).unwrap();
        assert_eq!(rcode(&buf[..n]), 0);
    }

    #[test]
    fn beyond_the_global_ceiling_udp_queries_are_dropped() {
        let (upstream, asked) = slow_upstream([192, 0, 2, 31], Duration::from_millis(800));
        let fwd = limited_forwarder(upstream, |c| c.max_in_flight = 3);
        let clients: Vec<UdpSocket> = (2..=6).map(client_udp).collect();
        for (id, c) in clients.iter().enumerate() {
            c.send_to(&query(id as u16, "slow.test"), fwd.local_addr())
                .unwrap();
        }
        let mut answered = 0;
        for c in &clients {
            c.set_read_timeout(Some(Duration::from_millis(2500)))
                .unwrap();
            if c.recv(&mut [0u8; 512]).is_ok() {
                answered += 1;
            }
        }
        assert_eq!(answered, 3, "three served, two dropped without a reply");
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn a_client_over_its_tcp_limit_has_new_connections_closed_and_others_connect() {
        let fwd = limited_forwarder(fake_upstream([192, 0, 2, 32]), |c| c.max_tcp_per_client = 2);
        let held: Vec<TcpStream> = (0..2).map(|_| client_tcp(2, fwd.local_addr())).collect();
        for mut extra in (0..3).map(|_| client_tcp(2, fwd.local_addr())) {
            assert!(closed_by_forwarder(&mut extra));
        }
        // The held connections still answer, and so does another client.
        let mut other = client_tcp(3, fwd.local_addr());
        for (id, mut s) in held.iter().chain([&other]).enumerate() {
            let q = query(id as u16, "a.test");
            write_framed(&mut s, &q).unwrap();
            assert_eq!(
                read_framed(&mut s).unwrap().unwrap(),
                answer(&q, [192, 0, 2, 32])
            );
        }
        // Closing one gives the client its connection back.
        drop(held);
        std::thread::sleep(Duration::from_millis(200));
        let mut again = client_tcp(2, fwd.local_addr());
        let q = query(7, "a.test");
        write_framed(&mut again, &q).unwrap();
        assert!(read_framed(&mut again).unwrap().is_some());
        let q = query(8, "a.test");
        write_framed(&mut other, &q).unwrap();
        assert!(read_framed(&mut other).unwrap().is_some());
    }

    #[test]
    fn idle_and_trickling_tcp_clients_are_closed_after_tcp_idle() {
        let fwd = limited_forwarder(fake_upstream([192, 0, 2, 33]), |c| {
            c.tcp_idle = Duration::from_millis(400)
        });
        // Silent after connecting.
        let mut idle = client_tcp(2, fwd.local_addr());
        assert!(closed_by_forwarder(&mut idle));
        // Silent after an answer.
        let mut after = client_tcp(2, fwd.local_addr());
        let q = query(1, "a.test");
        write_framed(&mut after, &q).unwrap();
        assert!(read_framed(&mut after).unwrap().is_some());
        assert!(closed_by_forwarder(&mut after));
        // A message sent one byte every 100 ms (it would take 3 s) is cut at the deadline,
        // though no single read waits longer than the limit.
        let mut slow = client_tcp(2, fwd.local_addr());
        let mut framed = (q.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&q);
        let mut writer = slow.try_clone().unwrap();
        let trickle = std::thread::spawn(move || {
            for byte in framed {
                if writer.write_all(&[byte]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        assert!(closed_by_forwarder(&mut slow), "answered a trickled query");
        trickle.join().unwrap();
    }
}
