//! The node boundary over HTTP (`fastbox_node_api::remote`), end to end on 127.0.0.1: a real
//! axum server wrapping a `testkit::FakeNode` (or a fake control plane), a real client.
//!
//! - every verb answers through `NodeClient` what the node answers directly, and the node
//!   sees the same arguments (a twin node driven directly is the reference);
//! - errors keep their kind and message; what is not an answer is `Unreachable` (a stopped
//!   server, a node that does not answer in time, an answer that does not parse, the node
//!   refusing the client's credential) or `Failed` (the router's other refusals);
//! - a missing or wrong credential is a 401 that names neither token, and the agent is not
//!   called;
//! - the proxy route streams both ways, carries its path exactly, its side channels
//!   (unsigned, client address) and refusals, strips what it must;
//! - the control routes round-trip likewise, access tokens included.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::response::Response;
use fastbox_api::egress::PolicyStatusResponse;
use fastbox_api::lifecycle::{ErrorResponse, NetworkPolicy, NetworkRule};
use fastbox_api::limits::CgroupLimits;
use fastbox_egress_policy::{Action, EgressPolicy};
use fastbox_node_api::control::{
    AccessApi, AccessToken, EgressApi, EgressApiError, PolicyChange, SandboxAccess, VIA_EGRESS_PORT,
};
use fastbox_node_api::recipe::{GoldenRecipe, Readiness};
use fastbox_node_api::remote::tls::{CertPin, TlsIdentity, serve_tls};
use fastbox_node_api::remote::{
    CREDENTIAL_HEADER, ControlClient, Credential, NodeClient, REFUSAL_HEADER, SingleNode, Timeouts,
    control_router, node_router,
};
use fastbox_node_api::testkit::{FakeNode, Verb};
use fastbox_node_api::wire::*;
use fastbox_node_api::{NodeAgent, NodeError, NodeErrorKind, NodeResult};
use futures::{SinkExt, StreamExt};
use http::{HeaderMap, HeaderName, Method, Request, StatusCode, header};

const IMAGE: &str = "python:3.12";
const NODE: &str = "node-7";

// A server on its own runtime, so stopping it drops every connection it holds.

struct TestServer {
    addr: SocketAddr,
    scheme: &'static str,
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    fn start(router: Router) -> Self {
        Self::serving(router, None)
    }

    /// Over TLS, presenting `identity`.
    fn start_tls(router: Router, identity: &TlsIdentity) -> Self {
        Self::serving(router, Some(identity.acceptor().unwrap()))
    }

    fn serving(router: Router, tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.spawn(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                match tls {
                    Some(acceptor) => {
                        let (_never, stop) = tokio::sync::watch::channel(false);
                        serve_tls(listener, acceptor, router, stop).await.unwrap();
                    }
                    None => {
                        let service = router.into_make_service_with_connect_info::<SocketAddr>();
                        axum::serve(listener, service).await.unwrap();
                    }
                }
            });
            let _ = stop_rx.recv();
            rt.shutdown_background();
        });
        Self {
            addr: addr_rx.recv().unwrap(),
            scheme,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn quick_timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(2),
        quick: Duration::from_millis(500),
        moderate: Duration::from_secs(5),
        long: Duration::from_secs(5),
        build: Duration::from_secs(5),
    }
}

fn client(url: &str, credential: &Credential) -> NodeClient {
    NodeClient::new(NODE, url, credential.clone(), quick_timeouts()).unwrap()
}

// A FakeNode that notes every call's arguments in full and whose proxy can echo.

/// What the proxy of a [`Spy`] was handed.
#[derive(Debug, Clone)]
struct Proxied {
    id: String,
    port: u16,
    path: String,
    unsigned: Unsigned,
    strip: Vec<HeaderName>,
    method: Method,
    query: Option<String>,
    headers: HeaderMap,
    client: Option<SocketAddr>,
}

struct Spy {
    node: FakeNode,
    args: Mutex<Vec<String>>,
    proxied: Mutex<Vec<Proxied>>,
}

impl Spy {
    fn new() -> Self {
        Self {
            node: FakeNode::new(4).with_node_id(NODE).with_image(IMAGE),
            args: Mutex::new(Vec::new()),
            proxied: Mutex::new(Vec::new()),
        }
    }

    fn note(&self, line: String) {
        self.args.lock().unwrap().push(line);
    }

    fn args(&self) -> Vec<String> {
        self.args.lock().unwrap().clone()
    }

    fn proxied(&self) -> Vec<Proxied> {
        self.proxied.lock().unwrap().clone()
    }
}

#[async_trait]
impl NodeAgent for Spy {
    fn node_id(&self) -> &str {
        self.node.node_id()
    }

    async fn admit(&self) -> NodeResult<u32> {
        self.note("admit".into());
        self.node.admit().await
    }

    async fn release_slot(&self, slot: u32) {
        self.note(format!("release_slot {slot}"));
        self.node.release_slot(slot).await
    }

    async fn release_unused_admission(&self, slot: u32, min_age_ms: u64) -> bool {
        self.note(format!("release_unused_admission {slot} {min_age_ms}"));
        self.node.release_unused_admission(slot, min_age_ms).await
    }

    async fn claim_slot(&self, slot: u32) {
        self.note(format!("claim_slot {slot}"));
        self.node.claim_slot(slot).await
    }

    fn check_image(&self, reference: &str) -> NodeResult<()> {
        self.node.check_image(reference)
    }

    async fn resolve_image(
        &self,
        reference: &str,
        auth: Option<RegistryCredentials>,
    ) -> NodeResult<ImageInfo> {
        let auth = auth.map(|a| (a.username.clone(), a.password.clone()));
        self.note(format!("resolve_image {reference} {auth:?}"));
        self.node.resolve_image(reference, None).await
    }

    async fn place(&self, spec: PlaceSpec, slot: u32) -> NodeResult<Placed> {
        self.note(format!("place {spec:?} {slot}"));
        self.node.place(spec, slot).await
    }

    async fn clone_snapshot(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        self.note(format!("clone_snapshot {key} {spec:?} {slot}"));
        self.node.clone_snapshot(key, spec, slot).await
    }

