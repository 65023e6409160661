//! A circuit breaker per peer, so a failed or slow peer costs one timeout, not one per block.
//!
//! States: **closed** (requests go through; consecutive failures are counted), **open**
//! (after [`BreakerConfig::failures_to_open`] consecutive failures: the peer is skipped
//! until [`BreakerConfig::open_for`] has passed), **half-open** (after that: exactly one
//! request, the probe, goes through; its success closes the breaker, its failure opens it
//! again for another `open_for`). A success in the closed state resets the count. A peer
//! answering 404 ("not held") is healthy: only transport errors, timeouts, bad bodies and
//! unexpected statuses count as failures.
//!
//! Time is passed in (`now`), so the state machine is tested without sleeping.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::membership::NodeId;

/// When a breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker (default 3).
    pub failures_to_open: u32,
    /// How long an open breaker skips its peer before one probe (default 10 s).
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures_to_open: 3,
            open_for: Duration::from_secs(10),
        }
    }
}

/// One peer's breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { probing: bool },
}

/// What recording a failure did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The breaker stays as it was (closed, counting).
    Counted,
    /// The breaker opened now (a trip).
    Tripped,
}

/// The breakers of all peers of one node.
#[derive(Debug)]
pub struct Breakers {
    config: BreakerConfig,
    states: Mutex<HashMap<NodeId, State>>,
}

impl Breakers {
    /// Breakers, all closed.
    pub fn new(config: BreakerConfig) -> Self {
        Breakers {
            config,
            states: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a request to `peer` may go out now. In the half-open state this admits one
    /// probe and refuses the rest until the probe is recorded.
    pub fn allow(&self, peer: &NodeId, now: Instant) -> bool {
        let mut states = self.lock();
        let state = states
            .entry(peer.clone())
            .or_insert(State::Closed { failures: 0 });
        match *state {
            State::Closed { .. } => true,
            State::Open { until } if now < until => false,
            State::Open { .. } | State::HalfOpen { probing: false } => {
                *state = State::HalfOpen { probing: true };
                true
            }
            State::HalfOpen { probing: true } => false,
        }
    }

    /// A request to `peer` succeeded (or the peer answered "not held"): close its breaker.
    pub fn record_success(&self, peer: &NodeId) {
        self.lock()
            .insert(peer.clone(), State::Closed { failures: 0 });
    }

    /// A request to `peer` failed.
    pub fn record_failure(&self, peer: &NodeId, now: Instant) -> Recorded {
        let open = State::Open {
            until: now + self.config.open_for,
        };
        let mut states = self.lock();
        let state = states
            .entry(peer.clone())
            .or_insert(State::Closed { failures: 0 });
        match *state {
            State::Closed { failures } if failures + 1 < self.config.failures_to_open => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                Recorded::Counted
            }
            State::Closed { .. } | State::HalfOpen { .. } => {
                *state = open;
                Recorded::Tripped
            }
            // A request admitted before the breaker opened failed late: it stays open.
            State::Open { .. } => Recorded::Counted,
        }
    }

    /// Whether `peer`'s breaker is open or half-open (for metrics and tests).
    pub fn is_open(&self, peer: &NodeId) -> bool {
        matches!(
            self.lock().get(peer),
            Some(State::Open { .. } | State::HalfOpen { .. })
        )
    }

    /// Forget the breakers of peers that are no longer members.
    pub fn retain(&self, keep: impl Fn(&NodeId) -> bool) {
        self.lock().retain(|peer, _| keep(peer));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, State>> {
        // The map is valid after any panic (every update is a single insert).
        self.states
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (Breakers, NodeId, Instant) {
        let b = Breakers::new(BreakerConfig {
            failures_to_open: 3,
            open_for: Duration::from_secs(10),
        });
        (b, NodeId::try_new("p").unwrap(), Instant::now())
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let (b, p, t) = setup();
        assert_eq!(b.record_failure(&p, t), Recorded::Counted);
        assert_eq!(b.record_failure(&p, t), Recorded::Counted);
        b.record_success(&p);
        assert_eq!(b.record_failure(&p, t), Recorded::Counted);
        assert_eq!(b.record_failure(&p, t), Recorded::Counted);
        assert!(b.allow(&p, t));
        assert_eq!(b.record_failure(&p, t), Recorded::Tripped);
        assert!(b.is_open(&p));
        assert!(!b.allow(&p, t + Duration::from_secs(9)));
    }

    #[test]
    fn half_open_admits_one_probe_whose_outcome_decides() {
        let (b, p, t) = setup();
        for _ in 0..3 {
            b.record_failure(&p, t);
        }
        let later = t + Duration::from_secs(10);
        assert!(b.allow(&p, later), "the probe");
        assert!(!b.allow(&p, later), "only one probe at a time");
        assert_eq!(b.record_failure(&p, later), Recorded::Tripped);
        assert!(!b.allow(&p, later + Duration::from_secs(1)));
        let again = later + Duration::from_secs(10);
        assert!(b.allow(&p, again));
        b.record_success(&p);
        assert!(!b.is_open(&p));
        assert!(b.allow(&p, again) && b.allow(&p, again));
    }

    #[test]
    fn retain_forgets_removed_peers() {
        let (b, p, t) = setup();
        for _ in 0..3 {
            b.record_failure(&p, t);
        }
        b.retain(|_| false);
        assert!(!b.is_open(&p));
        assert!(b.allow(&p, t));
    }
}
