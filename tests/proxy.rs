//! The proxy over real TCP: exact tier, streaming, single-flight, controls, errors.
//! A scripted backend makes calls countable and failures injectable.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use reprise_backend::fake::{Failure, ScriptConfig, ScriptedBackend};
use reprise_backend::BackendError;
use serde_json::{json, Value};

#[tokio::test]
async fn miss_then_exact_hit() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("What is the capital of France?");
    let r1 = app.chat(&body, &[]).await;
    assert_eq!(r1.status(), 200);
    assert_eq!(cache_status(&r1), "miss");
    assert!(r1.headers().get("age").is_none());
    let j1: Value = r1.json().await.unwrap();
    assert_eq!(
        j1["choices"][0]["message"]["content"],
        "You asked: What is the capital of France?"
    );
    assert_eq!(j1["object"], "chat.completion");
    assert_eq!(backend.calls(), 1);

    let r2 = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r2), "exact");
    assert_eq!(r2.headers()["cache-status"], "reprise; hit");
    assert!(r2.headers().get("age").is_some());
    let j2: Value = r2.json().await.unwrap();
    assert_eq!(j2["choices"][0]["message"], j1["choices"][0]["message"]);
    assert_eq!(j2["usage"], j1["usage"]);
    assert_eq!(backend.calls(), 1, "a hit must not reach the backend");
}

