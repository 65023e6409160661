//! `fastbox up`'s configuration: built-in defaults, then an optional TOML file, then
//! environment and flags (the command line turns those into a [`Settings`] layer).
//!
//! The node's artifact store ([`ArtifactConfig`]) is checked here as far as it can be without
//! the network: the store's URL, the DART member list and secret. Reaching the store (its
//! endpoint, credentials and bucket) is `fastbox up`'s first act after the state store.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fastbox_api::net::Ipv4Pool;
use fastbox_dart::store_config::{DartSettings, NodeStoreConfig, StoreLocation};
use serde::Deserialize;

/// One layer of settings: the TOML file, or what flags and environment say. Unset fields
/// fall through to the next layer.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Lifecycle API address.
    pub listen: Option<SocketAddr>,
    /// Node proxy address (the endpoints clients get point here).
    pub node_proxy_listen: Option<SocketAddr>,
    /// `host[:port]` clients use for the node proxy, when it differs from the listen address.
    pub node_proxy_public: Option<String>,
    /// The `OPEN-SANDBOX-API-KEY`; generated and kept in the data dir when unset.
    pub api_key: Option<String>,
    pub data_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    /// Prefix of every host-wide name of this instance (at most 8 of `[a-z0-9]`).
    pub prefix: Option<String>,
    /// Sandbox addresses, `BASE/LEN`.
    pub pool: Option<String>,
    /// Images prepared before `/health` answers 200.
    pub default_images: Option<Vec<String>>,
    /// Upper bound of a create's `timeout`.
    pub max_timeout_seconds: Option<u64>,
    /// How long terminated and failed sandboxes stay listed.
    pub retention_seconds: Option<u64>,
    /// The static execd binary.
    pub execd: Option<PathBuf>,
    /// How long a registered node's lease lasts, milliseconds (it heartbeats ten times as
    /// often; it is declared lost half a lease after its lease ran out).
    pub node_lease_ms: Option<u64>,
    /// How long a create waits for its image before answering `Pending`, milliseconds.
    pub create_image_wait_ms: Option<u64>,
    /// How long an endpoint lookup waits for a `Pending` or `Resuming` sandbox to run,
    /// milliseconds.
    pub endpoint_wait_ms: Option<u64>,
    /// Sets both `pool_min` and `pool_max` (0: no warm pool).
    pub pool_size: Option<usize>,
    /// Unclaimed sandboxes kept restored per template when idle.
    pub pool_min: Option<usize>,
    /// Most unclaimed sandboxes kept per template when creates ask for more.
    pub pool_max: Option<usize>,
    /// Network slots with an empty writable layer kept made ahead of demand (0: none).
    pub spare_slots: Option<usize>,
    /// Clones of a snapshot and resumes whose memory is at least this many MiB start before
    /// their memory is in place: a number, or `off` (a TOML integer or string).
    #[serde(default, deserialize_with = "number_or_text")]
    pub lazy_restore_min_mib: Option<String>,
    /// DNS servers (`address:port`) the forwarder asks for names a sandbox's policy allows.
    pub dns_upstreams: Option<Vec<std::net::SocketAddr>>,
    /// Networks (`a.b.c.d/len`) inside the private ranges denied to every sandbox that
    /// sandboxes may reach after all, subject to their egress policy.
    pub sandbox_reach: Option<Vec<String>>,
    /// Host directories whose subdirectories creates may mount as `host` volumes.
    pub allow_host_volume: Option<Vec<PathBuf>>,
    /// PEM files of roots the credential proxy trusts for bound hosts, besides the host's
    /// trust store.
    pub credential_proxy_roots: Option<Vec<PathBuf>>,
    /// Where the credential proxy's CA is kept (nodes given the same one share it).
    pub credential_proxy_ca_dir: Option<PathBuf>,
    /// Networks (`a.b.c.d/len`, `x::/len`, an address) in the private, loopback, link-local
    /// and other special ranges that registries, their token realms and redirects may be in;
    /// image pulls refuse those ranges otherwise.
    pub registry_allow_private: Option<Vec<String>>,
    /// The node's artifact store: an absolute directory (`file://` optional) or
    /// `s3://bucket/prefix?endpoint=URL`.
    pub artifact_store: Option<String>,
    /// Byte budget of the node block cache in front of a remote store, MiB.
    pub block_cache_mib: Option<u64>,
    /// This node's id in its DART delivery group.
    pub node_id: Option<String>,
    /// Where this node's DART peer server listens.
    pub dart_listen: Option<SocketAddr>,
    /// The DART delivery group, `id=host:port` entries, this node included.
    pub dart_peers: Option<Vec<String>>,
    /// The DART group secret: environment (`FASTBOX_DART_KEY`) or flag only, never the file.
    #[serde(skip)]
    pub dart_key: Option<String>,
    /// How often the server collects the artifact store's garbage (`24h`, `30m`, `off`).
    pub artifact_gc_interval: Option<String>,
    /// How recently written objects a collection never deletes (`24h`).
    pub artifact_gc_grace: Option<String>,
    /// Directories under which the API accepts local image references (`dir:`, `oci:`,
    /// `oci-archive:`, `docker-archive:`, paths); none by default.
    pub allow_local_images: Option<Vec<PathBuf>>,
    /// A create's cpu when it names none (a quantity: `1`, `500m`).
    #[serde(default, deserialize_with = "number_or_text")]
    pub default_cpu: Option<String>,
    /// A create's memory when it names none (`512Mi`).
    #[serde(default, deserialize_with = "number_or_text")]
    pub default_memory: Option<String>,
    /// A create's writable layer when it names none (`10Gi`).
    #[serde(default, deserialize_with = "number_or_text")]
    pub default_disk: Option<String>,
    /// A create's pids limit when it names none.
    pub default_pids: Option<u64>,
    /// The most cpu a create may ask for.
    #[serde(default, deserialize_with = "number_or_text")]
    pub max_cpu: Option<String>,
    /// The most memory a create may ask for.
    #[serde(default, deserialize_with = "number_or_text")]
    pub max_memory: Option<String>,
    /// The largest writable layer a create may ask for.
    #[serde(default, deserialize_with = "number_or_text")]
    pub max_disk: Option<String>,
    /// The highest pids limit a create may ask for.
    pub max_pids: Option<u64>,
    /// The longest a signed route may be valid (`24h`): further `expires` are refused.
    pub route_max_lifetime: Option<String>,
    /// Failed credential checks per minute from one source address before 429.
    pub access_failures_per_source: Option<u32>,
    /// Failed credential checks per minute from all sources before 429.
    pub access_failures_global: Option<u32>,
    /// Where the server's records are: a redb file path (default: `state.redb` in the data
    /// directory) or `etcd://HOST:PORT,...[/PREFIX]` (`etcds://` for TLS).
    pub state: Option<String>,
    /// The CA (PEM) that signed the etcd members' certificates.
    pub state_ca: Option<PathBuf>,
    /// A client certificate (PEM) for etcd, with `state_key`.
    pub state_cert: Option<PathBuf>,
    pub state_key: Option<PathBuf>,
    /// How long a state-store operation may go on trying the etcd members, milliseconds.
    pub state_timeout_ms: Option<u64>,
    /// The key that seals records in etcd (64 hex digits; made on first use when missing),
    /// the same file on every server [default: DATA_DIR/state-seal.key].
    pub state_seal_key: Option<PathBuf>,
    /// The etcd password: environment (`FASTBOX_STATE_PASSWORD`) or the URL, never the file.
    #[serde(skip)]
    pub state_password: Option<String>,
    /// This server's id among the servers sharing an etcd state (default: the host name).
    pub server_id: Option<String>,
    /// How long a server's lease in etcd lasts, milliseconds: a server that dies loses its
    /// leadership and its operations in flight to another within it.
    pub server_lease_ms: Option<u64>,
}

