//! `fastbox up`: the lifecycle server, the node agent and both proxies in one process, with
//! the state store in the data directory. Sandboxes outlive the process: SIGTERM stops
//! serving and leaves them running; the next start re-adopts them.
//!
//! The server reaches its node through `fastbox_node_api::NodeAgent` only; here the
//! in-process node ([`LocalNode`]) is wired in, with its node proxy, whose port-18080 policy
//! changes and access checks call back into the server.
//!
//! The node's artifact store (`fastbox_fastlet::node_store`: a local directory, or an S3
//! origin behind the node block cache and, with peers, DART) is opened right after the state
//! store and before anything touches the host, so an unreachable origin, bad credentials or
//! a missing bucket stop the start with the store's own message. The DART peer server runs
//! until the process stops; the artifact garbage collection runs on its schedule
//! (`fastbox_server::artifact_gc`); both report in `/metrics`
//! (`fastbox_server::metrics::NodeMetrics`).

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use fastbox_artifact::{CacheStats, CachedStoreStats};
use fastbox_fastlet::node_proxy::{self, AccessGuard, NodeProxy};
use fastbox_fastlet::node_store::{NodeStore, NodeStoreError};
use fastbox_fastlet::{Fastlet, FastletConfig, LocalNode, blocking};
use fastbox_image::{ImageConfig, StderrProgress};
use fastbox_node_api::wire::NodePlacement;
use fastbox_proxy::{Forwarder, ForwarderConfig, RouteKeys};
use fastbox_server::artifact_gc::{self, ArtifactCollector};
use fastbox_server::config::{ServerConfig, format_duration};
use fastbox_server::http::{self, AppState};
use fastbox_server::metrics::{self, NodeMetrics, StoreStats};
use fastbox_server::service::{Health, Lifecycle};
use fastbox_server::store::Store;
use tokio::net::TcpListener;

