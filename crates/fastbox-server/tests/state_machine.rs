//! The lifecycle server's state machine against a fake node (`fastbox_node_api::testkit`), no
//! root needed: the table of allowed and refused transitions, every verb's happy path and node
//! failures, the reconciler, and recovery after a crash at each step.
//!
//! Each test runs one or more lives of a real `Lifecycle` over one state store and one
//! `FakeNode` ([`Harness::life`]). A life runs on a runtime of its own; ending it drops the
//! runtime with every task still running: a crash, wherever the node holds a call. The next
//! life is the restarted server over the same store, which recovers.
//!
//! Background tasks are waited for by polling the records (bounded by [`PATIENCE`]); the fake
//! node answers at once unless a test holds a verb.

use std::sync::Arc;
use std::time::Duration;

use SandboxState::{Failed, Paused, Pausing, Pending, Resuming, Running, Stopping, Terminated};
use chrono::Utc;
use fastbox_api::lifecycle::{
    CreateSandboxRequest, ImageSpec, NetworkPolicy, NetworkRule, Sandbox, SandboxState, StringMap,
};
use fastbox_api::snapshots::{ForkRequest, Snapshot, SnapshotState};
use fastbox_api::templates::{CreateTemplateRequest, TemplatePhase};
use fastbox_node_api::control::PolicyChange;
use fastbox_node_api::testkit::{
    CheckpointState, FAKE_NODE_ID, FakeNode, Origin, Restart, SlotState, Verb,
};
use fastbox_node_api::{NodeAgent, NodeError, NodeErrorKind};
use fastbox_server::config::{ServerConfig, Settings};
use fastbox_server::error::ApiError;
use fastbox_server::nodes::Nodes;
use fastbox_server::service::{EndpointQuery, Lifecycle, ListQuery, SnapshotQuery};
use fastbox_server::store::Store;
use http::StatusCode;

/// The image the fake node knows.
const IMAGE: &str = "registry.test/app:1";

/// The longest a test waits for a background task.
const PATIENCE: Duration = Duration::from_secs(10);

/// Between two looks at a record.
const STEP: Duration = Duration::from_millis(5);

/// A state store and fake nodes that outlive the server's lives.
struct Harness {
    dir: tempfile::TempDir,
    /// The first node (the only one, but in the tests of several nodes).
    fake: Arc<FakeNode>,
    /// The nodes after the first.
    others: Vec<Arc<FakeNode>>,
    tune: fn(&mut ServerConfig),
}

impl Harness {
    /// A node of `slots` slots knowing [`IMAGE`].
    fn new(slots: u32) -> Self {
        Self::tuned(slots, |_| {})
    }

    /// The same, with `tune` applied to every life's configuration.
    fn tuned(slots: u32, tune: fn(&mut ServerConfig)) -> Self {
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            fake: Arc::new(FakeNode::new(slots).with_image(IMAGE)),
            others: Vec::new(),
            tune,
        }
    }

    /// Nodes named and sized as `nodes` says, each knowing [`IMAGE`].
    fn several(nodes: &[(&str, u32)]) -> Self {
        let mut fakes = nodes
            .iter()
            .map(|(id, slots)| Arc::new(FakeNode::new(*slots).with_node_id(id).with_image(IMAGE)));
        Self {
            dir: tempfile::tempdir().expect("tempdir"),
            fake: fakes.next().expect("a node"),
            others: fakes.collect(),
            tune: |_| {},
        }
    }

    /// Every node, the first first.
    fn fakes(&self) -> Vec<Arc<FakeNode>> {
        std::iter::once(self.fake.clone())
            .chain(self.others.iter().cloned())
            .collect()
    }

    /// Node `id`.
    fn fake_named(&self, id: &str) -> Arc<FakeNode> {
        self.fakes()
            .into_iter()
            .find(|f| f.node_id() == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    fn config(&self) -> ServerConfig {
        let mut cfg = ServerConfig::resolve(Settings {
            data_dir: Some(self.dir.path().to_path_buf()),
            cache_dir: Some(self.dir.path().join("cache")),
            ..Default::default()
        })
        .expect("config");
        // A create answers once its image is resolved and its start is done; a test that
        // holds the start gets `Pending` after a moment.
        cfg.image_wait = Duration::from_secs(5);
        cfg.create_wait = Duration::from_millis(50);
        // An endpoint lookup of a sandbox that stays Pending or Resuming answers soon.
        cfg.endpoint_wait = Duration::from_millis(50);
        (self.tune)(&mut cfg);
        cfg
    }

    /// One life of the server: `body` with a fresh `Lifecycle` over the harness's store and
    /// node, on a runtime of its own. The runtime goes with the life, and every task still
    /// running with it (a crash when the node holds one).
    fn life<T>(&self, body: impl AsyncFnOnce(Arc<Lifecycle>) -> T) -> T {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let out = runtime.block_on(async {
            let store = Store::open(&self.dir.path().join("state.redb")).expect("state store");
            let keys = fastbox_proxy::RouteKeys::load_or_create(&self.dir.path().join("route-key"))
                .expect("route keys");
            let nodes = self
                .fakes()
                .into_iter()
                .map(|f| f as Arc<dyn NodeAgent>)
                .collect();
            let lc = Lifecycle::with_nodes(
                self.config(),
                store,
                Nodes::new(nodes).expect("nodes"),
                fastbox_image::ImageConfig::default(),
                keys,
            )
            .expect("lifecycle");
            body(lc).await
        });
        drop(runtime);
        out
    }

    /// A restart of the server (and of the node, which runs in it): the next life recovers
    /// as `fastbox up` does.
    fn restart(&self, node: Restart) {
        for fake in self.fakes() {
            fake.release_all();
            fake.restart(node);
            fake.clear_calls();
        }
    }

    /// Nothing broke the node protocol.
    fn assert_clean(&self) {
        for fake in self.fakes() {
            let violations = fake.violations();
            assert!(
                violations.is_empty(),
                "node {} protocol violations: {violations:#?}",
                fake.node_id()
            );
        }
    }
}

// Requests.

fn request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: IMAGE.into(),
            auth: None,
        }),
        entrypoint: Some(vec!["sleep".into(), "infinity".into()]),
        ..Default::default()
    }
}

fn from_snapshot(snapshot_id: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        snapshot_id: Some(snapshot_id.into()),
        ..Default::default()
    }
}

fn fork_of(count: u32) -> ForkRequest {
    ForkRequest {
        count,
        metadata: None,
        timeout: None,
    }
}

fn deny_but(target: &str) -> NetworkPolicy {
    NetworkPolicy {
        default_action: Some("deny".into()),
        egress: Some(vec![NetworkRule {
            action: "allow".into(),
            target: target.into(),
        }]),
    }
}

// Waiting.

/// Polls `done` until it holds (at most [`PATIENCE`]).
async fn until(what: impl std::fmt::Display, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {PATIENCE:?} for {what}"
        );
        tokio::time::sleep(STEP).await;
    }
}

/// Sandbox `id` once it is `state`.
async fn becomes(lc: &Lifecycle, id: &str, state: SandboxState) -> Sandbox {
    until(
        format!("{id} to be {state}: {:?}", lc.get(id).map(|s| s.status)),
        || lc.get(id).is_ok_and(|s| s.status.state == state),
    )
    .await;
    lc.get(id).expect("sandbox")
}

/// Sandbox `id` once it is `state`, the reconciler running meanwhile.
async fn converges(lc: &Arc<Lifecycle>, id: &str, state: SandboxState) -> Sandbox {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        lc.reconcile().await;
        let now = lc.get(id).expect("sandbox");
        if now.status.state == state {
            return now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} did not converge to {state}: {:?}",
            now.status
        );
        tokio::time::sleep(STEP).await;
    }
}

/// Snapshot `id` once it is `state`.
async fn snapshot_becomes(lc: &Lifecycle, id: &str, state: SnapshotState) -> Snapshot {
    until(
        format!(
            "snapshot {id} to be {state:?}: {:?}",
            lc.get_snapshot(id).map(|s| s.status)
        ),
        || lc.get_snapshot(id).is_ok_and(|s| s.status.state == state),
    )
    .await;
    lc.get_snapshot(id).expect("snapshot")
}

/// Returns once a call of `verb` waits at its gate.
async fn held(fake: &FakeNode, verb: Verb) {
    tokio::time::timeout(PATIENCE, fake.wait_held(verb))
        .await
        .unwrap_or_else(|_| panic!("no call of {verb:?} came to its gate"));
}

// Reaching states.

/// A new sandbox, once `Running`.
async fn running(lc: &Arc<Lifecycle>) -> String {
    let id = lc.create(request()).await.expect("create").id;
    becomes(lc, &id, Running).await;
    id
}

/// A new sandbox, once `Paused`.
async fn paused(lc: &Arc<Lifecycle>) -> String {
    let id = running(lc).await;
    lc.pause(&id).expect("pause");
    becomes(lc, &id, Paused).await;
    id
}

/// A new `Ready` snapshot of `source`.
async fn ready_snapshot(lc: &Arc<Lifecycle>, source: &str) -> String {
    let id = lc.create_snapshot(source, None).expect("snapshot").id;
    snapshot_becomes(lc, &id, SnapshotState::Ready).await;
    id
}

/// A new sandbox in `state`; the node holds the call that would move it on (`Pending`: the
/// start, `Pausing`: the pause, `Resuming`: the resume, `Stopping`: the removal).
/// Running sandbox `id` is `Pausing`, its node holding the pause.
async fn hold_in_pause(lc: &Arc<Lifecycle>, fake: &FakeNode, id: &str) {
    fake.hold(Verb::Pause);
    lc.pause(id).expect("pause");
    held(fake, Verb::Pause).await;
}

