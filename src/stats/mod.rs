//! What the served traffic adds up to, per interval.
//!
//! - [`rollup`]: a [`Rollup`] sums the requests of one interval (by outcome, tier and tenant,
//!   latency and TTFT histograms of fixed buckets ([`hist`]), savings, gate rejections, the
//!   most missed questions and most served pairs ([`topk`], Space-Saving)); merging two is
//!   adding them, so intervals and replicas combine exactly.

pub mod hist;
pub mod rollup;
pub mod topk;

pub use rollup::{Facts, PrefetchCounts, Rollup};
