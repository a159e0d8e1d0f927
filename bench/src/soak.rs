//! `reprise-bench soak`: many distinct prompts through one server with a fixed memory budget,
//! watching the process's resident memory.
//!
//! One server (scripted backend answering at once, in-memory tier of `--memory-mb`, no Redis)
//! is started in this process; `--concurrency` clients send `--prompts` distinct chat prompts
//! through it, each one a miss that stores an entry, so the memory tier fills up to its budget
//! and then evicts. The semantic tier is off unless `--semantic` (then the configured real
//! embedder embeds every prompt and the index holds its vector: much slower).
//!
//! Progress (prompts sent, entries held, weighted bytes, RSS) goes to stderr every
//! `--progress-secs`; the report goes to stdout: RSS at start (server up, embedder loaded,
//! nothing stored), peak RSS, the memory tier's weighted size and entries held, RSS minus the
//! budget, bytes per entry held, and whether the peak stayed within the budget, its keys'
//! eighth, the budgets of the other stores distinct prompts fill (feedback's remembered
//! responses, the stats ring, the prefetch model, and with `--semantic` the embedder's text
//! cache and the context forms) and the overhead measured at start (or `--overhead-mb`). The clients run in the same process, so
//! their memory is part of every RSS figure (it does not grow with the prompts sent: prompts
//! are generated as they are sent).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::json;

use crate::common::{
    heap_in_use, load_embedder, mib, read_answer, rss, start_app, store, BackendKind, Config,
    Failures, CACHE_HEADER,
};

/// Options of `reprise-bench soak`.
#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Distinct prompts sent (each one a miss that stores an entry).
    #[arg(long, default_value_t = 1_000_000)]
    prompts: u64,
    /// The memory tier's budget, `cache.memory_bytes`, in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mb: u64,
    /// Length of each prompt in bytes (the scripted reply echoes it, so an entry weighs
    /// about twice this plus a fixed part).
    #[arg(long, default_value_t = 256)]
    prompt_bytes: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Turn the semantic tier on with the configured (real) embedder: every prompt is
    /// embedded and indexed. Off by default, so the soak measures the exact path and runs fast.
    #[arg(long)]
    semantic: bool,
    /// Configuration file (the embedder's model paths; the backend, cache and semantic
    /// settings named here are set by the options above).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seconds between progress lines.
    #[arg(long, default_value_t = 5)]
    progress_secs: u64,
    /// The fixed overhead the peak RSS is checked against, in MiB, beside the budget; by
    /// default the RSS measured at start.
    #[arg(long)]
    overhead_mb: Option<u64>,
}

/// Words the prompts are made of, picked at random per prompt so that no two prompts share
/// more than their shape (and, with the semantic tier on, few are near-duplicates).
const WORDS: &[&str] = &[
    "river", "copper", "lantern", "orbit", "violet", "harbor", "quartz", "meadow", "signal",
    "thunder", "pepper", "glacier", "canvas", "marble", "falcon", "ember", "velvet", "compass",
    "saddle", "prism", "tundra", "walnut", "beacon", "cobalt", "fjord", "garnet", "hollow",
    "juniper", "kettle", "lagoon", "mosaic", "nectar", "opal", "pylon", "quiver", "raven",
    "sierra", "tablet", "umber", "vortex", "willow", "xenon", "yarrow", "zephyr", "anchor",
    "basalt", "cipher", "dune", "eclipse", "fable", "gypsum", "helix", "iris", "jasper", "kelp",
    "lumen", "magma", "nebula", "oasis", "pollen", "quarry", "ridge", "spindle", "timber",
];

/// The `i`-th prompt of the soak: its number, then words chosen by a generator seeded with
/// `i`, until it is at least `bytes` long. Deterministic; distinct for distinct `i`.
pub fn prompt(i: u64, bytes: usize) -> String {
    let mut s = format!("soak prompt {i}:");
    let mut state = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED;
    while s.len() < bytes {
        // splitmix64
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        s.push(' ');
        s.push_str(WORDS[(z % WORDS.len() as u64) as usize]);
    }
    s
}

