//! Three (and four) nodes on loopback sharing one origin: the clean run, a node killed
//! mid-transfer, nodes leaving and joining, and an owner streaming while it receives.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, make_blocks, read_concurrently, seed_origin};
use fastbox_artifact::LocalStore;
use fastbox_dart::testkit::CountingOrigin;
use fastbox_dart::{FetchMode, NodeBlocks, PeerClient, PeerTimeouts};

/// Test blocks are smaller than the 4 MiB production size to keep debug builds quick; the
/// protocol does not depend on the size.
const BLOCK: usize = 512 * 1024;

fn origin(dir: &tempfile::TempDir) -> CountingOrigin {
    CountingOrigin::new(LocalStore::open(dir.path().join("origin")).unwrap())
}

#[test]
fn three_nodes_fetch_each_block_from_the_origin_about_once() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = make_blocks("clean", 40, BLOCK);
    let origin = origin(&dir);
    seed_origin(&origin, &blocks);
    let cluster = Cluster::start(&["a", "b", "c"], origin, |_| {});
    let ids = ["a", "b", "c"];

    read_concurrently(&cluster, &ids, &blocks, 2);

    let origin_reads = cluster.origin.block_reads();
    let n = blocks.len() as u64;
    assert!(
        (n..=n + 4).contains(&origin_reads),
        "origin reads {origin_reads} not within [{n}, {}]",
        n + 4
    );
    assert_eq!(cluster.total(&ids, |c| c.origin_fetches), origin_reads);
    let peer_fetches = cluster.total(&ids, |c| c.peer_fetches);
    assert!(
        peer_fetches >= 3 * n - origin_reads,
        "peers served the rest"
    );
    assert_eq!(cluster.total(&ids, |c| c.peer_served), peer_fetches);
    assert_eq!(cluster.total(&ids, |c| c.peer_failures), 0);
    assert_eq!(cluster.total(&ids, |c| c.fallbacks_to_origin), 0);
    for node in &cluster.nodes {
        node.assert_holds(&blocks);
        let counters = node.delivery.counters();
        assert!(
            counters.bytes_verified >= n * BLOCK as u64,
            "node {}: every block entered verified ({counters:?})",
            node.id
        );
        println!("{}: {counters:?}", node.id);
        print!("{}", node.delivery.metrics_text());
    }
    // Every block was fetched from the origin by its owner, and by no one else.
    for block in &blocks {
        assert_eq!(
            cluster.origin.reads_of(&block.digest),
            1,
            "block {}",
            block.digest
        );
    }
}

#[test]
fn the_others_still_get_every_block_when_a_node_dies_mid_transfer() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = make_blocks("kill", 40, BLOCK);
    // Slow enough that the victim is streaming blocks when it dies.
    let origin = origin(&dir).slow(64 * 1024, Duration::from_millis(5));
    seed_origin(&origin, &blocks);
    let cluster = Cluster::start(&["a", "b", "c"], origin, |config| {
        config.timeouts = PeerTimeouts {
            connect: Duration::from_millis(500),
            first_byte: Duration::from_secs(2),
            stall: Duration::from_secs(2),
            total: Duration::from_secs(10),
        };
    });
    let victim = cluster.node("c");

    std::thread::scope(|scope| {
        scope.spawn(|| {
            let started = Instant::now();
            while victim.delivery.counters().peer_served < 2 {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "c never served"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            victim.kill_server();
        });
        read_concurrently(&cluster, &["a", "b"], &blocks, 2);
    });

    for id in ["a", "b"] {
        let node = cluster.node(id);
        node.assert_holds(&blocks);
        println!("{id}: {:?}", node.delivery.counters());
    }
    assert!(
        cluster.total(&["a", "b"], |c| c.peer_failures) > 0,
        "the dead node was asked and failed"
    );
    assert!(
        cluster.total(&["a", "b"], |c| c.breaker_trips) > 0,
        "a breaker opened on the dead node"
    );
    assert!(
        cluster.node("a").delivery.breaker_open(&victim.id)
            || cluster.node("b").delivery.breaker_open(&victim.id)
    );
}

