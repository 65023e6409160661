//! Failed credential checks, counted per source address under a global ceiling.
//!
//! Each source has a token bucket holding [`FailureLimits::per_source`] failures that refills
//! at that many per minute; all sources together share one bucket of
//! [`FailureLimits::global`] per minute. A failure takes one token from both. A caller asks
//! [`FailureLimiter::check`] before it checks a guessable credential (a route signature) and
//! answers 429 without checking while either bucket is empty; it reports every failed check
//! with [`FailureLimiter::fail`], which says whether that failure was beyond the allowance.
//! Successes are never counted.
//!
//! A source is an IPv4 address, or the /64 of an IPv6 address (one host easily holds a whole
//! /64). The table of sources is bounded ([`FailureLimits::max_sources`]): sources whose
//! bucket is full again are dropped first, then the one that failed least recently. Nothing
//! is inserted while the global bucket is empty, so a flood from many addresses cannot churn
//! the table faster than the global ceiling.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How many failed checks are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureLimits {
    /// Failed checks per minute from one source (and its burst).
    pub per_source: u32,
    /// Failed checks per minute from all sources together (and their burst).
    pub global: u32,
    /// Sources remembered at most.
    pub max_sources: usize,
}

impl Default for FailureLimits {
    fn default() -> Self {
        Self {
            per_source: 20,
            global: 1000,
            max_sources: 4096,
        }
    }
}

/// Which allowance is used up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitedBy {
    /// This source's.
    Source,
    /// Everyone's together.
    Global,
}

/// Too many failed checks: try again after `retry_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub by: LimitedBy,
    pub retry_after: Duration,
}

impl Limited {
    /// `retry_after` in whole seconds, at least 1 (for a `Retry-After` header).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }
}

/// The failure counters of one proxy process. See the module docs.
#[derive(Debug)]
pub struct FailureLimiter {
    limits: FailureLimits,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    global: Bucket,
    sources: HashMap<Source, Bucket>,
}

/// Who is counted: an IPv4 address or an IPv6 /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    V4(u32),
    V6(u64),
}

impl Source {
    fn of(addr: IpAddr) -> Self {
        match addr.to_canonical() {
            IpAddr::V4(v4) => Self::V4(u32::from(v4)),
            IpAddr::V6(v6) => Self::V6((u128::from(v6) >> 64) as u64),
        }
    }
}

/// Tokens of a bucket of `capacity` that refills `capacity` per minute.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    /// When `tokens` was last brought up to date.
    at: Instant,
    /// The last failure counted (for eviction).
    last_failure: Instant,
}

impl Bucket {
    fn full(capacity: u32, now: Instant) -> Self {
        Self {
            tokens: f64::from(capacity),
            at: now,
            last_failure: now,
        }
    }

    fn refill(&mut self, capacity: u32, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        let capacity = f64::from(capacity);
        self.tokens = (self.tokens + elapsed * capacity / 60.0).min(capacity);
        self.at = now;
    }

    fn is_empty(&self) -> bool {
        self.tokens < 1.0
    }

    fn is_full(&self, capacity: u32) -> bool {
        self.tokens >= f64::from(capacity)
    }

    /// Takes one token; whether there was one.
    fn take(&mut self, now: Instant) -> bool {
        let had = !self.is_empty();
        self.tokens = (self.tokens - 1.0).max(0.0);
        self.last_failure = now;
        had
    }

    /// How long until one token is back.
    fn wait(&self, capacity: u32) -> Duration {
        if capacity == 0 {
            return Duration::from_secs(60);
        }
        let missing = (1.0 - self.tokens).max(0.0);
        Duration::from_secs_f64(missing * 60.0 / f64::from(capacity))
    }
}

impl FailureLimiter {
    pub fn new(limits: FailureLimits) -> Self {
        let now = Instant::now();
        Self {
            limits,
            state: Mutex::new(State {
                global: Bucket::full(limits.global, now),
                sources: HashMap::new(),
            }),
        }
    }

    pub fn limits(&self) -> FailureLimits {
        self.limits
    }

    /// Whether a credential check from `source` may run now.
    pub fn check(&self, source: IpAddr) -> Result<(), Limited> {
        self.check_at(source, Instant::now())
    }

