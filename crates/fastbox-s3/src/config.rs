//! Where the store is and how to talk to it: [`S3Config`].
//!
//! A configuration comes from a URL plus, optionally, the standard AWS environment variables:
//!
//! ```text
//! s3://<bucket>[/<prefix>][?endpoint=<url>&region=<name>&allow_http=<bool>&conditional_writes=auto|on|off]
//! ```
//!
//! ```no_run
//! # fn main() -> Result<(), fastbox_s3::ConfigError> {
//! let config = fastbox_s3::S3Config::from_url("s3://artifacts/fastbox?endpoint=http://127.0.0.1:9000")?
//!     .with_env(|name| std::env::var(name).ok());
//! # Ok(()) }
//! ```
//!
//! Secrets never travel in the URL: credentials are explicit fields or come from
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`). The environment
//! fills only what the URL or the caller left unset: `AWS_ENDPOINT_URL_S3` or
//! `AWS_ENDPOINT_URL` for the endpoint, `AWS_REGION` or `AWS_DEFAULT_REGION` for the region.
//! Nothing here reads the environment by itself: [`S3Config::with_env`] takes the lookup, so
//! a library caller decides (and tests pass a map).
//!
//! A plain-http endpoint must be allowed (`allow_http`); the URL and environment readers allow
//! it when the endpoint they read spells out `http://`, since that scheme was chosen
//! explicitly. Validation of the whole configuration happens in [`S3Config::validate`], which
//! `S3Store::open` calls.

use std::fmt;
use std::time::Duration;

/// S3's smallest part of a multipart upload (every part but the last).
pub const MIN_PART_SIZE: usize = 5 * 1024 * 1024;
/// The default multipart threshold and part size: 8 MiB.
pub const DEFAULT_PART_SIZE: usize = 8 * 1024 * 1024;
/// The region used when none is configured.
pub const DEFAULT_REGION: &str = "us-east-1";

/// Why a configuration is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not an `s3://bucket/prefix` URL.
    #[error("{url:?} is not an s3://bucket/prefix URL: {reason}")]
    BadUrl { url: String, reason: String },
    /// A query parameter this crate does not know (probably a typo).
    #[error(
        "unknown parameter {name:?} in {url:?} (known: endpoint, region, allow_http, conditional_writes)"
    )]
    UnknownParameter { url: String, name: String },
    /// A query parameter with a value it cannot take.
    #[error("parameter {name}={value:?}: {reason}")]
    BadParameter {
        name: String,
        value: String,
        reason: String,
    },
    /// The bucket name is empty or not a valid S3 bucket name.
    #[error("{0:?} is not a valid bucket name (3-63 characters of a-z, 0-9, '.', '-')")]
    BadBucket(String),
    /// A prefix with an empty, `.` or `..` segment.
    #[error("prefix {0:?} has an empty, '.' or '..' segment")]
    BadPrefix(String),
    /// An endpoint that is not an http(s) URL.
    #[error("endpoint {0:?} is not an http:// or https:// URL")]
    BadEndpoint(String),
    /// A plain-http endpoint without `allow_http`.
    #[error("endpoint {0} is plain http; set allow_http to use it")]
    HttpNotAllowed(String),
    /// No credentials were given.
    #[error(
        "no credentials for s3://{bucket}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or the config's fields"
    )]
    MissingCredentials { bucket: String },
    /// A multipart part size below S3's minimum.
    #[error("multipart part size {0} is below S3's minimum of {MIN_PART_SIZE} bytes")]
    PartTooSmall(usize),
}

/// Whether the server honours `If-None-Match: *` on writes (create-if-absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConditionalWrites {
    /// Probe once at open: write a probe object twice with the condition; if the second
    /// write succeeds, the server ignores the condition and the fallback is used.
    #[default]
    Auto,
    /// Trust the server (no probe).
    On,
    /// Never rely on the condition: use the fallback (see `docs/s3.md`).
    Off,
}

impl ConditionalWrites {
    fn parse(value: &str) -> Option<Self> {
        match value {
            "auto" => Some(ConditionalWrites::Auto),
            "on" | "true" => Some(ConditionalWrites::On),
            "off" | "false" => Some(ConditionalWrites::Off),
            _ => None,
        }
    }
}

/// Retries of transient failures (5xx, 429, timeouts, connection errors), with exponential
/// backoff. Other 4xx answers are never retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    /// Retries after the first attempt; 0 disables retrying.
    pub max_retries: usize,
    /// The first backoff; each next one doubles, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// The longest backoff.
    pub max_backoff: Duration,
    /// No retry starts later than this after the first attempt.
    pub retry_timeout: Duration,
}