impl Settings {
    /// `self` over `lower`: every field set here wins.
    pub fn over(self, lower: Settings) -> Settings {
        Settings {
            listen: self.listen.or(lower.listen),
            node_proxy_listen: self.node_proxy_listen.or(lower.node_proxy_listen),
            node_proxy_public: self.node_proxy_public.or(lower.node_proxy_public),
            api_key: self.api_key.or(lower.api_key),
            data_dir: self.data_dir.or(lower.data_dir),
            cache_dir: self.cache_dir.or(lower.cache_dir),
            prefix: self.prefix.or(lower.prefix),
            pool: self.pool.or(lower.pool),
            default_images: self.default_images.or(lower.default_images),
            max_timeout_seconds: self.max_timeout_seconds.or(lower.max_timeout_seconds),
            retention_seconds: self.retention_seconds.or(lower.retention_seconds),
            execd: self.execd.or(lower.execd),
            node_lease_ms: self.node_lease_ms.or(lower.node_lease_ms),
            create_image_wait_ms: self.create_image_wait_ms.or(lower.create_image_wait_ms),
            endpoint_wait_ms: self.endpoint_wait_ms.or(lower.endpoint_wait_ms),
            pool_size: self.pool_size.or(lower.pool_size),
            pool_min: self.pool_min.or(lower.pool_min),
            pool_max: self.pool_max.or(lower.pool_max),
            spare_slots: self.spare_slots.or(lower.spare_slots),
            lazy_restore_min_mib: self.lazy_restore_min_mib.or(lower.lazy_restore_min_mib),
            dns_upstreams: self.dns_upstreams.or(lower.dns_upstreams),
            sandbox_reach: self.sandbox_reach.or(lower.sandbox_reach),
            allow_host_volume: self.allow_host_volume.or(lower.allow_host_volume),
            credential_proxy_roots: self.credential_proxy_roots.or(lower.credential_proxy_roots),
            credential_proxy_ca_dir: self
                .credential_proxy_ca_dir
                .or(lower.credential_proxy_ca_dir),
            registry_allow_private: self.registry_allow_private.or(lower.registry_allow_private),
            artifact_store: self.artifact_store.or(lower.artifact_store),
            block_cache_mib: self.block_cache_mib.or(lower.block_cache_mib),
            node_id: self.node_id.or(lower.node_id),
            dart_listen: self.dart_listen.or(lower.dart_listen),
            dart_peers: self.dart_peers.or(lower.dart_peers),
            dart_key: self.dart_key.or(lower.dart_key),
            state: self.state.or(lower.state),
            state_ca: self.state_ca.or(lower.state_ca),
            state_cert: self.state_cert.or(lower.state_cert),
            state_key: self.state_key.or(lower.state_key),
            state_timeout_ms: self.state_timeout_ms.or(lower.state_timeout_ms),
            state_seal_key: self.state_seal_key.or(lower.state_seal_key),
            state_password: self.state_password.or(lower.state_password),
            server_id: self.server_id.or(lower.server_id),
            server_lease_ms: self.server_lease_ms.or(lower.server_lease_ms),
            artifact_gc_interval: self.artifact_gc_interval.or(lower.artifact_gc_interval),
            artifact_gc_grace: self.artifact_gc_grace.or(lower.artifact_gc_grace),
            allow_local_images: self.allow_local_images.or(lower.allow_local_images),
            default_cpu: self.default_cpu.or(lower.default_cpu),
            default_memory: self.default_memory.or(lower.default_memory),
            default_disk: self.default_disk.or(lower.default_disk),
            default_pids: self.default_pids.or(lower.default_pids),
            max_cpu: self.max_cpu.or(lower.max_cpu),
            max_memory: self.max_memory.or(lower.max_memory),
            max_disk: self.max_disk.or(lower.max_disk),
            max_pids: self.max_pids.or(lower.max_pids),
            route_max_lifetime: self.route_max_lifetime.or(lower.route_max_lifetime),
            access_failures_per_source: self
                .access_failures_per_source
                .or(lower.access_failures_per_source),
            access_failures_global: self.access_failures_global.or(lower.access_failures_global),
        }
    }

    /// Reads a TOML file of settings.
    pub fn from_file(path: &Path) -> Result<Settings, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_NODE_PROXY_LISTEN: &str = "127.0.0.1:8081";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/fastbox";
pub const DEFAULT_CACHE_DIR: &str = "/var/lib/fastbox/cache";
pub const DEFAULT_PREFIX: &str = "fb";
pub const DEFAULT_POOL: &str = "10.89.0.0/16";
pub const DEFAULT_IMAGE: &str = "python:3.12";
/// Warm sandboxes per template: enough for a small burst on a 2-core machine, each costing
/// an idle execd (a few MiB) and a network slot.
/// Pool bounds by default, for a small machine (2 cores): two sandboxes per template when
/// idle, up to ten (a 10-way burst) while creates keep coming.
pub const DEFAULT_POOL_MIN: usize = 2;
pub const DEFAULT_POOL_MAX: usize = 10;
/// Spare slots by default: enough for a burst of on-demand restores on a small machine, a
/// fork of 10 included (each clone takes one; a clone that finds none makes its slot during
/// the fork, about 100 ms more while the others restore); each costs a network namespace, a
/// veth pair, a loop-mounted sparse layer (a few MiB of disk) and a waiting launcher.
pub const DEFAULT_SPARE_SLOTS: usize = 10;
/// The node block cache's budget by default: 4 GiB, room for a handful of templates and
/// checkpoints of a few hundred MiB each (the cache is only used with a remote store).
pub const DEFAULT_BLOCK_CACHE_MIB: u64 = 4096;
/// How often a server collects a local store's garbage by default: daily. A remote store is
/// shared by the nodes of a cluster, each of which knows only its own pins, so its
/// collection is off by default and is turned on for one node (or run with
/// `fastbox artifacts gc`).
pub const DEFAULT_LOCAL_GC_INTERVAL: Duration = Duration::from_secs(24 * 3600);

/// A create's cpu, memory, disk and pids when it names none, or the most it may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resources {
    /// Thousandths of a CPU.
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    /// The writable layer (sparse: it costs what the sandbox writes).
    pub disk_bytes: u64,
    pub pids: u64,
}

