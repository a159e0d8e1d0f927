//! `reprise-bench llama`: the llama.cpp backend through reprise's HTTP API, side by side with
//! a bare llama.cpp decode loop, in one run on loopback.
//!
//! 1. **Single stream.** The same raw prompt, greedy, `--tokens` tokens: once through a
//!    [`BareDecoder`] (a plain decode loop: no engine, queue, channels or HTTP) and once
//!    through `/v1/completions` with `stream: true` and `Cache-Control: no-store` (never a
//!    hit). Both sides are treated alike: loaded once before the measured rounds (model and
//!    context stay loaded; each run starts from an empty KV cache) and warmed up by one
//!    unmeasured 8-token run. The two alternate for `--rounds` rounds, the order flipping
//!    every round. Reported: time
//!    to first token and decode tokens/s after the first token, and the ratio reprise/bare.
//! 2. **Concurrency.** 1, 2, 4 and 8 simultaneous distinct streams through reprise; the
//!    aggregate rate (all generated tokens over the wall time of the level) and its ratio to
//!    the single-stream level, which continuous batching should make rise.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use futures::StreamExt;
use reprise_backend::llama::{BareDecoder, BareStats, LlamaBackend};
use serde_json::{json, Value};

use crate::common::{start_app, BackendKind, Config};

/// Options of `reprise-bench llama`.
#[derive(Debug, Args)]
pub struct LlamaArgs {
    /// GGUF model file.
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// CPU threads for decoding (both sides).
    #[arg(long, default_value_t = 2)]
    threads: i32,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 128)]
    tokens: u32,
    /// Alternating rounds per side, and repetitions per concurrency level.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Sequences the engine decodes together (continuous batching slots).
    #[arg(long, default_value_t = 8)]
    parallel: usize,
    /// Model layers offloaded to the GPU, both sides (needs a build with `--features cuda`;
    /// 99 offloads every layer).
    #[arg(long, default_value_t = 0)]
    n_gpu_layers: u32,
    /// Write the results as JSON here as well.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Concurrent streams measured in the second part.
const LEVELS: [usize; 4] = [1, 2, 4, 8];

/// A raw prompt `start, start+1, … ,` that the model continues by counting, for hundreds of
/// tokens without ending the text; distinct `start`s give distinct requests.
fn counting_prompt(start: usize) -> String {
    let numbers: Vec<String> = (start..start + 8).map(|n| n.to_string()).collect();
    format!("{},", numbers.join(", "))
}

/// One streamed completion as the client saw it.
#[derive(Debug, Clone, Copy)]
struct StreamStats {
    /// From sending the request to the first chunk with text.
    ttft: Duration,
    /// From sending the request to the end of the body.
    total: Duration,
    /// `usage.completion_tokens` of the stream.
    tokens: u32,
    /// Chunks that carried text.
    chunks: u32,
    /// Decode rate after the first token: `(tokens - 1)` over first to last text chunk.
    tokens_per_second: f64,
}

/// Streams one completion and times it from the client's side.
async fn stream_once(
    client: &reqwest::Client,
    url: &str,
    model: &str,
    prompt: &str,
    tokens: u32,
) -> anyhow::Result<StreamStats> {
    let body = json!({
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let sent = Instant::now();
    let resp = client
        .post(url)
        // Never a hit, never stored: every request is generated.
        .header("cache-control", "no-store")
        .json(&body)
        .send()
        .await
        .context("the request failed")?;
    let status = resp.status();
    anyhow::ensure!(
        status.is_success(),
        "reprise answered {status}: {}",
        resp.text().await.unwrap_or_default()
    );
    let mut body = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut first = None;
    let mut last = sent;
    let mut chunks = 0u32;
    let mut usage_tokens = None;
    let mut done = false;
    while let Some(bytes) = body.next().await {
        let bytes = bytes.context("the stream broke")?;
        let now = Instant::now();
        buf.extend_from_slice(&bytes);
        // SSE events end with a blank line; a chunk may carry several or part of one.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim_start) else {
                    continue;
                };
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(data).context("a chunk is not JSON")?;
                if let Some(e) = v.get("error") {
                    anyhow::bail!("the stream failed: {e}");
                }
                if let Some(n) = v
                    .pointer("/usage/completion_tokens")
                    .and_then(Value::as_u64)
                {
                    usage_tokens = Some(n as u32);
                }
                let text = v.pointer("/choices/0/text").and_then(Value::as_str);
                if text.is_some_and(|t| !t.is_empty()) {
                    chunks += 1;
                    first.get_or_insert(now);
                    last = now;
                }
            }
        }
    }
    let total = sent.elapsed();
    anyhow::ensure!(done, "the stream ended without [DONE]");
    let first = first.context("the stream carried no text")?;
    let tokens = usage_tokens.context("the stream carried no usage")?;
    let decode = last.duration_since(first).as_secs_f64();
    Ok(StreamStats {
        ttft: first.duration_since(sent),
        total,
        tokens,
        chunks,
        tokens_per_second: if tokens > 1 && decode > 0.0 {
            f64::from(tokens - 1) / decode
        } else {
            0.0
        },
    })
}

