//! The data path from a public endpoint to a port inside a sandbox.
//!
//! Three concerns, shared by the lifecycle server's proxy
//! (`/v1/sandboxes/{id}/proxy/{port}/...`) and the node proxy (`{node}/{id}/{port}/...`):
//! - [`route`]: signed, expiring route credentials (OpenSandbox OSEP-0011), so an endpoint can
//!   be handed out without the API key, and the split of a path-form route into its credential
//!   and the path the sandbox sees;
//! - [`access`]: the per-sandbox access token of `secureAccess` sandboxes
//!   (`OpenSandbox-Secure-Access`) and the rate limit on failed credential checks;
//! - [`forward`]: one request forwarded to an upstream address, streaming both bodies (SSE
//!   arrives event by event) and splicing HTTP/1.1 upgrades (WebSocket).
//!
//! Architecture invariant: this crate decides nothing about who may reach which sandbox and
//! builds no HTTP error responses. Callers authenticate, resolve the sandbox's address, build a
//! [`Target`], and map [`ProxyError`] and [`RouteError`] to their own error envelope in one
//! place. It reads no environment variables and never logs paths, keys or signatures.

pub mod access;
pub mod forward;
pub mod route;

pub use access::{AccessToken, FailureLimiter, FailureLimits, Limited, SECURE_ACCESS_HEADER};
pub use forward::{Forwarder, ForwarderConfig, ProxyError, Target};
pub use route::{
    RouteError, RouteKeys, RoutePath, RouteSigner, from_b36, install_keys, retire_key, rotate_key,
    split_route, to_b36,
};
