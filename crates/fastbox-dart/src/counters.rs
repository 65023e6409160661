//! Per-node delivery counters, readable as a struct and as Prometheus text.
//!
//! Every counter only grows. What each one counts:
//!
//! | counter | counts |
//! |---|---|
//! | `cache_hits` | block reads answered from this node's own blocks |
//! | `peer_fetches` | blocks this node received, verified, from a peer |
//! | `origin_fetches` | fetches of a block this node started at the origin (one per single flight) |
//! | `peer_served` | 200 responses with a block this node began to send to a peer |
//! | `bytes_verified` | bytes received from a peer or the origin that hashed to their digest |
//! | `peer_failures` | requests to a peer that failed (transport error, timeout, bad status, bad bytes) |
//! | `breaker_trips` | times a peer's circuit breaker opened |
//! | `fallbacks_to_origin` | block reads that went to the origin although another node owns the block |

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::membership::NodeId;

/// A point-in-time copy of a node's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CounterSnapshot {
    /// Reads answered from the node's own blocks.
    pub cache_hits: u64,
    /// Blocks received from a peer.
    pub peer_fetches: u64,
    /// Origin fetches started by this node.
    pub origin_fetches: u64,
    /// Blocks this node began to serve to peers.
    pub peer_served: u64,
    /// Bytes received from a peer or the origin and verified.
    pub bytes_verified: u64,
    /// Failed requests to peers.
    pub peer_failures: u64,
    /// Circuit-breaker openings.
    pub breaker_trips: u64,
    /// Reads that fell back to the origin for a block another node owns.
    pub fallbacks_to_origin: u64,
}

impl CounterSnapshot {
    /// The counters as (metric name, value), in a fixed order.
    pub fn fields(&self) -> [(&'static str, u64); 8] {
        [
            ("cache_hits", self.cache_hits),
            ("peer_fetches", self.peer_fetches),
            ("origin_fetches", self.origin_fetches),
            ("peer_served", self.peer_served),
            ("bytes_verified", self.bytes_verified),
            ("peer_failures", self.peer_failures),
            ("breaker_trips", self.breaker_trips),
            ("fallbacks_to_origin", self.fallbacks_to_origin),
        ]
    }

    /// Prometheus text exposition: `fastbox_dart_<name>_total{node="<id>"} <value>` per
    /// counter, each after its `# TYPE` line.
    pub fn to_prometheus(&self, node: &NodeId) -> String {
        let mut text = String::new();
        for (name, value) in self.fields() {
            // Writing to a String cannot fail.
            let _ = writeln!(text, "# TYPE fastbox_dart_{name}_total counter");
            let _ = writeln!(text, "fastbox_dart_{name}_total{{node=\"{node}\"}} {value}");
        }
        text
    }
}

/// The live counters of one node.
#[derive(Debug, Default)]
pub struct Counters {
    pub(crate) cache_hits: AtomicU64,
    pub(crate) peer_fetches: AtomicU64,
    pub(crate) origin_fetches: AtomicU64,
    pub(crate) peer_served: AtomicU64,
    pub(crate) bytes_verified: AtomicU64,
    pub(crate) peer_failures: AtomicU64,
    pub(crate) breaker_trips: AtomicU64,
    pub(crate) fallbacks_to_origin: AtomicU64,
}

impl Counters {
    /// Add one.
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Add `n`.
    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> CounterSnapshot {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            cache_hits: read(&self.cache_hits),
            peer_fetches: read(&self.peer_fetches),
            origin_fetches: read(&self.origin_fetches),
            peer_served: read(&self.peer_served),
            bytes_verified: read(&self.bytes_verified),
            peer_failures: read(&self.peer_failures),
            breaker_trips: read(&self.breaker_trips),
            fallbacks_to_origin: read(&self.fallbacks_to_origin),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_has_one_typed_line_per_counter() {
        let counters = Counters::default();
        Counters::bump(&counters.cache_hits);
        Counters::add(&counters.bytes_verified, 4096);
        let text = counters
            .snapshot()
            .to_prometheus(&NodeId::try_new("n1").unwrap());
        assert!(text.contains("fastbox_dart_cache_hits_total{node=\"n1\"} 1\n"));
        assert!(text.contains("fastbox_dart_bytes_verified_total{node=\"n1\"} 4096\n"));
        assert!(text.contains("# TYPE fastbox_dart_fallbacks_to_origin_total counter\n"));
        assert_eq!(text.lines().count(), 16);
    }
}