/// The other stores that distinct prompts fill, each up to its own byte budget, as
/// configured: (what, bytes). `measured_start`: the fixed overhead is the RSS measured after
/// the warm-up, which already holds the embedder's working memory for full batches, so it
/// is not counted again.
fn other_budgets(config: &Config, measured_start: bool) -> Vec<(&'static str, u64)> {
    let mut out = Vec::new();
    if config.feedback.enabled {
        out.push(("feedback.memory_bytes", config.feedback.memory_bytes));
    }
    if config.stats.enabled {
        out.push(("stats.memory_bytes", config.stats.memory_bytes));
    }
    if config.prefetch.enabled {
        out.push(("prefetch.model_bytes", config.prefetch.model_bytes));
    }
    if config.semantic.enabled {
        out.push((
            "semantic.embedding_cache_bytes",
            config.semantic.embedding_cache_bytes,
        ));
        out.push((
            "semantic.context_forms_bytes",
            config.semantic.context_forms_bytes,
        ));
        if config.semantic.delta > 0.0 {
            out.push((
                "semantic.entry_evidence_bytes",
                config.semantic.entry_evidence_bytes,
            ));
        }
        // The runtime's working memory grows to the largest batch it has run.
        if !measured_start {
            out.push((
                "semantic.embedder_memory_bytes",
                config.semantic.embedder_memory_bytes,
            ));
        }
    }
    out
}

/// What the clients saw, all of them together.
#[derive(Debug, Default)]
struct Tally {
    /// Answers by their `x-reprise-cache` outcome (`miss`, `exact`, `semantic`, ...).
    outcomes: std::collections::BTreeMap<String, u64>,
    /// Requests that failed: counted, never timed.
    failed: Failures,
}

