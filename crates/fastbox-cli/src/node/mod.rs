//! `fastbox node`: a node agent alone, for a server elsewhere. It serves the node API
//! (`fastbox_node_api::remote::node_router` over the in-process [`LocalNode`]) and its node
//! proxy, whose port-18080 policy changes and access checks go to the server's control API
//! (`ControlClient`). Two ways to meet the server:
//! - `--join URL --join-token-file FILE --server-cert FILE` ([`join`]): the node registers
//!   with a `fastbox up --accept-nodes` server at every start, gets credentials of its own,
//!   and holds a lease by heartbeats; the server takes its sandboxes back after each
//!   registration. Both APIs are TLS: the node accepts only the server's certificate it
//!   was given, and registers its own node API certificate's pin (made in
//!   `DATA_DIR/node-tls`), the only one the server then accepts from it.
//! - `--control-url URL`: static; the server (`fastbox up --remote-node`) is given the node's
//!   URL and the credentials it keeps in its data directory, and takes its sandboxes back
//!   at the server's own start.
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
use fastbox_fastlet::node_proxy;
use fastbox_node_api::remote::tls::{CertPin, TlsIdentity, serve_tls};
use fastbox_node_api::remote::{ControlClient, node_router};
use fastbox_proxy::RouteKeys;
use fastbox_server::config::{ServerConfig, Settings};

use crate::up::node_side::{self, NodeBinaries, UnheldSlots};
use crate::up::{InstanceArgs, ROUTE_KEY_FILE, StoreArgs, UpError};

pub mod credentials;
pub mod fence_guard;
pub mod join;

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
        required_unless_present_any = ["print_credentials", "join"],
        conflicts_with = "join"
    )]
    pub control_url: Option<String>,
    /// Accept a plain-HTTP --control-url beyond loopback: the node's credential and the
    /// sandboxes' tokens cross the link readable (a link only the two hosts reach).
    #[arg(
        long,
        env = "FASTBOX_ALLOW_PLAINTEXT_PAIRING",
        requires = "control_url"
    )]
    pub allow_plaintext_pairing: bool,
    /// Join the server whose control API is at this URL (its --control-listen, with
    /// --accept-nodes), e.g. `https://10.0.0.1:8092`; `URL,URL,...` for the servers sharing
    /// one etcd state (any answers; the node moves to another when one does not).
    #[arg(long, env = "FASTBOX_JOIN", requires_all = ["join_token_file", "server_cert"])]
    pub join: Option<String>,
    /// The server's join token (its DATA_DIR/node-join-token).
    #[arg(long, env = "FASTBOX_JOIN_TOKEN_FILE", requires = "join")]
    pub join_token_file: Option<std::path::PathBuf>,
    /// The server's control API certificate (its DATA_DIR/control-tls/cert.pem, copied
    /// with the join token): the only certificate the node accepts from the server.
    #[arg(long, env = "FASTBOX_SERVER_CERT", requires = "join")]
    pub server_cert: Option<std::path::PathBuf>,
    /// This node's name in the cluster: 1 to 63 of [a-z0-9-] [default: the host name].
    #[arg(long, env = "FASTBOX_NODE_NAME")]
    pub node_name: Option<String>,
    /// The URL the server calls the node API at [default: https:// and --listen when it
    /// joins, http:// and --listen otherwise].
    #[arg(long, env = "FASTBOX_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Where artifacts are published and fetched (`--artifact-store`: the cluster's shared
    /// store, so a paused sandbox resumes on another node when this one is lost), and the
    /// node's DART delivery group.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Clones and resumes whose memory is at least this many MiB answer before their memory
    /// is copied in; `off` restores every one whole [default: 64]. A resume of a sandbox
    /// paused on another node always fetches its memory this way.
    #[arg(long, env = "FASTBOX_LAZY_RESTORE_MIN_MIB", value_name = "MIB|off")]
    pub lazy_restore_min_mib: Option<String>,
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
        self.instance
            .apply_credential_proxy(self.store.apply(Settings {
                node_proxy_listen: Some(self.node_proxy_listen),
                node_proxy_public: self.node_proxy_public.clone(),
                data_dir: self.instance.data_dir.clone(),
                cache_dir: self.instance.cache_dir.clone(),
                prefix: self.instance.prefix.clone(),
                pool: self.instance.pool.clone(),
                execd: self.instance.execd.clone(),
                default_images: Some(Vec::new()),
                lazy_restore_min_mib: self.lazy_restore_min_mib.clone(),
                sandbox_reach: self.instance.sandbox_reach(),
                allow_host_volume: self.instance.allow_host_volume(),
                ..Settings::default()
            }))
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
    let meeting = match (&args.join, &args.join_token_file, &args.control_url) {
        (Some(url), Some(token), _) => Meeting::Join {
            url: https_only(url, "--join")?,
            server_pin: {
                let cert = args
                    .server_cert
                    .as_deref()
                    .context("--join needs --server-cert")?;
                CertPin::of_pem_file(cert).context("--server-cert")?
            },
            token: join::join_token(token)?,
            node_id: join::node_id(args.node_name.as_deref())?,
            advertise_url: match &args.advertise_url {
                Some(url) => https_only(url, "--advertise-url")?,
                None if args.listen.ip().is_unspecified() => anyhow::bail!(
                    "--listen {} names no address the server can call: give --advertise-url",
                    args.listen
                ),
                None => format!("https://{}", args.listen),
            },
        },
        (_, _, Some(url)) => Meeting::Static {
            control_url: {
                crate::plaintext::check(url, "--control-url", args.allow_plaintext_pairing)?;
                url.clone()
            },
        },
        _ => anyhow::bail!("--control-url or --join is required"),
    };
    let binaries = node_side::binaries(&cfg, args.instance.criu.clone())?;
    node_side::runtime()?.block_on(run(cfg, args.listen, meeting, binaries))?;
    Ok(0)
}

