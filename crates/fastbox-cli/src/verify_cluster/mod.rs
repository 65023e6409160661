//! `fastbox verify cluster`: several nodes behind one server, on one machine, by itself
//! (`docs/cluster.md`).
//!
//! 0. **Network** ([`crate::scenario_net`]): a bridge holding the server's address, one
//!    network namespace per joined node (its host) and a test host running the
//!    [`collector`], the fencing witness: test sandboxes report to it every 100 ms, and the
//!    source of each report says which node ran the sandbox. The origin is an `s3s-fs` on
//!    the bridge ([`crate::scenario_origin`]), each of whose block reads an instance delays
//!    by `--origin-block-delay-ms`; every instance is in one DART group (its peer server on
//!    its host), and each node's delivery counters are reported at the end.
//! 1. **Server alone**: a `fastbox up --accept-nodes` (its own node in process) prepares the
//!    image; `--creates` creates at `--concurrency` through the lifecycle API, each timed to
//!    execd's `/ping` (the one-node figures).
//! 2. **Cluster**: `--nodes` − 1 `fastbox node --join` agents join it, each in its host (its
//!    own prefix, address pool and data directory); the same creates again, with each node's
//!    share (the server's admissions per node).
//! 3. **Node loss**: a reporting sandbox on the last node and one elsewhere; the node's agent
//!    is killed with SIGKILL. Checked: its lease runs out, then the node is declared lost no
//!    sooner than the lease after the kill; its fencing guard froze its sandboxes before
//!    that (the marker, the cgroups and the collector say so); its sandbox is `Failed`
//!    (`NODE_LOST`) while the other still answers.
//! 4. **Snapshots elsewhere** ([`snapshot_elsewhere`]): before the kill, a snapshot of the
//!    sandbox on that node; once it is lost, a create from the snapshot runs on another node
//!    and holds the file written before the snapshot.
//! 5. **Cross-node resume** ([`moves`]): before the kill, a third sandbox on that node fills
//!    `--move-mib` of memory, is paused and resumed there (timed), and paused again; once the
//!    node is lost it resumes on another node from the checkpoint in the origin, timed until
//!    execd answers and until its memory is local; its memory must sum as before and its
//!    report count go on.
//! 6. **Return**: the agent starts again and joins; the server removes what it ran while lost,
//!    and what the moved sandbox left there; nothing reports from it again.
//! 7. **Cut mid-resume** ([`cut`]): node n1 is cut off from the server right after a resume
//!    of a sandbox there was requested; the sandbox goes on elsewhere once n1 is lost, and
//!    what n1 restored meanwhile never reports after n1's fence.
//! 8. No sandbox reported from two nodes at once; everything stops, every prefix is purged,
//!    the network is removed, and nothing carrying the run's prefix is left.
//!
//! The nodes share the machine's CPU and disk: the figures are the cluster's overhead on one
//! host, not more capacity.

pub mod api;
pub mod collector;
mod cut;
pub mod moves;
pub mod procs;
mod snapshot_elsewhere;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use serde::Serialize;

use crate::bench_create::client::BenchClient;
use crate::bench_create::request::{self, Pool, Source};
use crate::bench_create::run::{self, Pace, Plan};
use crate::bench_create::stats::{Latency, Tally};
use crate::paths::{HostArgs, require_root, run_prefix};
use crate::scenario_net::{self, ScenarioNet};
use crate::scenario_origin::Origin;
use api::Api;
use collector::Collector;
use cut::CutReport;
use moves::MoveReport;
use procs::Instance;
use snapshot_elsewhere::SnapshotReport;

/// How long the server may take to prepare its image, and a node to join.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a test sandbox may take to report to the collector.
const REPORT_TIMEOUT: Duration = Duration::from_secs(20);
/// The ports of a joined node's API and proxy, on its own host's address.
const NODE_API_PORT: u16 = 7001;
const NODE_PROXY_PORT: u16 = 7002;
/// The port of a joined node's DART peer server.
const DART_PORT: u16 = 7470;

