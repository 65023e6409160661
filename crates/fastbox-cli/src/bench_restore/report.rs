//! The result of a run: one JSON object (`--json`) or a table, with nearest-rank percentiles
//! of every series and CRIU's own restore timings for each side, so the gap between the
//! two can be read off: CRIU's `restore_time` is the tree's restore proper, the rest of a
//! side's wall time is everything around it.

use std::time::Duration;

use fastbox_runtime::criu_stats::{DumpStats, RestoreStats};
use serde::{Serialize, Serializer};

use super::{fastbox, runc};
use fastbox_cli::bench::Percentiles;

#[derive(Debug, Serialize)]
pub struct Report {
    pub image: String,
    pub served_by: Option<String>,
    pub n: usize,
    pub fastbox: FastboxReport,
    pub runc: RuncReport,
    /// runc's `restore_ms` p50 over fastbox's `restore_ms` p50.
    pub runc_over_fastbox_p50: f64,
    /// Host state of the run still present after its clean-up (empty when clean).
    pub leftovers: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct FastboxReport {
    /// `Fastlet::restore_from`: slot, rootfs, CRIU restore, execd ready, claim.
    pub restore_ms: Percentiles,
    /// The phases of the start report, by name, in the order they ran.
    pub phases_ms: Named,
    /// CRIU's `stats-restore`; null when the runtime does not report it.
    pub criu: Option<CriuReport>,
    pub template_build_ms: f64,
    /// Spare slots the fastlet kept made ahead (the `--spare-slots` setting).
    pub spare_slots: usize,
    /// Restores that took a spare slot instead of making theirs.
    pub spare_hits: usize,
}

#[derive(Debug, Serialize)]
pub struct RuncReport {
    /// `runc restore -d` until it returned.
    pub restore_ms: Percentiles,
    /// `runc restore -d` until the clone's execd answered `/ping`.
    pub restore_to_ping_ms: Percentiles,
    pub criu: Option<CriuReport>,
    pub checkpoint_ms: f64,
    /// CRIU's `stats-dump` of the template container's checkpoint.
    pub dump: Option<DumpStats>,
}

/// Named series in the order they were first seen; a JSON object with its keys in that order.
#[derive(Debug)]
pub struct Named(pub Vec<(String, Percentiles)>);

impl Serialize for Named {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(name, p)| (name, p)))
    }
}

impl Named {
    /// Groups `(name, duration)` pairs by name, names in first-seen order.
    fn of<'a>(pairs: impl Iterator<Item = &'a (String, Duration)>) -> Self {
        let mut series: Vec<(String, Vec<Duration>)> = Vec::new();
        for (name, d) in pairs {
            match series.iter_mut().find(|(n, _)| n == name) {
                Some((_, ds)) => ds.push(*d),
                None => series.push((name.clone(), vec![*d])),
            }
        }
        Self(
            series
                .into_iter()
                .map(|(name, ds)| (name, Percentiles::of(&ds)))
                .collect(),
        )
    }
}

/// CRIU's own timings of one side's restores (from `stats-restore`).
#[derive(Debug, Serialize)]
pub struct CriuReport {
    /// Restores whose statistics were read.
    pub n: usize,
    pub restore_time_median_ms: f64,
    pub forking_time_median_ms: f64,
    pub restore_time_ms: Percentiles,
    pub forking_time_ms: Percentiles,
    /// Per restore, the side's wall time minus CRIU's `restore_time`: everything that is
    /// not the tree's restore proper (tool start-up, namespaces, cgroups, mounts, waiting).
    pub outside_restore_time_ms: Percentiles,
    /// Null when the side's statistics carry no page counts.
    pub pages_restored_median: Option<u64>,
}

impl CriuReport {
    /// From `(wall time, statistics)` of each restore with statistics; None without any.
    fn of(samples: &[(Duration, RestoreStats)]) -> Option<Self> {
        let series = |f: &dyn Fn(&(Duration, RestoreStats)) -> Duration| {
            Percentiles::of(&samples.iter().map(f).collect::<Vec<_>>())
        };
        let restore_time_ms = Percentiles::of_some(
            &samples
                .iter()
                .map(|(_, s)| Duration::from_micros(s.restore_time_us))
                .collect::<Vec<_>>(),
        )?;
        let forking_time_ms = series(&|(_, s)| Duration::from_micros(s.forking_time_us));
        let outside =
            series(&|(wall, s)| wall.saturating_sub(Duration::from_micros(s.restore_time_us)));
        let mut pages: Vec<u64> = samples.iter().map(|(_, s)| s.pages_restored).collect();
        pages.sort_unstable();
        Some(Self {
            n: samples.len(),
            restore_time_median_ms: restore_time_ms.p50_ms,
            forking_time_median_ms: forking_time_ms.p50_ms,
            restore_time_ms,
            forking_time_ms,
            outside_restore_time_ms: outside,
            pages_restored_median: Some(pages[(pages.len() - 1) / 2]).filter(|p| *p > 0),
        })
    }
}