async fn in_state(lc: &Arc<Lifecycle>, fake: &FakeNode, state: SandboxState) -> String {
    let id = match state {
        Pending => {
            fake.hold(Verb::Place);
            let id = lc.create(request()).await.expect("create").id;
            held(fake, Verb::Place).await;
            id
        }
        Running => running(lc).await,
        Pausing => {
            let id = running(lc).await;
            hold_in_pause(lc, fake, &id).await;
            id
        }
        Paused => paused(lc).await,
        Resuming => {
            let id = paused(lc).await;
            fake.hold(Verb::Resume);
            lc.resume(&id).expect("resume");
            held(fake, Verb::Resume).await;
            id
        }
        Stopping => {
            let id = running(lc).await;
            fake.hold(Verb::Remove);
            lc.delete(&id).expect("delete");
            held(fake, Verb::Remove).await;
            id
        }
        Terminated => {
            let id = running(lc).await;
            lc.delete(&id).expect("delete");
            becomes(lc, &id, Terminated).await;
            id
        }
        Failed => {
            fake.fail_next(Verb::Place, NodeError::failed("injected"));
            let id = lc.create(request()).await.expect("create").id;
            becomes(lc, &id, Failed).await;
            id
        }
        other => panic!("no way to {other}"),
    };
    assert_eq!(lc.get(&id).unwrap().status.state, state);
    id
}

// Looking at the server and the node.

/// Every sandbox record.
fn sandboxes(lc: &Lifecycle) -> Vec<Sandbox> {
    let all = ListQuery {
        page: 1,
        page_size: 1000,
        ..Default::default()
    };
    lc.list(&all).items
}

/// Every snapshot record.
fn snapshots(lc: &Lifecycle) -> Vec<Snapshot> {
    let all = SnapshotQuery {
        page: 1,
        page_size: 1000,
        ..Default::default()
    };
    lc.list_snapshots(&all).items
}

/// The slot the node holds for sandbox `id` (running in it or kept for it).
fn slot_of(fake: &FakeNode, id: &str) -> Option<u32> {
    fake.slots()
        .iter()
        .position(|s| match s {
            SlotState::Sandbox { id: x, .. } | SlotState::Kept { id: x } => x == id,
            _ => false,
        })
        .map(|i| i as u32)
}

/// The key of the pause checkpoint of `id` on the node.
fn pause_key(fake: &FakeNode, id: &str) -> Option<String> {
    let prefix = format!("pause-{id}-");
    fake.checkpoints()
        .into_iter()
        .map(|c| c.key)
        .find(|k| k.starts_with(&prefix))
}

/// `expected` appear among the node's calls in this order (other calls in between).
fn assert_calls_in_order(fake: &FakeNode, expected: &[Verb]) {
    let calls = fake.calls();
    let mut rest = calls.iter();
    for verb in expected {
        assert!(
            rest.any(|c| c.verb == *verb),
            "expected {expected:?} in order; calls: {}",
            calls
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}

fn status_of<T>(result: &Result<T, ApiError>) -> StatusCode {
    match result {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status(),
    }
}

// The table of transitions.

/// What the API is asked to do to a sandbox.
#[derive(Debug, Clone, Copy)]
enum Op {
    Pause,
    Resume,
    Snapshot,
    Fork,
    Delete,
    Renew,
    Egress,
    Metadata,
    Endpoint,
}

const STATES: [SandboxState; 8] = [
    Pending, Running, Pausing, Paused, Resuming, Stopping, Terminated, Failed,
];

async fn apply(lc: &Arc<Lifecycle>, op: Op, id: &str) -> Result<(), ApiError> {
    match op {
        Op::Pause => lc.pause(id),
        Op::Resume => lc.resume(id),
        Op::Snapshot => lc.create_snapshot(id, None).map(drop),
        Op::Fork => lc.fork(id, fork_of(1)).await.map(drop),
        Op::Delete => lc.delete(id),
        Op::Renew => lc
            .renew(id, Utc::now() + chrono::Duration::hours(1))
            .map(drop),
        Op::Egress => lc
            .change_network_policy(id.into(), PolicyChange::Replace(deny_but("example.org")))
            .await
            .map(drop),
        Op::Metadata => {
            let patch = serde_json::json!({"team": "a"});
            let patch = patch.as_object().expect("an object").clone();
            lc.patch_metadata(id, patch).map(drop)
        }
        Op::Endpoint => lc
            .endpoint(id, 8080, &EndpointQuery::default())
            .await
            .map(drop),
    }
}

#[test]
fn transitions_are_allowed_or_refused_by_state() {
    const OK: StatusCode = StatusCode::OK;
    const NO: StatusCode = StatusCode::CONFLICT;
    const NOT_READY: StatusCode = StatusCode::NOT_FOUND;
    // By state:  Pending    Running Pausing Paused Resuming   Stopping Terminated Failed
    let table: [(Op, [StatusCode; 8]); 9] = [
        (Op::Pause, [NO, OK, NO, NO, NO, NO, NO, NO]),
        (Op::Resume, [NO, NO, OK, OK, NO, NO, NO, NO]),
        (Op::Snapshot, [NO, OK, NO, NO, NO, NO, NO, NO]),
        (Op::Fork, [NO, OK, NO, NO, NO, NO, NO, NO]),
        (Op::Delete, [OK, OK, OK, OK, OK, OK, OK, OK]),
        (Op::Renew, [OK, OK, OK, OK, OK, NO, NO, NO]),
        (Op::Egress, [NO, OK, NO, NO, NO, NO, NO, NO]),
        (Op::Metadata, [OK, OK, OK, OK, OK, OK, NO, NO]),
        (Op::Endpoint, [NOT_READY, OK, NO, NO, NOT_READY, NO, NO, NO]),
    ];
    for (op, expected) in table {
        for (state, want) in STATES.into_iter().zip(expected) {
            let h = Harness::new(3);
            h.life(async |lc| {
                let id = in_state(&lc, &h.fake, state).await;
                let result = apply(&lc, op, &id).await;
                assert_eq!(
                    status_of(&result),
                    want,
                    "{op:?} of a {state} sandbox: {result:?}"
                );
                let now = lc.get(&id).unwrap().status.state;
                let then = match (op, want) {
                    (_, w) if w != OK => state,
                    (Op::Pause, _) => Pausing,
                    // Accepted during a pause: it runs once the pause ends.
                    (Op::Resume, _) if state == Pausing => Pausing,
                    (Op::Resume, _) => Resuming,
                    (Op::Delete, _) if state.is_final() => state,
                    (Op::Delete, _) => Stopping,
                    _ => state,
                };
                assert_eq!(now, then, "{op:?} of a {state} sandbox: {result:?}");
            });
            h.assert_clean();
        }
    }
}

#[test]
fn a_busy_sandbox_refuses_another_operation() {
    let h = Harness::new(3);
    h.life(async |lc| {
        let id = running(&lc).await;
        h.fake.hold(Verb::StageSnapshot);
        let snapshot = lc.create_snapshot(&id, None).unwrap();
        held(&h.fake, Verb::StageSnapshot).await;
        for op in [Op::Pause, Op::Snapshot, Op::Fork] {
            let result = apply(&lc, op, &id).await;
            assert_eq!(
                status_of(&result),
                StatusCode::CONFLICT,
                "{op:?}: {result:?}"
            );
        }
        h.fake.release(Verb::StageSnapshot);
        snapshot_becomes(&lc, &snapshot.id, SnapshotState::Ready).await;
        lc.pause(&id).expect("free again");
    });
    h.assert_clean();
}

#[test]
fn delete_ends_every_state_terminated_or_failed_and_leaves_nothing_on_the_node() {
    for state in STATES {
        let h = Harness::new(3);
        h.life(async |lc| {
            let id = in_state(&lc, &h.fake, state).await;
            lc.delete(&id).unwrap();
            h.fake.release_all();
            let end = if state == Failed { Failed } else { Terminated };
            converges(&lc, &id, end).await;
            until(
                format!("the node to be empty after deleting a {state} sandbox"),
                || h.fake.free_slots() == 3 && h.fake.checkpoints().is_empty(),
            )
            .await;
        });
        h.assert_clean();
    }
}

// Creates.

#[test]
fn an_idempotency_key_makes_one_sandbox_however_often_it_is_sent() {
    let h = Harness::new(4);
    h.life(async |lc| {
        let body = br#"{"image":{"uri":"registry.test/app:1"}}"#;
        // Two attempts at once, then a retry: one sandbox, one start.
        let (first, second) = tokio::join!(
            lc.create_once(request(), "key-1", body),
            lc.create_once(request(), "key-1", body)
        );
        let (first, second) = (first.expect("first"), second.expect("second"));
        assert_eq!(first.0.id, second.0.id);
        assert_eq!(
            [first.1, second.1].iter().filter(|r| **r).count(),
            1,
            "one replayed"
        );
        let (again, replayed) = lc
            .create_once(request(), "key-1", body)
            .await
            .expect("retry");
        assert!(replayed);
        assert_eq!(again.id, first.0.id);
        becomes(&lc, &first.0.id, Running).await;
        assert_eq!(h.fake.count(Verb::Place), 1);
        assert_eq!(sandboxes(&lc).len(), 1);

        // The same key with another request is refused.
        let other = lc
            .create_once(request(), "key-1", br#"{"image":{"uri":"other"}}"#)
            .await;
        assert_eq!(status_of(&other), StatusCode::CONFLICT);
        // A bad key is a 400.
        let bad = lc.create_once(request(), "", body).await;
        assert_eq!(status_of(&bad), StatusCode::BAD_REQUEST);

        // A create that fails gives its key back: the corrected request goes through.
        let mut unknown = request();
        unknown.image.as_mut().unwrap().uri = "registry.test/unknown:1".into();
        let failed = lc.create_once(unknown, "key-2", b"unknown").await;
        assert_eq!(status_of(&failed), StatusCode::BAD_REQUEST);
        let (made, replayed) = lc
            .create_once(request(), "key-2", body)
            .await
            .expect("the corrected request");
        assert!(!replayed);
        assert_ne!(made.id, first.0.id);
    });
    h.assert_clean();
}

#[test]
fn concurrent_changes_of_one_sandbox_are_all_kept() {
    // Writes of a record run without a lock, each a compare-and-swap on the version it was
    // made from: racing writers retry on what the store has, and none is lost.
    const WRITERS: usize = 4;
    const EACH: usize = 10;
    let h = Harness::new(1);
    let id = h.life(async |lc| {
        let id = running(&lc).await;
        let threads: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (lc, id) = (lc.clone(), id.clone());
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let patch = serde_json::json!({format!("w{w}-{i}"): "x"});
                        lc.patch_metadata(&id, patch.as_object().expect("an object").clone())
                            .expect("patch");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("writer");
        }
        assert_eq!(
            lc.get(&id).expect("get").metadata.unwrap().len(),
            WRITERS * EACH
        );
        id
    });
    // And the store has them all.
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(
            lc.get(&id).expect("get").metadata.unwrap().len(),
            WRITERS * EACH
        );
    });
}

