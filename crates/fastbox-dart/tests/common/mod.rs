//! A delivery group on one machine: real peer servers on 127.0.0.1 random ports, each node
//! with its own directory of blocks, all in front of one counting `LocalStore` origin.

#![allow(dead_code)] // each test binary uses part of the harness

use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

use fastbox_artifact::{ArtifactStore, Digest, LocalStore};
use fastbox_dart::testkit::CountingOrigin;
use fastbox_dart::{DartConfig, Delivery, GroupSecret, Member, Membership, NodeId, PeerServer};

/// The group secret of the test clusters.
pub fn secret() -> GroupSecret {
    GroupSecret::try_new(b"dart-test-group-secret-0123456789".to_vec()).unwrap()
}

/// A block the test wrote to the origin.
#[derive(Debug, Clone)]
pub struct TestBlock {
    pub digest: Digest,
    pub bytes: Vec<u8>,
}

/// `n` distinct pseudo-random blocks of `size` bytes, derived from `seed`.
pub fn make_blocks(seed: &str, n: usize, size: usize) -> Vec<TestBlock> {
    (0..n)
        .map(|i| {
            let mut bytes = vec![0u8; size];
            let mut hasher = blake3::Hasher::new();
            hasher.update(format!("{seed}/{i}").as_bytes());
            hasher.finalize_xof().fill(&mut bytes);
            TestBlock {
                digest: Digest::of(&bytes),
                bytes,
            }
        })
        .collect()
}

/// Write blocks to the origin without counting them as reads.
pub fn seed_origin(origin: &CountingOrigin, blocks: &[TestBlock]) {
    for block in blocks {
        origin
            .inner()
            .put_block(&block.digest, &block.bytes)
            .unwrap();
    }
}

/// One node: its block directory, its `Delivery`, its peer server.
pub struct TestNode {
    pub id: NodeId,
    pub addr: SocketAddr,
    pub blocks: Arc<LocalStore>,
    pub delivery: Arc<Delivery>,
    server: Mutex<Option<PeerServer>>,
}

impl TestNode {
    /// Its membership entry.
    pub fn member(&self) -> Member {
        Member::try_new(self.id.clone(), self.addr.to_string()).unwrap()
    }

    /// Stop its peer server abruptly (open connections are cut), as if the node died.
    pub fn kill_server(&self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.shutdown();
        }
    }

    /// Assert it holds every block, intact.
    pub fn assert_holds(&self, blocks: &[TestBlock]) {
        for block in blocks {
            let held = self
                .blocks
                .get_block(&block.digest)
                .unwrap_or_else(|e| panic!("node {} lacks block {}: {e}", self.id, block.digest));
            assert_eq!(held, block.bytes, "node {} block {}", self.id, block.digest);
        }
    }
}

/// Nodes sharing one origin.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub origin: Arc<CountingOrigin>,
    pub nodes: Vec<TestNode>,
}

impl Cluster {
    /// Start nodes `ids`, all members of one group, with `tune` applied to each config.
    pub fn start(ids: &[&str], origin: CountingOrigin, tune: impl Fn(&mut DartConfig)) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let origin = Arc::new(origin);
        let listeners: Vec<TcpListener> = ids
            .iter()
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let members: Vec<Member> = ids
            .iter()
            .zip(&listeners)
            .map(|(id, l)| {
                Member::try_new(
                    NodeId::try_new(*id).unwrap(),
                    l.local_addr().unwrap().to_string(),
                )
                .unwrap()
            })
            .collect();
        let membership = Membership::try_new(members.clone()).unwrap();
        let nodes = members
            .into_iter()
            .zip(listeners)
            .map(|(member, listener)| {
                let blocks =
                    Arc::new(LocalStore::open(dir.path().join(member.id.as_str())).unwrap());
                let mut config = DartConfig::new(member.id.clone(), membership.clone(), secret());
                tune(&mut config);
                let delivery = Arc::new(Delivery::new(config, blocks.clone(), origin.clone()));
                let addr = listener.local_addr().unwrap();
                let server = PeerServer::serve(listener, delivery.peer_state()).unwrap();
                TestNode {
                    id: member.id,
                    addr,
                    blocks,
                    delivery,
                    server: Mutex::new(Some(server)),
                }
            })
            .collect();
        Cluster { dir, origin, nodes }
    }

    /// The node named `id`.
    pub fn node(&self, id: &str) -> &TestNode {
        self.nodes
            .iter()
            .find(|n| n.id.as_str() == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    /// The membership made of the nodes named `ids`.
    pub fn membership(&self, ids: &[&str]) -> Membership {
        Membership::try_new(ids.iter().map(|id| self.node(id).member()).collect()).unwrap()
    }

    /// Give the nodes named `to` the membership made of the nodes named `members`.
    pub fn set_members(&self, to: &[&str], members: &[&str]) {
        let membership = self.membership(members);
        for id in to {
            self.node(id).delivery.set_members(membership.clone());
        }
    }

    /// Sum of one counter over the nodes named `ids`.
    pub fn total(
        &self,
        ids: &[&str],
        counter: impl Fn(&fastbox_dart::CounterSnapshot) -> u64,
    ) -> u64 {
        ids.iter()
            .map(|id| counter(&self.node(id).delivery.counters()))
            .sum()
    }
}

/// The blocks in an order that depends on `salt`, so concurrent readers do not march in step.
pub fn shuffled(blocks: &[TestBlock], salt: u64) -> Vec<TestBlock> {
    let mut order: Vec<TestBlock> = blocks.to_vec();
    order.sort_by_key(|b| {
        blake3::hash(&[b.digest.as_bytes().as_slice(), &salt.to_le_bytes()].concat())
            .to_hex()
            .to_string()
    });
    order
}

/// Read every block through `delivery` in a shuffled order, asserting each is the expected
/// content.
pub fn read_all(delivery: &Delivery, blocks: &[TestBlock], salt: u64) {
    for block in shuffled(blocks, salt) {
        let got = delivery
            .get_block(&block.digest)
            .unwrap_or_else(|e| panic!("node {} reading {}: {e}", delivery.node(), block.digest));
        assert_eq!(
            got,
            block.bytes,
            "node {} block {}",
            delivery.node(),
            block.digest
        );
    }
}

/// Every node named `ids` reads every block at once, `threads` threads per node.
pub fn read_concurrently(cluster: &Cluster, ids: &[&str], blocks: &[TestBlock], threads: u64) {
    std::thread::scope(|scope| {
        for (n, id) in ids.iter().enumerate() {
            for t in 0..threads {
                let delivery = cluster.node(id).delivery.clone();
                scope.spawn(move || read_all(&delivery, blocks, n as u64 * 100 + t));
            }
        }
    });
}
