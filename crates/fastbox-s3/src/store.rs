//! [`S3Store`]: the artifact store contract on an S3-compatible bucket.
//!
//! Opening checks the configuration, the endpoint, the credentials and the bucket (each
//! failure its own [`OpenError`] naming the endpoint and bucket), and settles whether the
//! server's `If-None-Match: *` can be relied on (see `probe.rs`). Every trait call then runs
//! its requests on the store's private runtime (`bridge.rs`) and waits for them; the calling
//! thread may be a plain thread or a `spawn_blocking` thread.
//!
//! How each part of the contract is met (details in `docs/s3.md`):
//! - verified reads: whole objects pass through [`verify_read`]; [`S3Store::stream_block`]
//!   hashes the chunks as they arrive and fails with `Corrupt` after the last one;
//! - verified, idempotent, create-if-absent puts with a refreshed modification time:
//!   [`verify_block_put`], then `put.rs`;
//! - atomic objects: S3 objects appear whole (single `PUT`, or a completed multipart upload);
//! - conditional index: `index.rs`;
//! - listings: object_store pages through `ListObjectsV2`; keys that are not ours are skipped.

use std::future::Future;
use std::io;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use fastbox_artifact::{
    ArtifactStore, Digest, IndexCreate, IndexKey, ObjectKind, StoreError, Stored, StoredObject,
    verify_block_put, verify_read,
};
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder, S3ConditionalPut};
use object_store::{BackoffConfig, ClientOptions, ObjectMeta, RetryConfig};

use crate::bridge::{Bridge, BridgeError};
use crate::bucket::{self, BucketError, Target};
use crate::client::{Client, ClientError};
use crate::config::{ConditionalWrites, ConfigError, S3Config};
use crate::index::Claim;
use crate::layout::Layout;
use crate::raw::{RawClient, RawError};

/// Worker threads of a store's runtime: requests are I/O-bound.
const RUNTIME_THREADS: usize = 2;
/// Index entries read at once by `list_index`.
const INDEX_READS_IN_FLIGHT: usize = 16;

/// Why a store could not be opened (or a bucket created).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The configuration is unusable.
    #[error("S3 store: {0}")]
    Config(#[from] ConfigError),
    /// The endpoint, credentials or bucket are wrong (the message says which).
    #[error(transparent)]
    Bucket(#[from] BucketError),
    /// The runtime could not start.
    #[error("S3 store {location}: {source}")]
    Runtime {
        location: String,
        #[source]
        source: BridgeError,
    },
    /// The S3 client could not be built.
    #[error("S3 store {location}: build the client: {source}")]
    Client {
        location: String,
        #[source]
        source: object_store::Error,
    },
    /// The HTTP client of raw requests could not be built.
    #[error("S3 store {location}: {source}")]
    Raw {
        location: String,
        #[source]
        source: RawError,
    },
    /// The conditional-write probe failed (set `conditional_writes` to `on` or `off` to skip
    /// it, e.g. for credentials that may not write).
    #[error(
        "S3 store {location} at {endpoint}: probing whether the server honours If-None-Match failed: {source}"
    )]
    Probe {
        location: String,
        endpoint: String,
        #[source]
        source: Box<ClientError>,
    },
}

/// An artifact store in an S3-compatible bucket. See the module docs.
#[derive(Debug)]
pub struct S3Store {
    client: Arc<Client>,
    bridge: Bridge,
    config: S3Config,
}

/// What both opening a store and creating a bucket need.
struct Connection {
    bridge: Bridge,
    raw: Arc<RawClient>,
    options: ClientOptions,
    target: Arc<Target>,
}

impl Connection {
    fn new(config: &S3Config) -> Result<Self, OpenError> {
        config.validate()?;
        let location = config.location();
        let bridge = Bridge::new(RUNTIME_THREADS).map_err(|source| OpenError::Runtime {
            location: location.clone(),
            source,
        })?;
        let options = ClientOptions::new()
            .with_allow_http(config.allow_http)
            .with_timeout(config.timeouts.request)
            .with_connect_timeout(config.timeouts.connect);
        let raw = RawClient::new(config, &options)
            .map_err(|source| OpenError::Raw { location, source })?;
        let target = Target {
            endpoint: config.endpoint_url(),
            bucket: config.bucket.clone(),
            region: config.region().to_string(),
            access_key_id: config.access_key_id.clone().unwrap_or_default(),
        };
        Ok(Connection {
            bridge,
            raw: Arc::new(raw),
            options,
            target: Arc::new(target),
        })
    }

    /// Run a bucket operation on the runtime.
    fn bucket_call<F, Fut>(&self, config: &S3Config, call: F) -> Result<(), OpenError>
    where
        F: FnOnce(Arc<RawClient>, Arc<Target>) -> Fut,
        Fut: Future<Output = Result<(), BucketError>> + Send + 'static,
    {
        self.bridge
            .run(call(self.raw.clone(), self.target.clone()))
            .map_err(|source| OpenError::Runtime {
                location: config.location(),
                source,
            })?
            .map_err(OpenError::from)
    }
}

