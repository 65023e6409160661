//! The peer server's edges: authentication, a peer that hangs, and requests to a node that
//! does not own the block.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::{Cluster, TestBlock, make_blocks, seed_origin};
use fastbox_artifact::{ArtifactStore, Digest, LocalStore};
use fastbox_dart::auth::sign;
use fastbox_dart::protocol::block_path;
use fastbox_dart::testkit::CountingOrigin;
use fastbox_dart::{
    BreakerConfig, DartConfig, Delivery, FetchMode, GroupSecret, Membership, NodeId, PeerClient,
    PeerError, PeerTimeouts, router,
};
use http_body_util::BodyExt;
use tower::ServiceExt;

const BLOCK: usize = 64 * 1024;

/// Node `a`, holding `held`, in front of an origin holding `at_origin`, in the group
/// `members` (no peer servers run: only `a`'s router, driven by `oneshot`, or its reads).
struct OneNode {
    _dir: tempfile::TempDir,
    origin: Arc<CountingOrigin>,
    delivery: Delivery,
}

fn one_node<S: AsRef<str>>(
    held: &[TestBlock],
    at_origin: &[TestBlock],
    members: &[S],
    tune: impl FnOnce(&mut DartConfig),
) -> OneNode {
    let dir = tempfile::tempdir().unwrap();
    let origin = CountingOrigin::new(LocalStore::open(dir.path().join("origin")).unwrap());
    seed_origin(&origin, at_origin);
    let origin = Arc::new(origin);
    let blocks = Arc::new(LocalStore::open(dir.path().join("a")).unwrap());
    for block in held {
        blocks.put_block(&block.digest, &block.bytes).unwrap();
    }
    let membership = Membership::parse(members).unwrap();
    let mut config = DartConfig::new(NodeId::try_new("a").unwrap(), membership, common::secret());
    tune(&mut config);
    let delivery = Delivery::new(config, blocks, origin.clone());
    OneNode {
        _dir: dir,
        origin,
        delivery,
    }
}

async fn get(
    node: &OneNode,
    path: &str,
    headers: &[(&'static str, String)],
) -> (StatusCode, Vec<u8>) {
    let mut request = Request::get(path);
    for (name, value) in headers {
        request = request.header(*name, value);
    }
    let response = router(node.delivery.peer_state())
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, body)
}

fn signed(secret: &GroupSecret, path: &str, at: SystemTime) -> Vec<(&'static str, String)> {
    sign(secret, &NodeId::try_new("b").unwrap(), path, at)
        .pairs()
        .iter()
        .map(|(name, value)| (*name, value.to_string()))
        .collect()
}

#[tokio::test]
async fn unsigned_forged_and_stale_requests_are_refused_with_401() {
    let blocks = make_blocks("auth", 2, BLOCK);
    let node = one_node(&blocks, &[], &["a=127.0.0.1:1"], |_| {});
    let path = block_path(&blocks[0].digest, FetchMode::LocalOnly);
    let now = SystemTime::now();

    let good = signed(&common::secret(), &path, now);
    let (status, body) = get(&node, &path, &good).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, blocks[0].bytes);

    let (status, _) = get(&node, &path, &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "no signature");

    let other_secret = GroupSecret::try_new(b"not-the-group-secret-at-all".to_vec()).unwrap();
    let forged = signed(&other_secret, &path, now);
    assert_eq!(get(&node, &path, &forged).await.0, StatusCode::UNAUTHORIZED);

    let mut tampered = good.clone();
    tampered[2].1 = format!("{}00", &tampered[2].1[..62]);
    assert_eq!(
        get(&node, &path, &tampered).await.0,
        StatusCode::UNAUTHORIZED
    );

    let stale = signed(&common::secret(), &path, now - Duration::from_secs(3600));
    let (status, body) = get(&node, &path, &stale).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "stale timestamp");
    assert!(String::from_utf8_lossy(&body).contains("clock"));

    // A valid signature moved to another block, or with `local=1` dropped, does not verify.
    let other = block_path(&blocks[1].digest, FetchMode::LocalOnly);
    assert_eq!(get(&node, &other, &good).await.0, StatusCode::UNAUTHORIZED);
    let widened = block_path(&blocks[0].digest, FetchMode::AsOwner);
    assert_eq!(
        get(&node, &widened, &good).await.0,
        StatusCode::UNAUTHORIZED
    );

    // A malformed digest is a 400 once authenticated; health needs no signature.
    let bad = "/dart/v1/blocks/not-a-digest";
    let bad_signed = signed(&common::secret(), bad, now);
    assert_eq!(
        get(&node, bad, &bad_signed).await.0,
        StatusCode::BAD_REQUEST
    );
    let (status, body) = get(&node, "/dart/v1/health", &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, br#"{"node":"a"}"#);
    assert_eq!(node.delivery.counters().peer_served, 1);
}

