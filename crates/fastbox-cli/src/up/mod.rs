//! `fastbox up` (the whole service on this machine), `fastbox purge` and `fastbox leftovers`
//! (an instance's host-wide state, for clean-up and leak checks).

use std::net::SocketAddr;
use std::path::PathBuf;

use fastbox_server::config::{ServerConfig, Settings};

use crate::node::NodeCredentials;
use crate::paths;

pub(crate) mod node_side;
mod run;
mod shared_files;
pub use run::{CONTROL_TLS_DIR, JOIN_TOKEN_FILE, ROUTE_KEY_FILE, UpError};
use run::{NodeMode, RemoteNode};

/// Every setting can also come from the config file; flags and environment win over it.
#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// TOML config file (keys as the long flags, with `_`: `listen`, `api_key`,
    /// `default_images = [...]`, ...).
    #[arg(long, env = "FASTBOX_CONFIG")]
    pub config: Option<PathBuf>,
    /// Lifecycle API address [default: 127.0.0.1:8080].
    #[arg(long, env = "FASTBOX_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Node proxy address; the endpoints handed to clients point here [default: 127.0.0.1:8081].
    #[arg(long, env = "FASTBOX_NODE_PROXY_LISTEN")]
    pub node_proxy_listen: Option<SocketAddr>,
    /// `host:port` clients should use for the node proxy, when not its listen address.
    #[arg(long, env = "FASTBOX_NODE_PROXY_PUBLIC")]
    pub node_proxy_public: Option<String>,
    /// API key clients send as OPEN-SANDBOX-API-KEY [default: generated at first start and
    /// kept in DATA_DIR/api-key].
    #[arg(long, env = "FASTBOX_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub instance: InstanceArgs,
    /// Image prepared before /health answers 200 (repeatable) [default: python:3.12].
    #[arg(
        long = "default-image",
        env = "FASTBOX_DEFAULT_IMAGES",
        value_delimiter = ','
    )]
    pub default_images: Option<Vec<String>>,
    /// Prepare no image at start.
    #[arg(long, conflicts_with = "default_images")]
    pub no_default_images: bool,
    /// Longest sandbox timeout a create may ask for, seconds [default: 86400].
    #[arg(long)]
    pub max_timeout_seconds: Option<u64>,
    /// How long terminated and failed sandboxes stay listed, seconds [default: 3600].
    #[arg(long)]
    pub retention_seconds: Option<u64>,
    /// How long a create waits for its image before answering `Pending` (an image that
    /// fails within this time is a 400) [default: 1500].
    #[arg(long)]
    pub create_image_wait_ms: Option<u64>,
    /// How long an endpoint lookup waits for a `Pending` or `Resuming` sandbox to run
    /// before answering 409 (not ready) [default: 10000].
    #[arg(long)]
    pub endpoint_wait_ms: Option<u64>,
    /// Sets both --pool-min and --pool-max: unclaimed sandboxes kept restored per template,
    /// ready for creates; 0 turns the warm pool off.
    #[arg(long, env = "FASTBOX_POOL_SIZE")]
    pub pool_size: Option<usize>,
    /// Unclaimed sandboxes kept per template when idle [default: 2].
    #[arg(long, env = "FASTBOX_POOL_MIN")]
    pub pool_min: Option<usize>,
    /// Most unclaimed sandboxes kept per template: the pool grows to the number of creates
    /// of the template in the last 30 s, up to this [default: 10].
    #[arg(long, env = "FASTBOX_POOL_MAX")]
    pub pool_max: Option<usize>,
    /// Network slots with an empty writable layer kept made ahead of demand, so a restore
    /// only mounts an overlay and runs CRIU; 0 makes each slot at its restore [default: 10].
    #[arg(long, env = "FASTBOX_SPARE_SLOTS")]
    pub spare_slots: Option<usize>,
    /// Clones of a snapshot (creates from it, forks) and resumes whose memory is at least
    /// this many MiB answer before their memory is copied in, which then happens in the
    /// background; `off` restores every one whole [default: 64]. A resume of a sandbox
    /// paused on another node is always restored this way.
    #[arg(long, env = "FASTBOX_LAZY_RESTORE_MIN_MIB", value_name = "MIB|off")]
    pub lazy_restore_min_mib: Option<String>,
    /// DNS server (`address:port`, repeatable) that sandboxes' allowed names are resolved
    /// with [default: the host's resolvers from /etc/resolv.conf].
    #[arg(long = "dns-upstream")]
    pub dns_upstreams: Vec<std::net::SocketAddr>,
    /// A network (`a.b.c.d/len`, `x::/len` or an address, repeatable) in the private,
    /// loopback, link-local or other special ranges that image registries, their token realms
    /// and redirects may be in; pulls refuse those ranges otherwise (request forgery), except
    /// for registries configured by name [default: none].
    #[arg(
        long = "registry-allow-private",
        env = "FASTBOX_REGISTRY_ALLOW_PRIVATE",
        value_delimiter = ',',
        value_name = "CIDR"
    )]
    pub registry_allow_private: Vec<String>,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub state: StateArgs,
    /// How often the artifact store's garbage is collected: `24h`, `30m`, ... or `off`
    /// [default: 24h for a local directory, off for an s3:// store].
    #[arg(long, env = "FASTBOX_ARTIFACT_GC_INTERVAL")]
    pub artifact_gc_interval: Option<String>,
    /// Objects written more recently than this are never collected [default: 24h].
    #[arg(long, env = "FASTBOX_ARTIFACT_GC_GRACE")]
    pub artifact_gc_grace: Option<String>,
    /// A directory under which the API accepts local image references (`dir:`, `oci:`,
    /// `oci-archive:`, `docker-archive:`, paths) from callers (repeatable); the server's own
    /// --default-image and `fastbox sandbox run` need none [default: none: callers get 400].
    #[arg(
        long = "allow-local-images",
        env = "FASTBOX_ALLOW_LOCAL_IMAGES",
        value_delimiter = ',',
        value_name = "DIR"
    )]
    pub allow_local_images: Option<Vec<PathBuf>>,
    /// cpu of a create that names none (a quantity: `1`, `500m`) [default: 1].
    #[arg(long, env = "FASTBOX_DEFAULT_CPU")]
    pub default_cpu: Option<String>,
    /// Memory of a create that names none [default: 512Mi].
    #[arg(long, env = "FASTBOX_DEFAULT_MEMORY")]
    pub default_memory: Option<String>,
    /// Writable layer of a create that names none (sparse); another size than the default
    /// keeps creates from using pooled sandboxes and spare slots [default: 10Gi].
    #[arg(long, env = "FASTBOX_DEFAULT_DISK")]
    pub default_disk: Option<String>,
    /// pids limit of a create that names none [default: 1024].
    #[arg(long, env = "FASTBOX_DEFAULT_PIDS")]
    pub default_pids: Option<u64>,
    /// Most cpu a create may ask for; more is a 400 [default: 4].
    #[arg(long, env = "FASTBOX_MAX_CPU")]
    pub max_cpu: Option<String>,
    /// Most memory a create may ask for; more is a 400 [default: 16Gi].
    #[arg(long, env = "FASTBOX_MAX_MEMORY")]
    pub max_memory: Option<String>,
    /// Largest writable layer a create may ask for; more (or more than the data directory's
    /// file system has free) is a 400 [default: 64Gi].
    #[arg(long, env = "FASTBOX_MAX_DISK")]
    pub max_disk: Option<String>,
    /// Highest pids limit a create may ask for; more is a 400 [default: 4096].
    #[arg(long, env = "FASTBOX_MAX_PIDS")]
    pub max_pids: Option<u64>,
    /// Longest a signed route (`expires`) may be valid: further ahead is a 400 when asked
    /// for and refused by the proxies: `24h`, `30m`, `90s` [default: 24h].
    #[arg(long, env = "FASTBOX_ROUTE_MAX_LIFETIME")]
    pub route_max_lifetime: Option<String>,
    /// Failed credential checks (route signatures, secure access tokens) per minute from one
    /// address before the proxies answer 429 [default: 20].
    #[arg(long, env = "FASTBOX_ACCESS_FAILURES_PER_SOURCE")]
    pub access_failures_per_source: Option<u32>,
    /// Failed credential checks per minute from all addresses together before the proxies
    /// answer 429 to everyone [default: 1000].
    #[arg(long, env = "FASTBOX_ACCESS_FAILURES_GLOBAL")]
    pub access_failures_global: Option<u32>,
    /// Run no node in this process: the lifecycle server uses the node agent (`fastbox
    /// node`) whose node API is at this URL (`http://HOST:PORT`); --node-proxy-public must
    /// name that node's proxy.
    #[arg(
        long,
        env = "FASTBOX_REMOTE_NODE",
        requires = "remote_node_credentials",
        requires = "node_proxy_public"
    )]
    pub remote_node: Option<String>,
    /// The remote node's credentials: the two lines `fastbox node --print-credentials`
    /// prints.
    #[arg(
        long,
        env = "FASTBOX_REMOTE_NODE_CREDENTIALS",
        requires = "remote_node"
    )]
    pub remote_node_credentials: Option<PathBuf>,
    /// Accept a plain-HTTP --remote-node beyond loopback: its credentials and the
    /// sandboxes' tokens cross the link readable (a link only the two hosts reach).
    #[arg(
        long,
        env = "FASTBOX_ALLOW_PLAINTEXT_PAIRING",
        requires = "remote_node"
    )]
    pub allow_plaintext_pairing: bool,
    /// Where the control API nodes call listens (their --control-url / --join).
    #[arg(long, env = "FASTBOX_CONTROL_LISTEN", default_value = "127.0.0.1:8092")]
    pub control_listen: SocketAddr,
    /// Accept `fastbox node --join` registrations on --control-listen (then TLS), besides
    /// the node in this process. They present the join token kept in
    /// DATA_DIR/node-join-token and pin the certificate DATA_DIR/control-tls/cert.pem (both
    /// made at the first start; hand both to the nodes). Servers sharing an etcd state share
    /// both: a node joins any of them.
    #[arg(long, env = "FASTBOX_ACCEPT_NODES", conflicts_with = "remote_node")]
    pub accept_nodes: bool,
    /// Place sandboxes on joined nodes only: the node in this process takes none (and keeps
    /// no warm pool). For servers that are only a control plane in front of `fastbox node`
    /// hosts.
    #[arg(long, env = "FASTBOX_NO_LOCAL_SANDBOXES", requires = "accept_nodes")]
    pub no_local_sandboxes: bool,
    /// How long a registered node's lease lasts, milliseconds; it heartbeats ten times as
    /// often, freezes its sandboxes when it cannot renew, and is declared lost half a lease
    /// after its lease ran out [default: 10000].
    #[arg(long, env = "FASTBOX_NODE_LEASE_MS")]
    pub node_lease_ms: Option<u64>,
}

