//! A collection's [`GcReport`] for people and programs: [`to_text`] (what
//! `fastbox artifacts gc` prints), [`summary`] (one log line) and [`to_json`] (`--json`).
//!
//! The JSON shape:
//!
//! ```json
//! {"dry_run": false,
//!  "roots": {"index": 3, "pinned": 2, "young": 0},
//!  "manifests": {"marked": {"count": 3, "bytes": 9120}, "spared": {...}, "deleted": {...}, "held_back": {...}},
//!  "blocks": {...the same...},
//!  "missing_manifests": ["<hex>"], "corrupt_manifests": [], "unreadable_manifests": {"<hex>": "reason"},
//!  "missing_blocks": [], "broken_manifests": [], "sweep_skipped": false,
//!  "dropped_index_entries": [{"key": "python:3.12", "manifest": "<hex>"}]}
//! ```
//!
//! In a dry run `deleted` counts what would have been deleted.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use fastbox_artifact::{Digest, GcReport, SweepTally, Tally};
use serde_json::{Value, json};

/// The report as JSON (see the module docs).
pub fn to_json(report: &GcReport) -> Value {
    let digests =
        |set: &BTreeSet<Digest>| -> Vec<String> { set.iter().map(Digest::to_hex).collect() };
    json!({
        "dry_run": report.dry_run,
        "roots": {
            "index": report.roots.index,
            "pinned": report.roots.pinned,
            "young": report.roots.young,
        },
        "manifests": sweep_json(&report.manifests),
        "blocks": sweep_json(&report.blocks),
        "missing_manifests": digests(&report.missing_manifests),
        "corrupt_manifests": digests(&report.corrupt_manifests),
        "unreadable_manifests": report
            .unreadable_manifests
            .iter()
            .map(|(digest, reason)| (digest.to_hex(), Value::from(reason.as_str())))
            .collect::<serde_json::Map<_, _>>(),
        "missing_blocks": digests(&report.missing_blocks),
        "broken_manifests": digests(&report.broken_manifests),
        "sweep_skipped": report.sweep_skipped,
        "dropped_index_entries": report
            .dropped_index_entries
            .iter()
            .map(|(key, digest)| json!({"key": key.as_str(), "manifest": digest.to_hex()}))
            .collect::<Vec<_>>(),
    })
}

fn sweep_json(sweep: &SweepTally) -> Value {
    let tally = |t: &Tally| json!({"count": t.count, "bytes": t.bytes});
    json!({
        "marked": tally(&sweep.marked),
        "spared": tally(&sweep.spared),
        "deleted": tally(&sweep.deleted),
        "held_back": tally(&sweep.held_back),
    })
}

/// One line: what was deleted and kept.
pub fn summary(report: &GcReport) -> String {
    let deleted = if report.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    let mut line = format!(
        "{deleted} {} manifest(s) and {} block(s) ({}); kept {} manifest(s) and {} block(s) ({}) reachable from {} index entries and {} pins, spared {} young object(s)",
        report.manifests.deleted.count,
        report.blocks.deleted.count,
        human_bytes(report.manifests.deleted.bytes + report.blocks.deleted.bytes),
        report.manifests.marked.count,
        report.blocks.marked.count,
        human_bytes(report.manifests.marked.bytes + report.blocks.marked.bytes),
        report.roots.index,
        report.roots.pinned,
        report.manifests.spared.count + report.blocks.spared.count,
    );
    let problems = problems(report);
    if !problems.is_empty() {
        let _ = write!(line, "; {}", problems.join("; "));
    }
    line
}

