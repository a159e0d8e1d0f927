//! `reprise-bench redis`: the shared Redis tier (L2) measured against the in-process one.
//!
//! Three parts, each on its own key prefix of one Redis (started here on a free loopback port
//! with nothing persisted, or `--redis-url`):
//!
//! - **(b) rebuild**: entries with synthetic 384-dimension unit vectors are written straight
//!   through [`RedisTier::put`]; a fresh replica is then built and timed until its semantic
//!   index holds them all, with the process's resident memory before and after. Runs first so
//!   the memory figures are not blurred by the other parts' allocations.
//! - **(a) L2 against L1**: replica A stores entries through HTTP misses; replica B, started
//!   before, has received them by replication into its memory by id, but an exact key is only
//!   linked to its entry by a lookup. So B's *first* request for a key is an L2 hit (memory
//!   misses the key, Redis answers `GET key` then `GET entry`, the entry is promoted) and the
//!   *second* request for the same key is an L1 hit. Each batch of fresh keys is asked twice
//!   in a row, first pass L2, second pass L1: same keys, same moment. Run twice: with the
//!   semantic tier off (the bare exact path) and on (values carry embeddings, and a
//!   promotion re-inserts the entry into B's index).
//! - **(c) propagation**: a miss on A, then the time from its answer reaching the client until
//!   B has it, two ways in alternating samples: B's semantic index holds the entry (the event
//!   stream delivered it; polled in process), and B answers the request as an exact hit over
//!   HTTP (`Cache-Control: only-if-cached`, polled back to back; served through L2).
//!
//! Progress goes to stderr, results to stdout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_cache::redis::{RedisConfig, RedisTier};
use reprise_cache::{now_ms, Digest, Entry, EntryId, Origin, Vector};
use reprise_embedder::Embedder;
use serde_json::json;

use crate::common::{
    build_replica, chat_exact_key, load_embedder, mib, percentile, read_cached_outcome, rebuilds,
    redis_tier, rss, semantic_index, start_redis, start_replica, store, BackendKind, Config,
    Failure, Failures, Samples, Server, DEFAULT_NAMESPACE,
};

/// Options of `reprise-bench redis`.
#[derive(Debug, Args)]
pub struct RedisArgs {
    /// Use this Redis instead of starting `redis-server` on a free port. Everything is
    /// written under a fresh `reprise-bench-*` prefix and expires within `--ttl-secs`.
    #[arg(long)]
    redis_url: Option<String>,
    /// Which parts to run: any of `a` (L2 against L1, with the semantic tier off, then on),
    /// `b` (rebuild), `c` (propagation).
    #[arg(long, default_value = "abc")]
    parts: String,
    /// (b) Entries a fresh replica rebuilds its index from.
    #[arg(long, default_value_t = 100_000)]
    entries: usize,
    /// (b) Semantic partitions the synthetic entries are spread over.
    #[arg(long, default_value_t = 16)]
    partitions: usize,
    /// (b) Stop once every vector is searchable (exact scans), without waiting for the
    /// graphs (the process exits there, with the parts after it not run): the semantic
    /// readiness of a large rebuild whose graph construction would take hours here.
    #[arg(long)]
    until_searchable: bool,
    /// (a) Distinct keys stored through replica A.
    #[arg(long, default_value_t = 9000)]
    keys: usize,
    /// (a) Concurrent clients, measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// (a) Alternating L2/L1 rounds per concurrency.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// (c) Propagation samples per way.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Lifetime of everything this benchmark writes, in seconds.
    #[arg(long, default_value_t = 3600)]
    ttl_secs: u64,
}

fn ms(x: f64) -> String {
    format!("{:.3} ms", x * 1000.0)
}

/// A small deterministic generator (splitmix64): synthetic vectors need no quality.
pub(crate) struct SplitMix(pub(crate) u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// A random unit vector of `dim` components.
    pub(crate) fn vector(&mut self, dim: usize) -> Vector {
        let mut v: Vec<f32> = (0..dim).map(|_| self.unit()).collect();
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= norm);
        v.into()
    }
}