/// Where the server keeps its records: the same for `fastbox up` and `fastbox state`.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct StateArgs {
    /// The state store: a redb file [default: DATA_DIR/state.redb], or
    /// `etcd://[USER@]HOST:PORT,...[/PREFIX]` for several servers sharing one state
    /// (`etcds://` over TLS; the password in FASTBOX_STATE_PASSWORD).
    #[arg(long, env = "FASTBOX_STATE", value_name = "URL")]
    pub state: Option<String>,
    /// The CA (PEM) that signed the etcd members' certificates [default: the system's].
    #[arg(long, env = "FASTBOX_STATE_CA", value_name = "FILE")]
    pub state_ca: Option<PathBuf>,
    /// A client certificate (PEM) for etcd, with --state-key.
    #[arg(long, env = "FASTBOX_STATE_CERT", value_name = "FILE")]
    pub state_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "FASTBOX_STATE_KEY", value_name = "FILE")]
    pub state_key: Option<PathBuf>,
    /// How long a state-store operation may go on trying the etcd members before the API
    /// answers 503, milliseconds [default: 10000].
    #[arg(long, env = "FASTBOX_STATE_TIMEOUT_MS")]
    pub state_timeout_ms: Option<u64>,
    /// The key that seals the records in etcd, the same file on every server (made on
    /// first use when missing) [default: DATA_DIR/state-seal.key].
    #[arg(long, env = "FASTBOX_STATE_SEAL_KEY", value_name = "FILE")]
    pub state_seal_key: Option<PathBuf>,
    /// This server's id among the servers sharing an etcd state (1-64 of [A-Za-z0-9._-]);
    /// its in-process node goes by it too [default: the host name].
    #[arg(long, env = "FASTBOX_SERVER_ID")]
    pub server_id: Option<String>,
    /// How long a server's lease in etcd lasts, milliseconds: a server that dies hands its
    /// leadership and its operations in flight to another within it [default: 5000].
    #[arg(long, env = "FASTBOX_SERVER_LEASE_MS")]
    pub server_lease_ms: Option<u64>,
    /// The etcd user's password (environment only: a flag shows in the process list).
    #[arg(skip = std::env::var("FASTBOX_STATE_PASSWORD").ok())]
    pub state_password: Option<String>,
}

