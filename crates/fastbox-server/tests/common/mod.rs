//! Servers sharing one etcd, each a `Lifecycle` on a runtime of its own over fake nodes
//! (servers.rs, chaos.rs).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use fastbox_api::lifecycle::{CreateSandboxRequest, ImageSpec, SandboxState};
use fastbox_node_api::NodeAgent;
use fastbox_node_api::testkit::FakeNode;
use fastbox_server::cluster::Cluster;
use fastbox_server::config::{ServerConfig, Settings};
use fastbox_server::nodes::Nodes;
use fastbox_server::service::Lifecycle;
use fastbox_server::store::Store;
use fastbox_state::{
    Coordinator, Entry, EtcdBackend, EtcdOptions, Fence, Guard, Holder, LeaseId, Revision,
    StateBackend, StateError, StateUrl,
};
use fastbox_testkit::etcd::EtcdCluster;
use std::sync::atomic::{AtomicBool, Ordering};

pub const IMAGE: &str = "registry.test/app:1";
/// The servers' leases (etcd raises a shorter one to its minimum, about 4 s here).
pub const LEASE: Duration = Duration::from_secs(4);
pub const PATIENCE: Duration = Duration::from_secs(30);

pub struct Server {
    pub lc: Arc<Lifecycle>,
    pub cluster: Arc<Cluster>,
    pub runtime: tokio::runtime::Runtime,
    /// Set: the server's link to etcd is cut (every call fails as unreachable).
    pub cut: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

/// A store whose link can be cut: while `cut` is set, every call fails as etcd unreachable
/// would (after a moment, as a call timing out does).
pub struct Cuttable {
    inner: EtcdBackend,
    cut: Arc<AtomicBool>,
}

impl Cuttable {
    fn check(&self) -> Result<(), StateError> {
        if self.cut.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(200));
            return Err(StateError::Unavailable("the link to etcd is cut".into()));
        }
        Ok(())
    }
}