impl Default for Retries {
    fn default() -> Self {
        Retries {
            max_retries: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            retry_timeout: Duration::from_secs(60),
        }
    }
}

/// Timeouts of one HTTP request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// Establishing the connection.
    pub connect: Duration,
    /// The whole request, body included (a multipart part is one request).
    pub request: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            request: Duration::from_secs(120),
        }
    }
}

/// When objects are uploaded in parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Multipart {
    /// Objects larger than this many bytes are uploaded in parts.
    pub threshold: usize,
    /// The size of every part but the last (at least [`MIN_PART_SIZE`]).
    pub part_size: usize,
}

impl Default for Multipart {
    fn default() -> Self {
        Multipart {
            threshold: DEFAULT_PART_SIZE,
            part_size: DEFAULT_PART_SIZE,
        }
    }
}

/// How to reach an S3-compatible store and where in it the artifacts live. See the module
/// docs for the URL form and the environment.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// The server's base URL (`http://127.0.0.1:9000`); None for AWS itself (path-style
    /// requests to the region's endpoint).
    pub endpoint: Option<String>,
    /// The bucket; it must exist.
    pub bucket: String,
    /// The key prefix of every object, without leading or trailing `/`; may be empty.
    pub prefix: String,
    /// The signing region; None means [`DEFAULT_REGION`].
    pub region: Option<String>,
    /// The access key id.
    pub access_key_id: Option<String>,
    /// The secret access key (never printed by `Debug`).
    pub secret_access_key: Option<String>,
    /// A session token for temporary credentials.
    pub session_token: Option<String>,
    /// Whether a plain-http endpoint is accepted.
    pub allow_http: bool,
    /// Whether to rely on `If-None-Match: *`.
    pub conditional_writes: ConditionalWrites,
    /// Retries of transient failures.
    pub retries: Retries,
    /// Request timeouts.
    pub timeouts: Timeouts,
    /// Multipart uploads.
    pub multipart: Multipart,
    /// A put of an object that is already stored copies it onto itself (which sets its
    /// modification time to now) when it was last written longer ago than this; younger
    /// objects are left alone. A garbage collector's grace period must exceed the longest
    /// publish plus this. `Duration::ZERO` refreshes on every put.
    pub refresh_after: Duration,
}

/// The default of [`S3Config::refresh_after`]: ten minutes.
pub const DEFAULT_REFRESH_AFTER: Duration = Duration::from_secs(600);

impl S3Config {
    /// A configuration for `bucket` with every other field at its default: no prefix, AWS's
    /// endpoint, no credentials (fill them in or use [`with_env`](Self::with_env)).
    pub fn new(bucket: impl Into<String>) -> Self {
        S3Config {
            endpoint: None,
            bucket: bucket.into(),
            prefix: String::new(),
            region: None,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            allow_http: false,
            conditional_writes: ConditionalWrites::Auto,
            retries: Retries::default(),
            timeouts: Timeouts::default(),
            multipart: Multipart::default(),
            refresh_after: DEFAULT_REFRESH_AFTER,
        }
    }

