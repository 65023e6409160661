//! `fastbox verify p2p`: the DART scenario on one machine, by itself (`docs/dart.md`).
//!
//! 1. **Network**: a bridge holding the origin's address and one network namespace per node
//!    ([`net`]); every host-wide name carries the run's prefix, and each node's fastlet has the
//!    prefix plus its node number.
//! 2. **Origin**: an `s3s-fs` S3 server on the bridge ([`origin`]).
//! 3. **Template**: a fastlet of the run builds the golden checkpoint of `--image`, adds a file
//!    of `--size-mib` random MiB to its rootfs, and publishes it into the origin.
//! 4. **Nodes**: `--nodes` fastlets, each a separate `fastbox verify p2p-node` process in its
//!    own namespace with its own state directory, block cache and peer server ([`node`]),
//!    restore that template cold at the same moment: every block is fetched through DART
//!    (owner by rendezvous hashing, peers before the origin), verified, materialized, restored
//!    with CRIU, and execd's `/ping` answers.
//! 5. **Checks**: every node restored (the killed one excepted, with `--kill-node`); in a clean
//!    run, origin fetches cluster-wide lie within `[blocks, blocks + 4]`; nothing carrying the
//!    prefix is left afterwards.
//!
//! `--compare-direct` then repeats step 4 with fresh caches and no peers, every node pulling
//! straight from the origin, so both delivery times come from one run.

mod node;

mod stack;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use fastbox_artifact::{ArtifactStore, Digest};
use fastbox_fastlet::Fastlet;
use serde::Serialize;

pub use node::{NodeArgs, run as run_node};

use crate::paths::{HostArgs, require_root};
use crate::scenario_net::ScenarioNet;
use crate::scenario_origin::{self as origin, Origin};
use node::NodeDone;

/// Extra origin fetches a clean run may need beyond one per block (a block whose owner's
/// first fetch raced a requester that fell back).
const ORIGIN_SLACK: u64 = 4;
/// How long the nodes may take to get ready, and to restore.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
const RESTORE_TIMEOUT: Duration = Duration::from_secs(900);
/// The file the scenario adds to the template's rootfs.
const PAYLOAD: &str = "fastbox-p2p.bin";

#[derive(clap::Args, Debug)]
pub struct P2pArgs {
    #[command(flatten)]
    pub host: HostArgs,
    /// Image whose golden checkpoint is the template.
    #[arg(long, default_value = "python:3.12", value_name = "REF")]
    pub image: String,
    /// Random data added to the template's rootfs, MiB.
    #[arg(long, default_value_t = 64)]
    pub size_mib: u64,
    /// Nodes restoring the template.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Prefix of the run's host-wide names (at most 7 of [a-z0-9]; node i's fastlet adds i)
    /// [default: fbp + 4 random hex digits].
    #[arg(long)]
    pub prefix: Option<String>,
    /// First two octets of the run's addresses (`A.B`: the bridge is A.B.0.1, node i
    /// A.B.0.(2+i), its sandboxes A.B.(1+i).0/24, the template build's A.B.99.0/24).
    #[arg(long, default_value = "10.241", value_name = "A.B")]
    pub net_base: String,
    /// Kill this node (0-based) with SIGKILL when it has fetched a third of the blocks; the
    /// others must still restore (the origin bound is not checked).
    #[arg(long, value_name = "I")]
    pub kill_node: Option<usize>,
    /// Afterwards, every node pulls the template again straight from the origin (fresh
    /// caches, no peers), for the delivery time next to DART's.
    #[arg(long)]
    pub compare_direct: bool,
    /// Afterwards, restart the first surviving node on its cache with one cached block
    /// corrupted: it must find every other block in its cache, drop the corrupt one, fetch it
    /// again and restore.
    #[arg(long)]
    pub restart_check: bool,
    /// Block cache budget of each node, MiB [default: twice the template, at least 512].
    #[arg(long)]
    pub cache_mib: Option<u64>,
    /// The s3s-fs binary [default: .deps/s3s-fs/bin/s3s-fs of the repository].
    #[arg(long, env = "FASTBOX_S3S_FS_BIN")]
    pub s3s_fs: Option<PathBuf>,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// One delivery of the template to every node.
#[derive(Debug, Serialize)]
pub struct Phase {
    /// `p2p` (peers, then the origin) or `direct` (the origin only).
    pub mode: &'static str,
    pub blocks: usize,
    pub bytes: u64,
    pub origin_fetches: u64,
    pub peer_fetches: u64,
    pub cache_hits: u64,
    pub bytes_verified: u64,
    /// From `go` until the last node's execd answered.
    pub seconds: f64,
    /// From `go` until the last node held every block.
    pub delivery_seconds: f64,
    /// Template bytes over each node's fetch time, MB/s (10^6 bytes).
    pub mb_per_s: Vec<f64>,
    pub killed: Option<usize>,
    pub nodes: Vec<NodeDone>,
}

/// What `verify p2p` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    pub image: String,
    pub size_mib: u64,
    pub nodes: usize,
    pub manifest: String,
    pub blocks: usize,
    pub origin_fetches: u64,
    pub peer_fetches: u64,
    pub cache_hits: u64,
    pub seconds: f64,
    pub bytes_verified: u64,
    /// Whether origin fetches lie within `[blocks, blocks + 4]` (clean runs only).
    pub origin_bound_ok: Option<bool>,
    pub publish_seconds: f64,
    pub p2p: Phase,
    pub direct: Option<Phase>,
    pub restart: Option<RestartCheck>,
    pub leftovers: Vec<String>,
}

