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

pub use reprise::config::{
    BackendConfig, BackendKind, Config, DegradeStep, RouteConfig, TenantConfig,
};
pub use reprise::harness::{
    build_replica, load_embedder, sse_data, sse_text, start_app, start_configured, start_redis,
    start_replica, start_routed, Server,
};
pub use reprise::headers::{CACHE_HEADER, DEFAULT_NAMESPACE, NAMESPACE_HEADER, SIMILARITY_HEADER};
pub use reprise::prefetch::{PrefetchConfig, PrefetchStats, Prefetcher};
pub use reprise::state::embedder_config;
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

/// The threshold the anonymous tenant of a server is served at under `delta` with no rule
/// (the learned one, from the verdicts the server holds now).
pub fn learned_threshold(state: &AppState, delta: f64) -> Learned {
    let s = &state.config.semantic;
    let scope = reprise_policies::semantic::scope(None);
    state
        .bounds
        .threshold("", &scope, delta, s.threshold, s.min_threshold)
}

/// How many index rebuilds from Redis a replica has finished.
pub fn rebuilds(state: &AppState) -> u64 {
    state.rebuilds.load(Ordering::SeqCst)
}

/// The prefetcher of a server, when prefetch is on.
pub fn prefetcher(state: &AppState) -> Option<&Prefetcher> {
    state.prefetch.as_deref()
}

/// Which half of a tuning / held-out split an item falls in (`true`: the tuning half), by a
/// hash of `seed` and the item's `parts`: fixed for a seed, independent of file order, about
/// half each.
pub fn in_tuning_half(seed: u64, parts: &[&str]) -> bool {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            h.update(&[0]);
        }
        h.update(part.as_bytes());
    }
    h.finalize().as_bytes()[0] & 1 == 0
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

/// Why a benchmark's request failed. Failed requests are counted and printed per side, never
/// timed and never counted as served or not served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The request or its body broke (refused, reset, timed out, a stream cut short).
    Transport,
    /// An answer with a status the benchmark did not expect (not a success).
    Status,
    /// Any other error of the operation measured (an embedding that failed).
    Other,
}

/// Failed requests of one side, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Failures {
    /// Transport failures.
    pub transport: u64,
    /// Answers with an unexpected status.
    pub status: u64,
    /// Other errors.
    pub other: u64,
}

impl Failures {
    /// Counts one failure.
    pub fn count(&mut self, f: Failure) {
        match f {
            Failure::Transport => self.transport += 1,
            Failure::Status => self.status += 1,
            Failure::Other => self.other += 1,
        }
    }

    /// Every failure.
    pub fn total(&self) -> u64 {
        self.transport + self.status + self.other
    }

    /// Adds `other`'s counts.
    pub fn add(&mut self, other: Failures) {
        self.transport += other.transport;
        self.status += other.status;
        self.other += other.other;
    }

    /// As JSON, for the benchmarks' result files.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "transport": self.transport, "status": self.status, "other": self.other,
        })
    }
}

impl std::fmt::Display for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed ({} transport, {} bad status, {} other)",
            self.total(),
            self.transport,
            self.status,
            self.other
        )
    }
}

/// Reads an answer to its end: its headers and body when the status is a success, else the
/// failure (the body of a failed answer is read too, so the connection can be reused).
pub async fn read_answer(
    sent: reqwest::Result<reqwest::Response>,
) -> Result<(reqwest::header::HeaderMap, axum::body::Bytes), Failure> {
    let r = sent.map_err(|_| Failure::Transport)?;
    let ok = r.status().is_success();
    let headers = r.headers().clone();
    let body = r.bytes().await.map_err(|_| Failure::Transport)?;
    if ok {
        Ok((headers, body))
    } else {
        Err(Failure::Status)
    }
}

/// Reads an answer to a request sent with `Cache-Control: only-if-cached` to its end: its
/// `x-reprise-cache` outcome, `not_cached` for the 504 of a miss, else the failure.
pub async fn read_cached_outcome(
    sent: reqwest::Result<reqwest::Response>,
) -> Result<String, Failure> {
    let r = sent.map_err(|_| Failure::Transport)?;
    let status = r.status();
    let outcome = r
        .headers()
        .get(CACHE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    r.bytes().await.map_err(|_| Failure::Transport)?;
    if status.is_success() {
        Ok(outcome)
    } else if status == reqwest::StatusCode::GATEWAY_TIMEOUT {
        Ok("not_cached".to_string())
    } else {
        Err(Failure::Status)
    }
}

/// Latency samples of one side: only requests that succeeded are timed; the others are
/// counted in `failed`.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    /// Seconds per request that succeeded.
    pub lat: Vec<f64>,
    /// Wall time the samples took.
    pub wall: f64,
    /// Requests that failed (not in `lat`).
    pub failed: Failures,
}

