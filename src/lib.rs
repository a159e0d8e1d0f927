//! reprise: an OpenAI-compatible caching proxy for LLM traffic.
//!
//! Apps point their OpenAI base URL at reprise. Exact repeats are answered from memory,
//! near-duplicates from a semantic index, and misses go to a backend (llama.cpp in-process or
//! any OpenAI-compatible upstream), streamed as they are generated.
//!
//! - [`run`] serves on a listener the caller owns until `shutdown` resolves.
//! - [`app`] is the router over a built [`AppState`] (tests build the state from parts);
//!   [`tasks::start`] starts its background work.
//! - [`request`] is the request path, top to bottom, one file per step; docs/ARCHITECTURE.md
//!   maps the rest.
//! - [`stats`] sums the served traffic per interval (`GET /admin/stats`, `reprise report`).
//! - `harness` (feature `harness`) builds servers on loopback for the tests and the
//!   benchmarks (the `reprise-bench` crate).

pub mod admin;
pub mod auth;
mod bookkeeping;
pub mod bounds;
pub mod candidate;
pub mod config;
mod cpu;
pub mod dashboard;
pub mod degraded;
pub mod error;
pub mod feedback;
mod flight;
mod forward;
pub mod generate;
#[cfg(feature = "harness")]
pub mod harness;
pub mod headers;
mod http;
pub mod key;
mod lines;
pub mod listen;
mod lookup;
pub mod metrics;
mod observe;
pub mod openai;
pub mod otel;
pub mod policy;
pub mod prefetch;
mod replication;
mod reqlog;
pub mod request;
pub mod routes;
mod share;
pub mod snapshot;
pub mod state;
pub mod stats;
pub mod tasks;
#[cfg(test)]
pub(crate) mod test_support;
pub mod trace;
pub mod tune;
mod verify;

use std::future::Future;
use std::sync::{Arc, OnceLock};

use anyhow::Context as _;
use axum::extract::Request;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use tower::ServiceExt;

pub use config::Config;
pub use http::app;
pub use state::AppState;

/// Serves `listener` until `stop`: `/healthz` at once, every other route from the router put
/// into the returned slot once loading finished (503 until then).
fn serve_until_loaded(
    listener: TcpListener,
    limits: listen::ConnectionLimits,
    stop: tokio_util::sync::CancellationToken,
) -> (
    Arc<OnceLock<Router>>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let loaded: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
    let slot = loaded.clone();
    let router = Router::new()
        .route("/healthz", get(http::healthz))
        .method_not_allowed_fallback(http::method_not_allowed)
        .fallback(move |req: Request| {
            let slot = slot.clone();
            async move {
                match slot.get() {
                    Some(app) => app.clone().oneshot(req).await.into_response(),
                    None => error::ApiError::NotReady.into_response(),
                }
            }
        });
    let server = tokio::spawn(listen::serve(listener, router, limits, stop));
    (loaded, server)
}

/// Awaits a server task that stops on `stop`, for at most `grace` once `stop` was
/// cancelled; past that it is aborted (its connections are left to end with the process).
async fn drain(
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: &tokio_util::sync::CancellationToken,
    grace: std::time::Duration,
) -> Result<std::io::Result<()>, tokio::task::JoinError> {
    tokio::select! {
        done = &mut server => return done,
        _ = stop.cancelled() => {}
    }
    match tokio::time::timeout(grace, &mut server).await {
        Ok(done) => done,
        Err(_) => {
            tracing::warn!(
                seconds = grace.as_secs_f64(),
                "open requests did not end within server.shutdown_timeout_secs; closing them"
            );
            server.abort();
            Ok(Ok(()))
        }
    }
}

/// Logs to stderr for reprise's binaries (the server and the benchmarks): `RUST_LOG` picks
/// what; by default info, with llama.cpp's and hnsw_rs's own logs (very chatty at info) at
/// warnings only. Colour codes only for a terminal, not in files and log collectors.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("info,llama-cpp-2=warn,hnsw_rs=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// The body of reprise's binaries (the server and the benchmarks): logging to stderr set up,
/// `body` run on a multi-threaded runtime, and an error printed as one
/// line with its cause chain (no backtrace for configuration and start-up errors), exit 1.
pub fn main_with(body: impl Future<Output = anyhow::Result<()>>) -> std::process::ExitCode {
    init_logging();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))
        .and_then(|rt| rt.block_on(body));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Serves reprise on `listener` until `shutdown` resolves; with `[server] admin_listen`, the
