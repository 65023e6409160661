//! The node boundary: what the lifecycle server asks of a node agent ([`NodeAgent`]), what a
//! node asks of the control plane ([`control`]), and the data both carry ([`wire`],
//! [`recipe`]). The server depends on this crate only, never on the runtime or the node
//! agent: `fastbox up` wires an in-process node in (a direct call, no extra hop); a remote
//! node implements the same trait over the network ([`remote`]).

mod agent;
pub mod control;
mod error;
pub mod membership;
pub mod recipe;
pub mod remote;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod wire;

pub use agent::NodeAgent;
pub use error::{NodeError, NodeErrorKind, NodeResult};
