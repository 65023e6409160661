//! Registered nodes, over the real control API and node API (HTTP on loopback), against fake
//! nodes: joining with the join token, per-node credentials and scoping, heartbeats and
//! leases, loss (`NODE_LOST`), a lost node's return, revocation, and a restart of the server.
//! No root needed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec, SandboxState};
use fastbox_node_api::NodeAgent;
use fastbox_node_api::control::{AccessApi, EgressApi};
use fastbox_node_api::membership::{
    Heartbeat, MembershipError, Registered, Registration, route_keys_digest,
};
use fastbox_node_api::remote::{
    ControlClient, Credential, MembershipCallError, control_router, node_router,
};
use fastbox_node_api::testkit::{FakeNode, Verb};
use fastbox_node_api::wire::CheckpointFetch;
use fastbox_server::config::{ServerConfig, Settings};
use fastbox_server::nodes::{NodeState, Nodes};
use fastbox_server::service::{Lifecycle, NODE_LOST};
use fastbox_server::store::Store;

const IMAGE: &str = "registry.test/app:1";
const PATIENCE: Duration = Duration::from_secs(10);

/// Serves `router` on a loopback port until the test's runtime ends; its base URL.
async fn serve(router: axum::Router) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let service = router.into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, service).await.unwrap();
    });
    (format!("http://{addr}"), task)
}

/// A server (with an in-process fake node `local`), its control API's URL and join token.
struct Cluster {
    dir: tempfile::TempDir,
    lc: Arc<Lifecycle>,
    control: String,
    join: Credential,
    local: Arc<FakeNode>,
    /// The control API's server (it holds the lifecycle).
    serving: tokio::task::JoinHandle<()>,
}

impl Cluster {
    async fn start(lease_ms: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let local = Arc::new(FakeNode::new(4).with_node_id("local").with_image(IMAGE));
        Self::living(dir, local, lease_ms).await
    }

    /// The server's next life over the data in `dir`, with node `local` in process.
    async fn living(dir: tempfile::TempDir, local: Arc<FakeNode>, lease_ms: u64) -> Self {
        let (lc, control, join, serving) = Self::life(&dir, local.clone(), lease_ms).await;
        Self {
            dir,
            lc,
            control,
            join,
            local,
            serving,
        }
    }

    /// One life of the server over the data in `dir`.
    async fn life(
        dir: &tempfile::TempDir,
        local: Arc<FakeNode>,
        lease_ms: u64,
    ) -> (
        Arc<Lifecycle>,
        String,
        Credential,
        tokio::task::JoinHandle<()>,
    ) {
        let mut cfg = ServerConfig::resolve(Settings {
            data_dir: Some(dir.path().to_path_buf()),
            cache_dir: Some(dir.path().join("cache")),
            node_lease_ms: Some(lease_ms),
            ..Default::default()
        })
        .unwrap();
        cfg.create_wait = Duration::from_secs(5);
        cfg.admission_grace = ADMISSION_GRACE;
        let store = Store::open(&dir.path().join("state.redb")).unwrap();
        let keys = fastbox_proxy::RouteKeys::load_or_create(&dir.path().join("route-key")).unwrap();
        let nodes = Nodes::new(vec![local as Arc<dyn NodeAgent>]).unwrap();
        let lc = Lifecycle::with_nodes(cfg, store, nodes, Default::default(), keys).unwrap();
        lc.load_registered_nodes().unwrap();
        let join = Credential::generate().unwrap();
        lc.set_join_token(Some(join.clone()));
        let (control, serving) = serve(control_router(lc.clone(), lc.clone(), lc.clone())).await;
        (lc, control, join, serving)
    }

    /// The server stops (once every task of its life ended) and starts again on the same
    /// store, with a new control API.
    async fn restarted(self, lease_ms: u64) -> Cluster {
        let Cluster {
            dir,
            lc,
            local,
            serving,
            ..
        } = self;
        serving.abort();
        let _ = serving.await;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while Arc::strong_count(&lc) > 1 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "a task holds the server"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(lc);
        Self::living(dir, local, lease_ms).await
    }

    /// Node `id` (a fake behind the real node API) joins; its fake and its control client.
    async fn join(&self, id: &str) -> (Arc<FakeNode>, ControlClient, Registered) {
        let fake = Arc::new(FakeNode::new(4).with_node_id(id).with_image(IMAGE));
        let join = self.join.clone();
        self.join_as(fake, &join).await
    }

