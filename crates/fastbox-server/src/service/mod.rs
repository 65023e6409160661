//! The lifecycle service: sandbox records, their state machine, and the tasks that converge
//! them (create, delete, expiry, recovery after a restart).

mod converge;
mod lifecycle;
pub mod plan;
mod templates;

pub use lifecycle::{EndpointQuery, Health, Lifecycle, ListQuery, random_token};