#[test]
fn a_create_starts_in_its_admitted_slot_and_runs() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let id = running(&lc).await;
        let sandbox = h.fake.sandbox(&id).expect("on the node");
        assert_eq!(sandbox.origin, Origin::Image(IMAGE.into()));
        assert_eq!(sandbox.placement.address, FakeNode::address_of(0));
        assert_eq!(lc.placements(FAKE_NODE_ID), [sandbox.placement]);
        assert_calls_in_order(
            &h.fake,
            &[
                Verb::CheckImage,
                Verb::Admit,
                Verb::ResolveImage,
                Verb::Place,
            ],
        );
        assert_eq!(h.fake.calls_of(Verb::Place)[0].slot, Some(0));
    });
    h.assert_clean();
}

#[test]
fn a_failed_start_is_failed_start_failed_and_frees_its_slot() {
    let h = Harness::new(1);
    h.life(async |lc| {
        h.fake
            .fail_next(Verb::Place, NodeError::failed("restore failed"));
        let id = lc.create(request()).await.expect("create").id;
        let sandbox = becomes(&lc, &id, Failed).await;
        assert_eq!(sandbox.status.reason.as_deref(), Some("START_FAILED"));
        assert!(sandbox.status.message.unwrap().contains("restore failed"));
        until("the slot to be free", || h.fake.free_slots() == 1).await;
        let removes = h.fake.calls_of(Verb::Remove);
        assert_eq!(removes.len(), 1, "{removes:?}");
        assert_eq!(
            (removes[0].id.as_deref(), removes[0].slot),
            (Some(id.as_str()), Some(0))
        );
        // The next create gets the slot.
        running(&lc).await;
    });
    h.assert_clean();
}

#[test]
fn an_unknown_image_is_a_400_and_leaves_nothing() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let mut req = request();
        req.image.as_mut().unwrap().uri = "registry.test/missing:1".into();
        let e = lc.create(req).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{e}");
        assert_eq!(e.code(), "SANDBOX::INVALID_PARAMETER");
        assert!(sandboxes(&lc).is_empty());
        assert_eq!(h.fake.free_slots(), 1);
        assert_eq!(h.fake.count(Verb::ReleaseSlot), 1);
        assert_eq!(h.fake.count(Verb::Place), 0);
    });
    h.assert_clean();
}

#[test]
fn a_malformed_image_is_refused_before_admission() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let mut req = request();
        req.image.as_mut().unwrap().uri = "not an image".into();
        let e = lc.create(req).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{e}");
        assert_eq!(h.fake.count(Verb::Admit), 0);
    });
    h.assert_clean();
}

#[test]
fn a_full_node_is_a_429_and_records_nothing() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let first = running(&lc).await;
        let e = lc.create(request()).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS, "{e}");
        assert_eq!(e.code(), "SANDBOX::CAPACITY_EXHAUSTED");
        let ids: Vec<String> = sandboxes(&lc).into_iter().map(|s| s.id).collect();
        assert_eq!(ids, [first]);
    });
    h.assert_clean();
}

#[test]
fn an_unreachable_node_is_a_503() {
    let h = Harness::new(1);
    h.life(async |lc| {
        h.fake.fail_next(
            Verb::Admit,
            NodeError::new(NodeErrorKind::Unreachable, "no answer"),
        );
        let e = lc.create(request()).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE, "{e}");
        assert!(sandboxes(&lc).is_empty());
    });
    h.assert_clean();
}

#[test]
fn a_pool_claim_releases_the_admitted_slot() {
    let h = Harness::new(2);
    h.fake.fill_pool(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        let sandbox = h.fake.sandbox(&id).unwrap();
        assert_eq!(sandbox.origin, Origin::Pool);
        assert_eq!(sandbox.placement.slot, 0, "the pooled sandbox's slot");
        let released: Vec<_> = h
            .fake
            .calls_of(Verb::ReleaseSlot)
            .iter()
            .map(|c| c.slot)
            .collect();
        assert_eq!(released, [Some(1)], "the admitted slot goes back");
        assert_eq!(h.fake.slot(1), SlotState::Free);
        // Removal frees the slot it runs in.
        lc.delete(&id).unwrap();
        becomes(&lc, &id, Terminated).await;
        assert_eq!(h.fake.free_slots(), 2);
    });
    h.assert_clean();
}

#[test]
fn pool_off_restores_into_the_admitted_slot() {
    let h = Harness::new(2);
    h.fake.fill_pool(1);
    h.life(async |lc| {
        let mut req = request();
        req.extensions = Some(StringMap::from([("fastbox.io/pool".into(), "off".into())]));
        let id = lc.create(req).await.unwrap().id;
        becomes(&lc, &id, Running).await;
        let sandbox = h.fake.sandbox(&id).unwrap();
        assert_eq!(
            (sandbox.origin, sandbox.placement.slot),
            (Origin::Image(IMAGE.into()), 1)
        );
    });
    h.assert_clean();
}

#[test]
fn an_image_failing_after_the_wait_fails_the_sandbox() {
    let h = Harness::tuned(1, |cfg| cfg.image_wait = Duration::from_millis(20));
    h.life(async |lc| {
        h.fake.hold(Verb::ResolveImage);
        let created = lc.create(request()).await.expect("answered Pending");
        assert_eq!(created.status.state, Pending);
        h.fake.fail_next(
            Verb::ResolveImage,
            NodeError::new(NodeErrorKind::BadImage, "gone"),
        );
        h.fake.release(Verb::ResolveImage);
        let failed = becomes(&lc, &created.id, Failed).await;
        assert_eq!(
            failed.status.reason.as_deref(),
            Some("IMAGE_RESOLUTION_FAILED")
        );
        until("the slot to be free", || h.fake.free_slots() == 1).await;
    });
    h.assert_clean();
}

#[test]
fn get_of_an_unknown_sandbox_is_a_404() {
    let h = Harness::new(1);
    h.life(async |lc| {
        for result in [
            lc.get("nope").map(drop),
            lc.delete("nope"),
            lc.pause("nope"),
            lc.resume("nope"),
        ] {
            assert_eq!(status_of(&result), StatusCode::NOT_FOUND, "{result:?}");
        }
    });
}

// Deletes.

#[test]
fn delete_removes_the_sandbox_and_frees_its_slot() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        let placement = h.fake.sandbox(&id).unwrap().placement;
        lc.delete(&id).unwrap();
        let gone = becomes(&lc, &id, Terminated).await;
        assert_eq!(gone.status.reason, None);
        let removes = h.fake.calls_of(Verb::Remove);
        assert_eq!(removes.len(), 1);
        assert_eq!(removes[0].slot, Some(placement.slot));
        assert!(h.fake.sandbox(&id).is_none());
        assert_eq!(h.fake.free_slots(), 1);
        assert!(lc.placements(FAKE_NODE_ID).is_empty());
        // Deleting again changes nothing.
        lc.delete(&id).unwrap();
        lc.reconcile().await;
        assert_eq!(h.fake.count(Verb::Remove), 1);
    });
    h.assert_clean();
}

#[test]
fn a_failed_removal_stays_stopping_and_the_reconciler_retries_it() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        h.fake
            .fail_next(Verb::Remove, NodeError::failed("busy mount"));
        lc.delete(&id).unwrap();
        until("the removal to be tried", || {
            h.fake.count(Verb::Remove) == 1
        })
        .await;
        until("the failure to be recorded", || {
            lc.diagnostics_events(&id, "all")
                .unwrap()
                .content
                .unwrap()
                .contains("RemoveFailed")
        })
        .await;
        assert_eq!(lc.get(&id).unwrap().status.state, Stopping);
        converges(&lc, &id, Terminated).await;
        assert_eq!(h.fake.count(Verb::Remove), 2);
        assert_eq!(h.fake.free_slots(), 1);
    });
    h.assert_clean();
}

#[test]
fn a_create_failing_after_its_delete_ends_terminated() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = in_state(&lc, &h.fake, Pending).await;
        lc.delete(&id).unwrap();
        h.fake
            .fail_next(Verb::Place, NodeError::failed("restore failed"));
        h.fake.release(Verb::Place);
        until("the start to end", || h.fake.count(Verb::Remove) == 1).await;
        let end = converges(&lc, &id, Terminated).await;
        assert_eq!(end.status.reason, None);
    });
}

// Pause and resume.

