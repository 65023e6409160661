//! The result of a run: one JSON object (`--json`), or a few lines for a terminal.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::request::{Pool, Source};
use super::stats::{Latency, Tally};

/// Everything a run reports. Latencies are of the successful creates only (null when none
/// succeeded); `failures` is `failure_reasons` summed.
#[derive(Debug, Serialize)]
pub struct Report {
    pub n: usize,
    pub concurrency: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    pub pool: Pool,
    /// Seconds between batches; null when workers ran back to back.
    pub batch_pause_s: Option<f64>,
    pub warmup: usize,
    pub warmup_failures: usize,
    pub ready_timeout_s: f64,
    pub ok: usize,
    #[serde(flatten)]
    pub latency: Latency,
    pub failures: usize,
    pub failure_reasons: BTreeMap<String, usize>,
    /// Deletes that failed (outside the timed region; not counted in `failures`).
    pub delete_failures: usize,
    /// The timed phase from its first create to its last delete, pauses included.
    pub wall_s: f64,
    /// Successful creates per second of `wall_s`.
    pub throughput_per_s: f64,
}

/// How the run was configured, as the report repeats it.
pub struct Settings<'a> {
    pub concurrency: usize,
    pub source: &'a Source,
    pub pool: Pool,
    pub batch_pause: Option<Duration>,
    pub warmup: usize,
    pub ready_timeout: Duration,
}

impl Report {
    pub fn new(settings: &Settings, warmup_failures: usize, tally: Tally, wall: Duration) -> Self {
        let (image, template) = match settings.source {
            Source::Image(image) => (Some(image.clone()), None),
            Source::Template(id) => (None, Some(id.clone())),
        };
        let ok = tally.samples.len();
        let wall_s = wall.as_secs_f64();
        Self {
            n: ok + tally.failures(),
            concurrency: settings.concurrency,
            image,
            template,
            pool: settings.pool,
            batch_pause_s: settings.batch_pause.map(|p| p.as_secs_f64()),
            warmup: settings.warmup,
            warmup_failures,
            ready_timeout_s: settings.ready_timeout.as_secs_f64(),
            ok,
            latency: Latency::of(&tally.samples),
            failures: tally.failures(),
            delete_failures: tally.delete_failures,
            failure_reasons: tally.failure_reasons,
            wall_s: (wall_s * 1000.0).round() / 1000.0,
            throughput_per_s: if wall_s > 0.0 {
                ((ok as f64 / wall_s) * 100.0).round() / 100.0
            } else {
                0.0
            },
        }
    }

    /// The report for a terminal.
    pub fn human(&self) -> String {
        let source = match (&self.image, &self.template) {
            (Some(image), _) => format!("image {image}"),
            (_, Some(template)) => format!("template {template}"),
            _ => String::new(),
        };
        let pace = match self.batch_pause_s {
            Some(pause) => format!("batches with {pause} s pauses"),
            None => "back to back".to_string(),
        };
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
        let mut out = format!(
            "create -> execd /ping 200: {source}, n={}, concurrency {}, {pace}, pool {}, \
             {} warm-up(s)\n",
            self.n, self.concurrency, self.pool, self.warmup
        );
        let l = &self.latency;
        out += &format!(
            "  p50 {}  p90 {}  p99 {}  (min {}, max {}, mean {})\n",
            ms(l.p50_ms),
            ms(l.p90_ms),
            ms(l.p99_ms),
            ms(l.min_ms),
            ms(l.max_ms),
            ms(l.mean_ms)
        );
        out += &format!(
            "  {} ok, {} failed; wall {:.2} s, {:.1} creates/s\n",
            self.ok, self.failures, self.wall_s, self.throughput_per_s
        );
        for (reason, count) in &self.failure_reasons {
            out += &format!("  failed: {count} x {reason}\n");
        }
        if self.warmup_failures > 0 {
            out += &format!("  warm-ups failed: {}\n", self.warmup_failures);
        }
        if self.delete_failures > 0 {
            out += &format!("  deletes failed: {}\n", self.delete_failures);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(source: &Source) -> Settings<'_> {
        Settings {
            concurrency: 2,
            source,
            pool: Pool::Off,
            batch_pause: None,
            warmup: 1,
            ready_timeout: Duration::from_secs(60),
        }
    }

    #[test]
    fn the_json_has_the_documented_keys() {
        let source = Source::Image("fastbox/busybox".into());
        let tally = Tally {
            samples: [10, 20].map(Duration::from_millis).to_vec(),
            failure_reasons: [("create 429".to_string(), 1)].into(),
            delete_failures: 0,
        };
        let report = Report::new(&settings(&source), 0, tally, Duration::from_secs(2));
        let json = serde_json::to_value(&report).unwrap();
        for key in [
            "n",
            "concurrency",
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "min_ms",
            "max_ms",
            "mean_ms",
            "failures",
            "failure_reasons",
            "wall_s",
            "throughput_per_s",
        ] {
            assert!(json.get(key).is_some(), "no {key} in {json}");
        }
        assert_eq!(json["n"], 3);
        assert_eq!(json["failures"], 1);
        assert_eq!(json["pool"], "off");
        assert_eq!(json["throughput_per_s"], 1.0);
        assert!(json.get("template").is_none());
    }

    #[test]
    fn a_run_without_successes_reports_null_latencies() {
        let source = Source::Template("t".into());
        let mut tally = Tally::default();
        tally.failure_reasons.insert("create 400".into(), 3);
        let report = Report::new(&settings(&source), 0, tally, Duration::from_secs(1));
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["p50_ms"].is_null());
        assert_eq!(json["failures"], 3);
        assert!(report.human().contains("3 x create 400"));
    }
}
