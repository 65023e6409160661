//! The result of a run: one summary per metric (nearest-rank percentiles, as `bench create`
//! computes them), as one JSON object (`--json`) or a table.

use std::time::Duration;

use serde::{Serialize, Serializer};

use crate::bench_create::stats::{millis, nearest_rank};

use super::Settings;
use super::fastbox::Taken;
use super::message::Cost;
use super::runc;

/// One metric over a run's samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metric {
    pub metric: &'static str,
    /// What it is, for a terminal.
    #[serde(skip)]
    pub label: String,
    pub unit: &'static str,
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Metric {
    /// The summary of `values`; None when there are none.
    pub fn of(
        metric: &'static str,
        label: impl Into<String>,
        unit: &'static str,
        values: impl IntoIterator<Item = f64>,
    ) -> Option<Self> {
        let mut sorted: Vec<f64> = values.into_iter().collect();
        sorted.sort_by(f64::total_cmp);
        let at = |percent| nearest_rank(&sorted, percent);
        Some(Self {
            metric,
            label: label.into(),
            unit,
            n: sorted.len(),
            p50: at(50)?,
            p90: at(90)?,
            p99: at(99)?,
            min: *sorted.first()?,
            max: *sorted.last()?,
        })
    }

    fn ms(
        metric: &'static str,
        label: impl Into<String>,
        samples: impl IntoIterator<Item = Duration>,
    ) -> Option<Self> {
        Self::of(metric, label, "ms", samples.into_iter().map(millis))
    }
}

/// What the fastbox side measured.
#[derive(Default)]
pub struct FastboxSeries {
    /// The source workload's RSS once it had allocated.
    pub rss_mib: f64,
    pub snapshots: Vec<Taken>,
    /// `POST .../pause` until `Paused`, and what the server says the checkpoint cost.
    pub pauses: Vec<(Duration, Cost)>,
    pub resumes: Vec<Duration>,
    pub creates: Vec<Duration>,
    pub forks: Vec<Duration>,
}

/// What became of the runc baseline.
#[derive(Debug)]
pub enum Baseline {
    Ran(runc::Series),
    /// Not run, and why (no runc, not root, `--no-runc`).
    Skipped(String),
    /// It ran and failed.
    Failed(String),
}

impl Serialize for Baseline {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let value = match self {
            Self::Ran(series) => {
                serde_json::json!({"status": "ran", "rss_mib": round3(series.rss_mib)})
            }
            Self::Skipped(reason) => serde_json::json!({"status": "skipped", "reason": reason}),
            Self::Failed(reason) => serde_json::json!({"status": "failed", "reason": reason}),
        };
        value.serialize(serializer)
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub settings: Settings,
    pub source_rss_mib: f64,
    pub metrics: Vec<Metric>,
    pub runc_baseline: Baseline,
    /// Host state of the baseline still present after its clean-up (empty when clean).
    pub leftovers: Vec<String>,
}

impl Report {
    pub fn new(
        settings: Settings,
        fastbox: &FastboxSeries,
        runc_baseline: Baseline,
        leftovers: Vec<String>,
    ) -> Self {
        let mut metrics = fastbox_metrics(fastbox, settings.fork_count);
        if let Baseline::Ran(series) = &runc_baseline {
            metrics.extend(runc_metrics(series));
        }
        Self {
            settings,
            source_rss_mib: round3(fastbox.rss_mib),
            metrics,
            runc_baseline,
            leftovers,
        }
    }

    /// The report for a terminal.
    pub fn human(&self) -> String {
        let mut out = format!(
            "snapshots of a sandbox of {} whose {} workload holds {} MiB (RSS {:.1} MiB), n={}, \
             fork of {} x {}\n",
            self.settings.image,
            self.settings.workload,
            self.settings.memory_mib,
            self.source_rss_mib,
            self.settings.n,
            self.settings.fork_count,
            self.settings.fork_rounds
        );
        out += &format!(
            "{:<52} {:<6} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
            "metric", "unit", "n", "p50", "p90", "p99", "min", "max"
        );
        for m in &self.metrics {
            out += &format!(
                "{:<52} {:<6} {:>3} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}\n",
                m.label, m.unit, m.n, m.p50, m.p90, m.p99, m.min, m.max
            );
        }
        out += &match &self.runc_baseline {
            Baseline::Ran(series) => format!(
                "runc baseline: ran (container process RSS {:.1} MiB)\n",
                series.rss_mib
            ),
            Baseline::Skipped(reason) => format!("runc baseline: skipped: {reason}\n"),
            Baseline::Failed(reason) => format!("runc baseline: FAILED: {reason}\n"),
        };
        for leftover in &self.leftovers {
            out += &format!("left on the host: {leftover}\n");
        }
        out
    }
}