/// Create the configuration's bucket (tests and first-time set-up); a bucket these
/// credentials can already list is fine.
pub fn create_bucket(config: &S3Config) -> Result<(), OpenError> {
    Connection::new(config)?.bucket_call(config, |raw, target| async move {
        bucket::create(&raw, &target).await
    })
}

impl S3Store {
    /// Open the store: check the configuration, reach the endpoint, check the credentials
    /// and that the bucket exists, and settle conditional writes (probing the server with
    /// [`ConditionalWrites::Auto`]).
    pub fn open(config: S3Config) -> Result<Self, OpenError> {
        let prefix = config.prefix.clone();
        let connection = Connection::new(&config)?;
        connection.bucket_call(&config, |raw, target| async move {
            bucket::check(&raw, &target, &prefix).await
        })?;
        let s3 =
            build_s3(&config, connection.options.clone()).map_err(|source| OpenError::Client {
                location: config.location(),
                source,
            })?;
        let client = Client {
            s3,
            raw: connection.raw,
            layout: Layout::new(&config.prefix),
            conditional: config.conditional_writes != ConditionalWrites::Off,
            multipart: config.multipart,
            refresh_after: config.refresh_after,
        };
        let bridge = connection.bridge;
        let client = match config.conditional_writes {
            ConditionalWrites::Auto => probe(&bridge, &config, client)?,
            ConditionalWrites::On | ConditionalWrites::Off => client,
        };
        Ok(S3Store {
            client: Arc::new(client),
            bridge,
            config,
        })
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &S3Config {
        &self.config
    }

    /// Where each object lives in the bucket.
    pub fn layout(&self) -> &Layout {
        &self.client.layout
    }

    /// Whether puts rely on `If-None-Match: *` (false: the fallback of `docs/s3.md`).
    pub fn uses_conditional_writes(&self) -> bool {
        self.client.conditional
    }

    /// Bytes `range` of a block, read with a ranged `GET`. Not verified: a range cannot be
    /// checked against the block's digest (read the whole block for that). A range past the
    /// end of the block is an error.
    pub fn get_block_range(
        &self,
        digest: &Digest,
        range: Range<u64>,
    ) -> Result<Vec<u8>, StoreError> {
        let key = self.client.layout.block(digest);
        if range.start > range.end {
            return Err(io_failure(
                "read a range of",
                &self.location(&key),
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("range {}..{} is reversed", range.start, range.end),
                ),
            ));
        }
        match self.call("read a range of", key, move |c, k| async move {
            c.get_range(&k, range).await
        })? {
            Some(bytes) => Ok(Vec::from(bytes)),
            None => Err(not_found(ObjectKind::Block, digest)),
        }
    }

    /// The async core, for in-crate tests.
    #[cfg(test)]
    pub(crate) fn client(&self) -> Arc<Client> {
        self.client.clone()
    }

    /// The runtime, for in-crate tests.
    #[cfg(test)]
    pub(crate) fn bridge(&self) -> &Bridge {
        &self.bridge
    }

    /// Run one operation on the runtime, mapping its failure to a store error on `key`.
    fn call<T, F, Fut>(&self, op: &'static str, key: String, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(Arc<Client>, String) -> Fut,
        Fut: Future<Output = Result<T, ClientError>> + Send + 'static,
        T: Send + 'static,
    {
        let location = self.location(&key);
        match self.bridge.run(f(self.client.clone(), key)) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => Err(client_failure(op, &location, error)),
            Err(error) => Err(io_failure(op, &location, io::Error::other(error))),
        }
    }

    /// `s3://bucket/key`, for messages.
    fn location(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.config.bucket)
    }

    fn get_object(
        &self,
        kind: ObjectKind,
        digest: &Digest,
        key: String,
    ) -> Result<Vec<u8>, StoreError> {
        match self.call("read", key, |c, k| async move { c.get(&k).await })? {
            Some(bytes) => verify_read(kind, digest, Vec::from(bytes)),
            None => Err(not_found(kind, digest)),
        }
    }

    fn put_object(&self, key: String, bytes: &[u8]) -> Result<Stored, StoreError> {
        let bytes = Bytes::copy_from_slice(bytes);
        self.call(
            "write",
            key,
            |c, k| async move { c.put_object(&k, bytes).await },
        )
    }

    fn exists(&self, key: String) -> Result<bool, StoreError> {
        self.call("stat", key, |c, k| async move { c.head(&k).await })
            .map(|meta| meta.is_some())
    }

    fn delete(&self, key: String) -> Result<(), StoreError> {
        self.call("delete", key, |c, k| async move { c.delete(&k).await })
    }

    fn list_objects(
        &self,
        dir: String,
        parse: impl Fn(&str) -> Option<Digest>,
    ) -> Result<Vec<StoredObject>, StoreError> {
        let objects = self.call("list", dir, |c, d| async move { c.list(&d).await })?;
        Ok(objects
            .into_iter()
            .filter_map(|meta| stored_object(&meta, &parse))
            .collect())
    }

    fn parse_entry(&self, key: &IndexKey, content: &[u8]) -> Result<Digest, StoreError> {
        let content = String::from_utf8_lossy(content).into_owned();
        Digest::from_hex(content.trim_end_matches('\n')).map_err(|_| StoreError::CorruptIndex {
            key: key.clone(),
            content,
        })
    }
}