/// Runs the soak.
pub async fn run(a: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.concurrency > 0, "--concurrency must be positive");
    anyhow::ensure!(a.memory_mb > 0, "--memory-mb must be positive");
    let mut config = Config::load(a.config.as_deref())?;
    config.backend.kind = BackendKind::Fake;
    config.cache.enabled = true;
    config.cache.memory_bytes = a.memory_mb * 1024 * 1024;
    config.cache.snapshot_path = None;
    config.semantic.enabled = a.semantic;
    // A slow lookup on a busy machine must not turn into a miss that stores twice.
    config.server.lookup_timeout_secs = config.server.lookup_timeout_secs.max(60.0);
    let budget = config.cache.memory_bytes;
    // The memory tier holds entries within `memory_bytes` and exact keys within an eighth of
    // it on top (see `MemoryTier::new`).
    let key_budget = budget / 8;
    let others = other_budgets(&config, a.overhead_mb.is_none());
    let others_total: u64 = others.iter().map(|(_, b)| b).sum();

    let embedder = if a.semantic {
        Some(
            load_embedder(&config)
                .await?
                .ok_or_else(|| anyhow::anyhow!("the semantic tier is off"))?,
        )
    } else {
        None
    };
    // The backend remembers no requests: the RSS figures are the server's.
    let backend = Arc::new(ScriptedBackend::new(ScriptConfig {
        log_len: 0,
        ..ScriptConfig::default()
    }));
    let server = start_app(config, backend, embedder).await?;
    let url = server.chat_url();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency * 2)
        .tcp_nodelay(true)
        .build()?;
    // A warm-up before the start figure: every client sends a few requests at once (prompts
    // outside the soak's), so the client's pool, the server's first allocations and, with the
    // semantic tier, the embedder's working memory for full batches are part of it, not of
    // what the soak counts as growth. The entries they store are evicted like the rest.
    let warm: Vec<_> = (0..a.concurrency * 4)
        .map(|i| {
            let (client, url) = (client.clone(), url.clone());
            let content = format!(
                "warm-up {i}: {}",
                prompt(u64::MAX - i as u64, a.prompt_bytes)
            );
            tokio::spawn(async move {
                let body =
                    json!({"model": "fake", "messages": [{"role": "user", "content": content}]});
                let sent = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.to_string())
                    .send()
                    .await;
                read_answer(sent).await.is_ok()
            })
        })
        .collect();
    for w in warm {
        anyhow::ensure!(w.await?, "the server did not answer the warm-up");
    }
    let (rss_start, _) = rss();
    let heap_start = heap_in_use();
    let mode = if a.semantic {
        "semantic tier on (real embedder)"
    } else {
        "semantic tier off"
    };
    eprintln!(
        "soak: {} prompts of {} bytes, {} clients, memory budget {} MiB, {mode}; RSS at start {:.0} MiB",
        a.prompts,
        a.prompt_bytes,
        a.concurrency,
        a.memory_mb,
        mib(rss_start)
    );

    let next = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let peak_sampled = Arc::new(AtomicU64::new(rss_start));
    let t0 = Instant::now();

    // Samples RSS every 200 ms (the peak) and prints progress every `--progress-secs`.
    let monitor = {
        let (answered, failed, done, peak) = (
            answered.clone(),
            failed.clone(),
            done.clone(),
            peak_sampled.clone(),
        );
        let state = server.state.clone();
        let every = Duration::from_secs(a.progress_secs.max(1));
        let total = a.prompts;
        tokio::spawn(async move {
            let mut next_report = Instant::now() + every;
            while !done.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let (now_rss, _) = rss();
                peak.fetch_max(now_rss, Ordering::SeqCst);
                if Instant::now() >= next_report {
                    next_report += every;
                    let s = store(&state);
                    let sent = answered.load(Ordering::SeqCst) + failed.load(Ordering::SeqCst);
                    eprintln!(
                        "  {:>6.0} s  sent {sent}/{total} ({:.0}/s), failed {}, entries held {}, weighted {:.1} MiB, indexed {}, RSS {:.1} MiB, heap in use {:.1} MiB",
                        t0.elapsed().as_secs_f64(),
                        sent as f64 / t0.elapsed().as_secs_f64(),
                        failed.load(Ordering::SeqCst),
                        s.entry_count(),
                        mib(s.weighted_size()),
                        s.indexed(),
                        mib(now_rss),
                        mib(heap_in_use())
                    );
                }
            }
        })
    };

    let workers: Vec<_> = (0..a.concurrency)
        .map(|_| {
            let (client, url, next, answered, failed) = (
                client.clone(),
                url.clone(),
                next.clone(),
                answered.clone(),
                failed.clone(),
            );
            let (n, bytes) = (a.prompts, a.prompt_bytes);
            tokio::spawn(async move {
                let mut tally = Tally::default();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let body = json!({"model": "fake", "messages": [{"role": "user", "content": prompt(i, bytes)}]})
                        .to_string();
                    let sent = client
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await;
                    match read_answer(sent).await {
                        Ok((headers, _)) => {
                            let outcome = headers
                                .get(CACHE_HEADER)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("none")
                                .to_string();
                            *tally.outcomes.entry(outcome).or_default() += 1;
                            answered.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(f) => {
                            tally.failed.count(f);
                            failed.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                tally
            })
        })
        .collect();
    let mut tally = Tally::default();
    for w in workers {
        let t = w.await?;
        for (k, v) in t.outcomes {
            *tally.outcomes.entry(k).or_default() += v;
        }
        tally.failed.add(t.failed);
    }
    let wall = t0.elapsed().as_secs_f64();
    let s = store(&server.state);
    s.run_pending_tasks().await;
    done.store(true, Ordering::SeqCst);
    monitor.await?;
    let (rss_end, hwm) = rss();
    let heap_end = heap_in_use();
    let peak = peak_sampled.load(Ordering::SeqCst).max(rss_end);
    let held = s.entry_count();
    let weighted = s.weighted_size();
    let indexed = s.indexed();
    let misses = tally.outcomes.get("miss").copied().unwrap_or(0);
    let answered = answered.load(Ordering::SeqCst);

    let overhead = a.overhead_mb.map_or(rss_start, |m| m * 1024 * 1024);
    let overhead_label = if a.overhead_mb.is_some() {
        "stated with --overhead-mb"
    } else {
        "the RSS measured at start"
    };
    let allowed = budget + key_budget + others_total + overhead;
    let per = |bytes: u64| bytes as f64 / held.max(1) as f64;
    let outcomes: Vec<String> = tally
        .outcomes
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();

    println!("== reprise bench soak ==");
    println!(
        "{} distinct prompts of {} bytes, {} clients, cache.memory_bytes {} MiB (entries; exact keys up to {} MiB more), {mode}, no Redis",
        a.prompts,
        a.prompt_bytes,
        a.concurrency,
        a.memory_mb,
        mib(key_budget)
    );
    println!(
        "    sent in {wall:.1} s ({:.0} answered/s); answers: {}; {}",
        answered as f64 / wall.max(1e-9),
        if outcomes.is_empty() {
            "none".to_string()
        } else {
            outcomes.join(", ")
        },
        tally.failed
    );
    println!(
        "    memory tier: {held} entries held, weighted {:.1} MiB of {} MiB ({:.0}%); {} evicted (misses not held); {indexed} vectors indexed",
        mib(weighted),
        a.memory_mb,
        100.0 * weighted as f64 / budget as f64,
        misses.saturating_sub(held)
    );
    println!(
        "    RSS: at start {:.1} MiB, at end {:.1} MiB, peak {:.1} MiB (sampled every 200 ms; VmHWM {:.1} MiB)",
        mib(rss_start),
        mib(rss_end),
        mib(peak),
        mib(hwm)
    );
    println!(
        "    heap in use (malloc's live bytes): at start {:.1} MiB, at end {:.1} MiB; RSS at end beyond it {:.1} MiB (free memory malloc keeps, code, stacks)",
        mib(heap_start),
        mib(heap_end),
        mib(rss_end.saturating_sub(heap_end))
    );
    println!(
        "    RSS minus budget (fixed overhead): at end {:.1} MiB, at peak {:.1} MiB",
        (rss_end as f64 - budget as f64) / (1024.0 * 1024.0),
        (peak as f64 - budget as f64) / (1024.0 * 1024.0)
    );
    println!(
        "    per entry held: {:.0} bytes weighted, {:.0} bytes of RSS growth since start, {:.0} bytes of RSS at end",
        per(weighted),
        per(rss_end.saturating_sub(rss_start)),
        per(rss_end)
    );
    let verdict = if peak <= allowed {
        format!("within, {:.1} MiB to spare", mib(allowed - peak))
    } else {
        format!("OVER by {:.1} MiB", mib(peak - allowed))
    };
    let listed: Vec<String> = others
        .iter()
        .map(|(what, b)| format!("{what} {:.0}", mib(*b)))
        .collect();
    println!(
        "    other stores' budgets (MiB): {}",
        if listed.is_empty() {
            "none".to_string()
        } else {
            listed.join(", ")
        }
    );
    println!(
        "    peak RSS {:.1} MiB against budget {} MiB + keys {:.0} MiB + other stores {:.0} MiB + fixed overhead {:.1} MiB ({overhead_label}) = {:.1} MiB: {verdict}",
        mib(peak),
        a.memory_mb,
        mib(key_budget),
        mib(others_total),
        mib(overhead),
        mib(allowed)
    );
    if weighted < budget * 9 / 10 {
        println!(
            "    note: the memory tier never came near its budget ({:.0}%): send more or longer prompts, or lower --memory-mb, to test the bound",
            100.0 * weighted as f64 / budget as f64
        );
    }
    drop(server);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_are_distinct_deterministic_and_sized() {
        let longest = WORDS.iter().map(|w| w.len()).max().unwrap();
        let mut seen = std::collections::HashSet::new();
        for i in 0..2000 {
            let p = prompt(i, 256);
            assert_eq!(p, prompt(i, 256));
            assert!(
                p.len() >= 256 && p.len() <= 256 + longest + 1,
                "{}",
                p.len()
            );
            assert!(seen.insert(p));
        }
        // Shorter than its own number: just the number.
        assert_eq!(prompt(7, 0), "soak prompt 7:");
    }
}