impl StateArgs {
    /// `settings` with these flags' values.
    pub fn apply(&self, settings: Settings) -> Settings {
        Settings {
            state: self.state.clone(),
            state_ca: self.state_ca.clone(),
            state_cert: self.state_cert.clone(),
            state_key: self.state_key.clone(),
            state_timeout_ms: self.state_timeout_ms,
            state_seal_key: self.state_seal_key.clone(),
            server_id: self.server_id.clone(),
            server_lease_ms: self.server_lease_ms,
            state_password: self.state_password.clone(),
            ..settings
        }
    }
}

/// Where an instance publishes and fetches artifacts, and its DART delivery group: the same
/// for `fastbox up` and `fastbox node`.
#[derive(clap::Args, Debug)]
pub struct StoreArgs {
    /// Where templates, snapshots and pause checkpoints are published: an absolute directory
    /// or `s3://BUCKET[/PREFIX]?endpoint=URL` (credentials from AWS_ACCESS_KEY_ID and
    /// AWS_SECRET_ACCESS_KEY) [default: DATA_DIR/artifacts].
    #[arg(long, env = "FASTBOX_ARTIFACT_STORE")]
    pub artifact_store: Option<String>,
    /// Byte budget of the node block cache (DATA_DIR/block-cache) in front of an s3:// store,
    /// MiB [default: 4096].
    #[arg(long, env = "FASTBOX_BLOCK_CACHE_MIB")]
    pub block_cache_mib: Option<u64>,
    /// This node's id in its DART delivery group (1-64 of [A-Za-z0-9._-]).
    #[arg(long, env = "FASTBOX_NODE_ID")]
    pub node_id: Option<String>,
    /// Where this node's DART peer server listens (needs --dart-peers).
    #[arg(long, env = "FASTBOX_DART_LISTEN")]
    pub dart_listen: Option<SocketAddr>,
    /// The DART delivery group, this node included: `ID=HOST:PORT,...` (needs --node-id,
    /// --dart-listen, an s3:// store and the group secret in FASTBOX_DART_KEY).
    #[arg(long, env = "FASTBOX_DART_PEERS", value_delimiter = ',')]
    pub dart_peers: Option<Vec<String>>,
    /// The DART group secret, at least 16 bytes, the same on every node (prefer the
    /// environment: a flag shows in the process list).
    #[arg(long, env = "FASTBOX_DART_KEY", hide_env_values = true)]
    pub dart_key: Option<String>,
}

