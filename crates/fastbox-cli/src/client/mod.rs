//! The client commands of `fastbox sandbox` (create, ls, get, exec, cp, cat, logs, kill): they
//! talk to a fastbox server, or any OpenSandbox-compatible one, through the lifecycle API and
//! each sandbox's execd, exactly as other clients do. See `docs/cli.md`.
//!
//! - `connection`: which server and API key (flags, environment, the local key file);
//! - `http`: sending requests, error replies and unreachable servers;
//! - `api`: the typed lifecycle API client; `execd`: one sandbox's execd;
//! - `commands`, `exec`, `files`: the verbs; `wait`, `render`, `quote`, `multipart`, `args`:
//!   what they share.

pub mod api;
pub mod args;
pub mod commands;
pub mod connection;
pub mod exec;
pub mod execd;
pub mod files;
pub mod http;
pub mod multipart;
pub mod quote;
pub mod render;
pub mod wait;

pub use commands::{CreateArgs, GetArgs, KillArgs, LogsArgs, LsArgs, create, get, kill, logs, ls};
pub use connection::ServerArgs;
pub use exec::{ExecArgs, exec};
pub use files::{CatArgs, CpArgs, cat, cp};
