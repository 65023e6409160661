//! One node of the scenario (`fastbox verify p2p-node`): a fastlet in its own network
//! namespace with its own state directory and prefix, a DART stack (block cache, peers, the
//! S3 origin) and its peer server. The orchestrator drives it over stdin/stdout, one JSON
//! object per line:
//!
//! 1. the node opens its stack, starts its fastlet and its peer server, prints
//!    `{"event":"ready"}`;
//! 2. on `go` it fetches every block of the manifest (four at a time, printing
//!    `{"event":"progress","blocks":N}` every few blocks), materializes the template from its
//!    cache, restores it with CRIU into a slot and waits for execd's `/ping`, then prints
//!    `{"event":"done", ...}` with its counters and timings;
//! 3. it keeps serving its peers until `exit` (or end of input), then removes its sandbox,
//!    its template and everything its prefix names, and exits.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fastbox_artifact::{ArtifactStore, Digest, read_manifest};
use fastbox_fastlet::execd_client::ExecdClient;
use fastbox_fastlet::node_store::NodeStore;
use fastbox_fastlet::{Fastlet, PlaceRequest};
use fastbox_runtime::net::Ipv4Pool;
use serde::{Deserialize, Serialize};

use super::stack::StackConfig;
use crate::paths::HostArgs;

/// Blocks fetched at once by one node.
const FETCH_THREADS: usize = 4;
/// A progress line every this many blocks.
pub(super) const PROGRESS_EVERY: usize = 4;

#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    pub host: HostArgs,
    #[command(flatten)]
    pub stack: StackConfig,
    /// The manifest to restore (hex digest).
    #[arg(long)]
    pub manifest: String,
    /// The fastlet's prefix (at most 8 of [a-z0-9]).
    #[arg(long)]
    pub prefix: String,
    /// The fastlet's sandbox address pool.
    #[arg(long, value_name = "BASE/LEN")]
    pub pool: Ipv4Pool,
    /// The golden token of the template (also `FASTBOX_GOLDEN_TOKEN`).
    #[arg(long, env = "FASTBOX_GOLDEN_TOKEN", hide_env_values = true)]
    pub golden_token: String,
}

/// What a node reports when its restore answered.
#[derive(Debug, Serialize, Deserialize)]
pub struct NodeDone {
    pub event: String,
    pub node: String,
    /// Distinct blocks of the manifest.
    pub blocks: usize,
    pub cache_hits: u64,
    pub peer_fetches: u64,
    pub origin_fetches: u64,
    pub bytes_verified: u64,
    pub peer_served: u64,
    /// Cached blocks found corrupt on read, dropped and fetched again.
    pub corrupt_dropped: u64,
    /// From `go` until every block was local.
    pub fetch_seconds: f64,
    /// From `go` until the template was materialized.
    pub materialized_seconds: f64,
    /// From `go` until execd of the restored sandbox answered `/ping`.
    pub seconds: f64,
    /// The restore alone (slot, rootfs, CRIU, claim), milliseconds.
    pub restore_ms: f64,
    /// Bytes of the manifest's distinct blocks.
    pub bytes: u64,
}

pub fn run(args: NodeArgs) -> anyhow::Result<i32> {
    crate::paths::require_root()?;
    let manifest = Digest::from_hex(&args.manifest).context("--manifest")?;
    let stack = args.stack.open(&args.host.data_dir)?;
    let fastlet = Arc::new(Fastlet::start(args.host.fastlet_config(
        crate::paths::RunFastlet {
            prefix: &args.prefix,
            data_dir: args.host.data_dir.join("fastlet"),
            pool: args.pool,
            spare_slots: 0,
            artifact_store: stack.store(),
        },
    )?)?);
    emit(&serde_json::json!({"event": "ready"}));

    let mut lines = std::io::stdin().lock().lines();
    match lines.next() {
        Some(Ok(line)) if line.trim() == "go" => {}
        other => bail!("expected `go` on stdin, got {other:?}"),
    }
    let outcome = restore(&args, &stack, &fastlet, &manifest);
    let (done, placed) = match outcome {
        Ok(v) => v,
        Err(e) => {
            emit(
                &serde_json::json!({"event": "failed", "node": args.stack.node, "error": format!("{e:#}")}),
            );
            let _ = lines.next();
            cleanup(&fastlet, &args, None);
            return Ok(1);
        }
    };
    emit(&serde_json::to_value(&done)?);
    // Serve the peers until the orchestrator says the run is over.
    let _ = lines.next();
    cleanup(&fastlet, &args, Some(placed));
    drop(stack);
    Ok(0)
}