/// Several lines: roots, each kind's tallies, and what is missing or broken.
pub fn to_text(report: &GcReport) -> String {
    let mut text = String::new();
    if report.dry_run {
        text.push_str("dry run: nothing was deleted\n");
    }
    let _ = writeln!(
        text,
        "roots: {} index entries, {} pinned, {} young manifest(s)",
        report.roots.index, report.roots.pinned, report.roots.young
    );
    for (kind, sweep) in [("manifests", &report.manifests), ("blocks", &report.blocks)] {
        let _ = writeln!(
            text,
            "{kind}: {} marked, {} spared, {} {}, {} held back",
            tally_text(&sweep.marked),
            tally_text(&sweep.spared),
            tally_text(&sweep.deleted),
            if report.dry_run {
                "to delete"
            } else {
                "deleted"
            },
            tally_text(&sweep.held_back),
        );
    }
    for problem in problems(report) {
        let _ = writeln!(text, "warning: {problem}");
    }
    for (key, digest) in &report.dropped_index_entries {
        let _ = writeln!(text, "dropped index entry {key} -> {digest}");
    }
    text
}

/// What the collection found wrong, one phrase each.
fn problems(report: &GcReport) -> Vec<String> {
    let mut problems = Vec::new();
    let mut count = |n: usize, what: &str| {
        if n > 0 {
            problems.push(format!("{n} {what}"));
        }
    };
    count(
        report.missing_manifests.len(),
        "referenced manifest(s) missing",
    );
    count(
        report.corrupt_manifests.len(),
        "referenced manifest(s) corrupt",
    );
    count(report.missing_blocks.len(), "referenced block(s) missing");
    count(report.broken_manifests.len(), "broken manifest(s)");
    count(
        report.unreadable_manifests.len(),
        "manifest(s) of a newer format",
    );
    if report.sweep_skipped {
        problems.push("the sweep was skipped: a reachable manifest is unreadable".into());
    }
    problems
}

fn tally_text(tally: &Tally) -> String {
    format!("{} ({})", tally.count, human_bytes(tally.bytes))
}

/// `0 B`, `812 B`, `3.4 KiB`, `12.0 MiB`, `1.5 GiB`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_artifact::{IndexKey, Roots};

    fn report() -> GcReport {
        let missing = Digest::of(b"missing");
        GcReport {
            dry_run: false,
            roots: Roots {
                index: 2,
                pinned: 1,
                young: 0,
            },
            blocks: SweepTally {
                marked: Tally {
                    count: 3,
                    bytes: 3 << 20,
                },
                deleted: Tally {
                    count: 2,
                    bytes: 5 << 20,
                },
                ..SweepTally::default()
            },
            missing_blocks: BTreeSet::from([missing]),
            dropped_index_entries: vec![(IndexKey::try_new("python:3.12").unwrap(), missing)],
            ..GcReport::default()
        }
    }

    #[test]
    fn json_has_every_tally_and_digests_in_hex() {
        let json = to_json(&report());
        assert_eq!(json["blocks"]["deleted"]["count"], 2);
        assert_eq!(json["blocks"]["deleted"]["bytes"], 5 << 20);
        assert_eq!(json["manifests"]["marked"]["count"], 0);
        assert_eq!(json["roots"]["pinned"], 1);
        let missing = Digest::of(b"missing").to_hex();
        assert_eq!(json["missing_blocks"][0], missing.as_str());
        assert_eq!(json["dropped_index_entries"][0]["key"], "python:3.12");
        assert_eq!(
            json["dropped_index_entries"][0]["manifest"],
            missing.as_str()
        );
        assert_eq!(json["sweep_skipped"], false);
    }

    #[test]
    fn text_and_summary_name_what_went_and_what_is_wrong() {
        let text = to_text(&report());
        assert!(text.contains("blocks: 3 (3.0 MiB) marked"), "{text}");
        assert!(text.contains("2 (5.0 MiB) deleted"), "{text}");
        assert!(
            text.contains("warning: 1 referenced block(s) missing"),
            "{text}"
        );
        let line = summary(&report());
        assert!(
            line.starts_with("deleted 0 manifest(s) and 2 block(s) (5.0 MiB)"),
            "{line}"
        );
        assert!(line.contains("1 referenced block(s) missing"), "{line}");
        let dry = summary(&GcReport {
            dry_run: true,
            ..report()
        });
        assert!(dry.starts_with("would delete"), "{dry}");
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
    }
}
