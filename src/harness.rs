//! Servers for tests and benchmarks (feature `harness`): reprise on 127.0.0.1:0 over a given
//! backend, the shared real embedder, SSE parsing, and redis-server processes.
//!
//! Two families:
//!
//! - `start_*`, [`try_serve`], [`load_embedder`] and [`start_redis`] return errors, for
//!   benchmarks (a missing model or `redis-server` is reported, not a panic); the embedder,
//!   when there is one, is the caller's.
//! - `spawn_*`, [`serve`] and [`embedder`] panic: test conveniences. They use the real embedder
//!   from [`models_dir`] whenever `config.semantic.enabled`.
//!
//! A [`Server`] stops serving when dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use anyhow::Context as _;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::Backend;
use reprise_embedder::{Embedder, EmbedderConfig, FastEmbedder};
use serde_json::Value;
use tokio::net::TcpListener;

pub use reprise_cache::testing::{RedisCluster, RedisServer};

use crate::tasks::BackgroundTasks;
use crate::{AppState, Config};

/// A running server, serving until dropped.
pub struct Server {
    /// Its address.
    pub addr: SocketAddr,
    /// Its state (cache tiers, metrics).
    pub state: Arc<AppState>,
    /// A client with a pooled keep-alive connection.
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
    /// Its background work (prefetch, replication, maintenance), cancelled on drop (`None`
    /// once [`Server::shutdown`] stopped it).
    tasks: Option<BackgroundTasks>,
}

/// The name the tests know a [`Server`] by.
pub type TestApp = Server;

impl Drop for Server {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Server {
    /// Shuts down as [`crate::run`] does: stops serving, then stops the background tasks and
    /// saves what they must keep ([`BackgroundTasks::stop`]), and sends the queued spans.
    /// Dropping a server only cancels its tasks.
    pub async fn shutdown(mut self) {
        self.server.abort();
        if let Some(tasks) = self.tasks.take() {
            tasks.stop(&self.state).await;
        }
        if let Some(traces) = &self.state.traces {
            traces
                .shutdown(self.state.config.server.shutdown_timeout())
                .await;
        }
    }

    /// `http://127.0.0.1:PORT` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// `http://127.0.0.1:PORT/v1`
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// `http://127.0.0.1:PORT/v1/chat/completions`
    pub fn chat_url(&self) -> String {
        self.url("/v1/chat/completions")
    }

    /// POSTs a chat completion body with extra headers (panics when the request fails).
    pub async fn chat(&self, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut req = self.client.post(self.chat_url()).json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.expect("request sent")
    }

    /// GETs `path` (panics when the request fails).
    pub async fn get(&self, path: &str) -> reqwest::Response {
        let req = self.client.get(self.url(path));
        req.send().await.expect("request sent")
    }

    /// POSTs a JSON body to `path` (panics when the request fails).
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        let req = self.client.post(self.url(path)).json(body);
        req.send().await.expect("request sent")
    }

    /// The Prometheus text of `/metrics` (panics when the request fails).
    pub async fn metrics_text(&self) -> String {
        let r = self.scrape("/metrics").await;
        r.text().await.expect("a body")
    }

    /// `/readyz` with its details, as whoever may scrape reads it (panics when the request
    /// fails or the body is not JSON).
    pub async fn readiness(&self) -> Value {
        self.scrape("/readyz")
            .await
            .json()
            .await
            .expect("a JSON body")
    }

    /// `path` read with the `/metrics` token.
    async fn scrape(&self, path: &str) -> reqwest::Response {
        let token = self.state.config.server.metrics_token_env.as_ref();
        let token = token
            .and_then(|v| std::env::var(v).ok())
            .unwrap_or_default();
        let r = self.client.get(self.url(path)).bearer_auth(token).send();
        r.await.expect("request sent")
    }
}

/// Where the fetched models live: `REPRISE_MODELS_DIR`, else `<workspace>/models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("REPRISE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models")))
}

/// One real embedder from [`models_dir`] per process (ONNX Runtime initialises once per
/// process). Panics when the model is missing.
pub fn embedder() -> Arc<dyn Embedder> {
    static E: OnceLock<Arc<dyn Embedder>> = OnceLock::new();
    E.get_or_init(|| {
        let dir = models_dir();
        let cfg = EmbedderConfig {
            model_dir: dir.join("all-MiniLM-L6-v2"),
            onnx_runtime: dir.join("libonnxruntime.so"),
            ..EmbedderConfig::default()
        };
        Arc::new(FastEmbedder::load(cfg).expect("embedder loads (run scripts/fetch-models.sh)"))
    })
    .clone()
}

/// The embedder `config`'s `[semantic]` section describes, as the server loads it; `None`
/// when the semantic tier is off.
pub async fn load_embedder(config: &Config) -> anyhow::Result<Option<Arc<dyn Embedder>>> {
    crate::state::build_embedder(config).await
}

/// Config for tests: in-memory, semantic off unless asked.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.semantic.enabled = false;
    // Tests on a busy machine must not see a lookup go on as a miss for being slow; the
    // lookup deadline has tests of its own.
    c.server.lookup_timeout_secs = 60.0;
    // `/metrics` asks for a token where tenants are configured: the tests' scrapes give it.
    // Set once: tests run on many threads, and the environment is process-wide.
    static TOKEN: std::sync::Once = std::sync::Once::new();
    TOKEN.call_once(|| std::env::set_var(TEST_METRICS_TOKEN_VAR, "test-scrape"));
    c.server.metrics_token_env = Some(TEST_METRICS_TOKEN_VAR.into());
    c
}