type Placed = (String, fastbox_fastlet::Placement, String);

fn restore(
    args: &NodeArgs,
    stack: &NodeStore,
    fastlet: &Fastlet,
    manifest: &Digest,
) -> anyhow::Result<(NodeDone, Placed)> {
    let go = Instant::now();
    let store = stack.store();
    let store: &dyn ArtifactStore = store.as_ref();
    let m = read_manifest(store, manifest).context("read the manifest")?;
    let blocks: Vec<Digest> = m.blocks().into_iter().collect();
    // The node serves these blocks to its peers for the whole run: none may be evicted.
    stack.pin(&manifest.to_hex(), blocks.iter().copied());
    let bytes = fetch_all(store, &blocks)?;
    let fetch_seconds = go.elapsed().as_secs_f64();
    let template = fastlet
        .template_from_artifact(store, manifest, &args.golden_token)
        .context("materialize the template")?;
    let materialized_seconds = go.elapsed().as_secs_f64();

    let id = format!("{}-p2p", args.prefix);
    let token = format!("{:032x}", rand::random::<u128>());
    let req = PlaceRequest {
        id: id.clone(),
        rootfs: template.rootfs.clone(),
        entrypoint: Vec::new(),
        env: Vec::new(),
        limits: Default::default(),
        disk_bytes: None,
        execd_token: token.clone(),
        egress_token: String::new(),
        policy: Default::default(),
        volumes: Vec::new(),
        volume_keys: Default::default(),
        credential_proxy: false,
    };
    let slot = fastlet.reserve_slot()?;
    let restore_clock = Instant::now();
    let (placement, _report) = fastlet.restore_from(&template, &req, slot).map_err(|e| {
        let _ = fastlet.remove(&id, None, Some(slot));
        anyhow::Error::from(e).context("restore")
    })?;
    let restore_ms = restore_clock.elapsed().as_secs_f64() * 1e3;
    let execd = ExecdClient::new(
        format!(
            "http://{}:{}",
            placement.address,
            fastbox_runtime::spec::EXECD_PORT
        ),
        Some(token),
    )?;
    execd
        .wait_ready(Duration::from_secs(10))
        .context("execd /ping of the restored sandbox")?;
    let seconds = go.elapsed().as_secs_f64();
    let c = stack.counters();
    Ok((
        NodeDone {
            event: "done".into(),
            node: args.stack.node.clone(),
            blocks: blocks.len(),
            cache_hits: c.cache_hits,
            peer_fetches: c.peer_fetches,
            origin_fetches: c.origin_fetches,
            bytes_verified: c.bytes_verified,
            peer_served: c.peer_served,
            corrupt_dropped: c.corrupt_dropped,
            fetch_seconds,
            materialized_seconds,
            seconds,
            restore_ms,
            bytes,
        },
        (id, placement, template.key),
    ))
}

/// Fetches every block through the stack (which verifies and caches each), a few at a time,
/// reporting progress; returns the bytes fetched.
fn fetch_all(store: &dyn ArtifactStore, blocks: &[Digest]) -> anyhow::Result<u64> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Vec<anyhow::Result<u64>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..FETCH_THREADS)
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<u64> {
                    let mut bytes = 0u64;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(digest) = blocks.get(i) else {
                            return Ok(bytes);
                        };
                        let block = store
                            .get_block(digest)
                            .with_context(|| format!("block {digest}"))?;
                        bytes += block.len() as u64;
                        let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                        if n.is_multiple_of(PROGRESS_EVERY) || n == blocks.len() {
                            emit(&serde_json::json!({"event": "progress", "blocks": n, "of": blocks.len()}));
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("fetch thread"))
            .collect()
    });
    results.into_iter().sum()
}

fn cleanup(fastlet: &Arc<Fastlet>, args: &NodeArgs, placed: Option<Placed>) {
    if let Some((id, placement, key)) = placed {
        if let Err(e) = fastlet.remove(&id, Some(&placement), None) {
            eprintln!("node {}: remove {id}: {e}", args.stack.node);
        }
        let _ = fastlet.remove_template(&key);
    }
    fastlet.drain_pools();
    let data_dir: PathBuf = args.host.data_dir.join("fastlet");
    fastbox_fastlet::from_artifact::unmount_all(&data_dir);
    if let Err(e) = fastbox_fastlet::host::purge(&args.prefix, &data_dir) {
        eprintln!("node {}: purge: {e}", args.stack.node);
    }
}

fn emit(value: &serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{value}");
    let _ = out.flush();
}
