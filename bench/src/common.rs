//! What the modes share: latency samples and percentiles, and every item of the server crate
//! (`reprise`) the benchmarks use.
//!
//! The modes reach the server only through this module: its `pub use` block and the small
//! functions below that read a server's state are the one place naming the server's modules
//! and fields (servers themselves are built by `reprise::harness`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use reprise::key::exact_key;
use reprise::openai::Endpoint;
use reprise::request::{parse, Request};
use reprise::state::AppState;
use reprise_cache::redis::RedisTier;
use reprise_cache::semantic::SemanticIndex;
use reprise_cache::{Digest, Store};

pub use reprise::config::{BackendKind, Config, TenantConfig, TenantPolicy};
pub use reprise::harness::{
    build_replica, load_embedder, sse_data, sse_text, start_app, start_configured, start_redis,
    start_replica, Server,
};
pub use reprise::headers::{CACHE_HEADER, DEFAULT_NAMESPACE, NAMESPACE_HEADER, SIMILARITY_HEADER};
pub use reprise::prefetch::{PrefetchConfig, PrefetchStats, Prefetcher};
pub use reprise_policies::bound::Learned;

/// The semantic index of a server, when its semantic tier is on.
pub fn semantic_index(state: &AppState) -> Option<Arc<SemanticIndex>> {
    state.store.index().cloned()
}

/// The cache of a server (its memory tier answers `get_by_key` and `entry_count`).
pub fn store(state: &AppState) -> &Store {
    &state.store
}

/// The Redis tier (L2) of a server, when it has one.
pub fn redis_tier(state: &AppState) -> Option<&RedisTier> {
    state.store.redis()
}

/// The threshold the anonymous tenant of a server is served at under `delta` (the learned
/// one, from the verdicts the server holds now).
pub fn learned_threshold(state: &AppState, delta: f64) -> Learned {
    let s = &state.config.semantic;
    state
        .bounds
        .threshold("", delta, s.threshold, s.min_threshold)
}

/// How many index rebuilds from Redis a replica has finished.
pub fn rebuilds(state: &AppState) -> u64 {
    state.rebuilds.load(Ordering::SeqCst)
}

/// The prefetcher of a server, when prefetch is on.
pub fn prefetcher(state: &AppState) -> Option<&Prefetcher> {
    state.prefetch.as_deref()
}

/// The exact key the server files a chat completion `body` under in the default namespace.
pub fn chat_exact_key(body: &[u8]) -> anyhow::Result<Digest> {
    let Request::Cacheable(probe) =
        parse(Endpoint::Chat, body).map_err(|e| anyhow::anyhow!("{e}"))?
    else {
        anyhow::bail!("a plain chat body was not cacheable");
    };
    Ok(exact_key(DEFAULT_NAMESPACE, Endpoint::Chat, &probe.req))
}

/// Latency samples of one side.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    /// Seconds per request.
    pub lat: Vec<f64>,
    /// Wall time the samples took.
    pub wall: f64,
}

impl Samples {
    /// Requests per second.
    pub fn throughput(&self) -> f64 {
        self.lat.len() as f64 / self.wall.max(1e-9)
    }

    /// The `p`-th percentile in seconds (p in 0..=100).
    pub fn pct(&self, p: f64) -> f64 {
        percentile(&self.lat, p)
    }

    /// Adds `other`'s samples and wall time to these.
    pub fn merge(&mut self, other: Samples) {
        self.lat.extend(other.lat);
        self.wall += other.wall;
    }
}

/// The `p`-th percentile of unsorted samples.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let idx = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[idx.min(s.len() - 1)]
}
