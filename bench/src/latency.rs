//! `reprise-bench latency`: semantic-hit latency and throughput over concurrency, side by side
//! with exact hits and with the embedding alone.
//!
//! An in-process reprise (scripted backend, semantic tier on, the real embedder) is loaded
//! with N distinct prompts through the HTTP path. Then, at each concurrency, three sides run
//! in alternating rounds so they share the same machine noise:
//!
//! - **exact**: the stored prompts verbatim (exact hits; no embedding);
//! - **semantic**: a *new* text every request, a stored prompt (or the paraphrase side of a
//!   labelled pair) with filler words appended, so that neither the exact key nor the
//!   embedder's LRU knows it and the embedding is really computed;
//! - **embed**: the same kind of new texts given straight to the server's embedder, in
//!   process (no HTTP, no index): the share of a semantic hit that is the model call.
//!
//! Every measured request carries `Cache-Control: only-if-cached`: the stored set stays fixed
//! for the whole run (a miss is answered 504 at once instead of generating and storing) and a
//! semantic hit does not write its alias (a memory insert of microseconds). Semantic latency
//! percentiles are over hits only; the hit share is printed next to them.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::json;

use crate::common::{
    load_embedder, read_cached_outcome, semantic_index, start_app, BackendKind, Config, Failure,
    Failures, Samples,
};

/// Options of `reprise-bench latency`.
#[derive(Debug, Args)]
pub struct LatencyArgs {
    /// Distinct prompts stored before measuring (generated; ignored with `--pairs`).
    #[arg(long, default_value_t = 2000)]
    prompts: usize,
    /// Labelled pairs instead of generated prompts: a JSON list of {origin, similar}; the
    /// origins are stored, the similar sides asked.
    #[arg(long)]
    pairs: Option<PathBuf>,
    /// Concurrent clients, measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    concurrency: Vec<usize>,
    /// Seconds per side per round.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Alternating rounds per side and concurrency.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Configuration whose `[semantic]` section is used (threshold, gate, batching).
    #[arg(long)]
    config: Option<PathBuf>,
}

/// Filler words appended to make a text new without changing what it asks. All lower case
/// and free of what the false-hit gate looks at (numbers, dates, negations, antonyms, "to",
/// capitalised words), so a decorated prompt stays a servable paraphrase.
const FILLERS: &[&str] = &[
    "please",
    "thanks",
    "kindly",
    "briefly",
    "simply",
    "honestly",
    "basically",
    "really",
    "actually",
    "anyway",
    "cheers",
    "mate",
    "friend",
    "folks",
    "team",
    "buddy",
    "quick",
    "short",
    "plain",
    "clearly",
    "here",
    "again",
    "okay",
    "pal",
];

/// Deterministic, varied questions: one slot from each list, spread by a stride coprime with
/// the number of combinations so that neighbours differ in several slots.
fn generated_prompts(n: usize) -> Vec<String> {
    const OPENERS: &[&str] = &[
        "How do I",
        "What is the best way to",
        "Can you explain how to",
        "Show me how to",
        "What are common mistakes when trying to",
        "Is there an easy way to",
        "Give me an example of how to",
        "Walk me through how to",
    ];
    const TASKS: &[&str] = &[
        "parse",
        "serialize",
        "validate",
        "compress",
        "encrypt",
        "sort",
        "deduplicate",
        "paginate",
        "cache",
        "stream",
        "merge",
        "split",
        "index",
        "profile",
        "benchmark",
        "log",
        "retry",
        "schedule",
        "render",
        "upload",
        "download",
        "translate",
        "summarize",
        "visualize",
        "back up",
    ];
    const OBJECTS: &[&str] = &[
        "a JSON document",
        "a large CSV file",
        "user passwords",
        "log lines",
        "an XML feed",
        "database rows",
        "image thumbnails",
        "a video file",
        "HTTP responses",
        "sensor readings",
        "email addresses",
        "product reviews",
        "a sparse matrix",
        "configuration files",
        "chat messages",
        "audio clips",
        "shipping addresses",
        "invoice records",
        "a dependency graph",
        "geographic coordinates",
    ];
    const CONTEXTS: &[&str] = &[
        "in Python",
        "in Rust",
        "in Go",
        "in JavaScript",
        "in a Java service",
        "on a Linux server",
        "inside a Docker container",
        "with PostgreSQL",
        "in a React app",
        "on AWS Lambda",
        "with Kubernetes",
        "in a shell script",
        "in C sharp",
        "with Redis",
        "in an Android app",
    ];
    let dims = [OPENERS.len(), TASKS.len(), OBJECTS.len(), CONTEXTS.len()];
    let total: usize = dims.iter().product();
    // 7919 is prime and larger than every slot list, so it is coprime with `total`.
    (0..n.min(total))
        .map(|i| {
            let mut x = (i * 7919) % total;
            let mut slot = [0usize; 4];
            for (s, d) in slot.iter_mut().zip(dims) {
                *s = x % d;
                x /= d;
            }
            format!(
                "{} {} {} {}?",
                OPENERS[slot[0]], TASKS[slot[1]], OBJECTS[slot[2]], CONTEXTS[slot[3]]
            )
        })
        .collect()
}