#[test]
fn pause_commits_a_checkpoint_and_keeps_the_slot() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let id = running(&lc).await;
        let before = h.fake.sandbox(&id).unwrap().placement;
        h.fake.hold(Verb::Pause);
        lc.pause(&id).unwrap();
        assert_eq!(lc.get(&id).unwrap().status.state, Pausing);
        held(&h.fake, Verb::Pause).await;
        assert_eq!(lc.get(&id).unwrap().status.state, Pausing);
        h.fake.release(Verb::Pause);
        becomes(&lc, &id, Paused).await;
        let key = pause_key(&h.fake, &id).expect("a pause checkpoint");
        assert_eq!(
            h.fake.checkpoint(&key).unwrap().state,
            CheckpointState::Committed
        );
        assert_eq!(h.fake.slot(before.slot), SlotState::Kept { id: id.clone() });
        assert!(h.fake.sandbox(&id).is_none(), "its processes are gone");
        assert!(lc.placements(FAKE_NODE_ID).is_empty());
        // The kept slot is not handed out.
        let other = running(&lc).await;
        assert_ne!(h.fake.sandbox(&other).unwrap().placement.slot, before.slot);
    });
    h.assert_clean();
}

#[test]
fn a_failed_pause_of_a_live_sandbox_leaves_it_running() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        h.fake
            .fail_next(Verb::Pause, NodeError::failed("criu dump failed"));
        lc.pause(&id).unwrap();
        let back = becomes(&lc, &id, Running).await;
        assert_eq!(back.status.reason.as_deref(), Some("PAUSE_FAILED"));
        assert!(h.fake.sandbox(&id).unwrap().alive);
        assert!(h.fake.checkpoints().is_empty());
        assert_eq!(h.fake.count(Verb::Remove), 0);
        // It can be paused again.
        lc.pause(&id).unwrap();
        becomes(&lc, &id, Paused).await;
    });
    h.assert_clean();
}

#[test]
fn a_failed_pause_whose_processes_are_gone_fails_the_sandbox() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        h.fake.hold(Verb::Pause);
        lc.pause(&id).unwrap();
        held(&h.fake, Verb::Pause).await;
        h.fake.kill(&id);
        h.fake.release(Verb::Pause);
        let failed = becomes(&lc, &id, Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("PROCESS_LOST"));
        until("the slot to be free", || h.fake.free_slots() == 1).await;
        assert!(h.fake.sandbox(&id).is_none());
        let removed: Vec<_> = h
            .fake
            .calls_of(Verb::RemoveSnapshot)
            .into_iter()
            .map(|c| c.key)
            .collect();
        assert_eq!(
            removed.len(),
            1,
            "its checkpoint name is dropped: {removed:?}"
        );
        assert!(
            removed[0]
                .as_ref()
                .unwrap()
                .starts_with(&format!("pause-{id}-"))
        );
    });
    h.assert_clean();
}

#[test]
fn resume_restores_into_the_kept_slot_and_drops_the_checkpoint() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let id = running(&lc).await;
        let before = h.fake.sandbox(&id).unwrap().placement;
        lc.pause(&id).unwrap();
        becomes(&lc, &id, Paused).await;
        let key = pause_key(&h.fake, &id).unwrap();
        h.fake.hold(Verb::Resume);
        lc.resume(&id).unwrap();
        held(&h.fake, Verb::Resume).await;
        assert_eq!(lc.get(&id).unwrap().status.state, Resuming);
        h.fake.release(Verb::Resume);
        becomes(&lc, &id, Running).await;
        let after = h.fake.sandbox(&id).unwrap();
        assert_eq!(after.origin, Origin::Resume(key.clone()));
        assert_eq!(
            (after.placement.slot, after.placement.address),
            (before.slot, before.address)
        );
        assert_ne!(after.placement.handle, before.handle);
        assert_eq!(lc.placements(FAKE_NODE_ID), [after.placement]);
        until("the checkpoint to go", || h.fake.checkpoint(&key).is_none()).await;
    });
    h.assert_clean();
}

#[test]
fn an_endpoint_lookup_waits_for_a_resume_to_end() {
    let h = Harness::tuned(1, |cfg| cfg.endpoint_wait = Duration::from_secs(30));
    h.life(async |lc| {
        let id = paused(&lc).await;
        h.fake.hold(Verb::Resume);
        lc.resume(&id).unwrap();
        held(&h.fake, Verb::Resume).await;
        // Asked while Resuming (as an SDK does right after its resume call): it waits.
        let lookup = tokio::spawn({
            let (lc, id) = (lc.clone(), id.clone());
            async move { lc.endpoint(&id, 8080, &EndpointQuery::default()).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!lookup.is_finished(), "answered while Resuming");
        h.fake.release(Verb::Resume);
        let endpoint = lookup.await.unwrap().expect("the endpoint once it runs");
        assert!(endpoint.endpoint.contains("8080"), "{endpoint:?}");
        assert_eq!(lc.get(&id).unwrap().status.state, Running);
    });
    h.assert_clean();
}

#[test]
fn a_resume_asked_during_its_pause_runs_once_the_pause_ends() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        hold_in_pause(&lc, &h.fake, &id).await;
        lc.resume(&id)
            .expect("a resume during the pause is accepted");
        lc.resume(&id).expect("and asking twice is the same");
        assert_eq!(lc.get(&id).unwrap().status.state, Pausing);
        assert_eq!(h.fake.count(Verb::Resume), 0);
        h.fake.release(Verb::Pause);
        becomes(&lc, &id, Running).await;
        assert_eq!(h.fake.count(Verb::Resume), 1, "{:?}", h.fake.calls());
        let events = lc.diagnostics_events(&id, "all").unwrap().content.unwrap();
        assert!(events.contains("ResumeRequested"), "{events}");
        assert!(events.contains("Paused"), "{events}");

        // A pause that fails leaves it running: the resume asked meanwhile is dropped.
        hold_in_pause(&lc, &h.fake, &id).await;
        lc.resume(&id).unwrap();
        // (An injected failure is taken after the gate: the held call fails.)
        h.fake.fail_next(Verb::Pause, NodeError::failed("injected"));
        h.fake.release(Verb::Pause);
        becomes(&lc, &id, Running).await;
        lc.reconcile().await;
        assert_eq!(h.fake.count(Verb::Resume), 1, "{:?}", h.fake.calls());
        assert_eq!(lc.get(&id).unwrap().status.state, Running);
    });
    h.assert_clean();
}

#[test]
fn a_failed_resume_leaves_it_paused_with_its_checkpoint() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        h.fake
            .fail_next(Verb::Resume, NodeError::failed("criu restore failed"));
        lc.resume(&id).unwrap();
        let back = becomes(&lc, &id, Paused).await;
        assert_eq!(back.status.reason.as_deref(), Some("RESUME_FAILED"));
        assert!(h.fake.checkpoint(&key).is_some());
        assert_eq!(h.fake.slot(0), SlotState::Kept { id: id.clone() });
        // And it resumes on a second try.
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
        assert_eq!(h.fake.sandbox(&id).unwrap().origin, Origin::Resume(key));
    });
    h.assert_clean();
}

#[test]
fn deleting_a_paused_sandbox_removes_its_checkpoint_and_slot() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        lc.delete(&id).unwrap();
        becomes(&lc, &id, Terminated).await;
        assert!(h.fake.checkpoint(&key).is_none());
        assert_eq!(h.fake.slot(0), SlotState::Free);
    });
    h.assert_clean();
}

// Snapshots and forks.

#[test]
fn a_snapshot_is_staged_then_committed_and_the_source_runs_on() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        h.fake.hold(Verb::CommitSnapshot);
        let snapshot = lc.create_snapshot(&id, Some("first".into())).unwrap();
        assert_eq!(snapshot.status.state, SnapshotState::Creating);
        held(&h.fake, Verb::CommitSnapshot).await;
        assert_eq!(
            h.fake.checkpoint(&snapshot.id).unwrap().state,
            CheckpointState::Staged
        );
        assert_eq!(
            lc.get_snapshot(&snapshot.id).unwrap().status.state,
            SnapshotState::Creating
        );
        h.fake.release(Verb::CommitSnapshot);
        snapshot_becomes(&lc, &snapshot.id, SnapshotState::Ready).await;
        assert_eq!(
            h.fake.checkpoint(&snapshot.id).unwrap().state,
            CheckpointState::Committed
        );
        assert_eq!(lc.get(&id).unwrap().status.state, Running);
        assert!(h.fake.sandbox(&id).unwrap().alive);
        assert_calls_in_order(&h.fake, &[Verb::StageSnapshot, Verb::CommitSnapshot]);
    });
    h.assert_clean();
}

#[test]
fn a_failed_snapshot_is_failed_and_the_source_runs_on() {
    for verb in [Verb::StageSnapshot, Verb::CommitSnapshot] {
        let h = Harness::new(1);
        h.life(async |lc| {
            let id = running(&lc).await;
            h.fake.fail_next(verb, NodeError::failed("dump failed"));
            let snapshot = lc.create_snapshot(&id, None).unwrap();
            let failed = snapshot_becomes(&lc, &snapshot.id, SnapshotState::Failed).await;
            assert_eq!(
                failed.status.reason.as_deref(),
                Some("SNAPSHOT_FAILED"),
                "{verb:?}"
            );
            assert_eq!(lc.get(&id).unwrap().status.state, Running, "{verb:?}");
            // The source is free for the next operation.
            ready_snapshot(&lc, &id).await;
        });
        h.assert_clean();
    }
}

