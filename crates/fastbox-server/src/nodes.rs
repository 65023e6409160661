//! The nodes sandboxes run on, and the choice of one for a create (FastPath).
//!
//! The server knows each node by its id and reaches it through its [`NodeAgent`]; a record
//! names the node it is on (`None`: the first node, for records written before there were
//! several). A create ranks the nodes by a score computed from what each last reported
//! ([`NodeStatus`]: a warm pool of the template, free slots, memory headroom) minus what the
//! server admitted into it since, and asks the best ones in turn: a node that refuses
//! admission (full) costs nothing, so the create falls back to the next. The ranking reads
//! only cached reports: it is constant time per node and never waits for a node.
//!
//! A registered node holds a lease it renews with heartbeats ([`Nodes::renew`]); one whose
//! lease ran out is asked for nothing new, and one whose lease ran out longer ago than the
//! margin is lost ([`Nodes::newly_lost`]) until it renews again. The in-process node and
//! nodes given by configuration hold no lease: they are never lost.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use fastbox_node_api::NodeAgent;
use fastbox_node_api::wire::NodeStatus;

/// At most this many nodes are asked, best first, before a create is refused as full.
pub const TOP_K: usize = 3;

/// The most slots a node's report is believed to have (a /16 address pool).
const MAX_SLOTS: u32 = 1 << 16;

/// Weight of a pre-restored sandbox of the create's template (a claim takes milliseconds,
/// a restore tens of them).
const WARM_POOL_SCORE: i64 = 1_000_000;
/// A node with less free memory than this is asked last.
const LOW_MEMORY_BYTES: u64 = 512 << 20;
const LOW_MEMORY_PENALTY: i64 = 500_000;

#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    #[error("node {0} is not known to this server")]
    Unknown(String),
    #[error("no node is available")]
    NoNodes,
    #[error("node id {0:?} is used twice")]
    Duplicate(String),
}

/// One node, with what it last reported and what was admitted into it since.
struct Entry {
    agent: Arc<dyn NodeAgent>,
    status: Mutex<Option<NodeStatus>>,
    /// Admissions since the last report (the report does not count them yet).
    admitted: AtomicU32,
    /// Admissions since this server started.
    admitted_total: std::sync::atomic::AtomicU64,
    /// Claims of a pooled sandbox since the last report, by whoever asked.
    claimed: AtomicU32,
    /// `host:port` of its node proxy (`None`: the server's configured one).
    proxy: Option<String>,
    lease: Mutex<Lease>,
    /// It registered again (it restarted): the server takes its sandboxes back.
    rejoined: std::sync::atomic::AtomicBool,
    /// Held back from placement: no create, move or fork lands on it (a server that only
    /// places on joined nodes).
    held_back: std::sync::atomic::AtomicBool,
}

/// A node's lease (`until: None`: it holds none and is never lost).
#[derive(Debug, Clone, Copy, Default)]
struct Lease {
    until: Option<Instant>,
    lost: bool,
}

/// Where a node stands, for `GET /v1/nodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Holds no lease (in process, or given by configuration).
    Static,
    /// Its lease holds.
    Ready,
    /// Its lease ran out: asked for nothing new, not yet lost.
    Expired,
    /// Declared lost: its running sandboxes failed (`NODE_LOST`).
    Lost,
}

/// One node as `GET /v1/nodes` shows it.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub id: String,
    pub state: NodeState,
    pub proxy: Option<String>,
    /// Until its lease runs out (`None` without a lease, or once it ran out).
    pub lease_left: Option<Duration>,
    pub status: Option<NodeStatus>,
    /// Sandboxes admitted into it since this server started.
    pub admitted_total: u64,
}

/// The nodes, in the order they were added (the first is the default).
pub struct Nodes {
    entries: RwLock<Vec<Arc<Entry>>>,
}

impl Nodes {
    /// The nodes `agents` (at least one; ids unique).
    pub fn new(agents: Vec<Arc<dyn NodeAgent>>) -> Result<Self, NodesError> {
        let nodes = Self {
            entries: RwLock::new(Vec::new()),
        };
        if agents.is_empty() {
            return Err(NodesError::NoNodes);
        }
        for agent in agents {
            nodes.add(agent)?;
        }
        Ok(nodes)
    }

