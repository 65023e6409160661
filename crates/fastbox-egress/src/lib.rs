//! Egress policy for sandboxes (work in progress).

pub mod policy;
