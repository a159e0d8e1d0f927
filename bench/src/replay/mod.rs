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
//! `prefetch.regroup_score` (see [`regroup::regroup_report`]). The report is in `report.rs`,
//! the reference ceiling in `ceiling.rs`.

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

mod ceiling;
mod lost;
mod regroup;
mod report;

use ceiling::print_ceiling;
use report::report;

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
    /// Prefetch side: `prefetch.min_observations` (default: the configured default).
    #[arg(long)]
    min_observations: Option<f64>,
    /// Prefetch side: `prefetch.regroup_score` (default: the configured default).
    #[arg(long)]
    regroup_score: Option<f32>,
    /// Prefetch side: `prefetch.regroup_family_score` (default: the configured default).
    #[arg(long)]
    regroup_family_score: Option<f32>,
    /// Play only one half of the sessions, split by a hash of each session id and
    /// `--split-seed` (about half each, fixed for a seed): tune on one, report the other.
    /// `--limit` and `--warmup` then count within the half.
    #[arg(long, value_enum)]
    half: Option<Half>,
    /// Seed of the `--half` split.
    #[arg(long, default_value_t = 1)]
    split_seed: u64,
    /// Tuning `prefetch.regroup_score` (repeatable: the same clusters every run). For each
    /// `--split-seeds` seed, learns the clusters of each half of the sessions (prefetch
    /// side only, regrouping off, nothing generated in the background, sessions one at a
    /// time in file order, each turn sent once the previous one was learned), regroups a
    /// copy at scores 1.50 to 3.00, and judges each score by the session file's labels:
    /// clusters left, and wordings sitting in a cluster of another intent. Each seed's
    /// choice (the lowest score meeting a `--target-misplaced` on its tuning half) is
    /// reported on its held-out half; the default to configure is the median choice.
    /// `--concurrency`, the think times and `--token-delay-ms` do not apply (`--half` is
    /// refused).
    #[arg(long)]
    regroup_curve: bool,
    /// With `--regroup-curve`: the split seeds (one tuning and one held-out half each).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3, 4, 5])]
    split_seeds: Vec<u64>,
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

#[derive(Debug, Clone, Deserialize)]
struct Session {
    session_id: String,
    turns: Vec<Turn>,
}

#[derive(Debug, Clone, Deserialize)]
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
    /// The turn's wording and intent, and the texts and intents of the user turns before it
    /// in its session (its context).
    text: String,
    intent: String,
    history: Vec<String>,
    history_intents: Vec<String>,
    /// When it was asked.
    asked_at: Instant,
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
    /// Turns answered (`--regroup-curve` waits for each to be learned).
    answered: AtomicUsize,
    /// Turns whose learning was not seen within the wait (`--regroup-curve`).
    unsynced: AtomicUsize,
}

/// Runs the benchmark.
pub async fn run(a: ReplayArgs) -> anyhow::Result<()> {
    let all = read_sessions(&a.sessions)?;
    if a.regroup_curve {
        anyhow::ensure!(
            a.half.is_none(),
            "--regroup-curve plays both halves of each --split-seeds seed; leave out --half"
        );
        return regroup::tune(&a, all).await;
    }
    let mut sessions = match a.half {
        Some(half) => split(all, a.split_seed, half),
        None => all,
    };
    if let Some(n) = a.limit {
        sessions.truncate(n);
    }
    anyhow::ensure!(
        sessions.len() > a.warmup,
        "{} sessions leave none to measure after a warm-up of {}",
        sessions.len(),
        a.warmup
    );
    if a.ceiling_only {
        anyhow::ensure!(a.domain.is_some(), "--ceiling-only needs --domain");
        print_ceiling(&a, &sessions)?;
        return Ok(());
    }
    let intent_of = Arc::new(intents(&sessions));
    let sessions = Arc::new(sessions);
    let mut sides = Vec::new();
    for (name, prefetch) in [("prefetch off", false), ("prefetch on", true)] {
        sides.push(Arc::new(start_side(&a, name, prefetch, |_| {}).await?));
    }
    eprintln!(
        "replaying {} sessions ({} warm-up, think {} ms), {} at a time per side, think {} ms, {}, sides {}",
        sessions.len(),
        a.warmup,
        a.warmup_think_ms.unwrap_or(a.think_ms),
        a.concurrency,
        a.think_ms,
        describe_backend(&a),
        if a.sequential { "one after the other" } else { "at once" }
    );
    let client = client(&a)?;
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
    report(&a, &sides, &intent_of, &sessions)?;
    let truth = ceiling::Truth::load(&a)?;
    for side in sides.iter().filter(|s| s.name == "prefetch on") {
        lost::print_lost(side, &intent_of, truth.as_ref());
    }
    Ok(())
}

/// The sessions of a session file, in file order.
fn read_sessions(path: &std::path::Path) -> anyhow::Result<Vec<Session>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}