    /// One node.
    pub fn single(agent: Arc<dyn NodeAgent>) -> Self {
        Self::new(vec![agent]).expect("one node")
    }

    /// Adds `agent`, holding no lease (refused when its id is taken).
    pub fn add(&self, agent: Arc<dyn NodeAgent>) -> Result<(), NodesError> {
        let mut entries = self.entries.write().expect("nodes lock");
        let id = agent.node_id().to_string();
        if entries.iter().any(|e| e.agent.node_id() == id) {
            return Err(NodesError::Duplicate(id));
        }
        entries.push(Arc::new(Entry::new(agent, None, Lease::default())));
        Ok(())
    }

    /// Adds registered node `agent` (or replaces the one of its id: it registered again),
    /// whose node proxy clients reach at `proxy`, with a lease until `until`.
    pub fn add_leased(&self, agent: Arc<dyn NodeAgent>, proxy: String, until: Instant) {
        let mut entries = self.entries.write().expect("nodes lock");
        let id = agent.node_id().to_string();
        let lease = Lease {
            until: Some(until),
            lost: false,
        };
        let entry = Arc::new(Entry::new(agent, Some(proxy), lease));
        match entries.iter().position(|e| e.agent.node_id() == id) {
            Some(i) => {
                // A node lost before keeps being lost until it renews: its sandboxes' failure
                // stands.
                let was = *entries[i].lease.lock().expect("lease lock");
                entry.lease.lock().expect("lease lock").lost = was.lost;
                entry.rejoined.store(true, Ordering::Relaxed);
                entries[i] = entry;
            }
            None => entries.push(entry),
        }
    }

    /// Keeps node `id` out of placement from now on: what runs there stays, nothing new
    /// lands there. Whether there is such a node.
    pub fn hold_back(&self, id: &str) -> bool {
        self.entry(id)
            .map(|e| e.held_back.store(true, Ordering::Relaxed))
            .is_some()
    }

    /// The nodes that registered again since the last call (each once).
    pub fn take_rejoined(&self) -> Vec<String> {
        self.entries
            .read()
            .expect("nodes lock")
            .iter()
            .filter(|e| e.rejoined.swap(false, Ordering::Relaxed))
            .map(|e| e.agent.node_id().to_string())
            .collect()
    }

    /// Forgets node `id` (revoked); whether it was there.
    pub fn remove(&self, id: &str) -> bool {
        let mut entries = self.entries.write().expect("nodes lock");
        let before = entries.len();
        entries.retain(|e| e.agent.node_id() != id);
        entries.len() != before
    }

    /// Renews node `id`'s lease until `until`; whether it had been lost (it no longer is).
    /// `None`: no such node, or one that holds no lease.
    pub fn renew(&self, id: &str, until: Instant) -> Option<bool> {
        let entry = self.entry(id)?;
        let mut lease = entry.lease.lock().expect("lease lock");
        lease.until?;
        let was_lost = lease.lost;
        *lease = Lease {
            until: Some(until),
            lost: false,
        };
        Some(was_lost)
    }

    /// Extends node `id`'s lease to `until` (its lease in the store is alive: another server
    /// got its heartbeat), unless it is lost: only a heartbeat it sends brings it back.
    pub fn extend(&self, id: &str, until: Instant) {
        let Some(entry) = self.entry(id) else {
            return;
        };
        let mut lease = entry.lease.lock().expect("lease lock");
        if !lease.lost && lease.until.is_some_and(|t| t < until) {
            lease.until = Some(until);
        }
    }

    /// Marks lost every node whose lease ran out more than `margin` ago and that was not lost
    /// yet; their ids.
    pub fn newly_lost(&self, margin: Duration) -> Vec<String> {
        let now = Instant::now();
        // Under the write lock: a registration replacing an entry meanwhile would carry the
        // old entry's state over before this marks it.
        let entries = self.entries.write().expect("nodes lock");
        entries
            .iter()
            .filter(|e| {
                let mut lease = e.lease.lock().expect("lease lock");
                let lost_now = !lease.lost && lease.until.is_some_and(|t| t + margin <= now);
                lease.lost |= lost_now;
                lost_now
            })
            .map(|e| e.agent.node_id().to_string())
            .collect()
    }

