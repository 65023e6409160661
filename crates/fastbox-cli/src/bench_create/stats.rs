//! What a run measured, reduced to numbers: nearest-rank percentiles of the successful
//! creates and the failures counted by reason.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// The value at rank `ceil(percent / 100 * n)` (1-based) of `sorted`, which is in ascending
/// order; rank 1 at least. None for no samples.
pub fn nearest_rank(sorted: &[f64], percent: u32) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    // Integer arithmetic: `0.99 * 100.0` must not become rank 100 through rounding.
    let rank = (percent as usize * n).div_ceil(100).clamp(1, n);
    Some(sorted[rank - 1])
}

/// Latencies of the successful creates, in milliseconds (None when there were none).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Latency {
    pub p50_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub min_ms: Option<f64>,
    pub max_ms: Option<f64>,
    pub mean_ms: Option<f64>,
}

impl Latency {
    pub fn of(samples: &[Duration]) -> Self {
        let mut ms: Vec<f64> = samples.iter().map(|d| millis(*d)).collect();
        ms.sort_by(f64::total_cmp);
        let mean =
            (!ms.is_empty()).then(|| round_to_micros(ms.iter().sum::<f64>() / ms.len() as f64));
        Self {
            p50_ms: nearest_rank(&ms, 50),
            p90_ms: nearest_rank(&ms, 90),
            p99_ms: nearest_rank(&ms, 99),
            min_ms: ms.first().copied(),
            max_ms: ms.last().copied(),
            mean_ms: mean,
        }
    }
}

/// Milliseconds with microsecond resolution.
pub fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

fn round_to_micros(ms: f64) -> f64 {
    (ms * 1000.0).round() / 1000.0
}

/// Every create's outcome: the latencies of those that became ready, the reasons of those
/// that did not.
#[derive(Debug, Default)]
pub struct Tally {
    pub samples: Vec<Duration>,
    pub failure_reasons: BTreeMap<String, usize>,
    pub delete_failures: usize,
}

impl Tally {
    pub fn failures(&self) -> usize {
        self.failure_reasons.values().sum()
    }

    pub fn merge(&mut self, other: Tally) {
        self.samples.extend(other.samples);
        for (reason, count) in other.failure_reasons {
            *self.failure_reasons.entry(reason).or_default() += count;
        }
        self.delete_failures += other.delete_failures;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_to(n: usize) -> Vec<f64> {
        (1..=n).map(|v| v as f64).collect()
    }

    #[test]
    fn nearest_rank_is_the_value_at_ceil_p_n_over_100() {
        let ten = one_to(10);
        assert_eq!(nearest_rank(&ten, 50), Some(5.0));
        assert_eq!(nearest_rank(&ten, 90), Some(9.0));
        assert_eq!(nearest_rank(&ten, 99), Some(10.0));
        let hundred = one_to(100);
        assert_eq!(nearest_rank(&hundred, 50), Some(50.0));
        assert_eq!(nearest_rank(&hundred, 99), Some(99.0));
        assert_eq!(nearest_rank(&hundred, 100), Some(100.0));
        let six = one_to(6);
        assert_eq!(nearest_rank(&six, 50), Some(3.0));
        assert_eq!(nearest_rank(&six, 90), Some(6.0));
    }

    #[test]
    fn nearest_rank_of_one_sample_is_that_sample_and_of_none_is_none() {
        assert_eq!(nearest_rank(&[7.0], 0), Some(7.0));
        assert_eq!(nearest_rank(&[7.0], 50), Some(7.0));
        assert_eq!(nearest_rank(&[7.0], 99), Some(7.0));
        assert_eq!(nearest_rank(&[], 50), None);
    }

    #[test]
    fn latency_sorts_and_summarises_in_milliseconds() {
        let samples = [30, 10, 20].map(Duration::from_millis);
        let latency = Latency::of(&samples);
        assert_eq!(latency.p50_ms, Some(20.0));
        assert_eq!(latency.p99_ms, Some(30.0));
        assert_eq!(latency.min_ms, Some(10.0));
        assert_eq!(latency.max_ms, Some(30.0));
        assert_eq!(latency.mean_ms, Some(20.0));
        assert_eq!(Latency::of(&[]).p50_ms, None);
    }

    #[test]
    fn tallies_merge_reasons_by_count() {
        let mut a = Tally::default();
        a.failure_reasons.insert("create 429".into(), 2);
        let mut b = Tally::default();
        b.failure_reasons.insert("create 429".into(), 1);
        b.failure_reasons.insert("ready timeout".into(), 1);
        b.samples.push(Duration::from_millis(5));
        a.merge(b);
        assert_eq!(a.failures(), 4);
        assert_eq!(a.failure_reasons["create 429"], 3);
        assert_eq!(a.samples.len(), 1);
    }
}