/// Limits of creates that name none: one CPU, 512 MiB, the runtime's writable layer
/// (10 GiB, sparse; pooled sandboxes and spare slots are made with it) and its pids limit.
pub const DEFAULT_RESOURCES: Resources = Resources {
    cpu_millis: 1000,
    memory_bytes: 512 << 20,
    disk_bytes: fastbox_api::limits::DEFAULT_DISK_BYTES,
    pids: fastbox_api::limits::DEFAULT_PIDS,
};

/// The most a create may ask for by default.
pub const DEFAULT_MAX_RESOURCES: Resources = Resources {
    cpu_millis: 4000,
    memory_bytes: 16 << 30,
    disk_bytes: 64 << 30,
    pids: 4096,
};

/// The smallest limits a create may ask for (less cannot run a sandbox).
pub const MIN_RESOURCES: Resources = Resources {
    cpu_millis: fastbox_api::limits::MIN_CPU_MILLIS,
    memory_bytes: 16 << 20,
    disk_bytes: 64 << 20,
    pids: 16,
};

/// What a create gets when it names no limit, and the most it may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourcePolicy {
    pub defaults: Resources,
    pub max: Resources,
}

impl Default for ResourcePolicy {
    fn default() -> Self {
        Self {
            defaults: DEFAULT_RESOURCES,
            max: DEFAULT_MAX_RESOURCES,
        }
    }
}

impl ResourcePolicy {
    fn resolve(settings: &Settings) -> Result<Self, ConfigError> {
        let invalid = |field, message: String| ConfigError::Invalid { field, message };
        let cpu = |field, text: &Option<String>, default| match text {
            None => Ok(default),
            Some(t) => fastbox_api::quantity::parse_cpu_millis(t)
                .map_err(|e| invalid(field, e.to_string())),
        };
        let bytes = |field, text: &Option<String>, default| match text {
            None => Ok(default),
            Some(t) => {
                fastbox_api::quantity::parse_bytes(t).map_err(|e| invalid(field, e.to_string()))
            }
        };
        let policy = ResourcePolicy {
            defaults: Resources {
                cpu_millis: cpu(
                    "default_cpu",
                    &settings.default_cpu,
                    DEFAULT_RESOURCES.cpu_millis,
                )?,
                memory_bytes: bytes(
                    "default_memory",
                    &settings.default_memory,
                    DEFAULT_RESOURCES.memory_bytes,
                )?,
                disk_bytes: bytes(
                    "default_disk",
                    &settings.default_disk,
                    DEFAULT_RESOURCES.disk_bytes,
                )?,
                pids: settings.default_pids.unwrap_or(DEFAULT_RESOURCES.pids),
            },
            max: Resources {
                cpu_millis: cpu(
                    "max_cpu",
                    &settings.max_cpu,
                    DEFAULT_MAX_RESOURCES.cpu_millis,
                )?,
                memory_bytes: bytes(
                    "max_memory",
                    &settings.max_memory,
                    DEFAULT_MAX_RESOURCES.memory_bytes,
                )?,
                disk_bytes: bytes(
                    "max_disk",
                    &settings.max_disk,
                    DEFAULT_MAX_RESOURCES.disk_bytes,
                )?,
                pids: settings.max_pids.unwrap_or(DEFAULT_MAX_RESOURCES.pids),
            },
        };
        type Field = (
            &'static str,
            &'static str,
            fn(&Resources) -> u64,
            fn(u64) -> String,
        );
        let fields: [Field; 4] = [
            ("default_cpu", "max_cpu", |r| r.cpu_millis, format_cpu),
            (
                "default_memory",
                "max_memory",
                |r| r.memory_bytes,
                format_bytes,
            ),
            ("default_disk", "max_disk", |r| r.disk_bytes, format_bytes),
            ("default_pids", "max_pids", |r| r.pids, |n| n.to_string()),
        ];
        for (default_field, max_field, get, show) in fields {
            let (default, max, min) =
                (get(&policy.defaults), get(&policy.max), get(&MIN_RESOURCES));
            if max < min {
                return Err(invalid(
                    max_field,
                    format!(
                        "{} is below the least a sandbox needs, {}",
                        show(max),
                        show(min)
                    ),
                ));
            }
            if default < min {
                return Err(invalid(
                    default_field,
                    format!(
                        "{} is below the least a sandbox needs, {}",
                        show(default),
                        show(min)
                    ),
                ));
            }
            if default > max {
                return Err(invalid(
                    default_field,
                    format!("{} is above {max_field} ({})", show(default), show(max)),
                ));
            }
        }
        Ok(policy)
    }
}

/// Millicores as a cpu quantity: whole CPUs when they are (`2`), else millicores (`500m`).
pub fn format_cpu(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        format!("{}", millis / 1000)
    } else {
        format!("{millis}m")
    }
}

/// Bytes as a quantity in the largest binary unit that divides them (`16Gi`, `512Mi`, `1000`).
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [
        (60, "Ei"),
        (50, "Pi"),
        (40, "Ti"),
        (30, "Gi"),
        (20, "Mi"),
        (10, "Ki"),
    ] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// The operator's directories of local images, each resolved (symlinks, `..`) as it is now.
