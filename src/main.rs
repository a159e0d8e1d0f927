//! The `reprise` command line: `serve`, and `tune` (thresholds from labelled pairs or the
//! request log); the benchmarks are the `reprise-bench` binary.

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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    reprise::main_with(async move {
        match cli.command {
            Command::Serve { config, listen } => serve(config, listen).await,
            Command::Tune(args) => reprise::tune::run(args).await,
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
