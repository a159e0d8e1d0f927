//! `reprise-bench replay`: plays recorded support sessions through two in-process reprise
//! servers side by side, one with prefetch off and one with it on, and reports hit rates
//! (exact, semantic, prefetch; by turn depth), interactive latency, the compute prefetch
//! spent and how much of it was never used.
//!
//! Each session is one multi-turn conversation: every request carries the earlier user turns
//! and the answers reprise served as assistant turns, so follow-ups are linked through the
//! conversation history (no session header). Each side has its own server state, its own
//! backend and its own embedder instance, so the "off" side never waits on the "on" side's
//! backend or embedder (they still share the machine's cores unless `--sequential`). The
//! backend is the scripted one with a per-token delay, by default with unlimited capacity
//! (every stream sleeps on its own, so background generations cannot delay interactive ones);
//! with `--backend-slots N` it runs at most N generations at once and the rest queue by
//! priority (interactive first; a background generation holding a slot that a user request
//! needs is preempted), so prefetch competes with live traffic for a busy backend and tells
//! its capacity to the prefetcher (`prefetch.max_capacity_share`). `--backend llama` serves a real
//! model instead (`--backend-slots` is then its `parallel`).
//!
//! The scripted answer starts with `You asked: <question>` and then pads to a realistic
//! length, so every answer names the question it was generated for; a hit whose question
//! belongs to another intent than the turn's (per the session file's labels) is a false hit.
//! A real model's answers do not name their question, so with `--backend llama` false hits
//! are not judged.
//! The session file's format is described next to it (`README.md`).
//!
//! `--half` plays one half of the sessions (split by session id), so a default can be tuned on
//! one half and reported on the other; `--regroup-curve` is that tuning for
//! `prefetch.regroup_score` (see [`regroup_report`]).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use futures::StreamExt;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::llama::LlamaBackend;
use reprise_backend::Backend;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::common::{
    in_tuning_half, load_embedder, naming_reply, percentile, prefetcher, sse_data, sse_text,
    start_app, BackendKind, Config, PrefetchConfig, PrefetchStats, Server, DEFAULT_NAMESPACE,
};

/// Options of `reprise-bench replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// Session file (JSON lines: `session_id`, `turns` of `intent` and `text`).
    #[arg(long)]
    sessions: PathBuf,
    /// Play only the first N sessions.
    #[arg(long)]
    limit: Option<usize>,
    /// Sessions played before measuring (the cache and the predictor learn from them).
    #[arg(long, default_value_t = 1000)]
    warmup: usize,
    /// Sessions in progress at once, per side.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Mean think time between a turn's answer and the next question, milliseconds (each
    /// pause is drawn between half and one and a half times this, the same on both sides).
    #[arg(long, default_value_t = 800)]
    think_ms: u64,
    /// Mean think time during the warm-up sessions (default: `--think-ms`). The warm-up only
    /// teaches the cache and the predictor, so a short pause there bounds the run time of
    /// realistic (long) think times; both sides get the same.
    #[arg(long)]
    warmup_think_ms: Option<u64>,
    /// The backend of both sides (one instance per side).
    #[arg(long, value_enum, default_value_t = ReplayBackend::Scripted)]
    backend: ReplayBackend,
    /// Generations the backend runs at once, per side; requests beyond wait in a queue.
    /// Scripted: unlimited when not given. Llama: its `parallel` (default: the configured one).
    #[arg(long)]
    backend_slots: Option<usize>,
    /// Play the "off" side to its end, then the "on" side, instead of both at once (neither
    /// then shares the machine with the other; both see whatever else runs on it).
    #[arg(long)]
    sequential: bool,
    /// `--backend llama`: the model file.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// `--backend llama`: decode threads per side.
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// `--backend llama`: layers offloaded to the GPU (needs the CUDA build).
    #[arg(long, default_value_t = 0)]
    n_gpu_layers: u32,
    /// Scripted backend: delay per generated token, milliseconds.
    #[arg(long, default_value_t = 3)]
    token_delay_ms: u64,
    /// Scripted backend: words of padding after the `You asked:` line (answer length).
    #[arg(long, default_value_t = 40)]
    reply_words: usize,
    /// Prefetch side: background generations at once (`prefetch.max_concurrent`).
    #[arg(long, default_value_t = 4)]
    max_concurrent: usize,
    /// Semantic similarity threshold of both sides (default: the configured default).
    #[arg(long)]
    threshold: Option<f32>,
    /// Prefetch side: `prefetch.cluster_threshold` (default: the configured default).
    #[arg(long)]
    cluster_threshold: Option<f32>,
    /// Prefetch side: `prefetch.max_wordings` (default: the configured default).
    #[arg(long)]
    max_wordings: Option<usize>,
    /// Prefetch side: `prefetch.max_backend_share` (default: the configured default).
    #[arg(long)]
    max_backend_share: Option<f64>,
    /// Prefetch side: `prefetch.max_capacity_share` (default: the configured default).
    #[arg(long)]
    max_capacity_share: Option<f64>,
    /// Prefetch side: `prefetch.regroup` (default: the configured default).
    #[arg(long)]
    regroup: Option<bool>,
    /// Prefetch side: `prefetch.min_probability` (default: the configured default).
    #[arg(long)]
    min_probability: Option<f64>,
    /// Prefetch side: `prefetch.regroup_score` (default: the configured default).
    #[arg(long)]
    regroup_score: Option<f32>,
    /// Play only one half of the sessions, split by a hash of each session id and
    /// `--split-seed` (about half each, fixed for a seed): tune on one, report the other.
    /// `--limit` and `--warmup` then count within the half.
    #[arg(long, value_enum)]
    half: Option<Half>,
    /// Seed of the `--half` split.
    #[arg(long, default_value_t = 1)]
    split_seed: u64,
    /// Tuning `prefetch.regroup_score`: play only the prefetch side, with regrouping off,
    /// then regroup its question clusters (on a copy) at scores 1.50 to 3.00 and print, for
    /// each, the clusters left and how many wordings sit in a cluster of another intent (per
    /// the session file's labels), and the lowest score meeting each `--target-misplaced`.
    #[arg(long)]
    regroup_curve: bool,
    /// With `--regroup-curve`: largest share of clustered wordings a chosen score may leave
    /// in a cluster of another intent (repeatable).
    #[arg(long, default_values_t = [0.02, 0.05])]
    target_misplaced: Vec<f64>,
    /// The sessions' domain file (`domain_dev.json`: its `transitions`). When given, the
    /// report adds a reference ceiling: what a predictor that knew the true transition table
    /// and grouped every wording of a question perfectly would reach under the same counting,
    /// with unlimited background compute (the table is never shown to reprise).
    #[arg(long)]
    domain: Option<PathBuf>,
    /// With `--domain`: print the reference ceiling for these sessions (`--warmup`,
    /// `--limit`, `--min-probability` apply) and stop, without running either side.
    #[arg(long)]
    ceiling_only: bool,
    /// Seed of the think-time draws.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as JSON here as well.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A half of the `--half` split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Half {
    /// The sessions a default is tuned on.
    Tune,
    /// The sessions it is then reported on.
    HeldOut,
}

