//! The node side of a fastbox process, shared by `fastbox up` (the node in process) and
//! `fastbox node` (the node alone): the node's artifact store, the fastlet and its background
//! threads, the clean-up of what a previous run left, the node proxy, serving and stopping.

use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;

use anyhow::Context;

use fastbox_fastlet::credential_proxy::CredentialProxyConfig;
use fastbox_fastlet::node_proxy::{AccessGuard, NodeProxy};
use fastbox_fastlet::node_store::NodeStore;
use fastbox_fastlet::{Fastlet, FastletConfig, blocking};
use fastbox_image::ImageConfig;
use fastbox_node_api::control::{AccessApi, EgressApi};
use fastbox_proxy::{Forwarder, ForwarderConfig, RouteKeys};
use fastbox_server::config::{ServerConfig, format_duration};
use tokio::net::TcpListener;

use super::run::UpError;
use crate::paths::{self, HostArgs};

/// The image configuration of the node (and of a server checking references for it).
pub(crate) fn image_config(cfg: &ServerConfig) -> ImageConfig {
    ImageConfig {
        cache_dir: cfg.cache_dir.clone(),
        registry_allow_private: cfg.registry_allow_private.clone(),
        ..ImageConfig::default()
    }
}

/// Opens the node's artifact store (on a plain thread: an S3 origin is checked over the
/// network) and says what it is and when its garbage is collected.
/// The node `node_id` over `fastlet`, reporting `node_store`'s DART counters in its status.
pub(crate) fn local_node(
    fastlet: Arc<Fastlet>,
    node_id: String,
    node_store: &Arc<NodeStore>,
) -> fastbox_fastlet::local_node::LocalNode {
    let store = node_store.clone();
    fastbox_fastlet::local_node::LocalNode::new(fastlet, node_id).with_delivery(Arc::new(
        move || {
            store.dart_counters().map(|(_, counters)| {
                counters
                    .fields()
                    .into_iter()
                    .map(|(name, value)| (name.to_string(), value))
                    .collect()
            })
        },
    ))
}

pub(crate) async fn open_node_store(cfg: &ServerConfig) -> Result<Arc<NodeStore>, UpError> {
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

/// Makes the data directory (0700) when missing.
pub(crate) fn create_data_dir(data_dir: &std::path::Path) -> Result<(), UpError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(data_dir)
        .map_err(|source| UpError::DataDir {
            path: data_dir.to_path_buf(),
            source,
        })
}

/// The runtime a process serving the APIs runs on.
pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

/// What the fastlet needs besides the configuration.
pub(crate) struct NodeBinaries {
    /// The `fastbox` executable itself (the sandbox starter).
    pub helper: std::path::PathBuf,
    pub execd: std::path::PathBuf,
    pub criu: fastbox_runtime::criu::Criu,
}

/// The binaries of `cfg`'s node (`criu` given, or found as `fastbox check` finds it); the
/// node needs root.
pub(crate) fn binaries(
    cfg: &ServerConfig,
    criu: Option<std::path::PathBuf>,
) -> anyhow::Result<NodeBinaries> {
    paths::require_root()?;
    let host = HostArgs {
        criu,
        execd: cfg.execd.clone(),
        data_dir: cfg.data_dir.clone(),
        cache_dir: cfg.cache_dir.clone(),
    };
    Ok(NodeBinaries {
        execd: host.execd()?,
        criu: host.criu()?,
        helper: std::env::current_exe().context("locate the fastbox executable")?,
    })
}

/// Starts the fastlet of `cfg` (its host state made or taken back), then removes the live
/// snapshots a previous run was staging.
pub(crate) async fn start_fastlet(
    cfg: &ServerConfig,
    binaries: NodeBinaries,
    node_store: &NodeStore,
) -> Result<Arc<Fastlet>, UpError> {
    let fastlet_cfg = FastletConfig {
        prefix: cfg.prefix.clone(),
        data_dir: cfg.data_dir.clone(),
        helper: binaries.helper,
        pool: cfg.pool,
        images: image_config(cfg),
        execd_bin: binaries.execd,
        criu: binaries.criu,
        pool_min: cfg.pool_min,
        pool_max: cfg.pool_max,
        spare_slots: cfg.spare_slots,
        dns_upstreams: cfg.dns_upstreams.clone(),
        sandbox_reach: cfg.sandbox_reach.clone(),
        host_volume_roots: cfg.host_volume_roots.clone(),
        artifact_store: node_store.store(),
        lazy_restore_min_bytes: cfg.lazy_restore_min_bytes,
        credential_proxy: Some(CredentialProxyConfig {
            ca_dir: cfg.credential_proxy_ca_dir.clone(),
            extra_roots: cfg.credential_proxy_roots.clone(),
        }),
    };
    let fastlet =
        Arc::new(blocking::run("fastbox-node", move || Fastlet::start(fastlet_cfg)).await?);
    let staged = fastlet.purge_staging();
    if staged > 0 {
        println!(
            "fastbox: removed {staged} live-snapshot staging directory(ies) of the previous run"
        );
    }
    let points = fastbox_fastlet::volumes::purge_staged(&fastlet.config().data_dir);
    if points > 0 {
        println!("fastbox: unmounted {points} volume staging point(s) of the previous run");
    }
    Ok(fastlet)
}

