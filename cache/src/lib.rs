//! Cache tiers for reprise.
//!
//! - [`entry`]: what is cached — a finished answer with its metadata — and its id.
//! - [`memory`]: the in-process tier (moka), bounded by bytes; [`shares`]: that budget
//!   shared out among pools (tenants), so one pool's flood evicts only its own entries.
//! - [`redis`]: the shared tier (L2) in Redis, with replication events between replicas.
//! - [`semantic`]: the near-duplicate index (hnsw_rs), partitioned by everything that must
//!   match exactly.
//! - [`vector`]: a stored embedding (half floats, shared by the entry and the index).
//! - [`store`]: the one door to all three: lookups with promotion from L2, writes, aliases,
//!   installs of replicated entries, removal.
//!
//! This crate knows nothing of HTTP or of the OpenAI wire format: keys arrive as 32-byte
//! digests computed by the server.

pub mod entry;
pub mod memory;
pub mod redis;
pub mod semantic;
pub mod shares;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod vector;

pub use entry::{now_ms, Digest, Entry, EntryId, Origin};
pub use memory::{EvictionHook, IndexCharge, MemoryTier, ITEM_OVERHEAD};
pub use shares::MemoryShares;
pub use store::{ByKey, DeleteFilter, Probe, Store};
pub use vector::Vector;