    /// Counts a failed check from `source`. `Err` when it was beyond the allowance (the
    /// source's or the global bucket was empty already): answer 429 rather than 401.
    pub fn fail(&self, source: IpAddr) -> Result<(), Limited> {
        self.fail_at(source, Instant::now())
    }

    /// [`FailureLimiter::check`] at `now`.
    pub fn check_at(&self, source: IpAddr, now: Instant) -> Result<(), Limited> {
        let limits = self.limits;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(bucket) = state.sources.get_mut(&Source::of(source)) {
            bucket.refill(limits.per_source, now);
            if bucket.is_empty() {
                return Err(Limited {
                    by: LimitedBy::Source,
                    retry_after: bucket.wait(limits.per_source),
                });
            }
        } else if limits.per_source == 0 {
            return Err(Limited {
                by: LimitedBy::Source,
                retry_after: Duration::from_secs(60),
            });
        }
        state.global.refill(limits.global, now);
        if state.global.is_empty() {
            return Err(Limited {
                by: LimitedBy::Global,
                retry_after: state.global.wait(limits.global),
            });
        }
        Ok(())
    }

    /// [`FailureLimiter::fail`] at `now`.
    pub fn fail_at(&self, source: IpAddr, now: Instant) -> Result<(), Limited> {
        let limits = self.limits;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.global.refill(limits.global, now);
        let global_had = state.global.take(now);
        let key = Source::of(source);
        if !state.sources.contains_key(&key) {
            if !global_had {
                // The global ceiling answers for everyone: nothing new is remembered.
                return Err(Limited {
                    by: LimitedBy::Global,
                    retry_after: state.global.wait(limits.global),
                });
            }
            state.make_room(limits, now);
            state
                .sources
                .insert(key, Bucket::full(limits.per_source, now));
        }
        let bucket = state.sources.get_mut(&key).expect("inserted above");
        bucket.refill(limits.per_source, now);
        if !bucket.take(now) {
            return Err(Limited {
                by: LimitedBy::Source,
                retry_after: bucket.wait(limits.per_source),
            });
        }
        if !global_had {
            return Err(Limited {
                by: LimitedBy::Global,
                retry_after: state.global.wait(limits.global),
            });
        }
        Ok(())
    }

    /// Sources remembered now.
    pub fn sources(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .sources
            .len()
    }
}