impl StateBackend for Cuttable {
    fn list(&self, table: &str) -> Result<Vec<Entry>, StateError> {
        self.check()?;
        self.inner.list(table)
    }
    fn get(&self, table: &str, key: &str) -> Result<Option<Entry>, StateError> {
        self.check()?;
        self.inner.get(table, key)
    }
    fn put(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<Revision, StateError> {
        self.check()?;
        self.inner.put(table, key, value, expected, fence)
    }
    fn create_under(
        &self,
        table: &str,
        key: &str,
        value: &[u8],
        guard: &Guard,
    ) -> Result<Revision, StateError> {
        self.check()?;
        self.inner.create_under(table, key, value, guard)
    }
    fn delete(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        fence: Option<&Fence>,
    ) -> Result<(), StateError> {
        self.check()?;
        self.inner.delete(table, key, expected, fence)
    }
    fn delete_under(
        &self,
        table: &str,
        key: &str,
        expected: Revision,
        guard: &Guard,
    ) -> Result<(), StateError> {
        self.check()?;
        self.inner.delete_under(table, key, expected, guard)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    // The watch follows on (a cut link stops the calls the server makes; a watch that
    // stalled catches up from its revision when the link is back, as this one does).
    fn watch(&self, from: Revision) -> Result<Option<fastbox_state::Watch>, StateError> {
        self.inner.watch(from)
    }
    fn coordinator(&self) -> Option<&dyn Coordinator> {
        Some(self)
    }
}

impl Coordinator for Cuttable {
    fn grant(&self, ttl: Duration) -> Result<LeaseId, StateError> {
        self.check()?;
        self.inner.grant(ttl)
    }
    fn keep_alive(&self, lease: LeaseId) -> Result<bool, StateError> {
        self.check()?;
        self.inner.keep_alive(lease)
    }
    fn revoke(&self, lease: LeaseId) -> Result<(), StateError> {
        self.check()?;
        self.inner.revoke(lease)
    }
    fn claim(&self, name: &str, value: &[u8], lease: LeaseId) -> Result<Holder, StateError> {
        self.check()?;
        self.inner.claim(name, value, lease)
    }
    fn claims(&self, prefix: &str) -> Result<Vec<Entry>, StateError> {
        self.check()?;
        self.inner.claims(prefix)
    }
    fn revision(&self) -> Result<Revision, StateError> {
        self.check()?;
        self.inner.revision()
    }
    fn compact(&self, revision: Revision) -> Result<(), StateError> {
        self.check()?;
        self.inner.compact(revision)
    }
}

impl Server {
    pub fn start(id: &str, etcd: &EtcdCluster, prefix: &str, nodes: &[Arc<FakeNode>]) -> Server {
        Self::start_with(id, etcd, prefix, nodes, |_| {})
    }

    pub fn start_with(
        id: &str,
        etcd: &EtcdCluster,
        prefix: &str,
        nodes: &[Arc<FakeNode>],
        tune: impl FnOnce(&mut Settings),
    ) -> Server {
        Self::start_following(id, etcd, prefix, nodes, tune, true)
    }

    /// A server that does not follow the store's watch: its cache holds only what it wrote
    /// or read itself (a server whose watch lags, for as long as a test needs).
    pub fn start_unfollowing(
        id: &str,
        etcd: &EtcdCluster,
        prefix: &str,
        nodes: &[Arc<FakeNode>],
    ) -> Server {
        Self::start_following(id, etcd, prefix, nodes, |_| {}, false)
    }

    fn start_following(
        id: &str,
        etcd: &EtcdCluster,
        prefix: &str,
        nodes: &[Arc<FakeNode>],
        tune: impl FnOnce(&mut Settings),
        follow: bool,
    ) -> Server {
        let StateUrl::Etcd(target) =
            StateUrl::parse(&format!("{}/{prefix}", etcd.state_url())).unwrap()
        else {
            unreachable!()
        };
        let cut = Arc::new(AtomicBool::new(false));
        let backend: Arc<dyn StateBackend> = Arc::new(Cuttable {
            inner: EtcdBackend::connect(target, EtcdOptions::default()).expect("etcd"),
            cut: cut.clone(),
        });
        let cluster = Arc::new(Cluster::join(id, backend.clone(), LEASE).expect("join"));
        cluster.round().expect("first round");
        cluster.run();
        let dir = tempfile::tempdir().unwrap();
        let mut settings = Settings {
            data_dir: Some(dir.path().to_path_buf()),
            cache_dir: Some(dir.path().join("cache")),
            ..Default::default()
        };
        tune(&mut settings);
        let mut cfg = ServerConfig::resolve(settings).expect("config");
        cfg.create_wait = Duration::from_millis(50);
        cfg.reconcile_every = Duration::from_millis(200);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let keys = fastbox_proxy::RouteKeys::load_or_create(&dir.path().join("route-key"))
            .expect("route keys");
        let lc = runtime.block_on(async {
            Lifecycle::in_cluster(
                cfg,
                Store::with_backend(backend),
                Nodes::new(
                    nodes
                        .iter()
                        .map(|n| n.clone() as Arc<dyn NodeAgent>)
                        .collect(),
                )
                .expect("nodes"),
                fastbox_image::ImageConfig::default(),
                keys,
                cluster.clone(),
            )
            .expect("lifecycle")
        });
        if follow {
            lc.follow_store().expect("follow");
        }
        runtime.spawn(lc.clone().reconcile_forever());
        Server {
            lc,
            cluster,
            runtime,
            cut,
            _dir: dir,
        }
    }

    pub fn create(&self) -> String {
        self.runtime
            .block_on(self.lc.create(request()))
            .expect("create")
            .id
    }

    pub fn delete(&self, id: &str) {
        let _in_runtime = self.runtime.enter();
        self.lc.delete(id).expect("delete");
    }

    pub fn state(&self, id: &str) -> Option<SandboxState> {
        self.lc.get(id).ok().map(|s| s.status.state)
    }

    /// A crash: the rounds stop (the lease runs out), every task ends where it is.
    pub fn crash(self) {
        self.cluster.halt();
        self.runtime.shutdown_background();
    }
}

pub fn until(what: &str, mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < PATIENCE,
            "{what}: not within {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    started.elapsed()
}

pub fn request() -> CreateSandboxRequest {
    CreateSandboxRequest {
        image: Some(ImageSpec {
            uri: IMAGE.into(),
            auth: None,
        }),
        entrypoint: Some(vec!["sleep".into(), "infinity".into()]),
        ..Default::default()
    }
}

pub fn fake() -> Arc<FakeNode> {
    Arc::new(FakeNode::new(8).with_image(IMAGE))
}

/// Serves `router` on a loopback port on `runtime`; its base URL.
pub fn serve(runtime: &tokio::runtime::Runtime, router: axum::Router) -> String {
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    runtime.spawn(async move {
        let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, service).await.unwrap();
    });
    url
}
