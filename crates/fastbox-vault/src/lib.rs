//! The Credential Vault of one sandbox, as OpenSandbox's egress API defines it
//! (`/credential-vault` on the egress port): named credentials, whose values are write-only,
//! and bindings that say which outgoing requests (scheme, host, method, path) get which
//! credential, and how (a bearer token, basic auth, an API-key header, headers of the
//! caller's choice, or placeholders replaced in the path, query, headers or body).
//!
//! - [`wire`]: the request and answer shapes, as the API sends them.
//! - [`Vault`]: a validated vault; creation and atomic mutations (each a new revision),
//!   sanitized views that never hold a value, and the binding an outgoing request falls
//!   under.
//! - [`inject`]: what a binding does to a request's head and body.
//! - [`redact`]: secret values taken out of what comes back.
//!
//! Pure: no I/O. The values live in memory only, are never printed (`Debug` shows
//! `<redacted>`) and are wiped when dropped.

pub mod inject;
mod matching;
pub mod redact;
mod secret;
mod vault;
pub mod wire;

pub use matching::RequestTarget;
pub use secret::Secret;
pub use vault::{Binding, Vault, VaultError};
