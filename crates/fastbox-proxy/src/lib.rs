//! The data path from a public endpoint to a port inside a sandbox.
//!
//! Two concerns, shared by the lifecycle server's proxy (`/v1/sandboxes/{id}/proxy/{port}/...`)
//! and the node proxy (`{node}/{id}/{port}/...`):
//! - [`route`]: signed, expiring route credentials (OpenSandbox OSEP-0011), so an endpoint can
//!   be handed out without the API key, and the split of a path-form route into its credential
//!   and the path the sandbox sees;
//! - [`forward`]: one request forwarded to an upstream address, streaming both bodies (SSE
//!   arrives event by event) and splicing HTTP/1.1 upgrades (WebSocket).
//!
//! Architecture invariant: this crate decides nothing about who may reach which sandbox and
//! builds no HTTP error responses. Callers authenticate, resolve the sandbox's address, build a
//! [`Target`], and map [`ProxyError`] and [`RouteError`] to their own error envelope in one
//! place. It reads no environment variables and never logs paths, keys or signatures.

pub mod forward;
pub mod route;

pub use forward::{Forwarder, ForwarderConfig, ProxyError, Target};
pub use route::{RouteError, RoutePath, RouteSigner, from_b36, split_route, to_b36};