#[test]
fn a_sandbox_created_from_a_snapshot_is_a_clone() {
    let h = Harness::new(3);
    h.life(async |lc| {
        let source = running(&lc).await;
        let snapshot = ready_snapshot(&lc, &source).await;
        let clone = lc.create(from_snapshot(&snapshot)).await.unwrap();
        assert_eq!(clone.snapshot_id.as_deref(), Some(snapshot.as_str()));
        becomes(&lc, &clone.id, Running).await;
        assert_eq!(
            h.fake.sandbox(&clone.id).unwrap().origin,
            Origin::Clone(snapshot.clone())
        );
        // Unknown: 404; not Ready: 409.
        let e = lc.create(from_snapshot("snap_nope")).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::NOT_FOUND, "{e}");
        h.fake
            .fail_next(Verb::StageSnapshot, NodeError::failed("dump failed"));
        let failed = lc.create_snapshot(&source, None).unwrap().id;
        snapshot_becomes(&lc, &failed, SnapshotState::Failed).await;
        let e = lc.create(from_snapshot(&failed)).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::CONFLICT, "{e}");
        // A clone that fails to restore is Failed and frees its slot.
        h.fake
            .fail_next(Verb::CloneSnapshot, NodeError::failed("restore failed"));
        let broken = lc.create(from_snapshot(&snapshot)).await.unwrap().id;
        let broken = becomes(&lc, &broken, Failed).await;
        assert_eq!(broken.status.reason.as_deref(), Some("START_FAILED"));
        until("its slot to be free", || h.fake.free_slots() == 1).await;
    });
    h.assert_clean();
}

#[test]
fn a_fork_restores_its_clones_from_the_staged_dump_before_the_commit() {
    let h = Harness::new(3);
    h.life(async |lc| {
        let source = running(&lc).await;
        h.fake.hold(Verb::CommitSnapshot);
        let fork = lc.fork(&source, fork_of(2)).await.unwrap();
        assert_eq!(fork.items.len(), 2);
        for clone in &fork.items {
            becomes(&lc, &clone.id, Running).await;
            let sandbox = h.fake.sandbox(&clone.id).unwrap();
            assert_eq!(sandbox.origin, Origin::Clone(fork.snapshot_id.clone()));
        }
        held(&h.fake, Verb::CommitSnapshot).await;
        assert_eq!(
            lc.get_snapshot(&fork.snapshot_id).unwrap().status.state,
            SnapshotState::Creating
        );
        h.fake.release(Verb::CommitSnapshot);
        snapshot_becomes(&lc, &fork.snapshot_id, SnapshotState::Ready).await;
        assert_calls_in_order(
            &h.fake,
            &[
                Verb::StageSnapshot,
                Verb::CloneSnapshot,
                Verb::CloneSnapshot,
                Verb::CommitSnapshot,
            ],
        );
        assert_eq!(h.fake.free_slots(), 0);
    });
    h.assert_clean();
}

#[test]
fn a_fork_on_a_full_node_is_a_429_and_undoes_its_clones() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let source = running(&lc).await;
        let e = lc.fork(&source, fork_of(2)).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS, "{e}");
        // The one clone recorded is Failed and its slot free again; the snapshot is Failed.
        let items = sandboxes(&lc);
        let clones: Vec<_> = items.iter().filter(|s| s.id != source).collect();
        assert_eq!(clones.len(), 1, "{items:?}");
        assert_eq!(clones[0].status.state, Failed);
        assert_eq!(clones[0].status.reason.as_deref(), Some("START_FAILED"));
        let snapshots = snapshots(&lc);
        assert_eq!(snapshots.len(), 1);
        assert_eq!(snapshots[0].status.state, SnapshotState::Failed);
        assert_eq!(h.fake.free_slots(), 1);
        assert_eq!(h.fake.count(Verb::StageSnapshot), 0);
        // The source is free again.
        lc.pause(&source).unwrap();
    });
    h.assert_clean();
}

#[test]
fn a_fork_whose_dump_fails_fails_its_clones() {
    let h = Harness::new(3);
    h.life(async |lc| {
        let source = running(&lc).await;
        h.fake
            .fail_next(Verb::StageSnapshot, NodeError::failed("dump failed"));
        let fork = lc.fork(&source, fork_of(2)).await.unwrap();
        for clone in &fork.items {
            let failed = becomes(&lc, &clone.id, Failed).await;
            assert_eq!(failed.status.reason.as_deref(), Some("START_FAILED"));
        }
        snapshot_becomes(&lc, &fork.snapshot_id, SnapshotState::Failed).await;
        until("the clones' slots to be free", || h.fake.free_slots() == 2).await;
        assert_eq!(h.fake.count(Verb::CloneSnapshot), 0);
        assert_eq!(lc.get(&source).unwrap().status.state, Running);
    });
    h.assert_clean();
}

#[test]
fn fork_counts_are_bounded() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let source = running(&lc).await;
        for count in [0, fastbox_server::service::MAX_FORK + 1] {
            let e = lc.fork(&source, fork_of(count)).await.unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{count}: {e}");
        }
        assert!(snapshots(&lc).is_empty());
    });
}

#[test]
fn deleting_a_snapshot_removes_it_but_not_while_it_is_taken() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let source = running(&lc).await;
        let snapshot = ready_snapshot(&lc, &source).await;
        let clone = lc.create(from_snapshot(&snapshot)).await.unwrap().id;
        becomes(&lc, &clone, Running).await;
        lc.delete_snapshot(&snapshot).await.unwrap();
        assert_eq!(
            lc.get_snapshot(&snapshot).unwrap_err().status(),
            StatusCode::NOT_FOUND
        );
        assert!(h.fake.checkpoint(&snapshot).is_none());
        assert_eq!(
            lc.get(&clone).unwrap().status.state,
            Running,
            "clones run on"
        );

        h.fake.hold(Verb::StageSnapshot);
        let taking = lc.create_snapshot(&source, None).unwrap().id;
        let e = lc.delete_snapshot(&taking).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::CONFLICT, "{e}");
        h.fake.release(Verb::StageSnapshot);
        snapshot_becomes(&lc, &taking, SnapshotState::Ready).await;

        h.fake
            .fail_next(Verb::RemoveSnapshot, NodeError::failed("busy"));
        let e = lc.delete_snapshot(&taking).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR, "{e}");
        assert_eq!(
            lc.get_snapshot(&taking).unwrap().status.state,
            SnapshotState::Deleting
        );
    });
    h.assert_clean();
}

// Egress policy and renewal.

#[test]
fn an_egress_change_is_applied_on_the_node_then_recorded() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        let answer = lc
            .change_network_policy(id.clone(), PolicyChange::Replace(deny_but("example.org")))
            .await
            .unwrap();
        assert_eq!(answer.mode.as_deref(), Some("enforcing"));
        let on_node = h.fake.sandbox(&id).unwrap().policy;
        assert_eq!(on_node.to_wire(), deny_but("example.org"));
        assert_eq!(
            lc.network_policy(&id).unwrap().policy,
            Some(deny_but("example.org"))
        );

        // The node refuses (its sandbox is not there): 409, nothing recorded.
        h.fake
            .fail_next(Verb::SetEgressPolicy, NodeError::not_found("not here"));
        let e = lc
            .change_network_policy(id.clone(), PolicyChange::Replace(NetworkPolicy::default()))
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::CONFLICT, "{e}");
        // The node fails: 500, nothing recorded.
        h.fake
            .fail_next(Verb::SetEgressPolicy, NodeError::failed("nft failed"));
        let e = lc
            .change_network_policy(id.clone(), PolicyChange::Replace(NetworkPolicy::default()))
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR, "{e}");
        assert_eq!(
            lc.network_policy(&id).unwrap().policy,
            Some(deny_but("example.org"))
        );
        // A bad policy never reaches the node.
        let calls = h.fake.count(Verb::SetEgressPolicy);
        let e = lc
            .change_network_policy(id.clone(), PolicyChange::Patch(vec![]))
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{e}");
        assert_eq!(h.fake.count(Verb::SetEgressPolicy), calls);
    });
    h.assert_clean();
}

#[test]
fn renew_moves_the_expiry_and_refuses_the_past() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        let at = Utc::now() + chrono::Duration::hours(2);
        assert_eq!(lc.renew(&id, at).unwrap(), at);
        assert_eq!(lc.get(&id).unwrap().expires_at, Some(at));
        let e = lc
            .renew(&id, Utc::now() - chrono::Duration::seconds(1))
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST, "{e}");
        assert_eq!(lc.get(&id).unwrap().expires_at, Some(at));
    });
}

// The reconciler.

#[test]
fn the_reconciler_fails_sandboxes_whose_processes_are_gone() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        lc.reconcile().await;
        assert_eq!(
            lc.get(&id).unwrap().status.state,
            Running,
            "alive: left alone"
        );
        h.fake.kill(&id);
        let failed = converges(&lc, &id, Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("PROCESS_LOST"));
        until("the slot to be free", || h.fake.free_slots() == 1).await;
        assert!(lc.placements(FAKE_NODE_ID).is_empty());
        assert_eq!(h.fake.count(Verb::Remove), 1);
    });
    h.assert_clean();
}

#[test]
fn the_reconciler_stops_expired_sandboxes() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = running(&lc).await;
        lc.renew(&id, Utc::now() + chrono::Duration::milliseconds(100))
            .unwrap();
        h.fake.hold(Verb::Remove);
        let stopping = converges(&lc, &id, Stopping).await;
        assert_eq!(stopping.status.reason.as_deref(), Some("EXPIRED"));
        held(&h.fake, Verb::Remove).await;
        h.fake.release(Verb::Remove);
        becomes(&lc, &id, Terminated).await;
        assert_eq!(h.fake.free_slots(), 1);
    });
    h.assert_clean();
}

#[test]
fn an_expired_paused_sandbox_loses_its_checkpoint_and_slot() {
    let h = Harness::new(1);
    h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        lc.renew(&id, Utc::now() + chrono::Duration::milliseconds(100))
            .unwrap();
        converges(&lc, &id, Terminated).await;
        assert!(h.fake.checkpoint(&key).is_none());
        assert_eq!(h.fake.slot(0), SlotState::Free);
    });
    h.assert_clean();
}

