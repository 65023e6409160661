//! A node's artifact store: where it publishes templates, snapshots and pause checkpoints,
//! and what it reads artifacts through (DESIGN §2: the artifact store and DART).
//!
//! ```text
//! local directory (default: DATA_DIR/artifacts)   read and written directly
//! s3://bucket/prefix (the origin)                 behind the node block cache, DATA_DIR/block-cache:
//!   without peers:    CachedStore: cache, then the origin
//!   with DART peers:  Delivery: cache, then the block's owner and other peers, then the
//!                     origin; and this node's peer server, serving its peers from the cache
//! ```
//!
//! [`NodeStore::open`] assembles the layers from a [`NodeStoreConfig`] (a [`StoreLocation`],
//! a cache budget, optional [`DartSettings`]); `fastbox up` and `fastbox verify p2p-node` both
//! use it. The configuration types are `fastbox_dart::store_config`'s (pure configuration,
//! which the lifecycle server resolves without this crate), re-exported here. A
//! [`NodeStore`]'s parts:
//! - [`NodeStore::store`]: what the fastlet publishes into and reads from
//!   (`FastletConfig::artifact_store`). Writes, the index and listings reach the origin in
//!   every layout; a `CachedStore` also keeps what it wrote, a `Delivery` does not.
//! - [`NodeStore::origin`]: the origin itself, which garbage collection works on (the node's
//!   cache is not part of the store's contents: a block collected at the origin and still
//!   cached here is harmless, since every cached read is verified).
//! - counters and statistics of whichever layer fetched ([`NodeStore::counters`],
//!   [`NodeStore::dart_counters`], [`NodeStore::fetch_stats`], [`NodeStore::cache_stats`]).
//!
//! A local directory gets no block cache (its reads are local already) and cannot be shared
//! through DART: DART needs an origin every node reaches. The peer server runs on its own
//! small runtime from [`NodeStore::open`] until [`NodeStore::shutdown`] or drop; both are
//! safe on any thread, as is dropping the S3 store.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fastbox_artifact::{
    ArtifactStore, BlockCache, CacheError, CacheStats, CachedStore, CachedStoreStats, DelayedStore,
};
use fastbox_dart::{CounterSnapshot, DartConfig, Delivery, PeerServer, StartError};

pub use fastbox_dart::store_config::{
    DART_KEY_ENV, DartSettings, DartSettingsError, LOCAL_STORE_DIR, LocationError, NodeStoreConfig,
    StoreLocation,
};

/// The node block cache's directory under the node's data directory.
pub const BLOCK_CACHE_DIR: &str = "block-cache";

/// Why a node store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NodeStoreError {
    /// The origin does not parse or does not open.
    #[error(transparent)]
    Location(#[from] LocationError),
    /// The node block cache could not be opened.
    #[error("node block cache {}: {source}", dir.display())]
    Cache { dir: PathBuf, source: CacheError },
    /// DART configured over a local directory.
    #[error(
        "DART peers share a remote origin: set the artifact store to s3://bucket/prefix (a local directory {0} is this node's alone)"
    )]
    DartNeedsRemoteOrigin(PathBuf),
    /// The peer server's address is taken or not ours.
    #[error("DART peer server: cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The peer server did not start.
    #[error("DART peer server: {0}")]
    PeerServer(#[from] StartError),
}

/// What a node fetched, from where, whatever its layout (zero where a layer has no such
/// source: a node without peers fetches nothing from peers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStoreCounters {
    /// Block reads answered from the node block cache.
    pub cache_hits: u64,
    /// Blocks received from a peer.
    pub peer_fetches: u64,
    /// Blocks fetched from the origin.
    pub origin_fetches: u64,
    /// Bytes received from peers or the origin, verified.
    pub bytes_verified: u64,
    /// Blocks this node began to serve to peers.
    pub peer_served: u64,
    /// Cached blocks found corrupt on read (dropped and fetched again).
    pub corrupt_dropped: u64,
}

/// The read path in front of the origin.
enum Reads {
    /// The origin itself (a local directory).
    Direct,
    /// The block cache, then the origin.
    Cached(Arc<CachedStore>),
    /// The block cache, the peers, then the origin.
    Dart(Arc<Delivery>),
}

/// The environment variable that delays every block read from the origin by this many
/// milliseconds: the latency of a remote origin, for benchmarks and verification runs on one
/// machine (`fastbox verify cluster --origin-block-delay-ms`). Not for production use.
pub const ORIGIN_BLOCK_DELAY_ENV: &str = "FASTBOX_ORIGIN_BLOCK_DELAY_MS";

