//! `GET /metrics`: the phases of every sandbox start (pool claims and restores) as Prometheus
//! histograms, so the timings that logs and sandbox events show one by one can be watched in
//! aggregate.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use fastbox_fastlet::StartReport;

/// Upper bounds of the histogram buckets, in seconds.
const BUCKETS: [f64; 11] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0,
];

#[derive(Debug, Default, Clone)]
struct Histogram {
    buckets: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, took: Duration) {
        let seconds = took.as_secs_f64();
        for (bound, n) in BUCKETS.iter().zip(self.buckets.iter_mut()) {
            if seconds <= *bound {
                *n += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

/// Start phases by (source, phase); `total` is the whole start.
#[derive(Debug, Default)]
pub struct StartMetrics {
    phases: Mutex<BTreeMap<(String, String), Histogram>>,
}

impl StartMetrics {
    pub fn record(&self, report: &StartReport) {
        let mut phases = self.phases.lock().expect("metrics lock");
        let mut observe = |phase: &str, took: Duration| {
            phases
                .entry((report.source.clone(), phase.to_string()))
                .or_default()
                .observe(took);
        };
        for (phase, took, _) in report.phases.all() {
            observe(phase, took);
        }
        observe("total", report.phases.total());
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let phases = self.phases.lock().expect("metrics lock");
        let name = "fastbox_start_phase_seconds";
        let mut out = String::new();
        writeln!(out, "# HELP {name} Phases of sandbox starts (source pool: a warm-pool claim; restore: a restore of a golden checkpoint; phase total: the whole start).").unwrap();
        writeln!(out, "# TYPE {name} histogram").unwrap();
        for ((source, phase), h) in phases.iter() {
            let labels = format!("source=\"{source}\",phase=\"{phase}\"");
            for (bound, n) in BUCKETS.iter().zip(h.buckets.iter()) {
                writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {n}").unwrap();
            }
            writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count).unwrap();
            writeln!(out, "{name}_sum{{{labels}}} {}", h.sum).unwrap();
            writeln!(out, "{name}_count{{{labels}}} {}", h.count).unwrap();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_fastlet::phases::Phases;

    #[test]
    fn phases_and_totals_become_cumulative_histograms() {
        let metrics = StartMetrics::default();
        let mut phases = Phases::default();
        phases.push("acquire", Duration::from_micros(10));
        phases.push("claim", Duration::from_millis(3));
        let report = StartReport {
            source: "pool".into(),
            phases,
        };
        metrics.record(&report);
        metrics.record(&report);
        let text = metrics.render();
        assert!(text.contains("# TYPE fastbox_start_phase_seconds histogram"));
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"claim\",le=\"0.002\"} 0"
        ));
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"claim\",le=\"0.005\"} 2"
        ));
        assert!(
            text.contains("fastbox_start_phase_seconds_count{source=\"pool\",phase=\"total\"} 2")
        );
        assert!(text.contains(
            "fastbox_start_phase_seconds_bucket{source=\"pool\",phase=\"acquire\",le=\"+Inf\"} 2"
        ));
    }
}