#[derive(clap::Args, Debug)]
pub struct ClusterArgs {
    #[command(flatten)]
    pub host: HostArgs,
    /// Nodes, the server's own included (at least 2).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Timed creates, on one node and then on the cluster.
    #[arg(long, default_value_t = 100)]
    pub creates: usize,
    /// Creates in flight at once.
    #[arg(long, default_value_t = 10)]
    pub concurrency: usize,
    /// Image of every sandbox.
    #[arg(long, default_value = "fastbox/busybox", value_name = "REF")]
    pub image: String,
    /// Lease of the joined nodes, milliseconds (lost half a lease after it ran out).
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// Prefix of the run's host-wide names (at most 7 of [a-z0-9]; the server's instance adds
    /// `s`, node i adds i) [default: fc + 4 random hex digits].
    #[arg(long)]
    pub prefix: Option<String>,
    /// Second octet of the run's addresses: the bridge (the server's host) is 10.B.0.1, node
    /// i's host 10.B.0.(1+i), the test host 10.B.0.254; the server's sandboxes take
    /// 10.B.99.0/24, node i's 10.B.i.0/24.
    #[arg(long, default_value_t = 219, value_name = "B")]
    pub net_octet: u8,
    /// Memory the moved sandbox holds, MiB (pseudo-random, in a busybox shell).
    #[arg(long, default_value_t = 256, value_name = "MIB")]
    pub move_mib: u64,
    /// Delay of every block read from the origin (on top of s3s-fs's own), milliseconds:
    /// the latency of a remote origin.
    #[arg(long, default_value_t = 5, value_name = "MS")]
    pub origin_block_delay_ms: u64,
    /// The s3s-fs binary, the origin [default: .deps/s3s-fs/bin/s3s-fs of the repository].
    #[arg(long, env = "FASTBOX_S3S_FS_BIN")]
    pub s3s_fs: Option<PathBuf>,
    /// Print one JSON object instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// What a run found.
#[derive(Debug, Serialize)]
pub struct ClusterReport {
    pub nodes: usize,
    pub image: String,
    pub creates: usize,
    pub concurrency: usize,
    /// The creates on the server's node alone.
    pub one_node: CreateRun,
    /// The same creates with every node joined.
    pub cluster: CreateRun,
    pub loss: LossReport,
    /// A create from a snapshot taken on another node.
    pub snapshot: SnapshotReport,
    /// A paused sandbox of the lost node resumed on another.
    pub moved: MoveReport,
    /// A node cut off from the server in the middle of a resume.
    pub cut: CutReport,
    /// What the test sandboxes reported to the collector.
    pub fencing: FencingReport,
    /// Each node's DART delivery counters at the end (a node's count from its last start).
    pub delivery: Vec<(String, std::collections::BTreeMap<String, u64>)>,
    /// Whether every check held.
    pub passed: bool,
    /// The checks that did not hold.
    pub failures: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct CreateRun {
    pub latency: Latency,
    pub failures: usize,
    pub seconds: f64,
    /// Creates admitted per node during the run.
    pub share: Vec<(String, u64)>,
}

/// The fencing witness: every test sandbox reported, every 100 ms, to a collector on the
/// test host, which noted the node each report came from.
#[derive(Debug, Serialize)]
pub struct FencingReport {
    /// Test sandboxes that reported, and their reports.
    pub sandboxes: usize,
    pub reports: usize,
    /// Sandboxes that reported from two nodes at once (none in a passing run).
    pub doubles: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct LossReport {
    pub node: String,
    pub lease_ms: u64,
    /// From the SIGKILL until the server said the lease ran out, and until it declared the
    /// node lost.
    pub expired_after_ms: u64,
    pub lost_after_ms: u64,
    /// Sandbox groups the node's guard froze (its marker), and whether the kernel reported
    /// each frozen when the node was declared lost.
    pub fenced: usize,
    pub all_frozen: bool,
    /// The state and reason of its sandbox once the node was lost.
    pub lost_sandbox: (String, Option<String>),
    /// Whether the sandbox on the server's node still answered.
    pub survivor_answers: bool,
    /// From the SIGKILL until its sandbox's last report from the node (the fence stopped it).
    pub last_report_after_kill_ms: Option<u64>,
    /// From its restart until the server removed what it ran while lost.
    pub removed_after_return_ms: u64,
}

pub fn run(args: ClusterArgs) -> anyhow::Result<i32> {
    require_root()?;
    ensure!(args.nodes >= 2, "--nodes must be at least 2");
    ensure!(
        args.creates > 0 && args.concurrency > 0,
        "--creates and --concurrency must be at least 1"
    );
    let prefix = run_prefix(args.prefix.as_deref(), "fc", 7)?;
    ensure!(
        args.nodes <= 10,
        "--nodes must be at most 10 (each instance adds one character to the prefix)"
    );
    let criu = args.host.criu()?;
    let execd = args.host.execd()?;
    let dir = tempfile::Builder::new()
        .prefix(&format!("fastbox-verify-cluster-{prefix}-"))
        .tempdir()
        .context("the run's directory")?;
    progress(format!(
        "a bridge with {} node hosts and a test host (10.{}.0.0/24)",
        args.nodes - 1,
        args.net_octet
    ));
    let net = ScenarioNet::create_with_test_host(&prefix, [10, args.net_octet], args.nodes - 1)?;
    let s3s_fs = crate::scenario_origin::s3s_fs_bin(args.s3s_fs.clone())?;
    let started = Collector::start(&net.test_netns(), net.test_host_ip()).and_then(|collector| {
        progress(format!("the origin: s3s-fs on {}", net.origin_ip()));
        let origin = Origin::start(&s3s_fs, net.origin_ip(), &dir.path().join("origin"))?;
        Ok((collector, origin, scenario_net::free_port(net.origin_ip())?))
    });
    let outcome = started.map(|(collector, origin, server_dart_port)| {
        let mut scenario = Scenario {
            dir: dir.path().to_path_buf(),
            prefix: prefix.clone(),
            criu: criu.path.clone(),
            execd,
            cache_dir: args.host.cache_dir.clone(),
            args: &args,
            net: &net,
            collector: &collector,
            origin: &origin,
            dart_key: format!("{:064x}", rand::random::<u128>()),
            server_dart_port,
            failures: Vec::new(),
        };
        let report = scenario.run();
        (report, scenario.prefixes())
    });
    net.remove();
    // A run that failed keeps its directory (every instance's log) for a look.
    let failed = match &outcome {
        Ok((Ok(report), _)) => !report.failures.is_empty(),
        _ => true,
    };
    let run_dir = dir.keep();
    if failed {
        eprintln!(
            "fastbox: the run failed: its logs are kept in {}",
            run_dir.display()
        );
    }
    let (report, prefixes) = outcome?;
    // Every process is stopped and purged by now (or by the drops on an error).
    let mut leftovers: Vec<String> = prefixes
        .iter()
        .flat_map(|p| crate::local_sandbox::leftovers(p))
        .collect();
    leftovers.extend(scenario_net::leftovers(&prefix));
    // The run's directory goes too. A fence guard outlives its stopped node for a moment and
    // may still write its marker there, so the removal is tried again for a few seconds.
    if !failed && let Err(e) = remove_run_dir(&run_dir) {
        leftovers.push(format!("{}: {e}", run_dir.display()));
    }
    let mut report = report?;
    if !leftovers.is_empty() {
        report.failures.push(format!("left behind: {leftovers:?}"));
    }
    report.passed = report.failures.is_empty();
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", human(&report));
    }
    Ok(if report.passed { 0 } else { 1 })
}

/// Removes `dir`, trying again for up to 10 s while something still writes into it.
fn remove_run_dir(dir: &Path) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::remove_dir_all(dir) {
            Err(_) if !dir.exists() => return Ok(()),
            Err(_) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(250));
            }
            other => return other,
        }
    }
}