fn canonical_dirs(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, ConfigError> {
    dirs.iter()
        .map(|dir| {
            let invalid = |message: String| ConfigError::Invalid {
                field: "allow_local_images",
                message,
            };
            let canonical = std::fs::canonicalize(dir)
                .map_err(|e| invalid(format!("{}: {e}", dir.display())))?;
            if !canonical.is_dir() {
                return Err(invalid(format!("{}: not a directory", dir.display())));
            }
            Ok(canonical)
        })
        .collect()
}

/// The node's artifact store and its garbage collection.
#[derive(Debug, Clone)]
pub struct ArtifactConfig {
    /// The origin, the block cache's budget, DART.
    pub store: NodeStoreConfig,
    /// How often the server collects garbage (`None`: never).
    pub gc_interval: Option<Duration>,
    /// Objects written more recently than this are never collected.
    pub gc_grace: Duration,
}

impl ArtifactConfig {
    /// Resolves the artifact settings of `settings`; `data_dir` is where the default local
    /// store lives.
    fn resolve(settings: &Settings, data_dir: &Path) -> Result<Self, ConfigError> {
        let invalid = |field, message: String| ConfigError::Invalid { field, message };
        let location = match &settings.artifact_store {
            Some(text) => {
                StoreLocation::parse(text).map_err(|e| invalid("artifact_store", e.to_string()))?
            }
            None => StoreLocation::local_default(data_dir),
        };
        let dart = DartSettings::from_parts(
            settings.node_id.as_deref(),
            settings.dart_listen,
            settings.dart_peers.as_deref().unwrap_or_default(),
            settings.dart_key.as_deref(),
        )
        .map_err(|e| invalid("dart", e.to_string()))?;
        if dart.is_some() && !location.is_remote() {
            return Err(invalid(
                "dart",
                "DART peers share a remote origin: set artifact_store to s3://bucket/prefix".into(),
            ));
        }
        let cache_mib = settings.block_cache_mib.unwrap_or(DEFAULT_BLOCK_CACHE_MIB);
        if cache_mib == 0 {
            return Err(invalid(
                "block_cache_mib",
                "must be at least 1 (MiB)".into(),
            ));
        }
        let gc_interval = match &settings.artifact_gc_interval {
            Some(text) => parse_interval(text).map_err(|e| invalid("artifact_gc_interval", e))?,
            None => (!location.is_remote()).then_some(DEFAULT_LOCAL_GC_INTERVAL),
        };
        let gc_grace = match &settings.artifact_gc_grace {
            Some(text) => parse_duration(text).map_err(|e| invalid("artifact_gc_grace", e))?,
            None => fastbox_artifact::DEFAULT_GRACE,
        };
        Ok(ArtifactConfig {
            store: NodeStoreConfig {
                location,
                cache_budget: cache_mib << 20,
                dart,
            },
            gc_interval,
            gc_grace,
        })
    }
}

/// Parses a duration: a whole number with a unit, `s`, `m`, `h` or `d` (`90s`, `30m`, `24h`,
/// `7d`); a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let seconds_per = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => {
            return Err(format!(
                "{text:?}: use a number and s, m, h or d (e.g. 24h)"
            ));
        }
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(seconds_per))
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{text:?}: use a number and s, m, h or d (e.g. 24h)"))
}

/// Parses an interval: a duration as [`parse_duration`], or `off` (also `0`) for never.
/// A setting written as a number or as text, kept as text.
fn number_or_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Number(u64),
        Text(String),
    }
    Ok(Option::<Either>::deserialize(d)?.map(|v| match v {
        Either::Number(n) => n.to_string(),
        Either::Text(t) => t,
    }))
}

/// `off` (`None`) or a whole number of MiB, in bytes.
pub fn parse_lazy_restore_min(text: &str) -> Result<Option<u64>, String> {
    if text.trim() == "off" {
        return Ok(None);
    }
    text.trim()
        .parse::<u64>()
        .ok()
        .and_then(|mib| mib.checked_mul(1 << 20))
        .map(Some)
        .ok_or_else(|| format!("{text:?} is neither a number of MiB nor `off`"))
}

pub fn parse_interval(text: &str) -> Result<Option<Duration>, String> {
    if text.trim() == "off" {
        return Ok(None);
    }
    parse_duration(text).map(|d| (!d.is_zero()).then_some(d))
}

