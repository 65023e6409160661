//! Chaos on a real cluster: three `fastbox up` servers (each in a network namespace of its
//! own, placing sandboxes on joined nodes only), a three-member etcd on the bridge, and two
//! `fastbox node` hosts that join all three servers. Clients create (with idempotency keys),
//! delete, pause, resume, fork and read through random servers over HTTP while a seeded,
//! fixed fault schedule `kill -9`s the leader server, `SIGSTOP`s it, `kill -9`s a follower,
//! kills an etcd member, and cuts a server's link (every packet of its namespace dropped).
//! Killed servers and members start again after a while, as a supervisor would start them.
//!
//! Half the created sandboxes report to a collector on a test host every 100 ms; the source
//! of a report says which node ran it (the witness of `fastbox verify cluster`). Forks are
//! taken only of sandboxes that do not report, so a fork never reports under its parent's
//! name.
//!
//! The checker judges the recorded history:
//! - every acknowledgement of one idempotency key names the same sandbox, and in the end each
//!   acknowledged key has exactly one sandbox (the listing, by the key in its metadata);
//! - every acknowledged delete ends the sandbox on every server, and a deleted sandbox no
//!   longer reports;
//! - the states each server reported of a sandbox follow the transition table;
//! - no sandbox reported from two nodes at once;
//! - no node fenced itself (lost its lease) while at most one server was down.
//!
//! `FASTBOX_CHAOS_SEED` and `FASTBOX_CHAOS_SECONDS` (default 120) vary the run; it prints the
//! operation and fault counts. The instances' logs are kept after a failure, or with
//! `FASTBOX_CHAOS_KEEP` set. Root, CRIU, etcd and s3s-fs (skipped with the reason
//! otherwise). Prefix: the run prefix's first six characters and `k`.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use fastbox_cli::scenario_net::{self, ScenarioNet};
use fastbox_cli::scenario_origin::{Origin, s3s_fs_bin};
use fastbox_cli::verify_cluster::api::Api;
use fastbox_cli::verify_cluster::collector::{self, Collector};
use fastbox_cli::verify_cluster::procs::Instance;
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

const SERVERS: usize = 3;
const NODES: usize = 2;
const CLIENTS: usize = 3;
/// Second octet of the run's addresses (see `ScenarioNet`).
const NET_OCTET: u8 = 226;
const STATE_PREFIX: &str = "/fbchaos";
/// The servers' leases, milliseconds (the nodes keep the default, 10 s: a node's lease must
/// outlast an etcd election and a heartbeat to a stopped server).
const LEASE_MS: &str = "4000";
const FAULT_EVERY: Duration = Duration::from_secs(12);
/// How long a killed server or member stays down, a stopped server stopped, a link cut.
const DOWN_FOR: Duration = Duration::from_secs(6);
/// At most this many sandboxes not deleted at once.
const MAX_LIVE: usize = 10;
/// How long a client waits for an answer.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const API_PORT: u16 = 7000;
const NODE_API_PORT: u16 = 7001;
const PROXY_PORT: u16 = 7002;
const CONTROL_PORT: u16 = 7003;
const IMAGE: &str = "fastbox/busybox";
const API_KEY: &str = "chaos-test-api-key";

/// What the clients did and saw.
#[derive(Default)]
struct History {
    /// Idempotency key -> the sandbox each acknowledgement named.
    created: Mutex<BTreeMap<String, Vec<String>>>,
    /// Sandboxes forks made.
    forked: Mutex<BTreeSet<String>>,
    /// Sandboxes whose reporter started.
    witnessed: Mutex<BTreeSet<String>>,
    deleted: Mutex<BTreeSet<String>>,
    /// (server, sandbox) -> the states that server listed, in order (one observer asks).
    observed: Mutex<HashMap<(usize, String), Vec<String>>>,
    /// Operation -> (tried, acknowledged).
    ops: Mutex<BTreeMap<&'static str, (usize, usize)>>,
}

