//! `fastbox bench snapshot` against a real `fastbox up`, run as the binary a user types, on
//! the test image with the shell workload: every metric has its samples in order, the runc
//! baseline runs (or says why it is skipped), and the run leaves neither sandboxes nor
//! snapshots nor host state behind. The server's leak check runs last.

mod common;

use std::process::Command;

use common::server::{UpServer, test_cache_dir};
use serde_json::Value;

const FASTBOX_METRICS: [&str; 11] = [
    "snapshot_frozen_ms",
    "snapshot_dump_ms",
    "snapshot_node_total_ms",
    "snapshot_to_ready_ms",
    "snapshot_size_mib",
    "pause_to_paused_ms",
    "pause_s_per_gib",
    "pause_size_mib",
    "resume_to_ready_ms",
    "create_from_snapshot_ms",
    "fork_to_ready_ms",
];

#[test]
fn bench_snapshot_measures_every_operation_and_leaves_nothing() {
    let Some(server) = UpServer::start('y', &[]) else {
        return;
    };
    let mut bench = Command::new(env!("CARGO_BIN_EXE_fastbox"));
    bench
        .args(["bench", "snapshot", "--url", &server.api])
        .args(["--api-key", &server.api_key, "--json"])
        .args(["--image", "fastbox/busybox", "--workload", "shell"])
        .args(["--memory-mib", "16", "--n", "1", "--fork-count", "2"])
        .arg("--cache-dir")
        .arg(test_cache_dir())
        .arg("--data-dir")
        .arg(server.dir.path())
        .env_remove("OPEN_SANDBOX_DOMAIN")
        .env_remove("OPEN_SANDBOX_API_KEY");
    if let Some(criu) = fastbox_testkit::criu_path() {
        bench.arg("--criu").arg(criu);
    }
    let out = bench.output().expect("run fastbox bench snapshot");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}\n{stderr}"));

    let metrics = report["metrics"].as_array().expect("metrics");
    let metric = |name: &str| metrics.iter().find(|m| m["metric"] == name);
    let baseline = &report["runc_baseline"];
    let mut expected: Vec<&str> = FASTBOX_METRICS.to_vec();
    match baseline["status"].as_str() {
        Some("ran") => expected.extend(["runc_tmpfs_frozen_ms", "runc_restore_ms"]),
        Some("skipped") => eprintln!("runc baseline skipped: {}", baseline["reason"]),
        _ => panic!("the runc baseline failed: {report:#}\n{stderr}"),
    }
    for name in expected {
        let m = metric(name).unwrap_or_else(|| panic!("no {name} in {report:#}"));
        assert_eq!(m["n"], 1, "{report:#}");
        let ordered = ["min", "p50", "p90", "p99", "max"].map(|k| m[k].as_f64().unwrap());
        assert!(
            ordered[0] > 0.0 && ordered.windows(2).all(|w| w[0] <= w[1]),
            "{name} out of order: {m}"
        );
    }
    assert!(
        metric("snapshot_size_mib").unwrap()["p50"]
            .as_f64()
            .unwrap()
            >= 16.0,
        "the snapshot holds the workload's memory: {report:#}"
    );
    assert_eq!(report["leftovers"], serde_json::json!([]), "{report:#}");

    for (list, what) in [
        ("/v1/sandboxes?state=Running&state=Paused", "sandboxes"),
        ("/v1/snapshots", "snapshots"),
    ] {
        let (status, listed) = server.get(list);
        assert_eq!(status, 200, "{listed}");
        assert_eq!(
            listed["items"],
            serde_json::json!([]),
            "{what} left: {listed}"
        );
    }
    server.finish();
}