/// What happens at start to the network slots that no sandbox the fastlet knows holds.
pub(crate) enum UnheldSlots {
    /// Removed: the server took back every sandbox it has (`fastbox up`).
    Purge,
    /// Kept and held, so no new sandbox or spare takes them before the server takes their
    /// sandboxes back (`fastbox node`: the records are the server's).
    Hold,
}

/// After the sandboxes that run were taken back (or, for `Hold`, before): removes the pooled
/// sandboxes a previous run left, except `claimed` ones (runtime ids), and its spare slots;
/// deals with the slots no sandbox holds as `unheld` says. Then starts the fastlet's
/// background threads.
pub(crate) fn recover_and_start(
    fastlet: &Arc<Fastlet>,
    claimed: &std::collections::HashSet<String>,
    unheld: UnheldSlots,
) {
    let stale = fastlet.purge_pool_leftovers(claimed);
    if stale > 0 {
        println!(
            "fastbox: removed {stale} unclaimed pooled sandbox(es) and spare slot(s) of the previous run"
        );
    }
    match unheld {
        UnheldSlots::Purge => {
            let stale_slots = fastlet.purge_stale_slots();
            if stale_slots > 0 {
                println!("fastbox: removed {stale_slots} network slot(s) that no sandbox held");
            }
        }
        UnheldSlots::Hold => {
            let held = hold_slots(fastlet);
            if held > 0 {
                println!(
                    "fastbox: holding {held} network slot(s) of the previous run for the server to take back"
                );
            }
        }
    }
    fastlet.start_reaper();
    fastlet.start_spares();
    fastlet.start_refill();
}

/// Claims every network slot of the fastlet's prefix on the host; how many.
fn hold_slots(fastlet: &Fastlet) -> usize {
    let prefix = &fastlet.config().prefix;
    let names = match fastbox_runtime::net::HostNetwork::leaked(prefix) {
        Ok(found) => found.netns,
        Err(e) => {
            tracing::warn!(error = %e, "could not list network slots");
            return 0;
        }
    };
    // Slots with a network namespace, and those paused sandboxes keep (they have none).
    let slots: std::collections::BTreeSet<u32> = names
        .iter()
        .filter_map(|n| fastbox_runtime::net::names::slot_index(prefix, n))
        .chain(fastlet.kept_slots().list())
        .collect();
    for &slot in &slots {
        fastlet.claim_slot(slot);
    }
    slots.len()
}

/// The node proxy of `fastlet`: port 18080's policy changes go to `egress`, access checks
/// to `access` (the lifecycle service, in process or over the control API).
pub(crate) fn node_proxy(
    cfg: &ServerConfig,
    fastlet: Arc<Fastlet>,
    keys: RouteKeys,
    egress: Arc<dyn EgressApi>,
    access: Arc<dyn AccessApi>,
) -> NodeProxy {
    NodeProxy {
        fastlet,
        keys,
        forwarder: Arc::new(Forwarder::new(ForwarderConfig::default())),
        egress,
        access,
        guard: Arc::new(AccessGuard::new(
            cfg.access_failures,
            cfg.route_max_lifetime,
        )),
    }
}

/// Stops the fastlet (pooled sandboxes drained; sandboxes keep running) and the node store,
/// off the async threads: removing sandboxes blocks, and the node's blocking HTTP client must
/// not be dropped on a runtime thread.
pub(crate) async fn stop(fastlet: Arc<Fastlet>, node_store: Arc<NodeStore>) {
    blocking::run("fastbox-stop", move || {
        fastlet.drain_pools();
        if let Ok(fastlet) = Arc::try_unwrap(fastlet) {
            fastlet.shutdown();
        }
        node_store.shutdown();
    })
    .await;
}

pub(crate) async fn bind(addr: std::net::SocketAddr) -> Result<TcpListener, UpError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| UpError::Listen { addr, source })
}

/// Serves `router` (with the callers' addresses) until `stop` turns true.
pub(crate) async fn serve(
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

pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
