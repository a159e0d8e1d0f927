//! Cache tiers for reprise.
//!
//! - [`entry`]: what is cached — a finished answer with its metadata — and its id.
//! - [`memory`]: the in-process tier (moka), bounded by bytes.
//! - [`semantic`]: the near-duplicate index (hnsw_rs), partitioned by everything that must
//!   match exactly.
//!
//! This crate knows nothing of HTTP or of the OpenAI wire format: keys arrive as 32-byte
//! digests computed by the server.

pub mod entry;
pub mod memory;
pub mod semantic;

pub use entry::{now_ms, Digest, Entry, EntryId, Origin};
pub use memory::{EvictionHook, MemoryTier};