/// `url` when it is `https://`: a joined node's channels to and from the server are TLS.
fn https_only(url: &str, flag: &str) -> anyhow::Result<String> {
    for one in url.split(',') {
        anyhow::ensure!(
            one.trim().starts_with("https://"),
            "{flag} {one:?}: a node that joins talks to its server over TLS only (https://)"
        );
    }
    Ok(url.to_string())
}

/// Where a joined node keeps its node API's TLS identity.
pub const NODE_TLS_DIR: &str = "node-tls";

/// How the node meets its server.
enum Meeting {
    /// It registers at `url` (whose certificate `server_pin` names) with the join token.
    Join {
        url: String,
        server_pin: CertPin,
        token: fastbox_node_api::remote::Credential,
        node_id: String,
        advertise_url: String,
    },
    /// The server was given its URL and credentials.
    Static { control_url: String },
}

/// How long a joining node waits for a server that does not answer yet.
const JOIN_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs the node until SIGTERM or SIGINT.
async fn run(
    cfg: ServerConfig,
    listen: SocketAddr,
    meeting: Meeting,
    binaries: NodeBinaries,
) -> anyhow::Result<()> {
    let data_dir = cfg.data_dir.clone();
    node_side::create_data_dir(&data_dir)?;
    let static_credentials = match &meeting {
        Meeting::Static { .. } => {
            let (credentials, created) = NodeCredentials::load_or_create(&data_dir)?;
            println!(
                "fastbox: node credentials {} in {} (hand them to the server: fastbox node --print-credentials)",
                if created { "made" } else { "kept" },
                NodeCredentials::dir(&data_dir).display()
            );
            Some(credentials)
        }
        Meeting::Join { .. } => None,
    };
    // A node that joins holds a lease: its self-fencing guard (a process that outlives this
    // one) freezes its sandboxes when a lease deadline passes unrenewed.
    let lease = join::LeaseClock::default();
    let fence = match &meeting {
        Meeting::Join { .. } => Some(Arc::new(join::GuardFence::start(&data_dir, &cfg.prefix)?)),
        Meeting::Static { .. } => None,
    };
    // Signed routes verify with these keys: the server's. A node that joins is given them
    // (and their rotations) with the server's answers; copy them to a static node.
    let key_path = data_dir.join(ROUTE_KEY_FILE);
    let keys = RouteKeys::load_or_create(&key_path).map_err(UpError::from)?;
    let key_file = join::RouteKeyFile {
        keys: keys.clone(),
        path: key_path,
    };
    let node_store = node_side::open_node_store(&cfg).await?;
    let fastlet = node_side::start_fastlet(&cfg, binaries, &node_store).await?;
    // The records are the server's: every pooled sandbox is kept (it may have been claimed;
    // a clean stop removed the unclaimed ones), and every slot on the host is held for the
    // server to take its sandbox back.
    node_side::recover_and_start(&fastlet, &pooled_ids(&data_dir), UnheldSlots::Hold);

    // A joined node's API is TLS, with an identity of its own it registers the pin of.
    let tls = match &meeting {
        Meeting::Join { .. } => Some(
            TlsIdentity::load_or_create(&data_dir.join(NODE_TLS_DIR), &[listen.ip().to_string()])
                .context("the node API's TLS identity")?,
        ),
        Meeting::Static { .. } => None,
    };
    // Listening before the registration names the node API: the server may call at once.
    let api_listener = node_side::bind(listen).await?;
    let proxy_listener = node_side::bind(cfg.node_proxy_listen).await?;
    let proxy_public = cfg
        .node_proxy_public
        .clone()
        .unwrap_or_else(|| cfg.node_proxy_listen.to_string());
    let (node_id, control_url, server_pin, credentials, terms) = match (meeting, static_credentials)
    {
        (
            Meeting::Join {
                url,
                server_pin,
                token,
                node_id,
                advertise_url,
            },
            _,
        ) => {
            let registration = fastbox_node_api::membership::Registration {
                node_id: node_id.clone(),
                url: advertise_url,
                proxy_public: proxy_public.clone(),
                tls_pin: tls.as_ref().map(|t| t.pin().to_string()),
            };
            let registered = join::register(
                &url,
                server_pin,
                &token,
                &data_dir,
                &registration,
                JOIN_PATIENCE,
            )
            .await?;
            // Until the first heartbeat: the lease the registration started.
            lease.set_for(std::time::Duration::from_millis(
                registered.terms.fence_after_ms(),
            ));
            println!(
                "fastbox: joined {url} as node {node_id} (lease {} ms, a heartbeat every {} ms)",
                registered.terms.lease_ms, registered.terms.heartbeat_ms
            );
            let credentials = NodeCredentials {
                server_to_node: registered.server_to_node.parse()?,
                node_to_server: registered.node_to_server.parse()?,
            };
            if let Some(text) = &registered.route_keys {
                key_file.install(text);
            }
            (
                node_id,
                url,
                Some(server_pin),
                credentials,
                Some(registered.terms),
            )
        }
        (Meeting::Static { control_url }, Some(credentials)) => {
            (listen.to_string(), control_url, None, credentials, None)
        }
        (Meeting::Static { .. }, None) => unreachable!("static credentials were loaded"),
    };
    let mut control = ControlClient::new(&control_url, credentials.node_to_server.clone())
        .with_context(|| format!("control URL {control_url}"))?;
    if let Some(pin) = server_pin {
        control = control.with_pinned_cert(pin)?;
    }
    let control = Arc::new(control);
    let node = Arc::new(node_side::local_node(fastlet.clone(), node_id, &node_store));
    let proxy = node_side::node_proxy(
        &cfg,
        fastlet.clone(),
        keys,
        control.clone(),
        control.clone(),
    );
    node.attach_proxy(proxy.clone());
    let heartbeats = async {
        match (terms, fence.clone()) {
            (Some(terms), Some(fence)) => {
                let why =
                    join::heartbeat(control, node.clone(), terms, fence, key_file, lease.clone())
                        .await;
                tracing::error!(error = %why, "heartbeats stopped");
                eprintln!("fastbox: {why:#}");
                std::future::pending::<()>().await
            }
            _ => std::future::pending::<()>().await,
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut api_router = node_router(node.clone(), credentials.server_to_node.clone());
    if let Some(fence) = &fence {
        // A node that holds a lease starts nothing once its own deadline passed.
        api_router = api_router.layer(axum::middleware::from_fn_with_state(
            join::Gate {
                lease: lease.clone(),
                fence: fence.clone(),
            },
            join::gate,
        ));
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let api_stop = stop_rx.clone();
    let api = async {
        match &tls {
            Some(identity) => {
                let acceptor = identity.acceptor().map_err(std::io::Error::other)?;
                serve_tls(api_listener, acceptor, api_router, api_stop).await
            }
            None => node_side::serve(api_listener, api_router, api_stop).await,
        }
    };
    let proxied = node_side::serve(proxy_listener, node_proxy::router(proxy), stop_rx);
    println!(
        "fastbox: node API on {scheme}://{listen}, node proxy on {} (public {}), control plane {control_url}, data in {}",
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
        () = heartbeats => {}
        () = node_side::shutdown_signal() => {
            println!("fastbox: stopping; sandboxes keep running and the server takes them back");
            let _ = stop_tx.send(true);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(5), &mut servers).await;
        }
    }
    drop(node);
    node_side::stop(fastlet, node_store).await;
    if let Some(fence) = &fence {
        fence.release();
    }
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
