//! `reprise-bench embedder`: ONNX Runtime's working memory and the embedder's throughput on
//! long texts, under the configured working-memory budget (`semantic.embedder_memory_bytes`)
//! and under one large enough never to cut a batch, side by side.
//!
//! The runtime keeps its largest batch's working memory for the life of the process, so each
//! side runs in a process of its own (this binary again, with a hidden flag), the two
//! alternating round by round. A side loads the configured embedder with its text cache off,
//! then sends bursts of distinct long texts at once (one `embed_many` each, so every burst is
//! one round of the batcher) and reports its resident memory after the load and at the end,
//! the peak, and texts per second.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};

use reprise_embedder::{Embedder, FastEmbedder};

use crate::common::{embedder_config, rss, Config};

/// Options of `reprise-bench embedder`.
#[derive(Debug, Args)]
pub struct EmbedderArgs {
    /// Texts in one burst (sent at once).
    #[arg(long, default_value_t = 16)]
    texts: usize,
    /// Words of each text (one token each; the model reads at most 256 tokens).
    #[arg(long, default_value_t = 300)]
    words: usize,
    /// Bursts per side per round.
    #[arg(long, default_value_t = 4)]
    bursts: usize,
    /// Rounds: each side runs once per round, in a process of its own.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// The budget measured, in MiB (default: the configuration's
    /// `semantic.embedder_memory_bytes`).
    #[arg(long)]
    memory_mb: Option<u64>,
    /// The other side's budget, in MiB: large enough that no batch is cut.
    #[arg(long, default_value_t = 4096)]
    baseline_mb: u64,
    /// Configuration whose `[semantic]` section is used (model, threads, batching).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run one side with this budget (bytes) in this process and print its result line.
    #[arg(long, hide = true)]
    side_bytes: Option<u64>,
}

/// What one side measured.
#[derive(Debug, Serialize, Deserialize)]
struct Side {
    /// Resident memory once the model is loaded, MiB.
    loaded_mib: f64,
    /// Resident memory after the last burst, MiB.
    end_mib: f64,
    /// Peak resident memory, MiB.
    peak_mib: f64,
    /// Texts embedded per second over the bursts.
    texts_per_sec: f64,
    /// Model calls the bursts took.
    calls: u64,
}

/// The marker before a side's result line on stdout.
const RESULT: &str = "embedder-side ";

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

pub async fn run(a: EmbedderArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.texts > 0 && a.words > 0 && a.bursts > 0,
        "nothing to embed"
    );
    let mut config = Config::load(a.config.as_deref())?;
    config.semantic.enabled = true;
    config.semantic.embedding_cache_bytes = 0;
    if let Some(bytes) = a.side_bytes {
        config.semantic.embedder_memory_bytes = bytes;
        let side = one_side(&config, &a).await?;
        println!("{RESULT}{}", serde_json::to_string(&side)?);
        return Ok(());
    }
    let budget = a
        .memory_mb
        .map_or(config.semantic.embedder_memory_bytes, |mb| mb << 20);
    let sides = [("budget", budget), ("baseline", a.baseline_mb << 20)];
    let mut results: Vec<Vec<Side>> = vec![Vec::new(), Vec::new()];
    let exe = std::env::current_exe()?;
    for round in 1..=a.rounds {
        for (k, (name, bytes)) in sides.iter().enumerate() {
            eprintln!(
                "round {round}/{}: {name} ({:.1} MiB)...",
                a.rounds,
                mib(*bytes)
            );
            let mut cmd = std::process::Command::new(&exe);
            cmd.arg("embedder")
                .args(["--texts", &a.texts.to_string()])
                .args(["--words", &a.words.to_string()])
                .args(["--bursts", &a.bursts.to_string()])
                .args(["--side-bytes", &bytes.to_string()])
                .stderr(std::process::Stdio::inherit());
            if let Some(c) = &a.config {
                cmd.arg("--config").arg(c);
            }
            let out = cmd.output()?;
            anyhow::ensure!(
                out.status.success(),
                "the {name} side failed: {}",
                out.status
            );
            let stdout = String::from_utf8_lossy(&out.stdout);
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix(RESULT))
                .ok_or_else(|| anyhow::anyhow!("the {name} side printed no result"))?;
            let side: Side = serde_json::from_str(line)?;
            eprintln!(
                "  +{:.1} MiB over the loaded model, peak {:.1} MiB, {:.1} texts/s, {} calls",
                side.end_mib - side.loaded_mib,
                side.peak_mib,
                side.texts_per_sec,
                side.calls
            );
            results[k].push(side);
        }
    }
    let mean = |v: &[Side], f: fn(&Side) -> f64| v.iter().map(f).sum::<f64>() / v.len() as f64;
    println!(
        "bursts of {} texts x {} words, {} bursts per side, {} rounds",
        a.texts, a.words, a.bursts, a.rounds
    );
    println!(
        "{:<10} {:>9} {:>14} {:>10} {:>10} {:>8}",
        "side", "budget", "added (MiB)", "peak", "texts/s", "calls"
    );
    for (k, (name, bytes)) in sides.iter().enumerate() {
        let v = &results[k];
        println!(
            "{:<10} {:>5.0} MiB {:>14.1} {:>10.1} {:>10.2} {:>8.1}",
            name,
            mib(*bytes),
            mean(v, |s| s.end_mib - s.loaded_mib),
            mean(v, |s| s.peak_mib),
            mean(v, |s| s.texts_per_sec),
            mean(v, |s| s.calls as f64)
        );
    }
    let added = |k: usize| mean(&results[k], |s| s.end_mib - s.loaded_mib);
    let rate = |k: usize| mean(&results[k], |s| s.texts_per_sec);
    println!(
        "budget / baseline: working memory {:.2}x, throughput {:.2}x",
        added(0) / added(1).max(f64::MIN_POSITIVE),
        rate(0) / rate(1).max(f64::MIN_POSITIVE)
    );
    Ok(())
}

/// Loads the embedder and sends the bursts, in this process.
async fn one_side(config: &Config, a: &EmbedderArgs) -> anyhow::Result<Side> {
    let cfg = embedder_config(config);
    let embedder = tokio::task::spawn_blocking(move || FastEmbedder::load(cfg)).await??;
    let loaded = rss().0;
    let body = "time ".repeat(a.words);
    let start = Instant::now();
    let mut calls = 0;
    for burst in 0..a.bursts {
        // Distinct texts: nothing is answered without the model.
        let texts: Vec<String> = (0..a.texts)
            .map(|i| format!("{burst} {i} {body}"))
            .collect();
        let before = embedder.stats().batches;
        embedder.embed_many(&texts).await?;
        calls += embedder.stats().batches - before;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (end, peak) = rss();
    Ok(Side {
        loaded_mib: mib(loaded),
        end_mib: mib(end),
        peak_mib: mib(peak),
        texts_per_sec: (a.texts * a.bursts) as f64 / elapsed,
        calls,
    })
}
