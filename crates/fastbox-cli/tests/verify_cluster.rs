//! `fastbox verify cluster --nodes 3` end to end, small: a server with its own node and two
//! joined `fastbox node` agents, each in a network namespace of its own on a bridge, share
//! creates; one agent is killed (SIGKILL), its guard freezes its sandboxes before the server
//! declares it lost, its sandbox fails (`NODE_LOST`), a sandbox paused there resumes on
//! another node with its memory fetched from the shared store while it runs, and the node
//! comes back; the other node is cut off from the server in the middle of a resume, and the
//! sandbox goes on elsewhere. Artifacts come from an S3 origin (s3s-fs) through DART peers. Test sandboxes report to a collector on a test host all along:
//! none reports from two nodes at once. Nothing is left afterwards.
//!
//! Root and CRIU (skipped with the reason otherwise). Prefix: the run prefix's first six
//! characters and `v` (see `fastbox_testkit::run_prefix_pair`).

mod common;

use std::process::Command;

#[test]
fn three_nodes_share_creates_and_a_killed_node_is_fenced_then_lost() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    let base = fastbox_testkit::run_prefix("");
    let prefix = format!("{}v", &base[..6]);
    let out = Command::new(env!("CARGO_BIN_EXE_fastbox"))
        .args([
            "verify",
            "cluster",
            "--nodes",
            "3",
            "--creates",
            "12",
            "--concurrency",
            "3",
            "--lease-ms",
            "5000",
            "--net-octet",
            "223",
            "--move-mib",
            "24",
            "--json",
            "--prefix",
            &prefix,
            "--cache-dir",
            &common::server::test_cache_dir().display().to_string(),
            "--execd",
            &fastbox_testkit::execd_path().unwrap().display().to_string(),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("no report ({e}): {stderr}"));
    assert!(out.status.success(), "{report:#}\n{stderr}");
    assert_eq!(report["passed"], true, "{report:#}");
    // Every create of both runs became ready, and every node took some.
    for run in ["one_node", "cluster"] {
        assert_eq!(report[run]["failures"], 0, "{run}: {report:#}");
        assert!(
            report[run]["latency"]["p50_ms"].as_f64().is_some(),
            "{report:#}"
        );
    }
    let share = report["cluster"]["share"].as_array().unwrap();
    assert_eq!(share.len(), 3, "{report:#}");
    assert!(
        share.iter().all(|s| s[1].as_u64().unwrap() > 0),
        "{report:#}"
    );
    let total: u64 = share.iter().map(|s| s[1].as_u64().unwrap()).sum();
    assert_eq!(total, 12, "{report:#}");
    // The loss: fenced, then lost after the lease, the sandbox NODE_LOST, the other alive.
    let loss = &report["loss"];
    assert!(loss["fenced"].as_u64().unwrap() >= 1, "{loss:#}");
    assert_eq!(loss["all_frozen"], true, "{loss:#}");
    assert!(loss["lost_after_ms"].as_u64().unwrap() >= 5000, "{loss:#}");
    assert_eq!(loss["lost_sandbox"][0], "Failed", "{loss:#}");
    assert_eq!(loss["lost_sandbox"][1], "NODE_LOST", "{loss:#}");
    assert_eq!(loss["survivor_answers"], true, "{loss:#}");
    // A create from a snapshot taken on another node, with the snapshot's file.
    let snapshot = &report["snapshot"];
    assert_ne!(
        snapshot["taken_on"], snapshot["restored_on"],
        "{snapshot:#}"
    );
    assert_eq!(snapshot["kept_file"], true, "{snapshot:#}");
    // The cross-node resume: on another node, memory intact, ready before its memory was.
    let moved = &report["moved"];
    assert_eq!(moved["from"], "n2", "{moved:#}");
    assert_ne!(moved["to"], "n2", "{moved:#}");
    assert_eq!(moved["memory_intact"], true, "{moved:#}");
    for resume in ["local", "moved"] {
        let (ready, local) = (
            moved[resume]["ready_ms"].as_u64().unwrap(),
            moved[resume]["memory_local_ms"].as_u64().unwrap(),
        );
        assert!(ready > 0 && local > 0, "{resume}: {moved:#}");
    }
    // The cut in the middle of a resume: the node lost no sooner than its lease, the
    // sandbox Paused on its published checkpoint, then going on elsewhere; nothing from the
    // cut node after the mend.
    let cut = &report["cut"];
    assert!(cut["lost_after_ms"].as_u64().unwrap() >= 5000, "{cut:#}");
    assert_eq!(cut["state_after_loss"][0], "Paused", "{cut:#}");
    assert_eq!(cut["state_after_loss"][1], "NODE_LOST", "{cut:#}");
    assert_ne!(cut["moved_to"], "n1", "{cut:#}");
    assert!(cut["moved_to"].is_string(), "{cut:#}");
    assert_eq!(cut["count_went_on"], true, "{cut:#}");
    assert_eq!(cut["memory_intact"], true, "{cut:#}");
    assert_eq!(cut["reports_after_mend"], 0, "{cut:#}");
    // The witness: every test sandbox reported, none from two nodes at once.
    let fencing = &report["fencing"];
    assert!(fencing["sandboxes"].as_u64().unwrap() >= 4, "{fencing:#}");
    assert!(fencing["reports"].as_u64().unwrap() > 20, "{fencing:#}");
    assert_eq!(fencing["doubles"], serde_json::json!([]), "{fencing:#}");
    assert!(
        loss["last_report_after_kill_ms"].as_u64().unwrap()
            < loss["expired_after_ms"].as_u64().unwrap(),
        "{loss:#}"
    );
    // Blocks came from the S3 origin and through DART peers.
    let delivery = report["delivery"].as_array().unwrap();
    let total = |name: &str| -> u64 {
        delivery
            .iter()
            .filter_map(|node| node[1][name].as_u64())
            .sum()
    };
    assert!(total("origin_fetches") > 0, "{delivery:?}");
    assert!(total("peer_fetches") > 0, "{delivery:?}");
    let net = fastbox_cli::scenario_net::leftovers(&prefix);
    assert!(net.is_empty(), "{prefix} left {net:?}");
    for instance in ["s", "1", "2"] {
        let left = fastbox_cli::local_sandbox::leftovers(&format!("{prefix}{instance}"));
        assert!(left.is_empty(), "{prefix}{instance} left {left:?}");
    }
}
