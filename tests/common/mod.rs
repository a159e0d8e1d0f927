//! Test support: the shared harness (servers on 127.0.0.1:0, the real embedder, SSE parsing,
//! redis-server processes) and the helpers only the tests use.

#![allow(dead_code)]

use std::time::Duration;

use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use serde_json::Value;

pub use reprise::harness::*;

/// A response header as text, when present.
pub fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

/// The lines of a request log written so far, parsed.
pub fn log_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A chat body for `model` with one user message.
pub fn chat_for(model: &str, text: &str) -> Value {
    serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
}

/// Starts a long streamed raw-prompt continuation of `model` on a llama server and waits
/// for its first chunk: the sequence then holds an engine slot until the response is
/// dropped.
pub async fn hold_llama_slot(app: &TestApp, model: &str) -> reqwest::Response {
    let long = serde_json::json!({"model": model, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,",
        "max_tokens": 400, "stream": true, "temperature": 0.0});
    let mut holder = app
        .client
        .post(app.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .expect("request sent");
    assert_eq!(holder.status(), 200);
    let first = tokio::time::timeout(Duration::from_secs(120), holder.chunk())
        .await
        .expect("a first chunk within the hang guard")
        .expect("a readable body");
    assert!(first.is_some(), "the long generation runs");
    holder
}

/// A `[backend]` table for the bundled GGUF served as `model_name`: one thread, one slot,
/// a small context and short answers.
pub fn small_llama(model_name: &str) -> reprise::config::BackendConfig {
    let gguf = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(gguf.is_file(), "run scripts/fetch-models.sh");
    reprise::config::BackendConfig {
        kind: reprise::config::BackendKind::Llama,
        model: gguf,
        model_name: Some(model_name.into()),
        n_ctx: 1024,
        n_threads: 1,
        parallel: 1,
        max_queue: 4,
        default_max_tokens: 8,
        ..Default::default()
    }
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

/// The `x-reprise-similarity` header of a hit matched by meaning.
pub fn similarity(resp: &reqwest::Response) -> f32 {
    resp.headers()["x-reprise-similarity"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// Sends a verdict (`{"id", "verdict"}`) to `POST /v1/feedback`, with `key` as the bearer.
pub async fn feedback(app: &TestApp, body: Value, key: Option<&str>) -> reqwest::Response {
    let mut req = app.client.post(app.url("/v1/feedback")).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
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

/// Polls the async `f` until it holds or `timeout` passes (for servers started with
/// `reprise::run`, whose state a test cannot read).
pub async fn eventually_async<F: std::future::Future<Output = bool>>(
    timeout: Duration,
    mut f: impl FnMut() -> F,
) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f().await
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

/// Asserts an OpenAI-shaped error with `status` and `param`; returns the body.
pub async fn assert_openai_error(r: reqwest::Response, status: u16, param: Option<&str>) -> Value {
    assert_eq!(r.status().as_u16(), status);
    let j: Value = r.json().await.unwrap();
    let e = &j["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
    assert!(e["type"].as_str().is_some(), "{j}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{j}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{j}");
    }
    j
}

/// Checks of hits with `result` (`reprise_verify_checks_total`) as `app` exposes them; the
/// recorder is the process's, so counts of other tests' apps are in it too.
pub async fn verify_checks(app: &TestApp, result: &str) -> f64 {
    let text = app.metrics_text().await;
    sample(&text, "reprise_verify_checks_total", &[("result", result)]).unwrap_or(0.0)
}

/// The value of the sample of `name` in a Prometheus exposition whose labels include all of
/// `labels`.
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        if n != name {
            return None;
        }
        let has_all = labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
        has_all.then(|| value.parse().ok()).flatten()
    })
}

/// A background request for `model`, routed by its model.
pub fn background_for(model: &str) -> reprise_backend::GenRequest {
    reprise_backend::GenRequest {
        model: model.into(),
        input: reprise_backend::Input::Prompt("a question".into()),
        params: Default::default(),
        priority: reprise_backend::Priority::Background,
        extra: Default::default(),
        backend: None,
    }
}

/// Makes the Redis at `url` stop answering every client for `pause_ms` and lets `tier`'s
/// reads time out meanwhile until its circuit breaker opens (it stays open for the tier's
/// `breaker_cooldown_ms`).
pub async fn open_breaker(url: &str, tier: &reprise_cache::redis::RedisTier, pause_ms: u64) {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause_ms)
        .arg("ALL")
        .query_async(&mut c)
        .await
        .unwrap();
    for _ in 0..6 {
        assert!(tier.get(reprise_cache::EntryId::random()).await.is_err());
    }
}