/// A node restarted on its cache with one cached block corrupted.
#[derive(Debug, Serialize)]
pub struct RestartCheck {
    pub node: usize,
    /// The block whose cached copy was corrupted.
    pub corrupted_block: String,
    /// Whether the node restored using its cache for every other block, and dropped and
    /// fetched the corrupted one again.
    pub ok: bool,
    pub phase: Phase,
}

pub fn run(args: P2pArgs) -> anyhow::Result<i32> {
    require_root()?;
    ensure!((1..=32).contains(&args.nodes), "--nodes must be 1 to 32");
    ensure!(args.size_mib <= 64 * 1024, "--size-mib is at most 65536");
    if let Some(k) = args.kill_node {
        ensure!(
            k < args.nodes && args.nodes >= 2,
            "--kill-node must name one of at least 2 nodes"
        );
    }
    let prefix = crate::paths::run_prefix(args.prefix.as_deref(), "fbp", 7)?;
    let base = parse_base(&args.net_base)?;
    let s3s_fs = origin::s3s_fs_bin(args.s3s_fs.clone())?;
    let dir = args.host.data_dir.join(format!("verify-p2p-{prefix}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;

    let net = ScenarioNet::create(&prefix, base, args.nodes)?;
    let outcome = Origin::start(&s3s_fs, net.origin_ip(), &dir.join("origin"))
        .and_then(|origin| scenario(&args, &prefix, &dir, &net, &origin));
    net.remove();
    let removed = std::fs::remove_dir_all(&dir);
    let leftovers = fastbox_fastlet::host::leftovers(&prefix);
    let mut report = outcome?;
    removed.with_context(|| format!("remove {}", dir.display()))?;
    report.leftovers = leftovers;

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", human(&report));
    }
    let restored_all = report.p2p.nodes.len() + usize::from(report.p2p.killed.is_some())
        == args.nodes
        && report
            .direct
            .as_ref()
            .is_none_or(|d| d.nodes.len() == args.nodes);
    let ok = restored_all
        && report.origin_bound_ok != Some(false)
        && report.restart.as_ref().is_none_or(|r| r.ok)
        && report.leftovers.is_empty();
    Ok(if ok { 0 } else { 1 })
}

fn scenario(
    args: &P2pArgs,
    prefix: &str,
    dir: &Path,
    net: &ScenarioNet,
    origin: &Origin,
) -> anyhow::Result<Report> {
    let store = fastbox_s3::S3Store::open(origin.config()).context("open the origin")?;
    let publish = Instant::now();
    let (manifest, golden_token) = build_and_publish(args, prefix, dir, net, &store)?;
    let publish_seconds = publish.elapsed().as_secs_f64();
    let cache_mib = args
        .cache_mib
        .unwrap_or_else(|| (2 * args.size_mib + 256).max(512));
    let group_key = format!("{:064x}", rand::random::<u128>());
    let ctx = PhaseContext {
        args,
        prefix,
        dir,
        net,
        origin,
        manifest: &manifest,
        golden_token: &golden_token,
        group_key: &group_key,
        cache_mib,
    };
    let all: Vec<usize> = (0..args.nodes).collect();
    let p2p = ctx.run("p2p", &all, args.kill_node)?;
    let direct = if args.compare_direct {
        Some(ctx.run("direct", &all, None)?)
    } else {
        None
    };
    let restart = if args.restart_check {
        let node = usize::from(args.kill_node == Some(0));
        Some(ctx.restart_check(node, &store)?)
    } else {
        None
    };
    let origin_bound_ok = (p2p.killed.is_none()).then(|| {
        let blocks = p2p.blocks as u64;
        (blocks..=blocks + ORIGIN_SLACK).contains(&p2p.origin_fetches)
    });
    Ok(Report {
        image: args.image.clone(),
        size_mib: args.size_mib,
        nodes: args.nodes,
        manifest: manifest.to_hex(),
        blocks: p2p.blocks,
        origin_fetches: p2p.origin_fetches,
        peer_fetches: p2p.peer_fetches,
        cache_hits: p2p.cache_hits,
        seconds: p2p.seconds,
        bytes_verified: p2p.bytes_verified,
        origin_bound_ok,
        publish_seconds,
        p2p,
        direct,
        restart,
        leftovers: Vec::new(),
    })
}

/// Builds the template of `--image` with a fastlet of the run, adds the random payload to a
/// copy of its rootfs (hard links: the image cache is not touched) and publishes it into the
/// origin. Returns the manifest and the golden token.
fn build_and_publish(
    args: &P2pArgs,
    prefix: &str,
    dir: &Path,
    net: &ScenarioNet,
    store: &dyn ArtifactStore,
) -> anyhow::Result<(Digest, String)> {
    let image = args.host.resolve_image(&args.image)?;
    let builder_prefix = format!("{prefix}b");
    let data_dir = dir.join("builder");
    let fastlet = Fastlet::start(args.host.fastlet_config(crate::paths::RunFastlet {
        prefix: &builder_prefix,
        data_dir: data_dir.clone(),
        pool: net.builder_pool().parse().context("builder pool")?,
        spare_slots: 0,
        artifact_store: fastbox_fastlet::node_store::open_local(&data_dir)?,
    })?)?;
    let built = (|| -> anyhow::Result<(Digest, String)> {
        eprintln!(
            "verify p2p: building the golden checkpoint of {}",
            args.image
        );
        let mut template = fastlet.template(&image)?;
        let rootfs = dir.join("rootfs");
        copy_linked(&template.rootfs, &rootfs)?;
        eprintln!("verify p2p: adding {} MiB of random data", args.size_mib);
        write_random(&rootfs.join(PAYLOAD), args.size_mib << 20)?;
        template.rootfs = rootfs.clone();
        let work = dir.join("publish-work");
        std::fs::create_dir_all(&work)?;
        eprintln!("verify p2p: publishing into the origin");
        let key = format!("verify-p2p/{prefix}");
        let published = fastbox_fastlet::artifact::publish_template(
            store,
            &template,
            &fastbox_fastlet::artifact::PublishOptions::new(&key, &work),
            &fastbox_artifact::NoProgress,
        )?;
        let _ = std::fs::remove_dir_all(&rootfs);
        let _ = std::fs::remove_dir_all(&work);
        Ok((published.manifest, template.golden_token))
    })();
    fastlet.drain_pools();
    fastlet.shutdown();
    fastbox_fastlet::host::purge(&builder_prefix, &data_dir).context("purge the builder")?;
    built
}

/// `cp -al`: the tree with every file hard-linked (cheap, and the source stays untouched).
fn copy_linked(from: &Path, to: &Path) -> anyhow::Result<()> {
    let status = Command::new("cp")
        .arg("-al")
        .arg(from)
        .arg(to)
        .status()
        .context("run cp")?;
    ensure!(
        status.success(),
        "cp -al {} {}: {status}",
        from.display(),
        to.display()
    );
    Ok(())
}

/// A file of `len` random bytes (a fast PRNG seeded from the OS: incompressible, unique per
/// run).
fn write_random(path: &Path, len: u64) -> anyhow::Result<()> {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::SmallRng::from_os_rng();
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?,
    );
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        rng.fill_bytes(&mut buf[..n]);
        out.write_all(&buf[..n])?;
        left -= n as u64;
    }
    out.flush()?;
    Ok(())
}