/// One concurrency level, summed over its repetitions.
#[derive(Debug, Default, Clone)]
struct Level {
    streams: usize,
    tokens: u64,
    wall: f64,
    /// Sum over streams of each stream's own decode rate, averaged over repetitions.
    per_stream_sum: f64,
    decode_steps: u64,
    generated: u64,
    peak_occupancy: usize,
}

impl Level {
    fn aggregate(&self) -> f64 {
        self.tokens as f64 / self.wall.max(1e-9)
    }

    /// Mean sequences per decode step while the level ran.
    fn mean_batch(&self) -> f64 {
        self.generated as f64 / (self.decode_steps.max(1)) as f64
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The middle value, or the mean of the two middle values of an even count.
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Runs `reprise-bench llama`.
pub async fn run(a: LlamaArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.model.is_file(),
        "model file {} not found (run scripts/fetch-models.sh or pass --model)",
        a.model.display()
    );
    anyhow::ensure!(a.tokens >= 2, "--tokens must be at least 2");
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(a.parallel >= 1, "--parallel must be at least 1");
    let prompt = counting_prompt(1);
    // The context is shared by the parallel sequences: room for every level's streams
    // (prompt of about 25 tokens plus the answer each), at least the default 4096.
    let n_ctx = ((a.parallel.max(8) as u32) * (a.tokens + 64)).max(4096);

    let mut config = Config::default();
    config.backend.kind = BackendKind::Llama;
    config.backend.model = a.model.clone();
    config.backend.n_threads = a.threads;
    config.backend.n_gpu_layers = a.n_gpu_layers;
    config.backend.parallel = a.parallel;
    config.backend.n_ctx = n_ctx;
    config.backend.max_queue = 64;
    config.semantic.enabled = false;
    config.validate()?;
    let b = &config.backend;
    let llama_cfg = b.llama_config();
    let model_name = llama_cfg.served_name();

    eprintln!(
        "loading {} (threads {}, parallel {}, n_ctx {})",
        a.model.display(),
        a.threads,
        a.parallel,
        n_ctx
    );
    let load_cfg = llama_cfg.clone();
    let started = Instant::now();
    // Built directly rather than through `build_backend` to keep the engine's counters.
    let engine = Arc::new(
        tokio::task::spawn_blocking(move || LlamaBackend::load(load_cfg))
            .await
            .context("model loader panicked")??,
    );
    eprintln!("  loaded in {:.2} s", started.elapsed().as_secs_f64());
    let placement = match engine.gpu_offload() {
        Some(g) => format!(
            "{}/{} layers on the GPU ({})",
            g.offloaded,
            g.layers,
            g.devices.join(", ")
        ),
        None => "CPU only".to_string(),
    };
    eprintln!("  {placement}");
    let server = start_app(config, engine.clone(), None).await?;
    let url = server.url("/v1/completions");
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(LEVELS[LEVELS.len() - 1] * 2)
        .timeout(Duration::from_secs(600))
        .build()?;

    // The baseline, loaded once like the backend (its load is not part of any round).
    let bare_cfg = llama_cfg.clone();
    let bare_decoder = Arc::new(
        tokio::task::spawn_blocking(move || BareDecoder::load(&bare_cfg))
            .await
            .context("bare decoder loader panicked")??,
    );
    eprintln!(
        "  bare decoder loaded in {:.2} s",
        bare_decoder.load_time().as_secs_f64()
    );

    // Warm-up of both sides, not measured: first-use costs (page faults, thread pools, the
    // first decode's allocations) land here, the same 8 tokens on each side.
    stream_once(&client, &url, &model_name, &prompt, 8).await?;
    let d = bare_decoder.clone();
    let p = prompt.clone();
    tokio::task::spawn_blocking(move || d.run(&p, 8))
        .await
        .context("bare warm-up panicked")??;

    // Part 1: single stream, bare vs reprise, alternating.
    eprintln!(
        "single stream: {} rounds, {} tokens, prompt {prompt:?}",
        a.rounds, a.tokens
    );
    let mut bare: Vec<BareStats> = Vec::new();
    let mut via: Vec<StreamStats> = Vec::new();
    for round in 0..a.rounds {
        // Flip the order every round so neither side always runs first.
        for side in 0..2 {
            if (side + round) % 2 == 0 {
                let d = bare_decoder.clone();
                let p = prompt.clone();
                let n = a.tokens;
                let s = tokio::task::spawn_blocking(move || d.run(&p, n))
                    .await
                    .context("bare benchmark panicked")??;
                eprintln!(
                    "  round {}/{} bare:    TTFT {:>7.2} ms  {:>7.1} tok/s  ({} tokens)",
                    round + 1,
                    a.rounds,
                    ms(s.time_to_first_token),
                    s.tokens_per_second,
                    s.generated_tokens,
                );
                bare.push(s);
            } else {
                let s = stream_once(&client, &url, &model_name, &prompt, a.tokens).await?;
                eprintln!(
                    "  round {}/{} reprise: TTFT {:>7.2} ms  {:>7.1} tok/s  ({} tokens in {} chunks)",
                    round + 1,
                    a.rounds,
                    ms(s.ttft),
                    s.tokens_per_second,
                    s.tokens,
                    s.chunks
                );
                via.push(s);
            }
        }
    }
    let bare_tps = median(&bare.iter().map(|s| s.tokens_per_second).collect::<Vec<_>>());
    let via_tps = median(&via.iter().map(|s| s.tokens_per_second).collect::<Vec<_>>());
    let bare_ttft = median(
        &bare
            .iter()
            .map(|s| ms(s.time_to_first_token))
            .collect::<Vec<_>>(),
    );
    let via_ttft = median(&via.iter().map(|s| ms(s.ttft)).collect::<Vec<_>>());
    let ratio = via_tps / bare_tps;

    // The baseline's model and context are not needed for the concurrency part.
    tokio::task::spawn_blocking(move || drop(bare_decoder))
        .await
        .context("unloading the bare decoder panicked")?;

    // Part 2: aggregate throughput at rising concurrency.
    eprintln!(
        "concurrency: {LEVELS:?} distinct streams x {} tokens, {} repetitions",
        a.tokens, a.rounds
    );
    let mut levels: Vec<Level> = Vec::new();
    let mut next_start = 1000;
    for &n in &LEVELS {
        let mut level = Level {
            streams: n,
            ..Level::default()
        };
        for rep in 0..a.rounds {
            let before = engine.stats();
            let t = Instant::now();
            let tasks: Vec<_> = (0..n)
                .map(|_| {
                    let client = client.clone();
                    let url = url.clone();
                    let model = model_name.clone();
                    let p = counting_prompt(next_start);
                    next_start += 100;
                    let tokens = a.tokens;
                    tokio::spawn(
                        async move { stream_once(&client, &url, &model, &p, tokens).await },
                    )
                })
                .collect();
            let mut results = Vec::with_capacity(n);
            for task in tasks {
                results.push(task.await.context("a stream task panicked")??);
            }
            let wall = t.elapsed().as_secs_f64();
            let after = engine.stats();
            let tokens: u64 = results.iter().map(|s| u64::from(s.tokens)).sum();
            let per_stream: f64 = results.iter().map(|s| s.tokens_per_second).sum();
            level.tokens += tokens;
            level.wall += wall;
            level.per_stream_sum += per_stream / a.rounds as f64;
            level.decode_steps += after.decode_steps - before.decode_steps;
            level.generated += after.generated_tokens - before.generated_tokens;
            level.peak_occupancy = after.peak_occupancy;
            let slowest = results.iter().map(|s| s.total).max().unwrap_or_default();
            eprintln!(
                "  {n} streams, repetition {}/{}: {tokens} tokens in {wall:.2} s = {:.1} tok/s (slowest stream {:.2} s)",
                rep + 1,
                a.rounds,
                tokens as f64 / wall,
                slowest.as_secs_f64()
            );
        }
        levels.push(level);
    }
    drop(server);

    let base = levels[0].aggregate();
    println!("== reprise bench llama ==");
    println!(
        "model {}  threads {}  tokens {}  rounds {}  parallel {}  n_gpu_layers {}",
        a.model.display(),
        a.threads,
        a.tokens,
        a.rounds,
        a.parallel,
        a.n_gpu_layers
    );
    println!("placement: {placement}");
    println!("single stream, raw prompt, greedy (medians over rounds):");
    println!("  bare llama.cpp   TTFT {bare_ttft:>8.2} ms   {bare_tps:>8.1} tok/s");
    println!("  reprise (HTTP)   TTFT {via_ttft:>8.2} ms   {via_tps:>8.1} tok/s");
    println!("  ratio reprise/bare tokens/s: {ratio:.3}x  (goal >= 0.95x)");
    println!(
        "  TTFT difference reprise - bare: {:+.2} ms",
        via_ttft - bare_ttft
    );
    println!("aggregate throughput, distinct concurrent streams through reprise:");
    println!("  streams   tok/s (all)   vs 1 stream   sum of per-stream tok/s   mean batch");
    for l in &levels {
        println!(
            "  {:>7}   {:>11.1}   {:>10.2}x   {:>23.1}   {:>10.2}",
            l.streams,
            l.aggregate(),
            l.aggregate() / base,
            l.per_stream_sum,
            l.mean_batch()
        );
    }
    let rising = levels
        .windows(2)
        .all(|w| w[1].aggregate() > w[0].aggregate());
    println!(
        "  aggregate rises with concurrency: {}  (goal: rising); engine peak occupancy {}",
        if rising { "yes" } else { "no" },
        levels.last().map_or(0, |l| l.peak_occupancy)
    );

    if let Some(path) = a.json {
        let out = json!({
            "model": a.model.display().to_string(),
            "threads": a.threads, "tokens": a.tokens, "rounds": a.rounds, "parallel": a.parallel,
            "n_gpu_layers": a.n_gpu_layers, "placement": placement,
            "single": {
                "bare_tokens_per_second": bare_tps, "reprise_tokens_per_second": via_tps,
                "ratio": ratio, "bare_ttft_ms": bare_ttft, "reprise_ttft_ms": via_ttft,
                "ttft_difference_ms": via_ttft - bare_ttft,
                "bare_rounds": bare.iter().map(|s| json!({
                    "ttft_ms": ms(s.time_to_first_token), "tokens_per_second": s.tokens_per_second,
                    "generated_tokens": s.generated_tokens, "prompt_tokens": s.prompt_tokens,
                })).collect::<Vec<_>>(),
                "reprise_rounds": via.iter().map(|s| json!({
                    "ttft_ms": ms(s.ttft), "tokens_per_second": s.tokens_per_second,
                    "completion_tokens": s.tokens, "chunks": s.chunks,
                })).collect::<Vec<_>>(),
            },
            "concurrency": levels.iter().map(|l| json!({
                "streams": l.streams, "tokens_per_second": l.aggregate(),
                "ratio_to_one_stream": l.aggregate() / base,
                "per_stream_sum_tokens_per_second": l.per_stream_sum,
                "mean_batch": l.mean_batch(), "tokens": l.tokens, "wall_s": l.wall,
            })).collect::<Vec<_>>(),
            "aggregate_rising": rising,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