    async fn resume(&self, key: &str, spec: RestoreSpec, slot: u32) -> NodeResult<Placed> {
        self.note(format!("resume {key} {spec:?} {slot}"));
        self.node.resume(key, spec, slot).await
    }

    async fn is_alive(&self, placement: &NodePlacement) -> bool {
        self.note(format!("is_alive {placement:?}"));
        self.node.is_alive(placement).await
    }

    async fn adopt(
        &self,
        id: &str,
        placement: &NodePlacement,
        tokens: &SandboxTokens,
        policy: &EgressPolicy,
        credential_proxy: bool,
    ) -> Adoption {
        self.note(format!("adopt {id} {placement:?} {tokens:?} {policy:?}"));
        self.node
            .adopt(id, placement, tokens, policy, credential_proxy)
            .await
    }

    async fn remove(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: Option<u32>,
    ) -> NodeResult<RemoveReport> {
        self.note(format!("remove {id} {placement:?} {slot:?}"));
        self.node.remove(id, placement, slot).await
    }

    async fn release_keeping_address(
        &self,
        id: &str,
        placement: Option<&NodePlacement>,
        slot: u32,
    ) -> NodeResult<()> {
        self.note(format!("release_keeping_address {id} {placement:?} {slot}"));
        self.node.release_keeping_address(id, placement, slot).await
    }

    async fn pause(&self, id: &str, source: &SnapshotSource) -> NodeResult<SnapshotReport> {
        self.note(format!("pause {id} {source:?}"));
        self.node.pause(id, source).await
    }

    async fn finish_interrupted_pause(&self, source: &SnapshotSource) -> bool {
        self.note(format!("finish_interrupted_pause {source:?}"));
        self.node.finish_interrupted_pause(source).await
    }

    async fn stage_snapshot(&self, source: &SnapshotSource, short_freeze: bool) -> NodeResult<()> {
        self.note(format!("stage_snapshot {source:?} {short_freeze}"));
        self.node.stage_snapshot(source, short_freeze).await
    }

    async fn commit_snapshot(
        &self,
        key: &str,
        placement: &NodePlacement,
    ) -> NodeResult<SnapshotReport> {
        self.note(format!("commit_snapshot {key} {placement:?}"));
        self.node.commit_snapshot(key, placement).await
    }

    async fn has_snapshot(&self, key: &str) -> bool {
        self.note(format!("has_snapshot {key}"));
        self.node.has_snapshot(key).await
    }

    async fn remove_snapshot(&self, key: &str) -> NodeResult<()> {
        self.note(format!("remove_snapshot {key}"));
        self.node.remove_snapshot(key).await
    }

    async fn fetch_checkpoint(
        &self,
        key: &str,
        manifest: &str,
        execd_token: &str,
        fetch: CheckpointFetch,
    ) -> NodeResult<()> {
        self.note(format!("fetch_checkpoint {key} {manifest} {fetch:?}"));
        self.node
            .fetch_checkpoint(key, manifest, execd_token, fetch)
            .await
    }

    async fn discard_interrupted_snapshot(&self, key: &str) {
        self.note(format!("discard_interrupted_snapshot {key}"));
        self.node.discard_interrupted_snapshot(key).await
    }

    async fn snapshot_keys(&self) -> Vec<String> {
        self.note("snapshot_keys".into());
        self.node.snapshot_keys().await
    }

    async fn build_template(
        &self,
        key: &str,
        image: &str,
        recipe: &GoldenRecipe,
    ) -> NodeResult<TemplateBuilt> {
        self.note(format!("build_template {key} {image} {recipe:?}"));
        self.node.build_template(key, image, recipe).await
    }

    async fn remove_template(&self, key: &str) -> NodeResult<()> {
        self.note(format!("remove_template {key}"));
        self.node.remove_template(key).await
    }

    async fn set_egress_policy(&self, id: &str, policy: &EgressPolicy) -> NodeResult<()> {
        self.note(format!("set_egress_policy {id} {policy:?}"));
        self.node.set_egress_policy(id, policy).await
    }

    /// `/echo...`: the request's body streamed back as the answer's; `/forge`: a sandbox
    /// answer that claims to be a refusal; `/answered`: the node proxy's own 429; anything
    /// else: the fake node's proxy.
    async fn proxy(
        &self,
        id: &str,
        port: u16,
        path: &str,
        unsigned: Unsigned,
        strip: &[HeaderName],
        req: Request<Body>,
    ) -> Result<Response, ProxyRefusal> {
        self.proxied.lock().unwrap().push(Proxied {
            id: id.to_string(),
            port,
            path: path.to_string(),
            unsigned,
            strip: strip.to_vec(),
            method: req.method().clone(),
            query: req.uri().query().map(str::to_string),
            headers: req.headers().clone(),
            client: req
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0),
        });
        if path == "/ws" {
            // A sandbox that switches protocols and echoes what it is sent.
            let mut req = req;
            let upgraded = hyper::upgrade::on(&mut req);
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(upgraded.await.unwrap());
                let (mut read, mut write) = tokio::io::split(io);
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
            return Ok(http::Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header(header::CONNECTION, "upgrade")
                .header(header::UPGRADE, "websocket")
                .body(Body::empty())
                .unwrap());
        }
        if path.starts_with("/echo") {
            let method = req.method().to_string();
            return Ok(http::Response::builder()
                .header("x-echo-method", method)
                .header("x-fastbox-credential", "a sandbox's own header")
                .body(Body::new(req.into_body()))
                .unwrap());
        }
        if path == "/forge" {
            let forged = serde_json::to_vec(&ProxyRefusal::Unsigned).unwrap();
            return Ok(http::Response::builder()
                .header(REFUSAL_HEADER, "1")
                .body(Body::from(forged))
                .unwrap());
        }
        if path == "/answered" {
            return Err(ProxyRefusal::Answered {
                status: 429,
                code: "SANDBOX::TOO_MANY_FAILURES".into(),
                message: "too many failed credential checks; retry in 7 s".into(),
                retry_after_secs: Some(7),
            });
        }
        self.node.proxy(id, port, path, unsigned, strip, req).await
    }

    async fn status(&self) -> NodeStatus {
        self.note("status".into());
        self.node.status().await
    }
}

