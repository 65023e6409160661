//! The S3-compatible artifact store: DART's origin in a cluster.
//!
//! [`S3Store`] implements [`fastbox_artifact::ArtifactStore`], the synchronous store contract
//! of `fastbox-artifact`, against any S3-compatible server (AWS S3, s3s-fs, moto, ...), with
//! the local store's layout under a bucket prefix ([`Layout`]):
//!
//! ```no_run
//! use fastbox_artifact::{ArtifactStore, Digest};
//! use fastbox_s3::{S3Config, S3Store};
//!
//! let config = S3Config::from_url("s3://artifacts/fastbox?endpoint=http://127.0.0.1:9000")?
//!     .with_env(|name| std::env::var(name).ok());
//! let store = S3Store::open(config)?; // clear errors: unreachable, bad credentials, no bucket
//! let block = b"hello";
//! store.put_block(&Digest::of(block), block)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Design (the full story, with the conditional-write fallback and its remaining race, is in
//! `docs/s3.md`):
//! - requests go through `object_store` (retries with backoff, listings that page, multipart
//!   parts, `If-None-Match: *` puts) plus a few signed requests of our own (`raw.rs`: the
//!   bucket check, bucket creation, the copy that refreshes a present object, the conditional
//!   completion of a multipart upload);
//! - the store owns a private tokio runtime; trait calls block the calling thread on a
//!   channel, never on `Runtime::block_on`, so they work from plain threads and from
//!   `spawn_blocking` alike (`bridge.rs`);
//! - reads are verified (`stream_block` hashes chunks as they arrive), puts are verified and
//!   create-if-absent, present objects are refreshed for garbage collection's grace period,
//!   the index create is conditional and reads its entry back, with a probed, documented
//!   fallback for servers that ignore the condition.
//!
//! Architecture invariant: like `fastbox-artifact`, this crate reads no environment variable
//! by itself ([`S3Config::with_env`] takes the lookup) and knows nothing of sandboxes.

mod bridge;
mod bucket;
mod client;
mod config;
mod index;
mod layout;
mod multipart;
mod probe;
mod put;
mod raw;
mod store;
#[cfg(test)]
mod testing;

pub use bridge::BridgeError;
pub use bucket::BucketError;
pub use client::ClientError;
pub use config::{
    ConditionalWrites, ConfigError, DEFAULT_PART_SIZE, DEFAULT_REFRESH_AFTER, DEFAULT_REGION,
    MIN_PART_SIZE, Multipart, Retries, S3Config, Timeouts,
};
pub use layout::Layout;
pub use raw::RawError;
pub use store::{OpenError, S3Store, create_bucket};
