//! What one tenant cannot take from the others, on the real kernel: the DNS forwarder's
//! per-client caps (TCP connections, queries in flight) and the instance table's per-slot
//! connection cap.
//!
//! Prefix tags (two characters, `fastbox_testkit::run_prefix_pair`): `xd` for the DNS test
//! (slots in 10.219.121.0/25, its upstream a test DNS server on 127.0.0.1, no test internet)
//! and `xc` for the connection test (slots in 10.219.120.0/25, its test internet's hosts in
//! 203.0.113.128/26). Traffic goes only to loopback and to namespaces the tests make.
//! Skipped (reason printed) without root, `ip`, `nft` or `conntrack`.

mod common;

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Lab, LabSetup, PurgeOnDrop, unavailable};
use fastbox_egress::testkit::{
    DnsTransport, Reach, Resolution, TestDnsServer, Zone, a_query, connect_from, echo, greeting,
    resolve_from,
};
use fastbox_egress::{EgressEnforcer, EgressPolicy, SlotRef};
use fastbox_runtime::net::dns_forwarder::message;
use fastbox_runtime::net::{
    DnsForwarder, DnsForwarderConfig, HostNetwork, NetConfig, SlotLimits, in_netns,
};

/// A name whose upstream answer takes [`SLOW_DELAY`], and one answered at once.
const SLOW: &str = "slow.test";
const FAST: &str = "fast.test";
const SLOW_DELAY: Duration = Duration::from_secs(8);
const SLOW_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 250);
const FAST_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 251);

/// The forwarder's caps in the DNS test: small, so the flood is small too.
const TCP_PER_CLIENT: usize = 4;
const QUERIES_PER_CLIENT: usize = 8;
const GLOBAL: usize = 24;
/// What the flooding slot tries: more than its caps, and more than the global ceiling.
const FLOOD_TCP: usize = 12;
const FLOOD_UDP: usize = 200;

/// How long the other slot may wait for an answer while the flood is on.
const BOUND: Duration = Duration::from_secs(2);

