//! A node's artifact stack: its block cache (`DATA_DIR/block-cache`, a byte budget) in front
//! of either DART delivery (peers, then the S3 origin; the node also serves its peers) or, with
//! no peers, the S3 origin alone. Counters come from whichever layer fetched.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, ensure};
use fastbox_artifact::{ArtifactStore, BlockCache, CachedStore};
use fastbox_dart::{DartConfig, Delivery, GroupSecret, Membership, NodeId, PeerServer};
use fastbox_s3::{S3Config, S3Store};

/// How a node reaches its blocks (flags of `fastbox verify p2p-node`).
#[derive(clap::Args, Debug, Clone)]
pub struct StackConfig {
    /// This node's id in the delivery group.
    #[arg(long)]
    pub node: String,
    /// The origin: `s3://BUCKET[/PREFIX]?endpoint=URL` (credentials from `AWS_ACCESS_KEY_ID`
    /// and `AWS_SECRET_ACCESS_KEY`).
    #[arg(long)]
    pub origin: String,
    /// Where this node serves its peers; without it the node has no peers and fetches every
    /// block from the origin.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// The delivery group, this node included: `ID=HOST:PORT,...`.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Byte budget of the node's block cache, MiB.
    #[arg(long, default_value_t = 1024)]
    pub cache_mib: u64,
    /// The group secret peers sign their requests with (at least 16 bytes).
    #[arg(long, env = "FASTBOX_DART_KEY", hide_env_values = true)]
    pub dart_key: Option<String>,
}

/// What a node fetched, from where.
#[derive(Debug, Clone, Copy, Default)]
pub struct StackCounters {
    pub cache_hits: u64,
    pub peer_fetches: u64,
    pub origin_fetches: u64,
    pub bytes_verified: u64,
    pub peer_served: u64,
    /// Cached blocks found corrupt (dropped and fetched again).
    pub corrupt_dropped: u64,
}

enum Layer {
    Dart(Arc<Delivery>),
    Direct(Arc<CachedStore>),
}

/// The open stack of one node.
pub struct NodeStack {
    layer: Layer,
    server: Option<PeerServer>,
    cache: Arc<BlockCache>,
}

impl NodeStack {
    /// Opens the origin and the cache under `data_dir`, and starts the peer server.
    pub fn open(cfg: &StackConfig, data_dir: &Path) -> anyhow::Result<Self> {
        let origin_cfg = S3Config::from_url(&cfg.origin)
            .context("--origin")?
            .with_env(|name| std::env::var(name).ok());
        let origin: Arc<dyn ArtifactStore> =
            Arc::new(S3Store::open(origin_cfg).context("open the origin")?);
        let cache = Arc::new(
            BlockCache::open(&data_dir.join("block-cache"), cfg.cache_mib << 20)
                .context("open the block cache")?,
        );
        let Some(listen) = cfg.listen else {
            return Ok(Self {
                layer: Layer::Direct(Arc::new(CachedStore::new(cache.clone(), origin))),
                server: None,
                cache,
            });
        };
        let key = cfg
            .dart_key
            .clone()
            .context("peers need a group secret: FASTBOX_DART_KEY")?;
        ensure!(!cfg.peers.is_empty(), "--listen needs --peers");
        let node = NodeId::try_new(cfg.node.clone()).context("--node")?;
        let members = Membership::parse(&cfg.peers).context("--peers")?;
        let secret = GroupSecret::try_new(key.into_bytes()).context("FASTBOX_DART_KEY")?;
        let delivery = Arc::new(Delivery::new(
            DartConfig::new(node, members, secret),
            cache.clone(),
            origin,
        ));
        let listener = TcpListener::bind(listen).with_context(|| format!("listen on {listen}"))?;
        let server =
            PeerServer::serve(listener, delivery.peer_state()).context("start the peer server")?;
        Ok(Self {
            layer: Layer::Dart(delivery),
            server: Some(server),
            cache,
        })
    }

    /// The store restores read through.
    pub fn store(&self) -> &dyn ArtifactStore {
        match &self.layer {
            Layer::Dart(d) => d.as_ref(),
            Layer::Direct(c) => c.as_ref(),
        }
    }

    pub fn counters(&self) -> StackCounters {
        let corrupt_dropped = self.cache.stats().corrupt_dropped;
        let counters = match &self.layer {
            Layer::Dart(d) => {
                let c = d.counters();
                StackCounters {
                    cache_hits: c.cache_hits,
                    peer_fetches: c.peer_fetches,
                    origin_fetches: c.origin_fetches,
                    bytes_verified: c.bytes_verified,
                    peer_served: c.peer_served,
                    ..StackCounters::default()
                }
            }
            Layer::Direct(c) => {
                let s = c.stats();
                StackCounters {
                    cache_hits: s.block_hits,
                    origin_fetches: s.block_fetches,
                    bytes_verified: s.fetched_bytes,
                    ..StackCounters::default()
                }
            }
        };
        StackCounters {
            corrupt_dropped,
            ..counters
        }
    }
}

impl Drop for NodeStack {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
    }
}