#[tokio::test]
async fn any_change_to_the_request_is_a_miss() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("hello");
    app.chat(&body, &[]).await;
    let mut b = body.clone();
    b["temperature"] = json!(0.3);
    assert_eq!(cache_status(&app.chat(&b, &[]).await), "miss");
    let mut b = body.clone();
    b["messages"] =
        json!([{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello"}]);
    assert_eq!(cache_status(&app.chat(&b, &[]).await), "miss");
    // `user` and `stream` do not change the answer, so they do not change the key.
    let mut b = body.clone();
    b["user"] = json!("someone");
    assert_eq!(cache_status(&app.chat(&b, &[]).await), "exact");
    assert_eq!(backend.calls(), 3);
}

#[tokio::test]
async fn stream_and_non_stream_share_one_entry() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let mut body = chat_body("tell me about rust");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    assert_eq!(sse_text(&data), "You asked: tell me about rust");
    // Framing: role first, finish reason, then a usage chunk with empty choices.
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let fin: Value = serde_json::from_str(&data[data.len() - 3]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");

    // The non-stream form of the same request is an exact hit.
    let plain = chat_body("tell me about rust");
    let r = app.chat(&plain, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        j["choices"][0]["message"]["content"],
        "You asked: tell me about rust"
    );
    // And the stream form again, rendered from the entry, without a usage chunk this time.
    let mut again = chat_body("tell me about rust");
    again["stream"] = json!(true);
    let r = app.chat(&again, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: tell me about rust");
    assert_eq!(data.last().unwrap(), "[DONE]");
    assert!(!data.iter().any(|d| d.contains("\"usage\"")));
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn completions_endpoint_round_trip() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = json!({"model": "fake", "prompt": "Once upon a time", "max_tokens": 8});
    let r = app.post("/v1/completions", &body).await;
    assert_eq!(cache_status(&r), "miss");
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["object"], "text_completion");
    assert_eq!(j["choices"][0]["text"], "You asked: Once upon a time");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = app.post("/v1/completions", &sbody).await;
    assert_eq!(cache_status(&r), "exact");
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: Once upon a time");
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn single_flight_makes_one_backend_call() {
    let script = ScriptConfig {
        token_delay: Duration::from_millis(20),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(test_config(), script).await;
    let app = Arc::new(app);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let app = app.clone();
        tasks.push(tokio::spawn(async move {
            let mut body = chat_body("a slow question with several words in it");
            if i % 2 == 0 {
                body["stream"] = json!(true);
            }
            let r = app.chat(&body, &[]).await;
            let status = cache_status(&r);
            let text = if i % 2 == 0 {
                sse_text(&sse_data(&r.text().await.unwrap()))
            } else {
                let j: Value = r.json().await.unwrap();
                j["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            };
            (status, text)
        }));
    }
    for t in tasks {
        let (status, text) = t.await.unwrap();
        assert_eq!(text, "You asked: a slow question with several words in it");
        assert!(status == "miss" || status == "exact", "{status}");
    }
    assert_eq!(
        backend.calls(),
        1,
        "identical concurrent misses share one call"
    );
}

#[tokio::test]
async fn no_cache_and_no_store() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("controls");
    // no-store: neither read nor write.
    let r = app.chat(&body, &[("cache-control", "no-store")]).await;
    assert_eq!(cache_status(&r), "bypass");
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss", "no-store must not have written");
    assert_eq!(backend.calls(), 2);
    // Now cached: no-store does not read it either.
    let r = app.chat(&body, &[("cache-control", "no-store")]).await;
    assert_eq!(cache_status(&r), "bypass");
    assert_eq!(backend.calls(), 3);
    // no-cache: skip the lookup, store the fresh answer.
    backend.set_config(ScriptConfig {
        reply: "fresh: {prompt}".into(),
        ..ScriptConfig::default()
    });
    let r = app.chat(&body, &[("cache-control", "no-cache")]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 4);
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        j["choices"][0]["message"]["content"], "fresh: controls",
        "no-cache replaced the entry"
    );
}

#[tokio::test]
async fn namespaces_are_isolated() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("tenant question");
    app.chat(&body, &[("x-reprise-namespace", "a")]).await;
    let r = app.chat(&body, &[("x-reprise-namespace", "b")]).await;
    assert_eq!(cache_status(&r), "miss");
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss", "default namespace is its own");
    let r = app.chat(&body, &[("x-reprise-namespace", "a")]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(backend.calls(), 3);
}

async fn assert_openai_error(r: reqwest::Response, status: u16, param: Option<&str>) -> Value {
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

#[tokio::test]
async fn bad_input_gets_openai_errors_and_changes_nothing() {
    let mut config = test_config();
    config.server.max_body_bytes = 2048;
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let url = app.url("/v1/chat/completions");
    let post = |body: String| {
        app.client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    assert_openai_error(post("{not json".into()).await.unwrap(), 400, None).await;
    assert_openai_error(post(r#"{"model":"fake"}"#.into()).await.unwrap(), 400, None).await;
    assert_openai_error(
        post(r#"{"model":"fake","messages":"hi"}"#.into())
            .await
            .unwrap(),
        400,
        Some("messages"),
    )
    .await;
    assert_openai_error(
        post(
            r#"{"model":"fake","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#
                .into(),
        )
        .await
        .unwrap(),
        400,
        Some("temperature"),
    )
    .await;
    assert_openai_error(
        post(
            r#"{"model":"fake","messages":[{"role":"user","content":"x"}],"temperature":7}"#.into(),
        )
        .await
        .unwrap(),
        400,
        Some("temperature"),
    )
    .await;
    assert_openai_error(
        post(r#"{"model":"fake","messages":[]}"#.into())
            .await
            .unwrap(),
        400,
        Some("messages"),
    )
    .await;
    assert_openai_error(
        post(r#"{"model":"fake","messages":[{"role":"user","content":"x"}],"n":2}"#.into())
            .await
            .unwrap(),
        400,
        Some("n"),
    )
    .await;
    let j = assert_openai_error(
        post(r#"{"model":"gpt-nope","messages":[{"role":"user","content":"x"}]}"#.into())
            .await
            .unwrap(),
        404,
        Some("model"),
    )
    .await;
    assert_eq!(j["error"]["code"], "model_not_found");
    let big = format!(
        r#"{{"model":"fake","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(4096)
    );
    assert_openai_error(post(big).await.unwrap(), 413, None).await;
    let r = app
        .chat(&chat_body("x"), &[("x-reprise-threshold", "lots")])
        .await;
    assert_openai_error(r, 400, Some("x-reprise-threshold")).await;
    let r = app.get("/v1/nothing-here").await;
    assert_openai_error(r, 404, None).await;

    assert_eq!(backend.calls(), 0, "bad input never reaches the backend");
    assert_eq!(app.state.store.entry_count(), 0);
    let r = app.chat(&chat_body("x"), &[]).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "nothing was stored by bad requests"
    );
}

#[tokio::test]
async fn backend_failures_map_to_status_codes_and_are_not_cached() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    backend.set_failure(Failure::AtStart(BackendError::Unavailable(
        "connect 10.9.9.9 refused".into(),
    )));
    let r = app.chat(&chat_body("q"), &[]).await;
    assert_eq!(cache_status(&r), "error");
    let j = assert_openai_error(r, 502, None).await;
    assert!(!j.to_string().contains("10.9.9.9"), "no internal detail");
    backend.set_failure(Failure::AtStart(BackendError::Overloaded {
        retry_after_secs: 3,
    }));
    let r = app.chat(&chat_body("q"), &[]).await;
    assert_eq!(r.headers()["retry-after"], "3");
    assert_openai_error(r, 429, None).await;
    backend.set_failure(Failure::AtStart(BackendError::Timeout));
    assert_openai_error(app.chat(&chat_body("q"), &[]).await, 504, None).await;
    backend.set_failure(Failure::None);
    let r = app.chat(&chat_body("q"), &[]).await;
    assert_eq!(cache_status(&r), "miss");
}

#[tokio::test]
async fn slow_backend_times_out() {
    let mut config = test_config();
    config.server.first_token_timeout_secs = 0.2;
    let script = ScriptConfig {
        first_token_delay: Duration::from_secs(5),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let r = app.chat(&chat_body("slow"), &[]).await;
    assert_openai_error(r, 504, None).await;
    // The abandoned generation is cancelled, not left running for nobody.
    assert!(eventually(Duration::from_secs(2), || backend.active() == 0).await);
    assert_eq!(backend.completed(), 0);
}

#[tokio::test]
async fn cut_off_stream_is_never_cached() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    backend.set_failure(Failure::AfterChunks(2));
    let mut body = chat_body("one two three four five");
    body["stream"] = json!(true);
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200, "the failure came after the first token");
    let data = sse_data(&r.text().await.unwrap());
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert!(last.get("error").is_some(), "error event in-band: {data:?}");
    assert!(!data.iter().any(|d| d == "[DONE]"));
    backend.set_failure(Failure::None);
    let r = app.chat(&body, &[]).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "the cut-off answer was not stored"
    );
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: one two three four five");
    assert_eq!(backend.calls(), 2);
}

#[tokio::test]
async fn client_disconnect_cancels_and_stores_nothing() {
    let script = ScriptConfig {
        reply: "word ".repeat(200),
        token_delay: Duration::from_millis(10),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(test_config(), script).await;
    let mut body = chat_body("long answer please");
    body["stream"] = json!(true);
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    let mut chunks = r.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    drop(chunks);
    assert!(
        eventually(Duration::from_secs(5), || backend.active() == 0).await,
        "the generation stops when its only client leaves"
    );
    assert_eq!(backend.completed(), 0);
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 2);
}

#[tokio::test]
async fn h2c_and_keep_alive() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = h2
            .post(app.url("/v1/chat/completions"))
            .json(&chat_body("over h2"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status(), 200);
    }
    let h1 = reqwest::Client::builder().http1_only().build().unwrap();
    for _ in 0..3 {
        let r = h1
            .post(app.url("/v1/chat/completions"))
            .json(&chat_body("over h2"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_11);
        assert_eq!(cache_status(&r), "exact");
    }
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn models_health_ready_metrics() {
    let (app, _backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let j: Value = app.get("/v1/models").await.json().await.unwrap();
    assert_eq!(j["data"][0]["id"], "fake");
    let r = app.get("/healthz").await;
    assert_eq!(r.status(), 200);
    let r = app.get("/readyz").await;
    assert_eq!(r.status(), 200);
    app.state.set_ready(false);
    let r = app.get("/readyz").await;
    assert_eq!(r.status(), 503);
    app.state.set_ready(true);
    app.chat(&chat_body("m"), &[]).await;
    app.chat(&chat_body("m"), &[]).await;
    let text = app.metrics_text().await;
    for name in [
        "reprise_requests_total{outcome=\"exact\"}",
        "reprise_cache_lookups_total{tier=\"exact\",result=\"hit\"}",
        "reprise_request_duration_seconds_bucket",
        "reprise_time_to_first_token_seconds_bucket",
        "reprise_backend_duration_seconds_bucket",
        "reprise_cache_entries",
        "reprise_cache_bytes",
        "# HELP reprise_requests_total",
    ] {
        assert!(text.contains(name), "missing {name} in\n{text}");
    }
}

#[tokio::test]
async fn run_serves_health_while_loading_and_fails_on_bad_model() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut config = test_config();
    config.backend.model = "/nonexistent/model.gguf".into();
    let err = reprise::run(listener, config, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("/nonexistent/model.gguf"),
        "{err:#}"
    );
}

/// A second reprise over a scripted backend stands in for an OpenAI-compatible upstream
/// whose calls can be counted and whose failures can be injected.
async fn upstream() -> (TestApp, ScriptedBackend) {
    let script = ScriptConfig {
        model: "up-model".into(),
        ..ScriptConfig::default()
    };
    let mut config = test_config();
    config.cache.enabled = false;
    spawn_fake(config, script).await
}

fn openai_config(base_url: String) -> reprise::Config {
    let mut c = test_config();
    c.backend.kind = reprise::config::BackendKind::Openai;
    c.backend.base_url = Some(base_url);
    c
}

async fn proxy_to(config: reprise::Config) -> TestApp {
    let backend = reprise::state::build_backend(&config).await.unwrap();
    spawn_app(config, backend).await
}

#[tokio::test]
async fn upstream_backend_streams_and_caches() {
    let (up, up_backend) = upstream().await;
    let app = proxy_to(openai_config(up.base_url())).await;
    let body = json!({"model": "up-model", "messages": [{"role": "user", "content": "via upstream"}], "stream": true});
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "You asked: via upstream");
    assert_eq!(data.last().unwrap(), "[DONE]");
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let r = app.chat(&plain, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        j["choices"][0]["message"]["content"],
        "You asked: via upstream"
    );
    assert!(
        j["usage"]["completion_tokens"].as_u64().unwrap() > 0,
        "usage from upstream"
    );
    assert_eq!(up_backend.calls(), 1);
    // Upstream errors for the client's request pass through as 4xx.
    let r = app
        .chat(
            &json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 404);
    // Sampling parameters reach the upstream.
    let r = app
        .chat(&json!({"model": "up-model", "messages": [{"role": "user", "content": "p"}], "max_tokens": 2, "seed": 7}), &[])
        .await;
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["choices"][0]["finish_reason"], "length");
    let last = up_backend.requests().pop().unwrap();
    assert_eq!(last.params.max_tokens, Some(2));
    assert_eq!(last.params.seed, Some(7));
}

#[tokio::test]
async fn upstream_dies_mid_stream_nothing_cached() {
    let (up, up_backend) = upstream().await;
    let app = proxy_to(openai_config(up.base_url())).await;
    up_backend.set_failure(Failure::AfterChunks(2));
    let body = json!({"model": "up-model", "messages": [{"role": "user", "content": "a b c d e f"}], "stream": true});
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    let data = sse_data(&r.text().await.unwrap());
    assert!(
        data.iter().any(|d| d.contains("\"error\"")),
        "error event: {data:?}"
    );
    assert!(!data.iter().any(|d| d == "[DONE]"));
    up_backend.set_failure(Failure::None);
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(up_backend.calls(), 2);
}

#[tokio::test]
async fn upstream_down_is_502_and_slow_is_504() {
    // A port that was free a moment ago: connection refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = dead.local_addr().unwrap().port();
    drop(dead);
    let app = proxy_to(openai_config(format!("http://127.0.0.1:{port}/v1"))).await;
    let r = app.chat(&chat_body("anyone?"), &[]).await;
    let j = assert_openai_error(r, 502, None).await;
    assert!(!j.to_string().contains(&port.to_string()), "{j}");

    let (up, up_backend) = upstream().await;
    up_backend.set_config(ScriptConfig {
        model: "up-model".into(),
        first_token_delay: Duration::from_secs(5),
        ..ScriptConfig::default()
    });
    let mut config = openai_config(up.base_url());
    config.server.first_token_timeout_secs = 0.3;
    let app = proxy_to(config).await;
    let r = app
        .chat(
            &json!({"model": "up-model", "messages": [{"role": "user", "content": "slow"}]}),
            &[],
        )
        .await;
    assert_openai_error(r, 504, None).await;
}

#[tokio::test]
async fn official_python_client() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
r = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "from python"}])
print(r.choices[0].message.content)
s = c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "from python"}],
                              stream=True, stream_options={"include_usage": True})