/// The backend `reprise-bench replay` runs on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ReplayBackend {
    /// The scripted backend (answers name their question; timing from `--token-delay-ms`).
    Scripted,
    /// The llama.cpp backend with `--model`.
    Llama,
}

#[derive(Debug, Deserialize)]
struct Session {
    session_id: String,
    turns: Vec<Turn>,
}

#[derive(Debug, Deserialize)]
struct Turn {
    intent: String,
    text: String,
}

/// How one turn was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Served {
    Exact,
    Semantic,
    Prefetch,
    Miss,
    Error,
}

impl Served {
    fn parse(s: &str) -> Served {
        match s {
            "exact" => Served::Exact,
            "semantic" => Served::Semantic,
            "prefetch" => Served::Prefetch,
            "miss" | "bypass" => Served::Miss,
            _ => Served::Error,
        }
    }

    fn is_hit(self) -> bool {
        matches!(self, Served::Exact | Served::Semantic | Served::Prefetch)
    }
}

/// One measured turn.
#[derive(Debug, Clone)]
struct TurnResult {
    depth: usize,
    served: Served,
    /// The answer was generated for another intent than the turn's.
    false_hit: bool,
    total_s: f64,
    ttft_s: f64,
}

/// One side of the comparison.
struct Side {
    name: &'static str,
    url: String,
    /// The model name requests carry.
    model: String,
    server: Server,
    results: parking_lot::Mutex<Vec<TurnResult>>,
    /// Prefetch counters when the first measured session started.
    at_measure: parking_lot::Mutex<Option<PrefetchStats>>,
    done: AtomicUsize,
}