#[test]
fn the_reconciler_forgets_final_records_after_the_retention() {
    let h = Harness::tuned(1, |cfg| cfg.retention = Duration::ZERO);
    h.life(async |lc| {
        let id = running(&lc).await;
        lc.delete(&id).unwrap();
        becomes(&lc, &id, Terminated).await;
        lc.reconcile().await;
        assert_eq!(lc.get(&id).unwrap_err().status(), StatusCode::NOT_FOUND);
    });
    h.assert_clean();
}

// Recovery after a crash.

#[test]
fn recovery_readopts_running_sandboxes() {
    let h = Harness::new(2);
    let (id, placement) = h.life(async |lc| {
        let id = running(&lc).await;
        lc.change_network_policy(id.clone(), PolicyChange::Replace(deny_but("example.org")))
            .await
            .unwrap();
        (id.clone(), h.fake.sandbox(&id).unwrap().placement)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (1, 0, 0));
        lc.recover_snapshots().await;
        assert_eq!(lc.get(&id).unwrap().status.state, Running);
        assert_eq!(
            lc.placements(FAKE_NODE_ID),
            std::slice::from_ref(&placement)
        );
        let adopts = h.fake.calls_of(Verb::Adopt);
        assert_eq!(adopts.len(), 1);
        assert_eq!(adopts[0].id.as_deref(), Some(id.as_str()));
        // The recorded policy is applied again.
        assert_eq!(
            h.fake.sandbox(&id).unwrap().policy.to_wire(),
            deny_but("example.org")
        );
        // Its slot is not handed out again.
        let other = running(&lc).await;
        assert_ne!(
            h.fake.sandbox(&other).unwrap().placement.slot,
            placement.slot
        );
    });
    h.assert_clean();
}

#[test]
fn recovery_fails_running_sandboxes_whose_processes_are_gone() {
    let h = Harness::new(1);
    let id = h.life(async |lc| running(&lc).await);
    h.restart(Restart::LoseSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 1, 0));
        let failed = becomes(&lc, &id, Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("PROCESS_LOST"));
        until("its slot to be removed", || h.fake.count(Verb::Remove) == 1).await;
        until("its slot to be free", || h.fake.free_slots() == 1).await;
        running(&lc).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_restarts_a_create_interrupted_before_its_start() {
    let h = Harness::new(2);
    let id = h.life(async |lc| in_state(&lc, &h.fake, Pending).await);
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 1));
        lc.recover_snapshots().await;
        becomes(&lc, &id, Running).await;
        assert_calls_in_order(
            &h.fake,
            &[
                Verb::ClaimSlot,
                Verb::ReleaseKeepingAddress,
                Verb::ResolveImage,
                Verb::Place,
            ],
        );
        assert_eq!(
            h.fake.calls_of(Verb::Place)[0].slot,
            Some(0),
            "the recorded slot"
        );
        assert_eq!(h.fake.sandbox(&id).unwrap().placement.slot, 0);
        let events = lc.diagnostics_events(&id, "all").unwrap().content.unwrap();
        assert!(events.contains("CreateRestarted"), "{events}");
    });
    h.assert_clean();
}

#[test]
fn recovery_restarts_a_create_interrupted_after_its_start() {
    let h = Harness::new(2);
    let (id, first) = h.life(async |lc| {
        h.fake.hold_after(Verb::Place);
        let id = lc.create(request()).await.unwrap().id;
        held(&h.fake, Verb::Place).await;
        let first = h
            .fake
            .sandbox(&id)
            .expect("started, not recorded")
            .placement;
        (id, first)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        becomes(&lc, &id, Running).await;
        let all: Vec<_> = h
            .fake
            .sandboxes()
            .into_iter()
            .filter(|s| s.id == id)
            .collect();
        assert_eq!(all.len(), 1, "the interrupted start is removed: {all:?}");
        assert_ne!(all[0].placement.handle, first.handle);
        assert_eq!(all[0].placement.slot, first.slot);
        assert_eq!(lc.placements(FAKE_NODE_ID), [all[0].placement.clone()]);
    });
    h.assert_clean();
}

#[test]
fn recovery_restarts_a_create_interrupted_while_its_image_resolves() {
    let h = Harness::tuned(2, |cfg| cfg.image_wait = Duration::from_millis(20));
    let id = h.life(async |lc| {
        h.fake.hold(Verb::ResolveImage);
        let created = lc.create(request()).await.unwrap();
        held(&h.fake, Verb::ResolveImage).await;
        created.id
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 1));
        becomes(&lc, &id, Running).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_pauses_again_when_the_dump_did_not_happen() {
    let h = Harness::new(2);
    let id = h.life(async |lc| in_state(&lc, &h.fake, Pausing).await);
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 1));
        becomes(&lc, &id, Paused).await;
        assert_calls_in_order(&h.fake, &[Verb::FinishInterruptedPause, Verb::Pause]);
        let key = pause_key(&h.fake, &id).expect("committed now");
        assert_eq!(
            h.fake.calls_of(Verb::Pause)[0].key.as_deref(),
            Some(key.as_str())
        );
        assert_eq!(slot_of(&h.fake, &id), Some(0));
        // And it resumes.
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_finishes_a_pause_whose_checkpoint_was_committed() {
    let h = Harness::new(2);
    let id = h.life(async |lc| {
        let id = running(&lc).await;
        h.fake.hold_after(Verb::Pause);
        lc.pause(&id).unwrap();
        held(&h.fake, Verb::Pause).await;
        id
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        let paused = becomes(&lc, &id, Paused).await;
        assert!(paused.status.message.unwrap().contains("after a restart"));
        assert_eq!(h.fake.count(Verb::Pause), 0, "not dumped twice");
        assert_eq!(h.fake.count(Verb::ReleaseKeepingAddress), 1);
        assert_eq!(h.fake.slot(0), SlotState::Kept { id: id.clone() });
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_fails_a_pause_whose_processes_are_gone() {
    let h = Harness::new(1);
    let id = h.life(async |lc| in_state(&lc, &h.fake, Pausing).await);
    h.restart(Restart::LoseSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        let failed = becomes(&lc, &id, Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("PROCESS_LOST"));
        until("its slot to be free", || h.fake.free_slots() == 1).await;
        let removed = h.fake.calls_of(Verb::RemoveSnapshot);
        assert!(
            removed
                .iter()
                .all(|c| c.key.as_deref().is_some_and(|k| k.starts_with("pause-"))),
            "{removed:?}"
        );
        assert!(!removed.is_empty());
        assert!(h.fake.checkpoints().is_empty());
    });
    h.assert_clean();
}

#[test]
fn recovery_resumes_again_when_the_restore_did_not_happen() {
    let h = Harness::new(2);
    let (id, key) = h.life(async |lc| {
        let id = in_state(&lc, &h.fake, Resuming).await;
        (id.clone(), pause_key(&h.fake, &id).unwrap())
    });
    h.restart(Restart::KeepSandboxes);
    assert_eq!(
        h.fake.slot(0),
        SlotState::Free,
        "the node forgot the kept slot"
    );
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 1));
        becomes(&lc, &id, Running).await;
        assert_calls_in_order(
            &h.fake,
            &[Verb::ClaimSlot, Verb::ReleaseKeepingAddress, Verb::Resume],
        );
        let sandbox = h.fake.sandbox(&id).unwrap();
        assert_eq!(
            (sandbox.origin, sandbox.placement.slot),
            (Origin::Resume(key.clone()), 0)
        );
        until("the checkpoint to go", || h.fake.checkpoint(&key).is_none()).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_resumes_again_when_the_restore_was_not_recorded() {
    let h = Harness::new(2);
    let (id, first) = h.life(async |lc| {
        let id = paused(&lc).await;
        h.fake.hold_after(Verb::Resume);
        lc.resume(&id).unwrap();
        held(&h.fake, Verb::Resume).await;
        let first = h
            .fake
            .sandbox(&id)
            .expect("restored, not recorded")
            .placement;
        (id, first)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        becomes(&lc, &id, Running).await;
        let all: Vec<_> = h
            .fake
            .sandboxes()
            .into_iter()
            .filter(|s| s.id == id)
            .collect();
        assert_eq!(all.len(), 1, "{all:?}");
        assert_ne!(all[0].placement.handle, first.handle);
        assert_eq!(all[0].placement.address, first.address);
    });
    h.assert_clean();
}

#[test]
fn a_resume_failing_in_recovery_leaves_it_paused() {
    let h = Harness::new(1);
    let (id, key) = h.life(async |lc| {
        let id = in_state(&lc, &h.fake, Resuming).await;
        (id.clone(), pause_key(&h.fake, &id).unwrap())
    });
    h.restart(Restart::KeepSandboxes);
    h.fake
        .fail_next(Verb::Resume, NodeError::failed("restore failed"));
    h.life(async |lc| {
        lc.recover().await;
        let back = becomes(&lc, &id, Paused).await;
        assert_eq!(back.status.reason.as_deref(), Some("RESUME_FAILED"));
        assert!(h.fake.checkpoint(&key).is_some());
        assert_eq!(h.fake.slot(0), SlotState::Kept { id: id.clone() });
    });
    h.assert_clean();
}

#[test]
fn a_resumed_sandbox_whose_memory_never_came_is_paused_again_on_the_kept_checkpoint() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        // The node keeps the checkpoint after the resume (its memory transfer failed), and
        // the transfer's failure killed the sandbox.
        h.fake.fail_next(
            Verb::RemoveSnapshot,
            NodeError::failed("the memory transfer failed: kept to resume from again"),
        );
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while h.fake.calls_of(Verb::RemoveSnapshot).is_empty() {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(h.fake.kill(&id));
        lc.reconcile().await;
        let back = lc.get(&id).unwrap();
        assert_eq!(back.status.state, Paused, "{:?}", back.status);
        assert_eq!(back.status.reason.as_deref(), Some("RESUME_FAILED"));
        assert!(h.fake.checkpoint(&key).is_some());
        // Resumed again from it, it runs.
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_claims_the_slots_of_paused_sandboxes() {
    let h = Harness::new(2);
    let id = h.life(async |lc| paused(&lc).await);
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 0));
        let claims: Vec<_> = h
            .fake
            .calls_of(Verb::ClaimSlot)
            .iter()
            .map(|c| c.slot)
            .collect();
        assert_eq!(claims, [Some(0)]);
        assert_ne!(h.fake.slot(0), SlotState::Free);
        // A create gets the other slot; the resume gets its own back.
        let other = running(&lc).await;
        assert_eq!(h.fake.sandbox(&other).unwrap().placement.slot, 1);
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
        let resumed = h.fake.sandbox(&id).unwrap().placement;
        assert_eq!(
            (resumed.slot, resumed.address),
            (0, FakeNode::address_of(0))
        );
    });
    h.assert_clean();
}

