//! The one error type of the crate: every variant says what failed and, where a user can act,
//! what to do about it. Messages are self-contained (the underlying I/O or transport cause is
//! part of the text, not a `source()`), so printing the chain prints each cause once.

use std::path::PathBuf;

/// Why an image could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The reference is not one of the forms of `docs/images.md`.
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference { reference: String, reason: String },

    /// The configuration is inconsistent (checked once by `ImageCache::try_new`).
    #[error("invalid image config: {0}")]
    Config(String),

    /// The registry, archive or layout has no such image (404, unknown manifest, missing tag).
    #[error("image {reference} not found: {detail}")]
    NotFound { reference: String, detail: String },

    /// The registry wants credentials and none were given.
    #[error(
        "registry {registry} requires authentication for {repository} (or the repository does not exist): pass image.auth credentials"
    )]
    AuthRequired {
        registry: String,
        repository: String,
    },

    /// The registry (or its token service) rejected the given credentials.
    #[error(
        "registry {registry} rejected the credentials of user {username:?} for {repository} (http {status}): check image.auth"
    )]
    AuthFailed {
        registry: String,
        repository: String,
        username: String,
        status: u16,
    },

    /// No connection to the registry (DNS, refused, timeout, TLS).
    #[error("registry {registry} is unreachable at {url}: {reason}")]
    Unreachable {
        registry: String,
        url: String,
        reason: String,
    },

    /// The registry, its token realm or a redirect leads to an address no pull may connect
    /// to (a private, loopback, link-local or other special network the operator did not
    /// allow). Refused before any connection is made.
    #[error("registry {registry}: refusing to connect to {target} for {via}: {reason}")]
    AddressRefused {
        registry: String,
        /// The refused address, or host (address), or host:port.
        target: String,
        /// `the registry`, `its token realm`, `a redirect`.
        via: String,
        reason: String,
    },

    /// The registry answered with something this client does not understand.
    #[error("registry {registry} answered http {status} for {url}: {detail}")]
    Registry {
        registry: String,
        url: String,
        status: u16,
        detail: String,
    },

    /// Content did not hash to the digest that names it.
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },

    /// A manifest, config or layer of a kind this crate does not unpack.
    #[error("unsupported media type {media_type:?} for {what}")]
    UnsupportedMediaType { what: String, media_type: String },

    /// A multi-platform image without a manifest for the host platform.
    #[error("image {reference} has no manifest for platform {platform} (available: {available})")]
    NoMatchingPlatform {
        reference: String,
        platform: String,
        available: String,
    },

    /// Malformed image metadata (JSON, layout, archive structure).
    #[error("invalid image {what}: {reason}")]
    InvalidImage { what: String, reason: String },

    /// A layer entry that would write outside the rootfs (or is otherwise unsafe).
    #[error("unsafe entry {entry:?} in layer {layer}: {reason}")]
    UnsafePath {
        layer: String,
        entry: String,
        reason: String,
    },

    /// An I/O failure while applying a layer entry.
    #[error("cannot unpack entry {entry:?} of layer {layer}: {error}")]
    Unpack {
        layer: String,
        entry: String,
        error: std::io::Error,
    },

    /// `debootstrap` exited with an error; `log_tail` holds the end of its output.
    #[error(
        "debootstrap failed ({status}) building recipe {recipe}, full log at {log}; log tail:\n{log_tail}"
    )]
    Debootstrap {
        recipe: String,
        status: String,
        log: PathBuf,
        log_tail: String,
    },

    /// A recipe step other than debootstrap failed (missing tool, busybox not static...).
    #[error("cannot build recipe {recipe}: {reason}")]
    Recipe { recipe: String, reason: String },

    /// No Debian mirror could be derived from the apt configuration.
    #[error(
        "no debian mirror found in the apt sources ({searched}); set debian_mirror in the image config"
    )]
    NoDebianMirror { searched: String },

    /// A filesystem operation of the cache or of a local image source failed.
    #[error("{what} {}: {error}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        error: std::io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |error| ImageError::Io { what, path, error }
    }

    pub(crate) fn invalid_image(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        ImageError::InvalidImage {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}
