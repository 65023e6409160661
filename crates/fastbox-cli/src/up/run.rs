//! `fastbox up`: the lifecycle server, the node agent and both proxies in one process, with
//! the state store in the data directory. Sandboxes outlive the process: SIGTERM stops
//! serving and leaves them running; the next start re-adopts them.
//!
//! The server reaches its node through `fastbox_node_api::NodeAgent` only; here the
//! in-process node ([`LocalNode`]) is wired in, with its node proxy, whose port-18080 policy
//! changes and access checks call back into the server. With `--remote-node`
//! ([`NodeMode::Remote`]) there is no node in this process: the node is a
//! `fastbox_node_api::remote::NodeClient` of a `fastbox node` elsewhere, and the server
//! serves that node the control API (its policy changes and access checks) instead of a
//! node proxy. The node parts (store, fastlet, proxy) are [`super::node_side`]'s, shared with
//! `fastbox node`.
//!
//! The node's artifact store (`fastbox_fastlet::node_store`: a local directory, or an S3
//! origin behind the node block cache and, with peers, DART) is opened right after the state
//! store and before anything touches the host, so an unreachable origin, bad credentials or
//! a missing bucket stop the start with the store's own message. The DART peer server runs
//! until the process stops; the artifact garbage collection runs on its schedule
//! (`fastbox_server::artifact_gc`); both report in `/metrics`
//! (`fastbox_server::metrics::NodeMetrics`). A remote node's store is the node's: the
//! server collects no garbage and reports no store metrics then.

use std::future::Future;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use fastbox_artifact::{CacheStats, CachedStoreStats};
use fastbox_fastlet::node_proxy;
use fastbox_fastlet::node_store::{NodeStore, NodeStoreError};
use fastbox_fastlet::{Fastlet, LocalNode, blocking};
use fastbox_image::StderrProgress;
use fastbox_node_api::NodeAgent;
use fastbox_node_api::remote::tls::{TlsIdentity, serve_tls};
use fastbox_node_api::remote::{NodeClient, SingleNode, Timeouts, control_router};
use fastbox_node_api::wire::NodePlacement;
use fastbox_proxy::RouteKeys;
use fastbox_server::artifact_gc::{self, ArtifactCollector};
use fastbox_server::cluster::{Cluster, ClusterError};
use fastbox_server::config::ServerConfig;
use fastbox_server::http::{self, AppState};
use fastbox_server::metrics::{self, NodeMetrics, StoreStats};
use fastbox_server::nodes::Nodes;
use fastbox_server::service::{Health, Lifecycle};
use fastbox_server::store::Store;