/// Runs the benchmark.
pub async fn run(a: ReplayArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&a.sessions)?;
    let mut sessions: Vec<Session> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    if let Some(half) = a.half {
        let before = sessions.len();
        sessions.retain(|s| in_tuning_half(a.split_seed, &[&s.session_id]) == (half == Half::Tune));
        eprintln!(
            "split (seed {}): {} of {before} sessions in the {half:?} half",
            a.split_seed,
            sessions.len()
        );
    }
    if let Some(n) = a.limit {
        sessions.truncate(n);
    }
    anyhow::ensure!(
        sessions.len() > a.warmup,
        "{} sessions leave none to measure after a warm-up of {}",
        sessions.len(),
        a.warmup
    );
    // Question text → intent, to tell which intent an answer was generated for.
    let mut intent_of: HashMap<String, String> = HashMap::new();
    for s in &sessions {
        for t in &s.turns {
            intent_of.insert(t.text.clone(), t.intent.clone());
        }
    }
    if a.ceiling_only {
        anyhow::ensure!(a.domain.is_some(), "--ceiling-only needs --domain");
        print_ceiling(&a, &sessions)?;
        return Ok(());
    }
    let intent_of = Arc::new(intent_of);
    let sessions = Arc::new(sessions);

    let mut base = Config::default();
    base.backend.kind = BackendKind::Fake;
    base.semantic.enabled = true;
    if let Some(t) = a.threshold {
        base.semantic.threshold = t;
    }
    let script = ScriptConfig {
        reply: naming_reply(a.reply_words),
        // Prompt processing before the first token: a few tokens' worth.
        first_token_delay: Duration::from_millis(a.token_delay_ms * 5),
        token_delay: Duration::from_millis(a.token_delay_ms),
        slots: a.backend_slots,
        ..ScriptConfig::default()
    };
    if a.backend == ReplayBackend::Llama {
        anyhow::ensure!(
            a.model.is_file(),
            "model file {} not found (run scripts/fetch-models.sh or pass --model)",
            a.model.display()
        );
    }
    let mut sides = Vec::new();
    let plays: &[(&'static str, bool)] = if a.regroup_curve {
        &[("prefetch on, regrouping off", true)]
    } else {
        &[("prefetch off", false), ("prefetch on", true)]
    };
    for &(name, prefetch) in plays {
        let mut config = base.clone();
        config.prefetch.enabled = prefetch;
        config.prefetch.max_concurrent = a.max_concurrent.max(1);
        if let Some(t) = a.cluster_threshold {
            config.prefetch.cluster_threshold = t;
        }
        if let Some(v) = a.max_backend_share {
            config.prefetch.max_backend_share = v;
        }
        if let Some(v) = a.max_capacity_share {
            config.prefetch.max_capacity_share = v;
        }
        if let Some(v) = a.regroup {
            config.prefetch.regroup = v;
        }
        if let Some(v) = a.regroup_score {
            config.prefetch.regroup_score = v;
        }
        if a.regroup_curve {
            config.prefetch.regroup = false;
        }
        if let Some(n) = a.max_wordings {
            config.prefetch.max_wordings = n;
        }
        if let Some(p) = a.min_probability {
            config.prefetch.min_probability = p;
        }
        // Its own embedder instance: the other side's embeddings never queue ahead of its own.
        eprintln!(
            "{name}: loading the embedder from {}",
            base.semantic.model_dir.display()
        );
        let embedder = load_embedder(&base)
            .await?
            .ok_or_else(|| anyhow::anyhow!("semantic tier is off"))?;
        let (backend, model): (Arc<dyn Backend>, String) = match a.backend {
            ReplayBackend::Scripted => (
                Arc::new(ScriptedBackend::new(script.clone())),
                script.model.clone(),
            ),
            ReplayBackend::Llama => {
                config.backend.kind = BackendKind::Llama;
                config.backend.model = a.model.clone();
                config.backend.n_threads = a.threads;
                config.backend.n_gpu_layers = a.n_gpu_layers;
                if let Some(n) = a.backend_slots {
                    config.backend.parallel = n.max(1);
                }
                // Room for every slot's conversation (a few turns of short answers).
                config.backend.n_ctx = (config.backend.parallel as u32 * 1024).max(4096);
                config.backend.max_queue = 4096;
                config.validate()?;
                let cfg = config.backend.llama_config();
                let model = cfg.served_name();
                eprintln!("{name}: loading {}", a.model.display());
                let engine = tokio::task::spawn_blocking(move || LlamaBackend::load(cfg))
                    .await
                    .map_err(|e| anyhow::anyhow!("model loader panicked: {e}"))??;
                (Arc::new(engine), model)
            }
        };
        let server = start_app(config, backend, Some(embedder)).await?;
        sides.push(Arc::new(Side {
            name,
            url: server.chat_url(),
            model,
            server,
            results: parking_lot::Mutex::new(Vec::new()),
            at_measure: parking_lot::Mutex::new(None),
            done: AtomicUsize::new(0),
        }));
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency * 4)
        .tcp_nodelay(true)
        .build()?;
    let backend = match a.backend {
        ReplayBackend::Scripted => format!(
            "scripted backend at {} ms/token, {} reply words, slots {}",
            a.token_delay_ms,
            a.reply_words + 3,
            a.backend_slots
                .map_or_else(|| "unlimited".to_string(), |n| n.to_string())
        ),
        ReplayBackend::Llama => format!("llama backend {}", a.model.display()),
    };
    eprintln!(
        "replaying {} sessions ({} warm-up, think {} ms), {} at a time per side, think {} ms, {backend}, sides {}",
        sessions.len(),
        a.warmup,
        a.warmup_think_ms.unwrap_or(a.think_ms),
        a.concurrency,
        a.think_ms,
        if a.sequential { "one after the other" } else { "at once" }
    );
    let started = Instant::now();
    let play = |side: &Arc<Side>| {
        tokio::spawn(play_side(
            side.clone(),
            client.clone(),
            sessions.clone(),
            intent_of.clone(),
            a.clone(),
        ))
    };
    if a.sequential {
        for side in &sides {
            play(side).await??;
        }
    } else {
        let runs: Vec<_> = sides.iter().map(play).collect();
        for r in runs {
            r.await??;
        }
    }
    eprintln!("done in {:.0} s", started.elapsed().as_secs_f64());
    if a.regroup_curve {
        return regroup_report(&a, &sides[0], &intent_of);
    }
    report(&a, &sides, &intent_of, &sessions)
}

