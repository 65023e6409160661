//! `fastbox node`: a node agent alone, for a `fastbox up --remote-node` server elsewhere. It
//! serves the node API (`fastbox_node_api::remote::node_router` over the in-process
//! [`LocalNode`]) and its node proxy, whose port-18080 policy changes and access checks go
//! to the server's control API (`ControlClient`). Static configuration: the server is given
//! the node's URL and credentials; registration, heartbeats and several nodes are not built.
//!
//! At start the node cleans up only what is its own alone (live snapshots being staged,
//! spare slots, teardowns queued before a stop): the records are the server's, so every
//! sandbox that runs is kept and the server takes it back (`adopt`) at its own start.
//! SIGTERM stops serving and leaves the sandboxes running.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use fastbox_fastlet::{LocalNode, node_proxy};
use fastbox_node_api::remote::{ControlClient, node_router};
use fastbox_proxy::RouteKeys;
use fastbox_server::config::{ServerConfig, Settings};

use crate::up::node_side::{self, NodeBinaries, UnheldSlots};
use crate::up::{InstanceArgs, ROUTE_KEY_FILE, UpError};

pub mod credentials;
pub mod fence_guard;

pub use credentials::NodeCredentials;

#[derive(clap::Args, Debug)]
pub struct NodeArgs {
    /// Node API address (the server's `--remote-node` URL points here).
    #[arg(long, env = "FASTBOX_NODE_LISTEN", default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Node proxy address: sandbox endpoints and the server proxy reach sandboxes here.
    #[arg(
        long,
        env = "FASTBOX_NODE_PROXY_LISTEN",
        default_value = "127.0.0.1:8091"
    )]
    pub node_proxy_listen: SocketAddr,
    /// `host:port` clients use for the node proxy, when not its listen address (the server
    /// is given the same as its --node-proxy-public).
    #[arg(long, env = "FASTBOX_NODE_PROXY_PUBLIC")]
    pub node_proxy_public: Option<String>,
    /// Base URL of the server's control API (its --control-listen), e.g.
    /// `http://10.0.0.1:8092`.
    #[arg(
        long,
        env = "FASTBOX_CONTROL_URL",
        required_unless_present = "print_credentials"
    )]
    pub control_url: Option<String>,
    /// Print the node's two credentials (made when missing) as the server reads them
    /// (`--remote-node-credentials FILE`), and exit.
    #[arg(long)]
    pub print_credentials: bool,
    #[command(flatten)]
    pub instance: InstanceArgs,
}

impl NodeArgs {
    /// The node's settings, with `fastbox up`'s defaults for everything not given here.
    fn settings(&self) -> Settings {
        Settings {
            node_proxy_listen: Some(self.node_proxy_listen),
            node_proxy_public: self.node_proxy_public.clone(),
            data_dir: self.instance.data_dir.clone(),
            cache_dir: self.instance.cache_dir.clone(),
            prefix: self.instance.prefix.clone(),
            pool: self.instance.pool.clone(),
            execd: self.instance.execd.clone(),
            default_images: Some(Vec::new()),
            ..Settings::default()
        }
    }
}

pub fn node(args: NodeArgs) -> anyhow::Result<i32> {
    let cfg = ServerConfig::resolve(args.settings())?;
    if args.print_credentials {
        node_side::create_data_dir(&cfg.data_dir)?;
        let (credentials, _) = NodeCredentials::load_or_create(&cfg.data_dir)?;
        print!("{}", credentials.to_text());
        return Ok(0);
    }
    let control_url = args
        .control_url
        .clone()
        .context("--control-url is required")?;
    let binaries = node_side::binaries(&cfg, args.instance.criu.clone())?;
    node_side::runtime()?.block_on(run(cfg, args.listen, control_url, binaries))?;
    Ok(0)
}

/// Runs the node until SIGTERM or SIGINT.
async fn run(
    cfg: ServerConfig,
    listen: SocketAddr,
    control_url: String,
    binaries: NodeBinaries,
) -> anyhow::Result<()> {
    let data_dir = cfg.data_dir.clone();
    node_side::create_data_dir(&data_dir)?;
    // The self-fencing guard: it outlives this process and freezes the node's sandboxes if a
    // lease deadline passes unrenewed. Heartbeats (the renewals) are not built yet, so it is
    // never armed and never fences; it exits with this process.
    let fence_guard = fence_guard::start_for_node(&data_dir, &cfg.prefix)?;
    let (credentials, created) = NodeCredentials::load_or_create(&data_dir)?;
    println!(
        "fastbox: node credentials {} in {} (hand them to the server: fastbox node --print-credentials)",
        if created { "made" } else { "kept" },
        NodeCredentials::dir(&data_dir).display()
    );
    // Signed routes verify with these keys: the server's (copy its route-signing.key here).
    let keys = RouteKeys::load_or_create(&data_dir.join(ROUTE_KEY_FILE)).map_err(UpError::from)?;
    let node_store = node_side::open_node_store(&cfg).await?;
    let fastlet = node_side::start_fastlet(&cfg, binaries, &node_store).await?;
    // The records are the server's: every pooled sandbox is kept (it may have been claimed;
    // a clean stop removed the unclaimed ones), and every slot on the host is held for the
    // server to take its sandbox back.
    node_side::recover_and_start(&fastlet, &pooled_ids(&data_dir), UnheldSlots::Hold);

    let control = Arc::new(
        ControlClient::new(&control_url, credentials.node_to_server.clone())
            .with_context(|| format!("control URL {control_url}"))?,
    );
    let node = Arc::new(LocalNode::new(fastlet.clone(), listen.to_string()));
    let proxy = node_side::node_proxy(&cfg, fastlet.clone(), keys, control.clone(), control);
    node.attach_proxy(proxy.clone());
    let api_listener = node_side::bind(listen).await?;
    let proxy_listener = node_side::bind(cfg.node_proxy_listen).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let api = node_side::serve(
        api_listener,
        node_router(node.clone(), credentials.server_to_node.clone()),
        stop_rx.clone(),
    );
    let proxied = node_side::serve(proxy_listener, node_proxy::router(proxy), stop_rx);
    println!(
        "fastbox: node API on http://{listen}, node proxy on {} (public {}), control plane {control_url}, data in {}",
        cfg.node_proxy_listen,
        cfg.node_proxy_public
            .clone()
            .unwrap_or_else(|| cfg.node_proxy_listen.to_string()),
        data_dir.display()
    );
    let servers = async { tokio::try_join!(api, proxied) };
    tokio::pin!(servers);
    tokio::select! {
        result = &mut servers => { result.map_err(UpError::Serve)?; }
        () = node_side::shutdown_signal() => {
            println!("fastbox: stopping; sandboxes keep running and the server takes them back");
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut servers).await;
        }
    }
    drop(node);
    node_side::stop(fastlet, node_store).await;
    fence_guard.release();
    Ok(())
}

/// The runtime ids of the pooled sandboxes in `data_dir` (claimed or not: only the server
/// knows).
fn pooled_ids(data_dir: &Path) -> HashSet<String> {
    std::fs::read_dir(data_dir.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|id| id.starts_with(fastbox_fastlet::pool::POOL_ID_PREFIX))
        .collect()
}
