//! Credentials of `secureAccess` sandboxes, and the brake on guessing credentials.
//!
//! - `token`: [`AccessToken`], the per-sandbox secret an endpoint of a secure sandbox carries
//!   in its `OpenSandbox-Secure-Access` header; compared in constant time;
//! - `limiter`: [`FailureLimiter`], token buckets of failed credential checks per source
//!   address under a global ceiling. A route signature has 32 bits (OSEP-0011), so without a
//!   brake it can be found by trying.
//!
//! What a proxy does with them (which sandbox needs which credential, what to answer) is the
//! caller's decision.

mod limiter;
mod token;

pub use limiter::{FailureLimiter, FailureLimits, Limited, LimitedBy};
pub use token::{AccessToken, SECURE_ACCESS_HEADER};
