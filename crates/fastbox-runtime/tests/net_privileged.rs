//! Privileged end-to-end tests of network slots: real netns, veth pairs, nft and the DNS
//! forwarder on this host's kernel.
//!
//! Skipped (with the reason printed) unless root with `ip` and `nft` installed. Every
//! host-wide name carries a per-run prefix (`FASTBOX_TEST_PREFIX`, else `fbt` + 4 random
//! hex digits, plus one letter per test), and a guard purges that prefix even when a test
//! fails. Traffic stays on this host: loopback, slots, and a test "internet" namespace
//! wired to the host by its own veth (not a slot), with addresses from a random 10.x/24
//! for the links and one from 203.0.113.64/26 (documentation range) for the internet server
//! that slots reach: private addresses are denied to every sandbox.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use fastbox_runtime::net::{
    DnsForwarder, DnsForwarderConfig, HostNetwork, NetConfig, NetSlot, in_netns, netns,
};

/// How long a connection attempt may take before we call it silently dropped.
const DROP_TIMEOUT: Duration = Duration::from_millis(800);

fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("needs root".into());
    }
    for (tool, arg) in [("ip", "-V"), ("nft", "--version")] {
        match Command::new(tool).arg(arg).output() {
            Ok(out) if out.status.success() => {}
            _ => return Some(format!("`{tool}` is not installed")),
        }
    }
    None
}

macro_rules! require_privileges {
    () => {
        if let Some(reason) = skip_reason() {
            eprintln!("skipping: {reason}");
            return;
        }
    };
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut buf)
        .unwrap();
    buf
}

/// Per-run prefix plus a per-test letter, so tests in one run never share names. This file
/// uses `n` and `o`; other suites building a `HostNetwork` should pick other letters.
fn test_prefix(letter: char) -> String {
    let base = std::env::var("FASTBOX_TEST_PREFIX")
        .unwrap_or_else(|_| format!("fbt{}", &hex::encode(random_bytes::<2>())));
    assert!(
        base.len() <= 7,
        "FASTBOX_TEST_PREFIX must be at most 7 bytes: {base:?}"
    );
    format!("{base}{letter}")
}

/// A random `10.x.y.0/24` for the test: slots in the low half, the rest for test links.
/// Never 10.200.x.y: fastbox-egress's `tests/private_network.rs` routes 10.200.0.1.
fn test_net() -> [u8; 2] {
    let [a, b] = random_bytes::<2>();
    [201 + a % 49, b]
}

/// Purges everything carrying the prefix when dropped, also on panic.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Err(e) = HostNetwork::purge(&self.0) {
            eprintln!("cleanup of {} failed: {e}", self.0);
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ip_out(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A tiny upstream DNS server on 127.0.0.1 (UDP and TCP, one port): answers every query
/// with one A record, `answer`.
fn fake_upstream(answer: Ipv4Addr) -> SocketAddr {
    let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = udp.local_addr().unwrap();
    let tcp = TcpListener::bind(addr).unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(&dns_answer(&buf[..n], answer), from);
        }
    });
    std::thread::spawn(move || {
        for mut s in tcp.incoming().flatten() {
            let mut len = [0u8; 2];
            while s.read_exact(&mut len).is_ok() {
                let mut q = vec![0u8; u16::from_be_bytes(len) as usize];
                if s.read_exact(&mut q).is_err() {
                    break;
                }
                let r = dns_answer(&q, answer);
                let mut out = (r.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&r);
                let _ = s.write_all(&out);
            }
        }
    });
    addr
}

fn dns_query(id: u16) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    q.extend_from_slice(b"\x07sandbox\x04test\x00\x00\x01\x00\x01");
    q
}

fn dns_answer(q: &[u8], ip: Ipv4Addr) -> Vec<u8> {
    let mut r = q.to_vec();
    r[2] |= 0x80;
    r[3] = 0x80;
    r[7] = 1;
    r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
    r.extend_from_slice(&ip.octets());
    r
}

