//! The nodes sandboxes run on, and the choice of one for a create (FastPath).
//!
//! The server knows each node by its id and reaches it through its [`NodeAgent`]; a record
//! names the node it is on (`None`: the first node, for records written before there were
//! several). A create ranks the nodes by a score computed from what each last reported
//! ([`NodeStatus`]: a warm pool of the template, free slots, memory headroom) minus what the
//! server admitted into it since, and asks the best ones in turn: a node that refuses
//! admission (full) costs nothing, so the create falls back to the next. The ranking reads
//! only cached reports: it is constant time per node and never waits for a node.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use fastbox_node_api::NodeAgent;
use fastbox_node_api::wire::NodeStatus;

/// At most this many nodes are asked, best first, before a create is refused as full.
pub const TOP_K: usize = 3;

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
    /// Claims of a pooled sandbox since the last report, by whoever asked.
    claimed: AtomicU32,
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

    /// Adds `agent` (refused when its id is taken).
    pub fn add(&self, agent: Arc<dyn NodeAgent>) -> Result<(), NodesError> {
        let mut entries = self.entries.write().expect("nodes lock");
        let id = agent.node_id().to_string();
        if entries.iter().any(|e| e.agent.node_id() == id) {
            return Err(NodesError::Duplicate(id));
        }
        entries.push(Arc::new(Entry {
            agent,
            status: Mutex::new(None),
            admitted: AtomicU32::new(0),
            claimed: AtomicU32::new(0),
        }));
        Ok(())
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

    /// At most [`TOP_K`] nodes for a create of template `pool_key`, best first.
    pub fn ranked(&self, pool_key: Option<&str>) -> Vec<Arc<dyn NodeAgent>> {
        let entries = self.entries.read().expect("nodes lock");
        if entries.len() == 1 {
            return vec![entries[0].agent.clone()];
        }
        let mut scored: Vec<(i64, usize)> = entries
            .iter()
            .enumerate()
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
        }
    }

    /// Counts a claim of a pooled sandbox on node `id` until its next report.
    pub fn claimed(&self, id: &str) {
        if let Some(e) = self.entry(id) {
            e.claimed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Asks every node for its status (concurrently) and keeps the answers.
    pub async fn refresh(&self) {
        let entries: Vec<Arc<Entry>> = self.entries.read().expect("nodes lock").clone();
        let reports = futures::future::join_all(entries.iter().map(|e| e.agent.status())).await;
        for (entry, status) in entries.iter().zip(reports) {
            entry.report(status);
        }
    }

    /// Keeps a report node `status.node_id` sent.
    pub fn report(&self, status: NodeStatus) {
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
        // Free slots as a share of the node (so a big node and a small one fill evenly),
        // in thousandths.
        let share = free * 1000 / i64::from(status.slots.max(1));
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