#[test]
fn recovery_leaves_an_interrupted_delete_to_the_reconciler() {
    let h = Harness::new(1);
    let id = h.life(async |lc| in_state(&lc, &h.fake, Stopping).await);
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        assert_eq!(lc.get(&id).unwrap().status.state, Stopping);
        assert_eq!(h.fake.calls_of(Verb::ClaimSlot).len(), 1);
        converges(&lc, &id, Terminated).await;
        assert!(h.fake.sandbox(&id).is_none());
        assert_eq!(h.fake.free_slots(), 1);
    });
    h.assert_clean();
}

#[test]
fn recovery_takes_an_interrupted_snapshot_again() {
    let h = Harness::new(1);
    let (source, snapshot) = h.life(async |lc| {
        let source = running(&lc).await;
        h.fake.hold(Verb::StageSnapshot);
        let snapshot = lc.create_snapshot(&source, None).unwrap().id;
        held(&h.fake, Verb::StageSnapshot).await;
        (source, snapshot)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        lc.recover_snapshots().await;
        snapshot_becomes(&lc, &snapshot, SnapshotState::Ready).await;
        assert_calls_in_order(
            &h.fake,
            &[
                Verb::HasSnapshot,
                Verb::DiscardInterruptedSnapshot,
                Verb::StageSnapshot,
                Verb::CommitSnapshot,
            ],
        );
        assert_eq!(lc.get(&source).unwrap().status.state, Running);
        // The source is free again.
        lc.pause(&source).unwrap();
        becomes(&lc, &source, Paused).await;
    });
    h.assert_clean();
}

#[test]
fn recovery_keeps_a_snapshot_the_node_finished() {
    let h = Harness::new(1);
    let snapshot = h.life(async |lc| {
        let source = running(&lc).await;
        h.fake.hold_after(Verb::CommitSnapshot);
        let snapshot = lc.create_snapshot(&source, None).unwrap().id;
        held(&h.fake, Verb::CommitSnapshot).await;
        snapshot
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        lc.recover_snapshots().await;
        let ready = snapshot_becomes(&lc, &snapshot, SnapshotState::Ready).await;
        assert!(ready.status.message.unwrap().contains("before a restart"));
        assert_eq!(h.fake.count(Verb::StageSnapshot), 0);
        assert_eq!(h.fake.count(Verb::DiscardInterruptedSnapshot), 0);
    });
    h.assert_clean();
}

#[test]
fn recovery_fails_an_interrupted_snapshot_whose_source_is_gone() {
    let h = Harness::new(1);
    let (source, snapshot) = h.life(async |lc| {
        let source = running(&lc).await;
        h.fake.hold(Verb::StageSnapshot);
        let snapshot = lc.create_snapshot(&source, None).unwrap().id;
        held(&h.fake, Verb::StageSnapshot).await;
        (source, snapshot)
    });
    h.restart(Restart::LoseSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        lc.recover_snapshots().await;
        let failed = snapshot_becomes(&lc, &snapshot, SnapshotState::Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("INTERRUPTED"));
        becomes(&lc, &source, Failed).await;
        assert_eq!(h.fake.count(Verb::StageSnapshot), 0);
    });
    h.assert_clean();
}

#[test]
fn recovery_finishes_an_interrupted_snapshot_deletion() {
    let h = Harness::new(1);
    let snapshot = h.life(async |lc| {
        let source = running(&lc).await;
        let snapshot = ready_snapshot(&lc, &source).await;
        h.fake.hold(Verb::RemoveSnapshot);
        let deleting = lc.clone();
        let id = snapshot.clone();
        tokio::spawn(async move { deleting.delete_snapshot(&id).await });
        held(&h.fake, Verb::RemoveSnapshot).await;
        assert_eq!(
            lc.get_snapshot(&snapshot).unwrap().status.state,
            SnapshotState::Deleting
        );
        snapshot
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(
            lc.get_snapshot(&snapshot).unwrap().status.state,
            SnapshotState::Deleting
        );
        lc.recover().await;
        lc.recover_snapshots().await;
        assert_eq!(
            lc.get_snapshot(&snapshot).unwrap_err().status(),
            StatusCode::NOT_FOUND
        );
        assert!(h.fake.checkpoint(&snapshot).is_none());
    });
    h.assert_clean();
}

#[test]
fn recovery_resumes_again_a_sandbox_whose_memory_transfer_was_cut_short() {
    let h = Harness::new(1);
    let (id, key, first) = h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        // The checkpoint is removed once the memory is in place: not yet.
        h.fake.hold(Verb::RemoveSnapshot);
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
        held(&h.fake, Verb::RemoveSnapshot).await;
        (id.clone(), key, h.fake.sandbox(&id).unwrap().placement)
    });
    h.restart(Restart::KeepSandboxes);
    assert!(h.fake.set_memory_incomplete(&id));
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (0, 0, 1));
        let again = becomes(&lc, &id, Running).await;
        assert!(again.status.message.is_some());
        let sandbox = h.fake.sandbox(&id).unwrap();
        assert_eq!(sandbox.origin, Origin::Resume(key.clone()));
        assert_ne!(sandbox.placement.handle, first.handle);
        assert_eq!(sandbox.placement.slot, first.slot);
        assert!(!sandbox.memory_incomplete);
        until("the checkpoint to go", || h.fake.checkpoint(&key).is_none()).await;
        let events = lc.diagnostics_events(&id, "all").unwrap().content.unwrap();
        assert!(events.contains("cut its memory transfer short"), "{events}");
    });
    h.assert_clean();
}

#[test]
fn recovery_fails_a_clone_whose_memory_transfer_was_cut_short() {
    let h = Harness::new(2);
    let clone = h.life(async |lc| {
        let source = running(&lc).await;
        let snapshot = ready_snapshot(&lc, &source).await;
        let clone = lc.create(from_snapshot(&snapshot)).await.unwrap().id;
        becomes(&lc, &clone, Running).await;
        clone
    });
    h.restart(Restart::KeepSandboxes);
    h.fake.set_memory_incomplete(&clone);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (1, 1, 0));
        let failed = becomes(&lc, &clone, Failed).await;
        assert_eq!(failed.status.reason.as_deref(), Some("PROCESS_LOST"));
        until("the clone to be removed", || {
            h.fake.sandbox(&clone).is_none()
        })
        .await;
    });
    h.assert_clean();
}

#[test]
fn a_pause_checkpoint_left_by_a_crash_after_a_resume_is_unreferenced() {
    let h = Harness::new(1);
    let (id, key) = h.life(async |lc| {
        let id = paused(&lc).await;
        let key = pause_key(&h.fake, &id).unwrap();
        h.fake.hold(Verb::RemoveSnapshot);
        lc.resume(&id).unwrap();
        becomes(&lc, &id, Running).await;
        held(&h.fake, Verb::RemoveSnapshot).await;
        (id, key)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (1, 0, 0));
        lc.recover_snapshots().await;
        let on_node: Vec<String> = h.fake.checkpoints().into_iter().map(|c| c.key).collect();
        assert_eq!(lc.unreferenced_pauses(&on_node), std::slice::from_ref(&key));
        assert_eq!(lc.get(&id).unwrap().status.state, Running);
    });
    h.assert_clean();
}

#[test]
fn recovery_of_an_interrupted_fork_ends_every_part_and_leaks_nothing() {
    let h = Harness::new(3);
    let (source, fork) = h.life(async |lc| {
        let source = running(&lc).await;
        h.fake.hold(Verb::StageSnapshot);
        let fork = lc.fork(&source, fork_of(2)).await.unwrap();
        held(&h.fake, Verb::StageSnapshot).await;
        for clone in &fork.items {
            assert_eq!(lc.get(&clone.id).unwrap().status.state, Pending);
        }
        (source, fork)
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        assert_eq!(lc.recover().await, (1, 0, 2));
        lc.recover_snapshots().await;
        snapshot_becomes(&lc, &fork.snapshot_id, SnapshotState::Ready).await;
        // Each clone ends Running or Failed (it races the snapshot taken again: see the
        // report), and a failed one gives its slot back.
        for clone in &fork.items {
            until(format!("clone {} to end", clone.id), || {
                lc.get(&clone.id)
                    .is_ok_and(|s| matches!(s.status.state, Running | Failed))
            })
            .await;
        }
        let placed = fork
            .items
            .iter()
            .filter(|c| lc.get(&c.id).unwrap().status.state == Running)
            .count() as u32;
        until("failed clones' slots to be free", || {
            h.fake.free_slots() == 2 - placed
        })
        .await;
        assert_eq!(lc.get(&source).unwrap().status.state, Running);
    });
    h.assert_clean();
}