impl State {
    /// Makes room for one more source: drops the sources whose bucket is full again (they
    /// are no different from unknown ones), then, if still full, the least recent failure.
    fn make_room(&mut self, limits: FailureLimits, now: Instant) {
        if self.sources.len() < limits.max_sources.max(1) {
            return;
        }
        self.sources.retain(|_, bucket| {
            bucket.refill(limits.per_source, now);
            !bucket.is_full(limits.per_source)
        });
        while self.sources.len() >= limits.max_sources.max(1) {
            let oldest = self
                .sources
                .iter()
                .min_by_key(|(_, bucket)| bucket.last_failure)
                .map(|(key, _)| *key);
            match oldest {
                Some(key) => {
                    self.sources.remove(&key);
                }
                None => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(192, 0, 2, last))
    }

    fn limits(per_source: u32, global: u32, max_sources: usize) -> FailureLimits {
        FailureLimits {
            per_source,
            global,
            max_sources,
        }
    }

    #[test]
    fn a_source_gets_its_allowance_then_waits_for_the_refill() {
        let limiter = FailureLimiter::new(limits(20, 1000, 100));
        let t0 = Instant::now();
        for i in 0..20 {
            assert_eq!(limiter.check_at(ip(1), t0), Ok(()), "check {i}");
            assert_eq!(limiter.fail_at(ip(1), t0), Ok(()), "failure {i}");
        }
        // The 21st check is refused before it runs, and a failure beyond is reported.
        let refused = limiter.check_at(ip(1), t0).unwrap_err();
        assert_eq!(refused.by, LimitedBy::Source);
        assert_eq!(refused.retry_after_secs(), 3);
        assert_eq!(
            limiter.fail_at(ip(1), t0).unwrap_err().by,
            LimitedBy::Source
        );
        // Other sources are not affected.
        assert_eq!(limiter.check_at(ip(2), t0), Ok(()));
        // 20 per minute: one more after 3 s.
        let later = t0 + Duration::from_secs(3);
        assert_eq!(limiter.check_at(ip(1), later), Ok(()));
        assert_eq!(limiter.fail_at(ip(1), later), Ok(()));
        assert!(limiter.check_at(ip(1), later).is_err());
        // After a minute the whole allowance is back.
        let minute = later + Duration::from_secs(60);
        for _ in 0..20 {
            assert_eq!(limiter.fail_at(ip(1), minute), Ok(()));
        }
        assert!(limiter.check_at(ip(1), minute).is_err());
    }

    #[test]
    fn the_global_ceiling_holds_for_every_source() {
        let limiter = FailureLimiter::new(limits(5, 12, 100));
        let t0 = Instant::now();
        // Four sources, three failures each: 12, the ceiling.
        for source in 1..=4 {
            for _ in 0..3 {
                assert_eq!(limiter.fail_at(ip(source), t0), Ok(()));
            }
        }
        // Everyone is refused now, also sources that never failed; nothing new is
        // remembered.
        for source in [1, 9] {
            let refused = limiter.check_at(ip(source), t0).unwrap_err();
            assert_eq!(refused.by, LimitedBy::Global, "{source}");
        }
        assert_eq!(
            limiter.fail_at(ip(9), t0).unwrap_err().by,
            LimitedBy::Global
        );
        assert_eq!(limiter.sources(), 4);
        // 12 per minute: one check again after 5 s.
        let later = t0 + Duration::from_secs(5);
        assert_eq!(limiter.check_at(ip(9), later), Ok(()));
    }

    #[test]
    fn the_source_table_is_bounded_and_forgets_the_oldest() {
        let limiter = FailureLimiter::new(limits(3, 1_000_000, 4));
        let t0 = Instant::now();
        // Sources 1..=4 each use up their allowance, 1 first.
        for source in 1..=4u8 {
            let at = t0 + Duration::from_millis(u64::from(source));
            for _ in 0..3 {
                limiter.fail_at(ip(source), at).unwrap();
            }
            assert!(limiter.check_at(ip(source), at).is_err());
        }
        assert_eq!(limiter.sources(), 4);
        // A fifth source evicts the least recent one (1), which starts afresh.
        let at = t0 + Duration::from_millis(10);
        limiter.fail_at(ip(5), at).unwrap();
        assert_eq!(limiter.sources(), 4);
        assert_eq!(limiter.check_at(ip(1), at), Ok(()));
        assert!(limiter.check_at(ip(2), at).is_err());
        // Sources whose bucket is full again go before any that is still counting: 5 fails
        // again 30 s later, so a minute after the others it is still counting.
        let half = t0 + Duration::from_secs(30);
        limiter.fail_at(ip(5), half).unwrap();
        limiter.fail_at(ip(5), half).unwrap();
        let refilled = t0 + Duration::from_secs(61);
        limiter.fail_at(ip(6), refilled).unwrap();
        assert_eq!(limiter.sources(), 2, "5 and 6 remain");
        assert!(limiter.check_at(ip(5), refilled).is_ok());
        // Never more than the bound, whatever the number of sources.
        for source in 0..=255u8 {
            limiter.fail_at(ip(source), refilled).unwrap();
            assert!(limiter.sources() <= 4);
        }
    }

    #[test]
    fn ipv6_sources_are_counted_by_their_64() {
        let limiter = FailureLimiter::new(limits(2, 1000, 100));
        let t0 = Instant::now();
        let a: IpAddr = "2001:db8:1:2::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:ffff::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        limiter.fail_at(a, t0).unwrap();
        limiter.fail_at(b, t0).unwrap();
        assert!(limiter.check_at(a, t0).is_err());
        assert_eq!(limiter.check_at(other, t0), Ok(()));
        // An IPv4-mapped address is its IPv4 address.
        let v4 = ip(7);
        let mapped = IpAddr::V6(Ipv4Addr::new(192, 0, 2, 7).to_ipv6_mapped());
        limiter.fail_at(v4, t0).unwrap();
        limiter.fail_at(mapped, t0).unwrap();
        assert!(limiter.check_at(v4, t0).is_err());
        assert_eq!(
            limiter.check_at(IpAddr::V6(Ipv6Addr::LOCALHOST), t0),
            Ok(())
        );
    }
}