struct PhaseContext<'a> {
    args: &'a P2pArgs,
    prefix: &'a str,
    dir: &'a Path,
    net: &'a ScenarioNet,
    origin: &'a Origin,
    manifest: &'a Digest,
    golden_token: &'a str,
    group_key: &'a str,
    cache_mib: u64,
}

/// A node process and its stdin.
struct NodeProcess {
    /// The node's number.
    index: usize,
    child: Child,
    stdin: Option<ChildStdin>,
    prefix: String,
    data_dir: PathBuf,
}

enum Event {
    Line(usize, serde_json::Value),
    Closed(usize),
}

impl PhaseContext<'_> {
    /// Starts every node, says `go` to all at once, waits for their results (killing
    /// `kill` a third of the way), then lets them clean up.
    fn run(
        &self,
        mode: &'static str,
        which: &[usize],
        kill: Option<usize>,
    ) -> anyhow::Result<Phase> {
        let (tx, rx) = mpsc::channel();
        let mut procs = Vec::with_capacity(which.len());
        for &i in which {
            match self.spawn(mode, i, tx.clone()) {
                Ok(p) => procs.push(p),
                Err(e) => {
                    finish(&mut procs, None);
                    return Err(e);
                }
            }
        }
        drop(tx);
        let outcome = self.drive(&mut procs, &rx, kill);
        finish(&mut procs, kill);
        let (nodes, seconds, killed) = outcome?;
        let blocks = nodes.first().map_or(0, |d| d.blocks);
        let bytes = nodes.first().map_or(0, |d| d.bytes);
        Ok(Phase {
            mode,
            blocks,
            bytes,
            origin_fetches: nodes.iter().map(|d| d.origin_fetches).sum(),
            peer_fetches: nodes.iter().map(|d| d.peer_fetches).sum(),
            cache_hits: nodes.iter().map(|d| d.cache_hits).sum(),
            bytes_verified: nodes.iter().map(|d| d.bytes_verified).sum(),
            seconds,
            delivery_seconds: nodes.iter().map(|d| d.fetch_seconds).fold(0.0, f64::max),
            mb_per_s: nodes
                .iter()
                .map(|d| d.bytes as f64 / 1e6 / d.fetch_seconds.max(1e-9))
                .collect(),
            killed,
            nodes,
        })
    }

    fn spawn(
        &self,
        mode: &str,
        i: usize,
        events: mpsc::Sender<Event>,
    ) -> anyhow::Result<NodeProcess> {
        let node_prefix = format!("{}{i}", self.prefix);
        let data_dir = self.node_dir(mode, i);
        std::fs::create_dir_all(&data_dir)?;
        let peers: Vec<String> = (0..self.args.nodes)
            .map(|j| format!("n{j}={}", self.peer_addr(j)))
            .collect();
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["verify", "p2p-node"])
            .args(["--node", &format!("n{i}")])
            .args(["--origin", &self.origin.url()])
            .args(["--cache-mib", &self.cache_mib.to_string()])
            .args(["--manifest", &self.manifest.to_hex()])
            .args(["--prefix", &node_prefix])
            .args(["--pool", &self.net.sandbox_pool(i)])
            .arg("--data-dir")
            .arg(&data_dir)
            .arg("--cache-dir")
            .arg(&self.args.host.cache_dir)
            .env("AWS_ACCESS_KEY_ID", &self.origin.access_key)
            .env("AWS_SECRET_ACCESS_KEY", &self.origin.secret_key)
            .env("FASTBOX_DART_KEY", self.group_key)
            .env("FASTBOX_GOLDEN_TOKEN", self.golden_token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if mode == "p2p" {
            cmd.args(["--listen", &self.peer_addr(i)])
                .args(["--peers", &peers.join(",")]);
        }
        for (flag, path) in [
            ("--criu", self.args.host.criu.as_ref()),
            ("--execd", self.args.host.execd.as_ref()),
        ] {
            if let Some(p) = path {
                cmd.arg(flag).arg(p);
            }
        }
        self.net.enter(i, &mut cmd)?;
        let mut child = cmd.spawn().context("start a node")?;
        let stdout = child.stdout.take().context("node stdout")?;
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str(&line) {
                    Ok(v) => {
                        let _ = events.send(Event::Line(i, v));
                    }
                    Err(_) => eprintln!("node n{i}: {line}"),
                }
            }
            let _ = events.send(Event::Closed(i));
        });
        Ok(NodeProcess {
            index: i,
            stdin: child.stdin.take(),
            child,
            prefix: node_prefix,
            data_dir,
        })
    }

    /// A node's state directory in `mode`; a restart reuses the one of the p2p run.
    fn node_dir(&self, mode: &str, i: usize) -> PathBuf {
        let mode = if mode == "restart" { "p2p" } else { mode };
        self.dir.join(mode).join(format!("n{i}"))
    }

    /// Corrupts one block in node `node`'s cache (left by the p2p run), restarts the node on
    /// it with the origin only, and checks it refetched exactly that block.
    fn restart_check(
        &self,
        node: usize,
        store: &dyn ArtifactStore,
    ) -> anyhow::Result<RestartCheck> {
        let manifest = fastbox_artifact::read_manifest(store, self.manifest)?;
        let block = manifest
            .blocks()
            .into_iter()
            .next()
            .context("an empty manifest")?;
        let hex = block.to_hex();
        let path = self
            .node_dir("restart", node)
            .join("block-cache/blocks")
            .join(&hex[..2])
            .join(&hex);
        let mut bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        bytes[0] ^= 0xff;
        std::fs::write(&path, &bytes).with_context(|| format!("corrupt {}", path.display()))?;
        eprintln!(
            "verify p2p: restarting n{node} on its cache with block {} corrupted",
            &hex[..12]
        );
        let phase = self.run("restart", &[node], None)?;
        let ok = phase.nodes.first().is_some_and(|d| {
            d.corrupt_dropped == 1 && d.origin_fetches == 1 && d.peer_fetches == 0
        });
        Ok(RestartCheck {
            node,
            corrupted_block: hex,
            ok,
            phase,
        })
    }

    fn peer_addr(&self, i: usize) -> String {
        format!("{}:7470", self.net.node_ip(i))
    }

    #[allow(clippy::type_complexity)]
    fn drive(
        &self,
        procs: &mut [NodeProcess],
        rx: &mpsc::Receiver<Event>,
        kill: Option<usize>,
    ) -> anyhow::Result<(Vec<NodeDone>, f64, Option<usize>)> {
        let n = procs.len();
        let mut ready = 0;
        let deadline = Instant::now() + READY_TIMEOUT;
        while ready < n {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Event::Line(_, v)) if v["event"] == "ready" => ready += 1,
                Ok(Event::Line(i, v)) => bail!("node n{i} before ready: {v}"),
                Ok(Event::Closed(i)) => bail!("node n{i} exited before it was ready"),
                Err(_) => bail!("the nodes were not ready within {READY_TIMEOUT:?}"),
            }
        }
        let go = Instant::now();
        for p in procs.iter_mut() {
            if let Some(stdin) = p.stdin.as_mut() {
                writeln!(stdin, "go").context("say go to a node")?;
            }
        }
        let mut done = std::collections::BTreeMap::new();
        let mut finished = 0;
        let mut killed = None;
        let mut last = 0.0f64;
        let deadline = go + RESTORE_TIMEOUT;
        let expected = n - usize::from(kill.is_some());
        while finished < expected {
            let event = rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .map_err(|_| {
                    anyhow::anyhow!("the nodes did not restore within {RESTORE_TIMEOUT:?}")
                })?;
            match event {
                Event::Line(i, v) if v["event"] == "progress" => {
                    if let Some(quarter) = quarter_reached(&v) {
                        eprintln!(
                            "verify p2p: n{i} holds {}/{} blocks ({}%, {:.1} s)",
                            v["blocks"],
                            v["of"],
                            quarter * 25,
                            go.elapsed().as_secs_f64()
                        );
                    }
                    if kill == Some(i) && killed.is_none() && past_a_third(&v) {
                        eprintln!("verify p2p: killing node n{i} (SIGKILL) mid-transfer");
                        if let Some(p) = procs.iter_mut().find(|p| p.index == i) {
                            let _ = p.child.kill();
                        }
                        killed = Some(i);
                    }
                }
                Event::Line(i, v) if v["event"] == "done" => {
                    let d: NodeDone =
                        serde_json::from_value(v).with_context(|| format!("node n{i}'s result"))?;
                    last = last.max(go.elapsed().as_secs_f64());
                    eprintln!(
                        "verify p2p: n{i} restored in {:.2} s ({} origin, {} peer fetches)",
                        d.seconds, d.origin_fetches, d.peer_fetches
                    );
                    done.insert(i, d);
                    finished += 1;
                }
                Event::Line(i, v) if v["event"] == "failed" => {
                    bail!("node n{i} failed: {}", v["error"])
                }
                Event::Line(i, v) => eprintln!("node n{i}: {v}"),
                Event::Closed(i) if killed == Some(i) => {}
                Event::Closed(i) => bail!("node n{i} exited before it restored"),
            }
        }
        Ok((done.into_values().collect(), last, killed))
    }
}