/// `origin`, delayed as [`ORIGIN_BLOCK_DELAY_ENV`] says.
fn delayed_origin(
    origin: Arc<dyn ArtifactStore>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Arc<dyn ArtifactStore> {
    match env(ORIGIN_BLOCK_DELAY_ENV).and_then(|ms| ms.trim().parse::<u64>().ok()) {
        Some(ms) if ms > 0 => {
            tracing::warn!(
                ms,
                "every block read from the artifact origin is delayed ({ORIGIN_BLOCK_DELAY_ENV})"
            );
            Arc::new(DelayedStore::new(
                origin,
                std::time::Duration::from_millis(ms),
            ))
        }
        _ => origin,
    }
}

/// A node's open artifact store. See the module docs.
pub struct NodeStore {
    location: StoreLocation,
    origin: Arc<dyn ArtifactStore>,
    reads: Reads,
    cache: Option<Arc<BlockCache>>,
    peer_server: Mutex<Option<PeerServer>>,
    peer_addr: Option<SocketAddr>,
}

impl NodeStore {
    /// Open the origin (S3 credentials looked up through `env`), the block cache under
    /// `data_dir` and, with DART, start the peer server. Blocks (an S3 origin is checked
    /// over the network): call it from a plain or `spawn_blocking` thread.
    pub fn open(
        config: &NodeStoreConfig,
        data_dir: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, NodeStoreError> {
        if let (StoreLocation::Local(path), Some(_)) = (&config.location, &config.dart) {
            return Err(NodeStoreError::DartNeedsRemoteOrigin(path.clone()));
        }
        let origin = delayed_origin(config.location.open(env)?, env);
        let mut store = NodeStore {
            location: config.location.clone(),
            origin: origin.clone(),
            reads: Reads::Direct,
            cache: None,
            peer_server: Mutex::new(None),
            peer_addr: None,
        };
        if !config.location.is_remote() {
            return Ok(store);
        }
        let dir = data_dir.join(BLOCK_CACHE_DIR);
        let cache = Arc::new(
            BlockCache::open(&dir, config.cache_budget)
                .map_err(|source| NodeStoreError::Cache { dir, source })?,
        );
        store.cache = Some(cache.clone());
        let Some(dart) = &config.dart else {
            store.reads = Reads::Cached(Arc::new(CachedStore::new(cache, origin)));
            return Ok(store);
        };
        if !dart.in_group() {
            tracing::warn!(node = %dart.node, "this node is not in its DART member list: it reads through the group but owns no block");
        }
        let listener = TcpListener::bind(dart.listen).map_err(|source| NodeStoreError::Listen {
            addr: dart.listen,
            source,
        })?;
        let delivery = Arc::new(Delivery::new(
            DartConfig::new(dart.node.clone(), dart.members.clone(), dart.secret.clone()),
            cache,
            origin,
        ));
        let server = PeerServer::serve(listener, delivery.peer_state())?;
        store.peer_addr = Some(server.local_addr());
        store.peer_server = Mutex::new(Some(server));
        store.reads = Reads::Dart(delivery);
        Ok(store)
    }

    /// What the node publishes into and reads artifacts through.
    pub fn store(&self) -> Arc<dyn ArtifactStore> {
        match &self.reads {
            Reads::Direct => self.origin.clone(),
            Reads::Cached(cached) => cached.clone(),
            Reads::Dart(delivery) => delivery.clone(),
        }
    }

    /// The origin itself (garbage collection works on it).
    pub fn origin(&self) -> &Arc<dyn ArtifactStore> {
        &self.origin
    }

    /// Where the origin is.
    pub fn location(&self) -> &StoreLocation {
        &self.location
    }

    /// Keeps `blocks` in the block cache (never evicted) until [`NodeStore::unpin`] of the
    /// same `holder`: the blocks of an artifact this node uses or serves its peers. A no-op
    /// without a cache (a local origin).
    pub fn pin(&self, holder: &str, blocks: impl IntoIterator<Item = fastbox_artifact::Digest>) {
        if let Some(cache) = &self.cache {
            cache.pin(holder, blocks);
        }
    }

    /// Releases what `holder` pinned.
    pub fn unpin(&self, holder: &str) {
        if let Some(cache) = &self.cache {
            cache.unpin(holder);
        }
    }

    /// The node block cache (a remote origin only).
    pub fn cache_stats(&self) -> Option<CacheStats> {
        self.cache.as_ref().map(|cache| cache.stats())
    }

    /// The DART delivery counters (with peers only) and this node's id.
    pub fn dart_counters(&self) -> Option<(&fastbox_dart::NodeId, CounterSnapshot)> {
        match &self.reads {
            Reads::Dart(delivery) => Some((delivery.node(), delivery.counters())),
            _ => None,
        }
    }

    /// What the caching store fetched (a remote origin without peers only).
    pub fn fetch_stats(&self) -> Option<CachedStoreStats> {
        match &self.reads {
            Reads::Cached(cached) => Some(cached.stats()),
            _ => None,
        }
    }

    /// Where the peer server listens (with DART only).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// What the node fetched, from where, in one shape for every layout.
    pub fn counters(&self) -> NodeStoreCounters {
        let corrupt_dropped = self.cache_stats().map_or(0, |s| s.corrupt_dropped);
        let counters = match &self.reads {
            Reads::Direct => NodeStoreCounters::default(),
            Reads::Cached(cached) => {
                let s = cached.stats();
                NodeStoreCounters {
                    cache_hits: s.block_hits,
                    origin_fetches: s.block_fetches,
                    bytes_verified: s.fetched_bytes,
                    ..NodeStoreCounters::default()
                }
            }
            Reads::Dart(delivery) => {
                let c = delivery.counters();
                NodeStoreCounters {
                    cache_hits: c.cache_hits,
                    peer_fetches: c.peer_fetches,
                    origin_fetches: c.origin_fetches,
                    bytes_verified: c.bytes_verified,
                    peer_served: c.peer_served,
                    ..NodeStoreCounters::default()
                }
            }
        };
        NodeStoreCounters {
            corrupt_dropped,
            ..counters
        }
    }

    /// One line for the start-up log: the origin, the cache budget, the group.
    pub fn describe(&self) -> String {
        let mut text = match &self.location {
            StoreLocation::Local(path) => format!("local directory {}", path.display()),
            remote => remote.to_string(),
        };
        if let Some(stats) = self.cache_stats() {
            text.push_str(&format!(
                ", through a {} MiB node block cache",
                stats.budget >> 20
            ));
        }
        if let (Reads::Dart(delivery), Some(addr)) = (&self.reads, self.peer_addr) {
            text.push_str(&format!(
                ", DART node {} serving peers on {addr} ({} members)",
                delivery.node(),
                delivery.members().members().len()
            ));
        }
        text
    }

    /// Stop the peer server (connections are cut). Idempotent; also done on drop.
    pub fn shutdown(&self) {
        let server = self
            .peer_server
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        if let Some(server) = server {
            server.shutdown();
        }
    }
}

/// The local default store of a node whose data directory is `data_dir`
/// (`DATA_DIR/artifacts`), for fastlets that need no origin, cache or peers (builders,
/// benchmarks).
pub fn open_local(data_dir: &Path) -> Result<Arc<dyn ArtifactStore>, LocationError> {
    StoreLocation::local_default(data_dir).open(&|_| None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fastbox_artifact::Digest;
    use fastbox_s3::S3Config;
    use fastbox_testkit::s3::{S3Server, S3ServerKind};

    /// A running s3s-fs with a bucket, the location of a prefix in it and the credentials
    /// (as an environment lookup); None, after printing why, when s3s-fs is not installed.
    fn s3_origin() -> Option<(S3Server, StoreLocation, impl Fn(&str) -> Option<String>)> {
        if let Some(reason) = S3ServerKind::S3sFs.unavailable() {
            eprintln!("skipped: {reason}");
            return None;
        }
        let server = S3Server::start(S3ServerKind::S3sFs).expect("start s3s-fs");
        let url = format!(
            "s3://{}/node?endpoint={}",
            server.bucket(),
            server.endpoint()
        );
        let location = StoreLocation::parse(&url).unwrap();
        let (id, secret) = (
            server.access_key().to_string(),
            server.secret_key().to_string(),
        );
        let env = move |name: &str| match name {
            "AWS_ACCESS_KEY_ID" => Some(id.clone()),
            "AWS_SECRET_ACCESS_KEY" => Some(secret.clone()),
            _ => None,
        };
        let StoreLocation::S3(config) = &location else {
            unreachable!("an s3:// URL");
        };
        fastbox_s3::create_bucket(&S3Config::clone(config).with_env(&env))
            .expect("create the bucket");
        Some((server, location, env))
    }

    #[test]
    fn an_s3_origin_is_read_through_the_node_block_cache() {
        let Some((_server, location, env)) = s3_origin() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let store = NodeStore::open(&config(location, None), dir.path(), &env).unwrap();
        let bytes = vec![7u8; 100_000];
        let digest = Digest::of(&bytes);
        store.origin().put_block(&digest, &bytes).unwrap();

        assert_eq!(store.store().get_block(&digest).unwrap(), bytes);
        assert_eq!(store.store().get_block(&digest).unwrap(), bytes);
        let counters = store.counters();
        assert_eq!(
            (counters.origin_fetches, counters.cache_hits),
            (1, 1),
            "{counters:?}"
        );
        assert_eq!(counters.bytes_verified, bytes.len() as u64);
        let cache = store.cache_stats().unwrap();
        assert_eq!((cache.blocks, cache.budget), (1, 64 << 20));
        assert!(dir.path().join(BLOCK_CACHE_DIR).join("blocks").is_dir());
        assert!(store.fetch_stats().is_some() && store.dart_counters().is_none());
        assert!(
            store.describe().contains("64 MiB node block cache"),
            "{}",
            store.describe()
        );
    }

    #[test]
    fn with_dart_the_node_serves_its_peers_and_counts_by_source() {
        let Some((_server, location, env)) = s3_origin() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let key = "0123456789abcdef-group";
        let dart = DartSettings::from_parts(
            Some("n1"),
            Some("127.0.0.1:0".parse().unwrap()),
            &["n1=127.0.0.1:9".to_string()],
            Some(key),
        )
        .unwrap();
        let store = NodeStore::open(&config(location, dart), dir.path(), &env).unwrap();
        let bytes = vec![9u8; 50_000];
        let digest = Digest::of(&bytes);
        store.origin().put_block(&digest, &bytes).unwrap();

        // This node owns every block of its one-member group: the origin, once.
        assert_eq!(store.store().get_block(&digest).unwrap(), bytes);
        assert_eq!(store.store().get_block(&digest).unwrap(), bytes);

        // A peer holding the group secret gets the block from this node's peer server.
        let addr = store.peer_addr().unwrap();
        let member: fastbox_dart::Member = format!("n1={addr}").parse().unwrap();
        let peer = fastbox_dart::PeerClient::new(
            fastbox_dart::NodeId::try_new("n2").unwrap(),
            fastbox_dart::GroupSecret::try_new(key.as_bytes().to_vec()).unwrap(),
            fastbox_dart::PeerTimeouts::default(),
        );
        let served = peer
            .fetch(&member, &digest, fastbox_dart::FetchMode::LocalOnly)
            .unwrap();
        assert_eq!(served.as_deref(), Some(bytes.as_slice()));

        let counters = store.counters();
        assert_eq!(
            (
                counters.origin_fetches,
                counters.cache_hits,
                counters.peer_served
            ),
            (1, 1, 1),
            "{counters:?}"
        );
        let (node, dart) = store.dart_counters().unwrap();
        assert_eq!((node.as_str(), dart.peer_fetches), ("n1", 0));
        assert!(
            store.describe().contains("DART node n1 serving peers on"),
            "{}",
            store.describe()
        );

        store.shutdown();
        let after = peer.fetch(&member, &digest, fastbox_dart::FetchMode::LocalOnly);
        assert!(after.is_err(), "the peer server is stopped: {after:?}");
    }

    fn config(location: StoreLocation, dart: Option<DartSettings>) -> NodeStoreConfig {
        NodeStoreConfig {
            location,
            cache_budget: 64 << 20,
            dart,
        }
    }

    #[test]
    fn a_local_directory_is_read_directly_without_a_cache() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeStore::open(
            &config(StoreLocation::local_default(dir.path()), None),
            dir.path(),
            &|_| None,
        )
        .unwrap();
        let bytes = b"published";
        let digest = Digest::of(bytes);
        store.store().put_block(&digest, bytes).unwrap();
        assert!(store.origin().has_block(&digest).unwrap());
        assert!(store.cache_stats().is_none() && store.dart_counters().is_none());
        assert!(!dir.path().join(BLOCK_CACHE_DIR).exists());
        assert_eq!(store.counters(), NodeStoreCounters::default());
        assert!(
            store.describe().starts_with("local directory "),
            "{}",
            store.describe()
        );
    }

    #[test]
    fn dart_over_a_local_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let dart = DartSettings::from_parts(
            Some("n1"),
            Some("127.0.0.1:0".parse().unwrap()),
            &["n1=127.0.0.1:7443".to_string()],
            Some("0123456789abcdef"),
        )
        .unwrap();
        let error = NodeStore::open(
            &config(StoreLocation::local_default(dir.path()), dart),
            dir.path(),
            &|_| None,
        )
        .err()
        .unwrap();
        assert!(
            matches!(error, NodeStoreError::DartNeedsRemoteOrigin(_)),
            "{error:?}"
        );
        assert!(error.to_string().contains("s3://"), "{error}");
    }
}
