//! The async core: one bucket prefix, the object operations every store call is made of.
//!
//! [`Client`] wraps object_store's S3 client (gets, heads, puts, deletes, listings, multipart
//! parts; its retries with backoff: 5xx, 429, timeouts and connection errors, never other 4xx)
//! and the [`RawClient`] for the few requests object_store lacks. Absence is a value here
//! (`Option`), not an error; the store turns it into the contract's errors. The write paths
//! live beside it: `put.rs` (create-if-absent objects, refresh), `index.rs` (the conditional
//! index and its fallback), `multipart.rs`, `probe.rs`.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::AmazonS3;
use object_store::client::HttpErrorKind;
use object_store::path::Path;
use object_store::{GetResult, ObjectMeta, ObjectStore, ObjectStoreExt};

use crate::config::Multipart;
use crate::layout::Layout;
use crate::raw::{RawClient, RawError};

/// Why an object operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// object_store's request failed (after its retries).
    #[error(transparent)]
    Store(#[from] object_store::Error),
    /// A raw request got no answer.
    #[error(transparent)]
    Raw(#[from] RawError),
    /// A raw request got an answer that means failure.
    #[error("{operation}: the server answered {answer}")]
    Answer {
        operation: &'static str,
        answer: String,
    },
    /// An object name object_store refuses (never one of ours).
    #[error("bad object key {key:?}: {reason}")]
    BadKey { key: String, reason: String },
    /// A conditional create lost to an object that kept disappearing before it was read.
    #[error("{0}")]
    Unsettled(String),
}

impl ClientError {
    /// The closest I/O error kind, for `StoreError::Io`.
    pub fn io_kind(&self) -> std::io::ErrorKind {
        use std::io::ErrorKind;
        match self {
            ClientError::Store(object_store::Error::NotFound { .. }) => ErrorKind::NotFound,
            ClientError::Store(
                object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. },
            ) => ErrorKind::PermissionDenied,
            ClientError::Raw(RawError::Transport { error, .. }) => match error.kind() {
                HttpErrorKind::Connect => ErrorKind::ConnectionRefused,
                HttpErrorKind::Timeout => ErrorKind::TimedOut,
                _ => ErrorKind::Other,
            },
            ClientError::BadKey { .. } => ErrorKind::InvalidInput,
            _ => ErrorKind::Other,
        }
    }
}

/// The S3 clients of one store and how it writes. See the module docs.
#[derive(Debug)]
pub struct Client {
    /// object_store's client.
    pub s3: AmazonS3,
    /// Signed requests object_store does not make.
    pub raw: Arc<RawClient>,
    /// Object keys.
    pub layout: Layout,
    /// Whether `If-None-Match: *` is relied on (false: the fallback).
    pub conditional: bool,
    /// When objects are uploaded in parts.
    pub multipart: Multipart,
    /// Present objects last written longer ago than this are refreshed by a put.
    pub refresh_after: Duration,
}

/// An object key as object_store's path (taken verbatim: our keys need no escaping).
pub fn path(key: &str) -> Result<Path, ClientError> {
    Path::parse(key).map_err(|e| ClientError::BadKey {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

impl Client {
    /// An object's size and modification time, None when absent.
    pub async fn head(&self, key: &str) -> Result<Option<ObjectMeta>, ClientError> {
        absent_is_none(self.s3.head(&path(key)?).await)
    }

    /// An object's bytes, None when absent.
    pub async fn get(&self, key: &str) -> Result<Option<Bytes>, ClientError> {
        match absent_is_none(self.s3.get(&path(key)?).await)? {
            Some(result) => Ok(Some(result.bytes().await?)),
            None => Ok(None),
        }
    }

    /// A byte range of an object, None when absent.
    pub async fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
    ) -> Result<Option<Bytes>, ClientError> {
        absent_is_none(self.s3.get_range(&path(key)?, range).await)
    }

    /// An object's body as a stream of chunks, None when absent.
    pub async fn open(&self, key: &str) -> Result<Option<GetResult>, ClientError> {
        absent_is_none(self.s3.get(&path(key)?).await)
    }

    /// Remove an object; an absent one is fine.
    pub async fn delete(&self, key: &str) -> Result<(), ClientError> {
        absent_is_none(self.s3.delete(&path(key)?).await).map(|_| ())
    }

    /// Every object under `dir/` (object_store pages through the listing).
    pub async fn list(&self, dir: &str) -> Result<Vec<ObjectMeta>, ClientError> {
        Ok(self.s3.list(Some(&path(dir)?)).try_collect().await?)
    }
}

/// object_store's NotFound as None.
pub fn absent_is_none<T>(result: object_store::Result<T>) -> Result<Option<T>, ClientError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(object_store::Error::NotFound { .. }) => Ok(None),
        Err(error) => Err(error.into()),
    }
}