/// Where an instance keeps its state and names its host-wide things, and its binaries: the
/// same for `fastbox up` and `fastbox node`.
#[derive(clap::Args, Debug)]
pub struct InstanceArgs {
    /// State directory: sandboxes, checkpoints, keys, the server's state store [default:
    /// /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Host-wide image cache [default: /var/lib/fastbox/cache].
    #[arg(long, env = "FASTBOX_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Prefix of this instance's host-wide names (netns, veths, cgroups, nft table); at most
    /// 8 of [a-z0-9] [default: fb].
    #[arg(long, env = "FASTBOX_PREFIX")]
    pub prefix: Option<String>,
    /// Sandbox address pool, BASE/LEN [default: 10.89.0.0/16].
    #[arg(long, env = "FASTBOX_POOL")]
    pub pool: Option<String>,
    /// The static execd binary.
    #[arg(long, env = "FASTBOX_EXECD_BIN")]
    pub execd: Option<PathBuf>,
    /// The CRIU binary (>= 4.2) [default: .deps/criu/bin/criu of the repository, then the
    /// system's].
    #[arg(long, env = "FASTBOX_CRIU")]
    pub criu: Option<PathBuf>,
    /// A network (`a.b.c.d/len` or an address, repeatable) that sandboxes may reach although
    /// it lies in the private, loopback, link-local, CGNAT, multicast or reserved ranges
    /// every sandbox is denied; each sandbox's egress policy still applies [default: none].
    #[arg(
        long = "sandbox-reach",
        env = "FASTBOX_SANDBOX_REACH",
        value_delimiter = ',',
        value_name = "CIDR"
    )]
    pub sandbox_reach: Vec<String>,
    /// A host directory (repeatable) whose subdirectories creates may mount into their
    /// sandboxes as `host` volumes; a path outside every one is refused [default: none, host
    /// volumes are off].
    #[arg(
        long = "allow-host-volume",
        env = "FASTBOX_ALLOW_HOST_VOLUME",
        value_delimiter = ',',
        value_name = "DIR"
    )]
    pub allow_host_volume: Vec<PathBuf>,
    /// A PEM file of root certificates (repeatable) the credential proxy trusts for the
    /// hosts a Credential Vault binds, besides the host's trust store [default: none].
    #[arg(
        long = "credential-proxy-roots",
        env = "FASTBOX_CREDENTIAL_PROXY_ROOTS",
        value_delimiter = ',',
        value_name = "FILE"
    )]
    pub credential_proxy_roots: Vec<PathBuf>,
    /// Where the credential proxy keeps its CA (made there on first use); nodes given the
    /// same directory share one CA, so a sandbox moved between them keeps trusting it
    /// [default: DATA_DIR/credential-proxy].
    #[arg(long, env = "FASTBOX_CREDENTIAL_PROXY_CA_DIR", value_name = "DIR")]
    pub credential_proxy_ca_dir: Option<PathBuf>,
}