/// Build object_store's client from the configuration.
fn build_s3(config: &S3Config, options: ClientOptions) -> Result<AmazonS3, object_store::Error> {
    let retries = config.retries;
    let mut builder = AmazonS3Builder::new()
        .with_bucket_name(&config.bucket)
        .with_region(config.region())
        .with_access_key_id(config.access_key_id.clone().unwrap_or_default())
        .with_secret_access_key(config.secret_access_key.clone().unwrap_or_default())
        .with_allow_http(config.allow_http)
        .with_virtual_hosted_style_request(false)
        .with_conditional_put(S3ConditionalPut::ETagMatch)
        .with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: retries.initial_backoff,
                max_backoff: retries.max_backoff,
                base: 2.0,
            },
            max_retries: retries.max_retries,
            retry_timeout: retries.retry_timeout,
        })
        .with_client_options(options);
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(token) = &config.session_token {
        builder = builder.with_token(token);
    }
    builder.build()
}

/// Settle [`ConditionalWrites::Auto`] by probing the server.
fn probe(bridge: &Bridge, config: &S3Config, mut client: Client) -> Result<Client, OpenError> {
    let failed = |source| OpenError::Probe {
        location: config.location(),
        endpoint: config.endpoint_url(),
        source: Box::new(source),
    };
    let (returned, honoured) = bridge
        .run(async move {
            let honoured = client.honours_if_none_match().await;
            (client, honoured)
        })
        .map_err(|source| OpenError::Runtime {
            location: config.location(),
            source,
        })?;
    client = returned;
    client.conditional = honoured.map_err(failed)?;
    if !client.conditional {
        tracing::warn!(endpoint = %config.endpoint_url(), bucket = %config.bucket,
            "the S3 server ignores If-None-Match; using the read-back fallback (docs/s3.md)");
    }
    Ok(client)
}

fn stored_object(
    meta: &ObjectMeta,
    parse: &impl Fn(&str) -> Option<Digest>,
) -> Option<StoredObject> {
    let digest = parse(meta.location.as_ref());
    if digest.is_none() {
        tracing::debug!(key = %meta.location, "not an artifact object, skipped");
    }
    Some(StoredObject {
        digest: digest?,
        size: meta.size,
        modified: meta.last_modified.into(),
    })
}

fn not_found(kind: ObjectKind, digest: &Digest) -> StoreError {
    StoreError::NotFound {
        kind,
        digest: *digest,
    }
}

fn io_failure(op: &'static str, location: &str, source: io::Error) -> StoreError {
    StoreError::Io {
        op,
        location: location.to_string(),
        source,
    }
}

fn client_failure(op: &'static str, location: &str, error: ClientError) -> StoreError {
    io_failure(op, location, io::Error::new(error.io_kind(), error))
}

/// Why a block stream could not start.
enum StreamStart {
    /// No such block.
    Absent,
    /// The request failed.
    Failed(ClientError),
}

impl ArtifactStore for S3Store {
    fn put_block(&self, digest: &Digest, bytes: &[u8]) -> Result<Stored, StoreError> {
        verify_block_put(digest, bytes)?;
        self.put_object(self.client.layout.block(digest), bytes)
    }

    fn get_block(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.get_object(ObjectKind::Block, digest, self.client.layout.block(digest))
    }