/// The A record in an answer built by [`dns_answer`].
fn answered_ip(r: &[u8]) -> Ipv4Addr {
    let a: [u8; 4] = r[r.len() - 4..].try_into().unwrap();
    Ipv4Addr::from(a)
}

/// UDP query from inside `ns` to `server`; the reply must come from `server` itself.
fn udp_dns_from(ns: &Path, server: SocketAddr, id: u16) -> std::io::Result<Vec<u8>> {
    in_netns(ns, || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.connect(server)?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.send(&dns_query(id))?;
        let mut buf = [0u8; 512];
        let n = s.recv(&mut buf)?;
        Ok(buf[..n].to_vec())
    })
    .unwrap()
}

fn tcp_dns_from(ns: &Path, server: SocketAddr, id: u16) -> std::io::Result<Vec<u8>> {
    in_netns(ns, || {
        let mut s = TcpStream::connect_timeout(&server, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        let q = dns_query(id);
        let mut out = (q.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&q);
        s.write_all(&out)?;
        let mut len = [0u8; 2];
        s.read_exact(&mut len)?;
        let mut r = vec![0u8; u16::from_be_bytes(len) as usize];
        s.read_exact(&mut r)?;
        Ok(r)
    })
    .unwrap()
}

/// TCP connect from inside `ns` (optionally from a given source address).
fn connect_from(ns: &Path, to: SocketAddr, from: Option<Ipv4Addr>) -> std::io::Result<TcpStream> {
    in_netns(ns, || match from {
        None => TcpStream::connect_timeout(&to, DROP_TIMEOUT),
        Some(src) => connect_bound(src, to),
    })
    .unwrap()
}

/// `connect_timeout` from a socket bound to `src` (std has no bind-then-connect).
fn connect_bound(src: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, socket};
    use std::os::fd::AsRawFd;
    let sock = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    bind(
        sock.as_raw_fd(),
        &SockaddrIn::from(SocketAddrV4::new(src, 0)),
    )?;
    let SocketAddr::V4(to) = to else {
        unreachable!()
    };
    match connect(sock.as_raw_fd(), &SockaddrIn::from(to)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => {}
        Err(e) => return Err(e.into()),
    }
    let stream = TcpStream::from(sock);
    let mut fds = [nix::poll::PollFd::new(
        std::os::fd::AsFd::as_fd(&stream),
        nix::poll::PollFlags::POLLOUT,
    )];
    let n = nix::poll::poll(
        &mut fds,
        nix::poll::PollTimeout::try_from(DROP_TIMEOUT).unwrap(),
    )?;
    if n == 0 {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

#[track_caller]
fn assert_dropped(what: &str, result: std::io::Result<TcpStream>) {
    match result {
        Ok(_) => panic!("{what}: connected, must be dropped"),
        Err(e) => assert_eq!(
            e.kind(),
            std::io::ErrorKind::TimedOut,
            "{what}: expected a silent drop, got {e}"
        ),
    }
}

/// A TCP server that writes the peer's address to every client.
fn peer_echo_server(listener: TcpListener) {
    std::thread::spawn(move || {
        for mut s in listener.incoming().flatten() {
            let peer = s
                .peer_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default();
            let _ = s.write_all(peer.as_bytes());
        }
    });
}

fn read_all(mut s: TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn host_global_ipv4(exclude_prefix: &str) -> Option<Ipv4Addr> {
    ip_out(&["-4", "-o", "addr", "show", "scope", "global"])
        .lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            let ifname = words.nth(1)?;
            if ifname.starts_with(exclude_prefix) {
                return None;
            }
            let cidr = words.skip_while(|w| *w != "inet").nth(1)?;
            cidr.split('/').next()?.parse().ok()
        })
}

fn start_forwarder(upstream: SocketAddr) -> DnsForwarder {
    DnsForwarder::start(DnsForwarderConfig::new(vec![upstream])).unwrap()
}

#[test]
fn slots_are_isolated_and_reach_the_outside_through_nat_and_dns_through_the_forwarder() {
    require_privileges!();
    let prefix = test_prefix('n');
    let _cleanup = Cleanup(prefix.clone());
    let [n1, n2] = test_net();
    let net = |last: u8| Ipv4Addr::new(10, n1, n2, last);
    eprintln!("prefix {prefix}, net 10.{n1}.{n2}.0/24");

    // DNS: the forwarder asks a fake upstream on loopback.
    let dns_answer_ip = Ipv4Addr::new(192, 0, 2, 123);
    let forwarder = start_forwarder(fake_upstream(dns_answer_ip));
    let cfg = NetConfig {
        prefix: prefix.clone(),
        pool: format!("10.{n1}.{n2}.0/25").parse().unwrap(),
        dns_port: forwarder.port(),
        sandbox_reach: Vec::new(),
        slot_limits: Default::default(),
        credential_proxy_port: None,
    };
    let host = HostNetwork::try_new(cfg).unwrap();
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        "1"
    );
    let a = host.create_slot(0).unwrap();
    let b = host.create_slot(1).unwrap();
    assert_eq!((a.gateway, a.address), (net(0), net(1)));
    assert_eq!(a.resolv_conf(), format!("nameserver {}\n", net(0)));
    assert!(a.netns_inode().unwrap() != b.netns_inode().unwrap());

    // The test "internet": its own netns behind its own veth (not a slot), with no route
    // back to the pool, so answers only arrive if the host masquerades. Its server is
    // reached at a documentation-range address (public to the firewall); its link address
    // is private.
    let inet_ns = format!("{prefix}_inet");
    let uplink = format!("{prefix}_up");
    let inet_path = netns::create(&inet_ns).unwrap();
    ip(&[
        "link", "add", &uplink, "type", "veth", "peer", "name", "up0", "netns", &inet_ns,
    ]);
    ip(&["addr", "add", &format!("{}/30", net(253)), "dev", &uplink]);
    ip(&["link", "set", &uplink, "up"]);
    let [r1, r2] = random_bytes::<2>();
    let link_local = Ipv4Addr::new(169, 254, 1 + r1 % 168, 1 + r2 % 250); // never .169.254
    let inet = Ipv4Addr::new(203, 0, 113, 65 + r1 % 62);
    for cmd in [
        format!("addr add {}/30 dev up0", net(254)),
        "link set up0 up".into(),
        "link set lo up".into(),
        format!("addr add {link_local}/32 dev lo"),
        format!("addr add {inet}/32 dev lo"),
    ] {
        let args: Vec<&str> = cmd.split(' ').collect();
        ip(&[&["-n", &inet_ns][..], &args].concat());
    }
    for routed in [link_local, inet] {
        ip(&[
            "route",
            "add",
            &format!("{routed}/32"),
            "via",
            &net(254).to_string(),
        ]);
    }
    let inet_server = in_netns(&inet_path, || {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap()
    })
    .unwrap();
    let inet_port = inet_server.local_addr().unwrap().port();
    peer_echo_server(inet_server);

    // Servers on the host (0.0.0.0) and in slot B.
    let host_server = TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
    let host_port = host_server.local_addr().unwrap().port();
    peer_echo_server(host_server);
    let b_server = in_netns(&b.netns_path, || {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap()
    })
    .unwrap();
    let b_port = b_server.local_addr().unwrap().port();
    peer_echo_server(b_server);

    let at = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip, port));

    // Positive controls from the host: each target exists and answers.
    assert_eq!(
        read_all(TcpStream::connect(at(b.address, b_port)).unwrap()),
        b.gateway.to_string()
    );
    for target in [link_local, net(254)] {
        assert_eq!(
            read_all(TcpStream::connect(at(target, inet_port)).unwrap()),
            net(253).to_string()
        );
    }
    TcpStream::connect(at(a.gateway, host_port)).unwrap();

    // Outside through NAT: the server sees the host's address on its link.
    let seen = read_all(connect_from(&a.netns_path, at(inet, inet_port), None).unwrap());
    assert_eq!(
        seen,
        net(253).to_string(),
        "source must be masqueraded to the host's address"
    );
    // A process (not just a thread) in the netns does the same.
    let out = in_netns(&a.netns_path, || {
        Command::new("bash")
            .args([
                "-c",
                &format!("read -r line < /dev/tcp/{inet}/{inet_port}; echo \"$line\""),
            ])
            .output()
            .unwrap()
    })
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        net(253).to_string()
    );

    // Denied, silently: the host (gateway, other host addresses, another slot's gateway),
    // the forwarder's real port, slot B, link-local.
    assert_dropped(
        "host server via own gateway",
        connect_from(&a.netns_path, at(a.gateway, host_port), None),
    );
    assert_dropped(
        "host server via slot B's gateway",
        connect_from(&a.netns_path, at(b.gateway, host_port), None),
    );
    assert_dropped(
        "host server via uplink address",
        connect_from(&a.netns_path, at(net(253), host_port), None),
    );
    if let Some(host_ip) = host_global_ipv4(&prefix) {
        assert_dropped(
            "host server via host address",
            connect_from(&a.netns_path, at(host_ip, host_port), None),
        );
    }
    assert_dropped(
        "forwarder port without the redirect",
        connect_from(&a.netns_path, at(a.gateway, forwarder.port()), None),
    );
    assert_dropped(
        "slot B",
        connect_from(&a.netns_path, at(b.address, b_port), None),
    );
    assert_dropped(
        "link-local",
        connect_from(&a.netns_path, at(link_local, inet_port), None),
    );
    // A private address, routed exactly like the internet server: only the private-range
    // rule stops it.
    assert_dropped(
        "private address",
        connect_from(&a.netns_path, at(net(254), inet_port), None),
    );

    // Anti-spoofing: A using B's address as source gets nowhere.
    ip(&[
        "-n",
        &a.name,
        "addr",
        "add",
        &format!("{}/32", b.address),
        "dev",
        "eth0",
    ]);
    assert_dropped(
        "spoofed source",
        connect_from(&a.netns_path, at(inet, inet_port), Some(b.address)),
    );
    ip(&[
        "-n",
        &a.name,
        "addr",
        "del",
        &format!("{}/32", b.address),
        "dev",
        "eth0",
    ]);

    // DNS: port 53 on the gateway, UDP and TCP, reaches the forwarder and its upstream;
    // port 53 on any other address does too, and the reply carries that address.
    let r = udp_dns_from(&a.netns_path, at(a.gateway, 53), 0x4242).unwrap();
    assert_eq!(
        (&r[..2], answered_ip(&r)),
        (&[0x42u8, 0x42][..], dns_answer_ip)
    );
    let r = tcp_dns_from(&a.netns_path, at(a.gateway, 53), 0x4343).unwrap();
    assert_eq!(
        (&r[..2], answered_ip(&r)),
        (&[0x43u8, 0x43][..], dns_answer_ip)
    );
    let r = udp_dns_from(&b.netns_path, at(net(254), 53), 0x4444).unwrap();
    assert_eq!(answered_ip(&r), dns_answer_ip);
    // The forwarder is not open to other interfaces: from the test internet it is dropped.
    let r = udp_dns_from(&inet_path, at(net(253), forwarder.port()), 0x4545);
    assert!(r.is_err(), "forwarder answered a non-slot interface");

    // IPv6 is off inside: sysctls, no addresses, no ::1.
    let (all, eth0, v6_bind) = in_netns(&a.netns_path, || {
        let read = |p: &str| std::fs::read_to_string(p).unwrap().trim().to_owned();
        (
            read("/proc/sys/net/ipv6/conf/all/disable_ipv6"),
            read("/proc/sys/net/ipv6/conf/eth0/disable_ipv6"),
            TcpListener::bind("[::1]:0").is_ok(),
        )
    })
    .unwrap();
    assert_eq!((all.as_str(), eth0.as_str(), v6_bind), ("1", "1", false));
    let ping_range = in_netns(&a.netns_path, || {
        std::fs::read_to_string("/proc/sys/net/ipv4/ping_group_range").unwrap()
    })
    .unwrap();
    assert_eq!(
        ping_range.split_whitespace().collect::<Vec<_>>(),
        ["0", "2147483647"]
    );
    assert_eq!(ip_out(&["-n", &a.name, "-6", "addr", "show"]).trim(), "");
    let host_side = std::fs::read_to_string(format!(
        "/proc/sys/net/ipv6/conf/{}/disable_ipv6",
        a.host_if
    ))
    .unwrap();
    assert_eq!(host_side.trim(), "1");

    // Tear down: the test's own objects, then the slots (twice: idempotent), then the table.
    ip(&["link", "del", &uplink]);
    netns::remove(&inet_ns).unwrap();
    for slot in [&a, &b] {
        host.destroy_slot(slot).unwrap();
        host.destroy_slot(slot).unwrap();
    }
    host.teardown().unwrap();
    let left = HostNetwork::leaked(&prefix).unwrap();
    assert!(left.is_empty(), "leaked: {left}");
}

