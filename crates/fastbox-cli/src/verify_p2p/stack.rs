//! A node's artifact stack, from the flags of `fastbox verify p2p-node`: the node block cache
//! (`DATA_DIR/block-cache`, a byte budget) in front of either DART delivery (peers, then the
//! S3 origin; the node also serves its peers) or, with no peers, the S3 origin alone. The
//! stack itself is `fastbox_fastlet::node_store`, which `fastbox up` opens too.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, ensure};
use fastbox_fastlet::node_store::{DartSettings, NodeStore, NodeStoreConfig, StoreLocation};

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

impl StackConfig {
    /// The node store these flags describe (the origin must be remote: nodes share it).
    pub fn node_store_config(&self) -> anyhow::Result<NodeStoreConfig> {
        let location = StoreLocation::parse(&self.origin).context("--origin")?;
        ensure!(
            location.is_remote(),
            "--origin must be an s3:// URL that every node reaches"
        );
        let dart = DartSettings::from_parts(
            Some(&self.node),
            self.listen,
            &self.peers,
            self.dart_key.as_deref(),
        )?;
        Ok(NodeStoreConfig {
            location,
            cache_budget: self.cache_mib << 20,
            dart,
        })
    }

    /// Open the stack under `data_dir` and start its peer server.
    pub fn open(&self, data_dir: &Path) -> anyhow::Result<NodeStore> {
        let config = self.node_store_config()?;
        NodeStore::open(&config, data_dir, &|name| std::env::var(name).ok())
            .context("open the node's artifact stack")
    }
}
