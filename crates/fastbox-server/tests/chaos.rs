//! Chaos on servers sharing one etcd, in one process: three servers (each a `Lifecycle` on a
//! runtime of its own) over three etcd members and two fake nodes, clients creating (with
//! idempotency keys), deleting, pausing, resuming and reading through random servers, while
//! a seeded, fixed fault schedule crashes the leader, stops the leader's lease renewals (as
//! `SIGSTOP` would), crashes a follower, kills an etcd member, or cuts a server off etcd
//! (every call it makes fails as unreachable). A crashed server is replaced by a new one.
//!
//! The checker judges the recorded history:
//! - every acknowledged create made one sandbox: every acknowledgement of one idempotency key
//!   names the same sandbox (a create a crash interrupted is placed again by the leader, once
//!   the first placement is gone: the nodes' samples below judge that);
//! - the states each server reported of a sandbox follow the transition table (a server's
//!   cache may lag, never go back), and a final state never turns into another;
//! - every acknowledged delete ends the sandbox, on every server;
//! - no sandbox ran on two nodes at once (sampled from the nodes themselves).
//!
//! `FASTBOX_CHAOS_SEED` and `FASTBOX_CHAOS_SECONDS` (default 40) vary the run; the report
//! gives the operation and fault counts.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{IMAGE, Server, request};
use fastbox_api::lifecycle::SandboxState;
use fastbox_node_api::NodeAgent;
use fastbox_node_api::testkit::FakeNode;
use fastbox_server::service::Lifecycle;
use fastbox_testkit::etcd::{EtcdCluster, etcd_unavailable};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use SandboxState::{Failed, Pausing, Pending, Resuming, Stopping, Terminated};

const SERVERS: usize = 3;
const CLIENTS: usize = 3;
const FAULT_EVERY: Duration = Duration::from_secs(7);
const PREFIX: &str = "fbt-chaos";

#[derive(Default)]
struct History {
    /// Idempotency key -> the sandbox each acknowledgement named.
    created: Mutex<BTreeMap<String, Vec<String>>>,
    deleted: Mutex<BTreeSet<String>>,
    /// (server, sandbox) -> the states that server reported, in order.
    observed: Mutex<HashMap<(String, String), Vec<SandboxState>>>,
    ops: Mutex<BTreeMap<&'static str, (usize, usize)>>,
    /// Why operations were refused, by operation and error code.
    refusals: Mutex<BTreeMap<String, usize>>,
}

impl History {
    fn op(&self, kind: &'static str, acked: bool) {
        let mut ops = self.ops.lock().unwrap();
        let entry = ops.entry(kind).or_default();
        entry.0 += 1;
        entry.1 += usize::from(acked);
    }

    fn refused(&self, kind: &str, e: &fastbox_server::error::ApiError) {
        *self
            .refusals
            .lock()
            .unwrap()
            .entry(format!("{kind} {}", e.code()))
            .or_default() += 1;
    }

    fn ids(&self) -> Vec<String> {
        let created = self.created.lock().unwrap();
        let mut ids: Vec<String> = created.values().flatten().cloned().collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// A server slot: its server while it lives, and the servers started so far.
struct Slots {
    servers: Mutex<Vec<Option<Server>>>,
    started: AtomicUsize,
}

impl Slots {
    /// A live server's name, lifecycle and runtime handle.
    fn pick(&self, rng: &mut StdRng) -> Option<(String, Arc<Lifecycle>, tokio::runtime::Handle)> {
        let servers = self.servers.lock().unwrap();
        let live: Vec<&Server> = servers.iter().flatten().collect();
        if live.is_empty() {
            return None;
        }
        let s = live[rng.random_range(0..live.len())];
        Some((
            s.cluster.id().to_string(),
            s.lc.clone(),
            s.runtime.handle().clone(),
        ))
    }

    fn leader(&self) -> Option<usize> {
        let servers = self.servers.lock().unwrap();
        servers
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.cluster.is_leader()))
    }
}

/// Runs `f` on a server that may crash meanwhile: a panic of the dying runtime is no answer.
fn call<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).ok()
}