#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error("data directory {path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("route signing key: {0}")]
    Signer(#[from] fastbox_proxy::RouteError),
    #[error(transparent)]
    Store(#[from] fastbox_server::store::StoreError),
    /// Not a `source`: the store's messages carry their causes already.
    #[error("artifact store: {0}")]
    Artifacts(NodeStoreError),
    #[error(transparent)]
    Node(#[from] fastbox_fastlet::FastletError),
    #[error("{0}")]
    Api(#[from] fastbox_server::error::ApiError),
    #[error("server: {0}")]
    Serve(std::io::Error),
}

/// The route signing keys in the data directory (`fastbox route-key` rotates them).
pub const ROUTE_KEY_FILE: &str = "route-signing.key";

/// The in-process node's name.
const LOCAL_NODE_ID: &str = "local";

/// Runs `fastbox up` until SIGTERM or SIGINT. `helper` is the `fastbox` executable itself.
pub async fn run(
    cfg: ServerConfig,
    helper: PathBuf,
    execd_bin: PathBuf,
    criu: fastbox_runtime::criu::Criu,
) -> Result<(), UpError> {
    let started = Instant::now();
    let data_dir = cfg.data_dir.clone();
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&data_dir)
        .map_err(|source| UpError::DataDir {
            path: data_dir.clone(),
            source,
        })?;
    let api_key = api_key(&cfg, &data_dir)?;
    // Followed as it changes: `fastbox route-key rotate` adds a signing key while the server
    // runs, the older keys verify until retired.
    let keys = RouteKeys::load_or_create(&data_dir.join(ROUTE_KEY_FILE))?;
    let images = ImageConfig {
        cache_dir: cfg.cache_dir.clone(),
        registry_allow_private: cfg.registry_allow_private.clone(),
        ..ImageConfig::default()
    };
    let store = Store::open(&data_dir.join("state.redb"))?;
    let node_store = open_node_store(&cfg).await?;
    let fastlet_cfg = FastletConfig {
        prefix: cfg.prefix.clone(),
        data_dir: data_dir.clone(),
        helper,
        pool: cfg.pool,
        images: images.clone(),
        execd_bin,
        criu,
        pool_min: cfg.pool_min,
        pool_max: cfg.pool_max,
        spare_slots: cfg.spare_slots,
        dns_upstreams: cfg.dns_upstreams.clone(),
        sandbox_reach: cfg.sandbox_reach.clone(),
        artifact_store: node_store.store(),
        lazy_restore_min_bytes: cfg.lazy_restore_min_bytes,
    };
    let fastlet =
        Arc::new(blocking::run("fastbox-node", move || Fastlet::start(fastlet_cfg)).await?);
    let node = Arc::new(LocalNode::new(fastlet.clone(), LOCAL_NODE_ID.to_string()));
    let lifecycle = Lifecycle::new(cfg.clone(), store, node.clone(), images, keys.clone())?;
    let staged = fastlet.purge_staging();
    if staged > 0 {
        println!(
            "fastbox: removed {staged} live-snapshot staging directory(ies) of the previous run"
        );
    }
    let (adopted, lost, restarted) = lifecycle.recover().await;
    lifecycle.recover_snapshots().await;
    for key in lifecycle.unreferenced_pauses(&fastlet.snapshot_keys()) {
        if let Err(e) = fastlet.remove_snapshot(&key) {
            tracing::warn!(checkpoint = %key, error = %e, "could not remove a pause checkpoint left by an earlier run");
        }
    }
    let claimed = runtime_ids(&lifecycle.placements());
    let stale = fastlet.purge_pool_leftovers(&claimed);
    if stale > 0 {
        println!(
            "fastbox: removed {stale} unclaimed pooled sandbox(es) and spare slot(s) of the previous run"
        );
    }
    let stale_slots = fastlet.purge_stale_slots();
    if stale_slots > 0 {
        println!("fastbox: removed {stale_slots} network slot(s) that no sandbox held");
    }
    fastlet.start_reaper();
    fastlet.start_spares();
    fastlet.start_refill();
    if adopted + lost + restarted > 0 {
        println!(
            "fastbox: recovered sandboxes: {adopted} re-adopted, {lost} lost (Failed: PROCESS_LOST), {restarted} interrupted creates restarted"
        );
    }

    let api_listener = bind(cfg.listen).await?;
    let node_listener = bind(cfg.node_proxy_listen).await?;
    let node_proxy = NodeProxy {
        fastlet: fastlet.clone(),
        keys,
        forwarder: Arc::new(Forwarder::new(ForwarderConfig::default())),
        // Port 18080's policy changes are applied and recorded by the lifecycle service.
        egress: lifecycle.clone(),
        // Which sandboxes are secure (`secureAccess`), from the records.
        access: lifecycle.clone(),
        guard: Arc::new(AccessGuard::new(
            cfg.access_failures,
            cfg.route_max_lifetime,
        )),
    };
    // The server proxy forwards through the node, the node through its proxy.
    node.attach_proxy(node_proxy.clone());
    let state = AppState {
        lifecycle: lifecycle.clone(),
        api_key: api_key.into(),
    };
    let collector = Arc::new(ArtifactCollector::new(
        node_store.origin().clone(),
        cfg.artifacts.gc_grace,
    ));
    let node_metrics = Arc::new(NodeMetrics::new(
        Arc::new(StoreMetrics(node_store.clone())),
        collector.clone(),
    ));
    let router = http::router(state).layer(axum::middleware::from_fn_with_state(
        node_metrics,
        metrics::append_node_metrics,
    ));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    if let Some(interval) = cfg.artifacts.gc_interval {
        tokio::spawn(artifact_gc::collect_periodically(
            collector,
            lifecycle.clone(),
            interval,
            stop_rx.clone(),
        ));
    }
    let api = serve(api_listener, router, stop_rx.clone());
    let node = serve(node_listener, node_proxy::router(node_proxy), stop_rx);
    println!(
        "fastbox: lifecycle API on http://{} (also /v1), node proxy on {}, data in {}",
        cfg.listen,
        cfg.node_proxy_listen,
        data_dir.display()
    );
    let _ = std::io::stdout().flush();

    let prepare = prepare_images(lifecycle.clone(), fastlet.clone());
    tokio::spawn(lifecycle.clone().reconcile_forever());
    let servers = async { tokio::try_join!(api, node) };
    tokio::pin!(servers);
    tokio::select! {
        result = &mut servers => { result.map_err(UpError::Serve)?; }
        () = async { prepare.await; println!("fastbox: ready in {:.1?}", started.elapsed()); let _ = std::io::stdout().flush(); std::future::pending::<()>().await } => {}
        () = shutdown_signal() => {
            println!("fastbox: stopping; sandboxes keep running and are re-adopted at the next start");
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut servers).await;
        }
    }
    // Off the async threads: removing sandboxes blocks, and the node's blocking HTTP client
    // must not be dropped on a runtime thread.
    blocking::run("fastbox-stop", move || {
        fastlet.drain_pools();
        if let Ok(fastlet) = Arc::try_unwrap(fastlet) {
            fastlet.shutdown();
        }
        node_store.shutdown();
    })
    .await;
    Ok(())
}

/// Opens the node's artifact store (on a plain thread: an S3 origin is checked over the
/// network) and says what it is and when its garbage is collected.
async fn open_node_store(cfg: &ServerConfig) -> Result<Arc<NodeStore>, UpError> {
    let (store_cfg, data_dir) = (cfg.artifacts.store.clone(), cfg.data_dir.clone());
    let node_store = blocking::run("fastbox-artifacts", move || {
        NodeStore::open(&store_cfg, &data_dir, &|name| std::env::var(name).ok())
    })
    .await
    .map_err(UpError::Artifacts)?;
    let collection = match cfg.artifacts.gc_interval {
        Some(interval) => format!(
            "every {} (grace {})",
            format_duration(interval),
            format_duration(cfg.artifacts.gc_grace)
        ),
        None => "off".into(),
    };
    println!(
        "fastbox: artifact store: {}; garbage collection {collection}",
        node_store.describe()
    );
    Ok(Arc::new(node_store))
}

/// The API key: configured, or kept in the data dir, or generated now (and printed once).
fn api_key(cfg: &ServerConfig, data_dir: &Path) -> Result<String, UpError> {
    if let Some(key) = &cfg.api_key {
        return Ok(key.clone());
    }
    let path = data_dir.join("api-key");
    let io = |source| UpError::DataDir {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(key) if !key.trim().is_empty() => return Ok(key.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let key = fastbox_server::service::random_token();
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    writeln!(file, "{key}").map_err(io)?;
    println!(
        "fastbox: generated an API key (kept in {}):\n  OPEN-SANDBOX-API-KEY: {key}",
        path.display()
    );
    Ok(key)
}

async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, UpError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| UpError::Listen { addr, source })
}

async fn serve(
    listener: TcpListener,
    router: axum::Router,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async move {
        let _ = stop.wait_for(|s| *s).await;
    })
    .await
}

