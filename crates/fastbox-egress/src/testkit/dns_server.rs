//! A tiny authoritative DNS server for tests: UDP and TCP on one address, a fixed zone of
//! A records, NXDOMAIN for every other name, and a log of the names it was asked. Names
//! made slow ([`Zone::slow`]) are answered after a delay, without holding up the others.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fastbox_runtime::net::dns_forwarder::message::{self, HEADER_LEN, NXDOMAIN};

use super::server::Stoppable;

/// Names (lower case, no trailing dot) to their A records and the records' TTL.
#[derive(Clone, Debug, Default)]
pub struct Zone {
    records: BTreeMap<String, (Vec<Ipv4Addr>, u32)>,
    delays: BTreeMap<String, Duration>,
}

impl Zone {
    /// An empty zone.
    pub fn new() -> Self {
        Self::default()
    }

    /// `name` has the A records `addrs`, with TTL `ttl` seconds.
    pub fn with(mut self, name: &str, addrs: &[Ipv4Addr], ttl: u32) -> Self {
        self.records
            .insert(name.to_ascii_lowercase(), (addrs.to_vec(), ttl));
        self
    }

    /// Queries for `name` (whatever its records) are answered `delay` after they arrive: an
    /// upstream that keeps a resolver waiting.
    pub fn slow(mut self, name: &str, delay: Duration) -> Self {
        self.delays.insert(name.to_ascii_lowercase(), delay);
        self
    }

    /// This zone with every record of `other` too (`other`'s win for a name in both).
    pub fn merged(mut self, other: Zone) -> Self {
        self.records.extend(other.records);
        self.delays.extend(other.delays);
        self
    }

    /// How long the answer to `query` waits.
    fn delay(&self, query: &[u8]) -> Option<Duration> {
        let question = message::question(query).ok()?;
        self.delays.get(&question.name).copied()
    }

    /// The answer to `query`: A records for a known name (none for other types), NXDOMAIN
    /// for an unknown one; `None` for a query that cannot be read.
    pub fn answer(&self, query: &[u8]) -> Option<Vec<u8>> {
        let question = message::question(query).ok()?;
        let Some((addrs, ttl)) = self.records.get(&question.name) else {
            return Some(message::reply_with_rcode(query, question.end, NXDOMAIN));
        };
        let mut reply = message::reply_with_rcode(query, question.end, 0);
        reply[2] |= 0x04; // AA
        if question.qtype != 1 {
            return Some(reply);
        }
        reply[6..8].copy_from_slice(&(addrs.len() as u16).to_be_bytes());
        for addr in addrs {
            // Owner: a pointer to the question's name; type A, class IN.
            reply.extend_from_slice(&[0xc0, HEADER_LEN as u8, 0, 1, 0, 1]);
            reply.extend_from_slice(&ttl.to_be_bytes());
            reply.extend_from_slice(&[0, 4]);
            reply.extend_from_slice(&addr.octets());
        }
        Some(reply)
    }
}

/// A running server. Dropping it stops it.
pub struct TestDnsServer {
    addr: SocketAddr,
    asked: Arc<Mutex<Vec<String>>>,
    _udp: Stoppable,
    _tcp: Stoppable,
}

impl TestDnsServer {
    /// Serves `zone` on sockets already bound (in whatever network namespace they were
    /// made): `udp` and `tcp` on the same address.
    pub fn serve(udp: UdpSocket, tcp: TcpListener, zone: Zone) -> io::Result<Self> {
        let addr = udp.local_addr()?;
        let zone = Arc::new(zone);
        let asked = Arc::new(Mutex::new(Vec::new()));
        let udp_fd = udp.try_clone()?;
        let (z, log) = (zone.clone(), asked.clone());
        let udp_thread = Stoppable::spawn(udp_fd.into(), move |stop| {
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = udp.recv_from(&mut buf) {
                if stop.is_stopped() {
                    return;
                }
                let Some(reply) = answer_logged(&z, &log, &buf[..n]) else {
                    continue;
                };
                match (z.delay(&buf[..n]), udp.try_clone()) {
                    (Some(delay), Ok(later)) => {
                        std::thread::spawn(move || {
                            std::thread::sleep(delay);
                            let _ = later.send_to(&reply, from);
                        });
                    }
                    _ => {
                        let _ = udp.send_to(&reply, from);
                    }
                }
            }
        })?;
        let tcp_fd = tcp.try_clone()?;
        let (z, log) = (zone, asked.clone());
        let tcp_thread = Stoppable::spawn(tcp_fd.into(), move |stop| {
            for stream in tcp.incoming() {
                if stop.is_stopped() {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let (z, log) = (z.clone(), log.clone());
                std::thread::spawn(move || serve_tcp(stream, &z, &log));
            }
        })?;
        Ok(Self {
            addr,
            asked,
            _udp: udp_thread,
            _tcp: tcp_thread,
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The names asked so far, in order.
    pub fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

fn answer_logged(zone: &Zone, log: &Mutex<Vec<String>>, query: &[u8]) -> Option<Vec<u8>> {
    if let Ok(q) = message::question(query) {
        log.lock().unwrap().push(q.name);
    }
    zone.answer(query)
}

fn serve_tcp(mut stream: TcpStream, zone: &Zone, log: &Mutex<Vec<String>>) {
    let mut len = [0u8; 2];
    while stream.read_exact(&mut len).is_ok() {
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if stream.read_exact(&mut query).is_err() {
            return;
        }
        let Some(reply) = answer_logged(zone, log, &query) else {
            return;
        };
        if let Some(delay) = zone.delay(&query) {
            std::thread::sleep(delay);
        }
        let mut out = (reply.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(&reply);
        if stream.write_all(&out).is_err() {
            return;
        }
    }
}

pub use fastbox_runtime::net::dns_forwarder::message::a_query;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zone_answers_known_names_and_nxdomain_for_others() {
        let a = Ipv4Addr::new(192, 0, 2, 1);
        let b = Ipv4Addr::new(192, 0, 2, 2);
        let zone = Zone::new().with("Known.Test", &[a, b], 42);
        let reply = zone.answer(&a_query(7, "known.test")).unwrap();
        assert_eq!(&reply[..2], &[0, 7]);
        assert_eq!(reply[3] & 0x0f, 0);
        assert_eq!(message::a_records(&reply).unwrap(), [(a, 42), (b, 42)]);
        let none = zone.answer(&a_query(8, "other.test")).unwrap();
        assert_eq!(none[3] & 0x0f, NXDOMAIN);
        assert!(zone.answer(&[0u8; 5]).is_none());
    }

    #[test]
    fn slow_names_wait_whatever_their_case_and_merges_keep_them() {
        let zone = Zone::new().merged(Zone::new().slow("Slow.Test", Duration::from_secs(3)));
        assert_eq!(
            zone.delay(&a_query(1, "slow.test")),
            Some(Duration::from_secs(3))
        );
        assert_eq!(zone.delay(&a_query(2, "other.test")), None);
    }
}
