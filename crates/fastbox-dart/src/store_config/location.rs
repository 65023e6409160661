//! Where a node's artifact store (its origin) is: [`StoreLocation`].
//!
//! Written as one string in flags, environment and config files:
//!
//! | form | store |
//! |---|---|
//! | `/abs/dir` or `file:///abs/dir` | a [`LocalStore`] directory (created when missing) |
//! | `s3://bucket[/prefix][?endpoint=URL&region=R&...]` | an [`S3Store`] (`fastbox_s3::S3Config::from_url`) |
//!
//! S3 credentials never travel in the string: [`StoreLocation::open`] fills them (and an
//! endpoint or region the URL left out) from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, ...
//! through the lookup it is given, so this module reads no environment by itself. Opening an
//! S3 location checks the endpoint, the credentials and the bucket: each failure is its own
//! clear error (`fastbox_s3::OpenError`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fastbox_artifact::{ArtifactStore, LocalStore, StoreError};
use fastbox_s3::{S3Config, S3Store};

/// The directory of a node's local store under its data directory (the default location).
pub const LOCAL_STORE_DIR: &str = "artifacts";

/// Why a location does not parse or its store does not open.
#[derive(Debug, thiserror::Error)]
pub enum LocationError {
    /// Neither an absolute directory nor an `s3://` URL.
    #[error(
        "{0:?} is not an artifact store: give an absolute directory (or file:///dir) or s3://bucket/prefix?endpoint=URL"
    )]
    Unknown(String),
    /// An `s3://` URL that `fastbox-s3` refuses.
    #[error("artifact store {url:?}: {source}")]
    S3Url {
        url: String,
        source: fastbox_s3::ConfigError,
    },
    /// The local directory could not be opened.
    #[error("artifact store {}: {source}", path.display())]
    OpenLocal { path: PathBuf, source: StoreError },
    /// The S3 store could not be opened (unreachable, bad credentials, no bucket, ...).
    #[error(transparent)]
    OpenS3(#[from] fastbox_s3::OpenError),
}

/// A node's origin store. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A local directory.
    Local(PathBuf),
    /// An S3-compatible bucket (credentials are filled in at [`open`](Self::open)).
    S3(Box<S3Config>),
}

impl StoreLocation {
    /// `DATA_DIR/artifacts`: the default of a node whose data directory is `data_dir`.
    pub fn local_default(data_dir: &Path) -> Self {
        StoreLocation::Local(data_dir.join(LOCAL_STORE_DIR))
    }

    /// Parse an absolute directory, a `file://` URL or an `s3://` URL.
    pub fn parse(text: &str) -> Result<Self, LocationError> {
        let text = text.trim();
        if text.starts_with("s3://") {
            return S3Config::from_url(text)
                .map(|config| StoreLocation::S3(Box::new(config)))
                .map_err(|source| LocationError::S3Url {
                    url: text.to_string(),
                    source,
                });
        }
        let path = Path::new(text.strip_prefix("file://").unwrap_or(text));
        if path.is_absolute() {
            Ok(StoreLocation::Local(path.to_path_buf()))
        } else {
            Err(LocationError::Unknown(text.to_string()))
        }
    }

    /// Whether the store is remote (reads are worth a node block cache, and nodes can share
    /// it).
    pub fn is_remote(&self) -> bool {
        matches!(self, StoreLocation::S3(_))
    }

    /// Open the store. `env` looks up the S3 credentials (and an endpoint or region the URL
    /// left out); pass `|name| std::env::var(name).ok()` for the process environment.
    pub fn open(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Arc<dyn ArtifactStore>, LocationError> {
        match self {
            StoreLocation::Local(path) => LocalStore::open(path)
                .map(|store| Arc::new(store) as Arc<dyn ArtifactStore>)
                .map_err(|source| LocationError::OpenLocal {
                    path: path.clone(),
                    source,
                }),
            StoreLocation::S3(config) => {
                let config = S3Config::clone(config).with_env(env);
                Ok(Arc::new(S3Store::open(config)?))
            }
        }
    }
}

/// The directory, or `s3://bucket/prefix at ENDPOINT`; never a credential.
impl fmt::Display for StoreLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreLocation::Local(path) => write!(f, "{}", path.display()),
            StoreLocation::S3(config) => match &config.endpoint {
                Some(endpoint) => write!(f, "{} at {endpoint}", config.location()),
                None => f.write_str(&config.location()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_and_s3_urls_parse_and_anything_else_is_named() {
        assert_eq!(
            StoreLocation::parse("/var/lib/fastbox/artifacts").unwrap(),
            StoreLocation::Local("/var/lib/fastbox/artifacts".into())
        );
        assert_eq!(
            StoreLocation::parse("file:///srv/artifacts").unwrap(),
            StoreLocation::Local("/srv/artifacts".into())
        );
        let s3 =
            StoreLocation::parse("s3://artifacts/fast/box?endpoint=http://127.0.0.1:9000").unwrap();
        let StoreLocation::S3(config) = &s3 else {
            panic!("{s3:?}");
        };
        assert_eq!(
            (config.bucket.as_str(), config.prefix.as_str()),
            ("artifacts", "fast/box")
        );
        assert!(s3.is_remote());
        assert_eq!(
            s3.to_string(),
            "s3://artifacts/fast/box at http://127.0.0.1:9000"
        );

        for bad in ["artifacts", "file://relative", "http://host/x", ""] {
            let error = StoreLocation::parse(bad).unwrap_err();
            assert!(
                matches!(error, LocationError::Unknown(_)),
                "{bad}: {error:?}"
            );
            assert!(error.to_string().contains("s3://bucket"), "{error}");
        }
        let error = StoreLocation::parse("s3://b?endpiont=x").unwrap_err();
        assert!(error.to_string().contains("endpiont"), "{error}");
    }

    #[test]
    fn the_default_is_the_data_directorys_artifacts_and_opens_there() {
        let dir = tempfile::tempdir().unwrap();
        let location = StoreLocation::local_default(dir.path());
        assert_eq!(location, StoreLocation::Local(dir.path().join("artifacts")));
        assert!(!location.is_remote());
        let store = location.open(&|_| None).unwrap();
        let bytes = b"a block";
        store
            .put_block(&fastbox_artifact::Digest::of(bytes), bytes)
            .unwrap();
        assert!(dir.path().join("artifacts/blocks").is_dir());
    }

    #[test]
    fn an_s3_location_without_credentials_is_refused_before_any_request() {
        let location = StoreLocation::parse("s3://artifacts?endpoint=http://127.0.0.1:1").unwrap();
        let error = location.open(&|_| None).err().expect("refused");
        assert!(error.to_string().contains("AWS_ACCESS_KEY_ID"), "{error}");
    }
}
