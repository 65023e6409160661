//! `fastbox up`'s configuration: built-in defaults, then an optional TOML file, then
//! environment and flags (the command line turns those into a [`Settings`] layer).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use fastbox_runtime::net::Ipv4Pool;
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
    /// How long a create waits for its image before answering `Pending`, milliseconds.
    pub create_image_wait_ms: Option<u64>,
    /// Sets both `pool_min` and `pool_max` (0: no warm pool).
    pub pool_size: Option<usize>,
    /// Unclaimed sandboxes kept restored per template when idle.
    pub pool_min: Option<usize>,
    /// Most unclaimed sandboxes kept per template when creates ask for more.
    pub pool_max: Option<usize>,
    /// Network slots with an empty writable layer kept made ahead of demand (0: none).
    pub spare_slots: Option<usize>,
    /// DNS servers (`address:port`) the forwarder asks for names a sandbox's policy allows.
    pub dns_upstreams: Option<Vec<std::net::SocketAddr>>,
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
            create_image_wait_ms: self.create_image_wait_ms.or(lower.create_image_wait_ms),
            pool_size: self.pool_size.or(lower.pool_size),
            pool_min: self.pool_min.or(lower.pool_min),
            pool_max: self.pool_max.or(lower.pool_max),
            spare_slots: self.spare_slots.or(lower.spare_slots),
            dns_upstreams: self.dns_upstreams.or(lower.dns_upstreams),
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
/// Spare slots by default: enough for a burst of on-demand restores (10 concurrent creates
/// with the pool off) on a small machine; each costs a network namespace, a veth pair and a
/// loop-mounted sparse layer (a few MiB of disk).
pub const DEFAULT_SPARE_SLOTS: usize = 8;

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
    /// The DNS forwarder's upstreams (`None`: the host's resolvers).
    pub dns_upstreams: Option<Vec<std::net::SocketAddr>>,
    /// How long a create waits for its image before answering `Pending` (an image that fails
    /// within this time is a 400).
    pub image_wait: Duration,
    /// How long a create waits for the start, once the image is there, before answering
    /// `Pending`.
    pub create_wait: Duration,
    /// How often expiry, deletion and garbage collection are reconciled.
    pub reconcile_every: Duration,
}

impl ServerConfig {
    /// Applies the defaults under `settings`.
    pub fn resolve(settings: Settings) -> Result<Self, ConfigError> {
        let invalid = |field, message: String| ConfigError::Invalid { field, message };
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
            .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
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
            dns_upstreams: settings.dns_upstreams,
            image_wait: Duration::from_millis(settings.create_image_wait_ms.unwrap_or(1500)),
            create_wait: Duration::from_secs(20),
            reconcile_every: Duration::from_secs(2),
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
}
