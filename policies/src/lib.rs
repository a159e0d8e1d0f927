//! Pure cache decisions for reprise: small inputs in, a decision out, no I/O.
//!
//! - [`gate`]: the false-hit gate run on a semantic candidate before it is served.

pub mod gate;

pub use gate::{gate, GateVerdict};