impl History {
    fn op(&self, kind: &'static str, acked: bool) {
        let mut ops = self.ops.lock().unwrap();
        let entry = ops.entry(kind).or_default();
        entry.0 += 1;
        entry.1 += usize::from(acked);
    }

    /// Every sandbox an acknowledgement named.
    fn ids(&self) -> Vec<String> {
        let created = self.created.lock().unwrap();
        let mut ids: BTreeSet<String> = created.values().flatten().cloned().collect();
        ids.extend(self.forked.lock().unwrap().iter().cloned());
        ids.into_iter().collect()
    }

    /// The sandboxes not deleted.
    fn live(&self) -> Vec<String> {
        let deleted = self.deleted.lock().unwrap().clone();
        self.ids()
            .into_iter()
            .filter(|id| !deleted.contains(id))
            .collect()
    }

    fn observe(&self, server: usize, id: &str, state: &str) {
        let mut observed = self.observed.lock().unwrap();
        let seen = observed.entry((server, id.to_string())).or_default();
        if seen.last().is_none_or(|last| last != state) {
            seen.push(state.to_string());
        }
    }
}

/// The run's directory (every instance's log and data): removed after a passing run, kept
/// and named after a failing one (or with `FASTBOX_CHAOS_KEEP` set).
struct RunDir(PathBuf);

impl RunDir {
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("FASTBOX_CHAOS_KEEP").is_some() {
            eprintln!("the instances' logs are kept in {}", self.0.display());
        } else {
            // Processes stopped a moment ago may still be closing files in it: a few tries.
            let mut last = Ok(());
            for _ in 0..10 {
                last = std::fs::remove_dir_all(&self.0);
                if last.is_ok() || !self.0.exists() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            if let Err(e) = last {
                eprintln!("could not remove {}: {e}", self.0.display());
            }
        }
    }
}

/// Removes the run's network when dropped.
struct Net(ScenarioNet);

impl Drop for Net {
    fn drop(&mut self) {
        self.0.remove();
    }
}

/// The leader's index, as etcd holds its claim.
fn leader(etcd: &EtcdCluster) -> Option<usize> {
    let key = B64.encode(format!("{STATE_PREFIX}/_cluster/leader"));
    (0..3).find_map(|member| {
        let body: Value = serde_json::from_str(&etcd.get(member, &key).ok()?).ok()?;
        let id = B64.decode(body["kvs"][0]["value"].as_str()?).ok()?;
        let id = String::from_utf8(id).ok()?;
        id.strip_prefix('s')?.parse::<usize>().ok()?.checked_sub(1)
    })
}

fn create_body(key: &str) -> Value {
    json!({
        "image": {"uri": IMAGE},
        "entrypoint": ["sleep", "100000"],
        "timeout": 3600,
        "metadata": {"chaos-key": key},
        "resourceLimits": {"cpu": "250m", "memory": "64Mi"},
    })
}