use super::node_side::{self, NodeBinaries, UnheldSlots, bind, serve, shutdown_signal};
use crate::node::NodeCredentials;

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
    #[error("remote node {url}: {source}")]
    RemoteNode {
        url: String,
        source: fastbox_node_api::remote::ClientError,
    },
    #[error("{0}")]
    Api(#[from] fastbox_server::error::ApiError),
    #[error("server: {0}")]
    Serve(std::io::Error),
    #[error("join token: {0}")]
    JoinToken(String),
    #[error("control API TLS: {0}")]
    ControlTls(#[from] fastbox_node_api::remote::tls::TlsError),
    #[error("state store: {0}")]
    Cluster(#[from] ClusterError),
}

/// The route signing keys in the data directory (`fastbox route-key` rotates them).
pub const ROUTE_KEY_FILE: &str = "route-signing.key";

/// The in-process node's name.
const LOCAL_NODE_ID: &str = "local";

/// Where the control API keeps its TLS identity when it accepts nodes: nodes pin its
/// `cert.pem`.
pub const CONTROL_TLS_DIR: &str = "control-tls";

/// The file of the join token nodes present to register (`--accept-nodes`).
pub const JOIN_TOKEN_FILE: &str = "node-join-token";

/// Where the server's node runs.
pub(crate) enum NodeMode {
    /// In this process, with these binaries; with `accept_nodes`, registered nodes join it
    /// through the control API listening there.
    Local {
        binaries: NodeBinaries,
        accept_nodes: Option<std::net::SocketAddr>,
        /// The node in this process takes no sandboxes (`--no-local-sandboxes`).
        hold_back: bool,
    },
    /// In a `fastbox node` elsewhere.
    Remote(RemoteNode),
}

/// A `fastbox node` the server uses.
pub(crate) struct RemoteNode {
    /// Its node API's base URL.
    pub url: String,
    pub credentials: NodeCredentials,
    /// Where the control API it calls listens.
    pub control_listen: std::net::SocketAddr,
}

/// How often a server looks whether its etcd answers.
const STATE_PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The join token and the control API's TLS identity: with a shared store, the same on
/// every server (a node joins, and pins the certificate of, any of them).
fn share_node_secrets(
    store: &Store,
    shared: bool,
    data_dir: &Path,
    addr: std::net::SocketAddr,
) -> Result<(), UpError> {
    use super::shared_files::{SharedFile, share};
    let token = data_dir.join(JOIN_TOKEN_FILE);
    share(
        store,
        shared,
        "join-token",
        &[SharedFile {
            path: token.clone(),
            mode: 0o600,
        }],
        || {
            crate::node::credentials::load_or_create_one(&token)
                .map(drop)
                .map_err(|e| UpError::JoinToken(format!("{e:#}")))
        },
    )?;
    let tls = data_dir.join(CONTROL_TLS_DIR);
    share(
        store,
        shared,
        "control-tls",
        &[
            SharedFile {
                path: tls.join(fastbox_node_api::remote::tls::CERT_FILE),
                mode: 0o644,
            },
            SharedFile {
                path: tls.join(fastbox_node_api::remote::tls::KEY_FILE),
                mode: 0o600,
            },
        ],
        || {
            TlsIdentity::load_or_create(&tls, &[addr.ip().to_string()])
                .map(drop)
                .map_err(UpError::from)
        },
    )
}

/// This server among those sharing its state store: alone on the redb file; on etcd, its
/// lease, presence and (when free) the leadership taken before anything else runs.
async fn join_cluster(cfg: &ServerConfig, store: &Store) -> Result<Arc<Cluster>, UpError> {
    let (id, ttl, backend) = (
        cfg.state.server_id.clone(),
        cfg.state.server_lease,
        store.backend(),
    );
    let cluster = tokio::task::spawn_blocking(move || -> Result<Cluster, ClusterError> {
        let cluster = Cluster::join(&id, backend, ttl)?;
        cluster.round()?;
        Ok(cluster)
    })
    .await
    .expect("joining does not panic")?;
    if cluster.is_shared() {
        println!(
            "fastbox: server {} of the state in {}; {}",
            cluster.id(),
            store.describe(),
            if cluster.is_leader() {
                "it leads the reconcilers"
            } else {
                "another server leads the reconcilers"
            }
        );
    }
    Ok(Arc::new(cluster))
}

/// Opens the state store `cfg` names (connecting to etcd, which checks it answers).
async fn open_state(cfg: &ServerConfig) -> Result<Store, UpError> {
    let state = cfg.state.clone();
    let backend = tokio::task::spawn_blocking(move || state.open())
        .await
        .expect("the state store opens without panicking")
        .map_err(fastbox_server::store::StoreError::from)?;
    tracing::info!(store = %backend.describe(), "state store");
    let store = Store::with_backend(Arc::from(backend));
    if matches!(cfg.state.url, fastbox_state::StateUrl::Etcd(_)) {
        store.check_canary()?;
        store.watch_reachability(STATE_PROBE_EVERY);
    }
    Ok(store)
}

/// The in-process node's parts that `fastbox up` runs besides the server.
struct InProcess {
    fastlet: Arc<Fastlet>,
    node_store: Arc<NodeStore>,
    node: Arc<LocalNode>,
}

/// Runs `fastbox up` until SIGTERM or SIGINT.
pub(crate) async fn run(cfg: ServerConfig, mode: NodeMode) -> Result<(), UpError> {
    let started = Instant::now();
    let data_dir = cfg.data_dir.clone();
    node_side::create_data_dir(&data_dir)?;
    let api_key = api_key(&cfg, &data_dir)?;
    // Followed as it changes: `fastbox route-key rotate` adds a signing key while the server
    // runs, the older keys verify until retired.
    let keys = RouteKeys::load_or_create(&data_dir.join(ROUTE_KEY_FILE))?;
    let images = node_side::image_config(&cfg);
    let store = open_state(&cfg).await?;
    let cluster = join_cluster(&cfg, &store).await?;
    // Alone, the node in this process is `local`; among servers sharing a state, it goes
    // by the server's id (records name their node).
    let local_node_id = match cluster.is_shared() {
        true => cluster.id().to_string(),
        false => LOCAL_NODE_ID.to_string(),
    };
    let (mut accept_nodes, mut hold_back) = (None, false);
    let (agent, local, remote): (Arc<dyn NodeAgent>, _, _) = match mode {
        NodeMode::Local {
            binaries,
            accept_nodes: accept,
            hold_back: held,
        } => {
            (accept_nodes, hold_back) = (accept, held);
            let node_store = node_side::open_node_store(&cfg).await?;
            let fastlet = node_side::start_fastlet(&cfg, binaries, &node_store).await?;
            let node = Arc::new(node_side::local_node(
                fastlet.clone(),
                local_node_id.clone(),
                &node_store,
            ));
            let local = InProcess {
                fastlet,
                node_store,
                node: node.clone(),
            };
            (node, Some(local), None)
        }
        NodeMode::Remote(remote) => {
            let client = NodeClient::new(
                remote.url.clone(),
                &remote.url,
                remote.credentials.server_to_node.clone(),
                Timeouts::default(),
            )
            .map_err(|source| UpError::RemoteNode {
                url: remote.url.clone(),
                source,
            })?
            .with_image_config(images.clone());
            println!(
                "fastbox: no node in this process: the node at {}",
                remote.url
            );
            (Arc::new(client), None, Some(remote))
        }
    };
    if let Some(addr) = accept_nodes {
        share_node_secrets(&store, cluster.is_shared(), &data_dir, addr)?;
    }
    let lifecycle = Lifecycle::in_cluster(
        cfg.clone(),
        store,
        Nodes::single(agent.clone()),
        images,
        keys.clone(),
        cluster.clone(),
    )?;
    if hold_back {
        lifecycle.nodes().hold_back(&local_node_id);
        println!("fastbox: sandboxes go to joined nodes only (--no-local-sandboxes)");
    }
    lifecycle.follow_store()?;
    cluster.run();
    if accept_nodes.is_some() {
        let (token, made) =
            crate::node::credentials::load_or_create_one(&data_dir.join(JOIN_TOKEN_FILE))
                .map_err(|e| UpError::JoinToken(format!("{e:#}")))?;
        lifecycle.set_join_token(Some(token));
        let registered = lifecycle.load_registered_nodes()?;
        println!(
            "fastbox: nodes join with the token in {} ({}); {registered} registered before",
            data_dir.join(JOIN_TOKEN_FILE).display(),
            if made { "made now" } else { "kept" }
        );
    }
    let (adopted, lost, restarted) = lifecycle.recover().await;
    lifecycle.recover_snapshots().await;
    for node in lifecycle.nodes().all() {
        for key in lifecycle.unreferenced_pauses(&node.snapshot_keys().await) {
            if let Err(e) = node.remove_snapshot(&key).await {
                tracing::warn!(node = node.node_id(), checkpoint = %key, error = %e, "could not remove a pause checkpoint left by an earlier run");
            }
        }
    }
    if let Some(local) = &local {
        let claimed = runtime_ids(&lifecycle.placements(&local_node_id));
        node_side::recover_and_start(&local.fastlet, &claimed, UnheldSlots::Purge);
    }
    if adopted + lost + restarted > 0 {
        println!(
            "fastbox: recovered sandboxes: {adopted} re-adopted, {lost} lost (Failed: PROCESS_LOST), {restarted} interrupted creates restarted"
        );
    }

    let api_listener = bind(cfg.listen).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let state = AppState {
        lifecycle: lifecycle.clone(),
        api_key: api_key.into(),
    };
    let mut router = http::router(state);
    // The node's other listener: its proxy in process, or the control API a remote node
    // calls.
    let (second, second_router, prepare): (_, _, Pin<Box<dyn Future<Output = ()> + Send>>) = match (
        &local, &remote,
    ) {
        (Some(local), _) => {
            let node_proxy = node_side::node_proxy(
                &cfg,
                local.fastlet.clone(),
                keys,
                // Port 18080's policy changes are applied and recorded by the lifecycle
                // service; which sandboxes are secure comes from its records.
                lifecycle.clone(),
                lifecycle.clone(),
            );
            // The server proxy forwards through the node, the node through its proxy.
            local.node.attach_proxy(node_proxy.clone());
            let collector = Arc::new(ArtifactCollector::new(
                local.node_store.origin().clone(),
                cfg.artifacts.gc_grace,
            ));
            let node_metrics = Arc::new(NodeMetrics::new(
                Arc::new(StoreMetrics(local.node_store.clone())),
                collector.clone(),
            ));
            router = router.layer(axum::middleware::from_fn_with_state(
                node_metrics,
                metrics::append_node_metrics,
            ));
            if let Some(interval) = cfg.artifacts.gc_interval {
                tokio::spawn(artifact_gc::collect_periodically(
                    collector,
                    lifecycle.clone(),
                    interval,
                    stop_rx.clone(),
                ));
            }
            println!(
                "fastbox: lifecycle API on http://{} (also /v1), node proxy on {}, data in {}",
                cfg.listen,
                cfg.node_proxy_listen,
                data_dir.display()
            );
            (
                bind(cfg.node_proxy_listen).await?,
                node_proxy::router(node_proxy),
                Box::pin(prepare_images(lifecycle.clone(), local.fastlet.clone())),
            )
        }
        (None, Some(remote)) => {
            println!(
                "fastbox: lifecycle API on http://{} (also /v1), control API for the node on {}, data in {}",
                cfg.listen,
                remote.control_listen,
                data_dir.display()
            );
            (
                bind(remote.control_listen).await?,
                control_router(
                    lifecycle.clone(),
                    lifecycle.clone(),
                    Arc::new(SingleNode {
                        node_id: agent.node_id().to_string(),
                        credential: remote.credentials.node_to_server.clone(),
                    }),
                ),
                Box::pin(prepare_remote_images(lifecycle.clone())),
            )
        }
        (None, None) => unreachable!("a node in process or a remote one"),
    };
    let api = serve(api_listener, router, stop_rx.clone());
    let node = serve(second, second_router, stop_rx.clone());
    // Registered nodes' control API, besides the node in this process.
    let control = match accept_nodes {
        Some(addr) => {
            let identity = TlsIdentity::load_or_create(
                &data_dir.join(CONTROL_TLS_DIR),
                &[addr.ip().to_string()],
            )?;
            println!(
                "fastbox: control API for joining nodes on https://{addr} (its certificate {}, sha256 {}: nodes pin it with --server-cert)",
                identity.cert_path().display(),
                identity.pin()
            );
            let router = control_router(lifecycle.clone(), lifecycle.clone(), lifecycle.clone());
            Some(serve_tls(
                bind(addr).await?,
                identity.acceptor()?,
                router,
                stop_rx,
            ))
        }
        None => None,
    };
    let control = async move {
        match control {
            Some(serving) => serving.await,
            None => Ok(()),
        }
    };
    if accept_nodes.is_some() {
        tokio::spawn(refresh_nodes(lifecycle.clone()));
    }
    let _ = std::io::stdout().flush();

    tokio::spawn(lifecycle.clone().reconcile_forever());
    let servers = async { tokio::try_join!(api, node, control) };
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
    // Another server may lead, and take over, at once.
    let leaving = cluster.clone();
    let _ = tokio::task::spawn_blocking(move || leaving.leave()).await;
    if let Some(InProcess {
        fastlet,
        node_store,
        node,
    }) = local
    {
        drop(node);
        node_side::stop(fastlet, node_store).await;
    }
    Ok(())
}

/// Asks the nodes that do not heartbeat (the one in this process) for their status every
/// second, for the choice of a node at a create.
async fn refresh_nodes(lifecycle: Arc<Lifecycle>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        lifecycle
            .nodes()
            .refresh_some(lifecycle.cluster().is_shared())
            .await;
    }
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

/// Has the remote node pull the default images (their golden checkpoints are built at their
/// first create there), then reports healthy.
async fn prepare_remote_images(lifecycle: Arc<Lifecycle>) {
    let images = lifecycle.config().default_images.clone();
    for reference in images {
        lifecycle.set_health(Health::Starting(format!("preparing image {reference}")));
        eprintln!("fastbox: the node prepares image {reference}");
        match lifecycle
            .nodes()
            .first()
            .resolve_image(&reference, None)
            .await
        {
            Ok(image) => eprintln!("fastbox: image {reference} ready ({})", image.digest),
            Err(e) => eprintln!("fastbox: warning: image {reference} could not be prepared: {e}"),
        }
    }
    lifecycle.set_health(Health::Ready);
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
