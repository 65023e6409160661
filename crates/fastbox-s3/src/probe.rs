//! Whether the server honours `If-None-Match: *` (checked once at open with
//! `conditional_writes: auto`).
//!
//! Some S3-compatible servers accept the header and ignore it, overwriting the object (garage
//! 2.5 did, DEPENDENCIES.md). The probe writes a fresh object under `tmp/` twice with the
//! condition: a server that honours it refuses the second write. The probe object is deleted
//! afterwards (a crash may leave it; everything under `tmp/` is garbage).

use bytes::Bytes;

use crate::client::{Client, ClientError};
use crate::put::Written;

impl Client {
    /// True when a second conditional write of one key is refused. See the module docs.
    pub async fn honours_if_none_match(&self) -> Result<bool, ClientError> {
        let key = self
            .layout
            .tmp(&format!("conditional-probe-{:016x}", rand::random::<u64>()));
        let result = self.probe_twice(&key).await;
        if let Err(error) = self.delete(&key).await {
            tracing::warn!(key, %error, "could not remove the conditional-write probe");
        }
        result
    }

    async fn probe_twice(&self, key: &str) -> Result<bool, ClientError> {
        if self.write(key, Bytes::from_static(b"first"), true).await? == Written::Exists {
            // A random name already taken: the condition was evidently checked.
            return Ok(true);
        }
        let second = self.write(key, Bytes::from_static(b"second"), true).await?;
        Ok(second == Written::Exists)
    }
}
