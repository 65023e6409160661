//! The cost of egress enforcement on an allowed connection (issue 7's closing note): the
//! throughput of one TCP connection from inside a slot to a sink in the test internet, and
//! the time to set a connection up, under four policies. Only new connections traverse the
//! slot's chain (established packets are accepted first), so throughput should not depend
//! on the policy and the connect time shows the chain's cost.
//!
//! A measurement, not a check: ignored by default, figures printed, never asserted.
//!
//! ```text
//! CARGO_TARGET_DIR=target/egress cargo test -p fastbox-egress --test throughput -- --ignored --nocapture
//! ```
//!
//! Privileged (root, `ip`, `nft`, `conntrack`). Prefix tag `3` (see
//! `fastbox_testkit::run_prefix`), slots in 10.219.51.0/25 (the lab's `10.219.<tag byte>`),
//! the sink in 198.51.100.128/26 (`testkit::hosts_block`).

mod common;

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use fastbox_egress::testkit::sink::{SinkServer, blast};
use fastbox_egress::testkit::{DnsTransport, Resolution, resolve_from};
use fastbox_egress::{Action, EgressPolicy};
use fastbox_runtime::net::{NetSlot, in_netns};

/// Bytes per throughput sample.
const BYTES: u64 = 256 * 1024 * 1024;
/// Throughput samples per case.
const REPEATS: usize = 5;
/// Connects per case, in rounds interleaved across the cases.
const CONNECTS: usize = 200;
const CONNECT_ROUNDS: usize = 4;
/// Non-matching CIDR rules before the allowing one in case (d).
const FILLER_RULES: usize = 200;

fn policy(default: Action, rules: &[(&str, String)]) -> EgressPolicy {
    let pairs: Vec<(&str, &str)> = rules.iter().map(|(a, t)| (*a, t.as_str())).collect();
    EgressPolicy::from_pairs(default, &pairs).unwrap()
}

struct Case {
    name: &'static str,
    slot: NetSlot,
    /// Resolve `ALLOWED` through the proxy before each sample (the learned set opens it).
    resolve: bool,
    mbps: Vec<f64>,
    connects: Vec<Duration>,
}

impl Case {
    /// The sink's address for this case: `ALLOWED`'s host, resolved through the slot's
    /// DNS proxy when the case learns it.
    fn target(&self, lab: &Lab, port: u16) -> SocketAddr {
        let addr = lab.inet(ALLOWED.1);
        if self.resolve {
            let got = resolve_from(
                &self.slot.netns_path,
                SocketAddr::from((self.slot.gateway, 53)),
                ALLOWED.0,
                DnsTransport::Udp,
            );
            assert_eq!(got, Resolution::Addresses(vec![addr]), "{}", self.name);
        }
        SocketAddr::from((addr, port))
    }
}

fn connect_in(netns: &Path, to: SocketAddr) -> TcpStream {
    in_netns(netns, || {
        TcpStream::connect_timeout(&to, Duration::from_secs(2))
    })
    .unwrap()
    .unwrap_or_else(|e| panic!("connect to {to}: {e}"))
}

/// MB/s (10^6 bytes) of one connection sending `bytes` to the sink.
fn throughput(netns: &Path, to: SocketAddr, bytes: u64) -> f64 {
    let mut stream = connect_in(netns, to);
    let started = Instant::now();
    let counted = blast(&mut stream, bytes).expect("blast");
    let secs = started.elapsed().as_secs_f64();
    assert_eq!(counted, bytes, "the sink did not get everything");
    bytes as f64 / 1e6 / secs
}

/// `n` connects from one thread inside `netns`, each timed from `connect` until it returns
/// (SYN out, SYN-ACK back), then closed.
fn connect_times(netns: &Path, to: SocketAddr, n: usize) -> Vec<Duration> {
    in_netns(netns, || {
        (0..n)
            .map(|_| {
                let started = Instant::now();
                let stream = TcpStream::connect(to).unwrap_or_else(|e| panic!("{to}: {e}"));
                let took = started.elapsed();
                drop(stream);
                took
            })
            .collect()
    })
    .unwrap()
}

fn median<T: Copy + PartialOrd>(v: &[T]) -> T {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn percentile(v: &[Duration], p: usize) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[(v.len() - 1) * p / 100]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[test]
#[ignore = "measurement: run with --ignored"]
fn throughput_and_connect_time_under_egress_policies() {
    let Some(lab) = Lab::start('3') else {
        return;
    };
    let sink = {
        let listener = in_netns(lab.internet.netns_path(), || {
            TcpListener::bind((Ipv4Addr::UNSPECIFIED, 0))
        })
        .unwrap()
        .unwrap();
        SinkServer::serve(listener).unwrap()
    };
    let port = sink.addr().port();
    let server_ip = lab.inet(ALLOWED.1).to_string();
    let mut filler: Vec<(&str, String)> = (0..FILLER_RULES)
        .map(|i| ("deny", format!("100.64.{i}.0/24")))
        .collect();
    filler.push(("allow", server_ip.clone()));
    let specs = [
        ("(a) allow all (no chain)", EgressPolicy::allow_all(), false),
        (
            "(b) deny + allow server IP",
            policy(Action::Deny, &[("allow", server_ip.clone())]),
            false,
        ),
        (
            "(c) deny + allow FQDN (learned)",
            policy(Action::Deny, &[("allow", ALLOWED.0.to_owned())]),
            true,
        ),
        (
            "(d) deny + 200 CIDRs + allow IP",
            policy(Action::Deny, &filler),
            false,
        ),
    ];
    let mut cases: Vec<Case> = specs
        .into_iter()
        .enumerate()
        .map(|(i, (name, policy, resolve))| Case {
            name,
            slot: lab.slot(i as u32, &policy),
            resolve,
            mbps: Vec::new(),
            connects: Vec::new(),
        })
        .collect();

    // Warm-up (ARP, routes, conntrack, the DNS path), untimed.
    for case in &cases {
        let to = case.target(&lab, port);
        throughput(&case.slot.netns_path, to, 16 * 1024 * 1024);
        connect_times(&case.slot.netns_path, to, 20);
    }
    // Interleaved, so drift on the machine spreads over every case.
    for _ in 0..REPEATS {
        for case in &mut cases {
            let to = case.target(&lab, port);
            let mbps = throughput(&case.slot.netns_path, to, BYTES);
            case.mbps.push(mbps);
        }
    }
    for _ in 0..CONNECT_ROUNDS {
        for case in &mut cases {
            let to = case.target(&lab, port);
            let times = connect_times(&case.slot.netns_path, to, CONNECTS / CONNECT_ROUNDS);
            case.connects.extend(times);
        }
    }

    println!(
        "\none TCP connection slot -> test internet, {} MiB x {REPEATS}; {CONNECTS} connects",
        BYTES / (1024 * 1024)
    );
    println!(
        "{:<34} {:>10} {:>17}   {:>14} {:>15}",
        "policy", "MB/s med", "(min-max)", "connect µs med", "(p10-p90)"
    );
    for case in &cases {
        let min = case.mbps.iter().copied().fold(f64::INFINITY, f64::min);
        let max = case.mbps.iter().copied().fold(0.0, f64::max);
        println!(
            "{:<34} {:>10.0} {:>17}   {:>14.1} {:>15}",
            case.name,
            median(&case.mbps),
            format!("({min:.0}-{max:.0})"),
            micros(median(&case.connects)),
            format!(
                "({:.1}-{:.1})",
                micros(percentile(&case.connects, 10)),
                micros(percentile(&case.connects, 90))
            ),
        );
    }

    drop(sink);
    lab.close();
}