impl Report {
    pub fn new(
        image: &str,
        served_by: Option<String>,
        spare_slots: usize,
        fastbox: &fastbox::Series,
        runc: &runc::Series,
        leftovers: Vec<String>,
    ) -> Self {
        let fb_walls: Vec<Duration> = fastbox.samples.iter().map(|s| s.wall).collect();
        let fastbox_report = FastboxReport {
            restore_ms: Percentiles::of(&fb_walls),
            phases_ms: Named::of(fastbox.samples.iter().flat_map(|s| &s.phases)),
            criu: CriuReport::of(
                &fastbox
                    .samples
                    .iter()
                    .filter_map(|s| s.criu.map(|c| (s.wall, c)))
                    .collect::<Vec<_>>(),
            ),
            template_build_ms: millis(fastbox.template_build),
            spare_slots,
            spare_hits: fastbox.samples.iter().filter(|s| s.spare).count(),
        };
        let runc_walls: Vec<Duration> = runc.samples.iter().map(|s| s.restore).collect();
        let runc_report = RuncReport {
            restore_ms: Percentiles::of(&runc_walls),
            restore_to_ping_ms: Percentiles::of(
                &runc.samples.iter().map(|s| s.to_ping).collect::<Vec<_>>(),
            ),
            criu: CriuReport::of(
                &runc
                    .samples
                    .iter()
                    .filter_map(|s| s.criu.map(|c| (s.restore, c)))
                    .collect::<Vec<_>>(),
            ),
            checkpoint_ms: millis(runc.checkpoint),
            dump: runc.dump,
        };
        let ratio = runc_report.restore_ms.p50_ms / fastbox_report.restore_ms.p50_ms;
        Self {
            image: image.to_string(),
            served_by,
            n: fb_walls.len(),
            runc_over_fastbox_p50: (ratio * 100.0).round() / 100.0,
            fastbox: fastbox_report,
            runc: runc_report,
            leftovers,
        }
    }

    /// The report for a terminal.
    pub fn human(&self) -> String {
        let served = self
            .served_by
            .as_deref()
            .map(|s| format!(" (served by {s})"))
            .unwrap_or_default();
        let mut out = format!(
            "node-side restore of a golden checkpoint of {}{served}, n={}\n",
            self.image, self.n
        );
        out += &row("fastbox restore_from", &self.fastbox.restore_ms);
        out += &format!(
            "  ({} of {} into a spare slot; {} spares kept)\n",
            self.fastbox.spare_hits, self.n, self.fastbox.spare_slots
        );
        for (phase, p) in &self.fastbox.phases_ms.0 {
            out += &row(&format!("  phase {phase}"), p);
        }
        match &self.fastbox.criu {
            Some(c) => out += &criu_rows(c),
            None => out += "  (CRIU statistics: not reported by the runtime)\n",
        }
        out += &row("runc restore -d (until it returns)", &self.runc.restore_ms);
        out += &row("runc restore -d until /ping", &self.runc.restore_to_ping_ms);
        if let Some(c) = &self.runc.criu {
            out += &criu_rows(c);
        }
        out += &format!(
            "runc restore p50 / fastbox restore p50: {:.2}x; set-up: fastbox template build \
             {:.0} ms, runc checkpoint {:.0} ms\n",
            self.runc_over_fastbox_p50, self.fastbox.template_build_ms, self.runc.checkpoint_ms
        );
        for leftover in &self.leftovers {
            out += &format!("left on the host: {leftover}\n");
        }
        out
    }
}

fn row(name: &str, p: &Percentiles) -> String {
    format!("{name:<34} {}\n", p.line())
}

fn criu_rows(c: &CriuReport) -> String {
    row("  CRIU restore_time", &c.restore_time_ms)
        + &row("  CRIU forking_time", &c.forking_time_ms)
        + &row("  wall minus CRIU restore_time", &c.outside_restore_time_ms)
}

fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(restore_ms: u64, forking_us: u64) -> Option<RestoreStats> {
        Some(RestoreStats {
            restore_time_us: restore_ms * 1000,
            forking_time_us: forking_us,
            pages_restored: 100,
            ..RestoreStats::default()
        })
    }

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn the_json_has_both_sides_and_crius_medians() {
        let fastbox = fastbox::Series {
            template_build: ms(900),
            samples: [20, 30, 25]
                .map(|w| fastbox::Sample {
                    wall: ms(w),
                    phases: vec![("restore".into(), ms(w - 5)), ("configure".into(), ms(5))],
                    criu: (w == 30).then(|| stats(20, 4)).flatten(),
                    spare: w == 20,
                })
                .into(),
        };
        let runc = runc::Series {
            checkpoint: ms(100),
            dump: None,
            samples: [(140, 60), (150, 70), (130, 50)]
                .map(|(w, r)| runc::Sample {
                    restore: ms(w),
                    to_ping: ms(w + 1),
                    criu: stats(r, 3),
                })
                .into(),
        };
        let report = Report::new("python:3.12", None, 8, &fastbox, &runc, Vec::new());
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["n"], 3);
        assert_eq!(json["fastbox"]["restore_ms"]["p50_ms"], 25.0);
        assert_eq!(json["fastbox"]["restore_ms"]["n"], 3);
        assert_eq!(json["fastbox"]["phases_ms"]["configure"]["max_ms"], 5.0);
        assert_eq!(json["fastbox"]["criu"]["n"], 1);
        assert_eq!(
            json["fastbox"]["criu"]["outside_restore_time_ms"]["p50_ms"],
            10.0
        );
        assert_eq!(json["fastbox"]["spare_hits"], 1);
        assert_eq!(json["runc"]["restore_ms"]["p50_ms"], 140.0);
        assert_eq!(json["runc"]["restore_to_ping_ms"]["min_ms"], 131.0);
        assert_eq!(json["runc"]["criu"]["restore_time_median_ms"], 60.0);
        assert_eq!(json["runc"]["criu"]["forking_time_median_ms"], 0.003);
        assert_eq!(
            json["runc"]["criu"]["outside_restore_time_ms"]["p50_ms"],
            80.0
        );
        assert_eq!(json["runc_over_fastbox_p50"], 5.6);
        assert!(report.human().contains("CRIU restore_time"));
        let text = serde_json::to_string(&report).unwrap();
        assert!(
            text.find("\"restore\":{").unwrap() < text.find("\"configure\":{").unwrap(),
            "phases keep their order: {text}"
        );
    }
}
