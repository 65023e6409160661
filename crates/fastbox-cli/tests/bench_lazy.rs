//! `fastbox bench lazy` run as the binary a user types, small (`--memory-mib 64 --n 2
//! --block-delay-ms 5`) on the test image: a real sandbox holding 64 MiB is checkpointed,
//! published as artifact blocks and restored both ways; every restore answers, every
//! checksum over the restored memory matches the one taken before the checkpoint, the lazy
//! restore fetched fewer bytes before its restore started than the full pull, and nothing of
//! the run's prefix stays on the host.
//!
//! Prefix: the first six characters of `fastbox_testkit::run_prefix("")` and `y` (the bench
//! allows 7; other suites use 8 characters ending in their tag, so none collides). Address
//! pool 10.244.0.0/24 (no other suite uses 10.244).

mod common;

use std::process::Command;

use serde_json::Value;

const N: u64 = 2;

fn unavailable() -> Option<String> {
    if let Some(reason) = common::unavailable() {
        return Some(reason);
    }
    let Some(criu) = fastbox_testkit::criu_path() else {
        return Some("no CRIU: run scripts/setup.sh or set FASTBOX_CRIU".into());
    };
    let uffd = Command::new(&criu)
        .args(["check", "--feature", "uffd-noncoop"])
        .output();
    if !uffd.is_ok_and(|o| o.status.success()) {
        return Some(format!(
            "{} reports no non-cooperative userfaultfd (lazy restores)",
            criu.display()
        ));
    }
    None
}

fn number(report: &Value, path: &[&str]) -> f64 {
    path.iter()
        .fold(report, |v, k| &v[*k])
        .as_f64()
        .unwrap_or_else(|| panic!("{path:?} is not a number in {report:#}"))
}

/// `min <= p50 <= p90 <= max`, all positive, over `n` samples.
fn assert_series(report: &Value, path: &[&str], n: u64) {
    let series = path.iter().fold(report, |v, k| &v[*k]);
    assert_eq!(series["n"], n, "{path:?} in {report:#}");
    let ordered = ["min_ms", "p50_ms", "p90_ms", "max_ms"].map(|k| number(series, &[k]));
    assert!(
        ordered[0] > 0.0 && ordered.windows(2).all(|w| w[0] <= w[1]),
        "{path:?} out of order: {report:#}"
    );
}

#[test]
fn bench_lazy_restores_both_ways_with_memory_intact_and_cleans_up() {
    fastbox_testkit::skip_unless!(unavailable());
    let prefix = common::short_run_prefix('y');
    let dir = tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()
        .expect("tempdir");
    let out = common::fastbox_run(&["bench", "lazy", "--json"], dir.path())
        .args(["--n", &N.to_string()])
        .args(["--memory-mib", "64", "--block-delay-ms", "5"])
        .args(["--image", "fastbox/busybox", "--prefix", &prefix])
        .args(["--pool", "10.244.0.0/24"])
        .output()
        .expect("run fastbox bench lazy");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let leftovers = fastbox_cli::local_sandbox::leftovers(&prefix);
    if !leftovers.is_empty() {
        let _ = fastbox_fastlet::host::purge(&prefix, dir.path());
    }
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}\n{stderr}"));

    assert_eq!(report["n"], N, "{report:#}");
    assert_eq!(report["memory_mib"], 64, "{report:#}");
    assert_eq!(report["block_delay_ms"], 5, "{report:#}");
    assert!(
        number(&report, &["checkpoint", "pages_bytes"]) >= (64u64 << 20) as f64,
        "the holder's memory is in the checkpoint: {report:#}"
    );
    for mode in ["full", "lazy"] {
        assert_series(&report, &[mode, "answer_ms"], N);
        assert_series(&report, &[mode, "checksum_ms"], N);
        assert_series(&report, &[mode, "all_local_ms"], N);
        assert_eq!(report[mode]["checksums_verified"], N, "{mode}: {report:#}");
        assert!(
            number(&report, &[mode, "checksum_ms", "min_ms"])
                >= number(&report, &[mode, "answer_ms", "min_ms"]),
            "{mode}: the checksum comes after the first answer: {report:#}"
        );
    }
    assert_eq!(report["checksum_failures"], 0, "{report:#}");
    let samples = report["samples"].as_array().expect("samples");
    assert_eq!(samples.len() as u64, 2 * N, "{report:#}");
    assert!(
        samples.iter().all(|s| s["checksum_ok"] == true),
        "{report:#}"
    );

    // The full pull fetches everything before its restore; the lazy restore only what the
    // restore reads itself, and the rest afterwards.
    let full_before = number(&report, &["full", "fetched_before_restore", "bytes"]);
    let lazy_before = number(&report, &["lazy", "fetched_before_restore", "bytes"]);
    let total = number(&report, &["checkpoint", "bytes"]);
    assert_eq!(full_before, total, "{report:#}");
    assert!(
        lazy_before < full_before,
        "lazy fetched fewer bytes before its restore: {report:#}"
    );
    assert_eq!(
        number(&report, &["lazy", "fetched", "bytes"]),
        total,
        "the lazy transfer fetched the rest: {report:#}"
    );
    assert!(
        number(&report, &["lazy", "lazy_prepare_ms", "n"]) == N as f64,
        "{report:#}"
    );

    assert_eq!(report["leftovers"], serde_json::json!([]), "{report:#}");
    assert!(
        leftovers.is_empty(),
        "the run left host state: {leftovers:?}"
    );
    let run_dirs: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|name| name.to_string_lossy().starts_with("bench-lazy-"))
        .collect();
    assert!(
        run_dirs.is_empty(),
        "the run's directory stayed: {run_dirs:?}"
    );
}
