//! What a resolution returns, and the credentials it may use.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// An image unpacked on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The rootfs directory. Shared by every user of the cache: treat it as read-only (mount
    /// it as an overlay lower layer).
    pub rootfs: PathBuf,
    /// Content address, `sha256:<hex>`: the image config digest for registry/OCI/docker images,
    /// the recipe digest for recipes, a path+mtime digest for rootfs directories.
    pub digest: String,
    /// The reference as the caller wrote it.
    pub reference: String,
    /// The normalized reference (`docker.io/library/python:3.12`, `dir:/abs/path`,
    /// `recipe:busybox`, `oci:/abs/path:tag`).
    pub canonical_reference: String,
    /// The recipe that built the rootfs, with what it resolved to
    /// (`debian-bookworm-python3.11`, `busybox-1.35.0`); `None` for images.
    pub served_by: Option<String>,
    /// Digest of the manifest the image was read from (registry and OCI sources).
    pub manifest_digest: Option<String>,
    /// Entrypoint, command, environment and working directory of the image.
    pub config: ImageRuntimeConfig,
    /// True when the rootfs was already in the cache (nothing was downloaded or built).
    pub cached: bool,
}

/// The parts of an OCI image config that say how to run it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageRuntimeConfig {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// `KEY=value` entries.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

/// Registry credentials (`image.auth` of the OpenSandbox API). Used for HTTP basic auth and as
/// the basic credentials of a bearer-token request. `Debug` never prints the password.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl RegistryAuth {
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        RegistryAuth {
            username: username.into(),
            password: password.into(),
        }
    }
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_redacts_the_password() {
        let shown = format!("{:?}", RegistryAuth::new("alice", "s3cret"));
        assert!(
            shown.contains("alice") && !shown.contains("s3cret"),
            "{shown}"
        );
    }
}