/// `base` made new by filler words: `d = 0` is `base` itself, then one filler, then two.
/// The fillers go before the final question mark, where a person would put them.
fn decorate(base: &str, d: usize) -> String {
    let f = FILLERS.len();
    let suffix = match d {
        0 => return base.to_string(),
        d if d <= f => FILLERS[d - 1].to_string(),
        d => {
            let d = (d - f - 1) % (f * f);
            format!("{} {}", FILLERS[d / f], FILLERS[d % f])
        }
    };
    match base.strip_suffix('?') {
        Some(stem) => format!("{stem}, {suffix}?"),
        None => format!("{base}, {suffix}"),
    }
}

/// Hands out texts that no request of this run used before.
struct Variants {
    /// What variants are made from (generated prompts, or the similar side of pairs).
    bases: Vec<String>,
    next: AtomicUsize,
}

impl Variants {
    fn next(&self) -> String {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.bases.len();
        // Variant 0 of a generated prompt is the stored prompt itself: start at 1.
        decorate(&self.bases[k % n], k / n + 1)
    }

    /// How many distinct texts exist before `next` repeats one.
    fn capacity(&self) -> usize {
        let f = FILLERS.len();
        self.bases.len() * (f + f * f)
    }
}

/// One side's results at one concurrency.
#[derive(Default)]
struct Side {
    /// Latencies of hits (or of every embedding) and the wall time they took.
    hits: Samples,
    /// Requests sent, hits or not.
    requests: usize,
}

impl Side {
    fn merge(&mut self, other: Side) {
        self.hits.merge(other.hits);
        self.requests += other.requests;
    }

    /// Hits among the requests answered (failed ones are neither hits nor misses).
    fn hit_share(&self) -> f64 {
        let answered = self.requests as u64 - self.hits.failed.total();
        self.hits.lat.len() as f64 / answered.max(1) as f64
    }
}

/// Closed loop: `concurrency` workers call `op` back to back for `seconds`. `op` resolves to
/// whether the call counts as a hit (its latency is kept only then), or how it failed.
async fn closed_loop<F, Fut>(op: Arc<F>, concurrency: usize, seconds: f64) -> Side
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<bool, Failure>> + Send + 'static,
{
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut side = Side::default();
                while Instant::now() < deadline {
                    let t = Instant::now();
                    let hit = op().await;
                    side.requests += 1;
                    match hit {
                        Ok(true) => side.hits.lat.push(t.elapsed().as_secs_f64()),
                        Ok(false) => {}
                        Err(f) => side.hits.failed.count(f),
                    }
                }
                side
            })
        })
        .collect();
    let mut side = Side::default();
    for w in workers {
        side.merge(w.await.unwrap_or_default());
    }
    side.hits.wall = start.elapsed().as_secs_f64();
    side
}

/// Asks `text` with `only-if-cached`; true when the answer's outcome is `want`.
async fn ask(client: &reqwest::Client, url: &str, text: &str, want: &str) -> Result<bool, Failure> {
    let body =
        json!({"model": "fake", "messages": [{"role": "user", "content": text}]}).to_string();
    let sent = client
        .post(url)
        .header("content-type", "application/json")
        .header("cache-control", "only-if-cached")
        .body(body)
        .send()
        .await;
    Ok(read_cached_outcome(sent).await? == want)
}

