//! Pure cache decisions for reprise: small inputs in, a decision out, no I/O.
//!
//! The proxy gathers the facts (headers, request fields, clock, counters) and asks this
//! crate what to do with them:
//!
//! - [`cache`]: the request's `Cache-Control` directives, whether it may read or write the
//!   cache, and how old an answer it accepts.
//! - [`cacheable`]: whether a request asks for more than a cached text answer can give (and
//!   so goes upstream as it came).
//! - [`semantic`]: the effective semantic policy for a namespace and model.
//! - [`gate`](mod@gate): the false-hit gate run on a semantic candidate before it is served.
//! - [`prefetch`]: the budgets of background generation.
//! - [`bound`]: similarity thresholds learned from verdicts under an error bound.
//! - [`standalone`]: whether a conversation's last message stands on its own.

pub mod bound;
pub mod cache;
pub mod cacheable;
pub mod gate;
pub mod prefetch;
pub mod semantic;
pub mod standalone;

pub use gate::{gate, GateVerdict};