parts, usage = [], None
for chunk in s:
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
    if chunk.usage:
        usage = chunk.usage.total_tokens
print("".join(parts))
print(usage)
raw = c.chat.completions.with_raw_response.create(model="fake", messages=[{"role": "user", "content": "from python"}])
print(raw.headers.get("x-reprise-cache"))
try:
    c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
except openai.NotFoundError as e:
    print("notfound", e.body["code"] if isinstance(e.body, dict) else e.body)
"#;
    let base = app.base_url();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(base)
            .output()
            .expect("python3 runs")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed (pip install openai): {}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "You asked: from python");
    assert_eq!(lines[1], "You asked: from python");
    assert!(lines[2].parse::<u32>().unwrap() > 0);
    assert_eq!(lines[3], "exact");
    assert_eq!(lines[4], "notfound model_not_found");
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn run_saves_a_snapshot_on_shutdown_and_loads_it_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config();
    config.backend.kind = reprise::config::BackendKind::Fake;
    config.cache.snapshot_path = Some(dir.path().join("snap"));
    let client = reqwest::Client::new();
    let body = chat_body("survive a restart");
    for expected in ["miss", "exact"] {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(reprise::run(listener, config.clone(), async {
            let _ = stopped.await;
        }));
        let url = format!("http://{addr}/v1/chat/completions");
        let mut status = String::new();
        for _ in 0..200 {
            if let Ok(r) = client.post(&url).json(&body).send().await {
                if r.status() == 200 {
                    status = cache_status(&r);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(status, expected);
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    }
}

/// What the tool-calling upstream answers: a JSON body, or these SSE events.
const TOOL_ANSWER: &str = r#"{"id":"chatcmpl-up","object":"chat.completion","created":1,"model":"up-model","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}]}"#;
const TOOL_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// An OpenAI-compatible upstream that records every request (path with query, and body) and
/// answers completions with a tool call, plus fixed embeddings, models and moderation (422)
/// answers: the parts of a model API that a scripted backend behind a second reprise cannot
/// play, since reprise answers them only by forwarding.
#[derive(Clone, Default)]
struct ToolUpstream {
    seen: Arc<std::sync::Mutex<Vec<(String, Value)>>>,
    /// The `authorization` header of every request, in order.
    auth: Arc<std::sync::Mutex<Vec<Option<String>>>>,
    base_url: String,
}

impl ToolUpstream {
    async fn spawn() -> ToolUpstream {
        use axum::http::{header, Uri};
        use axum::response::IntoResponse;
        let seen: Arc<std::sync::Mutex<Vec<(String, Value)>>> = Arc::default();
        let auth: Arc<std::sync::Mutex<Vec<Option<String>>>> = Arc::default();
        let (record, record_auth) = (seen.clone(), auth.clone());
        let handler = move |uri: Uri, headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let (record, record_auth) = (record.clone(), record_auth.clone());
            async move {
                let size = body.len();
                let body: Value = serde_json::from_slice(&body).unwrap_or(json!({"bytes": size}));
                let stream = body["stream"] == json!(true);
                let path = uri.path().to_string();
                record.lock().unwrap().push((uri.to_string(), body));
                let given = headers
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_string());
                record_auth.lock().unwrap().push(given);
                match path.as_str() {
                    "/v1/models" => (
                        [(header::CONTENT_TYPE, "application/json"), (header::HeaderName::from_static("x-request-id"), "req_1")],
                        r#"{"object":"list","data":[{"id":"up-model","object":"model"}]}"#,
                    )
                        .into_response(),
                    "/v1/embeddings" => (
                        [(header::CONTENT_TYPE, "application/json")],
                        r#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.25,-0.5]}]}"#,
                    )
                        .into_response(),
                    "/v1/models/old-name" => (
                        axum::http::StatusCode::TEMPORARY_REDIRECT,
                        [(header::LOCATION, "http://127.0.0.1:9/v1/models")],
                    )
                        .into_response(),
                    "/v1/models/busy" => (
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        [(header::RETRY_AFTER, "7")],
                        r#"{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}"#,
                    )
                        .into_response(),
                    "/v1/moderations" => (
                        axum::http::StatusCode::UNPROCESSABLE_ENTITY,
                        [(header::CONTENT_TYPE, "application/json")],
                        r#"{"error":{"message":"input is required","type":"invalid_request_error","param":"input","code":null}}"#,
                    )
                        .into_response(),
                    _ if stream => {
                        ([(header::CONTENT_TYPE, "text/event-stream")], TOOL_STREAM).into_response()
                    }
                    _ => ([(header::CONTENT_TYPE, "application/json")], TOOL_ANSWER).into_response(),
                }
            }
        };
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(handler.clone()))
            .route("/v1/completions", axum::routing::post(handler.clone()))
            .route("/v1/embeddings", axum::routing::post(handler.clone()))
            .route("/v1/moderations", axum::routing::post(handler.clone()))
            .route("/v1/models/old-name", axum::routing::get(handler.clone()))
            .route("/v1/models/busy", axum::routing::get(handler.clone()))
            .route("/v1/files", axum::routing::post(handler.clone()))
            .route("/v1/models", axum::routing::get(handler))
            .layer(axum::extract::DefaultBodyLimit::disable());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        ToolUpstream {
            seen,
            auth,
            base_url: format!("http://{addr}/v1"),
        }
    }

    fn seen(&self) -> Vec<(String, Value)> {
        self.seen.lock().unwrap().clone()
    }
}

