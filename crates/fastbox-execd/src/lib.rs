//! fastbox-execd: the daemon inside every sandbox, serving the OpenSandbox execd API.
//!
//! It runs as PID 1 of the sandbox's pid namespace (or as the direct child of a tiny init),
//! starts the user's entrypoint, runs commands, sessions and code, serves files, and proxies
//! to in-sandbox ports. It is built as a static binary and injected read-only into arbitrary
//! root filesystems, so it relies on nothing there: no NSS (see [`identity`]), no DNS, no
//! shell except to run the user's commands. It is checkpointed and cloned by CRIU, so it seeds
//! nothing at start (see [`ids`]) and keeps no file open while idle; a restored clone gets its
//! own token, environment and entrypoint through a claim (see [`claim`]).

pub mod app;
pub mod auth;
pub mod claim;
pub mod cli;
pub mod clock;
pub mod code;
pub mod code_port;
pub mod command;
pub mod entrypoint;
pub mod env;
pub mod error;
pub mod extract;
pub mod files;
pub mod identity;
pub mod ids;
pub mod isolated;
pub mod lines;
pub mod logbuf;
pub mod metrics;
pub mod output;
pub mod process;
pub mod proxy;
pub mod pty;
pub mod query;
pub mod reaper;
pub mod repl;
pub mod session;
pub mod shutdown;
pub mod sse;
pub mod state;
pub mod tenancy;

pub use app::app;
pub use state::{AppState, Config};
