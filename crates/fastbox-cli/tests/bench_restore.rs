//! `fastbox bench restore` run as the binary a user types, on the test image: both series
//! have every sample, percentiles are ordered, CRIU's restore statistics of the runc side
//! are read, and nothing of the run's prefix stays on the host.
//!
//! Prefix tag `2` (see `fastbox_testkit::run_prefix`), address pool 10.217.50.0/24 (the
//! `fastbox up` tests use 10.217.<their tag byte>.0/24; `2` is 50, none of theirs).

mod common;

use std::process::Command;

use serde_json::Value;

const N: u64 = 3;

fn unavailable() -> Option<String> {
    if let Some(reason) = common::unavailable() {
        return Some(reason);
    }
    let runc = Command::new("runc").arg("--version").output();
    if !runc.is_ok_and(|o| o.status.success()) {
        return Some("no runc on PATH (the baseline)".into());
    }
    if fastbox_testkit::criu_path().is_none() {
        return Some("no CRIU: run scripts/setup.sh or set FASTBOX_CRIU".into());
    }
    None
}

/// `min <= p50 <= p90 <= p99 <= max`, all positive, over `n` samples.
fn assert_series(report: &Value, path: &[&str], n: u64) {
    let series = path.iter().fold(report, |v, k| &v[*k]);
    assert_eq!(series["n"], n, "{path:?} in {report:#}");
    let ordered = ["min_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"].map(|k| {
        series[k]
            .as_f64()
            .unwrap_or_else(|| panic!("{path:?}.{k} is not a number in {report:#}"))
    });
    assert!(
        ordered[0] > 0.0 && ordered.windows(2).all(|w| w[0] <= w[1]),
        "{path:?} out of order: {report:#}"
    );
}

#[test]
fn bench_restore_times_both_sides_and_cleans_up() {
    fastbox_testkit::skip_unless!(unavailable());
    let prefix = fastbox_testkit::run_prefix("2");
    let dir = tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()
        .expect("tempdir");
    let out = common::fastbox_run(&["bench", "restore", "--json"], dir.path())
        .args(["--n", &N.to_string()])
        .args(["--image", "fastbox/busybox", "--prefix", &prefix])
        .args(["--pool", "10.217.50.0/24"])
        .output()
        .expect("run fastbox bench restore");
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
    assert_eq!(report["image"], "fastbox/busybox", "{report:#}");
    assert_series(&report, &["fastbox", "restore_ms"], N);
    let phases = report["fastbox"]["phases_ms"]
        .as_object()
        .expect("fastbox.phases_ms is an object");
    assert!(!phases.is_empty(), "{report:#}");
    for phase in phases.keys() {
        assert_series(&report, &["fastbox", "phases_ms", phase], N);
    }
    let fastbox_criu = &report["fastbox"]["criu"];
    assert!(
        fastbox_criu.is_null() || fastbox_criu["n"] == N,
        "{report:#}"
    );
    assert_series(&report, &["runc", "restore_ms"], N);
    assert_series(&report, &["runc", "restore_to_ping_ms"], N);
    assert_series(&report, &["runc", "criu", "restore_time_ms"], N);
    assert_eq!(report["runc"]["criu"]["n"], N, "{report:#}");
    assert_eq!(
        report["runc"]["criu"]["forking_time_ms"]["n"], N,
        "{report:#}"
    );
    let runc_criu = report["runc"]["criu"]["restore_time_median_ms"]
        .as_f64()
        .unwrap();
    assert!(
        runc_criu > 0.0 && runc_criu < report["runc"]["restore_ms"]["max_ms"].as_f64().unwrap(),
        "CRIU's restore_time is part of runc restore's wall time: {report:#}"
    );
    assert!(
        report["runc"]["dump"]["pages_written"].as_u64() > Some(0),
        "{report:#}"
    );
    assert!(
        report["runc_over_fastbox_p50"].as_f64() > Some(0.0),
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
        .filter(|name| name.to_string_lossy().starts_with("bench-restore-"))
        .collect();
    assert!(
        run_dirs.is_empty(),
        "the run's directory stayed: {run_dirs:?}"
    );
}