#[tokio::test]
async fn requests_beyond_text_go_upstream_unchanged_and_are_never_cached() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    let tools = json!({
        "model": "up-model",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "auto"
    });
    for round in 1..=2 {
        let r = app.chat(&tools, &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(cache_status(&r), "bypass");
        assert_eq!(r.headers()["content-type"], "application/json");
        assert_eq!(
            r.text().await.unwrap(),
            TOOL_ANSWER,
            "the answer comes back unchanged"
        );
        assert_eq!(up.seen().len(), round, "never answered from the cache");
    }
    let (path, body) = up.seen().pop().unwrap();
    assert_eq!(path, "/v1/chat/completions");
    assert_eq!(body, tools, "the body reaches the upstream unchanged");

    // A tool conversation, streamed: call ids and tool results reach the upstream, and its
    // events come back byte for byte.
    let convo = json!({"model": "up-model", "stream": true, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
    ]});
    let r = app.chat(&convo, &[]).await;
    assert_eq!(cache_status(&r), "bypass");
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.text().await.unwrap(), TOOL_STREAM);
    assert_eq!(up.seen().pop().unwrap().1, convo);

    // Several choices, image parts and the completions endpoint's log-probabilities take
    // the same path.
    let several = json!({"model": "up-model", "n": 2,
        "messages": [{"role": "user", "content": "Two names for a cat?"}]});
    let image = json!({"model": "up-model", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]});
    for body in [&several, &image] {
        let r = app.chat(body, &[]).await;
        assert_eq!(cache_status(&r), "bypass");
        assert_eq!(&up.seen().pop().unwrap().1, body);
    }
    let logprobs = json!({"model": "up-model", "prompt": "1, 2, 3,", "logprobs": 2});
    let r = app.post("/v1/completions", &logprobs).await;
    assert_eq!(cache_status(&r), "bypass");
    assert_eq!(
        up.seen().pop().unwrap(),
        ("/v1/completions".into(), logprobs)
    );

    // `only-if-cached` cannot be met by a request that is never cached.
    let before = up.seen().len();
    let r = app
        .chat(&tools, &[("cache-control", "only-if-cached")])
        .await;
    assert_openai_error(r, 504, None).await;
    assert_eq!(up.seen().len(), before);

    assert_eq!(app.state.store.entry_count(), 0, "nothing was stored");
    let m = app.metrics_text().await;
    for line in [
        r#"reprise_forwarded_total{field="tools"} 2"#,
        r#"reprise_forwarded_total{field="messages.tool_calls"} 1"#,
        r#"reprise_forwarded_total{field="n"} 1"#,
        r#"reprise_forwarded_total{field="messages.content"} 1"#,
        r#"reprise_forwarded_total{field="logprobs"} 1"#,
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
}