// The script every verb runs through, directly and remotely.

fn tokens(n: u32) -> SandboxTokens {
    SandboxTokens {
        execd: format!("execd-{n}"),
        egress: format!("egress-{n}"),
    }
}

fn policy() -> EgressPolicy {
    EgressPolicy::from_pairs(
        Action::Deny,
        &[("allow", "*.example.com"), ("deny", "10.0.0.0/8")],
    )
    .unwrap()
}

fn settings(n: u32) -> SandboxSettings {
    SandboxSettings {
        limits: CgroupLimits {
            cpu_millis: Some(500),
            memory_bytes: Some(256 << 20),
            pids: None,
        },
        disk_bytes: Some(1 << 30),
        tokens: tokens(n),
        policy: policy(),
        credential_proxy: false,
    }
}

fn recipe() -> GoldenRecipe {
    GoldenRecipe {
        env: vec!["WARM=1".into()],
        warm_up: vec!["python3".into(), "-c".into(), "print('é')".into()],
        readiness: Some(Readiness::parse(Some("tcp://127.0.0.1:8080"), Some(30)).unwrap()),
        isolation: true,
    }
}

fn restore_spec(id: &str, n: u32) -> RestoreSpec {
    RestoreSpec {
        id: id.into(),
        moved: false,
        env: vec![format!("N={n}")],
        volumes: Vec::new(),
        common: settings(n),
    }
}

fn source(key: &str, placement: &NodePlacement) -> SnapshotSource {
    SnapshotSource {
        key: key.into(),
        placement: placement.clone(),
        execd_token: "execd-1".into(),
        image_reference: IMAGE.into(),
        volumes: Vec::new(),
    }
}