#[test]
fn one_slot_flooding_the_dns_forwarder_does_not_starve_another() {
    if let Some(reason) = unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let prefix = fastbox_testkit::run_prefix_pair("xd");
    let _purge = PurgeOnDrop(prefix.clone());
    eprintln!("prefix {prefix}, slots 10.219.121.0/25");

    // The upstream, on loopback: `slow.test` keeps every query waiting.
    let zone = Zone::new()
        .with(SLOW, &[SLOW_ADDR], 300)
        .with(FAST, &[FAST_ADDR], 300)
        .slow(SLOW, SLOW_DELAY);
    let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let tcp = TcpListener::bind(udp.local_addr().unwrap()).unwrap();
    let upstream = TestDnsServer::serve(udp, tcp, zone).unwrap();

    // The instance as the node agent runs it (the enforcer as the forwarder's hook), with
    // small caps; the upstream timeout outlasts the slow answer, so queries stay in flight.
    let enforcer = Arc::new(EgressEnforcer::try_new(&prefix).expect("egress enforcer"));
    let mut cfg = DnsForwarderConfig::new(vec![upstream.addr()]).with_hook(enforcer.clone());
    cfg.timeout = SLOW_DELAY + Duration::from_secs(5);
    cfg.max_in_flight = GLOBAL;
    cfg.max_tcp_per_client = TCP_PER_CLIENT;
    cfg.max_queries_per_client = QUERIES_PER_CLIENT;
    cfg.tcp_idle = Duration::from_secs(60);
    let forwarder = DnsForwarder::start(cfg).unwrap();
    let host = HostNetwork::try_new(NetConfig {
        prefix: prefix.clone(),
        pool: "10.219.121.0/25".parse().unwrap(),
        dns_port: forwarder.port(),
        sandbox_reach: Vec::new(),
        slot_limits: SlotLimits::default(),
        credential_proxy_port: None,
    })
    .expect("host network");
    let flooder = host.create_slot(0).unwrap();
    let other = host.create_slot(1).unwrap();
    for slot in [&flooder, &other] {
        enforcer
            .apply(&SlotRef::from(slot), &EgressPolicy::allow_all())
            .unwrap();
    }
    let flooder_dns = SocketAddr::from((flooder.gateway, 53));
    let other_dns = SocketAddr::from((other.gateway, 53));

    // The flood: TCP connections held open (each asking the slow name) ...
    let mut conns: Vec<TcpStream> = in_netns(&flooder.netns_path, || {
        (0..FLOOD_TCP)
            .map(|_| TcpStream::connect_timeout(&flooder_dns, Duration::from_secs(2)).unwrap())
            .collect()
    })
    .unwrap();
    let (mut held, mut closed) = (Vec::new(), 0);
    for (n, conn) in conns.iter_mut().enumerate() {
        conn.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        match conn.read(&mut [0u8; 16]) {
            Ok(0) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            Err(e) if is_timeout(&e) => held.push(n),
            other => panic!("flood connection {n}: {other:?}"),
        }
    }
    assert_eq!(
        (held.len(), closed),
        (TCP_PER_CLIENT, FLOOD_TCP - TCP_PER_CLIENT),
        "the forwarder holds the client's first {TCP_PER_CLIENT} connections and closes the rest"
    );
    for (n, &i) in held.iter().enumerate() {
        write_framed(&mut conns[i], &a_query(0x100 + n as u16, SLOW));
    }
    // (They take their share of the client's query budget once at the upstream.)
    let asked_slow = || upstream.asked().iter().filter(|n| *n == SLOW).count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while asked_slow() < TCP_PER_CLIENT {
        assert!(Instant::now() < deadline, "the TCP queries never went up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // ... and UDP queries for the slow name from one socket.
    let flood_udp = in_netns(&flooder.netns_path, || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        s.connect(flooder_dns).unwrap();
        s
    })
    .unwrap();
    for id in 0..FLOOD_UDP {
        flood_udp.send(&a_query(id as u16, SLOW)).unwrap();
    }

    // Meanwhile the other slot resolves, over UDP and TCP, within the bound.
    for transport in [DnsTransport::Udp, DnsTransport::Tcp] {
        let started = Instant::now();
        let got = resolve_from(&other.netns_path, other_dns, FAST, transport);
        let took = started.elapsed();
        assert_eq!(got, Resolution::Addresses(vec![FAST_ADDR]), "{transport:?}");
        assert!(
            took < BOUND,
            "{transport:?}: the other slot waited {took:?} for its answer"
        );
    }

    // The flooder's queries beyond its budget were answered SERVFAIL at once; only the
    // admitted ones reached the upstream.
    flood_udp
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut servfails = 0;
    let mut buf = [0u8; 512];
    while let Ok(n) = flood_udp.recv(&mut buf) {
        assert!(n >= message::HEADER_LEN);
        assert_eq!(
            buf[3] & 0x0f,
            2,
            "a flood query answered before the slow upstream, but not SERVFAIL"
        );
        servfails += 1;
    }
    let admitted_udp = QUERIES_PER_CLIENT - TCP_PER_CLIENT;
    assert!(
        servfails > 0 && servfails <= FLOOD_UDP - admitted_udp,
        "{servfails} SERVFAIL answers"
    );
    assert_eq!(
        asked_slow(),
        QUERIES_PER_CLIENT,
        "the upstream saw only the client's budget of queries"
    );

    // The admitted queries do get their answers in the end.
    for &i in &held {
        conns[i]
            .set_read_timeout(Some(SLOW_DELAY + Duration::from_secs(3)))
            .unwrap();
        let reply = read_framed(&mut conns[i]);
        assert_eq!(
            message::a_records(&reply).unwrap(),
            [(SLOW_ADDR, 300)],
            "held connection {i}"
        );
    }

    drop((conns, flood_udp, forwarder));
    drop(upstream);
    for slot in [&flooder, &other] {
        enforcer.remove(&SlotRef::from(slot)).unwrap();
        host.destroy_slot(slot).unwrap();
    }
    host.teardown().unwrap();
    let left = HostNetwork::leaked(&prefix).unwrap();
    assert!(left.is_empty(), "left behind: {left}");
}

/// The connection cap of the test's instance.
const CAP: u32 = 8;
/// An internet host with an echo server on port 80.
const HOST: u8 = 10;

#[test]
fn a_slot_at_its_connection_cap_has_new_connections_dropped_and_keeps_the_open_ones() {
    let Some(lab) = Lab::start_custom(LabSetup {
        prefix: fastbox_testkit::run_prefix_pair("xc"),
        net: [10, 219, 120],
        hosts: Ipv4Addr::new(203, 0, 113, 128),
        reach: Vec::new(),
        extra: Zone::new(),
        // The cap alone: no rate limit, so a drop is the cap's doing.
        slot_limits: SlotLimits {
            max_connections: CAP,
            new_connections_per_second: 0,
            new_connections_burst: 0,
        },
        credential_proxy_port: None,
    }) else {
        return;
    };
    let slot = lab.slot(0, &EgressPolicy::allow_all());
    let neighbour = lab.slot(1, &EgressPolicy::allow_all());
    let target = SocketAddr::from((lab.inet(HOST), 80));
    let connect = |slot: &fastbox_runtime::net::NetSlot, what: &str| {
        let mut stream = connect_from(&slot.netns_path, target).stream(what);
        assert_eq!(greeting(&mut stream).unwrap(), lab.inet(HOST).to_string());
        stream
    };

    let mut open: Vec<TcpStream> = (0..CAP)
        .map(|n| connect(&slot, &format!("connection {n}")))
        .collect();
    let over = connect_from(&slot.netns_path, target);
    assert!(
        over.is_dropped(),
        "connection {} of a slot capped at {CAP}: {over:?}",
        CAP + 1
    );
    // The open connections keep working, the slot still resolves names (DNS flows are not
    // counted), and another slot has its own cap.
    for (n, stream) in open.iter_mut().enumerate() {
        assert_eq!(
            echo(stream, "still here").unwrap(),
            "still here",
            "connection {n}"
        );
    }
    let resolved = resolve_from(
        &slot.netns_path,
        SocketAddr::from((slot.gateway, 53)),
        common::ALLOWED.0,
        DnsTransport::Udp,
    );
    assert_eq!(
        resolved,
        Resolution::Addresses(vec![lab.inet(common::ALLOWED.1)])
    );
    let _neighbours = connect(&neighbour, "the neighbour's connection");

    // A closed connection gives its place back (closed TCP entries are not counted).
    drop(open.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    let again = loop {
        match connect_from(&slot.netns_path, target) {
            Reach::Connected(stream) => break stream,
            other if Instant::now() > deadline => {
                panic!("no place back after a close: {other:?}")
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    drop((again, open));
    lab.close();
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn write_framed(stream: &mut TcpStream, msg: &[u8]) {
    use std::io::Write;
    let mut out = (msg.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(msg);
    stream.write_all(&out).unwrap();
}

fn read_framed(stream: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).unwrap();
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut msg).unwrap();
    msg
}
