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
use fastbox_state::{EtcdBackend, EtcdOptions, StateBackend, StateUrl};
use fastbox_testkit::etcd::EtcdCluster;

pub const IMAGE: &str = "registry.test/app:1";
/// The servers' leases (etcd raises a shorter one to its minimum, about 4 s here).
pub const LEASE: Duration = Duration::from_secs(4);
pub const PATIENCE: Duration = Duration::from_secs(30);

pub struct Server {
    pub lc: Arc<Lifecycle>,
    pub cluster: Arc<Cluster>,
    pub runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
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
        let StateUrl::Etcd(target) =
            StateUrl::parse(&format!("{}/{prefix}", etcd.state_url())).unwrap()
        else {
            unreachable!()
        };
        let backend: Arc<dyn StateBackend> =
            Arc::new(EtcdBackend::connect(target, EtcdOptions::default()).expect("etcd"));
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
        lc.follow_store().expect("follow");
        runtime.spawn(lc.clone().reconcile_forever());
        Server {
            lc,
            cluster,
            runtime,
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