/// Plays every session on one side, `concurrency` at a time, in file order.
async fn play_side(
    side: Arc<Side>,
    client: reqwest::Client,
    sessions: Arc<Vec<Session>>,
    intent_of: Arc<HashMap<String, String>>,
    a: ReplayArgs,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(a.concurrency.max(1)));
    let mut tasks = Vec::with_capacity(sessions.len());
    let total = sessions.len();
    for i in 0..total {
        let permit = slots.clone().acquire_owned().await?;
        if i == a.warmup {
            *side.at_measure.lock() = prefetcher(&side.server.state).map(|p| p.stats());
        }
        let (side, client, sessions, intent_of, a) = (
            side.clone(),
            client.clone(),
            sessions.clone(),
            intent_of.clone(),
            a.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let out = play_session(&side, &client, &sessions[i], i, &intent_of, &a).await;
            drop(permit);
            let done = side.done.fetch_add(1, Ordering::Relaxed) + 1;
            if done % 100 == 0 || done == total {
                eprintln!("  {}: {done}/{total} sessions", side.name);
            }
            out
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

/// A deterministic draw in [0, 1) for (seed, session, turn): both sides pause alike.
fn unit(seed: u64, session: usize, turn: usize) -> f64 {
    // splitmix64
    let mut z = seed
        .wrapping_add((session as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add((turn as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// Plays one session as a multi-turn conversation.
async fn play_session(
    side: &Side,
    client: &reqwest::Client,
    session: &Session,
    index: usize,
    intent_of: &HashMap<String, String>,
    a: &ReplayArgs,
) -> anyhow::Result<()> {
    let measured = index >= a.warmup;
    let mut messages: Vec<Value> = Vec::new();
    for (depth, turn) in session.turns.iter().enumerate() {
        if depth > 0 {
            let mean = if measured {
                a.think_ms
            } else {
                a.warmup_think_ms.unwrap_or(a.think_ms)
            };
            let pause = mean as f64 * (0.5 + unit(a.seed, index, depth));
            tokio::time::sleep(Duration::from_secs_f64(pause / 1000.0)).await;
        }
        messages.push(json!({"role": "user", "content": turn.text}));
        let body = match a.backend {
            ReplayBackend::Scripted => {
                json!({"model": side.model, "messages": messages, "stream": true})
            }
            // A real model writes until it stops; answers of about the scripted length.
            ReplayBackend::Llama => json!({"model": side.model, "messages": messages,
                "stream": true, "max_tokens": a.reply_words + 20}),
        };
        let t = Instant::now();
        let (served, ttft, answer) = match client.post(&side.url).json(&body).send().await {
            Ok(r) if r.status().is_success() => {
                let served = Served::parse(
                    r.headers()
                        .get("x-reprise-cache")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or(""),
                );
                let mut stream = r.bytes_stream();
                let mut body = Vec::new();
                let mut ttft = None;
                let mut broke = false;
                while let Some(chunk) = stream.next().await {
                    let Ok(chunk) = chunk else {
                        broke = true;
                        break;
                    };
                    ttft.get_or_insert_with(|| t.elapsed().as_secs_f64());
                    body.extend_from_slice(&chunk);
                }
                let data = sse_data(&String::from_utf8_lossy(&body));
                // A stream cut short, or one that reported an error in-band, is a failed turn
                // (counted as an error, not timed), not a miss or a hit.
                if broke
                    || !data.iter().any(|d| d == "[DONE]")
                    || data.iter().any(|d| {
                        serde_json::from_str::<Value>(d).is_ok_and(|v| v.get("error").is_some())
                    })
                {
                    (Served::Error, f64::NAN, String::new())
                } else {
                    (served, ttft.unwrap_or(f64::NAN), sse_text(&data))
                }
            }
            _ => (Served::Error, f64::NAN, String::new()),
        };
        let total_s = t.elapsed().as_secs_f64();
        // The question the answer was generated for, and so its intent.
        let asked = answer
            .strip_prefix("You asked: ")
            .and_then(|s| s.split('\n').next())
            .unwrap_or("");
        let false_hit = a.backend == ReplayBackend::Scripted
            && served.is_hit()
            && intent_of.get(asked) != Some(&turn.intent);
        if measured {
            side.results.lock().push(TurnResult {
                depth: depth + 1,
                served,
                false_hit,
                total_s,
                ttft_s: ttft,
            });
        }
        if served == Served::Error {
            // The conversation cannot go on without an answer.
            break;
        }
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(())
}

/// Summary of one side.
#[derive(Debug, Clone, Default)]
struct Summary {
    turns: usize,
    exact: usize,
    semantic: usize,
    prefetch: usize,
    misses: usize,
    errors: usize,
    false_hits: usize,
    p50: f64,
    p95: f64,
    ttft50: f64,
    ttft95: f64,
    by_depth: Vec<(usize, usize, usize)>,
    spent: PrefetchStats,
    whole: PrefetchStats,
}

impl Summary {
    fn hits(&self) -> usize {
        self.exact + self.semantic + self.prefetch
    }

    fn hit_rate(&self) -> f64 {
        self.hits() as f64 / self.turns.max(1) as f64
    }

    /// Correct hits only (a false hit served the wrong answer).
    fn correct_rate(&self) -> f64 {
        (self.hits() - self.false_hits) as f64 / self.turns.max(1) as f64
    }

    /// Prefetches generated in the measured part less the turns a prefetch served there
    /// (entries prefetched in the warm-up included), over those generated: the waste as the
    /// reference ceiling also counts it. Not "never used" per entry: a warm-up entry's use
    /// offsets a measured one's waste (the prefetcher's counts do not say which entry served).
    fn unused_share(&self) -> f64 {
        let made = self.spent.completed;
        if made == 0 {
            return 0.0;
        }
        made.saturating_sub(self.spent.hits) as f64 / made as f64
    }
}

fn delta(end: &PrefetchStats, start: &PrefetchStats) -> PrefetchStats {
    PrefetchStats {
        predictions: end.predictions - start.predictions,
        queued: end.queued - start.queued,
        started: end.started - start.started,
        completed: end.completed - start.completed,
        skipped: end.skipped - start.skipped,
        cancelled: end.cancelled - start.cancelled,
        preempted: end.preempted - start.preempted,
        hits: end.hits - start.hits,
        wasted: end.wasted - start.wasted,
        tokens: end.tokens - start.tokens,
        backend_seconds: end.backend_seconds - start.backend_seconds,
        ..*end
    }
}

fn summarise(side: &Side) -> Summary {
    let results = side.results.lock().clone();
    let mut s = Summary {
        turns: results.len(),
        ..Summary::default()
    };
    for r in &results {
        match r.served {
            Served::Exact => s.exact += 1,
            Served::Semantic => s.semantic += 1,
            Served::Prefetch => s.prefetch += 1,
            Served::Miss => s.misses += 1,
            Served::Error => s.errors += 1,
        }
        s.false_hits += usize::from(r.false_hit);
        let d = r.depth;
        if s.by_depth.len() < d {
            s.by_depth.resize(d, (0, 0, 0));
        }
        s.by_depth[d - 1].0 += 1;
        s.by_depth[d - 1].1 += usize::from(r.served.is_hit());
        s.by_depth[d - 1].2 += usize::from(r.served == Served::Prefetch);
    }
    let ok: Vec<&TurnResult> = results
        .iter()
        .filter(|r| r.served != Served::Error)
        .collect();
    let lat: Vec<f64> = ok.iter().map(|r| r.total_s).collect();
    let ttft: Vec<f64> = ok
        .iter()
        .map(|r| r.ttft_s)
        .filter(|t| t.is_finite())
        .collect();
    s.p50 = percentile(&lat, 50.0);
    s.p95 = percentile(&lat, 95.0);
    s.ttft50 = percentile(&ttft, 50.0);
    s.ttft95 = percentile(&ttft, 95.0);
    if let Some(p) = prefetcher(&side.server.state) {
        let end = p.stats();
        let start = side.at_measure.lock().unwrap_or_default();
        s.spent = delta(&end, &start);
        s.whole = end;
    }
    s
}

fn pct(x: f64) -> String {
    format!("{:5.1} %", x * 100.0)
}

fn ms(x: f64) -> String {
    format!("{:7.1} ms", x * 1000.0)
}

/// How the prefetch side's question clusters split by intent: clusters, wordings clustered,
/// and clusters whose wordings belong to more than one intent (each such wording can be
/// served another intent's prefetched answer).
fn cluster_purity(
    side: &Side,
    intent_of: &HashMap<String, String>,
) -> Option<(usize, usize, usize)> {
    let p = prefetcher(&side.server.state)?;
    let clusters = p.clusters(DEFAULT_NAMESPACE);
    let wordings = clusters.iter().map(Vec::len).sum();
    let mixed = clusters
        .iter()
        .filter(|c| {
            let mut intents: Vec<&String> = c.iter().filter_map(|w| intent_of.get(w)).collect();
            intents.sort();
            intents.dedup();
            intents.len() > 1
        })
        .count();
    Some((clusters.len(), wordings, mixed))
}

/// The question clusters regrouping leaves at one score, judged by the turns' intents.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Grouping {
    score: f32,
    clusters: usize,
    /// Clusters holding wordings of more than one intent.
    mixed: usize,
    /// Wordings clustered (of a known intent).
    wordings: usize,
    /// Wordings not of their cluster's most common intent: each can be served another
    /// intent's prefetched answer.
    misplaced: usize,
    /// Intents (with a clustered wording).
    intents: usize,
}

impl Grouping {
    fn misplaced_share(&self) -> f64 {
        self.misplaced as f64 / self.wordings.max(1) as f64
    }

    /// Clusters per intent: 1.0 is every intent in one cluster (mixed ones count for each
    /// intent they hold).
    fn spread(&self) -> f64 {
        (self.clusters + self.mixed) as f64 / self.intents.max(1) as f64
    }
}

/// Judges `clusters` (each a list of wordings) by `intent_of`; wordings of unknown intent are
/// left out.
fn judge_grouping(
    score: f32,
    clusters: &[Vec<String>],
    intent_of: &HashMap<String, String>,
) -> Grouping {
    let mut g = Grouping {
        score,
        clusters: clusters.len(),
        mixed: 0,
        wordings: 0,
        misplaced: 0,
        intents: 0,
    };
    let mut intents = std::collections::HashSet::new();
    for c in clusters {
        let mut count: HashMap<&str, usize> = HashMap::new();
        for w in c {
            if let Some(i) = intent_of.get(w) {
                *count.entry(i.as_str()).or_default() += 1;
                intents.insert(i.as_str());
            }
        }
        let total: usize = count.values().sum();
        let most = count.values().copied().max().unwrap_or(0);
        g.wordings += total;
        g.misplaced += total - most;
        g.mixed += usize::from(count.len() > 1);
    }
    g.intents = intents.len();
    g
}

/// The lowest score of `curve` (ascending scores) whose misplaced wordings are at most
/// `target` of those clustered.
fn choose_score(curve: &[Grouping], target: f64) -> Option<Grouping> {
    curve
        .iter()
        .find(|g| g.wordings > 0 && g.misplaced as f64 <= target * g.wordings as f64)
        .copied()
}

/// `--regroup-curve`: the prefetch side's question clusters (learned with regrouping off)
/// regrouped at each score, judged by intent; the chosen score for each `--target-mixed` and
/// the configured score's point.
fn regroup_report(
    a: &ReplayArgs,
    side: &Side,
    intent_of: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let p = prefetcher(&side.server.state)
        .ok_or_else(|| anyhow::anyhow!("the prefetch side has no prefetcher"))?;
    let configured = side.server.state.config.prefetch.regroup_score;
    let at = |score: f32| {
        judge_grouping(
            score,
            &p.regrouped_clusters(DEFAULT_NAMESPACE, score),
            intent_of,
        )
    };
    eprintln!("regrouping at 31 scores");
    let curve: Vec<Grouping> = (30..=60).map(|i| at(i as f32 * 0.05)).collect();
    let alone = judge_grouping(f32::INFINITY, &p.clusters(DEFAULT_NAMESPACE), intent_of);
    println!("== reprise bench replay --regroup-curve ==");
    println!(
        "sessions played {}{}; intents {}, wordings clustered {}",
        side.done.load(Ordering::Relaxed),
        a.half
            .map(|h| format!(" ({h:?} half, split seed {})", a.split_seed))
            .unwrap_or_default(),
        alone.intents,
        alone.wordings
    );
    println!(
        "score | clusters | clusters per intent | clusters mixing intents | wordings misplaced"
    );
    let line = |g: &Grouping| {
        format!(
            "{} | {} | {:.2} | {} | {} ({})",
            if g.score.is_finite() {
                format!("{:.2}", g.score)
            } else {
                "none (embedding alone)".into()
            },
            g.clusters,
            g.spread(),
            g.mixed,
            g.misplaced,
            pct(g.misplaced_share()).trim()
        )
    };
    println!("{}", line(&alone));
    for g in &curve {
        println!("{}", line(g));
    }
    let conf = at(configured);
    println!("configured regroup_score: {}", line(&conf));
    let mut chosen = Vec::new();
    for &target in &a.target_misplaced {
        match choose_score(&curve, target) {
            Some(g) => {
                println!("target misplaced <= {:.1} %: {}", target * 100.0, line(&g));
                chosen.push(json!({"target_misplaced": target, "score": g.score}));
            }
            None => println!(
                "target misplaced <= {:.1} %: no score up to 3.00 meets it",
                target * 100.0
            ),
        }
    }
    if let Some(path) = &a.json {
        let point = |g: &Grouping| {
            json!({"score": g.score, "clusters": g.clusters, "mixed": g.mixed,
                "wordings": g.wordings, "misplaced": g.misplaced, "intents": g.intents})
        };
        let out = json!({
            "half": a.half.map(|h| format!("{h:?}")), "split_seed": a.split_seed,
            "embedding_alone": point(&alone),
            "configured": point(&conf),
            "curve": curve.iter().map(point).collect::<Vec<_>>(),
            "chosen": chosen,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

fn report(
    a: &ReplayArgs,
    sides: &[Arc<Side>],
    intent_of: &HashMap<String, String>,
    sessions: &[Session],
) -> anyhow::Result<()> {
    let sums: Vec<Summary> = sides.iter().map(|s| summarise(s)).collect();
    println!("== reprise bench replay ==");
    println!(
        "measured: {} turns per side (sessions {}..), multi-turn conversations; backend slots {}; sides {}",
        sums[0].turns,
        a.warmup,
        a.backend_slots
            .map_or_else(|| "unlimited".to_string(), |n| n.to_string()),
        if a.sequential { "one after the other" } else { "at once" }
    );
    for (side, s) in sides.iter().zip(&sums) {
        println!("-- {} --", side.name);
        println!(
            "hit rate {}  (exact {}, semantic {}, prefetch {})  misses {}  errors {}",
            pct(s.hit_rate()),
            pct(s.exact as f64 / s.turns.max(1) as f64),
            pct(s.semantic as f64 / s.turns.max(1) as f64),
            pct(s.prefetch as f64 / s.turns.max(1) as f64),
            s.misses,
            s.errors
        );
        if a.backend == ReplayBackend::Scripted {
            println!(
                "false hits {} ({} of hits); correct-hit rate {}",
                s.false_hits,
                pct(s.false_hits as f64 / s.hits().max(1) as f64),
                pct(s.correct_rate())
            );
        } else {
            println!("false hits not judged (a real model's answers do not name their question)");
        }
        println!(
            "latency p50 {}  p95 {}   TTFT p50 {}  p95 {}",
            ms(s.p50),
            ms(s.p95),
            ms(s.ttft50),
            ms(s.ttft95)
        );
        let depth: Vec<String> = s
            .by_depth
            .iter()
            .enumerate()
            .map(|(i, (n, h, p))| {
                format!(
                    "{}:{}{}",
                    i + 1,
                    pct(*h as f64 / (*n).max(1) as f64).trim(),
                    if *p > 0 {
                        format!(" ({} pf)", pct(*p as f64 / (*n).max(1) as f64).trim())
                    } else {
                        String::new()
                    }
                )
            })
            .collect();
        println!("hit rate by turn depth: {}", depth.join("  "));
        if prefetcher(&side.server.state).is_some() {
            let p = &s.spent;
            println!(
                "prefetch (measured part): {} predicted, {} queued, {} started, {} generated, {} already cached, {} cancelled ({} preempted); {:.1} backend s, {} tokens; {} used, unused {}",
                p.predictions, p.queued, p.started, p.completed, p.skipped, p.cancelled, p.preempted,
                p.backend_seconds, p.tokens, p.hits, pct(s.unused_share())
            );
            let w = &s.whole;
            println!(
                "prefetch (whole run): {} generated, {} used, {:.1} backend s, {} tokens, {} observations dropped",
                w.completed, w.hits, w.backend_seconds, w.tokens, w.observations_dropped
            );
            if let Some((n, words, mixed)) = cluster_purity(side, intent_of) {
                println!("question clusters: {n} holding {words} wordings; {mixed} mix intents");
            }
        }
    }
    let (off, on) = (&sums[0], &sums[1]);
    let hit_ratio = on.correct_rate() / off.correct_rate().max(1e-9);
    let p95_ratio = on.p95 / off.p95;
    let ttft_ratio = on.ttft95 / off.ttft95;
    println!("-- ratios (on / off) --");
    println!("correct-hit rate {hit_ratio:.2}x  (goal >= 1.5x)");
    println!("latency p95 {p95_ratio:.3}x  (goal <= 1.05x);  TTFT p95 {ttft_ratio:.3}x");
    println!(
        "prefetch unused (measured part: generated less served, over generated) {}  (goal <= 50 %)",
        pct(on.unused_share())
    );
    let ceiling = print_ceiling(a, sessions)?;
    if let Some(path) = &a.json {
        let side = |s: &Summary| {
            json!({"turns": s.turns, "hit_rate": s.hit_rate(), "correct_hit_rate": s.correct_rate(),
                   "exact": s.exact, "semantic": s.semantic, "prefetch": s.prefetch,
                   "misses": s.misses, "errors": s.errors, "false_hits": s.false_hits,
                   "p50_s": s.p50, "p95_s": s.p95, "ttft_p50_s": s.ttft50, "ttft_p95_s": s.ttft95,
                   "by_depth": s.by_depth.iter().map(|(n, h, p)| json!({"turns": n, "hits": h, "prefetch": p})).collect::<Vec<_>>(),
                   "prefetch_generated": s.spent.completed, "prefetch_used": s.spent.hits,
                   "prefetch_preempted": s.spent.preempted,
                   "prefetch_backend_s": s.spent.backend_seconds, "prefetch_tokens": s.spent.tokens,
                   "prefetch_unused_share": s.unused_share()})
        };
        let out = json!({"backend": format!("{:?}", a.backend).to_lowercase(),
                         "backend_slots": a.backend_slots, "sequential": a.sequential,
                         "token_delay_ms": a.token_delay_ms,
                         "off": side(off), "on": side(on), "hit_ratio": hit_ratio,
                         "p95_ratio": p95_ratio, "ttft_p95_ratio": ttft_ratio,
                         "ceiling": ceiling.map(|c| json!({"histories": "as_worded", "off": c.off, "on": c.on, "unused": c.unused,
                                                          "never_used": c.never_used}))});
        std::fs::write(path, serde_json::to_string_pretty(&out)?)?;
    }
    Ok(())
}

/// Computes and prints the reference ceiling when `--domain` is given.
fn print_ceiling(a: &ReplayArgs, sessions: &[Session]) -> anyhow::Result<Option<Ceiling>> {
    let Some(path) = &a.domain else {
        return Ok(None);
    };
    let domain: Domain = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let cfg = PrefetchConfig::default();
    let min_p = a.min_probability.unwrap_or(cfg.min_probability);
    let mut first = None;
    for (histories, label) in [
        (
            Histories::AsWorded,
            "histories matched as worded, as reprise's partitions",
        ),
        (
            Histories::ByIntent,
            "histories matched by intent, perfect context equivalence",
        ),
    ] {
        let c = ceiling(
            sessions,
            a.warmup,
            &domain,
            min_p,
            cfg.max_predictions,
            histories,
        );
        println!(
            "reference ceiling (true transition table, every wording of a question matched, {label}, \
             unlimited compute; min_probability {min_p}): hit rate {} -> {} = {:.2}x, \
             unused {} (counted as the run counts), never used {}",
            pct(c.off),
            pct(c.on),
            c.on / c.off.max(1e-9),
            pct(c.unused),
            pct(c.never_used)
        );
        first.get_or_insert(c);
    }
    let c = first.expect("two ceilings");
    Ok(Some(c))
}

/// How the reference ceiling matches two conversations' histories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Histories {
    /// The same questions in the same words.
    AsWorded,
    /// The same questions in any words.
    ByIntent,
}

/// The sessions' domain, as far as the reference ceiling needs it.
#[derive(Debug, Deserialize)]
struct Domain {
    /// Intent → next intent (or `END`) → probability.
    transitions: HashMap<String, HashMap<String, f64>>,
}

/// Hit rates of the reference ceiling over the measured sessions, counted as the run counts
/// its own (see [`ceiling`]).
#[derive(Debug, Clone, Copy)]
struct Ceiling {
    /// Turns the cache alone answers: the same question (any wording) asked before in the same
    /// context. The run's "off" side counts exact and semantic hits alike.
    off: f64,
    /// Turns the cache or a prefetch answers.
    on: f64,
    /// As the run reports it: prefetches generated in the measured part less the turns a
    /// prefetch served there (warm-up prefetches included), over those generated.
    unused: f64,
    /// Prefetches generated in the measured part that no turn ever used, over those
    /// generated (each generation followed to the end).
    never_used: f64,
}

/// Replays the sessions on paper with a perfect semantic cache and the true transition
/// table, counted as the run counts:
///
/// - A turn's context is its history (empty for a first turn), so sessions whose histories
///   match share answers, as reprise's partitions do. [`Histories::AsWorded`] matches
///   histories by their wordings (reprise's partitions without context equivalence);
///   [`Histories::ByIntent`] by the questions they asked, whatever the wording (perfect
///   context equivalence: an upper bound).
/// - The cache alone answers a turn whose intent was asked before in its context, whatever
///   the wording (the run's "off" side counts semantic hits too).
/// - After every turn of intent `X`, the (at most `max_predictions`) intents with a true
///   probability of at least `min_p` are prefetched in the new context, each generated once
///   and only when the cache does not already hold it; a prefetch is credited only for a turn
///   the cache alone would have missed. Before the second turn, `END` is impossible and left
///   out, as the session generator does.
/// - Generations are counted as the run counts completed prefetches (see [`Ceiling`]).
fn ceiling(
    sessions: &[Session],
    warmup: usize,
    domain: &Domain,
    min_p: f64,
    max_predictions: usize,
    histories: Histories,
) -> Ceiling {
    use std::collections::HashSet;
    let predict = |intent: &str, first: bool| -> Vec<&str> {
        let Some(row) = domain.transitions.get(intent) else {
            return Vec::new();
        };
        let total: f64 = row
            .iter()
            .filter(|(k, _)| !(first && k.as_str() == "END"))
            .map(|(_, v)| v)
            .sum();
        let mut p: Vec<(f64, &str)> = row
            .iter()
            .filter(|(k, _)| k.as_str() != "END")
            .map(|(k, v)| (v / total.max(1e-12), k.as_str()))
            .filter(|(p, _)| *p >= min_p)
            .collect();
        p.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
        p.into_iter()
            .take(max_predictions)
            .map(|(_, k)| k)
            .collect()
    };
    // (context, intent): what the cache holds, answered by a turn or a prefetch.
    type Key<'a> = (Vec<&'a str>, &'a str);
    let mut asked: HashSet<Key> = HashSet::new();
    // Prefetched entries not yet asked for, and whether each was generated in the measured
    // part.
    let mut pending: HashMap<Key, bool> = HashMap::new();
    let (mut n, mut off, mut on) = (0usize, 0usize, 0usize);
    let (mut generated, mut served, mut used_of_measured) = (0usize, 0usize, 0usize);
    for (si, s) in sessions.iter().enumerate() {
        let measured = si >= warmup;
        let mut path: Vec<&str> = Vec::new();
        for (t, turn) in s.turns.iter().enumerate() {
            let key = (path.clone(), turn.intent.as_str());
            let cached = asked.contains(&key);
            let prefetched = !cached && pending.contains_key(&key);
            if measured {
                n += 1;
                off += usize::from(cached);
                on += usize::from(cached || prefetched);
                served += usize::from(prefetched);
            }
            if let Some(of_measured) = pending.remove(&key) {
                used_of_measured += usize::from(of_measured);
            }
            asked.insert(key);
            path.push(match histories {
                Histories::AsWorded => turn.text.as_str(),
                Histories::ByIntent => turn.intent.as_str(),
            });
            for y in predict(&turn.intent, t == 0) {
                let k = (path.clone(), y);
                if !asked.contains(&k) && !pending.contains_key(&k) {
                    pending.insert(k, measured);
                    generated += usize::from(measured);
                }
            }
        }
    }
    let share = |x: usize| x as f64 / generated.max(1) as f64;
    Ceiling {
        off: off as f64 / n.max(1) as f64,
        on: on as f64 / n.max(1) as f64,
        unused: share(generated.saturating_sub(served)),
        never_used: share(generated - used_of_measured),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grouping_is_judged_by_intent_and_the_lowest_safe_score_chosen() {
        let intent_of: HashMap<String, String> = [
            ("a1", "A"),
            ("a2", "A"),
            ("a3", "A"),
            ("b1", "B"),
            ("b2", "B"),
        ]
        .into_iter()
        .map(|(w, i)| (w.to_string(), i.to_string()))
        .collect();
        let c = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        // A split in two, B whole: nothing misplaced, 3 clusters for 2 intents.
        let split = judge_grouping(
            2.8,
            &[c(&["a1", "a2"]), c(&["a3"]), c(&["b1", "b2"])],
            &intent_of,
        );
        assert_eq!(
            (split.clusters, split.mixed, split.misplaced, split.wordings),
            (3, 0, 0, 5)
        );
        assert!((split.spread() - 1.5).abs() < 1e-9);
        // a3 joins B's cluster: one wording misplaced (the minority), one mixed cluster; an
        // unknown wording counts nowhere.
        let mixed = judge_grouping(
            2.2,
            &[c(&["a1", "a2"]), c(&["b1", "b2", "a3", "stray"])],
            &intent_of,
        );
        assert_eq!(
            (mixed.clusters, mixed.mixed, mixed.misplaced, mixed.wordings),
            (2, 1, 1, 5)
        );
        let whole = judge_grouping(2.5, &[c(&["a1", "a2", "a3"]), c(&["b1", "b2"])], &intent_of);
        assert!((whole.spread() - 1.0).abs() < 1e-9);
        let curve = [mixed, whole, split];
        assert_eq!(choose_score(&curve, 0.25).map(|g| g.score), Some(2.2));
        assert_eq!(choose_score(&curve, 0.1).map(|g| g.score), Some(2.5));
        assert_eq!(choose_score(&curve[..1], 0.1), None);
    }

    #[test]
    fn the_split_is_fixed_by_its_seed_and_halves_the_sessions() {
        let ids: Vec<String> = (0..2000).map(|i| format!("s{i:05}")).collect();
        let tune = |seed| {
            ids.iter()
                .filter(|id| in_tuning_half(seed, &[id.as_str()]))
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(tune(1), tune(1));
        assert_ne!(tune(1), tune(2));
        let n = tune(1).len();
        assert!((900..=1100).contains(&n), "{n} of 2000 in the tuning half");
    }

    fn session(turns: &[(&str, &str)]) -> Session {
        Session {
            session_id: String::new(),
            turns: turns
                .iter()
                .map(|(i, t)| Turn {
                    intent: (*i).into(),
                    text: (*t).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_ceiling_counts_like_the_run() {
        let domain: Domain = serde_json::from_str(
            r#"{"transitions": {"A": {"B": 0.6, "C": 0.1, "END": 0.3}, "B": {"END": 1.0},
                                "C": {"B": 0.5, "END": 0.5}}}"#,
        )
        .unwrap();
        let sessions = [
            // Warm-up: prefetches B (and, at 0.1, C) after A.
            session(&[("A", "a1")]),
            // A in other words: the cache answers (any wording, shared first context); B
            // was prefetched in the warm-up after the same history.
            session(&[("A", "a2"), ("B", "b1")]),
            // A again; C is prefetched only at the lower bar.
            session(&[("A", "a1"), ("C", "c1")]),
            // A new first question: a miss; B is generated after it and never asked.
            session(&[("C", "c2")]),
        ];
        let c = ceiling(&sessions, 1, &domain, 0.2, 3, Histories::ByIntent);
        // Five measured turns: A, A cached; B served by the warm-up's prefetch; C, C missed.
        assert!((c.off - 0.4).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.6).abs() < 1e-9, "{c:?}");
        // B is generated after each measured C and never asked: as the run counts, two
        // generations less one turn served by a prefetch is half unused; followed to the
        // end, neither was used.
        assert!((c.unused - 0.5).abs() < 1e-9, "{c:?}");
        assert!((c.never_used - 1.0).abs() < 1e-9, "{c:?}");
        // At the lower bar the warm-up also prefetched C, which serves the second C: the
        // run's counting then shows no waste at all while both generations were wasted.
        let c = ceiling(&sessions, 1, &domain, 0.1, 3, Histories::ByIntent);
        assert!((c.off - 0.4).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.8).abs() < 1e-9, "{c:?}");
        assert!(c.unused.abs() < 1e-9, "{c:?}");
        assert!((c.never_used - 1.0).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn histories_as_worded_share_only_the_same_words() {
        let domain: Domain =
            serde_json::from_str(r#"{"transitions": {"A": {"B": 1.0}, "B": {"END": 1.0}}}"#)
                .unwrap();
        let sessions = [
            session(&[("A", "a1"), ("B", "b1")]),
            session(&[("A", "a2"), ("B", "b2")]),
        ];
        // The second B follows A in other words: by intent the history matches and the
        // cache answers it; as worded it does not, and the prefetch made after a2 does.
        let by_intent = ceiling(&sessions, 1, &domain, 0.2, 3, Histories::ByIntent);
        let as_worded = ceiling(&sessions, 1, &domain, 0.2, 3, Histories::AsWorded);
        assert!((by_intent.off - 1.0).abs() < 1e-9, "{by_intent:?}");
        assert!((as_worded.off - 0.5).abs() < 1e-9, "{as_worded:?}");
        assert!((as_worded.on - 1.0).abs() < 1e-9, "{as_worded:?}");
    }

    #[test]
    fn a_prefetch_is_not_credited_for_a_turn_the_cache_answers() {
        let domain: Domain =
            serde_json::from_str(r#"{"transitions": {"A": {"B": 1.0}, "B": {"END": 1.0}}}"#)
                .unwrap();
        // Both measured: the second session's B is answered by the first one's B (same
        // history), so the prefetch generated after its A is not needed, nor credited.
        let sessions = [
            session(&[("A", "a1"), ("B", "b1")]),
            session(&[("A", "a1"), ("B", "b2")]),
        ];
        let c = ceiling(&sessions, 0, &domain, 0.2, 3, Histories::ByIntent);
        // Turns: A miss, B prefetched, A cached, B cached.
        assert!((c.off - 0.5).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.75).abs() < 1e-9, "{c:?}");
        assert!(c.unused.abs() < 1e-9 && c.never_used.abs() < 1e-9, "{c:?}");
    }
}