/// admin API on that address (bound here) instead.
///
/// The listener answers at once: `/healthz` is alive while the model and embedder load, every
/// other route (including `/readyz`) answers 503 until loading finished. A loading failure
/// ends `run` with the error.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let admin = match config.server.admin_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (server.admin_listen)"))?,
        ),
        None => None,
    };
    run_with(listener, admin, config, shutdown).await
}

/// [`run`] with the admin listener given by the caller (tests bind both on port 0); with
/// `admin`, the API listener serves no `/admin` route.
pub async fn run_with(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "listening");
    if !addr.ip().is_loopback() && !config.auth.required {
        tracing::warn!(
            %addr,
            "listening beyond loopback without [auth] required = true: any client that reaches \
             this address can use the backend and read what the anonymous tenant cached"
        );
    }
    // Both listeners stop on the one shutdown signal.
    let stop = tokio_util::sync::CancellationToken::new();
    let stopping = stop.clone();
    tokio::spawn(async move {
        shutdown.await;
        stopping.cancel();
    });
    let limits = listen::ConnectionLimits::of(&config.server);
    let (loaded, server) = serve_until_loaded(listener, limits, stop.clone());
    let admin_server = match admin {
        Some(l) => {
            tracing::info!(addr = %l.local_addr()?, "admin API listening");
            Some(serve_until_loaded(l, limits, stop.clone()))
        }
        None => None,
    };
    let started = std::time::Instant::now();
    let state = match AppState::build(config).await {
        Ok(s) => s,
        Err(e) => {
            server.abort();
            if let Some((_, handle)) = &admin_server {
                handle.abort();
            }
            return Err(e);
        }
    };
    if let Some(path) = &state.config.cache.snapshot_path {
        match snapshot::load(&state, path).await {
            Ok(c) => tracing::info!(
                entries = c.entries,
                keys = c.keys,
                skipped = c.skipped,
                "snapshot loaded"
            ),
            Err(e) => tracing::warn!(error = %e, path = %path.display(), "snapshot not loaded"),
        }
    }
    let tasks = tasks::start(&state).await;
    let _ = loaded.set(http::api(state.clone(), admin_server.is_none()));
    if let Some((slot, _)) = &admin_server {
        let _ = slot.set(http::admin_app(state.clone()));
    }
    tracing::info!(
        seconds = started.elapsed().as_secs_f64(),
        "ready: models loaded"
    );
    // Open requests get `shutdown_timeout_secs` to end once the signal came; then `run`
    // goes on (the remaining connections end with the process) to save what must survive.
    let grace = state.config.server.shutdown_timeout();
    let served = drain(server, &stop, grace).await;
    let admin_served = match admin_server {
        Some((_, handle)) => Some(drain(handle, &stop, grace).await),
        None => None,
    };
    tasks.stop(&state).await;
    // What the Redis write queue still holds is written before the process ends (within the
    // shutdown deadline: a Redis that does not answer cannot hold a restart).
    if let Some(redis) = state.store.redis() {
        let grace = state.config.server.shutdown_timeout();
        match tokio::time::timeout(grace, redis.flush()).await {
            Ok(Ok(())) => tracing::info!("redis write queue flushed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "redis write queue not flushed"),
            Err(_) => tracing::warn!("redis write queue not flushed within the shutdown deadline"),
        }
    }
    // Queued spans are sent within the shutdown deadline too.
    if let Some(traces) = &state.traces {
        traces
            .shutdown(state.config.server.shutdown_timeout())
            .await;
    }
    // Saved however the servers ended (one that failed ends the process too).
    if let Some(path) = &state.config.cache.snapshot_path {
        let st = state.clone();
        let p = path.clone();
        match tokio::task::spawn_blocking(move || snapshot::save(&st, &p)).await? {
            Ok(c) => {
                tracing::info!(entries = c.entries, keys = c.keys, path = %path.display(), "snapshot saved")
            }
            Err(e) => tracing::warn!(error = %e, path = %path.display(), "snapshot not saved"),
        }
    }
    served??;
    if let Some(s) = admin_served {
        s??;
    }
    Ok(())
}