struct Scenario<'a> {
    dir: PathBuf,
    prefix: String,
    criu: PathBuf,
    execd: PathBuf,
    cache_dir: PathBuf,
    args: &'a ClusterArgs,
    net: &'a ScenarioNet,
    collector: &'a Collector,
    origin: &'a Origin,
    /// The DART group's secret, and the server's peer server's port.
    dart_key: String,
    server_dart_port: u16,
    failures: Vec<String>,
}

impl Scenario<'_> {
    fn prefixes(&self) -> Vec<String> {
        std::iter::once(format!("{}s", self.prefix))
            .chain((1..self.args.nodes).map(|i| format!("{}{i}", self.prefix)))
            .collect()
    }

    /// The bridge's address: the server's host.
    fn host_ip(&self) -> std::net::Ipv4Addr {
        self.net.origin_ip()
    }

    /// Node `id`'s host address (`local` is the server's).
    fn ip_of(&self, id: &str) -> std::net::Ipv4Addr {
        match id.strip_prefix('n').and_then(|i| i.parse::<usize>().ok()) {
            Some(i) if i >= 1 => self.net.node_ip(i - 1),
            _ => self.host_ip(),
        }
    }

    /// Starts the collector's reporter in sandbox `id` (its token is its id) and waits for
    /// its first report from node `node`.
    fn report_from(&self, api: &Api, id: &str, node: &str) -> anyhow::Result<()> {
        api.sh(id, &self.collector.reporter(id))?;
        self.collector
            .wait_for(id, self.ip_of(node), REPORT_TIMEOUT)
            .with_context(|| format!("{id} on node {node}"))
    }

    /// Reports of sandbox `id` from node `node` after `after`.
    fn reports_after(&self, id: &str, node: &str, after: Instant) -> Vec<collector::Report> {
        let ip = self.ip_of(node);
        self.collector
            .of(id)
            .into_iter()
            .filter(|r| r.from == ip && r.at > after)
            .collect()
    }

    /// Whether sandbox `id`'s first report from `to` counts on from its last from `from`
    /// before it was paused at `paused`: the memory of its checkpoint went on there.
    fn count_went_on(&self, id: &str, from: &str, paused: Instant, to: &str) -> bool {
        let reports = self.collector.of(id);
        let of = |node: &str| {
            let ip = self.ip_of(node);
            reports.iter().filter(move |r| r.from == ip)
        };
        let before = of(from).filter(|r| r.at <= paused).map(|r| r.count).max();
        match (before, of(to).map(|r| r.count).min()) {
            (Some(last), Some(first)) => first > last,
            _ => false,
        }
    }

    /// A running sandbox (holding `memory_mib` when given) on the node whose proxy is
    /// `proxy`: creates until one lands there (creates go by the ranking), the others
    /// deleted.
    fn create_on(&self, api: &Api, proxy: &str, memory_mib: Option<u64>) -> anyhow::Result<String> {
        for _ in 0..(4 * self.args.nodes) {
            let sandbox = match memory_mib {
                Some(mib) => api.running_with(&self.args.image, mib)?,
                None => api.running(&self.args.image)?,
            };
            let (endpoint, _) = api.execd(&sandbox)?;
            if endpoint.starts_with(&format!("{proxy}/")) {
                return Ok(sandbox);
            }
            api.delete(&format!("/v1/sandboxes/{sandbox}"))?;
        }
        bail!("no sandbox landed on the node of proxy {proxy}")
    }

    fn check(&mut self, holds: bool, what: impl Into<String>) {
        if !holds {
            let what = what.into();
            eprintln!("fastbox: check failed: {what}");
            self.failures.push(what);
        }
    }

    /// Node `node`'s DART peer server (`local`: the server's).
    fn dart_addr(&self, node: &str) -> String {
        match node {
            "local" => format!("{}:{}", self.host_ip(), self.server_dart_port),
            _ => format!("{}:{DART_PORT}", self.ip_of(node)),
        }
    }

    /// The DART delivery group: every instance.
    fn dart_peers(&self) -> String {
        std::iter::once("local".to_string())
            .chain((1..self.args.nodes).map(|i| format!("n{i}")))
            .map(|node| format!("{node}={}", self.dart_addr(&node)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// What every instance is given; `node`: its id (`local` for the server's own).
    fn common_args(&self, node: &str, data_dir: &Path, prefix: &str, pool: &str) -> Vec<String> {
        [
            "--artifact-store",
            &self.origin.url(),
            "--node-id",
            node,
            "--dart-listen",
            &self.dart_addr(node),
            "--dart-peers",
            &self.dart_peers(),
            "--data-dir",
            &data_dir.display().to_string(),
            "--cache-dir",
            &self.cache_dir.display().to_string(),
            "--prefix",
            prefix,
            "--pool",
            pool,
            "--execd",
            &self.execd.display().to_string(),
            "--criu",
            &self.criu.display().to_string(),
            // The collector: the test sandboxes report there.
            "--sandbox-reach",
            &format!("{}/32", self.net.test_host_ip()),
        ]
        .map(String::from)
        .to_vec()
    }

    /// Instance `name` of the run: every one reads the origin (its credentials and the DART
    /// group's secret in its environment, not on its command line) with the origin's delay,
    /// and restores clones and resumes lazily whatever their size.
    fn instance(&self, name: &str, prefix: &str, data_dir: PathBuf, args: Vec<String>) -> Instance {
        Instance::new(&self.dir, name, prefix, data_dir, args)
            .with_env("AWS_ACCESS_KEY_ID", &self.origin.access_key)
            .with_env("AWS_SECRET_ACCESS_KEY", &self.origin.secret_key)
            .with_env(fastbox_fastlet::node_store::DART_KEY_ENV, &self.dart_key)
            .with_env(
                fastbox_fastlet::node_store::ORIGIN_BLOCK_DELAY_ENV,
                &self.args.origin_block_delay_ms.to_string(),
            )
            .with_env("FASTBOX_LAZY_RESTORE_MIN_MIB", "1")
    }

    fn run(&mut self) -> anyhow::Result<ClusterReport> {
        let args = self.args;
        let host = self.host_ip();
        let (api_port, proxy_port, control_port) = (
            scenario_net::free_port(host)?,
            scenario_net::free_port(host)?,
            scenario_net::free_port(host)?,
        );
        let key = fastbox_server::service::random_token();
        let server_prefix = format!("{}s", self.prefix);
        let server_data = self.dir.join("server");
        let mut server_args: Vec<String> = [
            "up",
            "--listen",
            &format!("{host}:{api_port}"),
            "--node-proxy-listen",
            &format!("{host}:{proxy_port}"),
            "--default-image",
            &args.image,
            "--accept-nodes",
            "--control-listen",
            &format!("{host}:{control_port}"),
            "--node-lease-ms",
            &args.lease_ms.to_string(),
        ]
        .map(String::from)
        .to_vec();
        server_args.extend(self.common_args(
            "local",
            &server_data,
            &server_prefix,
            &self.net.builder_pool(),
        ));
        let mut server = self
            .instance("server", &server_prefix, server_data.clone(), server_args)
            // Not on the command line, where any local user reads it.
            .with_env("FASTBOX_API_KEY", &key);
        let api = Api::new(format!("http://{host}:{api_port}"), key.clone())?;
        progress(format!(
            "starting the server ({server_prefix}); it prepares {}",
            args.image
        ));
        server.spawn()?;
        server.wait_until("healthy", READY_TIMEOUT, || api.healthy())?;

        progress(format!(
            "{} creates at concurrency {} on the server's node alone",
            args.creates, args.concurrency
        ));
        let one_node = self.creates(&api, &key)?;

        let mut nodes = Vec::new();
        for i in 1..args.nodes {
            let node = self.join(i, control_port, &server_data)?;
            nodes.push(node);
        }
        for (i, node) in nodes.iter_mut().enumerate() {
            let id = format!("n{}", i + 1);
            node.wait_until("joined and reporting", READY_TIMEOUT, || {
                api.node(&id)
                    .ok()
                    .flatten()
                    .is_some_and(|n| n["state"] == "ready" && !n["freeSlots"].is_null())
            })?;
        }
        // Each node builds its golden checkpoint of the image at its first create.
        progress(
            "warming up every node (its first create builds the image's golden checkpoint)"
                .to_string(),
        );
        let mut warm = Vec::new();
        for _ in 0..args.nodes * 2 {
            warm.push(api.running(&args.image)?);
        }
        for id in warm {
            api.delete(&format!("/v1/sandboxes/{id}"))?;
        }
        progress(format!(
            "{} creates at concurrency {} on {} nodes",
            args.creates, args.concurrency, args.nodes
        ));
        let cluster = self.creates(&api, &key)?;
        self.check(
            cluster.failures == 0,
            format!("{} cluster creates failed", cluster.failures),
        );
        self.check(
            cluster.share.iter().filter(|(_, n)| *n > 0).count() == args.nodes,
            format!("not every node took creates: {:?}", cluster.share),
        );

        let mut logs = vec![("local".to_string(), server.log.clone())];
        logs.extend(
            nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("n{}", i + 1), n.log.clone())),
        );
        let victim_index = nodes.len() - 1;
        let (loss, snapshot, moved) =
            self.lose_and_return(&api, &mut nodes[victim_index], victim_index + 1, &logs)?;
        let cut = self.cut_mid_resume(&api, &logs)?;
        let reports = self.collector.reports();
        let fencing = FencingReport {
            sandboxes: reports
                .iter()
                .map(|r| &r.token)
                .collect::<std::collections::HashSet<_>>()
                .len(),
            reports: reports.len(),
            doubles: collector::doubles(&reports),
        };
        self.check(
            fencing.doubles.is_empty(),
            format!("sandboxes ran on two nodes at once: {:?}", fencing.doubles),
        );

        let delivery: Vec<(String, std::collections::BTreeMap<String, u64>)> = api
            .nodes()?
            .into_iter()
            .map(|(id, n)| {
                (
                    id,
                    serde_json::from_value(n["delivery"].clone()).unwrap_or_default(),
                )
            })
            .collect();
        let total = |name: &str| -> u64 { delivery.iter().filter_map(|(_, c)| c.get(name)).sum() };
        self.check(
            total("origin_fetches") > 0 && total("peer_fetches") > 0,
            format!("blocks did not come through DART peers and the origin: {delivery:?}"),
        );
        for node in &mut nodes {
            node.stop();
        }
        server.stop();
        drop(nodes);
        drop(server);
        Ok(ClusterReport {
            nodes: args.nodes,
            image: args.image.clone(),
            creates: args.creates,
            concurrency: args.concurrency,
            one_node,
            cluster,
            loss,
            snapshot,
            moved,
            cut,
            fencing,
            delivery,
            passed: false,
            failures: std::mem::take(&mut self.failures),
        })
    }

    /// Starts node `i`, joining the server's control API.
    fn join(&self, i: usize, control_port: u16, server_data: &Path) -> anyhow::Result<Instance> {
        let ip = self.ip_of(&format!("n{i}"));
        let (listen, proxy) = (
            format!("{ip}:{NODE_API_PORT}"),
            format!("{ip}:{NODE_PROXY_PORT}"),
        );
        let prefix = format!("{}{i}", self.prefix);
        let data_dir = self.dir.join(format!("n{i}"));
        let mut node_args: Vec<String> = [
            "node",
            "--join",
            &format!("https://{}:{control_port}", self.host_ip()),
            "--join-token-file",
            &server_data
                .join(crate::up::JOIN_TOKEN_FILE)
                .display()
                .to_string(),
            "--server-cert",
            &server_data
                .join(crate::up::CONTROL_TLS_DIR)
                .join(fastbox_node_api::remote::tls::CERT_FILE)
                .display()
                .to_string(),
            "--node-name",
            &format!("n{i}"),
            "--listen",
            &listen,
            "--node-proxy-listen",
            &proxy,
            "--node-proxy-public",
            &proxy,
        ]
        .map(String::from)
        .to_vec();
        node_args.extend(self.common_args(
            &format!("n{i}"),
            &data_dir,
            &prefix,
            &self.net.sandbox_pool(i - 1),
        ));
        let mut node = self
            .instance(&format!("n{i}"), &prefix, data_dir, node_args)
            .in_netns(&self.net.netns(i - 1));
        progress(format!("node n{i} ({prefix}) joins from its host {ip}"));
        node.spawn()?;
        Ok(node)
    }

    /// The timed creates, and each node's admissions meanwhile.
    fn creates(&self, api: &Api, key: &str) -> anyhow::Result<CreateRun> {
        let before = admissions(api)?;
        let server: reqwest::Url = api.base.parse()?;
        let ready_timeout = Duration::from_secs(120);
        let plan = Plan {
            n: self.args.creates,
            pace: Pace::BackToBack,
            body: request::create_body(&Source::Image(self.args.image.clone()), Pool::On, None),
            ready_timeout,
        };
        let clients = (0..self.args.concurrency.min(self.args.creates))
            .map(|_| BenchClient::try_new(&server, Some(key.to_string()), ready_timeout))
            .collect::<Result<Vec<_>, _>>()?;
        let (tally, wall): (Tally, Duration) = run::measure(&clients, &plan);
        let after = admissions(api)?;
        let share = after
            .into_iter()
            .map(|(id, n)| {
                let was = before.iter().find(|(b, _)| *b == id).map_or(0, |(_, v)| *v);
                (id, n - was)
            })
            .collect();
        Ok(CreateRun {
            latency: Latency::of(&tally.samples),
            failures: tally.failures(),
            seconds: wall.as_secs_f64(),
            share,
        })
    }

    /// Kills node `number`'s agent with SIGKILL and follows the loss, then its return; a
    /// sandbox paused there resumes elsewhere meanwhile. `logs`: each node's log, by id.
    fn lose_and_return(
        &mut self,
        api: &Api,
        node: &mut Instance,
        number: usize,
        logs: &[(String, PathBuf)],
    ) -> anyhow::Result<(LossReport, SnapshotReport, MoveReport)> {
        let id = format!("n{number}");
        let proxy = api.node_proxy(&id)?;
        let log_of = |node: &str| log_in(logs, node);
        let (mover, local, paused_at) = self.paused_mover(api, &id, &proxy, &log_of)?;
        // A sandbox on it and one elsewhere (creates go by the ranking: a few tries).
        let (mut on_victim, mut elsewhere) = (None, None);
        let mut spare = Vec::new();
        for _ in 0..(4 * self.args.nodes) {
            let sandbox = api.running(&self.args.image)?;
            let (endpoint, _) = api.execd(&sandbox)?;
            match (
                endpoint.starts_with(&format!("{proxy}/")),
                &on_victim,
                &elsewhere,
            ) {
                (true, None, _) => on_victim = Some(sandbox),
                (false, _, None) => elsewhere = Some(sandbox),
                _ => spare.push(sandbox),
            }
            if on_victim.is_some() && elsewhere.is_some() {
                break;
            }
        }
        for sandbox in spare {
            api.delete(&format!("/v1/sandboxes/{sandbox}"))?;
        }
        let (Some(on_victim), Some(elsewhere)) = (on_victim, elsewhere) else {
            bail!("no sandbox landed on node {id} (or none elsewhere)");
        };
        self.report_from(api, &on_victim, &id)?;
        let elsewhere_node = moves::node_of(api, &elsewhere)?;
        self.report_from(api, &elsewhere, &elsewhere_node)?;
        progress(format!("a snapshot of {on_victim} on node {id}"));
        let snapshot = snapshot_elsewhere::take(api, &on_victim)?;

        progress(format!(
            "killing node {id}'s agent (SIGKILL); lease {} ms",
            self.args.lease_ms
        ));
        let killed = Instant::now();
        node.kill9();
        let wait_state = |state: &str| -> anyhow::Result<Duration> {
            let deadline = Instant::now() + Duration::from_millis(self.args.lease_ms * 4 + 10_000);
            loop {
                if api.node(&id)?.is_some_and(|n| n["state"] == state) {
                    return Ok(killed.elapsed());
                }
                if Instant::now() >= deadline {
                    bail!("node {id} never became {state}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        let expired = wait_state("expired")?;
        let lost = wait_state("lost")?;
        let marker: Option<serde_json::Value> = std::fs::read(node.data_dir.join("fenced"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let groups: Vec<String> = marker
            .as_ref()
            .and_then(|m| m["sandboxes"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|g| g.as_str().map(str::to_string))
            .collect();
        let all_frozen = !groups.is_empty() && groups.iter().all(|g| frozen(&node.prefix, g));
        // The server marks the node's sandboxes right after it declared the node lost.
        let settled = Instant::now() + Duration::from_secs(10);
        let lost_sandbox = loop {
            let state = api.state(&on_victim)?;
            if state.0 != "Running" || Instant::now() >= settled {
                break state;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let survivor_answers = api.pings(&elsewhere);
        // The fence stopped it before the lease could run out at the server.
        let last_report = self
            .reports_after(&on_victim, &id, killed)
            .iter()
            .map(|r| r.at.duration_since(killed))
            .max();
        let late = self.reports_after(&on_victim, &id, killed + expired).len();
        self.check(
            late == 0,
            format!("{on_victim} reported {late} time(s) from node {id} after its lease ran out"),
        );
        self.check(
            marker.is_some(),
            format!("node {id}'s guard wrote no fence marker"),
        );
        self.check(
            all_frozen,
            format!("node {id}'s sandboxes were not all frozen: {groups:?}"),
        );
        self.check(
            lost >= Duration::from_millis(self.args.lease_ms),
            format!("node {id} was declared lost {lost:?} after the kill, within its lease"),
        );
        self.check(
            lost_sandbox == ("Failed".to_string(), Some("NODE_LOST".to_string())),
            format!("its sandbox is {lost_sandbox:?}, not Failed (NODE_LOST)"),
        );
        self.check(
            survivor_answers,
            "the sandbox on another node stopped answering",
        );

        progress(format!(
            "a create from snapshot {snapshot}, taken on the lost node {id}"
        ));
        let snapshot = snapshot_elsewhere::restore_elsewhere(api, &snapshot, &id)?;
        self.check(
            snapshot.restored_on != id && snapshot.kept_file,
            format!(
                "the create from a snapshot taken on {id} ran on {} (its file kept: {})",
                snapshot.restored_on, snapshot.kept_file
            ),
        );
        progress(format!(
            "resuming {mover} ({} MiB, paused on the lost node {id}) elsewhere",
            self.args.move_mib
        ));
        let (moved, to) = moves::timed_resume(api, &mover, &log_of)?;
        let moved_intact = moves::memory_intact(api, &mover)?;
        self.check(to != id, format!("{mover} resumed on its lost node {id}"));
        self.collector
            .wait_for(&mover, self.ip_of(&to), REPORT_TIMEOUT)
            .with_context(|| format!("{mover} moved to {to}"))?;
        self.check(
            self.count_went_on(&mover, &id, paused_at, &to),
            format!("{mover}'s count did not go on from node {id} on node {to}"),
        );
        self.check(
            moved_intact,
            format!("{mover}'s memory differs after its resume on {to}"),
        );

        progress(format!("node {id} starts again"));
        let returned = Instant::now();
        let marker_path = node.data_dir.join("fenced");
        node.spawn()?;
        node.wait_until("removing what it ran while lost", READY_TIMEOUT, || {
            api.events(&on_victim).is_ok_and(|e| e.contains("Removed"))
        })?;
        let removed = returned.elapsed();
        node.wait_until("rid of its fence marker", Duration::from_secs(30), || {
            !marker_path.exists()
        })?;
        node.wait_until(
            "cleaning what the moved sandbox left there",
            READY_TIMEOUT,
            || api.events(&mover).is_ok_and(|e| e.contains("Cleaned")),
        )?;
        // Nothing the node ran while lost runs again now that it is back.
        std::thread::sleep(Duration::from_millis(1500));
        for sandbox in [&on_victim, &mover] {
            let again = self.reports_after(sandbox, &id, returned).len();
            self.check(
                again == 0,
                format!("{sandbox} reported {again} time(s) from node {id} after it came back"),
            );
        }
        for sandbox in [&on_victim, &elsewhere, &mover] {
            api.delete(&format!("/v1/sandboxes/{sandbox}"))?;
        }
        let moved = MoveReport {
            memory_mib: self.args.move_mib,
            origin_block_delay_ms: self.args.origin_block_delay_ms,
            from: id.clone(),
            to,
            local: local.0,
            moved,
            memory_intact: local.1 && moved_intact,
        };
        let loss = LossReport {
            node: id,
            lease_ms: self.args.lease_ms,
            expired_after_ms: expired.as_millis() as u64,
            lost_after_ms: lost.as_millis() as u64,
            fenced: groups.len(),
            all_frozen,
            lost_sandbox,
            survivor_answers,
            last_report_after_kill_ms: last_report.map(|d| d.as_millis() as u64),
            removed_after_return_ms: removed.as_millis() as u64,
        };
        Ok((loss, snapshot, moved))
    }

    /// A sandbox on node `id` (its proxy `proxy`) holding `--move-mib` of memory, paused and
    /// resumed there (timed, its memory checked), then paused again.
    fn paused_mover(
        &mut self,
        api: &Api,
        id: &str,
        proxy: &str,
        log_of: &dyn Fn(&str) -> Option<PathBuf>,
    ) -> anyhow::Result<(String, (moves::ResumeTiming, bool), Instant)> {
        let mib = self.args.move_mib;
        let mover = self.create_on(api, proxy, Some(moves::memory_limit(mib)))?;
        progress(format!("{mover} on node {id} fills {mib} MiB of memory"));
        moves::start_holder(api, &mover, mib)?;
        self.report_from(api, &mover, id)?;
        progress(format!("{mover} pauses and resumes on node {id}"));
        moves::pause(api, &mover)?;
        let (local, at) = moves::timed_resume(api, &mover, log_of)?;
        let intact = moves::memory_intact(api, &mover)?;
        self.check(
            at == id,
            format!("{mover} resumed on {at}, not on its node {id}"),
        );
        self.check(
            intact,
            format!("{mover}'s memory differs after its resume on {id}"),
        );
        moves::pause(api, &mover)?;
        Ok((mover, (local, intact), Instant::now()))
    }
}

/// The log of node `node` among `logs` (each node's, by id).
fn log_in(logs: &[(String, PathBuf)], node: &str) -> Option<PathBuf> {
    logs.iter()
        .find(|(id, _)| id == node)
        .map(|(_, log)| log.clone())
}

/// Admissions per node so far.
fn admissions(api: &Api) -> anyhow::Result<Vec<(String, u64)>> {
    Ok(api
        .nodes()?
        .into_iter()
        .map(|(id, n)| (id, n["admittedTotal"].as_u64().unwrap_or(0)))
        .collect())
}

/// Whether cgroup `group` of instance `prefix` is frozen, as the kernel reports it (the v1
/// freezer, or v2's `cgroup.events`).
pub fn frozen(prefix: &str, group: &str) -> bool {
    let v1 = format!("/sys/fs/cgroup/freezer/{prefix}/{group}/freezer.state");
    let v2 = format!("/sys/fs/cgroup/{prefix}/{group}/cgroup.events");
    match std::fs::read_to_string(&v1) {
        Ok(state) => state.trim() == "FROZEN",
        Err(_) => std::fs::read_to_string(&v2).is_ok_and(|e| e.contains("frozen 1")),
    }
}

fn progress(line: String) {
    eprintln!("fastbox: {line}");
}

fn ms(value: Option<f64>) -> String {
    value.map_or("-".into(), |v| format!("{v:.1} ms"))
}

/// The report as text.
pub fn human(r: &ClusterReport) -> String {
    let mut out = String::new();
    let run = |name: &str, c: &CreateRun| {
        format!(
            "{name:<10} p50 {:>9}  p90 {:>9}  p99 {:>9}  max {:>9}  failures {}  ({:.1} s){}\n",
            ms(c.latency.p50_ms),
            ms(c.latency.p90_ms),
            ms(c.latency.p99_ms),
            ms(c.latency.max_ms),
            c.failures,
            c.seconds,
            match c.share.len() {
                0 | 1 => String::new(),
                _ => format!(
                    "\n           share: {}",
                    c.share
                        .iter()
                        .map(|(id, n)| format!("{id} {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        )
    };
    out.push_str(&format!(
        "verify cluster: {} nodes, {} creates of {} at concurrency {} (create -> execd /ping)\n",
        r.nodes, r.creates, r.image, r.concurrency
    ));
    out.push_str(&run("one node", &r.one_node));
    out.push_str(&run("cluster", &r.cluster));
    let l = &r.loss;
    out.push_str(&format!(
        "node loss: {} killed (lease {} ms): expired after {} ms, lost after {} ms; fence froze {} group(s) (all frozen: {}); its sandbox {:?}; the other answers: {}; removed {} ms after it came back\n",
        l.node, l.lease_ms, l.expired_after_ms, l.lost_after_ms, l.fenced, l.all_frozen, l.lost_sandbox, l.survivor_answers, l.removed_after_return_ms
    ));
    out.push_str(&format!(
        "  its sandbox's last report from it {} ms after the kill\n",
        l.last_report_after_kill_ms
            .map_or("-".into(), |ms| ms.to_string())
    ));
    let s = &r.snapshot;
    out.push_str(&format!(
        "snapshot taken on {}, a create from it on {}: Running after {} ms, its file kept: {}\n",
        s.taken_on, s.restored_on, s.create_ms, s.kept_file
    ));
    let m = &r.moved;
    out.push_str(&format!(
        "resume of {} MiB, origin block delay {} ms (request -> execd /ping; -> every page local):\n  on its node {:<6} {:>6} ms; {:>6} ms\n  moved to {:<9} {:>6} ms; {:>6} ms (its node {} lost, nothing cached there); memory intact: {}\n",
        m.memory_mib,
        m.origin_block_delay_ms,
        m.from,
        m.local.ready_ms,
        m.local.memory_local_ms,
        m.to,
        m.moved.ready_ms,
        m.moved.memory_local_ms,
        m.from,
        m.memory_intact
    ));
    let c = &r.cut;
    out.push_str(&format!(
        "cut mid-resume: {} cut off from the server while resuming a {} MiB sandbox (ran there before its fence: {}, last report {} ms after the cut); lost after {} ms; the sandbox {:?}; moved to {} (count went on: {}, memory intact: {}); reports from {} after the mend: {}\n",
        c.node,
        c.memory_mib,
        c.resumed_there,
        c.last_report_after_cut_ms.map_or("-".into(), |ms| ms.to_string()),
        c.lost_after_ms,
        c.state_after_loss,
        c.moved_to.as_deref().unwrap_or("-"),
        c.count_went_on,
        c.memory_intact,
        c.node,
        c.reports_after_mend
    ));
    let f = &r.fencing;
    out.push_str(&format!(
        "fencing witness: {} sandboxes sent {} reports to the collector; on two nodes at once: {}\n",
        f.sandboxes,
        f.reports,
        if f.doubles.is_empty() { "none".to_string() } else { f.doubles.join("; ") }
    ));
    out.push_str("DART delivery (each node since its last start):\n");
    for (node, c) in &r.delivery {
        let get = |name: &str| c.get(name).copied().unwrap_or(0);
        out.push_str(&format!(
            "  {node:<6} from the origin {:>5}, from peers {:>5}, served to peers {:>5}, cache hits {:>6}, peer failures {}, fallbacks to the origin {}\n",
            get("origin_fetches"),
            get("peer_fetches"),
            get("peer_served"),
            get("cache_hits"),
            get("peer_failures"),
            get("fallbacks_to_origin"),
        ));
    }
    match r.passed {
        true => out.push_str("passed\n"),
        false => out.push_str(&format!("FAILED: {}\n", r.failures.join("; "))),
    }
    out
}
