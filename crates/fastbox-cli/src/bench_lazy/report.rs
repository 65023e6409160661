//! The result of a run: one JSON object (`--json`) or a table. Latencies are nearest-rank
//! percentiles of each mode's samples (`crate::bench::Percentiles`); the fetch counts, the
//! same in every run of a mode, are given as the median sample's.

use std::fmt::Write as _;
use std::time::Duration;

use serde::{Serialize, Serializer};

use crate::bench::Percentiles;
use fastbox_runtime::lazy::restore::Fetched;

use super::restores::{Mode, Sample};

/// Serializes a duration as milliseconds (to the microsecond).
pub fn as_ms<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(millis(*d))
}

/// [`as_ms`] of a duration that may be missing (null).
pub fn as_ms_opt<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(millis(*d)),
        None => s.serialize_none(),
    }
}

fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// How the run was set up.
#[derive(Debug, Serialize)]
pub struct Settings {
    pub image: String,
    pub memory_mib: u64,
    pub n: usize,
    pub block_delay_ms: u64,
    pub fetch_workers: usize,
    /// The artifact store the checkpoint was published to (never a credential).
    pub origin: String,
}

/// The checkpoint every restore starts from.
#[derive(Debug, Default, Serialize)]
pub struct CheckpointFacts {
    /// Bytes and blocks of its files (CRIU images, `upper.tar`, metadata).
    pub bytes: u64,
    pub blocks: u64,
    /// Of which the pages images (what a lazy restore leaves for later).
    pub pages_bytes: u64,
    /// The holder's start until it answered (its memory filled).
    pub holder_start_ms: f64,
    /// `criu dump` of the source sandbox and the copy of its writable layer.
    pub checkpoint_ms: f64,
    /// Its publication as an artifact.
    pub publish_ms: f64,
}

/// One mode's series.
#[derive(Debug, Serialize)]
pub struct ModeReport {
    pub n: usize,
    /// Restore requested -> the holder answers.
    pub answer_ms: Option<Percentiles>,
    /// Restore requested -> the full-memory checksum received and checked.
    pub checksum_ms: Option<Percentiles>,
    /// Restore requested -> every block local.
    pub all_local_ms: Option<Percentiles>,
    /// The runtime's restore call.
    pub restore_call_ms: Option<Percentiles>,
    /// The `criu restore` process.
    pub criu_ms: Option<Percentiles>,
    /// A lazy restore's preparation (null for full restores).
    pub lazy_prepare_ms: Option<Percentiles>,
    /// Fetched before `criu restore` started (median sample).
    pub fetched_before_restore: Fetched,
    /// Fetched in all (median sample).
    pub fetched: Fetched,
    /// Samples whose checksums equal the one taken before the checkpoint.
    pub checksums_verified: usize,
}

impl ModeReport {
    fn of(samples: &[&Sample]) -> Self {
        let series = |f: fn(&Sample) -> Duration| {
            Percentiles::of_some(&samples.iter().map(|s| f(s)).collect::<Vec<_>>())
        };
        Self {
            n: samples.len(),
            answer_ms: series(|s| s.answer),
            checksum_ms: series(|s| s.checksum),
            all_local_ms: series(|s| s.all_local),
            restore_call_ms: series(|s| s.restore_call),
            criu_ms: series(|s| s.criu),
            lazy_prepare_ms: Percentiles::of_some(
                &samples
                    .iter()
                    .filter_map(|s| s.lazy_prepare)
                    .collect::<Vec<_>>(),
            ),
            fetched_before_restore: median(samples.iter().map(|s| s.before_restore)),
            fetched: median(samples.iter().map(|s| s.fetched)),
            checksums_verified: samples.iter().filter(|s| s.checksum_ok).count(),
        }
    }
}