#[test]
fn recovery_restarts_a_create_only_once_its_slot_is_torn_down() {
    let h = Harness::new(2);
    let id = h.life(async |lc| in_state(&lc, &h.fake, Pending).await);
    h.restart(Restart::KeepSandboxes);
    h.fake.defer_teardowns(true);
    h.life(async |lc| {
        lc.recover().await;
        becomes(&lc, &id, Running).await;
        h.fake.finish_teardowns();
        let slot = h.fake.sandbox(&id).map(|s| s.placement.slot);
        assert!(
            slot.is_some_and(|s| h.fake.slot(s) != SlotState::Free),
            "the restarted sandbox's slot was freed under it"
        );
    });
    h.assert_clean();
}

#[test]
fn recovery_ends_an_interrupted_template_build() {
    let h = Harness::new(1);
    let template = h.life(async |lc| {
        h.fake.hold(Verb::BuildTemplate);
        let template = lc
            .create_template(CreateTemplateRequest {
                image: IMAGE.into(),
                publish: "local".into(),
                ..Default::default()
            })
            .unwrap()
            .template_id;
        held(&h.fake, Verb::BuildTemplate).await;
        assert_eq!(
            lc.get_template(&template).unwrap().status.phase,
            TemplatePhase::Building
        );
        template
    });
    h.restart(Restart::KeepSandboxes);
    h.life(async |lc| {
        lc.recover().await;
        lc.recover_snapshots().await;
        until("the template build to end", || {
            lc.get_template(&template).is_ok_and(|t| {
                matches!(
                    t.status.phase,
                    TemplatePhase::Succeeded | TemplatePhase::Failed
                )
            })
        })
        .await;
    });
}

// Templates.

#[test]
fn a_template_is_built_on_the_node_and_its_sandboxes_start_from_it() {
    let h = Harness::new(2);
    h.life(async |lc| {
        let template = lc
            .create_template(CreateTemplateRequest {
                image: IMAGE.into(),
                publish: "local".into(),
                ..Default::default()
            })
            .unwrap()
            .template_id;
        until("the build to succeed", || {
            lc.get_template(&template)
                .is_ok_and(|t| t.status.phase == TemplatePhase::Succeeded)
        })
        .await;
        assert_eq!(h.fake.templates(), std::slice::from_ref(&template));
        let created = lc
            .create(CreateSandboxRequest {
                template_id: Some(template.clone()),
                timeout: Some(600),
                ..Default::default()
            })
            .await
            .unwrap();
        becomes(&lc, &created.id, Running).await;
        assert_eq!(
            h.fake.sandbox(&created.id).unwrap().template,
            Some(template.clone())
        );
        lc.delete_template(&template).await.unwrap();
        assert!(h.fake.templates().is_empty());

        // A build the node fails is Failed; creates from it are refused.
        h.fake
            .fail_next(Verb::BuildTemplate, NodeError::failed("warm-up failed"));
        let broken = lc
            .create_template(CreateTemplateRequest {
                image: IMAGE.into(),
                publish: "local".into(),
                ..Default::default()
            })
            .unwrap()
            .template_id;
        until("the build to fail", || {
            lc.get_template(&broken)
                .is_ok_and(|t| t.status.phase == TemplatePhase::Failed)
        })
        .await;
        let e = lc
            .create(CreateSandboxRequest {
                template_id: Some(broken),
                timeout: Some(600),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.status(), StatusCode::NOT_FOUND, "{e}");
    });
    h.assert_clean();
}

// Several nodes.

/// The node that runs sandbox `id` (exactly one).
fn runs_on(h: &Harness, id: &str) -> String {
    let on: Vec<String> = h
        .fakes()
        .iter()
        .filter(|f| f.sandbox(id).is_some_and(|s| s.alive))
        .map(|f| f.node_id().to_string())
        .collect();
    assert_eq!(on.len(), 1, "{id} runs on {on:?}");
    on[0].clone()
}

#[test]
fn creates_spread_over_the_nodes_and_a_full_node_is_passed_over() {
    let h = Harness::several(&[("a", 2), ("b", 4), ("c", 4)]);
    h.life(async |lc| {
        lc.nodes().refresh().await;
        let mut ids = Vec::new();
        for _ in 0..6 {
            ids.push(running(&lc).await);
        }
        let mut share = std::collections::BTreeMap::<String, usize>::new();
        for id in &ids {
            let node = runs_on(&h, id);
            // The server sends every later call to the node the record names.
            assert_eq!(lc.node_of_sandbox(id).unwrap().node_id(), node);
            *share.entry(node).or_default() += 1;
        }
        assert!(share.len() == 3, "every node took some: {share:?}");
        // Node a (two slots) is refused as full by its own count from now on: the rest
        // land on b and c, and only when every node is full is a create refused.
        lc.nodes().refresh().await;
        let mut more = 0;
        loop {
            match lc.create(request()).await {
                Ok(s) => {
                    becomes(&lc, &s.id, Running).await;
                    more += 1;
                }
                Err(e) => {
                    assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS, "{e}");
                    break;
                }
            }
        }
        assert_eq!(
            ids.len() + more,
            10,
            "every slot of the three nodes is used"
        );
        for fake in h.fakes() {
            assert_eq!(fake.free_slots(), 0, "node {}", fake.node_id());
        }
    });
    h.assert_clean();
}

#[test]
fn an_unreachable_node_at_admission_sends_the_create_to_the_next() {
    let h = Harness::several(&[("a", 4), ("b", 4)]);
    h.life(async |lc| {
        h.fake.fail_next(
            Verb::Admit,
            NodeError::new(NodeErrorKind::Unreachable, "connection refused"),
        );
        let id = running(&lc).await;
        assert_eq!(runs_on(&h, &id), "b");
        // A node that fails otherwise fails the create: nothing is tried elsewhere.
        h.fake
            .fail_next(Verb::Admit, NodeError::failed("the disk is gone"));
        let e = lc.create(request()).await.unwrap_err();
        assert_eq!(e.status(), StatusCode::INTERNAL_SERVER_ERROR, "{e}");
        assert_eq!(h.fake_named("b").sandboxes().len(), 1);
    });
    h.assert_clean();
}

#[test]
fn every_operation_goes_to_the_sandbox_s_own_node() {
    let h = Harness::several(&[("a", 4), ("b", 4)]);
    h.life(async |lc| {
        // One sandbox on each node (the second create goes to the emptier node).
        let first = running(&lc).await;
        let second = running(&lc).await;
        let (on_first, on_second) = (runs_on(&h, &first), runs_on(&h, &second));
        assert_ne!(on_first, on_second);
        let b = h.fake_named(&on_second);
        let a = h.fake_named(&on_first);
        a.clear_calls();
        b.clear_calls();

        // Egress, snapshot, clone from it, fork, pause, resume, delete: all on b.
        lc.change_network_policy(
            second.clone(),
            PolicyChange::Replace(deny_but("example.org")),
        )
        .await
        .expect("policy");
        let snap = ready_snapshot(&lc, &second).await;
        let clone = lc.create(from_snapshot(&snap)).await.expect("clone").id;
        becomes(&lc, &clone, Running).await;
        assert_eq!(
            runs_on(&h, &clone),
            on_second,
            "a clone lands where its snapshot is"
        );
        let forked = lc.fork(&second, fork_of(2)).await.expect("fork");
        for item in &forked.items {
            becomes(&lc, &item.id, Running).await;
            assert_eq!(runs_on(&h, &item.id), on_second);
        }
        lc.pause(&second).expect("pause");
        becomes(&lc, &second, Paused).await;
        assert!(pause_key(&b, &second).is_some());
        lc.resume(&second).expect("resume");
        becomes(&lc, &second, Running).await;
        assert_eq!(runs_on(&h, &second), on_second);
        lc.delete(&clone).expect("delete");
        becomes(&lc, &clone, Terminated).await;
        lc.delete_snapshot(&snap).await.expect("delete snapshot");
        assert!(b.checkpoint(&snap).is_none());
        // The other node only checks references' syntax (no I/O) for the admission.
        assert!(
            a.calls()
                .iter()
                .all(|c| matches!(c.verb, Verb::Status | Verb::CheckImage)),
            "node {on_first} was asked: {:?}",
            a.calls()
        );

        // After a restart of server and nodes, each node adopts its own.
        h.restart(Restart::KeepSandboxes);
    });
    h.life(async |lc| {
        let (adopted, lost, restarted) = lc.recover().await;
        assert_eq!((lost, restarted), (0, 0));
        assert_eq!(adopted, 4, "first, second and the fork's two clones");
        for fake in h.fakes() {
            for call in fake.calls_of(Verb::Adopt) {
                let id = call.id.clone().expect("adopt names the sandbox");
                assert_eq!(runs_on(&h, &id), fake.node_id());
            }
        }
    });
    h.assert_clean();
}

#[test]
fn a_record_on_a_node_the_server_no_longer_has_is_left_alone() {
    let h = Harness::several(&[("a", 4), ("b", 4)]);
    let on_b = h.life(async |lc| {
        running(&lc).await;
        let id = running(&lc).await;
        assert_eq!(runs_on(&h, &id), "b");
        id
    });
    // The server comes back with node a only.
    let only_a = Harness {
        dir: h.dir,
        fake: h.fake.clone(),
        others: Vec::new(),
        tune: h.tune,
    };
    only_a.life(async |lc| {
        lc.recover().await;
        // Not lost: nothing is known of it (its node may come back).
        for _ in 0..3 {
            lc.reconcile().await;
        }
        assert_eq!(lc.get(&on_b).unwrap().status.state, Running);
        // A pause is taken on (202) and ends Running with the reason: the node is unknown.
        lc.pause(&on_b).expect("pause");
        until("the pause to fail", || {
            lc.get(&on_b)
                .is_ok_and(|s| s.status.reason.as_deref() == Some("PAUSE_FAILED"))
        })
        .await;
        assert_eq!(lc.get(&on_b).unwrap().status.state, Running);
        let e = lc.node_of_sandbox(&on_b).err().expect("no node b");
        assert_eq!(e.status(), StatusCode::SERVICE_UNAVAILABLE, "{e}");
    });
}
