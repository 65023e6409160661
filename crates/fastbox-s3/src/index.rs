//! The conditional index create, and its fallback where the server ignores the condition.
//!
//! Both modes end the same way: after writing its entry, a creator **reads it back**, and only
//! its own content there means `Created`; someone else's content means that writer came later
//! and won (last writer wins on S3), and the creator reports `Exists(theirs)`.
//!
//! **Conditional** (the server honours `If-None-Match: *`): the entry is written only if the
//! key has none; a `412` means another writer was first, whose entry is read and returned.
//! On a server whose condition is atomic (AWS S3) exactly one of several concurrent creators
//! is told `Created` and the read-back always finds its own entry. The read-back is what
//! keeps servers that check the condition *before* writing, not atomically with it (s3s-fs
//! 0.14 and moto 5.2 do; `docs/s3.md`), no worse than the fallback.
//!
//! **Fallback** (`conditional_writes: off`, or the probe at open found the condition
//! ignored): read the entry; if there is one, it wins. Otherwise write ours plainly and read
//! it back. Of two racing creators at most one reads back the other's entry, so at most one
//! of them removes anything. The race that remains (`docs/s3.md`): a creator may read back
//! its own entry and be overwritten afterwards; it reports `Created`, removes nothing, and its
//! manifest is left unreferenced for garbage collection; with three or more concurrent
//! creators, one may read back an entry that a later one overwrites, which is the cross-key
//! race of `docs/artifacts.md` (a dangling reference, reported as `NotFound`, never bad
//! bytes).
//!
//! In both modes an entry that disappears before it is read (deleted concurrently) makes the
//! create start over, a bounded number of times.

use bytes::Bytes;

use crate::client::{Client, ClientError};
use crate::put::Written;

/// How often a create starts over when the entry disappears before it is read.
const ATTEMPTS: usize = 16;

/// What a conditional create did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The entry is ours.
    Created,
    /// The key has an entry: its content.
    Exists(Bytes),
}

impl Client {
    /// Create the object `key` with `content` unless it exists. See the module docs.
    pub async fn create_if_absent(&self, key: &str, content: Bytes) -> Result<Claim, ClientError> {
        for _ in 0..ATTEMPTS {
            if !self.conditional
                && let Some(existing) = self.get(key).await?
            {
                return Ok(Claim::Exists(existing));
            }
            // In the fallback the write is plain; `write` reports Created then.
            if self.write(key, content.clone(), self.conditional).await? == Written::Exists {
                match self.get(key).await? {
                    Some(existing) => return Ok(Claim::Exists(existing)),
                    None => continue, // deleted before we could read it
                }
            }
            match self.get(key).await? {
                Some(read) if read == content => return Ok(Claim::Created),
                Some(theirs) => return Ok(Claim::Exists(theirs)),
                None => continue,
            }
        }
        Err(ClientError::Unsettled(format!(
            "create {key}: the entry kept being created and deleted concurrently"
        )))
    }
}
