//! Image resolution: image references to unpacked rootfs directories in a shared cache.
//!
//! The template build (DESIGN §3.1) starts here: `ImageCache::resolve` turns an image
//! reference into a rootfs directory that the runtime mounts as the lower layer of a sandbox.
//! Sources, in the order a reference is matched:
//! - `dir:/path` or `/path`: a rootfs directory, used in place;
//! - `recipe:<name>` or an offline alias (`python:3.12` by default): a rootfs built here by
//!   debootstrap (or from busybox), for machines without a container registry;
//! - `oci:`, `oci-archive:`, `docker-archive:`: images on disk;
//! - anything else: an OCI distribution registry (Docker Hub names normalized).
//!
//! Every unpacked rootfs lives in one host-wide cache keyed by content digest; concurrent
//! resolutions by several processes converge on one directory, and partial work is never
//! visible (staging + lock + atomic rename; see `cache`). Layers are unpacked without ever
//! following a symlink out of the rootfs (see `unpack`).
//!
//! Architecture invariant: this crate knows nothing of sandboxes, namespaces or templates; it
//! produces directories and reads no environment variables (all settings are `ImageConfig`).

mod apt;
pub mod auth;
mod cache;
mod config;
mod digest;
mod error;
/// Entry points of the fuzz targets (`fuzz/`); not an API.
#[doc(hidden)]
pub mod fuzzing;
mod local;
mod netguard;
mod oci;
mod progress;
mod recipe;
mod reference;
mod registry;
mod resolved;
mod unpack;

pub use cache::ImageCache;
pub use config::{BUSYBOX_ALIAS, DEFAULT_PYTHON_RECIPE, ImageConfig, host_platform};
pub use error::ImageError;
pub use netguard::{IpNet, SPECIAL_RANGES, Special, SpecialRange, classify};
pub use oci::media;
pub use progress::{NoProgress, Progress, StderrProgress};
pub use recipe::Recipe;
pub use reference::{DOCKER_HUB, ImageSource, RegistryReference};
pub use resolved::{ImageRuntimeConfig, RegistryAuth, ResolvedImage};
pub use unpack::LayerStats;
