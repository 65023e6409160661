//! `fastbox verify p2p` as a user runs it: three fastlets, each a separate process in its own
//! network namespace, restore one template (the test image plus 64 MiB of random data) from a
//! real S3 server (`s3s-fs`), through DART.
//!
//! - Clean run: every node restores with CRIU and its execd answers `/ping`, origin fetches
//!   cluster-wide lie within `[blocks, blocks + 4]`, peers serve the rest, every block every
//!   node received was verified; then every node pulls straight from the origin (fresh caches,
//!   no peers) for the comparison.
//! - Restart: the first node starts again on its cache with one cached block corrupted; it
//!   takes every other block from the cache, drops the corrupt one and fetches it again.
//! - Kill run: one node is killed (SIGKILL) a third of the way through its fetches; the other
//!   two still restore, every byte verified.
//! - Nothing carrying the run's prefix stays on the host.
//!
//! Prefix: the run prefix's first six characters and `z` (seven: each node's fastlet adds its
//! number; `z` is not a hex digit, so no other suite's prefix starts with it), addresses
//! 10.242.0.0/16.

mod common;

use std::path::PathBuf;

use serde_json::Value;

const SIZE_MIB: u64 = 64;
const NODES: u64 = 3;

fn s3s_fs() -> Option<PathBuf> {
    std::env::var_os("FASTBOX_S3S_FS_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
            Some(repo.join(".deps/s3s-fs/bin/s3s-fs"))
        })
        .filter(|p| p.is_file())
}

fn unavailable() -> Option<String> {
    if let Some(reason) = common::unavailable() {
        return Some(reason);
    }
    if fastbox_testkit::criu_path().is_none() {
        return Some("no CRIU: run scripts/setup.sh or set FASTBOX_CRIU".into());
    }
    if s3s_fs().is_none() {
        return Some("no s3s-fs: run scripts/setup.sh or set FASTBOX_S3S_FS_BIN".into());
    }
    None
}

fn verify(prefix: &str, extra: &[&str]) -> Value {
    let dir = tempfile::Builder::new()
        .prefix(&format!("{prefix}-"))
        .tempdir()
        .expect("tempdir");
    let out = common::fastbox_run(&["verify", "p2p", "--json"], dir.path())
        .args(["--image", "fastbox/busybox"])
        .args(["--size-mib", &SIZE_MIB.to_string()])
        .args(["--nodes", &NODES.to_string()])
        .args(["--prefix", prefix, "--net-base", "10.242"])
        .args(extra)
        .arg("--s3s-fs")
        .arg(s3s_fs().unwrap())
        .output()
        .expect("run fastbox verify p2p");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let leftovers = fastbox_cli::local_sandbox::leftovers(prefix);
    assert!(
        leftovers.is_empty(),
        "left on the host: {leftovers:?}\n{stderr}"
    );
    assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
    serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{stdout}\n{stderr}"))
}

fn num(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} is not a number in {v:#}"))
}

/// Every node of `phase` restored, got every block once, and verified every byte it took
/// from a peer or the origin.
fn assert_nodes_restored(phase: &Value, nodes: u64) {
    let list = phase["nodes"].as_array().expect("nodes");
    assert_eq!(list.len() as u64, nodes, "{phase:#}");
    let blocks = num(phase, "blocks");
    for node in list {
        assert_eq!(num(node, "blocks"), blocks, "{node:#}");
        assert!(
            num(node, "origin_fetches") + num(node, "peer_fetches") >= blocks,
            "a node restored without fetching every block: {node:#}"
        );
        assert!(
            num(node, "bytes_verified") >= num(node, "bytes"),
            "{node:#}"
        );
        assert!(node["restore_ms"].as_f64().unwrap() > 0.0, "{node:#}");
    }
}

#[test]
fn three_nodes_restore_one_template_through_peers_and_survive_a_killed_node() {
    fastbox_testkit::skip_unless!(unavailable());
    let prefix = common::short_run_prefix('z');

    let clean = verify(&prefix, &["--compare-direct", "--restart-check"]);
    let blocks = num(&clean, "blocks");
    // 64 MiB of payload alone is 16 blocks.
    assert!(blocks >= SIZE_MIB / 4, "{clean:#}");
    let p2p = &clean["p2p"];
    assert_nodes_restored(p2p, NODES);
    let origin = num(&clean, "origin_fetches");
    assert!(
        (blocks..=blocks + 4).contains(&origin),
        "origin fetches {origin} outside [{blocks}, {}]: {clean:#}",
        blocks + 4
    );
    assert_eq!(clean["origin_bound_ok"], true, "{clean:#}");
    assert!(
        num(&clean, "peer_fetches") + origin >= NODES * blocks,
        "{clean:#}"
    );
    assert!(
        num(&clean, "bytes_verified") >= NODES * num(p2p, "bytes"),
        "{clean:#}"
    );
    let direct = &clean["direct"];
    assert_nodes_restored(direct, NODES);
    assert_eq!(num(direct, "peer_fetches"), 0, "{direct:#}");
    assert_eq!(num(direct, "origin_fetches"), NODES * blocks, "{direct:#}");

    // The restarted node kept its cache: only the corrupted block came again.
    let restart = &clean["restart"];
    assert_eq!(restart["ok"], true, "{restart:#}");
    let node = &restart["phase"]["nodes"][0];
    assert_eq!(num(node, "corrupt_dropped"), 1, "{restart:#}");
    assert_eq!(num(node, "origin_fetches"), 1, "{restart:#}");
    assert!(num(node, "cache_hits") >= blocks - 1, "{restart:#}");

    let killed = verify(&prefix, &["--kill-node", "1"]);
    let p2p = &killed["p2p"];
    assert_eq!(p2p["killed"], 1, "{killed:#}");
    assert_nodes_restored(p2p, NODES - 1);
    assert!(killed["origin_bound_ok"].is_null(), "{killed:#}");
}