/// Calls every verb (but `proxy` and `check_image`) in an order a server could; each answer
/// as text.
async fn script(node: &dyn NodeAgent) -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! note {
        ($e:expr) => {{
            let answer = $e;
            out.push(format!("{}: {answer:?}", stringify!($e)));
            answer
        }};
    }
    let auth = RegistryCredentials {
        username: "user".into(),
        password: "pass word".into(),
    };
    let image = note!(node.resolve_image(IMAGE, Some(auth)).await).unwrap();
    note!(node.resolve_image("nowhere/unknown:1", None).await).unwrap_err();
    let slot = note!(node.admit().await).unwrap();
    let spec = PlaceSpec {
        id: "sbx-1".into(),
        image,
        template: Some(TemplateChoice {
            key: "tpl-1".into(),
            recipe: recipe(),
        }),
        use_pool: false,
        entrypoint: vec!["sh".into(), "-c".into(), "sleep 1; echo \"x\"".into()],
        env: vec!["A=1".into(), "B=ü".into()],
        volumes: Vec::new(),
        volume_keys: Default::default(),
        isolation: true,
        common: settings(1),
    };
    let first = note!(node.place(spec, slot).await).unwrap().placement;
    note!(node.is_alive(&first).await);
    note!(
        node.set_egress_policy("sbx-1", &EgressPolicy::deny_all())
            .await
    )
    .unwrap();
    note!(node.set_egress_policy("nobody", &policy()).await).unwrap_err();
    note!(node.stage_snapshot(&source("snap-1", &first), true).await).unwrap();
    note!(node.commit_snapshot("snap-1", &first).await).unwrap();
    note!(node.commit_snapshot("snap-1", &first).await).unwrap_err();
    note!(node.has_snapshot("snap-1").await);
    note!(node.snapshot_keys().await);
    let slot = note!(node.admit().await).unwrap();
    let clone = note!(
        node.clone_snapshot("snap-1", restore_spec("sbx-2", 2), slot)
            .await
    );
    let clone = clone.unwrap().placement;
    let pause = source("pause-2", &clone);
    note!(node.pause("sbx-2", &pause).await).unwrap();
    note!(node.finish_interrupted_pause(&pause).await);
    note!(
        node.release_keeping_address("sbx-2", Some(&clone), clone.slot)
            .await
    )
    .unwrap();
    let resumed = note!(
        node.resume("pause-2", restore_spec("sbx-2", 2), clone.slot)
            .await
    );
    let resumed = resumed.unwrap().placement;
    note!(
        node.adopt("sbx-2", &resumed, &tokens(3), &policy(), false)
            .await
    );
    note!(
        node.adopt("ghost", &first, &tokens(4), &policy(), true)
            .await
    );
    note!(node.discard_interrupted_snapshot("snap-1").await);
    note!(node.remove_snapshot("pause-2").await).unwrap();
    note!(
        node.fetch_checkpoint(
            "pause-9",
            "fake-manifest-pause-9",
            "t",
            CheckpointFetch::MemoryOnFault
        )
        .await
    )
    .unwrap();
    note!(node.has_snapshot("pause-9").await);
    note!(node.build_template("tpl-1", IMAGE, &recipe()).await).unwrap();
    note!(node.build_template("tpl-2", "nowhere/x", &recipe()).await).unwrap_err();
    note!(node.remove_template("tpl-1").await).unwrap();
    note!(node.remove("sbx-1", Some(&first), None).await).unwrap();
    note!(node.remove("sbx-2", None, Some(resumed.slot)).await).unwrap();
    let slot = note!(node.admit().await).unwrap();
    note!(node.release_slot(slot).await);
    let unused = node.admit().await.unwrap();
    note!(node.release_unused_admission(unused, 3_600_000).await);
    note!(node.release_unused_admission(unused, 0).await);
    note!(node.claim_slot(slot).await);
    note!(node.is_alive(&first).await);
    note!(node.status().await);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verb_round_trips() {
    let direct = Spy::new();
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    assert_eq!(remote.node_id(), NODE);

    let expected = script(&direct).await;
    let got = script(&remote).await;
    assert_eq!(got, expected);
    // The same arguments reached the node, and left it in the same state.
    assert_eq!(served.args(), direct.args());
    assert_eq!(served.node.calls(), direct.node.calls());
    assert_eq!(served.node.sandboxes(), direct.node.sandboxes());
    assert_eq!(served.node.checkpoints(), direct.node.checkpoints());
    assert_eq!(served.node.slots(), direct.node.slots());
    assert!(
        served.node.violations().is_empty(),
        "{:?}",
        served.node.violations()
    );
    // Every verb with a route was called.
    let verbs: BTreeSet<Verb> = served.node.calls().iter().map(|c| c.verb).collect();
    let all: BTreeSet<Verb> = [
        Verb::Admit,
        Verb::ReleaseSlot,
        Verb::ClaimSlot,
        Verb::ReleaseUnusedAdmission,
        Verb::ResolveImage,
        Verb::Place,
        Verb::CloneSnapshot,
        Verb::Resume,
        Verb::IsAlive,
        Verb::Adopt,
        Verb::Remove,
        Verb::ReleaseKeepingAddress,
        Verb::Pause,
        Verb::FinishInterruptedPause,
        Verb::StageSnapshot,
        Verb::CommitSnapshot,
        Verb::HasSnapshot,
        Verb::FetchCheckpoint,
        Verb::RemoveSnapshot,
        Verb::DiscardInterruptedSnapshot,
        Verb::SnapshotKeys,
        Verb::BuildTemplate,
        Verb::RemoveTemplate,
        Verb::SetEgressPolicy,
        Verb::Status,
    ]
    .into();
    assert_eq!(verbs, all);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_keep_their_kind_and_message() {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    for kind in [
        NodeErrorKind::NoCapacity,
        NodeErrorKind::BadImage,
        NodeErrorKind::NotFound,
        NodeErrorKind::Failed,
        NodeErrorKind::Unreachable,
    ] {
        let injected = NodeError::new(kind, format!("{kind:?}: \"quoted\", ünïcode\nnewline"));
        served.node.fail_next(Verb::Admit, injected.clone());
        assert_eq!(remote.admit().await.unwrap_err(), injected);
        served
            .node
            .fail_next(Verb::RemoveSnapshot, injected.clone());
        assert_eq!(remote.remove_snapshot("k").await.unwrap_err(), injected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_image_is_the_nodes_own_syntax_check_without_a_call() {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    for good in [
        IMAGE,
        "docker.io/library/busybox:1.36",
        "recipe:busybox",
        "/srv/rootfs",
    ] {
        remote.check_image(good).unwrap();
    }
    let config = fastbox_image::ImageConfig::default();
    for bad in ["", "Not An Image", "recipe:nope", "dir:"] {
        let e = remote.check_image(bad).unwrap_err();
        assert_eq!(e.kind, NodeErrorKind::BadImage, "{bad}");
        let expected = fastbox_image::ImageSource::parse(bad, &config).unwrap_err();
        assert_eq!(e.message, expected.to_string());
    }
    assert!(served.node.calls().is_empty());
}

/// A raw call of a route, as anyone on the network could make it.
async fn raw(url: &str, credential: Option<&str>) -> (StatusCode, HeaderMap, String) {
    let mut request = reqwest::Client::new().post(url).body("{}");
    if let Some(credential) = credential {
        request = request.header(CREDENTIAL_HEADER, credential);
    }
    let response = request.send().await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_wrong_credential_is_401_and_the_node_is_not_called() {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let wrong = Credential::generate().unwrap();
    let secret = credential.to_string();
    for route in [
        "/node/v1/admit",
        "/node/v1/status",
        "/node/v1/nonsense",
        "/node/v1/proxy/sbx/8080/%2Fecho",
    ] {
        let url = format!("{}{route}", server.url());
        for (presented, code) in [
            (None, "MISSING_CREDENTIAL"),
            (Some(wrong.to_string()), "INVALID_CREDENTIAL"),
            (Some(secret[..63].to_string()), "INVALID_CREDENTIAL"),
            (Some(secret.to_uppercase()), "INVALID_CREDENTIAL"),
            (Some(format!("Bearer {secret}")), "INVALID_CREDENTIAL"),
        ] {
            let (status, headers, body) = raw(&url, presented.as_deref()).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{route} {body}");
            let envelope: ErrorResponse = serde_json::from_str(&body).unwrap();
            assert_eq!(envelope.code, code);
            assert!(!body.contains(&secret[..16]), "{body}");
            assert!(!body.contains(&wrong.to_string()[..16]), "{body}");
            assert_eq!(headers[REFUSAL_HEADER], "1");
        }
    }
    assert!(served.args().is_empty());
    assert!(served.proxied().is_empty());
    assert!(served.node.calls().is_empty());

    // The client with the wrong credential: the node refused the call, nothing was done,
    // and the node is of no use to this client (the server answers 503).
    let stranger = client(&server.url(), &wrong);
    let e = stranger.admit().await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(
        e.message.contains("refused this server's credential"),
        "{e}"
    );
    assert!(
        e.message.contains(NODE) && e.message.contains("admit"),
        "{e}"
    );
    assert!(e.message.contains("INVALID_CREDENTIAL"), "{e}");
    let refused = stranger
        .proxy(
            "sbx",
            80,
            "/echo",
            Unsigned::Allowed,
            &[],
            Request::new(Body::empty()),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ProxyRefusal::Upstream(m) if m.contains("INVALID_CREDENTIAL")),
        "{refused:?}"
    );
    assert!(served.node.calls().is_empty());
    assert!(served.proxied().is_empty());

    // The right one passes.
    let (status, _, body) = raw(&format!("{}/node/v1/admit", server.url()), Some(&secret)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, r#"{"Ok":0}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_own_refusals() {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let secret = credential.to_string();
    let post = |route: &str, body: &'static str| {
        reqwest::Client::new()
            .post(format!("{}{route}", server.url()))
            .header(CREDENTIAL_HEADER, &secret)
            .body(body)
            .send()
    };
    let response = post("/node/v1/nonsense", "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    let envelope: ErrorResponse = response.json().await.unwrap();
    assert_eq!(envelope.code, "NODE::UNKNOWN_VERB");
    let response = post("/node/v1/place", r#"{"slot": 1}"#).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let envelope: ErrorResponse = response.json().await.unwrap();
    assert_eq!(envelope.code, "NODE::BAD_REQUEST");
    assert!(envelope.message.contains("place"), "{}", envelope.message);
    let big = vec![b' '; (16 << 20) + 1];
    let response = reqwest::Client::new()
        .post(format!("{}/node/v1/status", server.url()))
        .header(CREDENTIAL_HEADER, &secret)
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(served.node.calls().is_empty());
    // The proxy route without its Unsigned header, or with a broken path.
    for (route, unsigned) in [
        ("/node/v1/proxy/sbx/80/%2Fecho", None),
        ("/node/v1/proxy/sbx/80/%2Fecho", Some("maybe")),
        ("/node/v1/proxy/sbx/x/%2Fecho", Some("allowed")),
        ("/node/v1/proxy/sbx/80/%zz", Some("allowed")),
        ("/node/v1/proxy/sbx/80/a/b", Some("allowed")),
    ] {
        let mut request = reqwest::Client::new()
            .get(format!("{}{route}", server.url()))
            .header(CREDENTIAL_HEADER, &secret);
        if let Some(unsigned) = unsigned {
            request = request.header("x-fastbox-unsigned", unsigned);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{route}");
        assert_eq!(response.headers()[REFUSAL_HEADER], "1");
    }
    assert!(served.proxied().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_is_unreachable_within_the_timeout() {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let mut server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    assert_eq!(remote.admit().await.unwrap(), 0);
    server.stop();
    let started = Instant::now();
    let e = remote.admit().await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(
        e.message.contains(NODE) && e.message.contains("admit"),
        "{e}"
    );
    let e = remote
        .place(
            PlaceSpec {
                id: "x".into(),
                image: served.node.add_image(IMAGE, &[]),
                template: None,
                use_pool: true,
                entrypoint: vec![],
                env: vec![],
                volumes: Vec::new(),
                volume_keys: Default::default(),
                isolation: false,
                common: settings(1),
            },
            0,
        )
        .await
        .unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(e.message.contains("place"), "{e}");
    // What destroys nothing, for the verbs that cannot say.
    let placement = NodePlacement {
        slot: 0,
        address: FakeNode::address_of(0),
        handle: NodeHandle::default(),
    };
    assert!(remote.is_alive(&placement).await);
    assert_eq!(
        remote
            .adopt("x", &placement, &tokens(1), &policy(), false)
            .await,
        Adoption::Adopted
    );
    assert!(!remote.has_snapshot("k").await);
    assert!(remote.snapshot_keys().await.is_empty());
    let status = remote.status().await;
    assert_eq!((status.node_id.as_str(), status.free_slots), (NODE, 0));
    let refused = remote
        .proxy(
            "sbx",
            80,
            "/",
            Unsigned::Allowed,
            &[],
            Request::new(Body::empty()),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, ProxyRefusal::Upstream(m) if m.contains(NODE)),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_does_not_answer_in_time_is_unreachable() {
    // Held by the node: the answer never comes within the quick timeout.
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    served.node.hold(Verb::Admit);
    let started = Instant::now();
    let e = remote.admit().await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(e.message.contains("no answer within 0.5 s"), "{e}");
    assert!(
        e.message.contains(NODE) && e.message.contains("admit"),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(3),
        "{took:?}"
    );
    served.node.release_all();

    // A listener that never answers: accepted by the kernel, never read.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let remote = client(
        &format!("http://{}", silent.local_addr().unwrap()),
        &credential,
    );
    let started = Instant::now();
    let e = remote.status().await;
    assert_eq!(e.free_slots, 0);
    let e = remote.admit().await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_are_not_answers() {
    let credential = Credential::generate().unwrap();
    let router = Router::new()
        .route("/node/v1/admit", axum::routing::post(async || "not json"))
        .route(
            "/node/v1/remove_template",
            axum::routing::post(async || vec![b'x'; (16 << 20) + 1]),
        )
        .route(
            "/node/v1/remove_snapshot",
            axum::routing::post(async || (StatusCode::BAD_GATEWAY, "proxy in the way")),
        )
        .route(
            "/node/v1/release_keeping_address",
            axum::routing::post(async || (StatusCode::CONFLICT, "no")),
        );
    let server = TestServer::start(router);
    let remote = client(&server.url(), &credential);
    let e = remote.admit().await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(e.message.contains("does not parse"), "{e}");
    let e = remote.remove_template("k").await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(e.message.contains("over 16777216 bytes"), "{e}");
    let e = remote.remove_snapshot("k").await.unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Unreachable);
    assert!(
        e.message.contains("502") && e.message.contains("proxy in the way"),
        "{e}"
    );
    let e = remote
        .release_keeping_address("x", None, 1)
        .await
        .unwrap_err();
    assert_eq!(e.kind, NodeErrorKind::Failed);
    assert!(e.message.contains("409"), "{e}");
}

// The proxy route.

fn proxy_server() -> (Arc<Spy>, TestServer, NodeClient) {
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let server = TestServer::start(node_router(served.clone(), credential.clone()));
    let remote = client(&server.url(), &credential);
    (served, server, remote)
}

async fn body_text(response: Response) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_streams_a_body_both_ways() {
    let (served, _server, remote) = proxy_server();
    let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let req = Request::builder()
        .method(Method::PUT)
        .uri("/upload?x=1")
        .body(Body::from_stream(rx))
        .unwrap();
    let response = remote
        .proxy("sbx", 8080, "/echo", Unsigned::Allowed, &[], req)
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-echo-method"], "PUT");
    // Each chunk comes back before the next one is sent: nothing waits for the whole body.
    let mut answer = response.into_body().into_data_stream();
    for chunk in ["one", "two", "three"] {
        tx.send(Ok(Bytes::from(chunk))).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(5), answer.next())
            .await
            .expect("the chunk came back before the body ended")
            .unwrap()
            .unwrap();
        assert_eq!(back, chunk);
    }
    drop(tx);
    assert!(answer.next().await.is_none());
    assert_eq!(served.proxied()[0].method, Method::PUT);

    // A body larger than any verb's, whole.
    let big: Vec<u8> = (0..(20u32 << 20)).map(|i| (i % 251) as u8).collect();
    let req = Request::builder()
        .method(Method::POST)
        .header(header::CONTENT_LENGTH, big.len())
        .body(Body::from(big.clone()))
        .unwrap();
    let response = remote
        .proxy("sbx", 8080, "/echo/big", Unsigned::Allowed, &[], req)
        .await
        .unwrap();
    assert_eq!(
        response.headers()[header::CONTENT_LENGTH],
        big.len().to_string()
    );
    let back = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert!(back == big, "the echo differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_carries_its_route_headers_and_client_exactly() {
    let (served, _server, remote) = proxy_server();
    let api_key = HeaderName::from_static("open-sandbox-api-key");
    let path = "/echo/../../../node/v1/remove/%2e%2e/ü ?#";
    let client_addr: SocketAddr = "203.0.113.9:40123".parse().unwrap();
    let mut req = Request::builder()
        .method(Method::GET)
        .uri("/v1/sandboxes/sbx/proxy/8080/x?b=2&a=%20")
        .header(header::HOST, "fastbox.example:8090")
        .header(header::AUTHORIZATION, "Bearer the-apps-own")
        .header(&api_key, "the server's key")
        .header(CREDENTIAL_HEADER, "forged")
        .header("x-fastbox-client", "198.51.100.1:1")
        .header("x-fastbox-unsigned", "allowed")
        .header(header::CONNECTION, "keep-alive, x-hop")
        .header("x-hop", "1")
        .body(Body::empty())
        .unwrap();
    req.extensions_mut().insert(ConnectInfo(client_addr));
    let response = remote
        .proxy(
            "sbx/1",
            8080,
            path,
            Unsigned::Refused,
            std::slice::from_ref(&api_key),
            req,
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // The sandbox's own headers pass, whatever their names.
    assert_eq!(
        response.headers()[CREDENTIAL_HEADER],
        "a sandbox's own header"
    );
    let seen = served.proxied().pop().unwrap();
    assert_eq!(
        (seen.id.as_str(), seen.port, seen.path.as_str()),
        ("sbx/1", 8080, path)
    );
    assert_eq!(seen.unsigned, Unsigned::Refused);
    assert!(
        seen.strip.is_empty(),
        "stripped by the client: {:?}",
        seen.strip
    );
    assert_eq!(seen.query.as_deref(), Some("b=2&a=%20"));
    assert_eq!(seen.client, Some(client_addr));
    let h = &seen.headers;
    assert_eq!(h[header::AUTHORIZATION], "Bearer the-apps-own");
    assert_eq!(h["x-forwarded-host"], "fastbox.example:8090");
    for gone in [
        api_key.as_str(),
        CREDENTIAL_HEADER,
        "x-fastbox-client",
        "x-fastbox-unsigned",
        "x-hop",
    ] {
        assert!(
            !h.contains_key(gone),
            "{gone} reached the node's agent: {h:?}"
        );
    }

    // Without a client address, a forged one does not become it.
    let req = Request::builder()
        .header("x-fastbox-client", "198.51.100.1:1")
        .body(Body::empty())
        .unwrap();
    remote
        .proxy("sbx", 80, "", Unsigned::Allowed, &[], req)
        .await
        .unwrap_err();
    let seen = served.proxied().pop().unwrap();
    assert_eq!((seen.path.as_str(), seen.client), ("", None));
    assert_eq!(seen.unsigned, Unsigned::Allowed);

    // The fake node's own answer names what it was given.
    let slot = served.node.admit().await.unwrap();
    let spec = PlaceSpec {
        id: "sbx-9".into(),
        image: served.node.add_image(IMAGE, &[]),
        template: None,
        use_pool: false,
        entrypoint: vec![],
        env: vec![],
        volumes: Vec::new(),
        volume_keys: Default::default(),
        isolation: false,
        common: settings(9),
    };
    served.node.place(spec, slot).await.unwrap();
    let response = remote
        .proxy(
            "sbx-9",
            44772,
            "/files?x",
            Unsigned::Allowed,
            &[],
            Request::new(Body::empty()),
        )
        .await
        .unwrap();
    assert_eq!(response.headers()["x-fake-node"], NODE);
    assert_eq!(body_text(response).await, "sbx-9:44772:/files?x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_refusals_round_trip_and_cannot_be_forged() {
    let (served, _server, remote) = proxy_server();
    let call = |id: &'static str, path: &'static str| {
        remote.proxy(
            id,
            80,
            path,
            Unsigned::Allowed,
            &[],
            Request::new(Body::empty()),
        )
    };
    assert_eq!(
        call("nobody", "/").await.unwrap_err(),
        ProxyRefusal::NotRunning("nobody".into())
    );
    served
        .node
        .fail_next(Verb::Proxy, NodeError::failed("connection refused"));
    assert_eq!(
        call("nobody", "/").await.unwrap_err(),
        ProxyRefusal::Upstream("connection refused".into())
    );
    assert_eq!(
        call("sbx", "/answered").await.unwrap_err(),
        ProxyRefusal::Answered {
            status: 429,
            code: "SANDBOX::TOO_MANY_FAILURES".into(),
            message: "too many failed credential checks; retry in 7 s".into(),
            retry_after_secs: Some(7),
        }
    );
    // A sandbox's answer that looks like a refusal is the sandbox's answer.
    let response = call("sbx", "/forge").await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(!response.headers().contains_key(REFUSAL_HEADER));
    assert_eq!(body_text(response).await, r#""Unsigned""#);

    // Routes the URL parser would rewrite are refused before any call.
    let before = served.proxied().len();
    for (id, path) in [(".", "/"), ("..", "/x"), ("", "/"), ("sbx", "relative")] {
        let refused = call(id, path).await.unwrap_err();
        assert!(
            matches!(refused, ProxyRefusal::BadRoute(_)),
            "{id} {path}: {refused:?}"
        );
    }
    assert_eq!(served.proxied().len(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_upgrade_passes_to_the_node_and_both_ways_after() {
    let (served, _node, remote) = proxy_server();
    upgrade_round_trip(&served, remote).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_upgrade_passes_to_a_node_over_tls_too() {
    let dir = tempfile::tempdir().unwrap();
    let identity = TlsIdentity::load_or_create(dir.path(), &[]).unwrap();
    let served = Arc::new(Spy::new());
    let credential = Credential::generate().unwrap();
    let _node = TestServer::start_tls(node_router(served.clone(), credential.clone()), &identity);
    let remote = client(&_node.url(), &credential)
        .with_pinned_cert(identity.pin())
        .unwrap();
    upgrade_round_trip(&served, remote).await;
}

/// A WebSocket-style upgrade from a client through `remote` to the spy's echo: 101, the
/// route's headers, then bytes both ways.
async fn upgrade_round_trip(served: &Spy, remote: NodeClient) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let remote = Arc::new(remote);
    // The server's side: every request goes to the node as `sbx`'s port 80.
    let front = TestServer::start(Router::new().fallback(move |req: Request<Body>| {
        let remote = remote.clone();
        async move {
            match remote
                .proxy("sbx", 80, "/ws", Unsigned::Allowed, &[], req)
                .await
            {
                Ok(response) => response,
                Err(refused) => http::Response::builder()
                    .status(StatusCode::BAD_GATEWAY)
                    .body(Body::from(format!("{refused:?}")))
                    .unwrap(),
            }
        }
    }));
    let mut stream = tokio::net::TcpStream::connect(front.addr).await.unwrap();
    stream
        .write_all(
            b"GET /chat HTTP/1.1\r\nHost: sandbox\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        stream.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    // The node saw the upgrade with its route headers, the server's own gone.
    let seen = served.proxied().pop().unwrap();
    assert_eq!(seen.headers[header::UPGRADE], "websocket");
    assert!(!seen.headers.contains_key("x-fastbox-credential"));
    // Spliced: bytes go both ways.
    for message in [&b"hello"[..], b"again"] {
        stream.write_all(message).await.unwrap();
        let mut back = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut back))
            .await
            .expect("the echo came back")
            .unwrap();
        assert_eq!(back, message);
    }
}

// TLS: each client accepts the one certificate it was given.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_only_the_pinned_certificate_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let identity = TlsIdentity::load_or_create(&dir.path().join("node"), &[]).unwrap();
    let impostor = TlsIdentity::load_or_create(&dir.path().join("impostor"), &[]).unwrap();
    let node = Arc::new(FakeNode::new(2).with_node_id(NODE));
    let credential = Credential::generate().unwrap();
    let server = TestServer::start_tls(node_router(node.clone(), credential.clone()), &identity);

    let pinned = client(&server.url(), &credential)
        .with_pinned_cert(identity.pin())
        .unwrap();
    let slot = pinned.admit().await.expect("the pinned client is answered");
    pinned.release_slot(slot).await;

    // Another certificate's pin: the handshake fails, nothing reaches the node.
    let calls = node.calls().len();
    let wrong = client(&server.url(), &credential)
        .with_pinned_cert(impostor.pin())
        .unwrap();
    let refused = wrong.admit().await.unwrap_err();
    assert_eq!(refused.kind, NodeErrorKind::Unreachable, "{refused}");
    assert!(refused.message.contains("not the pinned"), "{refused}");
    // No TLS at all, or the public roots: refused too.
    let plain = client(&server.url().replacen("https", "http", 1), &credential);
    assert_eq!(
        plain.admit().await.unwrap_err().kind,
        NodeErrorKind::Unreachable
    );
    let unpinned = client(&server.url(), &credential);
    assert_eq!(
        unpinned.admit().await.unwrap_err().kind,
        NodeErrorKind::Unreachable
    );
    assert_eq!(node.calls().len(), calls, "{:?}", node.calls());
    // A pinned client never falls back to plain HTTP.
    let downgraded = client(&server.url().replacen("https", "http", 1), &credential)
        .with_pinned_cert(identity.pin())
        .unwrap();
    assert!(downgraded.admit().await.is_err());
    assert_eq!(
        CertPin::of_pem_file(identity.cert_path()).unwrap(),
        identity.pin()
    );
}

// The control routes.

#[derive(Default)]
struct FakeControl {
    calls: Mutex<Vec<String>>,
    changes: Mutex<Vec<(String, PolicyChange, String)>>,
    token: Mutex<Option<AccessToken>>,
}

fn answer(mode: &str) -> PolicyStatusResponse {
    PolicyStatusResponse {
        status: Some("ok".into()),
        mode: Some(mode.into()),
        enforcement_mode: Some("dns+nft".into()),
        reason: None,
        policy: Some(NetworkPolicy {
            default_action: Some("deny".into()),
            egress: Some(vec![NetworkRule {
                action: "allow".into(),
                target: "example.com".into(),
            }]),
        }),
    }
}

#[async_trait]
impl EgressApi for FakeControl {
    async fn policy(&self, id: &str) -> Result<PolicyStatusResponse, EgressApiError> {
        self.calls.lock().unwrap().push(format!("policy {id}"));
        match id {
            "sbx" => Ok(answer("enforcing")),
            _ => Err(EgressApiError {
                status: StatusCode::NOT_FOUND,
                code: "SANDBOX::NOT_FOUND",
                message: format!("sandbox {id} not found"),
            }),
        }
    }

    async fn change(
        &self,
        id: &str,
        change: PolicyChange,
        via: &str,
    ) -> Result<PolicyStatusResponse, EgressApiError> {
        self.calls.lock().unwrap().push(format!("change {id}"));
        self.changes
            .lock()
            .unwrap()
            .push((id.to_string(), change.clone(), via.to_string()));
        match change {
            PolicyChange::Delete(_) => Err(EgressApiError {
                status: StatusCode::BAD_REQUEST,
                code: "SANDBOX::INVALID_PARAMETER",
                message: "no such target".into(),
            }),
            _ => Ok(answer("deny_all")),
        }
    }
}

#[async_trait]
impl AccessApi for FakeControl {
    async fn access(&self, id: &str) -> Option<SandboxAccess> {
        self.calls.lock().unwrap().push(format!("access {id}"));
        match id {
            "open" => Some(SandboxAccess::Open),
            "secure" => self
                .token
                .lock()
                .unwrap()
                .clone()
                .map(SandboxAccess::Secure),
            _ => None,
        }
    }
}

fn control_server() -> (Arc<FakeControl>, TestServer, Credential) {
    let control = Arc::new(FakeControl::default());
    *control.token.lock().unwrap() = Some(AccessToken::generate().unwrap());
    let credential = Credential::generate().unwrap();
    let plane = Arc::new(SingleNode {
        node_id: "n1".into(),
        credential: credential.clone(),
    });
    let router = control_router(control.clone(), control.clone(), plane);
    (control, TestServer::start(router), credential)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_routes_round_trip() {
    let (control, server, credential) = control_server();
    let node = ControlClient::new(&server.url(), credential).unwrap();

    assert_eq!(node.policy("sbx").await.unwrap(), answer("enforcing"));
    let e = node.policy("ghost").await.unwrap_err();
    assert_eq!(
        (e.status, e.code, e.message.as_str()),
        (
            StatusCode::NOT_FOUND,
            "SANDBOX::NOT_FOUND",
            "sandbox ghost not found"
        )
    );
    let changes = [
        PolicyChange::Replace(NetworkPolicy {
            default_action: Some("deny".into()),
            egress: None,
        }),
        PolicyChange::Patch(vec![NetworkRule {
            action: "allow".into(),
            target: "*.example.org".into(),
        }]),
        PolicyChange::Delete(vec!["example.com".into()]),
    ];
    for change in changes.clone() {
        let answered = node.change("sbx", change.clone(), VIA_EGRESS_PORT).await;
        match change {
            PolicyChange::Delete(_) => {
                let e = answered.unwrap_err();
                assert_eq!(
                    (e.status, e.code),
                    (StatusCode::BAD_REQUEST, "SANDBOX::INVALID_PARAMETER")
                );
            }
            _ => assert_eq!(answered.unwrap(), answer("deny_all")),
        }
    }
    let recorded = control.changes.lock().unwrap().clone();
    let expected: Vec<_> = changes
        .into_iter()
        .map(|c| ("sbx".to_string(), c, VIA_EGRESS_PORT.to_string()))
        .collect();
    assert_eq!(recorded, expected);

    // Access rules; a secure sandbox's token arrives as itself.
    assert!(matches!(
        node.access("open").await,
        Some(SandboxAccess::Open)
    ));
    assert!(node.access("nobody").await.is_none());
    let token = control.token.lock().unwrap().clone().unwrap();
    let Some(SandboxAccess::Secure(received)) = node.access("secure").await else {
        panic!("not secure");
    };
    assert!(received.matches(token.expose().as_bytes()));
    assert_eq!(received.expose(), token.expose());
    assert!(!format!("{node:?}").contains(token.expose()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_answers_are_kept_briefly() {
    let (control, server, credential) = control_server();
    let count = |id: &str| {
        let calls = control.calls.lock().unwrap();
        calls
            .iter()
            .filter(|c| *c == &format!("access {id}"))
            .count()
    };
    let cached = ControlClient::new(&server.url(), credential.clone()).unwrap();
    for _ in 0..3 {
        assert!(cached.access("secure").await.is_some());
        assert!(cached.access("nobody").await.is_none());
    }
    assert_eq!((count("secure"), count("nobody")), (1, 3));
    let uncached = ControlClient::new(&server.url(), credential)
        .unwrap()
        .with_access_ttl(Duration::ZERO);
    for _ in 0..3 {
        assert!(uncached.access("secure").await.is_some());
    }
    assert_eq!(count("secure"), 4);
    let brief = ControlClient::new(&server.url(), Credential::generate().unwrap())
        .unwrap()
        .with_access_ttl(Duration::from_millis(50));
    // A wrong credential: refused, so no access (and nothing kept).
    assert!(brief.access("secure").await.is_none());
    assert_eq!(count("secure"), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_routes_need_the_nodes_own_credential() {
    let (control, server, credential) = control_server();
    // The credential the server presents to nodes is another one: it opens nothing here.
    let servers = Credential::generate().unwrap();
    for route in [
        "/control/v1/egress/policy",
        "/control/v1/egress/change",
        "/control/v1/access",
    ] {
        let url = format!("{}{route}", server.url());
        for (presented, code) in [
            (None, "MISSING_CREDENTIAL"),
            (Some(servers.to_string()), "INVALID_CREDENTIAL"),
        ] {
            let (status, _, body) = raw(&url, presented.as_deref()).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{route}");
            let envelope: ErrorResponse = serde_json::from_str(&body).unwrap();
            assert_eq!(envelope.code, code);
            assert!(!body.contains(&credential.to_string()[..16]));
        }
    }
    assert!(control.calls.lock().unwrap().is_empty());
    let stranger = ControlClient::new(&server.url(), servers).unwrap();
    let e = stranger.policy("sbx").await.unwrap_err();
    assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(e.message.contains("INVALID_CREDENTIAL"), "{}", e.message);
    assert!(control.calls.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_control_plane_refuses_access_and_fails_changes() {
    let (_control, mut server, credential) = control_server();
    let node = ControlClient::new(&server.url(), credential).unwrap();
    assert!(node.policy("sbx").await.is_ok());
    server.stop();
    let started = Instant::now();
    let e = node
        .change("sbx", PolicyChange::Delete(vec![]), VIA_EGRESS_PORT)
        .await;
    let e = e.unwrap_err();
    assert_eq!(
        (e.status, e.code),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "SANDBOX::CONTROL_PLANE_UNAVAILABLE"
        )
    );
    assert!(node.access("open").await.is_none());
    assert!(started.elapsed() < Duration::from_secs(5));
}
