//! The create-from-snapshot step of `verify cluster`: a snapshot of a sandbox on the node
//! about to be killed (published to the shared store); once that node is lost, a create from
//! it lands on another node, which fetches the snapshot whole and restores it. The new
//! sandbox must hold the file the source wrote before the snapshot.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use super::api::Api;
use super::moves::node_of;

/// How long a snapshot may take to be ready.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);
/// What the source writes before its snapshot.
const MARK: &str = "snapshot-mark-42";

/// What the step found.
#[derive(Debug, Serialize)]
pub struct SnapshotReport {
    pub taken_on: String,
    pub restored_on: String,
    /// From the create request until the sandbox on the other node was `Running`.
    pub create_ms: u64,
    /// Whether it held the file written before the snapshot.
    pub kept_file: bool,
}

/// A live snapshot of sandbox `source`, after it wrote a file: its id once it is ready.
pub(super) fn take(api: &Api, source: &str) -> anyhow::Result<String> {
    api.sh(source, &format!("echo {MARK} > /tmp/snapshot-mark"))?;
    let (status, snapshot) = api.post(&format!("/v1/sandboxes/{source}/snapshots"))?;
    if !(200..300).contains(&status) {
        bail!("snapshot of {source}: {status} {snapshot}");
    }
    let snapshot = snapshot["id"]
        .as_str()
        .context("the snapshot has no id")?
        .to_string();
    let deadline = Instant::now() + SNAPSHOT_TIMEOUT;
    loop {
        let (_, got) = api.get(&format!("/v1/snapshots/{snapshot}"))?;
        match got["status"]["state"].as_str() {
            Some("Ready") => return Ok(snapshot),
            Some("Failed") => bail!("snapshot {snapshot} failed: {got}"),
            _ if Instant::now() >= deadline => bail!("snapshot {snapshot} not ready: {got}"),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A create from `snapshot`, taken on node `taken_on` which is lost now: it lands on another
/// node, which fetches the snapshot from the shared store. The sandbox and the snapshot are
/// removed afterwards.
pub(super) fn restore_elsewhere(
    api: &Api,
    snapshot: &str,
    taken_on: &str,
) -> anyhow::Result<SnapshotReport> {
    let clock = Instant::now();
    let clone = api.create(&serde_json::json!({
        "snapshotId": snapshot,
        "timeout": 3600,
    }))?;
    let took = clock.elapsed();
    let restored_on = node_of(api, &clone)?;
    let kept_file = api.sh(&clone, "cat /tmp/snapshot-mark")?.trim() == MARK;
    api.delete(&format!("/v1/sandboxes/{clone}"))?;
    api.delete(&format!("/v1/snapshots/{snapshot}"))?;
    Ok(SnapshotReport {
        taken_on: taken_on.to_string(),
        restored_on,
        create_ms: took.as_millis() as u64,
        kept_file,
    })
}