/// The quarter (1 to 4) of the blocks a progress line has just reached, if it is the first
/// line past it (nodes report every few blocks).
fn quarter_reached(progress: &serde_json::Value) -> Option<u64> {
    let blocks = progress["blocks"].as_u64()?;
    let of = progress["of"].as_u64().filter(|&of| of > 0)?;
    let quarter = blocks * 4 / of;
    let step = node::PROGRESS_EVERY as u64;
    let previous = blocks.saturating_sub(step) * 4 / of;
    (quarter > previous && quarter > 0).then_some(quarter.min(4))
}

/// Whether a progress line says a third of the blocks are in (the kill point).
fn past_a_third(progress: &serde_json::Value) -> bool {
    let blocks = progress["blocks"].as_u64().unwrap_or(0);
    let of = progress["of"].as_u64().unwrap_or(u64::MAX);
    blocks.saturating_mul(3) >= of
}

/// Tells every node to clean up and exit, waits (killing one that hangs), and purges what a
/// killed node left.
fn finish(procs: &mut [NodeProcess], killed: Option<usize>) {
    for p in procs.iter_mut() {
        if let Some(mut stdin) = p.stdin.take() {
            let _ = writeln!(stdin, "exit");
        }
    }
    for p in procs.iter_mut() {
        let i = p.index;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match p.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                _ => {
                    eprintln!("verify p2p: node n{i} did not exit: killing it");
                    let _ = p.child.kill();
                    let _ = p.child.wait();
                    break;
                }
            }
        }
        if killed == Some(i)
            || !p
                .child
                .try_wait()
                .is_ok_and(|s| s.is_some_and(|s| s.success()))
        {
            let fastlet_dir = p.data_dir.join("fastlet");
            fastbox_fastlet::from_artifact::unmount_all(&fastlet_dir);
            if let Err(e) = fastbox_fastlet::host::purge(&p.prefix, &fastlet_dir) {
                eprintln!("verify p2p: purge node n{i}: {e}");
            }
        }
    }
}