/// The configuration of one replica in this benchmark.
fn replica_config(url: &str, prefix: &str, semantic: bool, ttl_secs: u64) -> Config {
    let mut c = Config::default();
    c.backend.kind = BackendKind::Fake;
    c.cache.enabled = true;
    c.cache.ttl_secs = ttl_secs;
    c.semantic.enabled = semantic;
    c.redis.url = Some(url.to_string());
    c.redis.prefix = prefix.to_string();
    c
}

/// A replica: state with a Redis tier, served on a free loopback port.
async fn replica(config: Config, embedder: Option<Arc<dyn Embedder>>) -> anyhow::Result<Server> {
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    start_replica(config, backend, embedder).await
}

fn chat_body(text: &str) -> String {
    json!({"model": "fake", "messages": [{"role": "user", "content": text}]}).to_string()
}

/// Posts `body`; returns the `x-reprise-cache` outcome once the whole body arrived
/// (`not_cached` for the 504 of an `only-if-cached` miss), or how the request failed.
async fn post(
    client: &reqwest::Client,
    url: &str,
    body: String,
    headers: &[(&str, &str)],
) -> Result<String, Failure> {
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    read_cached_outcome(req.send().await).await
}

/// Runs the Redis benchmark.
pub async fn run(a: RedisArgs) -> anyhow::Result<()> {
    let local = match &a.redis_url {
        Some(_) => None,
        None => Some(start_redis()?),
    };
    let url = match (&a.redis_url, &local) {
        (Some(u), _) => u.clone(),
        (None, Some(l)) => l.url(),
        (None, None) => unreachable!("a local server is started when no url is given"),
    };
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let prefix = |part: &str| format!("reprise-bench-{}-{part}", &run_id[..8]);
    eprintln!(
        "redis: {}",
        if local.is_some() {
            "redis-server started on a free port"
        } else {
            "--redis-url"
        }
    );
    let parts = a.parts.to_ascii_lowercase();
    // One embedder for every replica of this process (each would load its own in a real
    // deployment; sharing it changes nothing that is measured here).
    let embedder = {
        let cfg = replica_config(&url, "unused", true, a.ttl_secs);
        load_embedder(&cfg).await?
    };
    println!("== reprise bench redis ==");
    if parts.contains('b') {
        rebuild(&a, &url, &prefix("b"), embedder.clone()).await?;
        if a.until_searchable {
            // The runtime would wait for the graphs' background build at shutdown (hours at
            // a million entries): the run ends here, its Redis stopped first.
            use std::io::Write;
            drop(local);
            std::io::stdout().flush()?;
            std::process::exit(0);
        }
    }
    if parts.contains('a') {
        l2_vs_l1(&a, &url, &prefix("a"), None).await?;
        l2_vs_l1(&a, &url, &prefix("a-semantic"), embedder.clone()).await?;
    }
    if parts.contains('c') {
        propagation(&a, &url, &prefix("c"), embedder.clone()).await?;
    }
    Ok(())
}

