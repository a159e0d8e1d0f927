//! Test support: servers on 127.0.0.1:0, the shared real embedder, SSE parsing, and
//! redis-server processes on free ports.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use reprise::{AppState, Config};
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::Backend;
use reprise_embedder::{Embedder, EmbedderConfig, FastEmbedder};
use serde_json::Value;
use tokio::net::TcpListener;

/// Where the fetched models live.
pub fn models_dir() -> PathBuf {
    std::env::var_os("REPRISE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/models")))
}

/// One real embedder per test process (ONNX Runtime initialises once per process).
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

/// A running server.
pub struct TestApp {
    /// Its address.
    pub addr: SocketAddr,
    /// Its state (cache tiers, metrics).
    pub state: Arc<AppState>,
    /// A client with a pooled keep-alive connection.
    pub client: reqwest::Client,
    server: tokio::task::JoinHandle<()>,
    /// Its background work (prefetch, replication, maintenance), cancelled on drop.
    _tasks: reprise::tasks::BackgroundTasks,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl TestApp {
    /// `http://127.0.0.1:PORT`
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// `http://127.0.0.1:PORT/v1`
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// POSTs a chat completion body with extra headers.
    pub async fn chat(&self, body: &Value, headers: &[(&str, &str)]) -> reqwest::Response {
        let mut req = self
            .client
            .post(self.url("/v1/chat/completions"))
            .json(body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send().await.expect("request sent")
    }

    /// GETs `path`.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        let req = self.client.get(self.url(path));
        req.send().await.expect("request sent")
    }

    /// POSTs a JSON body to `path`.
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        let req = self.client.post(self.url(path)).json(body);
        req.send().await.expect("request sent")
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics_text(&self) -> String {
        let r = self.client.get(self.url("/metrics")).send().await;
        r.expect("request sent").text().await.expect("a body")
    }
}

/// Config for tests: in-memory, semantic off unless asked.
pub fn test_config() -> Config {
    let mut c = Config::default();
    c.semantic.enabled = false;
    c
}

/// Serves `state` on a free loopback port.
pub async fn serve(state: Arc<AppState>) -> TestApp {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = reprise::app(state.clone());
    let tasks = reprise::tasks::start(&state);
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    TestApp {
        addr,
        state,
        client: reqwest::Client::new(),
        server,
        _tasks: tasks,
    }
}

/// A server over `backend`, with the real embedder when `config.semantic.enabled`.
pub async fn spawn_app(config: Config, backend: Arc<dyn Backend>) -> TestApp {
    let emb = config.semantic.enabled.then(embedder);
    let state = AppState::new(config, backend, emb).unwrap();
    serve(state).await
}

/// A server over a scripted backend (model name `fake`).
pub async fn spawn_fake(config: Config, script: ScriptConfig) -> (TestApp, ScriptedBackend) {
    let backend = ScriptedBackend::new(script);
    let app = spawn_app(config, Arc::new(backend.clone())).await;
    (app, backend)
}

/// A chat body with one user message.
pub fn chat_body(text: &str) -> Value {
    serde_json::json!({"model": "fake", "messages": [{"role": "user", "content": text}]})
}

/// The `x-reprise-cache` header.
pub fn cache_status(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("x-reprise-cache")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
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

/// Polls `f` until it holds or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}

/// A server over `backend` with the Redis tier of `config` (and the real embedder when
/// `config.semantic.enabled`).
pub async fn spawn_replica(config: Config, backend: Arc<dyn Backend>) -> TestApp {
    let emb = config.semantic.enabled.then(embedder);
    let redis = reprise::state::connect_redis(&config).await.unwrap();
    let state = AppState::with_redis(config, backend, emb, redis).unwrap();
    serve(state).await
}

/// A scripted backend shared by several replicas.
pub fn scripted() -> ScriptedBackend {
    ScriptedBackend::new(ScriptConfig::default())
}

/// Waits for an answer from a `Duration` of polls; returns the last status seen.
pub async fn poll_status(
    app: &TestApp,
    body: &Value,
    headers: &[(&str, &str)],
    want: &str,
) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut h = headers.to_vec();
    h.push(("cache-control", "only-if-cached"));
    loop {
        let r = app.chat(body, &h).await;
        let s = cache_status(&r);
        if s == want || tokio::time::Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Asserts that `body` comes to be answered from the cache with status `want` (polled
/// with `only-if-cached`, see [`poll_status`]).
pub async fn expect_status(app: &TestApp, body: &Value, headers: &[(&str, &str)], want: &str) {
    let got = poll_status(app, body, headers, want).await;
    assert_eq!(got, want, "cache status of {body}");
}

/// The assistant text of a chat completion body.
pub async fn content(r: reqwest::Response) -> String {
    let j: Value = r.json().await.unwrap();
    j["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A chat body for model `fake` from (role, content) pairs.
pub fn convo(msgs: &[(&str, &str)]) -> Value {
    let m: Vec<Value> = msgs
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "fake", "messages": m})
}