fn ms(x: f64) -> String {
    format!("{:.2}", x * 1000.0)
}

/// Runs the latency benchmark.
pub async fn run(a: LatencyArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.concurrency.is_empty() && a.concurrency.iter().all(|&c| c > 0),
        "--concurrency needs positive values"
    );
    let mut config = Config::load(a.config.as_deref())?;
    config.backend.kind = BackendKind::Fake;
    config.cache.enabled = true;
    config.semantic.enabled = true;

    // What is stored, and what the semantic side's new texts are made from.
    let (stored, bases) = match &a.pairs {
        Some(path) => {
            let pairs = crate::quality::load_pairs(path)?;
            let mut seen = std::collections::HashSet::new();
            let stored: Vec<String> = pairs
                .iter()
                .filter(|p| p.same && seen.insert(p.a.clone()))
                .map(|p| p.a.clone())
                .collect();
            let bases: Vec<String> = pairs
                .iter()
                .filter(|p| p.same)
                .map(|p| p.b.clone())
                .collect();
            (stored, bases)
        }
        None => {
            let p = generated_prompts(a.prompts);
            (p.clone(), p)
        }
    };
    anyhow::ensure!(!stored.is_empty(), "nothing to store");

    let backend = Arc::new(ScriptedBackend::new(ScriptConfig::default()));
    let embedder = load_embedder(&config)
        .await?
        .ok_or_else(|| anyhow::anyhow!("the semantic tier is off"))?;
    let server = start_app(config.clone(), backend, Some(embedder.clone())).await?;
    let url = server.chat_url();
    let max_c = a.concurrency.iter().copied().max().unwrap_or(1);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(max_c * 2)
        .tcp_nodelay(true)
        .build()?;

    // Store every prompt as its own entry (`no-cache`: never served from a near-duplicate
    // stored just before it).
    eprintln!("storing {} prompts", stored.len());
    let t = Instant::now();
    let stored_ok = futures::stream::iter(stored.iter().cloned().map(|text| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let body = json!({"model": "fake", "messages": [{"role": "user", "content": text}]});
            match client
                .post(&url)
                .header("cache-control", "no-cache")
                .json(&body)
                .send()
                .await
            {
                Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                Err(_) => false,
            }
        }
    }))
    .buffer_unordered(8)
    .filter(|ok| futures::future::ready(*ok))
    .count()
    .await;
    let indexed = semantic_index(&server.state).map_or(0, |index| index.len());
    eprintln!(
        "  stored {stored_ok} in {:.1} s; {indexed} vectors indexed",
        t.elapsed().as_secs_f64()
    );
    anyhow::ensure!(stored_ok == stored.len(), "some prompts were not stored");

    let stored = Arc::new(stored);
    let variants = Arc::new(Variants {
        bases,
        next: AtomicUsize::new(0),
    });
    let exact_next = Arc::new(AtomicUsize::new(0));
    let exact_op = {
        let (client, url, stored, next) = (
            client.clone(),
            url.clone(),
            stored.clone(),
            exact_next.clone(),
        );
        Arc::new(move || {
            let (client, url, stored, next) =
                (client.clone(), url.clone(), stored.clone(), next.clone());
            async move {
                let i = next.fetch_add(1, Ordering::Relaxed) % stored.len();
                ask(&client, &url, &stored[i], "exact").await
            }
        })
    };
    let semantic_op = {
        let (client, url, variants) = (client.clone(), url.clone(), variants.clone());
        Arc::new(move || {
            let (client, url, text) = (client.clone(), url.clone(), variants.next());
            async move { ask(&client, &url, &text, "semantic").await }
        })
    };
    let embed_op = {
        let (embedder, variants) = (embedder.clone(), variants.clone());
        Arc::new(move || {
            let (embedder, text) = (embedder.clone(), variants.next());
            async move {
                match embedder.embed(&text).await {
                    Ok(_) => Ok(true),
                    Err(_) => Err(Failure::Other),
                }
            }
        })
    };

    // Warm-up, unrecorded: connections, allocator, the index's pages.
    closed_loop(exact_op.clone(), max_c, 0.5).await;
    closed_loop(semantic_op.clone(), max_c, 0.5).await;

    eprintln!(
        "measuring: {} rounds x {:.1} s per side at {:?} clients",
        a.rounds, a.seconds, a.concurrency
    );
    let mut rows = Vec::new();
    for &c in &a.concurrency {
        let (mut exact, mut semantic, mut embed) =
            (Side::default(), Side::default(), Side::default());
        for _ in 0..a.rounds.max(1) {
            exact.merge(closed_loop(exact_op.clone(), c, a.seconds).await);
            semantic.merge(closed_loop(semantic_op.clone(), c, a.seconds).await);
            embed.merge(closed_loop(embed_op.clone(), c, a.seconds).await);
        }
        eprintln!(
            "  {c:>2} clients: exact {:.0}/s, semantic {:.0}/s ({:.1} % hits), embed {:.0}/s",
            exact.hits.throughput(),
            semantic.hits.throughput(),
            100.0 * semantic.hit_share(),
            embed.hits.throughput()
        );
        for (name, side) in [
            ("exact", &exact),
            ("semantic", &semantic),
            ("embed", &embed),
        ] {
            if side.hits.failed.total() > 0 {
                eprintln!(
                    "     {name}: {} (left out of the figures)",
                    side.hits.failed
                );
            }
        }
        rows.push((c, exact, semantic, embed));
    }
    let used = variants.next.load(Ordering::Relaxed);
    if used > variants.capacity() {
        eprintln!(
            "warning: {used} new texts asked but only {} distinct ones exist; some repeated",
            variants.capacity()
        );
    }

    println!(
        "== reprise bench latency ({} stored, threshold {:.2}, gate {}) ==",
        stored.len(),
        config.semantic.threshold,
        if config.semantic.gate { "on" } else { "off" }
    );
    println!("times in ms; semantic percentiles over hits; every semantic and embed text is new");
    println!(
        "clients |  exact p50    p99    req/s | semantic p50    p99   hits/s  hit % | embed p50    p99      /s | sem/exact p50"
    );
    for (c, exact, semantic, embed) in &rows {
        println!(
            "{c:>7} | {:>10} {:>6} {:>8.0} | {:>12} {:>6} {:>8.0} {:>6.1} | {:>9} {:>6} {:>7.0} | {:>8.2}x",
            ms(exact.hits.pct(50.0)),
            ms(exact.hits.pct(99.0)),
            exact.hits.throughput(),
            ms(semantic.hits.pct(50.0)),
            ms(semantic.hits.pct(99.0)),
            semantic.hits.throughput(),
            100.0 * semantic.hit_share(),
            ms(embed.hits.pct(50.0)),
            ms(embed.hits.pct(99.0)),
            embed.hits.throughput(),
            semantic.hits.pct(50.0) / exact.hits.pct(50.0),
        );
    }
    let mut failed = (
        Failures::default(),
        Failures::default(),
        Failures::default(),
    );
    for (_, exact, semantic, embed) in &rows {
        failed.0.add(exact.hits.failed);
        failed.1.add(semantic.hits.failed);
        failed.2.add(embed.hits.failed);
    }
    println!(
        "failed requests (neither timed nor counted as hits or misses): exact {}; semantic {}; embed {}",
        failed.0, failed.1, failed.2
    );
    if let Some((_, e1, s1, m1)) = rows.first() {
        println!("throughput at k clients / at {} (goal: rising)", rows[0].0);
        for (c, e, s, m) in &rows {
            println!(
                "{c:>7} | exact {:>5.2}x | semantic {:>5.2}x | embed {:>5.2}x",
                e.hits.throughput() / e1.hits.throughput(),
                s.hits.throughput() / s1.hits.throughput(),
                m.hits.throughput() / m1.hits.throughput()
            );
        }
        println!(
            "semantic-hit p50 at {} client(s): {} ms (goal <= 5 ms, embedding included); the embedding alone {} ms",
            rows[0].0,
            ms(s1.hits.pct(50.0)),
            ms(m1.hits.pct(50.0))
        );
    }
    Ok(())
}