/// (b) A fresh replica rebuilding its index from `--entries` entries.
async fn rebuild(
    a: &RedisArgs,
    url: &str,
    prefix: &str,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<()> {
    let embedder = embedder.ok_or_else(|| anyhow::anyhow!("no embedder"))?;
    let dim = embedder.dim();
    let n = a.entries;
    eprintln!(
        "(b) writing {n} entries ({dim}-dim vectors, {} partitions) to redis",
        a.partitions
    );
    let mut cfg = replica_config(url, prefix, true, a.ttl_secs);
    let writer = RedisTier::connect(
        RedisConfig {
            prefix: prefix.to_string(),
            ..cfg.redis.clone()
        },
        "bench-writer".into(),
    )
    .await?;
    let partitions: Vec<Digest> = (0..a.partitions.max(1))
        .map(|p| *blake3::hash(format!("{prefix} partition {p}").as_bytes()).as_bytes())
        .collect();
    let mut rng = SplitMix(0x5EED);
    let t = Instant::now();
    let now = now_ms();
    let mut dropped = 0usize;
    for i in 0..n {
        let entry = Entry {
            id: EntryId::random(),
            namespace: DEFAULT_NAMESPACE.into(),
            model: "fake".into(),
            text: format!("synthetic answer number {i}, about as long as a short reply"),
            finish_reason: "stop".into(),
            prompt_tokens: 20,
            completion_tokens: 12,
            prompt: format!("synthetic prompt number {i}"),
            partition: partitions[i % partitions.len()],
            embedding: Some(rng.vector(dim)),
            embedder: None,
            origin: Origin::Live,
            tags: Vec::new(),
            refusals: Vec::new(),
            created_ms: now,
            expires_ms: now + a.ttl_secs * 1000,
            gen_ms: 0,
        };
        let key = *blake3::hash(format!("{prefix} key {i}").as_bytes()).as_bytes();
        dropped += usize::from(!writer.put(&entry, &[key]));
        // The write queue holds `write_queue` writes; beyond that puts are dropped, so let
        // the writer catch up well before.
        if (i + 1) % 2000 == 0 {
            writer.flush().await?;
        }
        if (i + 1) % 20_000 == 0 {
            eprintln!("  {} written ({:.1} s)", i + 1, t.elapsed().as_secs_f64());
        }
    }
    writer.flush().await?;
    drop(writer);
    anyhow::ensure!(
        dropped == 0,
        "{dropped} puts were dropped by the write queue"
    );
    let write_s = t.elapsed().as_secs_f64();
    eprintln!("  written in {write_s:.1} s");

    // The entries must all fit: an entry evicted from memory is tombstoned in the index and
    // the count would never be reached.
    cfg.cache.memory_bytes = cfg.cache.memory_bytes.max(n as u64 * 8 * 1024);
    let (rss_before, _) = rss();
    eprintln!("(b) starting a fresh replica");
    let t = Instant::now();
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let (state, _tasks) = build_replica(cfg, backend, Some(embedder)).await?;
    let index = semantic_index(&state).ok_or_else(|| anyhow::anyhow!("no semantic index"))?;
    // The rebuild scans everything, then places the vectors at once: the first vector in the
    // index marks the end of the scan, and from then on every vector is searchable (exact
    // scans). The graphs of partitions past the exact-scan limit are built after, in the
    // background.
    let mut searchable_s = None;
    // Entries go round robin: the first `n % parts` partitions hold one more.
    let parts = a.partitions.max(1);
    let graphs_expected = (0..parts)
        .filter(|p| {
            n / parts + usize::from(*p < n % parts) > state.config.semantic.index.exact_scan_max
        })
        .count();
    let mut next_report = Instant::now() + Duration::from_secs(5);
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        let len = index.len();
        if len >= n && rebuilds(&state) > 0 {
            searchable_s.get_or_insert(t.elapsed().as_secs_f64());
            if a.until_searchable || index.graphs() >= graphs_expected {
                break;
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the index holds {len} of {n} vectors and {} of {graphs_expected} graphs after an \
             hour",
            index.graphs()
        );
        if Instant::now() >= next_report {
            eprintln!(
                "  {len} of {n} indexed, {} of {graphs_expected} graphs ({:.1} s)",
                index.graphs(),
                t.elapsed().as_secs_f64()
            );
            next_report += Duration::from_secs(5);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let total_s = t.elapsed().as_secs_f64();
    let (rss_after, hwm) = rss();
    let searchable_s = searchable_s.unwrap_or(total_s);
    println!(
        "(b) fresh replica rebuilding {n} entries ({dim}-dim, {} partitions)",
        a.partitions
    );
    println!(
        "    semantic hits (every vector searchable) after {searchable_s:.2} s ({:.0} entries/s)",
        n as f64 / searchable_s
    );
    if !a.until_searchable {
        println!("    every graph built after {total_s:.2} s");
    }
    println!("    (writing them through RedisTier::put took {write_s:.1} s)");
    println!(
        "    RSS before {:.0} MiB, after {:.0} MiB: +{:.0} MiB ({:.0} bytes/entry{}); peak RSS \
         of the process {:.0} MiB",
        mib(rss_before),
        mib(rss_after),
        mib(rss_after.saturating_sub(rss_before)),
        rss_after.saturating_sub(rss_before) as f64 / n as f64,
        if a.until_searchable {
            ", without graphs"
        } else {
            ""
        },
        mib(hwm)
    );
    // Dropping the state stops its replication task; its memory goes back to the allocator.
    drop(index);
    drop(state);
    Ok(())
}

/// (a) Exact hits on replica B served from Redis (first request of each key) against the
/// same keys' second request (memory).
async fn l2_vs_l1(
    a: &RedisArgs,
    url: &str,
    prefix: &str,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.concurrency.is_empty() && a.concurrency.iter().all(|&c| c > 0),
        "--concurrency needs positive values"
    );
    // Without an embedder the semantic tier is off and only the exact path is measured; with
    // one, entries carry embeddings (bigger values to decode) and a promotion also inserts
    // into B's index, as on a real replica.
    let semantic = embedder.is_some();
    let label = if semantic {
        "semantic tier on"
    } else {
        "semantic tier off"
    };
    let cfg = replica_config(url, prefix, semantic, a.ttl_secs);
    let replica_a = replica(cfg.clone(), embedder.clone()).await?;
    let replica_b = replica(cfg, embedder).await?;
    let (url_a, url_b) = (replica_a.chat_url(), replica_b.chat_url());
    let memory_b = store(&replica_b.state);
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(max_c * 2)
        .tcp_nodelay(true)
        .build()?;
    let texts: Vec<String> = (0..a.keys)
        .map(|i| format!("redis tier benchmark question {i}: what is stored under this key?"))
        .collect();
    eprintln!(
        "(a, {label}) storing {} entries through replica A",
        texts.len()
    );
    let t = Instant::now();
    let stored = futures::stream::iter(texts.iter().map(|text| {
        let (client, url_a) = (client.clone(), url_a.clone());
        let body = chat_body(text);
        async move { post(&client, &url_a, body, &[]).await }
    }))
    .buffer_unordered(8)
    .collect::<Vec<_>>()
    .await;
    let mut store_failed = Failures::default();
    for r in &stored {
        if let Err(f) = r {
            store_failed.count(*f);
        }
    }
    let stored = stored.iter().filter(|r| r.as_deref() == Ok("miss")).count();
    anyhow::ensure!(
        stored == texts.len(),
        "only {stored} of {} stored as misses; {store_failed}",
        texts.len()
    );
    if let Some(r) = redis_tier(&replica_a.state) {
        r.flush().await?;
    }
    eprintln!("  stored in {:.1} s", t.elapsed().as_secs_f64());
    // Let replication deliver them to B (by id), so that B is in the state of a replica that
    // has been running along: entries in memory, exact keys not yet linked.
    let deadline = Instant::now() + Duration::from_secs(60);
    let index_b = semantic_index(&replica_b.state);
    loop {
        memory_b.run_pending_tasks().await;
        let delivered = match &index_b {
            Some(index) => index.len() as u64,
            None => memory_b.entry_count(),
        };
        if delivered >= texts.len() as u64 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "  replica B holds {} entries by id ({} in its index)",
        memory_b.entry_count(),
        index_b.as_ref().map_or(0, |i| i.len())
    );

    // Each key is used by exactly one L2 pass (then one L1 pass): the rounds consume keys.
    let batches = a.concurrency.len() * a.rounds.max(1);
    let per_batch = texts.len() / batches;
    anyhow::ensure!(
        per_batch >= max_c,
        "--keys {} is too few for {batches} batches of at least {max_c}",
        a.keys
    );
    let mut next = 0usize;
    let mut rows = Vec::new();
    let mut wrong = 0usize;
    for &c in &a.concurrency {
        let (mut l2, mut l1) = (Samples::default(), Samples::default());
        for _ in 0..a.rounds.max(1) {
            let batch: Vec<String> = texts[next..next + per_batch].to_vec();
            next += per_batch;
            // Make sure what is about to be measured as L2 really is not linked in B's memory.
            let key = chat_exact_key(chat_body(&batch[0]).as_bytes())?;
            anyhow::ensure!(
                memory_b.get_by_key(&key).await.is_none(),
                "a key meant for an L2 pass is already in B's memory"
            );
            let (s, w) = pass(&client, &url_b, &batch, c).await;
            l2.merge(s);
            wrong += w;
            anyhow::ensure!(
                memory_b.get_by_key(&key).await.is_some(),
                "an L2 hit was not promoted into B's memory"
            );
            let (s, w) = pass(&client, &url_b, &batch, c).await;
            l1.merge(s);
            wrong += w;
        }
        eprintln!(
            "  {c:>2} clients: L2 {:.0}/s, L1 {:.0}/s",
            l2.throughput(),
            l1.throughput()
        );
        rows.push((c, l2, l1));
    }
    println!(
        "(a, {label}) exact hits on replica B, {per_batch} keys per pass: first request of a key (L2: memory misses the key, Redis GET key + GET entry, promoted) vs the same keys again (L1)"
    );
    println!("    clients |    L2 p50      p99     req/s |    L1 p50      p99     req/s | L2/L1 p50  L1/L2 req/s");
    for (c, l2, l1) in &rows {
        println!(
            "    {c:>7} | {:>9} {:>9} {:>8.0} | {:>9} {:>9} {:>8.0} | {:>8.2}x {:>9.2}x",
            ms(l2.pct(50.0)),
            ms(l2.pct(99.0)),
            l2.throughput(),
            ms(l1.pct(50.0)),
            ms(l1.pct(99.0)),
            l1.throughput(),
            l2.pct(50.0) / l1.pct(50.0),
            l1.throughput() / l2.throughput()
        );
    }
    if wrong > 0 {
        println!("    warning: {wrong} requests were not exact hits (left out of the figures)");
    }
    let (mut l2_failed, mut l1_failed) = (Failures::default(), Failures::default());
    for (_, l2, l1) in &rows {
        l2_failed.add(l2.failed);
        l1_failed.add(l1.failed);
    }
    println!("    failed requests (left out of the figures): L2 {l2_failed}; L1 {l1_failed}");
    if let Some(index) = index_b {
        // A promotion re-installs an entry replication had already indexed: each one leaves
        // a tombstone behind, which maintenance reports when it drops them.
        let len = index.len();
        let report = tokio::task::spawn_blocking(move || index.maintain()).await?;
        println!(
            "    B's index after the passes: {len} live vectors; maintenance then dropped {} tombstones in {} rebuilt partitions",
            report.tombstones_dropped, report.rebuilt
        );
    }
    drop((replica_a, replica_b));
    Ok(())
}

/// Asks every text once with `concurrency` clients; latencies of exact hits (failed requests
/// counted in the samples), and how many were answered but not as exact hits.
async fn pass(
    client: &reqwest::Client,
    url: &str,
    texts: &[String],
    concurrency: usize,
) -> (Samples, usize) {
    let start = Instant::now();
    let results: Vec<Result<Option<f64>, Failure>> =
        futures::stream::iter(texts.iter().map(|text| {
            let (client, url) = (client.clone(), url.to_string());
            let body = chat_body(text);
            async move {
                let t = Instant::now();
                let outcome =
                    post(&client, &url, body, &[("cache-control", "only-if-cached")]).await?;
                Ok((outcome == "exact").then(|| t.elapsed().as_secs_f64()))
            }
        }))
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut samples = Samples {
        wall: start.elapsed().as_secs_f64(),
        ..Samples::default()
    };
    let mut wrong = 0;
    for r in results {
        match r {
            Ok(Some(lat)) => samples.lat.push(lat),
            Ok(None) => wrong += 1,
            Err(f) => samples.failed.count(f),
        }
    }
    (samples, wrong)
}

/// (c) Time from a miss answered on A until B has the entry.
async fn propagation(
    a: &RedisArgs,
    url: &str,
    prefix: &str,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<()> {
    // The semantic tier is on so that B's index shows when replication installed an entry.
    let replica_a = replica(
        replica_config(url, prefix, true, a.ttl_secs),
        embedder.clone(),
    )
    .await?;
    let replica_b = replica(replica_config(url, prefix, true, a.ttl_secs), embedder).await?;
    let (url_a, url_b) = (replica_a.chat_url(), replica_b.chat_url());
    let index_b =
        semantic_index(&replica_b.state).ok_or_else(|| anyhow::anyhow!("no semantic index"))?;
    let client = reqwest::Client::builder().tcp_nodelay(true).build()?;
    // Let both replicas finish their (empty) start-up rebuild and subscribe.
    tokio::time::sleep(Duration::from_millis(500)).await;
    eprintln!("(c) {} samples per way", a.samples);
    let timeout = Duration::from_secs(2);
    let (mut via_index, mut via_http) = (Vec::new(), Vec::new());
    let mut lost = 0usize;
    let mut poll_failed = Failures::default();
    // A few unrecorded samples first: connections, the embedder's LRU.
    let warmup = 6;
    for i in 0..(2 * a.samples + warmup) {
        // A namespace per sample: its own exact key and partition, so no sample can be served
        // (exactly or semantically) from another one. The text stays the same, so the
        // embedding comes from the LRU and A's miss is quick.
        let ns = format!("probe-{i}");
        let body = chat_body("How long does an entry take to reach the other replica?");
        let ns_header = [("x-reprise-namespace", ns.as_str())];
        let by_index = i % 2 == 0;
        let before = index_b.len();
        let outcome = post(&client, &url_a, body.clone(), &ns_header).await;
        anyhow::ensure!(
            outcome.as_deref() == Ok("miss"),
            "the write on A was not a miss: {outcome:?}"
        );
        let t0 = Instant::now();
        let seen = if by_index {
            // Polled from a blocking thread with short sleeps: finer than tokio's
            // millisecond timer, without spinning a core away from the replication task.
            let index = index_b.clone();
            tokio::task::spawn_blocking(move || {
                while t0.elapsed() < timeout {
                    if index.len() > before {
                        return Some(t0.elapsed().as_secs_f64());
                    }
                    std::thread::sleep(Duration::from_micros(20));
                }
                None
            })
            .await?
        } else {
            let headers = [
                ("x-reprise-namespace", ns.as_str()),
                ("cache-control", "only-if-cached"),
            ];
            let mut seen = None;
            while t0.elapsed() < timeout {
                match post(&client, &url_b, body.clone(), &headers).await {
                    Ok(o) if o == "exact" => {
                        seen = Some(t0.elapsed().as_secs_f64());
                        break;
                    }
                    Ok(_) => {}
                    Err(f) => poll_failed.count(f),
                }
            }
            seen
        };
        if i < warmup {
            continue;
        }
        match (seen, by_index) {
            (Some(s), true) => via_index.push(s),
            (Some(s), false) => via_http.push(s),
            (None, _) => lost += 1,
        }
    }
    println!("(c) propagation A -> B, from A's answer reaching its client until B has the entry");
    println!(
        "    B's index holds it (event stream + fetch): p50 {}  p99 {}  max {}  ({} samples)",
        ms(percentile(&via_index, 50.0)),
        ms(percentile(&via_index, 99.0)),
        ms(percentile(&via_index, 100.0)),
        via_index.len()
    );
    println!(
        "    B answers it as an exact hit (HTTP polls, via L2): p50 {}  p99 {}  max {}  ({} samples)",
        ms(percentile(&via_http, 50.0)),
        ms(percentile(&via_http, 99.0)),
        ms(percentile(&via_http, 100.0)),
        via_http.len()
    );
    if lost > 0 {
        println!("    {lost} samples did not arrive within {timeout:?}");
    }
    if poll_failed.total() > 0 {
        println!("    polls of B: {poll_failed} (a failed poll is not a sighting)");
    }
    Ok(())
}