/// A duration in the largest unit up to hours that divides it (`24h`, `30m`, `90s`), as
/// [`parse_duration`] reads it back.
pub fn format_duration(duration: Duration) -> String {
    let seconds = duration.as_secs();
    match seconds {
        0 => "0s".into(),
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// The networks of `--sandbox-reach`, each `a.b.c.d/len` (host bits zero) or an address.
pub fn parse_sandbox_reach(texts: &[String]) -> Result<Vec<fastbox_api::net::Ipv4Net>, String> {
    texts
        .iter()
        .map(|text| {
            text.parse::<fastbox_api::net::Ipv4Net>()
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// The directories of `--allow-host-volume`: each an existing directory, taken by its real
/// path (a host volume's path is compared with that), never `/`.
pub fn host_volume_roots(dirs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    dirs.iter()
        .map(|dir| {
            if !dir.is_absolute() {
                return Err(format!("{}: not an absolute path", dir.display()));
            }
            let real = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            if !real.is_dir() {
                return Err(format!("{}: not a directory", dir.display()));
            }
            if real == Path::new("/") {
                return Err(format!(
                    "{}: the root would let sandboxes mount any host directory",
                    dir.display()
                ));
            }
            Ok(real)
        })
        .collect()
}

/// The networks of `--registry-allow-private`, each a network (host bits zero) or an address.
pub fn parse_registry_allow_private(texts: &[String]) -> Result<Vec<fastbox_image::IpNet>, String> {
    texts.iter().map(|text| text.parse()).collect()
}

/// The configuration in force, every default applied.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub node_proxy_listen: SocketAddr,
    pub node_proxy_public: Option<String>,
    pub api_key: Option<String>,
    pub data_dir: PathBuf,
    pub cache_dir: PathBuf,
    pub prefix: String,
    pub pool: Ipv4Pool,
    pub default_images: Vec<String>,
    pub max_timeout: Duration,
    pub retention: Duration,
    pub execd: Option<PathBuf>,
    /// Unclaimed sandboxes kept restored per template when idle, and at most (the pool grows
    /// with the creates of the last 30 s).
    pub pool_min: usize,
    pub pool_max: usize,
    /// Spare slots (network slot + empty writable layer) kept made ahead of demand.
    pub spare_slots: usize,
    /// Clones and resumes of checkpoints holding at least this many bytes of memory start
    /// lazily (`None`: never).
    pub lazy_restore_min_bytes: Option<u64>,
    /// The DNS forwarder's upstreams (`None`: the host's resolvers).
    pub dns_upstreams: Option<Vec<std::net::SocketAddr>>,
    /// Networks inside the private ranges (`fastbox_api::net::PRIVATE_RANGES`) that
    /// sandboxes may reach after all, subject to their egress policy (none by default).
    pub sandbox_reach: Vec<fastbox_api::net::Ipv4Net>,
    /// Host directories whose subdirectories creates may mount as `host` volumes (absolute,
    /// made canonical at start; empty: host volumes are refused).
    pub host_volume_roots: Vec<PathBuf>,
    /// PEM files of roots the node's credential proxy trusts besides the host's store.
    pub credential_proxy_roots: Vec<PathBuf>,
    /// The credential proxy's CA directory (`None`: `DATA_DIR/credential-proxy`).
    pub credential_proxy_ca_dir: Option<PathBuf>,
    /// Networks inside the special ranges (`fastbox_image::SPECIAL_RANGES`) that image pulls
    /// may connect to after all: registries, token realms, redirects (none by default).
    pub registry_allow_private: Vec<fastbox_image::IpNet>,
    /// How long a create waits for its image before answering `Pending` (an image that fails
    /// within this time is a 400).
    pub image_wait: Duration,
    /// How long a create waits for the start, once the image is there, before answering
    /// `Pending`.
    pub create_wait: Duration,
    /// How long an endpoint lookup waits for a `Pending` or `Resuming` sandbox to run before
    /// answering that it is not ready (an SDK resumes, then asks for its endpoint at once).
    pub endpoint_wait: Duration,
    /// How often expiry, deletion and garbage collection are reconciled.
    pub reconcile_every: Duration,
    /// The node's artifact store (origin, block cache, DART) and its garbage collection.
    pub artifacts: ArtifactConfig,
    /// Directories (canonical) under which the API accepts local image references.
    pub allow_local_images: Vec<PathBuf>,
    /// Limits of creates that name none, and the most a create may name.
    pub resources: ResourcePolicy,
    /// The longest a signed route may be valid: issued (400) and accepted (401/403).
    pub route_max_lifetime: Duration,
    /// Failed credential checks allowed per minute, per source and for all together.
    pub access_failures: fastbox_proxy::FailureLimits,
    /// Leases of registered nodes.
    pub leases: LeaseConfig,
    /// A slot a node reports admitted and unused for this long, that no record and no start
    /// in flight holds, is given back (an admission whose answer never arrived).
    pub admission_grace: Duration,
    /// Where the server's records are, and how to reach them.
    pub state: StateConfig,
}

/// The state store: the embedded redb file or etcd.
#[derive(Debug, Clone)]
pub struct StateConfig {
    pub url: fastbox_state::StateUrl,
    pub options: fastbox_state::EtcdOptions,
    /// The key file that seals the records (etcd only; the redb file stays in the root-only
    /// data directory).
    pub seal_key: Option<PathBuf>,
    /// This server's id among the servers sharing the store.
    pub server_id: String,
    /// The time to live of the server's lease (etcd counts whole seconds).
    pub server_lease: Duration,
}

/// A server's lease in etcd, by default.
pub const DEFAULT_SERVER_LEASE_MS: u64 = 5000;

/// This host's name (the default server id), or `server`.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "server".to_string())
}

impl StateConfig {
    /// The state store `settings` name (`state.redb` in `data_dir` by default).
    pub fn resolve(settings: &Settings, data_dir: &Path) -> Result<Self, ConfigError> {
        use fastbox_state::StateUrl;
        let invalid = |field, message: String| ConfigError::Invalid { field, message };
        let mut url = match &settings.state {
            None => StateUrl::Redb(data_dir.join("state.redb")),
            Some(text) => StateUrl::parse(text).map_err(|e| invalid("state", e.to_string()))?,
        };
        let mut seal_key = None;
        if let StateUrl::Etcd(target) = &mut url {
            seal_key = Some(
                settings
                    .state_seal_key
                    .clone()
                    .unwrap_or_else(|| data_dir.join("state-seal.key")),
            );
            if let Some(password) = &settings.state_password {
                target.password = Some(password.clone());
            }
            if target.password.is_some() && target.user.is_none() {
                return Err(invalid(
                    "state",
                    "an etcd password needs a user (etcd://USER@HOST:PORT)".into(),
                ));
            }
        } else if settings.state_ca.is_some() || settings.state_cert.is_some() {
            return Err(invalid(
                "state_ca",
                "certificates are for an etcds:// state store".into(),
            ));
        } else if settings.state_seal_key.is_some() {
            return Err(invalid(
                "state_seal_key",
                "the seal key is for an etcd state store".into(),
            ));
        }
        let client_cert = match (&settings.state_cert, &settings.state_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "state_cert",
                    "state_cert and state_key go together".into(),
                ));
            }
        };
        let mut options = fastbox_state::EtcdOptions {
            ca: settings.state_ca.clone(),
            client_cert,
            ..Default::default()
        };
        if let Some(ms) = settings.state_timeout_ms {
            if ms == 0 {
                return Err(invalid("state_timeout_ms", "must be positive".into()));
            }
            options.timeout = Duration::from_millis(ms);
        }
        let server_lease_ms = settings.server_lease_ms.unwrap_or(DEFAULT_SERVER_LEASE_MS);
        if server_lease_ms < 2000 {
            return Err(invalid(
                "server_lease_ms",
                "at least 2000 (etcd leases count whole seconds)".into(),
            ));
        }
        Ok(Self {
            url,
            options,
            seal_key,
            server_id: settings.server_id.clone().unwrap_or_else(host_name),
            server_lease: Duration::from_millis(server_lease_ms),
        })
    }

    /// Opens the store (connecting to etcd, which checks it answers), its records sealed
    /// with the seal key, which is made when missing. Blocks.
    pub fn open(&self) -> Result<Box<dyn fastbox_state::StateBackend>, fastbox_state::StateError> {
        let seal = match &self.seal_key {
            None => None,
            Some(path) => {
                let (key, made) = fastbox_state::SealKey::load_or_create(path)?;
                if made {
                    tracing::warn!(
                        file = %path.display(),
                        key = key.id_hex(),
                        "made a new seal key for the records in etcd: every server of this \
                         state needs a copy of this file"
                    );
                }
                Some(key)
            }
        };
        fastbox_state::open(&self.url, self.options.clone(), seal)
    }
}

/// [`ServerConfig::admission_grace`] by default.
pub const DEFAULT_ADMISSION_GRACE: Duration = Duration::from_secs(60);

/// How registered nodes hold their lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    pub terms: fastbox_node_api::membership::LeaseTerms,
    /// A node is declared lost this long after its lease ran out (its guard froze its
    /// sandboxes before the lease ran out).
    pub lost_margin: Duration,
}

impl LeaseConfig {
    /// The lease of `lease_ms` milliseconds (at least 1 s).
    pub fn of(lease_ms: u64) -> Self {
        let lease_ms = lease_ms.max(1000);
        Self {
            terms: fastbox_node_api::membership::LeaseTerms {
                lease_ms,
                heartbeat_ms: (lease_ms / 10).max(100),
            },
            lost_margin: Duration::from_millis(lease_ms / 2),
        }
    }
}