#[tokio::test]
async fn requests_beyond_text_are_refused_by_a_text_only_backend() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let mut tools = chat_body("Weather in Paris?");
    tools["tools"] = json!([{"type": "function", "function": {"name": "weather"}}]);
    let j = assert_openai_error(app.chat(&tools, &[]).await, 400, Some("tools")).await;
    assert!(
        j["error"]["message"].as_str().unwrap().contains("upstream"),
        "{j}"
    );
    let mut several = chat_body("Two names for a cat?");
    several["n"] = json!(3);
    assert_openai_error(app.chat(&several, &[]).await, 400, Some("n")).await;
    // Fields that ask for nothing beyond text do not count: the request is served.
    let mut plain = chat_body("Weather in Paris?");
    plain["tools"] = json!([]);
    plain["logprobs"] = json!(false);
    plain["n"] = json!(1);
    let r = app.chat(&plain, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn listed_api_endpoints_pass_through_to_the_upstream() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    config.backend.passthrough.push("files".into());
    // Built by hand to give it a key: the upstream sees reprise's key, never the client's.
    let backend =
        reprise_backend::openai::OpenAiBackend::new(reprise_backend::openai::OpenAiConfig {
            base_url: up.base_url.clone(),
            api_key: Some("sk-upstream".into()),
            connect_timeout: Duration::from_secs(5),
            pool_max_idle: 4,
            models: Vec::new(),
        })
        .unwrap();
    let app = spawn_app(config, Arc::new(backend)).await;
    let emb = json!({"model": "text-embedding-3-small", "input": "hello"});
    let r = app
        .client
        .post(app.url("/v1/embeddings?trace=1"))
        .bearer_auth("client-token")
        .json(&emb)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "bypass");
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["data"][0]["embedding"], json!([0.25, -0.5]));
    assert_eq!(
        up.seen().pop().unwrap(),
        ("/v1/embeddings?trace=1".into(), emb),
        "path, query and body arrive unchanged"
    );
    let auth = up.auth.lock().unwrap().last().cloned().flatten();
    assert_eq!(auth.as_deref(), Some("Bearer sk-upstream"));

    // Without a configured model list, /v1/models is the upstream's (its request id too).
    let r = app.get("/v1/models").await;
    assert_eq!(r.headers()["x-request-id"], "req_1");
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["data"][0]["id"], "up-model");

    // The upstream's client errors come back as they are: its 422, and its 404 for a path of
    // a listed endpoint that it does not have.
    let r = app.post("/v1/moderations", &json!({})).await;
    assert_eq!(r.status(), 422);
    assert_eq!(cache_status(&r), "error");
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["error"]["param"], "input");
    let r = app.get("/v1/files/file-1/content").await;
    assert_eq!(r.status(), 404);
    assert_eq!(cache_status(&r), "error");
    let forwarded = up.seen().len();

    // Uploads stream through, past reprise's own body limit for completions.
    let upload = vec![b'x'; app.state.config.server.max_body_bytes + 1024 * 1024];
    let len = upload.len();
    let r = app
        .client
        .post(app.url("/v1/files"))
        .header("content-type", "multipart/form-data; boundary=b")
        .body(upload)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        up.seen().pop().unwrap(),
        ("/v1/files".into(), json!({"bytes": len}))
    );

    // Its server errors too, with their Retry-After.
    let r = app.get("/v1/models/busy").await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "7");
    assert_eq!(cache_status(&r), "error");
    let forwarded = forwarded + 2;

    // A redirect is not followed (it would carry the key elsewhere): reprise answers 502.
    let r = app.get("/v1/models/old-name").await;
    assert_openai_error(r, 502, None).await;
    assert_eq!(up.seen().len(), forwarded + 1);

    // Endpoints not listed, paths that are not plain, and any variant of reprise's own
    // routes never reach the upstream.
    for (method, path) in [
        ("POST", "/v1/batches"),
        ("DELETE", "/v1/vector_stores/vs_1"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1//chat/completions"),
        ("POST", "/v1/completions/x"),
        ("POST", "/v1/embeddings/"),
        ("GET", "/v1/files//x"),
        ("GET", "/not-the-api"),
    ] {
        let r = app
            .client
            .request(method.parse().unwrap(), app.url(path))
            .json(&json!({"model": "up-model", "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{method} {path}");
    }
    assert_eq!(up.seen().len(), forwarded + 1, "nothing else went upstream");

    let m = app.metrics_text().await;
    for line in [
        r#"reprise_passthrough_total{endpoint="embeddings"} 1"#,
        r#"reprise_passthrough_total{endpoint="moderations"} 1"#,
        r#"reprise_passthrough_total{endpoint="files"} 2"#,
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
    assert_eq!(app.state.store.entry_count(), 0);
}

#[tokio::test]
async fn other_api_endpoints_are_404_without_an_upstream() {
    let (app, _) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let r = app
        .client
        .post(app.url("/v1/embeddings"))
        .json(&json!({"model": "fake", "input": "hello"}))
        .send()
        .await
        .unwrap();
    let j = assert_openai_error(r, 404, None).await;
    assert_eq!(j["error"]["code"], "not_found");
}

#[tokio::test]
async fn https_upstreams_are_reached_over_tls() {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let first_bytes = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = [0u8; 3];
        socket.read_exact(&mut head).await.unwrap();
        head
    });
    let app = proxy_to(openai_config(format!("https://{addr}/v1"))).await;
    let r = app.chat(&chat_body("over tls?"), &[]).await;
    // Not a TLS server, so no answer; what matters is that a TLS handshake began.
    assert_openai_error(r, 502, None).await;
    let head = tokio::time::timeout(Duration::from_secs(10), first_bytes)
        .await
        .expect("reprise connected to the https upstream")
        .unwrap();
    assert_eq!(head[0], 0x16, "a TLS handshake record");
    assert_eq!(head[1], 0x03, "TLS version major");
}

#[tokio::test]
async fn a_backend_that_stalls_mid_answer_is_cut_off_and_nothing_is_cached() {
    let mut config = test_config();
    config.server.token_timeout_secs = 0.3;
    let script = ScriptConfig {
        token_delay: Duration::from_secs(3),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let mut body = chat_body("one two three");
    body["stream"] = json!(true);
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(
        sse_text(&data),
        "You",
        "the first word came, then the stall"
    );
    assert!(data.iter().any(|d| d.contains("\"error\"")), "{data:?}");
    assert!(!data.iter().any(|d| d == "[DONE]"));
    let r = app.chat(&chat_body("one two three"), &[]).await;
    assert_openai_error(r, 504, None).await;
    assert_eq!(backend.calls(), 2, "the cut-off answer was not stored");
    app.state.store.run_pending_tasks().await;
    assert_eq!(app.state.store.entry_count(), 0);

    // A slow first token is not a stall: that wait has its own, longer, timeout.
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_millis(800),
        ..ScriptConfig::default()
    });
    let r = app.chat(&chat_body("seven eight"), &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(content(r).await, "You asked: seven eight");
}

#[tokio::test]
async fn max_age_refreshes_answers_older_than_the_client_takes() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("What time is it?");
    assert_eq!(cache_status(&app.chat(&body, &[]).await), "miss");
    tokio::time::sleep(Duration::from_millis(20)).await;
    let r = app.chat(&body, &[("cache-control", "max-age=3600")]).await;
    assert_eq!(cache_status(&r), "exact");
    // Older than zero seconds: generated again, and the fresh answer takes the key over.
    let r = app
        .chat(&body, &[("cache-control", "no-transform, max-age=0")])
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 2);
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(r.headers()["age"], "0");
    assert_eq!(backend.calls(), 2);
}