fn client(seed: u64, slots: &Slots, history: &History, stop: &AtomicBool, body: &'static [u8]) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keys = 0;
    while !stop.load(Ordering::Relaxed) {
        let Some((server, lc, handle)) = slots.pick(&mut rng) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let ids = history.ids();
        let target = (!ids.is_empty()).then(|| ids[rng.random_range(0..ids.len())].clone());
        let roll = rng.random_range(0..100);
        match (roll, target) {
            (0..35, _) | (_, None) => {
                // A create, retried once through another server with the same key when its
                // answer is lost.
                keys += 1;
                let key = format!("c{seed}-{keys}");
                for _ in 0..2 {
                    let Some((_, lc, handle)) = slots.pick(&mut rng) else {
                        break;
                    };
                    let answer = call(|| handle.block_on(lc.create_once(request(), &key, body)));
                    if let Some(Err(e)) = &answer {
                        history.refused("create", e);
                    }
                    let answer = answer.flatten_ok();
                    history.op("create", answer.is_some());
                    if let Some((sandbox, _)) = answer {
                        history
                            .created
                            .lock()
                            .unwrap()
                            .entry(key.clone())
                            .or_default()
                            .push(sandbox.id);
                        break;
                    }
                }
            }
            (35..50, Some(id)) => {
                let _in = handle.enter();
                let acked = call(|| lc.delete(&id).is_ok()).unwrap_or(false);
                history.op("delete", acked);
                if acked {
                    history.deleted.lock().unwrap().insert(id);
                }
            }
            (50..65, Some(id)) => {
                let _in = handle.enter();
                let acked = call(|| lc.pause(&id).is_ok()).unwrap_or(false);
                history.op("pause", acked);
            }
            (65..80, Some(id)) => {
                let _in = handle.enter();
                let acked = call(|| lc.resume(&id).is_ok()).unwrap_or(false);
                history.op("resume", acked);
            }
            (_, Some(id)) => {
                if let Ok(sandbox) = lc.get(&id) {
                    history
                        .observed
                        .lock()
                        .unwrap()
                        .entry((server, id))
                        .or_default()
                        .push(sandbox.status.state);
                }
                history.op("get", true);
            }
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(5..40)));
    }
}

/// `Option<Result<T, E>>` -> `Option<T>`.
trait FlattenOk<T> {
    fn flatten_ok(self) -> Option<T>;
}

impl<T, E> FlattenOk<T> for Option<Result<T, E>> {
    fn flatten_ok(self) -> Option<T> {
        self.and_then(Result::ok)
    }
}

