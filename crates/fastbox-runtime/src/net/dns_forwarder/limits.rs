//! What the forwarder serves at once: all clients together, and each client (source
//! address) on its own, so one sandbox cannot take the forwarder from the others.
//!
//! Every UDP query and every TCP connection runs on its own worker thread, so the global
//! ceiling bounds the threads. A client's budget bounds its open TCP connections and its
//! queries in flight (UDP and TCP together: a TCP connection asks one query at a time). A
//! [`Permit`] holds its share until it is dropped.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// The caps (see [`super::DnsForwarderConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Worker threads (UDP queries plus TCP connections), all clients together.
    pub global: usize,
    /// Open TCP connections per client.
    pub tcp_per_client: usize,
    /// Queries in flight per client, UDP and TCP.
    pub queries_per_client: usize,
}

/// What a permit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One UDP query: a worker thread and one of the client's queries.
    UdpQuery,
    /// One TCP connection: a worker thread and one of the client's connections.
    TcpConnection,
    /// One query on a TCP connection the client holds (its thread is the connection's).
    TcpQuery,
}

/// Which cap refused a permit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The forwarder is busy with all clients together.
    Global,
    /// This client has used its own budget.
    Client,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    tcp: usize,
    queries: usize,
}

#[derive(Debug, Default)]
struct State {
    workers: usize,
    clients: HashMap<IpAddr, Counts>,
}

/// The forwarder's accounting, shared by the loop and the workers.
#[derive(Debug)]
pub struct Limits {
    caps: Caps,
    state: Mutex<State>,
}

impl Limits {
    pub fn new(caps: Caps) -> Arc<Self> {
        Arc::new(Self {
            caps,
            state: Mutex::new(State::default()),
        })
    }

    /// A permit of `kind` for `client`, or which cap is reached.
    pub fn acquire(self: &Arc<Self>, client: IpAddr, kind: Kind) -> Result<Permit, Refused> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let counts = state.clients.get(&client).copied().unwrap_or_default();
        let worker = kind != Kind::TcpQuery;
        let client_full = match kind {
            Kind::UdpQuery | Kind::TcpQuery => counts.queries >= self.caps.queries_per_client,
            Kind::TcpConnection => counts.tcp >= self.caps.tcp_per_client,
        };
        if client_full {
            return Err(Refused::Client);
        }
        if worker && state.workers >= self.caps.global {
            return Err(Refused::Global);
        }
        if worker {
            state.workers += 1;
        }
        let entry = state.clients.entry(client).or_default();
        match kind {
            Kind::UdpQuery | Kind::TcpQuery => entry.queries += 1,
            Kind::TcpConnection => entry.tcp += 1,
        }
        Ok(Permit {
            limits: self.clone(),
            client,
            kind,
        })
    }

    fn release(&self, client: IpAddr, kind: Kind) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if kind != Kind::TcpQuery {
            state.workers = state.workers.saturating_sub(1);
        }
        if let Some(entry) = state.clients.get_mut(&client) {
            match kind {
                Kind::UdpQuery | Kind::TcpQuery => entry.queries = entry.queries.saturating_sub(1),
                Kind::TcpConnection => entry.tcp = entry.tcp.saturating_sub(1),
            }
            if *entry == Counts::default() {
                state.clients.remove(&client);
            }
        }
    }

    /// Worker threads in use and clients with anything in flight (for tests).
    #[cfg(test)]
    fn in_use(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap();
        (state.workers, state.clients.len())
    }
}

/// A share of the caps; given back when dropped.
#[derive(Debug)]
pub struct Permit {
    limits: Arc<Limits>,
    client: IpAddr,
    kind: Kind,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limits.release(self.client, self.kind);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn caps() -> Caps {
        Caps {
            global: 5,
            tcp_per_client: 2,
            queries_per_client: 3,
        }
    }

    fn ip(last: u8) -> IpAddr {
        Ipv4Addr::new(10, 88, 0, last).into()
    }

    #[test]
    fn each_client_has_its_own_budget_of_connections_and_queries() {
        let limits = Limits::new(caps());
        let conns: Vec<_> = (0..2)
            .map(|_| limits.acquire(ip(1), Kind::TcpConnection).unwrap())
            .collect();
        assert_eq!(
            limits.acquire(ip(1), Kind::TcpConnection).unwrap_err(),
            Refused::Client
        );
        // UDP and TCP queries share the client's query budget.
        let q1 = limits.acquire(ip(1), Kind::UdpQuery).unwrap();
        let q2 = limits.acquire(ip(1), Kind::TcpQuery).unwrap();
        let q3 = limits.acquire(ip(1), Kind::TcpQuery).unwrap();
        assert_eq!(
            limits.acquire(ip(1), Kind::UdpQuery).unwrap_err(),
            Refused::Client
        );
        assert_eq!(
            limits.acquire(ip(1), Kind::TcpQuery).unwrap_err(),
            Refused::Client
        );
        // Another client is not affected.
        let other = limits.acquire(ip(3), Kind::UdpQuery).unwrap();
        // A TCP query runs on its connection's thread: 2 connections + 1 UDP + other's UDP.
        assert_eq!(limits.in_use(), (4, 2));
        drop((q1, q2, q3));
        let again = limits.acquire(ip(1), Kind::UdpQuery).unwrap();
        drop((conns, again, other));
        assert_eq!(limits.in_use(), (0, 0), "nothing left behind");
    }

    #[test]
    fn the_global_ceiling_holds_for_all_clients_together() {
        let limits = Limits::new(caps());
        let held: Vec<_> = (1..=5)
            .map(|n| limits.acquire(ip(n), Kind::UdpQuery).unwrap())
            .collect();
        assert_eq!(
            limits.acquire(ip(9), Kind::UdpQuery).unwrap_err(),
            Refused::Global
        );
        assert_eq!(
            limits.acquire(ip(9), Kind::TcpConnection).unwrap_err(),
            Refused::Global
        );
        // A query on a connection already held needs no new thread.
        let conn_client = ip(1);
        drop(held);
        let conn = limits.acquire(conn_client, Kind::TcpConnection).unwrap();
        let fill: Vec<_> = (2..=5)
            .map(|n| limits.acquire(ip(n), Kind::UdpQuery).unwrap())
            .collect();
        assert!(limits.acquire(conn_client, Kind::TcpQuery).is_ok());
        drop((conn, fill));
        assert_eq!(limits.in_use(), (0, 0));
    }
}