/// A registered node's lease by default.
pub const DEFAULT_NODE_LEASE_MS: u64 = 10_000;

/// The longest a signed route may be valid by default.
pub const DEFAULT_ROUTE_MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);

impl ServerConfig {
    /// Applies the defaults under `settings`.
    pub fn resolve(settings: Settings) -> Result<Self, ConfigError> {
        let invalid = |field, message: String| ConfigError::Invalid { field, message };
        let data_dir = settings
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        let artifacts = ArtifactConfig::resolve(&settings, &data_dir)?;
        let state = StateConfig::resolve(&settings, &data_dir)?;
        let resources = ResourcePolicy::resolve(&settings)?;
        let allow_local_images =
            canonical_dirs(settings.allow_local_images.as_deref().unwrap_or_default())?;
        let pool_text = settings.pool.unwrap_or_else(|| DEFAULT_POOL.to_string());
        let pool = pool_text
            .parse::<Ipv4Pool>()
            .map_err(|e| invalid("pool", format!("{pool_text:?}: {e}")))?;
        let prefix = settings
            .prefix
            .unwrap_or_else(|| DEFAULT_PREFIX.to_string());
        if prefix.is_empty()
            || prefix.len() > 8
            || !prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        {
            return Err(invalid(
                "prefix",
                format!("{prefix:?}: 1 to 8 characters of [a-z0-9]"),
            ));
        }
        if let Some(key) = &settings.api_key
            && key.trim().is_empty()
        {
            return Err(invalid("api_key", "must not be empty".into()));
        }
        let data_dir = settings
            .data_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
        let route_max_lifetime = match &settings.route_max_lifetime {
            Some(text) => parse_duration(text).map_err(|e| invalid("route_max_lifetime", e))?,
            None => DEFAULT_ROUTE_MAX_LIFETIME,
        };
        if route_max_lifetime.is_zero() {
            return Err(invalid("route_max_lifetime", "must be positive".into()));
        }
        let mut access_failures = fastbox_proxy::FailureLimits::default();
        for (field, value, target) in [
            (
                "access_failures_per_source",
                settings.access_failures_per_source,
                &mut access_failures.per_source,
            ),
            (
                "access_failures_global",
                settings.access_failures_global,
                &mut access_failures.global,
            ),
        ] {
            match value {
                Some(0) => return Err(invalid(field, "must be at least 1 per minute".into())),
                Some(n) => *target = n,
                None => {}
            }
        }
        Ok(Self {
            listen: settings
                .listen
                .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("default address")),
            node_proxy_listen: settings
                .node_proxy_listen
                .unwrap_or_else(|| DEFAULT_NODE_PROXY_LISTEN.parse().expect("default address")),
            node_proxy_public: settings.node_proxy_public,
            api_key: settings.api_key,
            cache_dir: settings
                .cache_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_CACHE_DIR)),
            data_dir,
            prefix,
            pool,
            default_images: settings
                .default_images
                .unwrap_or_else(|| vec![DEFAULT_IMAGE.to_string()]),
            max_timeout: Duration::from_secs(settings.max_timeout_seconds.unwrap_or(86_400)),
            retention: Duration::from_secs(settings.retention_seconds.unwrap_or(3_600)),
            execd: settings.execd,
            pool_min: settings
                .pool_min
                .or(settings.pool_size)
                .unwrap_or(DEFAULT_POOL_MIN),
            pool_max: settings
                .pool_max
                .or(settings.pool_size)
                .unwrap_or(DEFAULT_POOL_MAX),
            spare_slots: settings.spare_slots.unwrap_or(DEFAULT_SPARE_SLOTS),
            lazy_restore_min_bytes: match settings.lazy_restore_min_mib.as_deref() {
                None => Some(fastbox_api::limits::DEFAULT_LAZY_RESTORE_MIN_BYTES),
                Some(text) => {
                    parse_lazy_restore_min(text).map_err(|e| invalid("lazy_restore_min_mib", e))?
                }
            },
            dns_upstreams: settings.dns_upstreams,
            host_volume_roots: host_volume_roots(
                settings.allow_host_volume.as_deref().unwrap_or_default(),
            )
            .map_err(|e| invalid("allow_host_volume", e))?,
            credential_proxy_roots: settings.credential_proxy_roots.unwrap_or_default(),
            credential_proxy_ca_dir: settings.credential_proxy_ca_dir,
            sandbox_reach: parse_sandbox_reach(
                settings.sandbox_reach.as_deref().unwrap_or_default(),
            )
            .map_err(|e| invalid("sandbox_reach", e))?,
            registry_allow_private: parse_registry_allow_private(
                settings
                    .registry_allow_private
                    .as_deref()
                    .unwrap_or_default(),
            )
            .map_err(|e| invalid("registry_allow_private", e))?,
            image_wait: Duration::from_millis(settings.create_image_wait_ms.unwrap_or(1500)),
            create_wait: Duration::from_secs(20),
            endpoint_wait: Duration::from_millis(settings.endpoint_wait_ms.unwrap_or(10_000)),
            reconcile_every: Duration::from_secs(2),
            artifacts,
            allow_local_images,
            resources,
            route_max_lifetime,
            access_failures,
            leases: LeaseConfig::of(settings.node_lease_ms.unwrap_or(DEFAULT_NODE_LEASE_MS)),
            admission_grace: DEFAULT_ADMISSION_GRACE,
            state,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_fall_through_and_defaults_apply() {
        let file: Settings =
            toml::from_str("listen = \"127.0.0.1:9000\"\nprefix = \"abc\"\n").unwrap();
        let flags = Settings {
            prefix: Some("xyz".into()),
            ..Settings::default()
        };
        let cfg = ServerConfig::resolve(flags.over(file)).unwrap();
        assert_eq!(cfg.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(cfg.prefix, "xyz");
        assert_eq!(cfg.node_proxy_listen.to_string(), DEFAULT_NODE_PROXY_LISTEN);
        assert_eq!(cfg.default_images, vec![DEFAULT_IMAGE.to_string()]);
    }

    #[test]
    fn route_lifetime_and_failure_limits_have_defaults_and_are_checked() {
        let cfg = ServerConfig::resolve(Settings::default()).unwrap();
        assert_eq!(cfg.route_max_lifetime, DEFAULT_ROUTE_MAX_LIFETIME);
        assert_eq!(cfg.access_failures, fastbox_proxy::FailureLimits::default());
        let file: Settings = toml::from_str(
            "route_max_lifetime = \"2h\"\naccess_failures_per_source = 5\naccess_failures_global = 50\n",
        )
        .unwrap();
        let cfg = ServerConfig::resolve(Settings::default().over(file)).unwrap();
        assert_eq!(cfg.route_max_lifetime, Duration::from_secs(7200));
        assert_eq!(
            (cfg.access_failures.per_source, cfg.access_failures.global),
            (5, 50)
        );
        for bad in [
            "route_max_lifetime = \"0s\"",
            "route_max_lifetime = \"soon\"",
            "access_failures_per_source = 0",
            "access_failures_global = 0",
        ] {
            let file: Settings = toml::from_str(bad).unwrap();
            assert!(
                ServerConfig::resolve(Settings::default().over(file)).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn sandbox_reach_comes_from_any_layer_and_is_checked() {
        assert!(
            ServerConfig::resolve(Settings::default())
                .unwrap()
                .sandbox_reach
                .is_empty()
        );
        let file: Settings =
            toml::from_str("sandbox_reach = [\"10.200.0.0/24\", \"169.254.169.254\"]").unwrap();
        let cfg = ServerConfig::resolve(Settings::default().over(file.clone())).unwrap();
        assert_eq!(
            cfg.sandbox_reach
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.200.0.0/24", "169.254.169.254/32"]
        );
        let flags = Settings {
            sandbox_reach: Some(vec!["192.168.7.0/24".into()]),
            ..Settings::default()
        };
        let cfg = ServerConfig::resolve(flags.over(file)).unwrap();
        assert_eq!(cfg.sandbox_reach, ["192.168.7.0/24".parse().unwrap()]);
        let bad = ServerConfig::resolve(Settings {
            sandbox_reach: Some(vec!["10.0.0.1/8".into()]),
            ..Settings::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            bad.starts_with("sandbox_reach:") && bad.contains("10.0.0.0/8"),
            "{bad}"
        );
    }

    #[test]
    fn registry_allow_private_comes_from_any_layer_and_is_checked() {
        assert!(
            ServerConfig::resolve(Settings::default())
                .unwrap()
                .registry_allow_private
                .is_empty()
        );
        let file: Settings =
            toml::from_str("registry_allow_private = [\"10.20.0.0/16\", \"fd00::/8\"]").unwrap();
        let cfg = ServerConfig::resolve(Settings::default().over(file.clone())).unwrap();
        assert_eq!(
            cfg.registry_allow_private
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.20.0.0/16", "fd00::/8"]
        );
        let flags = Settings {
            registry_allow_private: Some(vec!["127.0.0.1".into()]),
            ..Settings::default()
        };
        let cfg = ServerConfig::resolve(flags.over(file)).unwrap();
        assert_eq!(
            cfg.registry_allow_private,
            ["127.0.0.1/32".parse().unwrap()]
        );
        let bad = ServerConfig::resolve(Settings {
            registry_allow_private: Some(vec!["10.0.0.1/8".into()]),
            ..Settings::default()
        })
        .unwrap_err()
        .to_string();
        assert!(
            bad.starts_with("registry_allow_private:") && bad.contains("10.0.0.0/8"),
            "{bad}"
        );
    }

    #[test]
    fn bad_values_are_named() {
        let bad = |s: Settings| ServerConfig::resolve(s).unwrap_err().to_string();
        assert!(
            bad(Settings {
                prefix: Some("Bad-Prefix".into()),
                ..Default::default()
            })
            .starts_with("prefix:")
        );
        assert!(
            bad(Settings {
                pool: Some("10.0.0.0".into()),
                ..Default::default()
            })
            .starts_with("pool:")
        );
        assert!(toml::from_str::<Settings>("lisen = 1").is_err());
    }

    const KEY: &str = "0123456789abcdef-group";

    #[test]
    fn the_artifact_store_defaults_to_the_data_directory_with_a_daily_collection() {
        let cfg = ServerConfig::resolve(Settings {
            data_dir: Some("/srv/fb".into()),
            ..Default::default()
        })
        .unwrap();
        let artifacts = &cfg.artifacts;
        assert_eq!(
            artifacts.store.location,
            StoreLocation::Local("/srv/fb/artifacts".into())
        );
        assert_eq!(artifacts.store.cache_budget, DEFAULT_BLOCK_CACHE_MIB << 20);
        assert!(artifacts.store.dart.is_none());
        assert_eq!(artifacts.gc_interval, Some(DEFAULT_LOCAL_GC_INTERVAL));
        assert_eq!(artifacts.gc_grace, fastbox_artifact::DEFAULT_GRACE);
    }

    #[test]
    fn an_s3_store_with_dart_comes_from_the_file_and_the_key_from_the_environment_layer() {
        let file: Settings = toml::from_str(
            r#"
            artifact_store = "s3://artifacts/fb?endpoint=http://10.0.0.9:9000"
            block_cache_mib = 512
            node_id = "n1"
            dart_listen = "0.0.0.0:7443"
            dart_peers = ["n1=10.0.0.1:7443", "n2=10.0.0.2:7443"]
            artifact_gc_grace = "2h"
            "#,
        )
        .unwrap();
        let env = Settings {
            dart_key: Some(KEY.into()),
            ..Default::default()
        };
        let cfg = ServerConfig::resolve(env.over(file)).unwrap();
        let artifacts = &cfg.artifacts;
        assert!(artifacts.store.location.is_remote());
        assert_eq!(artifacts.store.cache_budget, 512 << 20);
        let dart = artifacts.store.dart.as_ref().unwrap();
        assert_eq!(dart.node.as_str(), "n1");
        assert_eq!(dart.members.members().len(), 2);
        assert_eq!(
            artifacts.gc_interval, None,
            "a shared origin is not collected by default"
        );
        assert_eq!(artifacts.gc_grace, Duration::from_secs(7200));
        assert!(
            toml::from_str::<Settings>(&format!("dart_key = \"{KEY}\"")).is_err(),
            "the secret never comes from the file"
        );
    }

    #[test]
    fn bad_artifact_settings_are_named() {
        let bad = |s: Settings| ServerConfig::resolve(s).unwrap_err().to_string();
        let s3 = || Some("s3://artifacts?endpoint=http://127.0.0.1:9000".to_string());
        assert!(
            bad(Settings {
                artifact_store: Some("relative/dir".into()),
                ..Default::default()
            })
            .starts_with("artifact_store:")
        );
        let missing_key = bad(Settings {
            artifact_store: s3(),
            node_id: Some("n1".into()),
            dart_listen: Some("127.0.0.1:7443".parse().unwrap()),
            dart_peers: Some(vec!["n1=127.0.0.1:7443".into()]),
            ..Default::default()
        });
        assert!(
            missing_key.starts_with("dart:") && missing_key.contains("FASTBOX_DART_KEY"),
            "{missing_key}"
        );
        let local_dart = bad(Settings {
            node_id: Some("n1".into()),
            dart_listen: Some("127.0.0.1:7443".parse().unwrap()),
            dart_peers: Some(vec!["n1=127.0.0.1:7443".into()]),
            dart_key: Some(KEY.into()),
            ..Default::default()
        });
        assert!(local_dart.contains("s3://"), "{local_dart}");
        assert!(
            bad(Settings {
                artifact_gc_interval: Some("daily".into()),
                ..Default::default()
            })
            .starts_with("artifact_gc_interval:")
        );
        assert!(
            bad(Settings {
                artifact_store: s3(),
                block_cache_mib: Some(0),
                ..Default::default()
            })
            .starts_with("block_cache_mib:")
        );
    }

    #[test]
    fn the_lazy_clone_threshold_is_mib_or_off_with_a_default() {
        assert_eq!(parse_lazy_restore_min("64"), Ok(Some(64 << 20)));
        assert_eq!(parse_lazy_restore_min(" 0 "), Ok(Some(0)));
        assert_eq!(parse_lazy_restore_min("off"), Ok(None));
        for bad in ["lots", "-1", "1.5", "99999999999999999"] {
            assert!(parse_lazy_restore_min(bad).is_err(), "{bad}");
        }
        let cfg = ServerConfig::resolve(Settings::default()).unwrap();
        assert_eq!(
            cfg.lazy_restore_min_bytes,
            Some(fastbox_api::limits::DEFAULT_LAZY_RESTORE_MIN_BYTES)
        );
        let bad = Settings {
            lazy_restore_min_mib: Some("lots".into()),
            ..Settings::default()
        };
        let err = ServerConfig::resolve(bad).unwrap_err().to_string();
        assert!(err.contains("lazy_restore_min_mib"), "{err}");
        for (toml_text, want) in [
            ("lazy_restore_min_mib = 16", Some(16 << 20)),
            ("lazy_restore_min_mib = \"off\"", None),
        ] {
            let settings: Settings = toml::from_str(toml_text).unwrap();
            let cfg = ServerConfig::resolve(settings).unwrap();
            assert_eq!(cfg.lazy_restore_min_bytes, want, "{toml_text}");
        }
    }

    #[test]
    fn resource_defaults_and_maximums_come_from_the_layers_and_are_checked() {
        let cfg = ServerConfig::resolve(Settings::default()).unwrap();
        assert_eq!(cfg.resources, ResourcePolicy::default());
        assert_eq!(cfg.resources.defaults.memory_bytes, 512 << 20);
        assert_eq!(cfg.resources.max.memory_bytes, 16 << 30);
        assert!(cfg.allow_local_images.is_empty(), "none allowed by default");
        let file: Settings = toml::from_str(
            "default_cpu = 2\ndefault_memory = \"1Gi\"\nmax_cpu = \"8\"\nmax_disk = \"128Gi\"\nmax_pids = 8192\n",
        )
        .unwrap();
        let flags = Settings {
            default_memory: Some("768Mi".into()),
            default_pids: Some(256),
            ..Default::default()
        };
        let r = ServerConfig::resolve(flags.over(file)).unwrap().resources;
        assert_eq!(
            (
                r.defaults.cpu_millis,
                r.defaults.memory_bytes,
                r.defaults.pids
            ),
            (2000, 768 << 20, 256)
        );
        assert_eq!(
            (
                r.max.cpu_millis,
                r.max.disk_bytes,
                r.max.pids,
                r.max.memory_bytes
            ),
            (8000, 128 << 30, 8192, DEFAULT_MAX_RESOURCES.memory_bytes)
        );
        let bad = |s: Settings| ServerConfig::resolve(s).unwrap_err().to_string();
        let e = bad(Settings {
            default_memory: Some("32Gi".into()),
            ..Default::default()
        });
        assert!(
            e.starts_with("default_memory:") && e.contains("max_memory (16Gi)"),
            "{e}"
        );
        let e = bad(Settings {
            max_cpu: Some("lots".into()),
            ..Default::default()
        });
        assert!(e.starts_with("max_cpu:"), "{e}");
        let e = bad(Settings {
            max_pids: Some(4),
            ..Default::default()
        });
        assert!(e.starts_with("max_pids:"), "{e}");
    }

    #[test]
    fn local_image_directories_are_resolved_at_start() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("images");
        std::fs::create_dir(&real).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let cfg = ServerConfig::resolve(Settings {
            allow_local_images: Some(vec![link, real.join("../images")]),
            ..Default::default()
        })
        .unwrap();
        let canonical = std::fs::canonicalize(&real).unwrap();
        assert_eq!(cfg.allow_local_images, vec![canonical.clone(), canonical]);
        for missing in [
            tmp.path().join("missing"),
            tmp.path().join("images/../nope"),
        ] {
            let e = ServerConfig::resolve(Settings {
                allow_local_images: Some(vec![missing]),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
            assert!(e.starts_with("allow_local_images:"), "{e}");
        }
        let file = tmp.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = ServerConfig::resolve(Settings {
            allow_local_images: Some(vec![file]),
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a directory"), "{e}");
        let settings: Settings =
            toml::from_str("allow_local_images = [\"/srv/a\", \"/srv/b\"]").unwrap();
        assert_eq!(settings.allow_local_images.unwrap().len(), 2);
    }

    #[test]
    fn quantities_print_in_their_largest_whole_unit() {
        assert_eq!(format_bytes(16 << 30), "16Gi");
        assert_eq!(format_bytes(512 << 20), "512Mi");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(format_cpu(4000), "4");
        assert_eq!(format_cpu(1500), "1500m");
    }

    #[test]
    fn durations_and_intervals_read_and_print_back() {
        for (text, seconds) in [
            ("90s", 90),
            ("30m", 1800),
            ("24h", 86_400),
            ("168h", 604_800),
        ] {
            let d = parse_duration(text).unwrap();
            assert_eq!(d, Duration::from_secs(seconds), "{text}");
            assert_eq!(format_duration(d), text);
        }
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(604_800));
        assert_eq!(parse_duration("45").unwrap(), Duration::from_secs(45));
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
        for bad in ["", "h", "1.5h", "-3s", "3w", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_interval("off").unwrap(), None);
        assert_eq!(parse_interval("0").unwrap(), None);
        assert_eq!(
            parse_interval("6h").unwrap(),
            Some(Duration::from_secs(21_600))
        );
    }
}
