//! Helpers shared by the Redis tier's tests: a counters-only metrics recorder, a tier on a
//! test server, entries and digests, the next replication event, a raw connection.

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use parking_lot::Mutex;
use reprise_cache::redis::{RedisConfig, RedisTier, ReplicationEvent, ReplicationStream};
use reprise_cache::{now_ms, Digest, Entry, EntryId, Origin, Vector};

/// A recorder that only keeps counters, so tests can read `reprise_redis_skipped_total`.
#[derive(Default)]
pub struct Counters(Mutex<HashMap<String, Arc<TestCounter>>>);

#[derive(Default)]
pub struct TestCounter(AtomicU64);

impl CounterFn for TestCounter {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }
    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let c = self
            .0
            .lock()
            .entry(key.name().to_string())
            .or_default()
            .clone();
        Counter::from_arc(c)
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

/// The process-wide recorder (installed before any tier is created).
pub fn counters() -> &'static Counters {
    static RECORDER: OnceLock<&'static Counters> = OnceLock::new();
    RECORDER.get_or_init(|| {
        let r: &'static Counters = Box::leak(Box::default());
        metrics::set_global_recorder(r).expect("no other recorder in this test binary");
        r
    })
}

/// Sum of a counter over all label sets registered so far.
pub fn counter(name: &str) -> u64 {
    counters()
        .0
        .lock()
        .get(name)
        .map_or(0, |c| c.0.load(Ordering::Relaxed))
}

pub fn config(url: String) -> RedisConfig {
    RedisConfig {
        url: Some(url),
        ..RedisConfig::default()
    }
}

pub async fn tier(cfg: RedisConfig, replica: &str) -> RedisTier {
    counters();
    RedisTier::connect(cfg, replica.to_string()).await.unwrap()
}

pub fn entry(namespace: &str, text: &str, ttl_ms: u64) -> Entry {
    Entry {
        id: EntryId::random(),
        namespace: namespace.into(),
        model: "m".into(),
        text: text.into(),
        finish_reason: "stop".into(),
        prompt_tokens: 3,
        completion_tokens: 5,
        prompt: format!("prompt for {text}"),
        partition: [7; 32],
        embedding: Some(Vector::from(vec![0.6f32, -0.8, 3.0e-7])),
        embedder: None,
        origin: Origin::Live,
        tags: Vec::new(),
        refusals: Vec::new(),
        created_ms: now_ms(),
        expires_ms: now_ms() + ttl_ms,
        gen_ms: 0,
    }
}

pub fn digest(n: u32) -> Digest {
    *blake3::hash(&n.to_le_bytes()).as_bytes()
}

/// The next event, failing the test after a generous wait.
pub async fn next_event(stream: &mut ReplicationStream) -> ReplicationEvent {
    tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .expect("an event within 20 s")
        .expect("the stream stays open")
}

/// A plain connection for writing foreign values and inspecting keys.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// A refusal of the question whose key is `digest(n)`.
pub fn refusal(n: u32) -> reprise_cache::entry::Refusal {
    reprise_cache::entry::Refusal {
        key: digest(n),
        around: None,
    }
}

/// A store over `server` as replica `name`: 1 MiB of memory, an index of `dim` dimensions if
/// any, expired entries kept `retain`.
pub async fn replica(
    server: &reprise_cache::testing::RedisServer,
    name: &'static str,
    dim: Option<usize>,
    retain: Duration,
) -> reprise_cache::Store {
    use reprise_cache::semantic::{IndexConfig, SemanticIndex};
    let redis = tier(config(server.url()), name).await;
    let index = dim.map(|d| Arc::new(SemanticIndex::new(d, IndexConfig::default())));
    reprise_cache::Store::new(
        1 << 20,
        Duration::from_secs(60),
        retain,
        Some(redis),
        index,
        None,
    )
}