impl StoreArgs {
    /// `settings` with these flags' values.
    pub fn apply(&self, settings: Settings) -> Settings {
        Settings {
            artifact_store: self.artifact_store.clone(),
            block_cache_mib: self.block_cache_mib,
            node_id: self.node_id.clone(),
            dart_listen: self.dart_listen,
            dart_peers: self.dart_peers.clone(),
            dart_key: self.dart_key.clone(),
            ..settings
        }
    }
}

impl InstanceArgs {
    /// `--sandbox-reach`, when given.
    pub fn sandbox_reach(&self) -> Option<Vec<String>> {
        (!self.sandbox_reach.is_empty()).then(|| self.sandbox_reach.clone())
    }

    /// `--allow-host-volume`, when given.
    pub fn allow_host_volume(&self) -> Option<Vec<PathBuf>> {
        (!self.allow_host_volume.is_empty()).then(|| self.allow_host_volume.clone())
    }

    /// `settings` with the credential proxy's flags, when given.
    pub fn apply_credential_proxy(&self, settings: Settings) -> Settings {
        Settings {
            credential_proxy_roots: (!self.credential_proxy_roots.is_empty())
                .then(|| self.credential_proxy_roots.clone()),
            credential_proxy_ca_dir: self.credential_proxy_ca_dir.clone(),
            ..settings
        }
    }
}