impl Samples {
    /// Requests that succeeded, per second.
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
        self.failed.add(other.failed);
    }
}

/// A field of `/proc/self/status` given in kB (`VmRSS:`, `VmHWM:`), in bytes; `None` when
/// the field is absent or unreadable.
pub fn status_bytes(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Resident and peak resident memory of this process, bytes (`/proc/self/status`; 0 where
/// it cannot be read).
pub fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        status_bytes(&status, "VmRSS:").unwrap_or(0),
        status_bytes(&status, "VmHWM:").unwrap_or(0),
    )
}

/// Bytes the allocator has handed out and not taken back (glibc's `mallinfo2`, over every
/// arena, mapped chunks included): the live heap. RSS minus this is what malloc keeps for
/// reuse (free chunks, fragmentation) plus code and stacks. 0 where the C library is not
/// glibc.
pub fn heap_in_use() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and only reads malloc's own statistics
        // (under its arenas' locks).
        #[allow(unsafe_code)]
        let m = unsafe { libc::mallinfo2() };
        (m.uordblks + m.hblkhd) as u64
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        0
    }
}

/// Bytes as MiB.
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
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

/// The scripted backend's answer for question benchmarks: `You asked: <question>` (so an
/// answer names the question it was generated for) and `words` words of padding.
pub fn naming_reply(words: usize) -> String {
    let padding: Vec<&str> = "Open the editor and follow these steps to get it done quickly"
        .split(' ')
        .cycle()
        .take(words)
        .collect();
    format!("You asked: {{prompt}}\n{}", padding.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server answering 200 (with an outcome), 500, and the 504 of an `only-if-cached`
    /// miss, and an address nothing listens on.
    async fn answers() -> (String, String) {
        use axum::http::StatusCode;
        use axum::routing::get;
        let router = axum::Router::new()
            .route("/ok", get(|| async { ([(CACHE_HEADER, "exact")], "body") }))
            .route(
                "/fail",
                get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "no") }),
            )
            .route(
                "/miss",
                get(|| async { (StatusCode::GATEWAY_TIMEOUT, "not cached") }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let nobody = closed.local_addr().unwrap();
        drop(closed);
        (format!("http://{addr}"), format!("http://{nobody}/ok"))
    }

    #[test]
    fn status_fields_are_read_in_bytes() {
        let status = "Name:\treprise-bench\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\nVmRSS:\t    1536 kB\nThreads:\t4\n";
        assert_eq!(status_bytes(status, "VmRSS:"), Some(1536 * 1024));
        assert_eq!(status_bytes(status, "VmHWM:"), Some(2048 * 1024));
        assert_eq!(status_bytes(status, "VmSwap:"), None);
        assert_eq!(status_bytes("VmRSS:\tlots kB\n", "VmRSS:"), None);
        assert_eq!(status_bytes("", "VmRSS:"), None);
    }

    #[tokio::test]
    async fn failures_are_told_from_answers() {
        let (base, nobody) = answers().await;
        let client = reqwest::Client::new();
        let get = |path: &str| client.get(format!("{base}{path}")).send();

        let (headers, body) = read_answer(get("/ok").await).await.unwrap();
        assert_eq!(headers[CACHE_HEADER], "exact");
        assert_eq!(&body[..], b"body");
        assert_eq!(read_answer(get("/fail").await).await, Err(Failure::Status));
        assert_eq!(read_answer(get("/miss").await).await, Err(Failure::Status));
        let refused = client.get(&nobody).send().await;
        assert_eq!(read_answer(refused).await, Err(Failure::Transport));

        // Under only-if-cached a 504 is a miss, not a failure.
        assert_eq!(
            read_cached_outcome(get("/ok").await).await,
            Ok("exact".into())
        );
        assert_eq!(
            read_cached_outcome(get("/miss").await).await,
            Ok("not_cached".into())
        );
        assert_eq!(
            read_cached_outcome(get("/fail").await).await,
            Err(Failure::Status)
        );
        let refused = client.get(&nobody).send().await;
        assert_eq!(read_cached_outcome(refused).await, Err(Failure::Transport));

        let mut samples = Samples::default();
        samples.failed.count(Failure::Transport);
        samples.failed.count(Failure::Status);
        let mut more = Samples::default();
        more.lat.push(0.001);
        more.failed.count(Failure::Status);
        samples.merge(more);
        assert_eq!(samples.lat.len(), 1, "failures are never timed");
        assert_eq!((samples.failed.transport, samples.failed.status), (1, 2));
        assert_eq!(samples.failed.total(), 3);
    }
}