/// Prepares the default images (progress on stderr), then reports healthy.
async fn prepare_images(lifecycle: Arc<Lifecycle>, fastlet: Arc<Fastlet>) {
    let images = lifecycle.config().default_images.clone();
    for reference in images {
        lifecycle.set_health(Health::Starting(format!("preparing image {reference}")));
        eprintln!("fastbox: preparing image {reference}");
        let node = fastlet.clone();
        let r = reference.clone();
        let started = Instant::now();
        let result = blocking::run("fastbox-image", move || {
            let image = node.resolve_image(&r, None, &StderrProgress::new())?;
            eprintln!("fastbox: building the golden checkpoint of {r}");
            let template = node.template(&image)?;
            node.register_template(&template);
            Ok::<_, fastbox_fastlet::FastletError>((image, template))
        })
        .await;
        if let Ok((_, template)) = &result {
            // The artifact (packed rootfs + checkpoint, indexed by the reference) is made in
            // the background: creates do not wait for it.
            let (node, template, key) = (fastlet.clone(), template.clone(), reference.clone());
            tokio::spawn(blocking::run("fastbox-publish", move || {
                if let Err(e) = node.publish_template(&template, &key) {
                    tracing::warn!(image = %key, error = %e, "template artifact not published");
                }
            }));
        }
        match result {
            Ok((image, template)) => eprintln!(
                "fastbox: image {reference} ready ({}; its template took {} ms to build; {:.1?} here)",
                image.digest,
                template.build_ms,
                started.elapsed()
            ),
            // Creates of this image will fail with the error; the server still serves others.
            Err(e) => eprintln!("fastbox: warning: image {reference} could not be prepared: {e}"),
        }
    }
    lifecycle.set_health(Health::Ready);
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// The runtime names (cgroup, directory) of the sandboxes placed at `placements` (a pooled
/// sandbox keeps its pool name after a claim): what the node must not purge.
fn runtime_ids(placements: &[NodePlacement]) -> std::collections::HashSet<String> {
    placements
        .iter()
        .filter_map(|p| fastbox_fastlet::local_node::to_placement(p).ok())
        .map(|p| p.handle.id)
        .collect()
}

/// The node store's layers as `/metrics` shows them.
struct StoreMetrics(Arc<NodeStore>);

impl StoreStats for StoreMetrics {
    fn cache_stats(&self) -> Option<CacheStats> {
        self.0.cache_stats()
    }

    fn fetch_stats(&self) -> Option<CachedStoreStats> {
        self.0.fetch_stats()
    }

    fn dart_text(&self) -> Option<String> {
        self.0
            .dart_counters()
            .map(|(node, counters)| counters.to_prometheus(node))
    }
}