impl UpArgs {
    fn settings(&self) -> Settings {
        self.state.apply(
            self.instance.apply_credential_proxy(
                self.store.apply(Settings {
                    listen: self.listen,
                    node_proxy_listen: self.node_proxy_listen,
                    node_proxy_public: self.node_proxy_public.clone(),
                    api_key: self.api_key.clone(),
                    data_dir: self.instance.data_dir.clone(),
                    cache_dir: self.instance.cache_dir.clone(),
                    prefix: self.instance.prefix.clone(),
                    pool: self.instance.pool.clone(),
                    default_images: if self.no_default_images {
                        Some(Vec::new())
                    } else {
                        self.default_images.clone()
                    },
                    max_timeout_seconds: self.max_timeout_seconds,
                    retention_seconds: self.retention_seconds,
                    execd: self.instance.execd.clone(),
                    node_lease_ms: self.node_lease_ms,
                    create_image_wait_ms: self.create_image_wait_ms,
                    endpoint_wait_ms: self.endpoint_wait_ms,
                    pool_size: match self.no_local_sandboxes {
                        true => Some(0),
                        false => self.pool_size,
                    },
                    pool_min: self.pool_min,
                    pool_max: self.pool_max,
                    spare_slots: self.spare_slots,
                    lazy_restore_min_mib: self.lazy_restore_min_mib.clone(),
                    dns_upstreams: (!self.dns_upstreams.is_empty())
                        .then(|| self.dns_upstreams.clone()),
                    sandbox_reach: self.instance.sandbox_reach(),
                    allow_host_volume: self.instance.allow_host_volume(),
                    registry_allow_private: (!self.registry_allow_private.is_empty())
                        .then(|| self.registry_allow_private.clone()),
                    artifact_gc_interval: self.artifact_gc_interval.clone(),
                    artifact_gc_grace: self.artifact_gc_grace.clone(),
                    allow_local_images: self.allow_local_images.clone(),
                    default_cpu: self.default_cpu.clone(),
                    default_memory: self.default_memory.clone(),
                    default_disk: self.default_disk.clone(),
                    default_pids: self.default_pids,
                    max_cpu: self.max_cpu.clone(),
                    max_memory: self.max_memory.clone(),
                    max_disk: self.max_disk.clone(),
                    max_pids: self.max_pids,
                    route_max_lifetime: self.route_max_lifetime.clone(),
                    access_failures_per_source: self.access_failures_per_source,
                    access_failures_global: self.access_failures_global,
                    ..Settings::default()
                }),
            ),
        )
    }
}

pub fn up(args: UpArgs) -> anyhow::Result<i32> {
    let file = match &args.config {
        Some(path) => Settings::from_file(path)?,
        None => Settings::default(),
    };
    let cfg = ServerConfig::resolve(args.settings().over(file))?;
    let mode = match (&args.remote_node, &args.remote_node_credentials) {
        (Some(url), Some(credentials)) => NodeMode::Remote(RemoteNode {
            url: {
                crate::plaintext::check(url, "--remote-node", args.allow_plaintext_pairing)?;
                url.clone()
            },
            credentials: NodeCredentials::read(credentials)?,
            control_listen: args.control_listen,
        }),
        _ => NodeMode::Local {
            binaries: node_side::binaries(&cfg, args.instance.criu.clone())?,
            accept_nodes: args.accept_nodes.then_some(args.control_listen),
            hold_back: args.no_local_sandboxes,
        },
    };
    node_side::runtime()?.block_on(run::run(cfg, mode))?;
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct PurgeArgs {
    /// The instance's prefix.
    #[arg(long, env = "FASTBOX_PREFIX")]
    pub prefix: String,
    /// The instance's data directory (its sandboxes are removed) [default: /var/lib/fastbox].
    #[arg(long, env = "FASTBOX_DATA_DIR", default_value = "/var/lib/fastbox")]
    pub data_dir: PathBuf,
}

/// Removes everything a stopped instance left on the host.
pub fn purge(args: PurgeArgs) -> anyhow::Result<i32> {
    paths::require_root()?;
    fastbox_fastlet::host::purge(&args.prefix, &args.data_dir)?;
    Ok(0)
}

#[derive(clap::Args, Debug)]
pub struct LeftoversArgs {
    /// The prefix to look for.
    #[arg(long, env = "FASTBOX_PREFIX")]
    pub prefix: String,
}

/// Prints host-wide state carrying a prefix; exit status 1 when there is any.
pub fn leftovers(args: LeftoversArgs) -> anyhow::Result<i32> {
    let found = fastbox_fastlet::host::leftovers(&args.prefix);
    for item in &found {
        println!("{item}");
    }
    Ok(if found.is_empty() { 0 } else { 1 })
}
