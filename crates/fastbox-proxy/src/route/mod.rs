//! Signed, expiring route credentials (OpenSandbox OSEP-0011).
//!
//! An endpoint handed out with `expires` carries a credential instead of requiring the API
//! key: the expiry time in base 36 and a 9-character signature over sandbox id, port and
//! expiry (see [`RouteSigner`]). Anyone holding the URL may reach that one port of that one
//! sandbox until the expiry; the proxy verifies the credential on every request.
//!
//! - `b36`: the canonical base-36 form of expiry times;
//! - `signer`: signing and verifying, byte for byte as OSEP-0011 defines them;
//! - `key_file`: the signing keys on disk, created on first start and reused afterwards,
//!   rotated by adding a key (which signs from then on) and retiring old ones; [`RouteKeys`]
//!   follows the file in a running server;
//! - `path`: telling a credential-carrying path from a plain one.
//!
//! Credentials and secrets are never logged, and `Debug` of a signer omits its secret.

mod b36;
mod key_file;
mod path;
mod signer;

use std::io;
use std::path::PathBuf;

pub use b36::{from_b36, to_b36};
pub use key_file::{RELOAD_EVERY, RouteKeys, install_keys, retire_key, rotate_key};
pub use path::{RoutePath, split_route};
pub use signer::RouteSigner;

/// What went wrong with a route credential or the signing key.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The expiry or signature does not have the OSEP-0011 shape.
    #[error("malformed route credential")]
    Malformed,
    /// The signature names a key this signer does not hold.
    #[error("route credential signed with unknown key {0:?}")]
    UnknownKey(char),
    /// The signature does not match sandbox id, port and expiry.
    #[error("route credential signature mismatch")]
    BadSignature,
    /// The credential was genuine but its expiry time has passed.
    #[error("route credential expired at {expires}")]
    Expired {
        /// Expiry time, Unix seconds.
        expires: u64,
    },
    /// The credential was genuine but expires further ahead than routes are ever issued.
    #[error("route credential expires at {expires}, more than {max_secs} s ahead")]
    TooFarAhead {
        /// Expiry time, Unix seconds.
        expires: u64,
        /// The longest lifetime accepted, seconds.
        max_secs: u64,
    },
    /// A keyring without keys.
    #[error("no route signing key")]
    NoKeys,
    /// Two keys of one keyring share a key id.
    #[error("route key id {0:?} is used twice")]
    DuplicateKeyId(char),
    /// A key file change that would leave no key to sign with, or retire the signing key.
    #[error("{0}")]
    Rotation(String),
    /// A key id outside `0-9a-z`.
    #[error("invalid route key id {0:?} (want one of 0-9a-z)")]
    InvalidKeyId(char),
    /// A secret too short to be safe or too long for the length prefix.
    #[error("route secret of {0} bytes (want 16 to 4096)")]
    InvalidSecretLength(usize),
    /// Reading or writing the key file failed.
    #[error("cannot access route key file {path}")]
    KeyFileIo {
        /// The key file (or its temporary sibling).
        path: PathBuf,
        /// The failed operation.
        source: io::Error,
    },
    /// The key file exists but cannot be used; it is never replaced automatically.
    #[error("route key file {path} is unusable: {reason}")]
    KeyFileInvalid {
        /// The key file.
        path: PathBuf,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The kernel's random source failed while generating a key.
    #[error("cannot generate a route key")]
    Random(#[source] getrandom::Error),
}