    /// Node `fake` registers presenting `credential` (the join token, or its own to register
    /// again after a restart of its own).
    async fn join_as(
        &self,
        fake: Arc<FakeNode>,
        credential: &Credential,
    ) -> (Arc<FakeNode>, ControlClient, Registered) {
        // The node API listens before the registration names it (the credential comes with
        // the answer): a listener first, the router once registered.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let registered =
            ControlClient::register(&self.control, None, credential, &fake.registration(url))
                .await
                .expect("registered");
        let router = node_router(fake.clone(), registered.server_to_node.parse().unwrap());
        tokio::spawn(async move {
            axum::serve(listener, router.into_make_service())
                .await
                .unwrap();
        });
        let client = ControlClient::new(&self.control, registered.node_to_server.parse().unwrap())
            .unwrap()
            .with_access_ttl(Duration::ZERO);
        (fake, client, registered)
    }
}

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

/// A running sandbox on node `on` (creates until one lands there; the others are deleted).
async fn running_on(lc: &Arc<Lifecycle>, on: &FakeNode) -> String {
    for _ in 0..8 {
        let id = lc.create(request()).await.expect("create").id;
        until(lc, &id, SandboxState::Running).await;
        if on.sandbox(&id).is_some() {
            return id;
        }
        lc.delete(&id).unwrap();
    }
    panic!("no create landed on node {}", on.node_id());
}

/// How long the server leaves a slot a node reports admitted and unused.
const ADMISSION_GRACE: Duration = Duration::from_millis(500);

/// A sandbox paused on node `on`, and the key of its pause checkpoint there.
async fn paused_on(lc: &Arc<Lifecycle>, on: &FakeNode) -> (String, String) {
    let id = running_on(lc, on).await;
    lc.pause(&id).unwrap();
    until(lc, &id, SandboxState::Paused).await;
    let key = on
        .checkpoints()
        .into_iter()
        .find(|k| k.key.starts_with(&format!("pause-{id}-")))
        .expect("the pause checkpoint on the node")
        .key;
    (id, key)
}

async fn until(lc: &Lifecycle, id: &str, state: SandboxState) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while lc.get(id).unwrap().status.state != state {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id}: {:?}, not {state}",
            lc.get(id).unwrap().status
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A heartbeat with `status` (and no route keys held).
fn beat(status: fastbox_node_api::wire::NodeStatus) -> Heartbeat {
    Heartbeat {
        status,
        route_keys_sha256: None,
    }
}