fn median_and_p90(mut xs: Vec<Duration>) -> (Duration, Duration) {
    xs.sort();
    (xs[xs.len() / 2], xs[xs.len() * 9 / 10])
}

#[test]
fn slots_are_created_and_destroyed_quickly_and_leave_nothing_behind() {
    require_privileges!();
    let prefix = test_prefix('o');
    let _cleanup = Cleanup(prefix.clone());
    let [n1, n2] = test_net();
    let forwarder = start_forwarder(SocketAddr::from((Ipv4Addr::LOCALHOST, 9)));
    let cfg = NetConfig {
        prefix: prefix.clone(),
        pool: format!("10.{n1}.{n2}.0/24").parse().unwrap(),
        dns_port: forwarder.port(),
        sandbox_reach: Vec::new(),
        slot_limits: Default::default(),
        credential_proxy_port: None,
    };
    // Installing twice replaces the table rather than duplicating it.
    HostNetwork::try_new(cfg.clone()).unwrap();
    let host = HostNetwork::try_new(cfg).unwrap();
    assert_eq!(
        HostNetwork::leaked(&prefix).unwrap().nft_tables,
        [format!("inet {prefix}")]
    );

    const N: u32 = 20;
    let mut creates = Vec::new();
    let mut slots: Vec<NetSlot> = Vec::new();
    for i in 0..N {
        let t = Instant::now();
        slots.push(host.create_slot(i).unwrap());
        creates.push(t.elapsed());
    }
    assert!(matches!(
        host.create_slot(3),
        Err(fastbox_runtime::net::NetError::SlotExists { .. })
    ));
    // The slot that was refused still works.
    assert!(
        ip_out(&["-n", &slots[3].name, "-4", "addr", "show", "eth0"])
            .contains(&slots[3].address.to_string())
    );
    let left = HostNetwork::leaked(&prefix).unwrap();
    assert_eq!(
        (left.netns.len(), left.links.len()),
        (N as usize, N as usize),
        "{left}"
    );

    // Concurrent creates of distinct slots.
    let parallel: Vec<NetSlot> = std::thread::scope(|s| {
        let handles: Vec<_> = (N..N + 8)
            .map(|i| {
                s.spawn({
                    let host = &host;
                    move || host.create_slot(i).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let mut destroys = Vec::new();
    for slot in &slots {
        let t = Instant::now();
        host.destroy_slot(slot).unwrap();
        destroys.push(t.elapsed());
    }
    for slot in &parallel {
        host.destroy_slot(slot).unwrap();
    }
    let (c50, c90) = median_and_p90(creates);
    let (d50, d90) = median_and_p90(destroys);
    eprintln!(
        "create_slot: median {c50:?}, p90 {c90:?}; destroy_slot: median {d50:?}, p90 {d90:?} (n={N})"
    );

    host.teardown().unwrap();
    let left = HostNetwork::leaked(&prefix).unwrap();
    assert!(left.is_empty(), "leaked: {left}");
}