    /// Parse `s3://bucket/prefix?endpoint=...&region=...&allow_http=...&conditional_writes=...`.
    pub fn from_url(url: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::BadUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| bad("the scheme must be s3://"))?;
        let (location, query) = match rest.split_once('?') {
            Some((location, query)) => (location, Some(query)),
            None => (rest, None),
        };
        let (bucket, prefix) = location.split_once('/').unwrap_or((location, ""));
        if bucket.is_empty() {
            return Err(bad("no bucket"));
        }
        let mut config = S3Config::new(bucket);
        config.prefix = prefix.trim_matches('/').to_string();
        let mut allow_http = None;
        for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let parameter_error = |reason: &str| ConfigError::BadParameter {
                name: name.to_string(),
                value: value.to_string(),
                reason: reason.to_string(),
            };
            match name.as_ref() {
                "endpoint" => config.endpoint = Some(value.trim_end_matches('/').to_string()),
                "region" => config.region = Some(value.to_string()),
                "allow_http" => {
                    allow_http = Some(
                        parse_bool(&value)
                            .ok_or_else(|| parameter_error("expected true or false"))?,
                    )
                }
                "conditional_writes" => {
                    config.conditional_writes = ConditionalWrites::parse(&value)
                        .ok_or_else(|| parameter_error("expected auto, on or off"))?
                }
                _ => {
                    return Err(ConfigError::UnknownParameter {
                        url: url.to_string(),
                        name: name.to_string(),
                    });
                }
            }
        }
        config.allow_http = allow_http.unwrap_or_else(|| config.endpoint_is_http());
        Ok(config)
    }

    /// Fill what is still unset from the standard AWS environment variables, read through
    /// `lookup` (pass `|name| std::env::var(name).ok()` for the process environment). Empty
    /// values count as unset.
    pub fn with_env(mut self, lookup: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| lookup(name).filter(|value| !value.is_empty());
        if self.access_key_id.is_none() && self.secret_access_key.is_none() {
            self.access_key_id = get("AWS_ACCESS_KEY_ID");
            self.secret_access_key = get("AWS_SECRET_ACCESS_KEY");
            if self.session_token.is_none() {
                self.session_token = get("AWS_SESSION_TOKEN");
            }
        }
        if self.endpoint.is_none() {
            self.endpoint = get("AWS_ENDPOINT_URL_S3")
                .or_else(|| get("AWS_ENDPOINT_URL"))
                .map(|endpoint| endpoint.trim_end_matches('/').to_string());
            self.allow_http |= self.endpoint_is_http();
        }
        if self.region.is_none() {
            self.region = get("AWS_REGION").or_else(|| get("AWS_DEFAULT_REGION"));
        }
        self
    }

    /// The signing region.
    pub fn region(&self) -> &str {
        self.region.as_deref().unwrap_or(DEFAULT_REGION)
    }

    /// The server's base URL: the endpoint, or AWS's endpoint of the region.
    pub fn endpoint_url(&self) -> String {
        match &self.endpoint {
            Some(endpoint) => endpoint.trim_end_matches('/').to_string(),
            None => format!("https://s3.{}.amazonaws.com", self.region()),
        }
    }

    /// `s3://bucket/prefix`, for messages.
    pub fn location(&self) -> String {
        if self.prefix.is_empty() {
            format!("s3://{}", self.bucket)
        } else {
            format!("s3://{}/{}", self.bucket, self.prefix)
        }
    }

    /// Check the configuration: bucket name, prefix, endpoint scheme and `allow_http`,
    /// credentials, part size.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !valid_bucket_name(&self.bucket) {
            return Err(ConfigError::BadBucket(self.bucket.clone()));
        }
        if !self.prefix.is_empty()
            && self
                .prefix
                .split('/')
                .any(|segment| matches!(segment, "" | "." | ".."))
        {
            return Err(ConfigError::BadPrefix(self.prefix.clone()));
        }
        if let Some(endpoint) = &self.endpoint {
            if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
                return Err(ConfigError::BadEndpoint(endpoint.clone()));
            }
            if self.endpoint_is_http() && !self.allow_http {
                return Err(ConfigError::HttpNotAllowed(endpoint.clone()));
            }
        }
        if self.access_key_id.is_none() || self.secret_access_key.is_none() {
            return Err(ConfigError::MissingCredentials {
                bucket: self.bucket.clone(),
            });
        }
        if self.multipart.part_size < MIN_PART_SIZE {
            return Err(ConfigError::PartTooSmall(self.multipart.part_size));
        }
        Ok(())
    }

    fn endpoint_is_http(&self) -> bool {
        self.endpoint
            .as_deref()
            .is_some_and(|endpoint| endpoint.starts_with("http://"))
    }
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hidden = |secret: &Option<String>| secret.as_ref().map(|_| "******");
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &hidden(&self.secret_access_key))
            .field("session_token", &hidden(&self.session_token))
            .field("allow_http", &self.allow_http)
            .field("conditional_writes", &self.conditional_writes)
            .field("retries", &self.retries)
            .field("timeouts", &self.timeouts)
            .field("multipart", &self.multipart)
            .field("refresh_after", &self.refresh_after)
            .finish()
    }
}

fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