#[test]
fn ownership_moves_when_nodes_leave_and_join_and_reads_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let first = make_blocks("members-1", 12, BLOCK);
    let second = make_blocks("members-2", 12, BLOCK);
    let origin = origin(&dir);
    seed_origin(&origin, &first);
    seed_origin(&origin, &second);
    let cluster = Cluster::start(&["a", "b", "c", "d"], origin, |_| {});
    cluster.set_members(&["a", "b", "c", "d"], &["a", "b", "c"]);

    // Phase 1: a, b and c.
    read_concurrently(&cluster, &["a", "b", "c"], &first, 1);
    assert_eq!(cluster.origin.block_reads(), first.len() as u64);

    // Phase 2: c leaves (its server dies, a and b drop it from their lists).
    let with_c = cluster.membership(&["a", "b", "c"]);
    let moved = second
        .iter()
        .filter(|b| with_c.owner(&b.digest).unwrap().id.as_str() == "c")
        .count();
    assert!(moved > 0, "some of the new blocks were c's");
    cluster.node("c").kill_server();
    cluster.set_members(&["a", "b"], &["a", "b"]);
    let without_c = cluster.membership(&["a", "b"]);
    for block in &second {
        assert_ne!(without_c.owner(&block.digest).unwrap().id.as_str(), "c");
    }
    read_concurrently(&cluster, &["a", "b"], &second, 1);
    for block in &second {
        assert_eq!(
            cluster.origin.reads_of(&block.digest),
            1,
            "once, by its new owner"
        );
    }
    assert_eq!(
        cluster.total(&["a", "b"], |c| c.peer_failures),
        0,
        "c was not asked"
    );
    assert_eq!(cluster.total(&["a", "b"], |c| c.fallbacks_to_origin), 0);

    // Phase 3: d joins a and b; it takes over some blocks it does not hold yet.
    cluster.set_members(&["a", "b", "d"], &["a", "b", "d"]);
    let with_d = cluster.membership(&["a", "b", "d"]);
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    assert!(
        all.iter()
            .any(|b| with_d.owner(&b.digest).unwrap().id.as_str() == "d")
    );
    let reads_before = cluster.origin.block_reads();
    read_concurrently(&cluster, &["d"], &all, 1);
    let d = cluster.node("d");
    d.assert_holds(&all);
    let counters = d.delivery.counters();
    println!("d: {counters:?}");
    assert_eq!(counters.origin_fetches, 0, "d got everything from a and b");
    assert_eq!(counters.peer_fetches, all.len() as u64);
    assert_eq!(counters.bytes_verified, (all.len() * BLOCK) as u64);
    assert_eq!(cluster.origin.block_reads(), reads_before);
}

#[test]
fn a_requester_receives_the_first_bytes_before_the_owner_has_the_whole_block() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = make_blocks("stream", 8, 1024 * 1024);
    let origin = origin(&dir).slow(64 * 1024, Duration::from_millis(25));
    seed_origin(&origin, &blocks);
    let cluster = Cluster::start(&["a", "b"], origin, |_| {});
    let members = cluster.membership(&["a", "b"]);
    let block = blocks
        .iter()
        .find(|b| members.owner(&b.digest).unwrap().id.as_str() == "a")
        .expect("a owns one of 8 blocks");
    let a = cluster.node("a");

    // b asks a (the owner, which does not hold the block) and notes when bytes arrive.
    let client = PeerClient::new(
        cluster.node("b").id.clone(),
        common::secret(),
        PeerTimeouts::default(),
    );
    let mut first_byte_at = None;
    let mut received = Vec::new();
    let len = client
        .stream(
            &a.member(),
            &block.digest,
            FetchMode::AsOwner,
            &mut |piece| {
                first_byte_at.get_or_insert_with(Instant::now);
                received.extend_from_slice(piece);
                Ok(())
            },
        )
        .unwrap()
        .expect("the owner fetches the block");
    assert_eq!(len, block.bytes.len() as u64);
    assert_eq!(received, block.bytes);

    let first_byte_at = first_byte_at.unwrap();
    let origin_done_at = cluster.origin.finished_at(&block.digest).unwrap();
    assert!(
        first_byte_at < origin_done_at,
        "the first byte arrived {:?} before the owner's origin fetch ended",
        origin_done_at - first_byte_at
    );
    assert_eq!(a.delivery.counters().origin_fetches, 1);
    assert_eq!(a.delivery.counters().peer_served, 1);
    // The owner keeps the block just after the flight ends (after the body was sent).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !a.blocks.has_local(&block.digest) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    a.assert_holds(std::slice::from_ref(block));
}