#[test]
fn a_peer_with_the_wrong_secret_is_refused_over_real_http_and_the_reader_falls_back() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = make_blocks("wrong-secret", 6, BLOCK);
    let origin = CountingOrigin::new(LocalStore::open(dir.path().join("origin")).unwrap());
    seed_origin(&origin, &blocks);
    let cluster = Cluster::start(&["a", "b"], origin, |_| {});
    let b = cluster.node("b");
    let owned_by_b = blocks
        .iter()
        .find(|blk| {
            cluster
                .membership(&["a", "b"])
                .owner(&blk.digest)
                .unwrap()
                .id
                == b.id
        })
        .expect("b owns one of 6 blocks");

    let intruder = PeerClient::new(
        NodeId::try_new("a").unwrap(),
        GroupSecret::try_new(b"guessed-secret-0123456789".to_vec()).unwrap(),
        PeerTimeouts::default(),
    );
    match intruder.fetch(&b.member(), &owned_by_b.digest, FetchMode::AsOwner) {
        Err(PeerError::Status { status: 401, .. }) => {}
        other => panic!("expected a 401, got {other:?}"),
    }
    assert_eq!(b.delivery.counters().peer_served, 0);
    assert_eq!(
        cluster.origin.block_reads(),
        0,
        "nothing was fetched for the intruder"
    );
}

/// A misbehaving peer: a listener that hands every connection it accepts to `handle`
/// (which may keep it open forever); counts what it accepted.
struct FakePeer {
    addr: String,
    accepted: Arc<AtomicUsize>,
}

fn fake_peer(handle: impl Fn(TcpStream) + Send + 'static) -> FakePeer {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            count.fetch_add(1, Ordering::SeqCst);
            handle(stream);
        }
    });
    FakePeer { addr, accepted }
}

/// Accepts and never answers (the connection is kept open).
fn hanging_peer() -> FakePeer {
    let held = Mutex::new(Vec::new());
    fake_peer(move |stream| held.lock().unwrap().push(stream))
}

/// Answers every request with 200 and `body`.
fn lying_peer(body: Vec<u8>) -> FakePeer {
    fake_peer(move |mut stream| {
        let mut request = [0u8; 4096];
        let _ = stream.read(&mut request);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(&body);
    })
}

/// Blocks of `members` that `owner` owns.
fn owned_by(members: &Membership, owner: &str, seed: &str, n: usize) -> Vec<TestBlock> {
    let blocks: Vec<TestBlock> = make_blocks(seed, 16 * n, BLOCK)
        .into_iter()
        .filter(|b| members.owner(&b.digest).unwrap().id.as_str() == owner)
        .take(n)
        .collect();
    assert_eq!(blocks.len(), n);
    blocks
}