#[test]
fn servers_and_etcd_members_fail_and_the_history_holds() {
    fastbox_testkit::skip_unless!(etcd_unavailable());
    let (seed, seconds) = fastbox_testkit::chaos::seed_and_seconds(40);
    let mut etcd = EtcdCluster::start(3).expect("etcd");
    let nodes: Vec<Arc<FakeNode>> = ["n1", "n2"]
        .iter()
        .map(|id| Arc::new(FakeNode::new(512).with_node_id(id).with_image(IMAGE)))
        .collect();
    let slots = Arc::new(Slots {
        servers: Mutex::new(Vec::new()),
        started: AtomicUsize::new(0),
    });
    let start = |slots: &Slots, etcd: &EtcdCluster| {
        let n = slots.started.fetch_add(1, Ordering::Relaxed);
        Server::start(&format!("s{n}"), etcd, PREFIX, &nodes)
    };
    for _ in 0..SERVERS {
        let server = start(&slots, &etcd);
        slots.servers.lock().unwrap().push(Some(server));
    }
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let body: &'static [u8] = br#"{"image":{"uri":"registry.test/app:1"}}"#;

    // The nodes themselves say where each sandbox runs.
    let doubled = Arc::new(Mutex::new(BTreeSet::new()));
    let sampler = {
        let (nodes, stop, doubled) = (nodes.clone(), stop.clone(), doubled.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let mut seen = BTreeMap::new();
                for node in &nodes {
                    for sandbox in node.sandboxes().into_iter().filter(|s| s.alive) {
                        if let Some(other) = seen.insert(sandbox.id.clone(), node.node_id()) {
                            doubled.lock().unwrap().insert(format!(
                                "{} on {other} and {}",
                                sandbox.id,
                                node.node_id()
                            ));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (slots, history, stop) = (slots.clone(), history.clone(), stop.clone());
            std::thread::spawn(move || client(seed + c as u64, &slots, &history, &stop, body))
        })
        .collect();

    // The fault schedule: the same order for a seed.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut faults: BTreeMap<&str, usize> = BTreeMap::new();
    let mut killed_member: Option<(usize, Instant)> = None;
    let started = Instant::now();
    // Each kind in turn, in an order the seed picks.
    let mut kinds = [
        "crash the leader",
        "stop the leader",
        "crash a follower",
        "kill an etcd member",
        "cut a server off etcd",
    ];
    let mut cut_server: Option<(Arc<AtomicBool>, Instant)> = None;
    fastbox_testkit::chaos::seeded_order(&mut kinds, &mut rng);
    let mut turn = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(FAULT_EVERY);
        if let Some((member, at)) = killed_member
            && at.elapsed() >= FAULT_EVERY
        {
            etcd.restart(member).expect("the member comes back");
            killed_member = None;
        }
        if let Some((cut, at)) = &cut_server
            && at.elapsed() >= FAULT_EVERY
        {
            cut.store(false, Ordering::Relaxed);
            cut_server = None;
        }
        let kind = kinds[turn % kinds.len()];
        turn += 1;
        let leader = slots.leader();
        match kind {
            "crash the leader" | "crash a follower" => {
                let victim = {
                    let servers = slots.servers.lock().unwrap();
                    let live: Vec<usize> = (0..servers.len())
                        .filter(|i| servers[*i].is_some())
                        .collect();
                    match kind {
                        "crash the leader" => leader,
                        _ => live.iter().copied().find(|i| Some(*i) != leader),
                    }
                };
                let Some(victim) = victim else { continue };
                let server = slots.servers.lock().unwrap()[victim].take();
                if let Some(server) = server {
                    server.crash();
                }
                let replacement = start(&slots, &etcd);
                slots.servers.lock().unwrap()[victim] = Some(replacement);
            }
            "stop the leader" => {
                let servers = slots.servers.lock().unwrap();
                let Some(leader) = leader.and_then(|i| servers[i].as_ref()) else {
                    continue;
                };
                leader.cluster.suspend_for(FAULT_EVERY);
            }
            "cut a server off etcd" => {
                if cut_server.is_some() {
                    continue;
                }
                let servers = slots.servers.lock().unwrap();
                let live: Vec<&Server> = servers.iter().flatten().collect();
                let victim = live[rng.random_range(0..live.len())];
                victim.cut.store(true, Ordering::Relaxed);
                cut_server = Some((victim.cut.clone(), Instant::now()));
            }
            _ => {
                if killed_member.is_some() {
                    continue;
                }
                let member = rng.random_range(0..3);
                etcd.kill(member);
                killed_member = Some((member, Instant::now()));
            }
        }
        *faults.entry(kind).or_default() += 1;
        eprintln!("{:?}: {kind}", started.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().expect("a client");
    }
    sampler.join().unwrap();
    if let Some((member, _)) = killed_member {
        etcd.restart(member).expect("the member comes back");
    }
    if let Some((cut, _)) = cut_server {
        cut.store(false, Ordering::Relaxed);
    }

    // Quiet: the leader finishes what was in flight; every server converges.
    let servers = slots.servers.lock().unwrap();
    let live: Vec<&Server> = servers.iter().flatten().collect();
    let quiet = Instant::now();
    let settled = |s: &&Server| {
        history.ids().iter().all(|id| match s.lc.get(id) {
            Ok(sb) => !matches!(sb.status.state, Pending | Pausing | Resuming | Stopping),
            Err(_) => true,
        })
    };
    while !live.iter().all(settled) {
        assert!(
            quiet.elapsed() < Duration::from_secs(60),
            "operations still in flight a minute after the faults"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The checker.
    let mut violations = Vec::new();
    for (key, ids) in history.created.lock().unwrap().iter() {
        if ids.iter().any(|id| *id != ids[0]) {
            violations.push(format!("key {key} acknowledged as {ids:?}"));
        }
    }
    for ((server, id), states) in history.observed.lock().unwrap().iter() {
        let states: Vec<String> = states.iter().map(|s| s.as_str().to_string()).collect();
        for step in fastbox_testkit::transitions::violations(&states) {
            violations.push(format!("{server} reported {id} {step}"));
        }
    }
    // Every server's view converges (its cache follows the store) within a bound.
    let deleted = history.deleted.lock().unwrap().clone();
    let alive_after_delete = |server: &Server| -> Vec<String> {
        deleted
            .iter()
            .filter_map(|id| match server.lc.get(id) {
                Ok(sb) if !matches!(sb.status.state, Terminated | Failed) => Some(format!(
                    "{id} deleted, but {} has it {}",
                    server.cluster.id(),
                    sb.status.state
                )),
                _ => None,
            })
            .collect()
    };
    let converging = Instant::now();
    let mut left: Vec<String> = live.iter().flat_map(|s| alive_after_delete(s)).collect();
    while !left.is_empty() && converging.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(200));
        left = live.iter().flat_map(|s| alive_after_delete(s)).collect();
    }
    eprintln!("the servers' views converged in {:?}", converging.elapsed());
    violations.extend(left);
    violations.extend(doubled.lock().unwrap().iter().cloned());

    let ops = history.ops.lock().unwrap();
    eprintln!(
        "chaos seed {seed}, {seconds} s: operations (tried, acknowledged) {ops:?}; creates refused \
         {:?}; faults {faults:?}; {} sandboxes, {} servers started",
        history.refusals.lock().unwrap(),
        history.ids().len(),
        slots.started.load(Ordering::Relaxed)
    );
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(ops.get("create").is_some_and(|(_, acked)| *acked > 0));
    for server in live {
        server.cluster.leave();
    }
}
