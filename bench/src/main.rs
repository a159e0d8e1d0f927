//! `reprise-bench`: measurements side by side in one run on loopback, reported as ratios.
//!
//! Every mode starts what it measures in this process on 127.0.0.1:0 (through
//! `reprise::harness`) and interleaves the candidate and its baseline in alternating rounds,
//! so both see the same machine noise. docs/BENCHMARKS.md holds the latest figures.

mod common;
mod embedder;
mod index;
mod latency;
mod llama;
mod overload;
mod proxy;
mod quality;
mod redis;
mod replay;
mod soak;

use clap::{Parser, Subcommand};

/// Benchmarks and load tests for reprise: each mode measures it side by side with its baseline
/// on loopback.
#[derive(Debug, Parser)]
#[command(name = "reprise-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Debug, Subcommand)]
enum Mode {
    /// Exact-hit throughput and latency against a plain axum handler returning the same bytes
    /// (the ceiling), and the proxy's added time to first token on a miss against calling the
    /// upstream directly.
    Proxy(proxy::ProxyArgs),
    /// Semantic hit quality on labelled pairs: store side A through the HTTP path, ask side B,
    /// report hit rate on true pairs and false hits, over thresholds, with and without the gate;
    /// with --online, the learned thresholds on the pairs sent as traffic.
    Quality(quality::QualityArgs),
    /// The llama backend through reprise's HTTP API against a bare llama.cpp decode loop
    /// (tokens/s, time to first token), and aggregate throughput at 1, 2, 4, 8 streams.
    Llama(llama::LlamaArgs),
    /// Semantic-hit latency and throughput at 1..16 clients on new paraphrases (each one
    /// embedded), side by side with exact hits and the embedding alone.
    Latency(latency::LatencyArgs),
    /// The Redis tier: L2 against L1 exact hits, a fresh replica's index rebuild time and
    /// memory, replica-to-replica propagation delay.
    Redis(redis::RedisArgs),
    /// The semantic index alone at scale: memory per entry on top of the vectors, time until a
    /// bulk load is searchable and until its graphs are built, recall against an exact scan.
    Index(index::IndexArgs),
    /// Predictive prefetch on recorded sessions: the same conversations through reprise with
    /// prefetch off and on, side by side; hit rates, latency, compute spent and wasted.
    Replay(Box<replay::ReplayArgs>),
    /// Open-loop arrivals at multiples of the backend's measured capacity, `[degrade]` off and
    /// on side by side: interactive latency percentiles, answers degraded by kind, 429s and
    /// wrong hits.
    Overload(overload::OverloadArgs),
    /// The embedder's working memory and throughput on long texts under its memory budget,
    /// side by side with a budget that never cuts a batch (each side in its own process).
    Embedder(embedder::EmbedderArgs),
    /// Many distinct prompts through one server with a fixed memory budget: entries held,
    /// weighted bytes and resident memory as it fills and evicts; RSS against the budget.
    Soak(soak::SoakArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    reprise::main_with(async move {
        match cli.mode {
            Mode::Proxy(a) => proxy::run(a).await,
            Mode::Quality(a) => quality::run(a).await,
            Mode::Llama(a) => llama::run(a).await,
            Mode::Latency(a) => latency::run(a).await,
            Mode::Redis(a) => redis::run(a).await,
            Mode::Index(a) => index::run(a).await,
            Mode::Replay(a) => replay::run(*a).await,
            Mode::Soak(a) => soak::run(a).await,
            Mode::Embedder(a) => embedder::run(a).await,
            Mode::Overload(a) => overload::run(a).await,
        }
    })
}