    fn stream_block(
        &self,
        digest: &Digest,
        sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> Result<u64, StoreError> {
        let key = self.client.layout.block(digest);
        let location = self.location(&key);
        let client = self.client.clone();
        let mut hasher = blake3::Hasher::new();
        let mut len = 0u64;
        let mut failure = None;
        let started = self.bridge.stream(
            move || async move {
                match client.open(&key).await {
                    Ok(Some(body)) => Ok(body
                        .into_stream()
                        .map_err(|e| StreamStart::Failed(e.into()))
                        .boxed()),
                    Ok(None) => Err(StreamStart::Absent),
                    Err(error) => Err(StreamStart::Failed(error)),
                }
            },
            |chunk| match chunk {
                Ok(bytes) => {
                    hasher.update(&bytes);
                    len += bytes.len() as u64;
                    match sink(&bytes) {
                        Ok(()) => true,
                        Err(source) => {
                            failure =
                                Some(io_failure("pass on", &format!("block {digest}"), source));
                            false
                        }
                    }
                }
                Err(StreamStart::Failed(error)) => {
                    failure = Some(client_failure("read", &location, error));
                    false
                }
                Err(StreamStart::Absent) => {
                    failure = Some(not_found(ObjectKind::Block, digest));
                    false
                }
            },
        );
        match started {
            Err(error) => return Err(io_failure("read", &location, io::Error::other(error))),
            Ok(Err(StreamStart::Absent)) => return Err(not_found(ObjectKind::Block, digest)),
            Ok(Err(StreamStart::Failed(error))) => {
                return Err(client_failure("read", &location, error));
            }
            Ok(Ok(())) => {}
        }
        if let Some(failure) = failure {
            return Err(failure);
        }
        let actual = Digest::from(hasher.finalize());
        if actual != *digest {
            return Err(StoreError::Corrupt {
                kind: ObjectKind::Block,
                digest: *digest,
                actual,
            });
        }
        Ok(len)
    }

    fn has_block(&self, digest: &Digest) -> Result<bool, StoreError> {
        self.exists(self.client.layout.block(digest))
    }

    fn delete_block(&self, digest: &Digest) -> Result<(), StoreError> {
        self.delete(self.client.layout.block(digest))
    }

    fn list_blocks(&self) -> Result<Vec<StoredObject>, StoreError> {
        let layout = self.client.layout.clone();
        self.list_objects(layout.blocks_dir(), |key| layout.parse_block(key))
    }

    fn put_manifest(&self, bytes: &[u8]) -> Result<(Digest, Stored), StoreError> {
        let digest = Digest::of(bytes);
        let stored = self.put_object(self.client.layout.manifest(&digest), bytes)?;
        Ok((digest, stored))
    }

    fn get_manifest(&self, digest: &Digest) -> Result<Vec<u8>, StoreError> {
        self.get_object(
            ObjectKind::Manifest,
            digest,
            self.client.layout.manifest(digest),
        )
    }

    fn has_manifest(&self, digest: &Digest) -> Result<bool, StoreError> {
        self.exists(self.client.layout.manifest(digest))
    }

    fn delete_manifest(&self, digest: &Digest) -> Result<(), StoreError> {
        self.delete(self.client.layout.manifest(digest))
    }

    fn list_manifests(&self) -> Result<Vec<StoredObject>, StoreError> {
        let layout = self.client.layout.clone();
        self.list_objects(layout.manifests_dir(), |key| layout.parse_manifest(key))
    }

    fn index_create_if_absent(
        &self,
        key: &IndexKey,
        digest: &Digest,
    ) -> Result<IndexCreate, StoreError> {
        let content = Bytes::from(format!("{digest}\n"));
        let claim = self.call(
            "create index entry",
            self.client.layout.index(key),
            |c, k| async move { c.create_if_absent(&k, content).await },
        )?;
        match claim {
            Claim::Created => Ok(IndexCreate::Created),
            Claim::Exists(content) => Ok(IndexCreate::Exists(self.parse_entry(key, &content)?)),
        }
    }

    fn index_get(&self, key: &IndexKey) -> Result<Option<Digest>, StoreError> {
        let content = self.call("read", self.client.layout.index(key), |c, k| async move {
            c.get(&k).await
        })?;
        content
            .map(|content| self.parse_entry(key, &content))
            .transpose()
    }

    fn index_delete(&self, key: &IndexKey) -> Result<(), StoreError> {
        self.delete(self.client.layout.index(key))
    }

    fn list_index(&self) -> Result<Vec<(IndexKey, Digest)>, StoreError> {
        let entries = self.call(
            "list",
            self.client.layout.index_dir(),
            |c, dir| async move {
                let keys: Vec<(IndexKey, String)> = c
                    .list(&dir)
                    .await?
                    .into_iter()
                    .filter_map(|meta| {
                        let object = meta.location.to_string();
                        c.layout.parse_index(&object).map(|key| (key, object))
                    })
                    .collect();
                futures::stream::iter(keys)
                    .map(|(key, object)| {
                        let c = c.clone();
                        async move { Ok::<_, ClientError>((key, c.get(&object).await?)) }
                    })
                    .buffered(INDEX_READS_IN_FLIGHT)
                    .try_collect::<Vec<_>>()
                    .await
            },
        )?;
        let mut index = Vec::with_capacity(entries.len());
        for (key, content) in entries {
            // An entry deleted since the listing is simply not listed.
            if let Some(content) = content {
                let digest = self.parse_entry(&key, &content)?;
                index.push((key, digest));
            }
        }
        Ok(index)
    }
}