/// The median (lower, by bytes) of `fetched`; zero when empty.
fn median(fetched: impl Iterator<Item = Fetched>) -> Fetched {
    let mut all: Vec<Fetched> = fetched.collect();
    all.sort_by_key(|f| (f.bytes, f.blocks));
    all.get(all.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or_default()
}

#[derive(Debug, Serialize)]
pub struct Report {
    #[serde(flatten)]
    pub settings: Settings,
    pub checkpoint: CheckpointFacts,
    pub full: ModeReport,
    pub lazy: ModeReport,
    /// The full mode's p50 over the lazy mode's, until the holder answers (null without
    /// samples).
    pub answer_p50_full_over_lazy: Option<f64>,
    /// The same until the checksum is checked.
    pub checksum_p50_full_over_lazy: Option<f64>,
    /// Samples whose checksum did not match (memory not restored intact).
    pub checksum_failures: usize,
    /// Every sample, in the order taken.
    pub samples: Vec<Sample>,
    /// Host state of the run left after its clean-up (empty when clean).
    pub leftovers: Vec<String>,
}

impl Report {
    pub fn new(
        settings: Settings,
        checkpoint: CheckpointFacts,
        samples: Vec<Sample>,
        leftovers: Vec<String>,
    ) -> Self {
        let of = |mode: Mode| {
            ModeReport::of(
                &samples
                    .iter()
                    .filter(|s| s.mode == mode)
                    .collect::<Vec<_>>(),
            )
        };
        let (full, lazy) = (of(Mode::Full), of(Mode::Lazy));
        let ratio = |f: fn(&ModeReport) -> &Option<Percentiles>| {
            Some(f(&full).as_ref()?.p50_ms / f(&lazy).as_ref()?.p50_ms)
        };
        Self {
            answer_p50_full_over_lazy: ratio(|m| &m.answer_ms),
            checksum_p50_full_over_lazy: ratio(|m| &m.checksum_ms),
            checksum_failures: samples.iter().filter(|s| !s.checksum_ok).count(),
            settings,
            checkpoint,
            full,
            lazy,
            samples,
            leftovers,
        }
    }

    /// Whether the run showed what it must: every checksum matched, nothing was left.
    pub fn passed(&self) -> bool {
        self.checksum_failures == 0 && self.leftovers.is_empty()
    }

    /// The table for a terminal.
    pub fn human(&self) -> String {
        let s = &self.settings;
        let c = &self.checkpoint;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} holding {} MiB; checkpoint {} blocks, {:.1} MiB ({:.1} MiB of pages); \
             {} ms per block, {} fetch workers, origin {}",
            s.image,
            s.memory_mib,
            c.blocks,
            mib(c.bytes),
            mib(c.pages_bytes),
            s.block_delay_ms,
            s.fetch_workers,
            s.origin
        );
        for (name, mode) in [
            ("full pull, then restore", &self.full),
            ("lazy restore", &self.lazy),
        ] {
            let _ = writeln!(out, "{name} (n={}):", mode.n);
            let rows: [(&str, &Option<Percentiles>); 6] = [
                ("-> holder answers", &mode.answer_ms),
                ("-> checksum checked", &mode.checksum_ms),
                ("-> every block local", &mode.all_local_ms),
                ("restore call", &mode.restore_call_ms),
                ("of which lazy prepare", &mode.lazy_prepare_ms),
                ("criu restore", &mode.criu_ms),
            ];
            for (label, p) in rows {
                if let Some(p) = p {
                    let _ = writeln!(out, "  {label:<22} {}", p.line());
                }
            }
            let before = mode.fetched_before_restore;
            let _ = writeln!(
                out,
                "  fetched before restore {} blocks, {:.1} MiB (of {} blocks, {:.1} MiB); \
                 checksums verified {}/{}",
                before.blocks,
                mib(before.bytes),
                mode.fetched.blocks,
                mib(mode.fetched.bytes),
                mode.checksums_verified,
                mode.n
            );
        }
        if let (Some(answer), Some(checksum)) = (
            self.answer_p50_full_over_lazy,
            self.checksum_p50_full_over_lazy,
        ) {
            let _ = writeln!(
                out,
                "full over lazy at p50: {answer:.2}x until the holder answers, \
                 {checksum:.2}x until its checksum"
            );
        }
        let _ = writeln!(
            out,
            "leftovers: {}",
            if self.leftovers.is_empty() {
                "none".to_string()
            } else {
                self.leftovers.join(", ")
            }
        );
        out
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(mode: Mode, answer_ms: u64, before_blocks: u64, ok: bool) -> Sample {
        let ms = Duration::from_millis;
        Sample {
            mode,
            answer: ms(answer_ms),
            checksum: ms(answer_ms * 2),
            all_local: ms(answer_ms * 3),
            restore_call: ms(10),
            criu: ms(5),
            lazy_prepare: (mode == Mode::Lazy).then(|| ms(3)),
            before_restore: Fetched {
                blocks: before_blocks,
                bytes: before_blocks << 22,
            },
            fetched: Fetched {
                blocks: 10,
                bytes: 10 << 22,
            },
            checksum_ok: ok,
            pages_served: None,
            short_answers: None,
        }
    }

    #[test]
    fn modes_are_summarized_apart_and_compared() {
        let settings = Settings {
            image: "fastbox/busybox".into(),
            memory_mib: 64,
            n: 2,
            block_delay_ms: 5,
            fetch_workers: 4,
            origin: "/tmp/store".into(),
        };
        let samples = vec![
            sample(Mode::Full, 400, 10, true),
            sample(Mode::Lazy, 100, 2, true),
            sample(Mode::Full, 600, 10, true),
            sample(Mode::Lazy, 300, 2, false),
        ];
        let report = Report::new(settings, CheckpointFacts::default(), samples, vec![]);
        assert_eq!(report.full.n, 2);
        assert_eq!(report.full.answer_ms.as_ref().unwrap().p50_ms, 400.0);
        assert_eq!(report.lazy.answer_ms.as_ref().unwrap().p90_ms, 300.0);
        assert_eq!(report.answer_p50_full_over_lazy, Some(4.0));
        assert_eq!(report.lazy.fetched_before_restore.blocks, 2);
        assert_eq!(report.full.checksums_verified, 2);
        assert_eq!(report.checksum_failures, 1);
        assert!(!report.passed());
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["memory_mib"], 64);
        assert_eq!(json["samples"][1]["mode"], "lazy");
        assert_eq!(json["samples"][1]["answer_ms"], 100.0);
        assert_eq!(json["lazy"]["fetched_before_restore"]["bytes"], 2u64 << 22);
        assert!(report.human().contains("checksums verified 1/2"));
    }
}