#[test]
fn a_peer_sending_other_bytes_is_not_believed() {
    let liar = lying_peer(vec![0x5a; BLOCK]);
    let members = ["a=127.0.0.1:1".to_string(), format!("l={}", liar.addr)];
    let membership = Membership::parse(&members).unwrap();
    let blocks = owned_by(&membership, "l", "lies", 2);
    let node = one_node(&[], &blocks, &members, |_| {});

    for block in &blocks {
        assert_eq!(node.delivery.get_block(&block.digest).unwrap(), block.bytes);
    }
    let counters = node.delivery.counters();
    assert_eq!(liar.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(counters.peer_failures, 2);
    assert_eq!(counters.peer_fetches, 0);
    assert_eq!(counters.fallbacks_to_origin, 2);
    assert_eq!(
        counters.bytes_verified,
        (2 * BLOCK) as u64,
        "only the origin's bytes"
    );
}

#[test]
fn a_hanging_peer_is_bypassed_after_the_timeout_and_its_breaker_opens() {
    let hang = hanging_peer();
    let members = ["a=127.0.0.1:1".to_string(), format!("h={}", hang.addr)];
    let membership = Membership::parse(&members).unwrap();
    let h = NodeId::try_new("h").unwrap();
    let blocks = owned_by(&membership, "h", "hang", 6);
    let timeouts = PeerTimeouts {
        connect: Duration::from_millis(500),
        first_byte: Duration::from_millis(300),
        stall: Duration::from_millis(300),
        total: Duration::from_secs(2),
    };
    let node = one_node(&[], &blocks, &members, |config| {
        config.timeouts = timeouts;
        config.breaker = BreakerConfig {
            failures_to_open: 3,
            open_for: Duration::from_secs(600),
        };
    });

    for (i, block) in blocks.iter().enumerate() {
        let started = Instant::now();
        let got = node.delivery.get_block(&block.digest).unwrap();
        let took = started.elapsed();
        println!("read {i}: {took:?}");
        assert_eq!(got, block.bytes);
        // A hang guard, not a timing target: without the timeout this read never ends.
        assert!(
            took < timeouts.total + Duration::from_secs(5),
            "read {i} took {took:?}"
        );
    }
    let counters = node.delivery.counters();
    println!("{counters:?}");
    assert_eq!(
        hang.accepted.load(Ordering::SeqCst),
        3,
        "asked until the breaker opened, then never"
    );
    assert_eq!(counters.peer_failures, 3);
    assert_eq!(counters.breaker_trips, 1);
    assert!(node.delivery.breaker_open(&h));
    assert_eq!(counters.fallbacks_to_origin, 6);
    assert_eq!(counters.origin_fetches, 6);
    assert_eq!(counters.bytes_verified, (6 * BLOCK) as u64);
}

#[tokio::test]
async fn a_node_that_does_not_own_a_block_answers_404_without_asking_anyone() {
    let blocks = make_blocks("not-owner", 32, BLOCK);
    // In this node's view, z (an address nothing listens on) owns every block below.
    let members = ["a=127.0.0.1:1", "z=127.0.0.1:2"];
    let view = Membership::parse(&members).unwrap();
    let z = NodeId::try_new("z").unwrap();
    let block = blocks
        .iter()
        .find(|b| view.owner(&b.digest).unwrap().id == z)
        .unwrap();
    let owned = blocks
        .iter()
        .find(|b| view.owner(&b.digest).unwrap().id != z)
        .unwrap();
    let node = one_node(&[], &blocks, &members, |_| {});
    let now = SystemTime::now();

    let path = block_path(&block.digest, FetchMode::AsOwner);
    assert_eq!(
        get(&node, &path, &signed(&common::secret(), &path, now))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    let local = block_path(&owned.digest, FetchMode::LocalOnly);
    assert_eq!(
        get(&node, &local, &signed(&common::secret(), &local, now))
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        node.origin.block_reads(),
        0,
        "neither the origin nor a peer was asked"
    );

    // The block it owns is fetched from the origin for the requester, once.
    let path = block_path(&owned.digest, FetchMode::AsOwner);
    let (status, body) = get(&node, &path, &signed(&common::secret(), &path, now)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, owned.bytes);
    let (status, _) = get(&node, &path, &signed(&common::secret(), &path, now)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(node.origin.block_reads(), 1);

    // An owner whose origin lacks the block says 404, not 502.
    let missing = (0u32..)
        .map(|i| Digest::of(&i.to_le_bytes()))
        .find(|d| view.owner(d).unwrap().id != z)
        .unwrap();
    let path = block_path(&missing, FetchMode::AsOwner);
    let headers = signed(&common::secret(), &path, now);
    assert_eq!(get(&node, &path, &headers).await.0, StatusCode::NOT_FOUND);
}
