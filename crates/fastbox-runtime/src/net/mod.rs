//! Network slots: a network namespace with a veth pair, addresses, routes and NAT.