/// One half of `sessions` by the split of `seed`, in file order.
fn split(mut sessions: Vec<Session>, seed: u64, half: Half) -> Vec<Session> {
    let before = sessions.len();
    sessions.retain(|s| in_tuning_half(seed, &[&s.session_id]) == (half == Half::Tune));
    eprintln!(
        "split (seed {seed}): {} of {before} sessions in the {half:?} half",
        sessions.len()
    );
    sessions
}

/// Question text → intent, to tell which intent an answer was generated for.
fn intents(sessions: &[Session]) -> HashMap<String, String> {
    let mut intent_of = HashMap::new();
    for s in sessions {
        for t in &s.turns {
            intent_of.insert(t.text.clone(), t.intent.clone());
        }
    }
    intent_of
}

/// The scripted backend's script.
fn script(a: &ReplayArgs) -> ScriptConfig {
    ScriptConfig {
        reply: naming_reply(a.reply_words),
        // Prompt processing before the first token: a few tokens' worth.
        first_token_delay: Duration::from_millis(a.token_delay_ms * 5),
        token_delay: Duration::from_millis(a.token_delay_ms),
        slots: a.backend_slots,
        ..ScriptConfig::default()
    }
}

/// The backend of each side, in words.
fn describe_backend(a: &ReplayArgs) -> String {
    match a.backend {
        ReplayBackend::Scripted => format!(
            "scripted backend at {} ms/token, {} reply words, slots {}",
            a.token_delay_ms,
            a.reply_words + 3,
            a.backend_slots
                .map_or_else(|| "unlimited".to_string(), |n| n.to_string())
        ),
        ReplayBackend::Llama => format!("llama backend {}", a.model.display()),
    }
}

/// The HTTP client of the sessions.
fn client(a: &ReplayArgs) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(a.concurrency * 4)
        .tcp_nodelay(true)
        .build()?)
}

/// Starts one side: its own server state, backend and embedder, prefetch on or off, the
/// prefetch options of `a`, then `adjust`.
async fn start_side(
    a: &ReplayArgs,
    name: &'static str,
    prefetch: bool,
    adjust: impl FnOnce(&mut Config),
) -> anyhow::Result<Side> {
    let mut config = Config::default();
    config.backend.kind = BackendKind::Fake;
    config.semantic.enabled = true;
    if let Some(t) = a.threshold {
        config.semantic.threshold = t;
    }
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
    if let Some(v) = a.regroup_family_score {
        config.prefetch.regroup_family_score = v;
    }
    if let Some(v) = a.regroup_score {
        config.prefetch.regroup_score = v;
    }
    if let Some(n) = a.max_wordings {
        config.prefetch.max_wordings = n;
    }
    if let Some(p) = a.min_probability {
        config.prefetch.min_probability = p;
    }
    if let Some(n) = a.min_observations {
        config.prefetch.min_observations = n;
    }
    adjust(&mut config);
    // Its own embedder instance: the other side's embeddings never queue ahead of its own.
    eprintln!(
        "{name}: loading the embedder from {}",
        config.semantic.model_dir.display()
    );
    let embedder = load_embedder(&config)
        .await?
        .ok_or_else(|| anyhow::anyhow!("semantic tier is off"))?;
    let (backend, model): (Arc<dyn Backend>, String) = match a.backend {
        ReplayBackend::Scripted => {
            let script = script(a);
            let model = script.model.clone();
            (Arc::new(ScriptedBackend::new(script)), model)
        }
        ReplayBackend::Llama => {
            anyhow::ensure!(
                a.model.is_file(),
                "model file {} not found (run scripts/fetch-models.sh or pass --model)",
                a.model.display()
            );
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
    Ok(Side {
        name,
        url: server.chat_url(),
        model,
        server,
        results: parking_lot::Mutex::new(Vec::new()),
        at_measure: parking_lot::Mutex::new(None),
        done: AtomicUsize::new(0),
        answered: AtomicUsize::new(0),
        unsynced: AtomicUsize::new(0),
    })
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

/// Waits until the prefetcher of `side` took in `turns` answered turns (so the next turn's
/// request finds the previous answer stored and its learning comes after): the order of
/// learning is then the order of the session file. Gives up after a while and counts the
/// turn as unsynced.
async fn learned(side: &Side, turns: usize) {
    let Some(p) = prefetcher(&side.server.state) else {
        return;
    };
    let give_up = Instant::now() + Duration::from_secs(5);
    loop {
        let s = p.stats();
        if s.observations + s.observations_dropped >= turns as u64 {
            return;
        }
        if Instant::now() >= give_up {
            side.unsynced.fetch_add(1, Ordering::Relaxed);
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
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
        let history: Vec<String> = session.turns[..depth]
            .iter()
            .map(|t| t.text.clone())
            .collect();
        let history_intents: Vec<String> = session.turns[..depth]
            .iter()
            .map(|t| t.intent.clone())
            .collect();
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
                text: turn.text.clone(),
                intent: turn.intent.clone(),
                history,
                history_intents,
                asked_at: t,
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
        if a.regroup_curve {
            learned(side, side.answered.fetch_add(1, Ordering::Relaxed) + 1).await;
        }
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