/// S3's bucket naming rules, loosely: 3 to 63 of `a-z 0-9 . -`, starting and ending with a
/// letter or digit.
fn valid_bucket_name(name: &str) -> bool {
    let edge = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    (3..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && edge(name.bytes().next())
        && edge(name.bytes().last())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn with_creds(mut config: S3Config) -> S3Config {
        config.access_key_id = Some("id".into());
        config.secret_access_key = Some("secret".into());
        config
    }

    #[test]
    fn parses_bucket_prefix_and_parameters() {
        let config = S3Config::from_url(
            "s3://artifacts/fast/box/?endpoint=http://127.0.0.1:9000/&region=eu-west-1&conditional_writes=off",
        )
        .unwrap();
        assert_eq!(config.bucket, "artifacts");
        assert_eq!(config.prefix, "fast/box");
        assert_eq!(config.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(config.region(), "eu-west-1");
        assert_eq!(config.conditional_writes, ConditionalWrites::Off);
        assert!(config.allow_http, "an explicit http:// endpoint is allowed");
        assert_eq!(config.location(), "s3://artifacts/fast/box");
        with_creds(config).validate().unwrap();

        let bare = S3Config::from_url("s3://artifacts").unwrap();
        assert_eq!(bare.prefix, "");
        assert_eq!(bare.region(), DEFAULT_REGION);
        assert_eq!(bare.endpoint_url(), "https://s3.us-east-1.amazonaws.com");
        assert!(!bare.allow_http);
    }

    #[test]
    fn rejects_bad_urls_and_parameters() {
        assert!(matches!(
            S3Config::from_url("http://bucket/x"),
            Err(ConfigError::BadUrl { .. })
        ));
        assert!(matches!(
            S3Config::from_url("s3:///x"),
            Err(ConfigError::BadUrl { .. })
        ));
        assert!(matches!(
            S3Config::from_url("s3://bucket?endpiont=x"),
            Err(ConfigError::UnknownParameter { .. })
        ));
        assert!(matches!(
            S3Config::from_url("s3://bucket?conditional_writes=maybe"),
            Err(ConfigError::BadParameter { .. })
        ));
        let refused = S3Config::from_url("s3://bucket?endpoint=http://h:1&allow_http=false")
            .map(with_creds)
            .unwrap();
        assert_eq!(
            refused.validate(),
            Err(ConfigError::HttpNotAllowed("http://h:1".into()))
        );
        for (url, error) in [
            ("s3://Bucket", ConfigError::BadBucket("Bucket".into())),
            ("s3://ab", ConfigError::BadBucket("ab".into())),
            ("s3://bucket/a//b", ConfigError::BadPrefix("a//b".into())),
            (
                "s3://bucket/a/../b",
                ConfigError::BadPrefix("a/../b".into()),
            ),
            (
                "s3://bucket?endpoint=ftp://h",
                ConfigError::BadEndpoint("ftp://h".into()),
            ),
        ] {
            let config = with_creds(S3Config::from_url(url).unwrap());
            assert_eq!(config.validate(), Err(error), "{url}");
        }
    }

    #[test]
    fn the_environment_fills_only_what_is_unset() {
        let env: HashMap<&str, &str> = HashMap::from([
            ("AWS_ACCESS_KEY_ID", "env-id"),
            ("AWS_SECRET_ACCESS_KEY", "env-secret"),
            ("AWS_ENDPOINT_URL", "http://10.0.0.1:9000"),
            ("AWS_REGION", "ap-south-1"),
        ]);
        let lookup = |name: &str| env.get(name).map(|v| v.to_string());

        let filled = S3Config::from_url("s3://bucket").unwrap().with_env(lookup);
        assert_eq!(filled.access_key_id.as_deref(), Some("env-id"));
        assert_eq!(filled.secret_access_key.as_deref(), Some("env-secret"));
        assert_eq!(filled.endpoint.as_deref(), Some("http://10.0.0.1:9000"));
        assert!(filled.allow_http);
        assert_eq!(filled.region(), "ap-south-1");
        filled.validate().unwrap();

        let explicit = S3Config::from_url("s3://bucket?endpoint=https://s3.example&region=r1")
            .map(with_creds)
            .unwrap()
            .with_env(lookup);
        assert_eq!(explicit.access_key_id.as_deref(), Some("id"));
        assert_eq!(explicit.endpoint.as_deref(), Some("https://s3.example"));
        assert_eq!(explicit.region(), "r1");
        assert!(!explicit.allow_http);

        let missing = S3Config::from_url("s3://bucket")
            .unwrap()
            .with_env(|_| None);
        assert_eq!(
            missing.validate(),
            Err(ConfigError::MissingCredentials {
                bucket: "bucket".into()
            })
        );
    }

    #[test]
    fn debug_hides_the_secret() {
        let mut config = with_creds(S3Config::new("bucket"));
        config.secret_access_key = Some("s3cr3t-value".into());
        let printed = format!("{config:?}");
        assert!(
            printed.contains("\"id\"") && printed.contains("******"),
            "{printed}"
        );
        assert!(!printed.contains("s3cr3t-value"), "{printed}");
    }

    #[test]
    fn part_size_has_a_floor() {
        let mut config = with_creds(S3Config::new("bucket"));
        config.multipart.part_size = MIN_PART_SIZE - 1;
        assert_eq!(
            config.validate(),
            Err(ConfigError::PartTooSmall(MIN_PART_SIZE - 1))
        );
    }
}