/// Waits until server `api` reports sandbox `id` `Running`, at most `within`.
fn wait_running(api: &Api, id: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if api.state(id).is_ok_and(|(state, _)| state == "Running") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

fn client(seed: u64, apis: &[Api], collector: &Collector, history: &History, stop: &AtomicBool) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keys = 0;
    while !stop.load(Ordering::Relaxed) {
        let s = rng.random_range(0..SERVERS);
        let api = &apis[s];
        let live = history.live();
        let roll = rng.random_range(0..100);
        let target = (!live.is_empty()).then(|| live[rng.random_range(0..live.len())].clone());
        match (roll, target) {
            (0..30, _) | (_, None) if live.len() < MAX_LIVE => {
                // A create, tried again through another server with the same key when its
                // answer is lost.
                keys += 1;
                let key = format!("c{seed}-{keys}");
                for attempt in 0..2 {
                    let api = &apis[(s + attempt * rng.random_range(1..SERVERS)) % SERVERS];
                    let answer = api.post_with(
                        "/v1/sandboxes",
                        &create_body(&key),
                        &[("Idempotency-Key", &key)],
                    );
                    let id = match answer {
                        Ok((202, body)) => body["id"].as_str().map(str::to_string),
                        _ => None,
                    };
                    history.op("create", id.is_some());
                    let Some(id) = id else { continue };
                    history
                        .created
                        .lock()
                        .unwrap()
                        .entry(key.clone())
                        .or_default()
                        .push(id.clone());
                    // Half report to the collector from then on.
                    if rng.random_bool(0.5)
                        && wait_running(api, &id, Duration::from_secs(20))
                        && api.sh(&id, &collector.reporter(&id)).is_ok()
                    {
                        history.witnessed.lock().unwrap().insert(id);
                    }
                    break;
                }
            }
            (0..30, Some(id)) | (30..45, Some(id)) => {
                let acked = api
                    .delete(&format!("/v1/sandboxes/{id}"))
                    .is_ok_and(|status| status == 204);
                history.op("delete", acked);
                if acked {
                    history.deleted.lock().unwrap().insert(id);
                }
            }
            (45..57, Some(id)) => {
                let acked = api
                    .post(&format!("/v1/sandboxes/{id}/pause"))
                    .is_ok_and(|(status, _)| status == 202);
                history.op("pause", acked);
            }
            (57..69, Some(id)) => {
                let acked = api
                    .post(&format!("/v1/sandboxes/{id}/resume"))
                    .is_ok_and(|(status, _)| status == 202);
                history.op("resume", acked);
            }
            (69..77, Some(id)) => {
                // Forks only of sandboxes that do not report: a fork keeps its parent's
                // processes, and would report under its parent's name.
                if history.witnessed.lock().unwrap().contains(&id) {
                    continue;
                }
                keys += 1;
                let answer = api.post_with(
                    &format!("/v1/sandboxes/{id}/fork"),
                    &json!({"count": 1, "metadata": {"chaos-fork": format!("f{seed}-{keys}")}}),
                    &[],
                );
                let child = match answer {
                    Ok((202, body)) => body["items"][0]["id"].as_str().map(str::to_string),
                    _ => None,
                };
                history.op("fork", child.is_some());
                if let Some(child) = child {
                    history.forked.lock().unwrap().insert(child);
                }
            }
            (_, Some(id)) => {
                // (States are judged from the observer's listings alone: one thread asking
                // each server in turn records them in the order the server answered.)
                history.op("get", api.state(&id).is_ok());
            }
            (_, None) => {}
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(20..80)));
    }
}