    /// Whether node `id` (`None`: the first) is lost.
    pub fn is_lost(&self, id: Option<&str>) -> bool {
        let entry = match id {
            Some(id) => self.entry(id),
            None => self.entries.read().expect("nodes lock").first().cloned(),
        };
        entry.is_some_and(|e| e.lease.lock().expect("lease lock").lost)
    }

    /// `host:port` of node `id`'s proxy, when it is not the server's configured one.
    pub fn proxy_of(&self, id: Option<&str>) -> Option<String> {
        self.entry(id?)?.proxy.clone()
    }

    /// Every node, as `GET /v1/nodes` shows it.
    pub fn views(&self) -> Vec<NodeView> {
        let now = Instant::now();
        self.entries
            .read()
            .expect("nodes lock")
            .iter()
            .map(|e| {
                let lease = *e.lease.lock().expect("lease lock");
                let state = match (lease.until, lease.lost) {
                    (None, _) => NodeState::Static,
                    (Some(_), true) => NodeState::Lost,
                    (Some(t), false) if t <= now => NodeState::Expired,
                    (Some(_), false) => NodeState::Ready,
                };
                NodeView {
                    id: e.agent.node_id().to_string(),
                    state,
                    proxy: e.proxy.clone(),
                    lease_left: lease.until.and_then(|t| t.checked_duration_since(now)),
                    status: e.status.lock().expect("status lock").clone(),
                    admitted_total: e.admitted_total.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Node `id`; `None` names the first node.
    pub fn get(&self, id: Option<&str>) -> Result<Arc<dyn NodeAgent>, NodesError> {
        let entries = self.entries.read().expect("nodes lock");
        let found = match id {
            None => entries.first(),
            Some(id) => entries.iter().find(|e| e.agent.node_id() == id),
        };
        found.map(|e| e.agent.clone()).ok_or_else(|| match id {
            Some(id) => NodesError::Unknown(id.to_string()),
            None => NodesError::NoNodes,
        })
    }

    /// The first node (images are checked, templates built there).
    pub fn first(&self) -> Arc<dyn NodeAgent> {
        self.get(None).expect("at least one node")
    }

    /// Every node.
    pub fn all(&self) -> Vec<Arc<dyn NodeAgent>> {
        self.entries
            .read()
            .expect("nodes lock")
            .iter()
            .map(|e| e.agent.clone())
            .collect()
    }

    /// How many nodes there are.
    pub fn len(&self) -> usize {
        self.entries.read().expect("nodes lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id of the first node, which records without a node are on.
    pub fn first_id(&self) -> String {
        self.first().node_id().to_string()
    }

    /// The last report of every node (`None` before its first).
    pub fn statuses(&self) -> Vec<(String, Option<NodeStatus>)> {
        self.entries
            .read()
            .expect("nodes lock")
            .iter()
            .map(|e| {
                (
                    e.agent.node_id().to_string(),
                    e.status.lock().expect("status lock").clone(),
                )
            })
            .collect()
    }

    /// At most [`TOP_K`] nodes for a create of template `pool_key`, best first: nodes whose
    /// lease holds (or that hold none).
    pub fn ranked(&self, pool_key: Option<&str>) -> Vec<Arc<dyn NodeAgent>> {
        let entries = self.entries.read().expect("nodes lock");
        let now = Instant::now();
        let mut scored: Vec<(i64, usize)> = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.usable(now))
            .map(|(i, e)| (e.score(pool_key), i))
            .collect();
        // Best first; equal scores keep the order the nodes were added in.
        scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        scored
            .into_iter()
            .take(TOP_K)
            .map(|(_, i)| entries[i].agent.clone())
            .collect()
    }

    /// Counts an admission into node `id` until its next report.
    pub fn admitted(&self, id: &str) {
        if let Some(e) = self.entry(id) {
            e.admitted.fetch_add(1, Ordering::Relaxed);
            e.admitted_total.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Counts a claim of a pooled sandbox on node `id` until its next report.
    pub fn claimed(&self, id: &str) {
        if let Some(e) = self.entry(id) {
            e.claimed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Asks every node that holds no lease for its status (concurrently) and keeps the
    /// answers (registered nodes report with their heartbeats).
    pub async fn refresh(&self) {
        self.refresh_some(false).await;
    }

    /// [`Nodes::refresh`], and with `leased_too` the registered nodes that are not lost as
    /// well (servers sharing a store: a node heartbeats to one of them, the others ask it).
    pub async fn refresh_some(&self, leased_too: bool) {
        let entries: Vec<Arc<Entry>> = self
            .entries
            .read()
            .expect("nodes lock")
            .iter()
            .filter(|e| {
                let lease = e.lease.lock().expect("lease lock");
                lease.until.is_none() || (leased_too && !lease.lost)
            })
            .cloned()
            .collect();
        let reports = futures::future::join_all(entries.iter().map(|e| e.agent.status())).await;
        for (entry, status) in entries.iter().zip(reports) {
            entry.report(status);
        }
    }

    /// Keeps a report node `status.node_id` sent, its figures bounded by the node's own size
    /// (a node that lies about them cannot outrank the others by more than an honest full
    /// report would).
    pub fn report(&self, mut status: NodeStatus) {
        status.slots = status.slots.min(MAX_SLOTS);
        status.free_slots = status.free_slots.min(status.slots);
        status.sandboxes = status.sandboxes.map(|n| n.min(status.slots));
        let slots = status.slots as usize;
        status.pools.values_mut().for_each(|n| *n = (*n).min(slots));
        status.unused_admissions.truncate(slots);
        if let Some(e) = self.entry(&status.node_id) {
            e.report(status);
        }
    }

    fn entry(&self, id: &str) -> Option<Arc<Entry>> {
        self.entries
            .read()
            .expect("nodes lock")
            .iter()
            .find(|e| e.agent.node_id() == id)
            .cloned()
    }
}

impl Entry {
    fn new(agent: Arc<dyn NodeAgent>, proxy: Option<String>, lease: Lease) -> Self {
        Self {
            agent,
            status: Mutex::new(None),
            admitted: AtomicU32::new(0),
            admitted_total: std::sync::atomic::AtomicU64::new(0),
            claimed: AtomicU32::new(0),
            proxy,
            lease: Mutex::new(lease),
            rejoined: std::sync::atomic::AtomicBool::new(false),
            held_back: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether new sandboxes may go to the node: it is not held back, and holds no lease or
    /// one that holds.
    fn usable(&self, now: Instant) -> bool {
        if self.held_back.load(Ordering::Relaxed) {
            return false;
        }
        let lease = self.lease.lock().expect("lease lock");
        !lease.lost && lease.until.is_none_or(|t| now < t)
    }

    fn report(&self, status: NodeStatus) {
        *self.status.lock().expect("status lock") = Some(status);
        self.admitted.store(0, Ordering::Relaxed);
        self.claimed.store(0, Ordering::Relaxed);
    }

    /// Higher is better. A node that has not reported yet scores as an empty one of no
    /// known size: after every node that reported free slots.
    fn score(&self, pool_key: Option<&str>) -> i64 {
        let admitted = i64::from(self.admitted.load(Ordering::Relaxed));
        let claimed = i64::from(self.claimed.load(Ordering::Relaxed));
        let status = self.status.lock().expect("status lock");
        let Some(status) = status.as_ref() else {
            return -admitted;
        };
        let free = i64::from(status.free_slots) - admitted;
        if free <= 0 {
            return i64::MIN / 2 + free;
        }
        let warm = pool_key
            .and_then(|key| status.pools.get(key))
            .map(|&n| i64::try_from(n).unwrap_or(i64::MAX) - claimed)
            .unwrap_or(0)
            .max(0);
        let memory = match status.memory_available_bytes {
            Some(bytes) if bytes < LOW_MEMORY_BYTES => -LOW_MEMORY_PENALTY,
            _ => 0,
        };
        // The share of the node not running sandboxes (so a big node and a small one fill
        // evenly), in thousandths. Slots also hold pooled sandboxes and spares (capacity made
        // ahead, not load): the running count says the load when the node reports it.
        let idle = match status.sandboxes {
            Some(running) => i64::from(status.slots) - i64::from(running) - admitted,
            None => free,
        };
        let share = idle * 1000 / i64::from(status.slots.max(1));
        (warm.min(1) * WARM_POOL_SCORE) + memory + share
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_node_api::testkit::FakeNode;
    use std::collections::BTreeMap;

    fn node(id: &str) -> Arc<dyn NodeAgent> {
        Arc::new(FakeNode::new(4).with_node_id(id))
    }

    fn status(id: &str, slots: u32, free: u32, pools: &[(&str, usize)]) -> NodeStatus {
        NodeStatus {
            node_id: id.to_string(),
            slots,
            free_slots: free,
            pools: pools
                .iter()
                .map(|(k, n)| (k.to_string(), *n))
                .collect::<BTreeMap<_, _>>(),
            memory_available_bytes: None,
            sandboxes: None,
            unused_admissions: Vec::new(),
            delivery: None,
        }
    }

    fn ids(nodes: &[Arc<dyn NodeAgent>]) -> Vec<&str> {
        nodes.iter().map(|n| n.node_id()).collect()
    }

    #[test]
    fn ids_are_unique_and_the_first_is_the_default() {
        let nodes = Nodes::new(vec![node("a"), node("b")]).unwrap();
        assert_eq!(nodes.get(None).unwrap().node_id(), "a");
        assert_eq!(nodes.get(Some("b")).unwrap().node_id(), "b");
        assert!(matches!(
            nodes.get(Some("c")),
            Err(NodesError::Unknown(id)) if id == "c"
        ));
        assert!(matches!(
            nodes.add(node("b")),
            Err(NodesError::Duplicate(_))
        ));
        assert!(matches!(Nodes::new(vec![]), Err(NodesError::NoNodes)));
    }

    #[test]
    fn a_warm_pool_of_the_template_wins_then_free_share() {
        let nodes = Nodes::new(vec![node("a"), node("b"), node("c")]).unwrap();
        nodes.report(status("a", 10, 9, &[]));
        nodes.report(status("b", 10, 2, &[("t", 1)]));
        nodes.report(status("c", 10, 5, &[]));
        assert_eq!(ids(&nodes.ranked(Some("t"))), ["b", "a", "c"]);
        assert_eq!(ids(&nodes.ranked(None)), ["a", "c", "b"]);
        // The pooled sandbox was claimed: b's pool counts as empty until its next report.
        nodes.claimed("b");
        assert_eq!(ids(&nodes.ranked(Some("t"))), ["a", "c", "b"]);
    }

    #[test]
    fn admissions_since_the_last_report_spread_a_burst() {
        let nodes = Nodes::new(vec![node("a"), node("b")]).unwrap();
        nodes.report(status("a", 4, 4, &[]));
        nodes.report(status("b", 4, 4, &[]));
        let mut firsts = Vec::new();
        for _ in 0..6 {
            let best = nodes.ranked(None)[0].node_id().to_string();
            nodes.admitted(&best);
            firsts.push(best);
        }
        assert_eq!(firsts, ["a", "b", "a", "b", "a", "b"]);
        let totals: Vec<u64> = nodes.views().iter().map(|v| v.admitted_total).collect();
        assert_eq!(totals, [3, 3]);
        // Full by the server's count: last, whatever it reported.
        for _ in 0..2 {
            nodes.admitted("a");
        }
        assert_eq!(ids(&nodes.ranked(None)), ["b", "a"]);
        // A report replaces the count.
        nodes.report(status("a", 4, 4, &[]));
        assert_eq!(ids(&nodes.ranked(None))[0], "a");
    }

    #[test]
    fn the_running_count_is_the_load_when_reported() {
        // Node a made more capacity ahead (pooled sandboxes, spares): fewer free slots, but
        // fewer sandboxes running.
        let nodes = Nodes::new(vec![node("a"), node("b")]).unwrap();
        let mut a = status("a", 100, 60, &[]);
        a.sandboxes = Some(10);
        let mut b = status("b", 100, 80, &[]);
        b.sandboxes = Some(20);
        nodes.report(a);
        nodes.report(b);
        assert_eq!(ids(&nodes.ranked(None)), ["a", "b"]);
        for _ in 0..11 {
            nodes.admitted("a");
        }
        assert_eq!(ids(&nodes.ranked(None)), ["b", "a"]);
    }

    #[test]
    fn low_memory_goes_last_and_at_most_top_k_are_asked() {
        let nodes = Nodes::new(vec![node("a"), node("b"), node("c"), node("d")]).unwrap();
        let mut low = status("a", 4, 4, &[]);
        low.memory_available_bytes = Some(100 << 20);
        nodes.report(low);
        nodes.report(status("b", 4, 1, &[]));
        nodes.report(status("c", 4, 2, &[]));
        nodes.report(status("d", 4, 0, &[]));
        assert_eq!(ids(&nodes.ranked(None)), ["c", "b", "a"]);
    }

    #[test]
    fn leases_expire_then_are_lost_and_a_renewal_brings_the_node_back() {
        let nodes = Nodes::new(vec![node("local")]).unwrap();
        let now = Instant::now();
        nodes.add_leased(
            node("r"),
            "10.0.0.2:8091".into(),
            now + Duration::from_secs(60),
        );
        assert_eq!(nodes.proxy_of(Some("r")).as_deref(), Some("10.0.0.2:8091"));
        assert_eq!(nodes.proxy_of(Some("local")), None);
        assert_eq!(nodes.ranked(None).len(), 2);
        // Its lease ran out: nothing new goes there, but it is not lost before the margin.
        assert_eq!(nodes.renew("r", now), Some(false));
        assert_eq!(ids(&nodes.ranked(None)), ["local"]);
        assert!(nodes.newly_lost(Duration::from_secs(60)).is_empty());
        assert_eq!(nodes.views()[1].state, NodeState::Expired);
        assert_eq!(nodes.newly_lost(Duration::ZERO), ["r"]);
        assert!(nodes.newly_lost(Duration::ZERO).is_empty(), "lost once");
        assert!(nodes.is_lost(Some("r")));
        // Registering again does not undo the loss; a renewal does, and says so.
        assert!(nodes.take_rejoined().is_empty());
        nodes.add_leased(
            node("r"),
            "10.0.0.2:8091".into(),
            now + Duration::from_secs(60),
        );
        assert!(nodes.is_lost(Some("r")));
        assert_eq!(nodes.take_rejoined(), ["r"]);
        assert!(nodes.take_rejoined().is_empty());
        assert_eq!(
            nodes.renew("r", Instant::now() + Duration::from_secs(60)),
            Some(true)
        );
        assert!(!nodes.is_lost(Some("r")));
        assert_eq!(nodes.views()[1].state, NodeState::Ready);
        assert_eq!(nodes.ranked(None).len(), 2);
        // Nodes without a lease are never lost and cannot renew.
        assert_eq!(nodes.renew("local", now), None);
        assert_eq!(nodes.views()[0].state, NodeState::Static);
        assert!(nodes.remove("r"));
        assert!(!nodes.remove("r"));
    }

    #[test]
    fn a_held_back_node_takes_nothing_new() {
        let nodes = Nodes::single(node("local"));
        nodes.add_leased(
            node("r"),
            "10.0.0.2:8091".into(),
            Instant::now() + Duration::from_secs(60),
        );
        assert!(nodes.hold_back("local"));
        assert!(!nodes.hold_back("nobody"));
        assert_eq!(ids(&nodes.ranked(None)), ["r"]);
        // It stays a node: records on it still find it, and it is never lost.
        assert!(nodes.get(Some("local")).is_ok());
        assert!(nodes.newly_lost(Duration::ZERO).is_empty());
        nodes.remove("r");
        assert!(nodes.ranked(None).is_empty(), "no node left to place on");
    }

    #[tokio::test]
    async fn refresh_asks_every_node() {
        let a = Arc::new(FakeNode::new(3).with_node_id("a"));
        let b = Arc::new(FakeNode::new(5).with_node_id("b"));
        let nodes = Nodes::new(vec![a.clone(), b.clone()]).unwrap();
        assert!(nodes.statuses().iter().all(|(_, s)| s.is_none()));
        nodes.refresh().await;
        let slots: Vec<u32> = nodes
            .statuses()
            .into_iter()
            .map(|(_, s)| s.unwrap().slots)
            .collect();
        assert_eq!(slots, [3, 5]);
    }
}
