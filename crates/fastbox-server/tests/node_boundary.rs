//! The node boundary holds: the lifecycle server reaches a node only through
//! `fastbox-node-api`, never the runtime or the node agent, directly or through any crate it
//! builds with (dev-dependencies aside: tests may use anything).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::process::Command;

use serde_json::Value;

const SERVER: &str = "fastbox-server";
const FORBIDDEN: [&str; 2] = ["fastbox-runtime", "fastbox-fastlet"];

#[test]
fn the_server_reaches_neither_the_runtime_nor_the_node_agent() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let names: HashMap<&str, &str> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let nodes = meta["resolve"]["nodes"].as_array().expect("resolve.nodes");
    let by_id: HashMap<&str, &Value> = nodes
        .iter()
        .map(|n| (n["id"].as_str().unwrap(), n))
        .collect();
    let server = nodes
        .iter()
        .find(|n| names[n["id"].as_str().unwrap()] == SERVER)
        .expect("fastbox-server in the workspace");

    // Every package the server builds with: normal and build dependencies, transitively.
    let mut reached: BTreeSet<&str> = BTreeSet::new();
    let mut paths: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut queue = VecDeque::from([(server["id"].as_str().unwrap(), vec![SERVER])]);
    while let Some((id, path)) = queue.pop_front() {
        for dep in by_id[id]["deps"].as_array().unwrap() {
            let builds_with = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].is_null() || k["kind"] == "build");
            let dep_id = dep["pkg"].as_str().unwrap();
            if builds_with && reached.insert(names[dep_id]) {
                let mut next = path.clone();
                next.push(names[dep_id]);
                paths.insert(names[dep_id], next.clone());
                queue.push_back((dep_id, next));
            }
        }
    }
    assert!(
        reached.contains("fastbox-node-api"),
        "the server talks to nodes through fastbox-node-api: {reached:?}"
    );
    for forbidden in FORBIDDEN {
        assert!(
            !reached.contains(forbidden),
            "fastbox-server reaches {forbidden} through {}",
            paths[forbidden].join(" -> ")
        );
    }
}