/// Every sandbox server `api` lists: `(id, state, metadata)`.
fn listing(api: &Api) -> anyhow::Result<Vec<(String, String, Value)>> {
    let mut all = Vec::new();
    for page in 1.. {
        let (status, body) = api.get(&format!("/v1/sandboxes?pageSize=200&page={page}"))?;
        anyhow::ensure!(status == 200, "list: {status} {body}");
        let items = body["items"].as_array().cloned().unwrap_or_default();
        for item in &items {
            all.push((
                item["id"].as_str().unwrap_or_default().to_string(),
                item["status"]["state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                item["metadata"].clone(),
            ));
        }
        if items.len() < 200 {
            break;
        }
    }
    Ok(all)
}

/// Reads every server's listing every half second and notes each sandbox's state.
fn observer(apis: &[Api], history: &History, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        for (s, api) in apis.iter().enumerate() {
            for (id, state, _) in listing(api).unwrap_or_default() {
                history.observe(s, &id, &state);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Sends `signal` to instance `server`'s process.
fn signal(server: &Instance, signal: Signal) {
    if let Some(pid) = server.pid() {
        let _ = kill(Pid::from_raw(pid as i32), signal);
    }
}

/// A fault to undo once it has lasted `DOWN_FOR`.
enum Undo {
    Restart(usize),
    Continue(usize),
    Member(usize),
    Mend(usize),
}

struct Run {
    net: Net,
    etcd: EtcdCluster,
    servers: Vec<Instance>,
    apis: Arc<Vec<Api>>,
}

impl Run {
    fn start_server(&mut self, i: usize) {
        self.servers[i].spawn().expect("spawn a server");
        let api = &self.apis[i];
        self.servers[i]
            .wait_until("healthy", Duration::from_secs(120), || api.healthy())
            .expect("the server starts");
    }

    fn undo(&mut self, undo: Undo) {
        match undo {
            Undo::Restart(i) => self.start_server(i),
            Undo::Continue(i) => signal(&self.servers[i], Signal::SIGCONT),
            Undo::Member(m) => self.etcd.restart(m).expect("the member comes back"),
            Undo::Mend(i) => self.net.0.isolate(i, false).expect("mend the link"),
        }
    }
}

// It once ended, one run in seven, with a deleted sandbox still reporting: a create whose
// server died between the node's claim from the warm pool and the record of its placement
// was placed again by the leader, and the release by the sandbox's id and admitted slot did
// not reach the claimed sandbox, which ran on in the pooled sandbox's slot. The node now
// remembers claims by id (remote_node.rs tests it alone).
#[test]
fn servers_etcd_members_and_links_fail_and_the_history_holds() {
    if let Some(reason) = common::unavailable() {
        eprintln!("skipped: {reason}");
        return;
    }
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let s3s_fs = match s3s_fs_bin(None) {
        Ok(bin) => bin,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let (seed, seconds) = fastbox_testkit::chaos::seed_and_seconds(120);
    let base = fastbox_testkit::run_prefix("");
    let prefix = format!("{}k", &base[..6]);
    let fastbox = PathBuf::from(env!("CARGO_BIN_EXE_fastbox"));
    let dir = RunDir(
        tempfile::Builder::new()
            .prefix(&format!("fastbox-chaos-{prefix}-"))
            .tempdir()
            .unwrap()
            .keep(),
    );
    let net = Net(
        ScenarioNet::create_with_test_host(&prefix, [10, NET_OCTET], SERVERS + NODES)
            .expect("the run's network"),
    );
    let bridge = net.0.origin_ip();
    let collector = Collector::start(&net.0.test_netns(), net.0.test_host_ip()).unwrap();
    let origin = Origin::start(&s3s_fs, bridge, &dir.path().join("origin")).unwrap();
    let etcd = EtcdCluster::start_on(3, bridge).expect("etcd");
    let execd = fastbox_testkit::execd_path().unwrap();
    let criu = fastbox_testkit::criu_path().unwrap();
    let cache = common::server::test_cache_dir();
    let seal_key = dir.path().join("seal.key");

    // What every instance is given: host `i` of the network (servers first, then nodes).
    let instance = |name: &str, i: usize, prefix: String, args: Vec<String>| -> Instance {
        let data = dir.path().join(name);
        let mut all = args;
        all.extend(
            [
                "--artifact-store",
                &origin.url(),
                "--data-dir",
                &data.display().to_string(),
                "--cache-dir",
                &cache.display().to_string(),
                "--prefix",
                &prefix,
                "--pool",
                &net.0.sandbox_pool(i),
                "--execd",
                &execd.display().to_string(),
                "--criu",
                &criu.display().to_string(),
                "--sandbox-reach",
                &format!("{}/32", net.0.test_host_ip()),
            ]
            .map(String::from),
        );
        Instance::new(dir.path(), name, &prefix, data, all)
            .with_program(&fastbox)
            .in_netns(&net.0.netns(i))
            .with_env("AWS_ACCESS_KEY_ID", &origin.access_key)
            .with_env("AWS_SECRET_ACCESS_KEY", &origin.secret_key)
            .with_env("FASTBOX_API_KEY", API_KEY)
    };
    let servers: Vec<Instance> = (0..SERVERS)
        .map(|i| {
            let ip = net.0.node_ip(i);
            let args = [
                "up",
                "--listen",
                &format!("{ip}:{API_PORT}"),
                "--node-proxy-listen",
                &format!("{ip}:{PROXY_PORT}"),
                "--default-image",
                IMAGE,
                "--accept-nodes",
                "--no-local-sandboxes",
                "--control-listen",
                &format!("{ip}:{CONTROL_PORT}"),
                "--state",
                &format!("{}{STATE_PREFIX}", etcd.state_url()),
                "--state-seal-key",
                &seal_key.display().to_string(),
                "--server-id",
                &format!("s{}", i + 1),
                "--server-lease-ms",
                LEASE_MS,
                "--retention-seconds",
                "3600",
            ]
            .map(String::from)
            .to_vec();
            instance(
                &format!("s{}", i + 1),
                i,
                format!("{prefix}{}", (b'a' + i as u8) as char),
                args,
            )
        })
        .collect();
    // Server `i`'s API, each call given up after `timeout`.
    let api = |i: usize, timeout: Duration| {
        Api::new(
            format!("http://{}:{API_PORT}", net.0.node_ip(i)),
            API_KEY.into(),
        )
        .and_then(|api| api.with_timeout(timeout))
        .unwrap()
    };
    let apis: Arc<Vec<Api>> = Arc::new((0..SERVERS).map(|i| api(i, CALL_TIMEOUT)).collect());
    let warm_apis: Vec<Api> = (0..SERVERS)
        .map(|i| api(i, Duration::from_secs(120)))
        .collect();
    let first_data = dir.path().join("s1");
    let joins: Vec<String> = (0..SERVERS)
        .map(|i| format!("https://{}:{CONTROL_PORT}", net.0.node_ip(i)))
        .collect();
    let mut nodes: Vec<Instance> = (0..NODES)
        .map(|j| {
            let i = SERVERS + j;
            let ip = net.0.node_ip(i);
            let args = [
                "node",
                "--join",
                &joins.join(","),
                "--join-token-file",
                &first_data.join("node-join-token").display().to_string(),
                "--server-cert",
                &first_data
                    .join("control-tls/cert.pem")
                    .display()
                    .to_string(),
                "--node-name",
                &format!("n{}", j + 1),
                "--listen",
                &format!("{ip}:{NODE_API_PORT}"),
                "--node-proxy-listen",
                &format!("{ip}:{PROXY_PORT}"),
                "--node-proxy-public",
                &format!("{ip}:{PROXY_PORT}"),
            ]
            .map(String::from)
            .to_vec();
            instance(
                &format!("n{}", j + 1),
                i,
                format!("{prefix}{}", j + 1),
                args,
            )
        })
        .collect();
    let mut run = Run {
        net,
        etcd,
        servers,
        apis: apis.clone(),
    };
    // The first makes the seal key and the nodes' join token; the others take both.
    for i in 0..SERVERS {
        run.start_server(i);
    }
    for node in &mut nodes {
        node.spawn().unwrap();
    }
    for (j, node) in nodes.iter_mut().enumerate() {
        let id = format!("n{}", j + 1);
        node.wait_until("known to every server", Duration::from_secs(120), || {
            apis.iter().all(|api| {
                api.node(&id)
                    .ok()
                    .flatten()
                    .is_some_and(|n| n["state"] == "ready" && !n["freeSlots"].is_null())
            })
        })
        .unwrap();
    }
    // Each node builds its golden checkpoint of the image at its first create.
    let warm: Vec<String> = (0..2 * NODES)
        .map(|i| {
            warm_apis[i % SERVERS]
                .running(IMAGE)
                .expect("a warm-up create")
        })
        .collect();
    for id in warm {
        assert_eq!(apis[0].delete(&format!("/v1/sandboxes/{id}")).unwrap(), 204);
    }

    // The clients and the observer.
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let collector = Arc::new(collector);
    let mut threads: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (apis, collector, history, stop) = (
                apis.clone(),
                collector.clone(),
                history.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || client(seed + c as u64, &apis, &collector, &history, &stop))
        })
        .collect();
    threads.push({
        let (apis, history, stop) = (apis.clone(), history.clone(), stop.clone());
        std::thread::spawn(move || observer(&apis, &history, &stop))
    });

    // The fault schedule: each kind in turn, in an order the seed picks.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut kinds = [
        "kill -9 the leader",
        "SIGSTOP the leader",
        "kill -9 a follower",
        "kill an etcd member",
        "cut a server's link",
    ];
    fastbox_testkit::chaos::seeded_order(&mut kinds, &mut rng);
    let mut faults: BTreeMap<&str, usize> = BTreeMap::new();
    let started = Instant::now();
    let mut turn = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(FAULT_EVERY - DOWN_FOR);
        let kind = kinds[turn % kinds.len()];
        turn += 1;
        let leader = leader(&run.etcd);
        let follower = (0..SERVERS).find(|i| Some(*i) != leader && rng.random_bool(0.5));
        let follower = follower.or((0..SERVERS).find(|i| Some(*i) != leader));
        let undo = match (kind, leader, follower) {
            ("kill -9 the leader", Some(i), _) | ("kill -9 a follower", _, Some(i)) => {
                run.servers[i].kill9();
                Undo::Restart(i)
            }
            ("SIGSTOP the leader", Some(i), _) => {
                signal(&run.servers[i], Signal::SIGSTOP);
                Undo::Continue(i)
            }
            ("kill an etcd member", ..) => {
                let member = rng.random_range(0..3);
                run.etcd.kill(member);
                Undo::Member(member)
            }
            ("cut a server's link", ..) => {
                let i = rng.random_range(0..SERVERS);
                run.net.0.isolate(i, true).expect("cut a link");
                Undo::Mend(i)
            }
            _ => {
                eprintln!("{:?}: {kind}: no leader known, skipped", started.elapsed());
                continue;
            }
        };
        *faults.entry(kind).or_default() += 1;
        eprintln!("{:?}: {kind} (leader {leader:?})", started.elapsed());
        std::thread::sleep(DOWN_FOR);
        run.undo(undo);
    }
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().expect("a client");
    }

    // Quiet: every server's view settles (the leader finishes what was in flight).
    let quiet = Instant::now();
    let in_flight = || -> Vec<String> {
        apis.iter()
            .enumerate()
            .flat_map(|(s, api)| match listing(api) {
                Ok(all) => all
                    .into_iter()
                    .filter(|(_, state, _)| {
                        matches!(
                            state.as_str(),
                            "Pending" | "Pausing" | "Resuming" | "Stopping"
                        )
                    })
                    .map(|(id, state, _)| {
                        format!(
                            "s{}: {id} {state}; its events:\n{}",
                            s + 1,
                            api.events(&id).unwrap_or_default()
                        )
                    })
                    .collect(),
                Err(e) => vec![format!("s{}: {e:#}", s + 1)],
            })
            .collect()
    };
    let mut violations = Vec::new();
    loop {
        let left = in_flight();
        if left.is_empty() {
            eprintln!("settled {:?} after the faults", quiet.elapsed());
            break;
        }
        if quiet.elapsed() > Duration::from_secs(90) {
            violations.push(format!("in flight 90 s after the faults: {left:?}"));
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for (s, api) in apis.iter().enumerate() {
        for (id, state, _) in listing(api).unwrap_or_default() {
            history.observe(s, &id, &state);
        }
    }

    // The checker.
    let created = history.created.lock().unwrap().clone();
    for (key, ids) in &created {
        if ids.iter().any(|id| *id != ids[0]) {
            violations.push(format!("key {key} acknowledged as {ids:?}"));
        }
    }
    let all = listing(&apis[0]).unwrap();
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, _, metadata) in &all {
        if let Some(key) = metadata["chaos-key"].as_str() {
            by_key.entry(key.to_string()).or_default().push(id.clone());
        }
    }
    for (key, ids) in &by_key {
        if ids.len() > 1 {
            violations.push(format!("key {key} made {} sandboxes: {ids:?}", ids.len()));
        }
    }
    for (key, acked) in &created {
        if by_key.get(key).is_none_or(|ids| !ids.contains(&acked[0])) {
            violations.push(format!("{} (key {key}) is not listed", acked[0]));
        }
    }
    let deleted = history.deleted.lock().unwrap().clone();
    for (s, api) in apis.iter().enumerate() {
        for id in &deleted {
            // Ended: `Terminated`, or `Failed` when it failed before the delete (a delete
            // of a failed sandbox changes nothing).
            match api.state(id) {
                Ok((state, _)) if state != "Terminated" && state != "Failed" => {
                    violations.push(format!(
                        "{id} deleted, but s{} has it {state}; its events:\n{}",
                        s + 1,
                        api.events(id).unwrap_or_default()
                    ));
                }
                _ => {}
            }
        }
    }
    for ((s, id), states) in history.observed.lock().unwrap().iter() {
        for step in fastbox_testkit::transitions::violations(states) {
            violations.push(format!("s{} reported {id} {step}", s + 1));
        }
    }
    // The witness: nothing deleted still reports, nothing reported from two nodes at once.
    let mark = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let reports = collector.reports();
    for id in &deleted {
        let late: Vec<_> = reports
            .iter()
            .filter(|r| r.token == *id && r.at > mark)
            .collect();
        if let Some(last) = late.last() {
            violations.push(format!(
                "{id} was deleted, yet it still reports ({} reports since, from {}, count {})",
                late.len(),
                last.from,
                last.count
            ));
        }
    }
    violations.extend(collector::doubles(&reports));
    // With one server or etcd member down at a time, no node ever lost its lease: none
    // fenced itself (froze its sandboxes).
    for node in &nodes {
        let log = std::fs::read_to_string(&node.log).unwrap_or_default();
        for line in log.lines().filter(|l| l.contains("FENCED")) {
            violations.push(format!("{} fenced itself: {line}", node.name));
        }
    }

    let ops = history.ops.lock().unwrap().clone();
    eprintln!(
        "cluster chaos seed {seed}, {seconds} s: operations (tried, acknowledged) {ops:?}; \
         faults {faults:?}; {} sandboxes ({} forks, {} reporting, {} deleted); {} reports",
        history.ids().len(),
        history.forked.lock().unwrap().len(),
        history.witnessed.lock().unwrap().len(),
        deleted.len(),
        reports.len(),
    );
    for kind in ["create", "delete", "pause", "resume"] {
        if ops.get(kind).is_none_or(|(_, acked)| *acked == 0) {
            violations.push(format!("no {kind} was acknowledged"));
        }
    }
    assert!(violations.is_empty(), "{violations:#?}");

    // Everything stops; nothing carrying the run's prefix is left.
    let prefixes: Vec<String> = run
        .servers
        .iter()
        .chain(&nodes)
        .map(|i| i.prefix.clone())
        .collect();
    for node in &mut nodes {
        node.stop();
    }
    for server in &mut run.servers {
        server.stop();
    }
    drop(nodes);
    drop(run);
    let mut left: Vec<String> = prefixes
        .iter()
        .flat_map(|p| fastbox_cli::local_sandbox::leftovers(p))
        .collect();
    left.extend(scenario_net::leftovers(&prefix));
    assert!(left.is_empty(), "left behind: {left:?}");
}
