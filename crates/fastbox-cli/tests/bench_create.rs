//! `fastbox bench create` against a real `fastbox up`, run as the binary a user types: a
//! successful run reports ordered percentiles and no failures; a run whose every create is
//! refused counts each refusal under its status and code. The server's leak check runs last.

mod common;

use std::process::Command;

use common::server::UpServer;
use serde_json::Value;

/// `fastbox bench create --json` against `server` with `args` appended: its JSON report.
fn bench(server: &UpServer, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args(["bench", "create", "--url", &server.api])
        .args(["--api-key", &server.api_key, "--json"])
        .args(args)
        .env_remove("OPEN_SANDBOX_DOMAIN")
        .env_remove("OPEN_SANDBOX_API_KEY")
        .output()
        .expect("run fastbox bench create");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}\n{stderr}"))
}

fn ms(report: &Value, key: &str) -> f64 {
    report[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {report}"))
}

#[test]
fn bench_create_times_ready_sandboxes_and_counts_refused_creates() {
    let Some(server) = UpServer::start('t', &["--default-image", "fastbox/busybox"]) else {
        return;
    };

    let report = bench(
        &server,
        &[
            "--image",
            "fastbox/busybox",
            "--n",
            "6",
            "--concurrency",
            "2",
            "--warmup",
            "1",
        ],
    );
    assert_eq!(report["n"], 6, "{report}");
    assert_eq!(report["concurrency"], 2, "{report}");
    assert_eq!(report["failures"], 0, "{report}");
    assert_eq!(report["ok"], 6, "{report}");
    let ordered = ["min_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"].map(|k| ms(&report, k));
    assert!(
        ordered.windows(2).all(|w| w[0] <= w[1]) && ordered[0] > 0.0,
        "percentiles out of order: {report}"
    );
    assert!(ms(&report, "wall_s") > 0.0, "{report}");
    assert!(
        server
            .ids()
            .iter()
            .all(|id| server.state(id).0 != "Running"),
        "every benchmark sandbox is deleted: {:?}",
        server.ids()
    );

    let refused = bench(
        &server,
        &[
            "--image",
            "oci:/nonexistent",
            "--n",
            "3",
            "--concurrency",
            "2",
        ],
    );
    assert_eq!(refused["n"], 3, "{refused}");
    assert_eq!(refused["failures"], 3, "{refused}");
    assert!(refused["p50_ms"].is_null(), "{refused}");
    let reasons = refused["failure_reasons"].as_object().expect("reasons");
    assert_eq!(reasons.len(), 1, "{refused}");
    let (reason, count) = reasons.iter().next().unwrap();
    assert!(reason.starts_with("create 400"), "{refused}");
    assert_eq!(count, 3, "{refused}");

    server.finish();
}
