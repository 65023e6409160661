//! Puts of content-addressed objects: create-if-absent, and the refresh of present ones.
//!
//! A put first asks whether the object is there (`HEAD`), which costs one small request and
//! saves uploading a block the store already has (a publish of a snapshot finds most of its
//! template's blocks present):
//!
//! - **present, right size**: nothing is uploaded; the put reports `AlreadyPresent`. If the
//!   object was last written longer ago than `refresh_after`, it is copied onto itself
//!   (`CopyObject` with `x-amz-metadata-directive: REPLACE`, done inside the server), which
//!   sets its modification time to now, so a garbage collector's grace period protects a
//!   publish that references it. S3 has no cheaper "touch". If the object vanished between
//!   the `HEAD` and the copy (a collector removed it), it is written again.
//! - **present, wrong size**: a damaged object; it is overwritten and the put reports
//!   `AlreadyPresent` (it was referenced before; never report it as this writer's).
//! - **absent**: written with `If-None-Match: *` when the server honours it (a `412` means a
//!   concurrent writer got there first: `AlreadyPresent`), so `Added` goes to one writer
//!   where the server checks the condition atomically; in the fallback mode written plainly, and `Added` may go to several concurrent
//!   writers of the same content (see `docs/s3.md` for why that is safe).
//!
//! Objects above the multipart threshold go through `multipart.rs`, with the same condition on
//! the completing request.

use std::time::SystemTime;

use bytes::Bytes;
use fastbox_artifact::Stored;
use object_store::{ObjectMeta, ObjectStore, PutMode, PutOptions};

use crate::client::{Client, ClientError, path};
use crate::raw::{Method, RawRequest, StatusCode};

/// What one write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The object was written.
    Created,
    /// A conditional write found the object present; nothing was written.
    Exists,
}

impl Client {
    /// Store `bytes` under `key` unless an object of that size is there. See the module docs.
    pub async fn put_object(&self, key: &str, bytes: Bytes) -> Result<Stored, ClientError> {
        match self.head(key).await? {
            Some(meta) if meta.size == bytes.len() as u64 => self.refresh(key, &meta, bytes).await,
            Some(meta) => {
                tracing::warn!(
                    key,
                    size = meta.size,
                    expected = bytes.len(),
                    "stored object has the wrong size; replacing it"
                );
                self.write(key, bytes, false).await?;
                Ok(Stored::AlreadyPresent)
            }
            None => self.create(key, bytes).await,
        }
    }

    /// Write an object found absent.
    async fn create(&self, key: &str, bytes: Bytes) -> Result<Stored, ClientError> {
        Ok(match self.write(key, bytes, self.conditional).await? {
            Written::Created => Stored::Added,
            Written::Exists => Stored::AlreadyPresent,
        })
    }

    /// One write of a whole object: in parts above the multipart threshold; with
    /// `if_absent`, conditional on the key having no object (`If-None-Match: *`).
    pub async fn write(
        &self,
        key: &str,
        bytes: Bytes,
        if_absent: bool,
    ) -> Result<Written, ClientError> {
        if bytes.len() > self.multipart.threshold {
            return self.write_multipart(key, bytes, if_absent).await;
        }
        let mode = if if_absent {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let options = PutOptions {
            mode,
            ..PutOptions::default()
        };
        match self.s3.put_opts(&path(key)?, bytes.into(), options).await {
            Ok(_) => Ok(Written::Created),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(Written::Exists),
            Err(error) => Err(error.into()),
        }
    }

    /// A present object: copy it onto itself if it is older than `refresh_after`.
    async fn refresh(
        &self,
        key: &str,
        meta: &ObjectMeta,
        bytes: Bytes,
    ) -> Result<Stored, ClientError> {
        let modified: SystemTime = meta.last_modified.into();
        let age = SystemTime::now()
            .duration_since(modified)
            .unwrap_or_default();
        if age < self.refresh_after {
            return Ok(Stored::AlreadyPresent);
        }
        let request = RawRequest::new(Method::PUT, Some(key))
            .header("x-amz-copy-source", self.raw.copy_source(key))
            .header("x-amz-metadata-directive", "REPLACE");
        let response = self.raw.send(&request).await?;
        if response.status.is_success() && response.error_code().is_none() {
            return Ok(Stored::AlreadyPresent);
        }
        if response.status == StatusCode::NOT_FOUND {
            tracing::debug!(
                key,
                "object removed while it was refreshed; writing it again"
            );
            return self.create(key, bytes).await;
        }
        Err(ClientError::Answer {
            operation: "refresh (copy onto itself)",
            answer: response.describe(),
        })
    }
}
