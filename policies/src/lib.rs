//! Pure cache decisions for reprise: small inputs in, a decision out, no I/O.
//!
//! - [`cache`]: may a request read or write the cache, given its `Cache-Control`?
//! - [`semantic`]: the effective semantic policy for a namespace and model.
//! - [`gate`]: the false-hit gate run on a semantic candidate before it is served.

pub mod cache;
pub mod cacheable;
pub mod gate;
pub mod prefetch;
pub mod semantic;

pub use gate::{gate, GateVerdict};