fn parse_base(text: &str) -> anyhow::Result<[u8; 2]> {
    let parts: Vec<u8> = text
        .split('.')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("--net-base {text:?}: expected A.B"))?;
    match parts[..] {
        [a, b] => Ok([a, b]),
        _ => bail!("--net-base {text:?}: expected two octets, A.B"),
    }
}

fn human(r: &Report) -> String {
    let mut out = format!(
        "DART p2p: {} nodes restored {} ({} MiB payload; manifest {}, {} blocks)\n",
        r.nodes,
        r.image,
        r.size_mib,
        &r.manifest[..12],
        r.blocks
    );
    for phase in std::iter::once(&r.p2p).chain(r.direct.as_ref()) {
        out += &format!(
            "  {:6}: {:.2} s to the last /ping, delivery {:.2} s; origin {} peer {} cache {} fetches; {:.1} MB verified; MB/s per node {:?}{}\n",
            phase.mode,
            phase.seconds,
            phase.delivery_seconds,
            phase.origin_fetches,
            phase.peer_fetches,
            phase.cache_hits,
            phase.bytes_verified as f64 / 1e6,
            phase
                .mb_per_s
                .iter()
                .map(|m| (m * 10.0).round() / 10.0)
                .collect::<Vec<_>>(),
            phase
                .killed
                .map(|k| format!(" (n{k} killed)"))
                .unwrap_or_default(),
        );
    }
    if let Some(rc) = &r.restart {
        let d = rc.phase.nodes.first();
        out += &format!(
            "  restart: n{} on its cache, block {} corrupted: {} cache hits, {} corrupt dropped, {} fetched again: {}\n",
            rc.node,
            &rc.corrupted_block[..12],
            d.map_or(0, |d| d.cache_hits),
            d.map_or(0, |d| d.corrupt_dropped),
            d.map_or(0, |d| d.origin_fetches),
            if rc.ok { "ok" } else { "NOT OK" }
        );
    }
    if let Some(ok) = r.origin_bound_ok {
        out += &format!(
            "  origin fetches {} within [{}, {}]: {}\n",
            r.origin_fetches,
            r.blocks,
            r.blocks as u64 + ORIGIN_SLACK,
            if ok { "yes" } else { "NO" }
        );
    }
    if !r.leftovers.is_empty() {
        out += &format!("  LEFT ON THE HOST: {:?}\n", r.leftovers);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(blocks: u64, of: u64) -> serde_json::Value {
        serde_json::json!({"event": "progress", "blocks": blocks, "of": of})
    }

    #[test]
    fn each_quarter_is_reported_once_as_nodes_report_every_few_blocks() {
        let of = 322;
        let mut reported = Vec::new();
        let mut lines: Vec<u64> = (1..=of / 4).map(|k| k * 4).collect();
        lines.push(of);
        for blocks in lines {
            if let Some(q) = quarter_reached(&progress(blocks, of)) {
                reported.push(q);
            }
        }
        assert_eq!(reported, vec![1, 2, 3, 4]);
        assert_eq!(quarter_reached(&progress(4, 0)), None);
    }

    #[test]
    fn the_kill_point_is_a_third_of_the_blocks() {
        assert!(!past_a_third(&progress(10, 43)));
        assert!(past_a_third(&progress(15, 43)));
        assert!(!past_a_third(&serde_json::json!({"blocks": 5})));
    }

    #[test]
    fn the_net_base_is_two_octets() {
        assert_eq!(parse_base("10.241").unwrap(), [10, 241]);
        assert!(parse_base("10").is_err());
        assert!(parse_base("10.300").is_err());
        assert!(parse_base("10.1.2").is_err());
    }
}
