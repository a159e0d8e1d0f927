//! The `reprise` command line: `serve`, `tune` (thresholds from labelled pairs or the
//! request log) and `report` (a request log summed up); the benchmarks are the
//! `reprise-bench` binary.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use reprise::Config;

/// An OpenAI-compatible semantic caching proxy for LLM traffic.
#[derive(Parser)]
#[command(name = "reprise", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve {
        /// TOML configuration file (every key has a default; see reprise.example.toml).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Address to listen on; overrides `[server] listen`.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Choose a semantic threshold from labelled pairs or the request log.
    ///
    /// Prints the curve of hit rate and wrong hits at thresholds 0.70 to 0.99, from labelled
    /// pairs (--pairs, measured with the configured embedder and the false-hit gate) or the
    /// request log and its verdicts (--log), then the lowest threshold whose wrong share
    /// (with the gate) meets --target-wrong and the TOML that applies it. Exits 1 when no
    /// threshold does.
    Tune(reprise::tune::TuneArgs),
    /// Sum up a request log (`[log] request_log`) as markdown on stdout: requests, hit rate by
    /// tier, latency against `[slo]`, savings, top missed questions and served pairs.
    Report {
        /// The request log (JSON lines).
        #[arg(long)]
        log: PathBuf,
        /// Also read the rotated files beside it: LOG.1, LOG.2, ... (up to the first missing).
        #[arg(long)]
        rotated: bool,
        /// Length of one interval of the series, seconds (at most a year).
        #[arg(long, default_value_t = 3600)]
        interval_secs: u64,
        /// Only requests that ended at or after this time (RFC 3339 or epoch milliseconds).
        #[arg(long, value_parser = reprise::stats::report::parse_time)]
        since: Option<u64>,
        /// Only requests that ended before this time (RFC 3339 or epoch milliseconds).
        #[arg(long, value_parser = reprise::stats::report::parse_time)]
        until: Option<u64>,
        /// Only this tenant's requests (`anonymous`: those without a tenant).
        #[arg(long)]
        tenant: Option<String>,
        /// The configuration whose `[slo]` targets and `[metrics] currency` apply (defaults
        /// otherwise).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Also write the report as a self-contained HTML page with charts to this file.
        #[arg(long)]
        html: Option<PathBuf>,
    },
}

/// Longest interval `reprise report` groups by (a year; the series counts milliseconds).
const MAX_REPORT_INTERVAL_SECS: u64 = 365 * 24 * 3600;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    reprise::main_with(async move {
        match cli.command {
            Command::Serve { config, listen } => serve(config, listen).await,
            Command::Tune(args) => reprise::tune::run(args).await,
            Command::Report {
                log,
                rotated,
                interval_secs,
                since,
                until,
                tenant,
                config,
                html,
            } => {
                anyhow::ensure!(
                    (1..=MAX_REPORT_INTERVAL_SECS).contains(&interval_secs),
                    "--interval-secs must be 1 to {MAX_REPORT_INTERVAL_SECS} (a year)"
                );
                let config = match config {
                    Some(path) => Config::load(Some(&path))?,
                    None => Config::default(),
                };
                let opts = reprise::stats::report::Options {
                    log,
                    rotated,
                    interval_secs,
                    since_ms: since,
                    until_ms: until,
                    tenant,
                    slo: config.slo,
                    currency: config.metrics.currency,
                };
                reprise::stats::report::run(&opts, html.as_deref())
            }
        }
    })
}

async fn serve(config: Option<PathBuf>, listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let mut config = Config::load(config.as_deref())?;
    if let Some(addr) = listen {
        config.server.listen = addr;
    }
    let listener = tokio::net::TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.server.listen))?;
    reprise::run(listener, config, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}