/// The environment variable [`test_config`] keeps its `/metrics` token in.
pub const TEST_METRICS_TOKEN_VAR: &str = "REPRISE_TEST_METRICS_TOKEN";

/// Serves `state` on a free loopback port.
pub async fn try_serve(state: Arc<AppState>) -> anyhow::Result<Server> {
    let tasks = crate::tasks::start(&state).await;
    serve_with_tasks(state, tasks).await
}

/// Serves `state` whose background tasks already run.
async fn serve_with_tasks(state: Arc<AppState>, tasks: BackgroundTasks) -> anyhow::Result<Server> {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen on 127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let app = crate::app(state.clone());
    let limits = crate::listen::ConnectionLimits::of(&state.config.server);
    let server = tokio::spawn(async move {
        let never = tokio_util::sync::CancellationToken::new();
        if let Err(e) = crate::listen::serve(listener, app, limits, never).await {
            tracing::warn!(error = %e, %addr, "server stopped");
        }
    });
    Ok(Server {
        addr,
        state,
        client: reqwest::Client::new(),
        server,
        tasks: Some(tasks),
    })
}

/// A server over `backend` and `embedder` (the semantic tier needs both
/// `config.semantic.enabled` and an embedder); no Redis tier.
pub async fn start_app(
    config: Config,
    backend: Arc<dyn Backend>,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<Server> {
    try_serve(AppState::new(config, backend, embedder)?).await
}

/// The state of a replica: `backend`, `embedder` and the Redis tier of `config` (the policies
/// shared through it applied, as at start-up), with its background tasks (replication)
/// running until the handle is dropped; not served (see [`start_replica`]).
pub async fn build_replica(
    config: Config,
    backend: Arc<dyn Backend>,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<(Arc<AppState>, BackgroundTasks)> {
    let redis = crate::state::connect_redis(&config).await?;
    let state = AppState::with_redis(config, backend, embedder, redis)?;
    crate::policy::sync(&state).await;
    let tasks = crate::tasks::start(&state).await;
    Ok((state, tasks))
}

/// A replica ([`build_replica`]) served on a free loopback port.
pub async fn start_replica(
    config: Config,
    backend: Arc<dyn Backend>,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<Server> {
    let (state, tasks) = build_replica(config, backend, embedder).await?;
    serve_with_tasks(state, tasks).await
}

/// A server built from `config` alone, as `reprise serve` builds it (backend, embedder and
/// Redis tier as configured; no snapshot).
pub async fn start_configured(config: Config) -> anyhow::Result<Server> {
    try_serve(AppState::build(config).await?).await
}

/// [`try_serve`], panicking on failure.
pub async fn serve(state: Arc<AppState>) -> Server {
    try_serve(state).await.expect("server on 127.0.0.1:0")
}

/// A server over `backend`, with the real embedder when `config.semantic.enabled`.
pub async fn spawn_app(config: Config, backend: Arc<dyn Backend>) -> Server {
    let emb = config.semantic.enabled.then(embedder);
    start_app(config, backend, emb)
        .await
        .expect("server starts")
}

/// A server over several named backends (in `config.backends` order) that `config.routes`
/// choose between, and `embedder`; no Redis tier.
pub async fn start_routed(
    config: Config,
    backends: Vec<(&str, Arc<dyn Backend>)>,
    embedder: Option<Arc<dyn Embedder>>,
) -> anyhow::Result<Server> {
    let named = backends
        .into_iter()
        .map(|(name, b)| (name.to_string(), b))
        .collect();
    try_serve(AppState::with_backends(config, named, embedder, None)?).await
}

/// [`start_routed`] with the real embedder when `config.semantic.enabled`, panicking on
/// failure.
pub async fn spawn_routed(config: Config, backends: Vec<(&str, Arc<dyn Backend>)>) -> Server {
    let emb = config.semantic.enabled.then(embedder);
    start_routed(config, backends, emb)
        .await
        .expect("server starts")
}

/// A server over a scripted backend (model name `fake`).
pub async fn spawn_fake(config: Config, script: ScriptConfig) -> (Server, ScriptedBackend) {
    let backend = ScriptedBackend::new(script);
    let app = spawn_app(config, Arc::new(backend.clone())).await;
    (app, backend)
}

/// A server over `backend` with the Redis tier of `config` (and the real embedder when
/// `config.semantic.enabled`).
pub async fn spawn_replica(config: Config, backend: Arc<dyn Backend>) -> Server {
    let emb = config.semantic.enabled.then(embedder);
    start_replica(config, backend, emb)
        .await
        .expect("replica starts")
}

/// A `redis-server` on a free loopback port that keeps nothing on disk; killed when dropped.
/// Errors when `redis-server` cannot be run; panics when no port works (see
/// [`RedisServer::start`]).
pub fn start_redis() -> anyhow::Result<RedisServer> {
    let probe = std::process::Command::new("redis-server")
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("cannot start redis-server")?;
    anyhow::ensure!(probe.success(), "redis-server --version failed: {probe}");
    Ok(RedisServer::start())
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| {
            let data: Vec<&str> = ev
                .lines()
                .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// The text carried by chat or completion chunks.
pub fn sse_text(data: &[String]) -> String {
    data.iter()
        .filter(|d| d.as_str() != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            let c = v.pointer("/choices/0")?;
            c.pointer("/delta/content")
                .or_else(|| c.get("text"))
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect()
}