fn refused(e: MembershipCallError) -> MembershipError {
    match e {
        MembershipCallError::Refused(e) => e,
        other => panic!("not a refusal: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joining_needs_the_join_token_and_a_valid_name() {
    let c = Cluster::start(10_000).await;
    let registration = |id: &str| Registration {
        node_id: id.into(),
        url: "http://127.0.0.1:1".into(),
        proxy_public: "127.0.0.1:8091".into(),
        tls_pin: None,
    };
    let wrong = Credential::generate().unwrap();
    let e = refused(
        ControlClient::register(&c.control, None, &wrong, &registration("n1"))
            .await
            .unwrap_err(),
    );
    assert!(e.to_string().contains("401"), "{e}");
    for (id, why) in [("N1", "node id"), ("local", "taken")] {
        let e = refused(
            ControlClient::register(&c.control, None, &c.join, &registration(id))
                .await
                .unwrap_err(),
        );
        assert!(e.to_string().contains(why), "{id}: {e}");
    }
    let mut bad_proxy = registration("n1");
    bad_proxy.proxy_public = "http://x/".into();
    let e = refused(
        ControlClient::register(&c.control, None, &c.join, &bad_proxy)
            .await
            .unwrap_err(),
    );
    assert!(matches!(e, MembershipError::Invalid(_)), "{e}");
    // An https node API comes with its certificate's pin, and a pin with https only.
    let pin = "ab".repeat(32);
    for (url, tls_pin, why) in [
        ("https://127.0.0.1:1", None, "needs its certificate's pin"),
        (
            "http://127.0.0.1:1",
            Some(pin.clone()),
            "goes with an https URL",
        ),
        (
            "https://127.0.0.1:1",
            Some("abc".into()),
            "not a certificate pin",
        ),
    ] {
        let mut tls = registration("n1");
        tls.url = url.into();
        tls.tls_pin = tls_pin;
        let e = refused(
            ControlClient::register(&c.control, None, &c.join, &tls)
                .await
                .unwrap_err(),
        );
        assert!(matches!(e, MembershipError::Invalid(_)), "{e}");
        assert!(e.to_string().contains(why), "{url}: {e}");
    }

    // The join token registers and does nothing else; a node's credential does the rest.
    let (_, node, registered) = c.join("n1").await;
    assert_ne!(registered.server_to_node, registered.node_to_server);
    let as_joining = ControlClient::new(&c.control, c.join.clone()).unwrap();
    let e = refused(
        as_joining
            .heartbeat(&beat(c.lc.nodes().first().status().await))
            .await
            .unwrap_err(),
    );
    assert!(e.to_string().contains("403"), "{e}");
    let e = as_joining.policy("x").await.unwrap_err();
    assert_eq!(e.status, 503, "{e:?}");
    let mut status = fastbox_node_api::wire::NodeStatus {
        node_id: "n1".into(),
        ..Default::default()
    };
    let renewal = node
        .heartbeat(&beat(status.clone()))
        .await
        .expect("heartbeat");
    assert!(!renewal.was_lost);
    assert_eq!(renewal.terms.lease_ms, 10_000);
    // A node speaks for itself only.
    status.node_id = "local".into();
    let e = refused(node.heartbeat(&beat(status)).await.unwrap_err());
    assert!(matches!(e, MembershipError::Invalid(_)), "{e}");
    let views = c.lc.list_nodes();
    assert_eq!(
        views
            .iter()
            .map(|v| (v.id.as_str(), v.state))
            .collect::<Vec<_>>(),
        [("local", NodeState::Static), ("n1", NodeState::Ready)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_answered_about_its_own_sandboxes_only() {
    let c = Cluster::start(10_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let (_, n2_control, _) = c.join("n2").await;
    let on_n1 = running_on(&c.lc, &n1).await;
    let on_local = running_on(&c.lc, &c.local).await;

    // Endpoints point at the owning node's proxy.
    let endpoint =
        c.lc.endpoint(&on_n1, 8080, &Default::default())
            .await
            .unwrap();
    assert!(
        endpoint.endpoint.starts_with("n1.nodes.test:8091/"),
        "{}",
        endpoint.endpoint
    );
    assert!(n1_control.policy(&on_n1).await.is_ok());
    assert!(n1_control.access(&on_n1).await.is_some());
    for (control, id) in [
        (&n2_control, &on_n1),
        (&n1_control, &on_local),
        (&n2_control, &on_local),
    ] {
        let e = control.policy(id).await.unwrap_err();
        assert_eq!(e.status, 404, "{e:?}");
        assert!(control.access(id).await.is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_renewing_is_lost_and_its_return_removes_what_it_ran() {
    // A lease of 1 s: lost 0.5 s after it ran out.
    let c = Cluster::start(1_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let on_n1 = running_on(&c.lc, &n1).await;
    let on_local = running_on(&c.lc, &c.local).await;
    let paused = running_on(&c.lc, &n1).await;
    c.lc.pause(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Paused).await;

    // No heartbeat: after the lease, nothing new goes to n1; a bit later it is lost.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Expired);
    assert_eq!(
        c.lc.get(&on_n1).unwrap().status.state,
        SandboxState::Running
    );
    let later = c.lc.create(request()).await.unwrap().id;
    until(&c.lc, &later, SandboxState::Running).await;
    assert!(c.local.sandbox(&later).is_some(), "not on the expired node");
    tokio::time::sleep(Duration::from_millis(600)).await;
    n1.clear_calls();
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);
    let lost = c.lc.get(&on_n1).unwrap();
    assert_eq!(lost.status.state, SandboxState::Failed);
    assert_eq!(lost.status.reason.as_deref(), Some(NODE_LOST));
    assert_eq!(
        c.lc.get(&paused).unwrap().status.state,
        SandboxState::Paused
    );
    assert_eq!(
        c.lc.get(&on_local).unwrap().status.state,
        SandboxState::Running
    );
    // Nothing was asked of the lost node, and more passes change nothing.
    c.lc.reconcile().await;
    assert!(
        n1.calls().iter().all(|c| c.verb == Verb::Status),
        "{:?}",
        n1.calls()
    );
    assert!(n1.sandbox(&on_n1).is_some_and(|s| s.alive));

    // It comes back: told it was lost, and the reconciler removes what it ran.
    let renewal = n1_control
        .heartbeat(&beat(n1.status().await))
        .await
        .expect("heartbeat");
    assert!(renewal.was_lost);
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Ready);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while n1.sandbox(&on_n1).is_some() {
        assert!(tokio::time::Instant::now() < deadline, "never removed");
        n1_control
            .heartbeat(&beat(n1.status().await))
            .await
            .unwrap();
        c.lc.reconcile().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        c.lc.get(&on_n1).unwrap().status.reason.as_deref(),
        Some(NODE_LOST)
    );
    // The paused sandbox stayed where it was (nobody resumed it meanwhile): it resumes there.
    c.lc.resume(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Running).await;
    assert!(n1.sandbox(&paused).is_some_and(|s| s.alive));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_ends_a_node_s_credentials_and_its_sandboxes() {
    let c = Cluster::start(10_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let on_n1 = running_on(&c.lc, &n1).await;
    let e = c.lc.revoke_node("local").unwrap_err();
    assert_eq!(e.status(), 409, "{e}");
    assert_eq!(c.lc.revoke_node("ghost").unwrap_err().status(), 404);
    c.lc.revoke_node("n1").unwrap();
    let e = refused(
        n1_control
            .heartbeat(&beat(n1.status().await))
            .await
            .unwrap_err(),
    );
    assert!(e.to_string().contains("401"), "{e}");
    let failed = c.lc.get(&on_n1).unwrap();
    assert_eq!(failed.status.reason.as_deref(), Some(NODE_LOST));
    assert_eq!(c.lc.list_nodes().len(), 1);
    // Calls about its records find no node: 503, not a guess.
    let e = c.lc.node_of_sandbox(&on_n1).err().unwrap();
    assert_eq!(e.status(), 503, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_nodes_survive_a_restart_of_the_server() {
    let c = Cluster::start(10_000).await;
    let (n1, _, registered) = c.join("n1").await;
    let on_n1 = running_on(&c.lc, &n1).await;
    n1.clear_calls();
    // The next life: the same store, a new control API.
    let c = c.restarted(10_000).await;
    let (lc, control) = (&c.lc, &c.control);
    let (adopted, lost, _) = lc.recover().await;
    assert_eq!((adopted, lost), (1, 0));
    assert_eq!(lc.node_of_sandbox(&on_n1).unwrap().node_id(), "n1");
    assert!(
        n1.calls_of(Verb::Adopt)
            .iter()
            .any(|c| c.id.as_deref() == Some(on_n1.as_str())),
        "adopted by its own node"
    );
    assert_eq!(
        lc.list_nodes()[1].state,
        NodeState::Ready,
        "a fresh lease at start"
    );
    // Its credential still works; another does not.
    let node = ControlClient::new(control, registered.node_to_server.parse().unwrap()).unwrap();
    node.heartbeat(&beat(n1.status().await))
        .await
        .expect("heartbeat");
    let stranger = ControlClient::new(control, Credential::generate().unwrap()).unwrap();
    let e = refused(
        stranger
            .heartbeat(&beat(n1.status().await))
            .await
            .unwrap_err(),
    );
    assert!(e.to_string().contains("401"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_registers_again_is_given_its_sandboxes_back() {
    let c = Cluster::start(10_000).await;
    let (n1, old_control, registered) = c.join("n1").await;
    let kept = running_on(&c.lc, &n1).await;
    let gone = running_on(&c.lc, &n1).await;
    // n1 restarts (one sandbox's processes died meanwhile) and registers again with its own
    // credential: new credentials, the old ones stop working.
    n1.kill(&gone);
    n1.restart(fastbox_node_api::testkit::Restart::KeepSandboxes);
    n1.clear_calls();
    let own: Credential = registered.node_to_server.parse().unwrap();
    let (_, control, _) = c.join_as(n1.clone(), &own).await;
    let e = refused(
        old_control
            .heartbeat(&beat(n1.status().await))
            .await
            .unwrap_err(),
    );
    assert!(e.to_string().contains("401"), "{e}");
    control.heartbeat(&beat(n1.status().await)).await.unwrap();
    c.lc.reconcile().await;
    let adopted: Vec<_> = n1
        .calls_of(Verb::Adopt)
        .into_iter()
        .filter_map(|c| c.id)
        .collect();
    assert_eq!(adopted.len(), 2, "{adopted:?}");
    assert_eq!(c.lc.get(&kept).unwrap().status.state, SandboxState::Running);
    let lost = c.lc.get(&gone).unwrap();
    assert_eq!(lost.status.state, SandboxState::Failed, "{:?}", lost.status);
}

/// A server sees a registration a second time (its own write coming back through the
/// store's watch, or a reload of the store): the node did not register again, and nothing of
/// what runs there is taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_seen_twice_is_not_a_new_one() {
    let c = Cluster::start(10_000).await;
    let (n1, control, _) = c.join("n1").await;
    let id = running_on(&c.lc, &n1).await;
    n1.clear_calls();
    assert_eq!(c.lc.load_registered_nodes().unwrap(), 1);
    c.lc.reconcile().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for verb in [Verb::Adopt, Verb::ClaimSlot, Verb::Remove] {
        assert!(
            n1.calls_of(verb).is_empty(),
            "{verb:?}: taken back as if n1 had restarted: {:?}",
            n1.calls()
        );
    }
    assert_eq!(c.lc.get(&id).unwrap().status.state, SandboxState::Running);
    // Its credentials still work (the client was not replaced by another).
    control.heartbeat(&beat(n1.status().await)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_in_flight_when_its_node_registers_again_is_not_run_twice() {
    let c = Cluster::start(10_000).await;
    let (n1, _, registered) = c.join("n1").await;
    let id = running_on(&c.lc, &n1).await;
    n1.hold(Verb::Pause);
    c.lc.pause(&id).unwrap();
    tokio::time::timeout(PATIENCE, n1.wait_held(Verb::Pause))
        .await
        .expect("the pause reaches n1");

    // n1 restarts and registers again while the pause waits there: the recovery of its
    // sandboxes leaves the pause to finish by itself.
    n1.restart(fastbox_node_api::testkit::Restart::KeepSandboxes);
    let own: Credential = registered.node_to_server.parse().unwrap();
    let (_, control, _) = c.join_as(n1.clone(), &own).await;
    control.heartbeat(&beat(n1.status().await)).await.unwrap();
    c.lc.reconcile().await;
    // What a recovery starts runs in a task of its own: give it time to call n1.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(c.lc.get(&id).unwrap().status.state, SandboxState::Pausing);
    let slot = n1.calls_of(Verb::Pause)[0].slot;
    assert!(
        n1.calls_of(Verb::ClaimSlot)
            .iter()
            .any(|call| call.slot == slot),
        "its slot is claimed at once: {:?}",
        n1.calls()
    );
    for verb in [
        Verb::FinishInterruptedPause,
        Verb::HasSnapshot,
        Verb::ReleaseKeepingAddress,
    ] {
        assert!(
            n1.calls_of(verb).is_empty(),
            "{verb:?}: the recovery acted on a pause in flight: {:?}",
            n1.calls()
        );
    }

    // Once the pause ended, the next pass recovers it.
    n1.release_all();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while c.lc.get(&id).unwrap().status.state == SandboxState::Pausing {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let calls = n1.calls().len();
    c.lc.reconcile().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        n1.calls().len() > calls,
        "the deferred recovery ran: {:?}",
        n1.calls()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_admitted_whose_answer_was_lost_is_given_back_after_the_grace() {
    let c = Cluster::start(10_000).await;
    let (n1, control, _) = c.join("n1").await;
    let running = running_on(&c.lc, &n1).await;
    // The server asked n1 for a slot and never got the answer: n1 holds it, unused.
    let lost = n1.admit().await.unwrap();
    control.heartbeat(&beat(n1.status().await)).await.unwrap();
    c.lc.reconcile().await;
    assert!(
        n1.calls_of(Verb::ReleaseSlot).is_empty(),
        "not within the grace: {:?}",
        n1.calls()
    );

    tokio::time::sleep(ADMISSION_GRACE + Duration::from_millis(100)).await;
    control.heartbeat(&beat(n1.status().await)).await.unwrap();
    c.lc.reconcile().await;
    assert!(
        n1.status().await.unused_admissions.is_empty(),
        "the forgotten admission went"
    );
    assert!(
        n1.calls_of(Verb::ReleaseSlot).is_empty(),
        "{:?}",
        n1.calls()
    );
    assert_eq!(
        c.lc.get(&running).unwrap().status.state,
        SandboxState::Running
    );

    // The slot is admitted again (an answer on its way); the server still has the old
    // report, but the node gives back only the admission that report named.
    assert_eq!(n1.admit().await.unwrap(), lost);
    c.lc.reconcile().await;
    let unused: Vec<u32> = n1
        .status()
        .await
        .unused_admissions
        .iter()
        .map(|a| a.slot)
        .collect();
    assert_eq!(unused, vec![lost], "a stale report frees nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_get_the_route_signing_keys_and_their_rotations() {
    let c = Cluster::start(10_000).await;
    let (n1, control, registered) = c.join("n1").await;
    let key_file = c.dir.path().join("route-key");
    let keys = registered
        .route_keys
        .expect("the keys come with the registration");
    // Its own keys, derived from the server's: not the server's.
    let server_keys = fastbox_proxy::RouteKeys::load_or_create(&key_file).unwrap();
    assert_ne!(keys, server_keys.file_text());
    assert_eq!(keys, server_keys.current().derive("n1").file_text());
    // A node holding them is not sent them again; one holding others (or none) is.
    let holding = |text: &str| Heartbeat {
        status: fastbox_node_api::wire::NodeStatus {
            node_id: n1.node_id().into(),
            ..Default::default()
        },
        route_keys_sha256: Some(route_keys_digest(text)),
    };
    assert_eq!(
        control.heartbeat(&holding(&keys)).await.unwrap().route_keys,
        None
    );
    let sent = control.heartbeat(&holding("old")).await.unwrap().route_keys;
    assert_eq!(sent.as_deref(), Some(keys.as_str()));
    // A rotation on the server reaches the nodes with their next heartbeat.
    let rotated = fastbox_proxy::rotate_key(&key_file)
        .unwrap()
        .derive("n1")
        .file_text();
    assert_ne!(rotated, keys);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let renewal = control.heartbeat(&holding(&keys)).await.unwrap();
        if renewal.route_keys.as_deref() == Some(rotated.as_str()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the rotation never came"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_of_a_lost_node_resumes_on_another_and_its_leftovers_go_later() {
    let c = Cluster::start(1_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let (paused, key) = paused_on(&c.lc, &n1).await;
    // A snapshot taken on n1 too.
    let source = running_on(&c.lc, &n1).await;
    let snap = c.lc.create_snapshot(&source, None).unwrap().id;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while c.lc.get_snapshot(&snap).unwrap().status.state
        != fastbox_api::snapshots::SnapshotState::Ready
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // n1 stops renewing and is lost.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);

    // The resume takes it to the server's node: the checkpoint fetched there first (the fake
    // node's fetch needs the manifest the pause published), a new slot, Running.
    c.lc.resume(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Running).await;
    assert!(c.local.sandbox(&paused).is_some_and(|s| s.alive));
    assert!(
        c.local
            .calls_of(Verb::FetchCheckpoint)
            .iter()
            .any(|call| call.key.as_deref() == Some(key.as_str())),
        "{:?}",
        c.local.calls()
    );
    assert!(
        c.local
            .fetches()
            .contains(&(key.clone(), CheckpointFetch::MemoryOnFault)),
        "a resume fetches the memory while the sandbox runs: {:?}",
        c.local.fetches()
    );
    assert_eq!(c.lc.node_of_sandbox(&paused).unwrap().node_id(), "local");
    let events =
        c.lc.diagnostics_events(&paused, "all")
            .unwrap()
            .content
            .unwrap();
    assert!(events.contains("Moved"), "{events}");
    // A create from the snapshot goes elsewhere too, fetching it.
    let clone =
        c.lc.create(CreateSandboxRequest {
            snapshot_id: Some(snap.clone()),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    until(&c.lc, &clone, SandboxState::Running).await;
    assert!(c.local.sandbox(&clone).is_some());
    assert!(
        c.local
            .calls_of(Verb::FetchCheckpoint)
            .iter()
            .any(|call| call.key.as_deref() == Some(snap.as_str()))
    );
    assert!(
        c.local
            .fetches()
            .contains(&(snap.clone(), CheckpointFetch::Whole)),
        "clones read a whole checkpoint: {:?}",
        c.local.fetches()
    );

    // n1 comes back: what the moved sandbox left there (its kept slot, its checkpoint) goes.
    n1_control
        .heartbeat(&beat(n1.status().await))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while n1.checkpoint(&key).is_some() {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", n1.calls());
        c.lc.reconcile().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events =
        c.lc.diagnostics_events(&paused, "all")
            .unwrap()
            .content
            .unwrap();
    assert!(events.contains("Cleaned"), "{events}");
    assert!(
        n1.sandbox(&paused).is_none(),
        "nothing of it runs on n1: {:?}",
        n1.sandbox(&paused)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_cut_short_by_the_loss_of_its_node_is_paused_again_and_moves() {
    let c = Cluster::start(1_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let (paused, key) = paused_on(&c.lc, &n1).await;
    // The resume reaches n1, and its answer never comes back (n1 is cut off).
    n1.hold(Verb::Resume);
    c.lc.resume(&paused).unwrap();
    tokio::time::timeout(PATIENCE, n1.wait_held(Verb::Resume))
        .await
        .expect("the resume reaches n1");
    assert_eq!(
        c.lc.get(&paused).unwrap().status.state,
        SandboxState::Resuming
    );

    // n1 is lost: whatever the resume started there, its fence froze. The resume in flight
    // is given up, and the sandbox is Paused on its published checkpoint.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);
    until(&c.lc, &paused, SandboxState::Paused).await;
    let status = c.lc.get(&paused).unwrap().status;
    assert_eq!(status.reason.as_deref(), Some(NODE_LOST), "{status:?}");
    // Never Paused yet busy: a resume is taken at once.
    c.lc.resume(&paused).expect("a resume once Paused");
    until(&c.lc, &paused, SandboxState::Running).await;
    assert_eq!(c.lc.node_of_sandbox(&paused).unwrap().node_id(), "local");
    assert!(c.local.sandbox(&paused).is_some_and(|s| s.alive));

    // n1 comes back: the held resume ends late; its answer changes nothing, and what the
    // sandbox left on n1 goes.
    n1.release_all();
    n1_control
        .heartbeat(&beat(n1.status().await))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while n1.checkpoint(&key).is_some() || n1.sandbox(&paused).is_some() {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", n1.calls());
        c.lc.reconcile().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        c.lc.get(&paused).unwrap().status.state,
        SandboxState::Running
    );
    assert_eq!(c.lc.node_of_sandbox(&paused).unwrap().node_id(), "local");
}

/// Long enough for the leases (1 s) of the nodes that do not renew to run out and the nodes
/// to be declared lost, `alive` renewing meanwhile.
async fn lease_runs_out(c: &Cluster, alive: Option<(&FakeNode, &ControlClient)>) {
    for _ in 0..6 {
        if let Some((fake, control)) = alive {
            control.heartbeat(&beat(fake.status().await)).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    c.lc.reconcile().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_moves_twice_has_its_leftovers_on_both_nodes_removed() {
    let c = Cluster::start(1_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let (n2, n2_control, _) = c.join("n2").await;
    // The server's own node is full: the first move can only go to n2.
    let mut fillers = Vec::new();
    while c.local.free_slots() > 0 {
        let id = running_on(&c.lc, &c.local).await;
        fillers.push(id);
    }
    let (paused, key1) = paused_on(&c.lc, &n1).await;
    // n1 stops renewing (n2 goes on) and is lost; the resume moves the sandbox to n2.
    lease_runs_out(&c, Some((&n2, &n2_control))).await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);
    c.lc.resume(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Running).await;
    assert!(n2.sandbox(&paused).is_some_and(|s| s.alive));

    // Paused on n2, which is lost too; room on the server's node, and the next resume moves
    // it there.
    c.lc.pause(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Paused).await;
    let key2 = n2
        .checkpoints()
        .into_iter()
        .find(|k| k.key.starts_with(&format!("pause-{paused}-")))
        .expect("the pause checkpoint on n2")
        .key;
    lease_runs_out(&c, None).await;
    assert_eq!(c.lc.list_nodes()[2].state, NodeState::Lost);
    c.lc.delete(&fillers[0]).unwrap();
    until(&c.lc, &fillers[0], SandboxState::Terminated).await;
    c.lc.resume(&paused).unwrap();
    until(&c.lc, &paused, SandboxState::Running).await;
    assert!(c.local.sandbox(&paused).is_some_and(|s| s.alive));

    // Both come back: what it left on each (a kept slot, a pause checkpoint) goes, and the
    // sandbox runs on.
    for (fake, control) in [(&n1, &n1_control), (&n2, &n2_control)] {
        control.heartbeat(&beat(fake.status().await)).await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while n1.checkpoint(&key1).is_some() || n2.checkpoint(&key2).is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "n1 {:?}, n2 {:?}",
            n1.calls(),
            n2.calls()
        );
        c.lc.reconcile().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(n1.sandbox(&paused).is_none() && n2.sandbox(&paused).is_none());
    let events =
        c.lc.diagnostics_events(&paused, "all")
            .unwrap()
            .content
            .unwrap();
    assert_eq!(events.matches("Cleaned").count(), 2, "{events}");
    assert_eq!(
        c.lc.get(&paused).unwrap().status.state,
        SandboxState::Running
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_of_a_lost_node_expires_and_goes_when_the_node_is_back() {
    let c = Cluster::start(1_000).await;
    let (n1, n1_control, _) = c.join("n1").await;
    let (paused, key) = paused_on(&c.lc, &n1).await;

    // n1 is lost, then the sandbox's time runs out: it expires all the same, so it can no
    // longer be resumed anywhere; nothing is asked of n1 meanwhile.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);
    c.lc.renew(
        &paused,
        chrono::Utc::now() + chrono::Duration::milliseconds(100),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let calls = n1.calls().len();
    c.lc.reconcile().await;
    let record = c.lc.get(&paused).unwrap();
    assert_eq!(record.status.state, SandboxState::Stopping, "{record:?}");
    assert_eq!(record.status.reason.as_deref(), Some("EXPIRED"));
    assert!(
        c.lc.resume(&paused).is_err(),
        "an expired sandbox does not resume"
    );
    assert_eq!(
        n1.calls().len(),
        calls,
        "nothing was asked of the lost node"
    );

    // n1 is back: the sandbox and its checkpoint there go.
    n1_control
        .heartbeat(&beat(n1.status().await))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while c.lc.get(&paused).unwrap().status.state != SandboxState::Terminated
        || n1.checkpoint(&key).is_some()
    {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", n1.calls());
        c.lc.reconcile().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_join_token_never_takes_over_a_name_and_revoked_names_stay_out() {
    let c = Cluster::start(10_000).await;
    let (n1, _, n1_registered) = c.join("n1").await;
    let (_, _, n2_registered) = c.join("n2").await;
    let as_n1 = |credential: &Credential| {
        let control = c.control.clone();
        let credential = credential.clone();
        async move {
            ControlClient::register(
                &control,
                None,
                &credential,
                &Registration {
                    node_id: "n1".into(),
                    url: "http://127.0.0.1:1".into(),
                    proxy_public: "127.0.0.1:8091".into(),
                    tls_pin: None,
                },
            )
            .await
        }
    };
    // The join token, or another node's credential, cannot register as n1.
    let e = refused(as_n1(&c.join).await.unwrap_err());
    assert!(e.to_string().contains("own credential"), "{e}");
    let n2_own: Credential = n2_registered.node_to_server.parse().unwrap();
    let e = refused(as_n1(&n2_own).await.unwrap_err());
    assert!(e.to_string().contains("as itself only"), "{e}");
    // n1 itself can (and gets new credentials).
    let n1_own: Credential = n1_registered.node_to_server.parse().unwrap();
    let again = as_n1(&n1_own).await.expect("n1 registers again");
    assert_ne!(again.node_to_server, n1_registered.node_to_server);
    let e = refused(as_n1(&n1_own).await.unwrap_err());
    assert!(
        e.to_string().contains("401"),
        "the old credential is gone: {e}"
    );

    // Revoked: its name stays out, even with the join token, until forgotten.
    c.lc.revoke_node("n1").unwrap();
    let e = refused(as_n1(&c.join).await.unwrap_err());
    assert!(e.to_string().contains("revoked"), "{e}");
    let newest: Credential = again.node_to_server.parse().unwrap();
    assert!(as_n1(&newest).await.is_err());
    c.lc.revoke_node("n1").unwrap();
    as_n1(&c.join).await.expect("a forgotten name joins anew");
    drop(n1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losses_are_counted_durably_and_told_with_every_renewal() {
    let c = Cluster::start(1_000).await;
    let (n1, control, registered) = c.join("n1").await;
    assert_eq!(
        control
            .heartbeat(&beat(n1.status().await))
            .await
            .unwrap()
            .losses,
        0
    );
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    c.lc.reconcile().await;
    assert_eq!(c.lc.list_nodes()[1].state, NodeState::Lost);
    let renewal = control.heartbeat(&beat(n1.status().await)).await.unwrap();
    assert!(renewal.was_lost);
    assert_eq!(renewal.losses, 1);
    // The count outlives a restart of the server (its lease does not).
    let c = c.restarted(1_000).await;
    let control_url = c.control.clone();
    let own: Credential = registered.node_to_server.parse().unwrap();
    let control = ControlClient::new(&control_url, own).unwrap();
    let renewal = control.heartbeat(&beat(n1.status().await)).await.unwrap();
    assert!(!renewal.was_lost);
    assert_eq!(renewal.losses, 1);
}