fn fastbox_metrics(s: &FastboxSeries, fork_count: u32) -> Vec<Metric> {
    let costs = || s.snapshots.iter().map(|t| t.cost);
    let pause_s_per_gib = s
        .pauses
        .iter()
        .filter(|(_, cost)| cost.mib > 0.0)
        .map(|(wall, cost)| round3(wall.as_secs_f64() / (cost.mib / 1024.0)));
    [
        Metric::of(
            "snapshot_frozen_ms",
            "live snapshot: frozen (CRIU frozen_time)",
            "ms",
            costs().filter_map(|c| c.frozen_ms),
        ),
        Metric::of(
            "snapshot_dump_ms",
            "live snapshot: criu dump",
            "ms",
            costs().map(|c| c.dump_ms),
        ),
        Metric::of(
            "snapshot_node_total_ms",
            "live snapshot: node total (server message)",
            "ms",
            costs().map(|c| c.total_ms),
        ),
        Metric::ms(
            "snapshot_to_ready_ms",
            "live snapshot: POST -> Ready",
            s.snapshots.iter().map(|t| t.wall),
        ),
        Metric::of(
            "snapshot_size_mib",
            "live snapshot: size",
            "MiB",
            costs().map(|c| c.mib),
        ),
        Metric::ms(
            "pause_to_paused_ms",
            "pause: POST -> Paused",
            s.pauses.iter().map(|(wall, _)| *wall),
        ),
        Metric::of(
            "pause_s_per_gib",
            "pause: POST -> Paused per GiB of checkpoint",
            "s/GiB",
            pause_s_per_gib,
        ),
        Metric::of(
            "pause_size_mib",
            "pause: checkpoint size",
            "MiB",
            s.pauses.iter().map(|(_, cost)| cost.mib),
        ),
        Metric::ms(
            "resume_to_ready_ms",
            "resume: POST -> execd /ping 200",
            s.resumes.iter().copied(),
        ),
        Metric::ms(
            "create_from_snapshot_ms",
            "create from snapshot: POST -> execd /ping 200",
            s.creates.iter().copied(),
        ),
        Metric::ms(
            "fork_to_ready_ms",
            format!("fork of {fork_count}: POST -> all answer /ping"),
            s.forks.iter().copied(),
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn runc_metrics(s: &runc::Series) -> Vec<Metric> {
    let frozen = |checkpoints: &[runc::Checkpoint]| {
        checkpoints
            .iter()
            .filter_map(|c| c.stats)
            .map(|stats| Duration::from_micros(stats.frozen_time_us))
            .collect::<Vec<_>>()
    };
    let written_mib = s
        .disk
        .iter()
        .filter_map(|c| c.stats)
        .map(|stats| round3(stats.pages_written as f64 * 4096.0 / (1024.0 * 1024.0)));
    let mut metrics = Vec::new();
    for (place, names, checkpoints) in [
        (
            "tmpfs",
            ["runc_tmpfs_frozen_ms", "runc_tmpfs_checkpoint_ms"],
            &s.tmpfs,
        ),
        (
            "disk",
            ["runc_disk_frozen_ms", "runc_disk_checkpoint_ms"],
            &s.disk,
        ),
    ] {
        let label = format!("runc checkpoint --leave-running to {place}");
        metrics.extend(Metric::ms(
            names[0],
            format!("{label}: frozen"),
            frozen(checkpoints),
        ));
        metrics.extend(Metric::ms(
            names[1],
            format!("{label}: wall"),
            checkpoints.iter().map(|c| c.wall),
        ));
    }
    metrics.extend(
        [
            Metric::of(
                "runc_pages_written_mib",
                "runc checkpoint: memory pages written",
                "MiB",
                written_mib,
            ),
            Metric::ms(
                "runc_restore_ms",
                "runc restore -d (until it returns)",
                s.restores.iter().map(|r| r.wall),
            ),
            Metric::ms(
                "runc_restore_criu_ms",
                "runc restore: CRIU restore_time",
                s.restores
                    .iter()
                    .filter_map(|r| r.stats)
                    .map(|stats| Duration::from_micros(stats.restore_time_us)),
            ),
        ]
        .into_iter()
        .flatten(),
    );
    metrics
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_snapshot::Workload;
    use fastbox_runtime::criu_stats::DumpStats;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn cost(frozen: Option<f64>, mib: f64) -> Cost {
        Cost {
            frozen_ms: frozen,
            dump_ms: 10.0,
            total_ms: 20.0,
            mib,
        }
    }

    fn settings() -> Settings {
        Settings {
            image: "python:3.12".into(),
            workload: Workload::Python,
            memory_mib: 256,
            n: 3,
            fork_count: 10,
            fork_rounds: 1,
        }
    }

    #[test]
    fn metrics_are_nearest_rank_and_empty_series_are_left_out() {
        let m = Metric::of("x", "x", "ms", [30.0, 10.0, 20.0]).unwrap();
        assert_eq!(
            (m.n, m.p50, m.p90, m.p99, m.min, m.max),
            (3, 20.0, 30.0, 30.0, 10.0, 30.0)
        );
        let twenty = Metric::of("y", "y", "ms", (1..=20).map(f64::from)).unwrap();
        assert_eq!((twenty.p50, twenty.p90, twenty.p99), (10.0, 18.0, 20.0));
        assert_eq!(Metric::of("z", "z", "ms", []), None);
    }

    #[test]
    fn the_json_has_one_object_per_metric() {
        let fastbox = FastboxSeries {
            rss_mib: 262.5,
            snapshots: [(100, Some(40.0)), (120, None), (110, Some(50.0))]
                .map(|(wall, frozen)| Taken {
                    id: "s".into(),
                    wall: ms(wall),
                    cost: cost(frozen, 262.0),
                })
                .into(),
            pauses: vec![(ms(512), cost(Some(1.0), 512.0))],
            resumes: vec![ms(60)],
            creates: vec![ms(30), ms(40)],
            forks: vec![ms(900)],
        };
        let report = Report::new(
            settings(),
            &fastbox,
            Baseline::Skipped("runc is not on PATH".into()),
            Vec::new(),
        );
        let json = serde_json::to_value(&report).unwrap();
        let metrics = json["metrics"].as_array().unwrap();
        let by_name = |name: &str| {
            metrics
                .iter()
                .find(|m| m["metric"] == name)
                .unwrap_or_else(|| panic!("no {name} in {json}"))
        };
        assert_eq!(
            by_name("snapshot_frozen_ms")["n"],
            2,
            "frozen only where reported"
        );
        assert_eq!(by_name("snapshot_frozen_ms")["p50"], 40.0);
        assert_eq!(by_name("snapshot_to_ready_ms")["p50"], 110.0);
        assert_eq!(by_name("pause_s_per_gib")["p50"], 1.024);
        assert_eq!(by_name("pause_s_per_gib")["unit"], "s/GiB");
        assert_eq!(by_name("create_from_snapshot_ms")["max"], 40.0);
        assert!(metrics.iter().all(|m| m.get("label").is_none()));
        assert!(
            !metrics
                .iter()
                .any(|m| m["metric"].as_str().unwrap().starts_with("runc"))
        );
        assert_eq!(json["runc_baseline"]["status"], "skipped");
        assert_eq!(json["source_rss_mib"], 262.5);
        let text = report.human();
        assert!(
            text.contains("fork of 10: POST -> all answer /ping"),
            "{text}"
        );
        assert!(
            text.contains("runc baseline: skipped: runc is not on PATH"),
            "{text}"
        );
    }

    #[test]
    fn a_runc_baseline_adds_its_metrics() {
        let dump = |frozen_ms: u64| DumpStats {
            frozen_time_us: frozen_ms * 1000,
            pages_written: 65536,
            ..DumpStats::default()
        };
        let checkpoint = |wall, frozen| runc::Checkpoint {
            wall: ms(wall),
            stats: Some(dump(frozen)),
        };
        let series = runc::Series {
            rss_mib: 260.0,
            tmpfs: vec![checkpoint(300, 200)],
            disk: vec![checkpoint(400, 250), checkpoint(420, 260)],
            restores: vec![runc::Restore {
                wall: ms(350),
                stats: None,
            }],
        };
        let report = Report::new(
            settings(),
            &FastboxSeries::default(),
            Baseline::Ran(series),
            Vec::new(),
        );
        let names: Vec<&str> = report.metrics.iter().map(|m| m.metric).collect();
        assert_eq!(
            names,
            [
                "runc_tmpfs_frozen_ms",
                "runc_tmpfs_checkpoint_ms",
                "runc_disk_frozen_ms",
                "runc_disk_checkpoint_ms",
                "runc_pages_written_mib",
                "runc_restore_ms",
            ]
        );
        assert_eq!(report.metrics[2].max, 260.0);
        assert_eq!(report.metrics[4].p50, 256.0);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["runc_baseline"]["status"], "ran");
        assert_eq!(json["runc_baseline"]["rss_mib"], 260.0);
    }
}
