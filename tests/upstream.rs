//! The OpenAI-compatible upstream backend over real TCP: streaming and caching through it,
//! upstream failures, the official Python client, and requests only the upstream can answer
//! (forward: tools, `n > 1`, ...; passthrough: other `/v1` endpoints).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use reprise_backend::fake::{Failure, ScriptConfig, ScriptedBackend};
use serde_json::{json, Value};

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

/// What the tool-calling upstream answers: a JSON body, or these SSE events.
const TOOL_ANSWER: &str = r#"{"id":"chatcmpl-up","object":"chat.completion","created":1,"model":"up-model","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":"tool_calls"}]}"#;
const TOOL_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"weather","arguments":"{\"city\":\"Paris\"}"}}]},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// What makes it answer a stream with comments only, for ever.
const KEEP_ALIVE_ONLY: &str = "KEEP-ALIVE-ONLY";
/// A prompt marker the tool upstream answers with data events that never end.
const ENDLESS: &str = "[endless]";

/// What it answers a question containing [`FILTERED`]: the start of an answer, cut by a
/// content filter.
const FILTERED: &str = "FILTERED";
const FILTER_ANSWER: &str = r#"{"id":"chatcmpl-up","object":"chat.completion","created":1,"model":"up-model","choices":[{"index":0,"message":{"role":"assistant","content":"The first half"},"finish_reason":"content_filter"}],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#;
const FILTER_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"role":"assistant","content":"The first half"},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// What makes it answer as an upstream that ignores `stream_options.include_usage`: three
/// chunks of text and no usage chunk.
const NO_USAGE: &str = "NO_USAGE";
const NO_USAGE_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"role":"assistant","content":"An"},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"content":" answer"},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"content":" here."},"finish_reason":"stop"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// What makes it decline (structured outputs' `refusal`, content null).
const REFUSED: &str = "REFUSED";
const REFUSAL_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{"role":"assistant","content":null,"refusal":"I can't help with that."},"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-up","object":"chat.completion.chunk","created":1,"model":"up-model","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// Keys required, and the tenants of the policy document `doc`.
fn require_tenants(config: &mut reprise::Config, doc: &str) {
    config.auth.required = true;
    config.tenants = reprise::policy::PolicyDocument::from_toml(doc)
        .unwrap()
        .tenants
        .unwrap();
}

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
                let filtered = body.to_string().contains(FILTERED);
                let refused = body.to_string().contains(REFUSED);
                let no_usage = body.to_string().contains(NO_USAGE);
                let idle = body.to_string().contains(KEEP_ALIVE_ONLY);
                let endless = body.to_string().contains(ENDLESS);
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
                        [(header::CONTENT_TYPE, "application/json"), (header::HeaderName::from_static("x-ratelimit-remaining-tokens"), "149000")],
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
                    // A download that sends its start, then nothing more.
                    "/v1/files/stalled/content" => {
                        let start = futures::stream::once(async {
                            Ok::<_, std::io::Error>("the start of a file")
                        });
                        let body = start.chain(futures::stream::pending());
                        (
                            [(header::CONTENT_TYPE, "application/octet-stream")],
                            axum::body::Body::from_stream(body),
                        )
                            .into_response()
                    }
                    // Comments every 50 ms, and never an event.
                    _ if idle && stream => {
                        let comments = futures::stream::unfold((), |()| async {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Some((Ok::<_, std::io::Error>(": keep-alive\n\n"), ()))
                        });
                        (
                            [(header::CONTENT_TYPE, "text/event-stream")],
                            axum::body::Body::from_stream(comments),
                        )
                            .into_response()
                    }
                    // Data events of 64 KiB, as fast as they are read, for ever.
                    _ if endless && stream => {
                        let event = format!("data: {{\"pad\":\"{}\"}}\n\n", "p".repeat(64 * 1024));
                        let events = futures::stream::repeat(event).map(Ok::<_, std::io::Error>);
                        (
                            [(header::CONTENT_TYPE, "text/event-stream")],
                            axum::body::Body::from_stream(events),
                        )
                            .into_response()
                    }
                    _ if no_usage && stream => {
                        ([(header::CONTENT_TYPE, "text/event-stream")], NO_USAGE_STREAM).into_response()
                    }
                    _ if refused && stream => {
                        ([(header::CONTENT_TYPE, "text/event-stream")], REFUSAL_STREAM).into_response()
                    }
                    _ if filtered => match stream {
                        true => ([(header::CONTENT_TYPE, "text/event-stream")], FILTER_STREAM).into_response(),
                        false => ([(header::CONTENT_TYPE, "application/json")], FILTER_ANSWER).into_response(),
                    },
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
            .route(
                "/v1/files/stalled/content",
                axum::routing::get(handler.clone()),
            )
            .route("/v1/files", axum::routing::post(handler.clone()))
            .route(
                "/v1/audio/transcriptions",
                axum::routing::post(handler.clone()),
            )
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

/// An answer a content filter cut short is served as the upstream sent it, and never stored:
/// the next request for it, streamed or not, goes upstream again.
#[tokio::test]
async fn an_answer_cut_by_a_content_filter_is_never_cached() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    let body = |stream: bool| {
        json!({
            "model": "up-model",
            "messages": [{"role": "user", "content": format!("Tell me something {FILTERED}")}],
            "stream": stream,
        })
    };
    for round in 0..2 {
        let r = app.chat(&body(false), &[]).await;
        assert_eq!(cache_status(&r), "miss", "round {round}");
        // Not said to be stored, nor given an entry id nothing is stored under.
        let status = r.headers()["cache-status"].to_str().unwrap().to_string();
        assert_eq!(status, "reprise; fwd=miss");
        assert!(r.headers().get("x-reprise-entry").is_none());
        let j: Value = r.json().await.unwrap();
        assert_eq!(j["choices"][0]["finish_reason"], "content_filter");
        assert_eq!(j["choices"][0]["message"]["content"], "The first half");
        let r = app.chat(&body(true), &[]).await;
        assert_eq!(cache_status(&r), "miss", "round {round}");
        let data = sse_data(&r.text().await.unwrap());
        assert_eq!(sse_text(&data), "The first half");
        assert!(
            data.iter().any(|d| d.contains("\"content_filter\"")),
            "{data:?}"
        );
    }
    assert_eq!(up.seen().len(), 4);
}

/// An upstream that sends no usage chunk: the answer's usage is estimated (its three chunks
/// of text, the prompt's bytes), for the miss and for the hits on it, not reported as 0.
#[tokio::test]
async fn an_upstream_without_usage_gets_an_estimate() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    let body = json!({
        "model": "up-model",
        "messages": [{"role": "user", "content": format!("Answer me {NO_USAGE}")}],
    });
    let mut seen = Vec::new();
    for want in ["miss", "exact"] {
        let r = app.chat(&body, &[]).await;
        assert_eq!(cache_status(&r), want);
        let j: Value = r.json().await.unwrap();
        assert_eq!(j["choices"][0]["message"]["content"], "An answer here.");
        seen.push(j["usage"].clone());
    }
    let usage = &seen[0];
    assert_eq!(usage["completion_tokens"], 3, "{usage}");
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 0, "{usage}");
    assert_eq!(seen[1], seen[0], "the hit reports the stored usage");
    assert_eq!(up.seen().len(), 1);
}

/// A model that declines (a `refusal` instead of content) is not cached as an empty answer:
/// its refusal reaches the client as the text, ended as a filter would, and the next ask
/// goes to the upstream again.
#[tokio::test]
async fn a_refusal_is_passed_on_and_never_cached() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    let body = json!({
        "model": "up-model",
        "messages": [{"role": "user", "content": format!("Fill this schema {REFUSED}")}],
    });
    for round in 0..2 {
        let r = app.chat(&body, &[]).await;
        assert_eq!(cache_status(&r), "miss", "round {round}");
        let j: Value = r.json().await.unwrap();
        assert_eq!(
            j["choices"][0]["message"]["content"],
            "I can't help with that."
        );
        assert_eq!(j["choices"][0]["finish_reason"], "content_filter");
    }
    assert_eq!(up.seen().len(), 2);
}

/// A cap the client names `max_completion_tokens` goes up under that name (reasoning models
/// refuse `max_tokens`), one named `max_tokens` as `max_tokens`.
#[tokio::test]
async fn the_answer_cap_goes_upstream_under_the_name_it_came_with() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    for (i, field) in ["max_completion_tokens", "max_tokens"]
        .into_iter()
        .enumerate()
    {
        let mut body = json!({
            "model": "up-model",
            "messages": [{"role": "user", "content": format!("Question {i} {FILTERED}")}],
        });
        body[field] = json!(9);
        assert_eq!(app.chat(&body, &[]).await.status(), 200);
        let (_, sent) = up.seen().pop().unwrap();
        assert_eq!(sent[field], 9, "{sent}");
        let other = ["max_tokens", "max_completion_tokens"][usize::from(i == 1)];
        assert!(sent.get(other).is_none(), "{sent}");
    }
}

/// A forwarded stream whose upstream only sends keep-alive comments is cut off at the
/// first-token timeout: comments pass, but are no token.
#[tokio::test]
async fn a_forwarded_stream_of_comments_only_is_cut_off() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    config.server.first_token_timeout_secs = 1.0;
    config.server.token_timeout_secs = 1.0;
    let app = proxy_to(config).await;
    let body = json!({
        "model": "up-model",
        "stream": true,
        "messages": [{"role": "user", "content": format!("Weather? {KEEP_ALIVE_ONLY}")}],
        // Forwarded (audio), by a field no other test here counts.
        "modalities": ["text", "audio"],
    });
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "bypass");
    let read = tokio::time::timeout(Duration::from_secs(20), r.bytes()).await;
    let body = read.expect("the stream ends");
    assert!(body.is_err(), "cut off: {body:?}");
}

/// A forwarded stream that never ends is cut off at the generation's size cap (it would hold
/// its upstream slot for as long as the client reads).
#[tokio::test]
async fn a_forwarded_stream_without_end_is_cut_off_at_its_cap() {
    let up = ToolUpstream::spawn().await;
    let app = proxy_to(openai_config(up.base_url.clone())).await;
    let body = json!({
        "model": "up-model",
        "stream": true,
        "messages": [{"role": "user", "content": format!("Talk forever {ENDLESS}")}],
        "modalities": ["text", "audio"],
    });
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "bypass");
    let mut body = r.bytes_stream();
    let mut read = 0usize;
    let ended = loop {
        match body.next().await {
            Some(Ok(chunk)) => read += chunk.len(),
            Some(Err(e)) => break Some(e),
            None => break None,
        }
        assert!(
            read <= 2 * reprise_backend::openai::MAX_STREAM_BYTES,
            "never cut off"
        );
    };
    assert!(ended.is_some(), "cut off with an error");
    assert!(
        read <= reprise_backend::openai::MAX_STREAM_BYTES,
        "{read} bytes"
    );
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

/// A forwarded request (`top_logprobs`, which no other test here counts) is held to the tenant's `max_tokens` cap and token budget like
/// any other: none asked gets the cap written into the body that goes up, more is refused
/// before the upstream sees it, and each answer asked is charged.
#[tokio::test]
async fn forwarded_requests_keep_to_the_tenants_cap_and_budget() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    let doc = "[[tenants]]\nname = \"capped\"\napi_keys = [\"sk-capped\"]\n\
               [tenants.policy]\nmax_tokens = 64\ntokens_per_minute = 200\n\
               [[tenants]]\nname = \"budgeted\"\napi_keys = [\"sk-budgeted\"]\n\
               [tenants.policy]\ntokens_per_minute = 10000\n";
    require_tenants(&mut config, doc);
    let app = proxy_to(config).await;
    let auth = [("authorization", "Bearer sk-capped")];
    let tools = |extra: Value| {
        let mut b = json!({
            "model": "up-model",
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "top_logprobs": 2,
        });
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    // None asked: the cap goes up with it (64 of 200 tokens spent).
    let asked = tools(json!({}));
    assert_eq!(app.chat(&asked, &auth).await.status(), 200);
    let (_, body) = up.seen().pop().unwrap();
    assert_eq!(body["max_tokens"], 64, "{body}");
    assert_eq!(body["top_logprobs"], asked["top_logprobs"]);
    // Within the cap: the body goes up unchanged (50 more, 114).
    let within = tools(json!({"max_completion_tokens": 50}));
    assert_eq!(app.chat(&within, &auth).await.status(), 200);
    assert_eq!(up.seen().pop().unwrap().1, within);
    // Above it: 400, and the upstream never sees it.
    let above = tools(json!({"max_tokens": 65}));
    assert_openai_error(app.chat(&above, &auth).await, 400, Some("max_tokens")).await;
    assert_eq!(up.seen().len(), 2);
    // No bound of 0 either (an upstream may read it as none, and it would cost nothing).
    for field in ["max_tokens", "max_completion_tokens"] {
        let zero = tools(json!({ field: 0 }));
        assert_openai_error(app.chat(&zero, &auth).await, 400, Some(field)).await;
    }
    assert_eq!(up.seen().len(), 2);
    // Two answers of 64 tokens do not fit in the 86 left this minute.
    let two = tools(json!({"n": 2}));
    let r = app.chat(&two, &auth).await;
    assert!(r.headers().contains_key("retry-after"));
    assert_openai_error(r, 429, None).await;
    assert_eq!(up.seen().len(), 2);

    // A tenant with a budget and no cap: a request asking for no bound is given what it is
    // charged (`backend.default_max_tokens`), forwarded or not, never the upstream's default.
    let budgeted = [("authorization", "Bearer sk-budgeted")];
    let default = u64::from(reprise::Config::default().backend.default_max_tokens);
    assert_eq!(app.chat(&asked, &budgeted).await.status(), 200);
    let (_, body) = up.seen().pop().unwrap();
    assert_eq!(body["max_tokens"], default, "{body}");
    let plain = json!({
        "model": "up-model",
        "messages": [{"role": "user", "content": "A question of its own"}],
    });
    // (This upstream answers every chat with a tool call, which a streamed miss does not
    // take: what matters is what went up.)
    app.chat(&plain, &budgeted).await;
    let (_, body) = up.seen().pop().unwrap();
    let bound = body["max_tokens"]
        .as_u64()
        .or(body["max_completion_tokens"].as_u64());
    assert_eq!(bound, Some(default), "{body}");
}

/// An upstream configured to read `max_completion_tokens` (`backend.max_tokens_field`) gets
/// every bound reprise sets on a chat completion under that name, forwarded or generated,
/// never `max_tokens` (which such a model refuses); the legacy completions endpoint keeps
/// `max_tokens`.
#[tokio::test]
async fn bounds_go_up_as_the_field_the_upstream_reads() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    config.backend.max_tokens_field = reprise_backend::BoundField::MaxCompletionTokens;
    let doc = "[[tenants]]\nname = \"capped\"\napi_keys = [\"sk-capped\"]\n\
               [tenants.policy]\nmax_tokens = 64\n";
    require_tenants(&mut config, doc);
    let app = proxy_to(config).await;
    let auth = [("authorization", "Bearer sk-capped")];
    let bound = |body: &Value| {
        (
            body.get("max_tokens").cloned(),
            body.get("max_completion_tokens").cloned(),
        )
    };
    // Forwarded as it came, the cap written in.
    let forwarded = json!({
        "model": "up-model",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "top_logprobs": 2,
    });
    assert_eq!(app.chat(&forwarded, &auth).await.status(), 200);
    let (_, body) = up.seen().pop().unwrap();
    assert_eq!(bound(&body), (None, Some(json!(64))), "{body}");
    // Generated by reprise (a request it caches), the cap and the client's own `max_tokens`.
    for (extra, sent) in [(json!({}), 64), (json!({"max_tokens": 9}), 9)] {
        let mut plain = json!({
            "model": "up-model",
            "messages": [{"role": "user", "content": format!("A question {sent}")}],
        });
        plain
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        app.chat(&plain, &auth).await;
        let (_, body) = up.seen().pop().unwrap();
        assert_eq!(bound(&body), (None, Some(json!(sent))), "{body}");
    }
    // The legacy endpoint knows only `max_tokens`.
    let r = app
        .client
        .post(app.url("/v1/completions"))
        .bearer_auth("sk-capped")
        .json(&json!({"model": "up-model", "prompt": "Once upon a time"}))
        .send()
        .await
        .unwrap();
    drop(r);
    let (path, body) = up.seen().pop().unwrap();
    assert_eq!(path, "/v1/completions");
    assert_eq!(bound(&body), (Some(json!(64)), None), "{body}");
}

/// Text parts with fields of their own (a gateway's `cache_control`) reach the upstream as
/// the client gave them, not as their joined text, and key the answer: the same text without
/// them is another request, asked again. Plain text parts still go as their text.
#[tokio::test]
async fn text_parts_with_their_own_fields_go_up_as_given() {
    let (up, up_backend) = upstream().await;
    let app = proxy_to(openai_config(up.base_url())).await;
    let system = |marked: bool| {
        let mut last = json!({"type": "text", "text": "The manual is long."});
        if marked {
            last["cache_control"] = json!({"type": "ephemeral"});
        }
        json!([{"type": "text", "text": "You answer from the manual. "}, last])
    };
    let asked = |marked: bool| {
        json!({
            "model": "up-model",
            "stream": false,
            "messages": [
                {"role": "system", "content": system(marked)},
                {"role": "user", "content": "How do I reset it?"},
            ],
        })
    };
    // What the upstream was given, as its own parsing reads it.
    let given_system = || {
        let req = up_backend.requests().pop().unwrap();
        let reprise_backend::Input::Chat(msgs) = req.input else {
            panic!("chat input");
        };
        msgs[0].clone()
    };

    let r = app.chat(&asked(true), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let sent = given_system();
    assert_eq!(
        sent.content,
        "You answer from the manual. The manual is long."
    );
    assert_eq!(sent.extra[reprise_backend::GIVEN_PARTS], system(true));
    assert_eq!(cache_status(&app.chat(&asked(true), &[]).await), "exact");

    // The same text without the field: another request, asked upstream as plain text.
    let r = app.chat(&asked(false), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(up_backend.calls(), 2);
    let sent = given_system();
    assert!(sent.is_plain(), "{sent:?}");
    assert_eq!(
        sent.content,
        "You answer from the manual. The manual is long."
    );
}

/// A tenant kept to some models is kept to them on the passthrough endpoints too: an
/// embedding with one of its models goes up, one with another model (or none) is refused
/// before the upstream sees it, and `/v1/models` lists only its own. With tenants, endpoints
/// whose objects live in the upstream account cannot be opened at all.
#[tokio::test]
async fn passthrough_keeps_a_tenant_to_its_models() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    let doc = "[[tenants]]\nname = \"narrow\"\napi_keys = [\"sk-narrow\"]\n\
               [tenants.policy]\nmodels = [\"up-model\", \"text-embedding-3-small\"]\n\
               [[tenants]]\nname = \"wide\"\napi_keys = [\"sk-wide\"]\n";
    require_tenants(&mut config, doc);
    let mut stateful = config.clone();
    stateful.backend.passthrough.push("files".into());
    let err = stateful.validate().unwrap_err().to_string();
    assert!(err.contains("backend.passthrough"), "{err}");

    let app = proxy_to(config).await;
    let embed = |key: &'static str, body: Value| {
        let req = app.client.post(app.url("/v1/embeddings")).bearer_auth(key);
        async move { req.json(&body).send().await.unwrap() }
    };
    let ok = json!({"model": "text-embedding-3-small", "input": "hello"});
    let r = embed("sk-narrow", ok.clone()).await;
    assert_eq!(r.status(), 200);
    // The account's rate-limit headers would tell a tenant how much the others use.
    assert!(r.headers().get("x-ratelimit-remaining-tokens").is_none());
    assert_eq!(up.seen().pop().unwrap(), ("/v1/embeddings".into(), ok));
    let other = json!({"model": "text-embedding-3-large", "input": "hello"});
    assert_openai_error(embed("sk-narrow", other.clone()).await, 404, Some("model")).await;
    let none = json!({"input": "hello"});
    assert_openai_error(embed("sk-narrow", none).await, 403, None).await;
    assert_eq!(up.seen().len(), 1, "neither went up");
    // Another tenant, without a list, is not held back.
    assert_eq!(embed("sk-wide", other).await.status(), 200);
    // The account's models are shared: read, never deleted, by a tenant (a fine-tune
    // another tenant's routes serve, say).
    let seen = up.seen().len();
    for key in ["sk-wide", "sk-narrow"] {
        let r = app
            .client
            .delete(app.url("/v1/models/up-model"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        assert_openai_error(r, 403, None).await;
    }
    assert_eq!(up.seen().len(), seen, "nothing went up");

    let models = |key: &'static str| {
        let req = app.client.get(app.url("/v1/models")).bearer_auth(key);
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let ids = |j: Value| -> Vec<String> {
        j["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        ids(models("sk-narrow").await),
        ["up-model", "text-embedding-3-small"]
    );
    assert_eq!(
        ids(models("sk-wide").await),
        ["up-model"],
        "the upstream's list"
    );
    let r = app
        .client
        .get(app.url("/v1/models/other-model"))
        .bearer_auth("sk-narrow")
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 404, Some("model")).await;
}

/// A tenant with a token budget is charged a passthrough request's input (a token for every
/// 4 bytes of body): one larger than a minute's budget is a 400, one beyond what is left a
/// 429, and neither reaches the upstream; a read is not charged.
#[tokio::test]
async fn passthrough_is_charged_to_a_token_budget() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    let doc = "[[tenants]]\nname = \"budgeted\"\napi_keys = [\"sk-budgeted\"]\n\
               [tenants.policy]\nmax_tokens = 64\ntokens_per_minute = 100\n";
    require_tenants(&mut config, doc);
    config.backend.passthrough.push("audio".into());
    let app = proxy_to(config).await;
    let embed = |input: String| {
        let req = app
            .client
            .post(app.url("/v1/embeddings"))
            .bearer_auth("sk-budgeted");
        let body = json!({"model": "text-embedding-3-small", "input": input});
        async move { req.json(&body).send().await.unwrap() }
    };
    // About 500 bytes: 125 tokens, more than a minute's 100.
    let j = assert_openai_error(embed("x".repeat(450)).await, 400, Some("input")).await;
    let message = j["error"]["message"].as_str().unwrap();
    assert!(message.contains("100 tokens a minute"), "{message}");
    // About 300 bytes (75 tokens) fits once, not twice.
    assert_eq!(embed("y".repeat(250)).await.status(), 200);
    let r = embed("y".repeat(250)).await;
    let retry = r.headers().get("retry-after").cloned();
    assert_openai_error(r, 429, None).await;
    assert!(retry.is_some(), "429 says when to retry");
    assert_eq!(up.seen().len(), 1, "only the one that fitted went up");
    // A JSON body whose media type says otherwise, or nothing, is charged all the same.
    for media in [Some("Application/JSON"), Some("text/plain"), None] {
        let mut req = app
            .client
            .post(app.url("/v1/embeddings"))
            .bearer_auth("sk-budgeted")
            .body(json!({"model": "text-embedding-3-small", "input": "y".repeat(250)}).to_string());
        if let Some(m) = media {
            req = req.header("content-type", m);
        }
        assert_openai_error(req.send().await.unwrap(), 429, None).await;
    }
    assert_eq!(up.seen().len(), 1);
    // So is one labelled as an upload to an endpoint that takes none (upstreams read JSON
    // whatever the label says).
    let upload = |path: &str, media: &str| {
        app.client
            .post(app.url(path))
            .bearer_auth("sk-budgeted")
            .header("content-type", media)
            .body(vec![b'z'; 300])
            .send()
    };
    for media in [
        "multipart/form-data; boundary=b",
        "application/octet-stream",
    ] {
        assert_openai_error(upload("/v1/embeddings", media).await.unwrap(), 429, None).await;
    }
    assert_eq!(up.seen().len(), 1);
    // An upload (multipart) to an endpoint that takes files streams uncharged (75 tokens by
    // the estimate, 25 left): its bytes are no measure of tokens.
    let media = "multipart/form-data; boundary=b";
    let r = upload("/v1/audio/transcriptions", media).await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.seen().len(), 2);
    // Reading the model list costs nothing.
    let r = app
        .client
        .get(app.url("/v1/models"))
        .bearer_auth("sk-budgeted")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A passthrough request other than a read takes one of the upstream's slots
/// (`backend.max_concurrent`) like a completion: while a forwarded stream holds the only
/// slot, an embedding waits for it, one more is refused (the line holds one), and the model
/// list is read meanwhile.
#[tokio::test]
async fn passthrough_takes_an_upstream_slot() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    config.backend.max_concurrent = 1;
    config.backend.max_queue = 1;
    config.server.first_token_timeout_secs = 60.0;
    config.server.token_timeout_secs = 60.0;
    let app = proxy_to(config).await;
    let holder = json!({
        "model": "up-model",
        "stream": true,
        "messages": [{"role": "user", "content": format!("Weather? {KEEP_ALIVE_ONLY}")}],
        "modalities": ["text", "audio"],
    });
    let held = app.chat(&holder, &[]).await;
    assert_eq!(cache_status(&held), "bypass");
    let embed = || {
        let req = app.client.post(app.url("/v1/embeddings"));
        let body = json!({"model": "text-embedding-3-small", "input": "hello"});
        async move { req.json(&body).send().await.unwrap() }
    };
    let waiting = tokio::spawn(embed());
    let state = app.state.clone();
    assert!(
        eventually(Duration::from_secs(10), || state.backend.load().queued == 1).await,
        "the embedding waits for the slot"
    );
    assert_openai_error(embed().await, 429, None).await;
    let models = app.client.get(app.url("/v1/models")).send().await.unwrap();
    assert_eq!(models.status(), 200, "a read takes no slot");
    assert!(!waiting.is_finished());
    drop(held);
    let r = tokio::time::timeout(Duration::from_secs(20), waiting)
        .await
        .expect("the slot is freed")
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A client that stops reading a forwarded answer does not keep its upstream slot: once it
/// has left a chunk unread for the token timeout, its answer is cut off (never ended as if
/// whole), recorded as `client_closed`, and the next request takes the slot. A client that
/// leaves a forwarded stream is recorded as `client_closed` too.
#[tokio::test]
async fn a_client_that_stops_reading_frees_its_upstream_slot() {
    let up = ToolUpstream::spawn().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut config = openai_config(up.base_url.clone());
    config.backend.max_concurrent = 1;
    config.backend.max_queue = 1;
    config.server.first_token_timeout_secs = 60.0;
    config.server.token_timeout_secs = 1.0;
    config.server.request_timeout_secs = 60.0;
    config.log.request_log = Some(path.clone());
    let app = proxy_to(config).await;
    let endless = |text: &str| {
        json!({
            "model": "up-model",
            "stream": true,
            "messages": [{"role": "user", "content": format!("{text} {ENDLESS}")}],
            "modalities": ["text", "audio"],
        })
    };
    // Reads the first chunk, then leaves.
    let left = app.chat(&endless("Weather?"), &[]).await;
    assert_eq!(cache_status(&left), "bypass");
    let mut chunks = left.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    drop(chunks);
    assert!(eventually(Duration::from_secs(10), || log_lines(&path).len() == 1).await);
    assert_eq!(log_lines(&path)[0]["error"], "client_closed");

    // Reads nothing, and keeps its connection open.
    let held = app.chat(&endless("Wind?"), &[]).await;
    assert_eq!(held.status(), 200);
    let mut next = endless("Rain?");
    next["messages"][0]["content"] = json!("Rain?");
    next["stream"] = json!(false);
    let r = tokio::time::timeout(Duration::from_secs(30), app.chat(&next, &[]))
        .await
        .expect("the slot is freed");
    assert_eq!(r.status(), 200);
    let rest = held.bytes().await;
    assert!(rest.is_err(), "the stalled answer ends cut off, not whole");
    assert!(eventually(Duration::from_secs(10), || log_lines(&path).len() == 3).await);
    let closed = log_lines(&path)
        .iter()
        .filter(|l| l["error"] == "client_closed")
        .count();
    assert_eq!(
        closed, 2,
        "the one that left and the one cut off; not the whole answer"
    );
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

/// A read passed through (a file's content) whose upstream stops sending mid-body is cut
/// off once it has sent nothing for the token timeout: it holds no slot, but it must not
/// hold the handler and the client's connection for ever either.
#[tokio::test]
async fn a_passed_through_read_that_stalls_is_cut_off() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    config.backend.passthrough.push("files".into());
    config.server.token_timeout_secs = 0.5;
    let app = proxy_to(config).await;
    let r = app.get("/v1/files/stalled/content").await;
    assert_eq!(r.status(), 200);
    let body = tokio::time::timeout(Duration::from_secs(20), r.bytes())
        .await
        .expect("the stalled body is cut off");
    assert!(body.is_err(), "it ends cut off, not whole");
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
            max_concurrent: 0,
            max_queue: 64,
            priority_aging: None,
            bound_field: Default::default(),
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
    // Without tenants, the one client sees the account's rate limits.
    assert_eq!(r.headers()["x-ratelimit-remaining-tokens"], "149000");
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

    // At least: the recorder is the process's, and other tests pass requests through too.
    let m = app.metrics_text().await;
    for (series, least) in [
        (r#"reprise_passthrough_total{endpoint="embeddings"}"#, 1),
        (r#"reprise_passthrough_total{endpoint="moderations"}"#, 1),
        (r#"reprise_passthrough_total{endpoint="files"}"#, 2),
    ] {
        let n: u64 = m
            .lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        assert!(n >= least, "{series} {n} in\n{m}");
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

/// An upstream that streams its answers a word every `token_ms`, and a proxy that sends it at
/// most one generation at a time (`backend.max_concurrent = 1`).
async fn one_slot_upstream(token_ms: u64, aging_secs: f64) -> (TestApp, TestApp, ScriptedBackend) {
    let (up, up_backend) = upstream().await;
    up_backend.set_config(ScriptConfig {
        model: "up-model".into(),
        token_delay: Duration::from_millis(token_ms),
        ..ScriptConfig::default()
    });
    let mut config = openai_config(up.base_url());
    config.backend.max_concurrent = 1;
    config.backend.priority_aging_secs = aging_secs;
    let app = proxy_to(config).await;
    (app, up, up_backend)
}

fn up_body(text: &str) -> Value {
    json!({"model": "up-model", "messages": [{"role": "user", "content": text}], "stream": true})
}

/// Sends one request in a task and returns its answer's text.
fn send(app: &TestApp, text: &str, priority: &'static str) -> tokio::task::JoinHandle<String> {
    let (client, url, body) = (app.client.clone(), app.chat_url(), up_body(text));
    tokio::spawn(async move {
        let r = client
            .post(url)
            .header("x-reprise-priority", priority)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        sse_text(&sse_data(&r.text().await.unwrap()))
    })
}

/// The upstream's concurrency limit serves waiting requests by priority: with its one slot
/// busy, an interactive request that came after a batch one goes upstream first.
#[tokio::test]
async fn the_upstream_limit_serves_interactive_before_batch() {
    let (app, _up, up_backend) = one_slot_upstream(20, 0.0).await;
    let mut running = app
        .client
        .post(app.chat_url())
        .json(&up_body("one two three four five six seven eight"))
        .send()
        .await
        .unwrap();
    running.chunk().await.unwrap().expect("a first chunk");
    let queued = |interactive, batch| {
        let l = app.state.backend.load();
        l.capacity == 1
            && l.running == 1
            && (l.queued_interactive, l.queued_batch) == (interactive, batch)
    };
    let batch = send(&app, "the batch question", "batch");
    assert!(eventually(Duration::from_secs(30), || queued(0, 1)).await);
    let interactive = send(&app, "the interactive question", "interactive");
    assert!(eventually(Duration::from_secs(30), || queued(1, 1)).await);
    while running.chunk().await.unwrap().is_some() {}
    assert_eq!(
        interactive.await.unwrap(),
        "You asked: the interactive question"
    );
    assert_eq!(batch.await.unwrap(), "You asked: the batch question");
    let order: Vec<String> = up_backend
        .requests()
        .iter()
        .map(|r| match &r.input {
            reprise_backend::Input::Chat(m) => m[0].content.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        order[1..],
        ["the interactive question", "the batch question"],
        "{order:?}"
    );
}

/// A batch request waiting longer than `backend.priority_aging_secs` is served as interactive:
/// a steady interactive stream does not starve it.
#[tokio::test]
async fn the_upstream_limit_ages_batch_through_a_steady_interactive_stream() {
    let (app, _up, _up_backend) = one_slot_upstream(5, 0.2).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two clients asking back to back: whenever the slot frees, one of them waits.
    let clients: Vec<_> = (0..2)
        .map(|c| {
            let (client, url, stop) = (app.client.clone(), app.chat_url(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let body = up_body(&format!("client {c} asks question {n}"));
                    let r = client.post(&url).json(&body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                    n += 1;
                }
            })
        })
        .collect();
    let busy = || {
        let l = app.state.backend.load();
        l.running == 1 && l.queued_interactive >= 1
    };
    assert!(eventually(Duration::from_secs(30), busy).await);
    // Generous: without aging it waits as long as the stream goes on, i.e. forever here.
    let batch = tokio::time::timeout(
        Duration::from_secs(60),
        send(&app, "the batch question", "batch"),
    )
    .await
    .expect("the batch request starved")
    .unwrap();
    assert_eq!(batch, "You asked: the batch question");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for c in clients {
        c.await.unwrap();
    }
}

/// A background generation holding the upstream's only slot is cut when a user request needs
/// it: its stream ends with `Overloaded` (never cached) and the user request goes upstream.
#[tokio::test]
async fn a_background_generation_on_the_upstream_is_preempted_for_a_user_request() {
    use futures::StreamExt;
    use reprise_backend::{BackendError, ChatMessage, GenEvent, GenRequest, Input, Priority};
    let (app, _up, up_backend) = one_slot_upstream(20, 5.0).await;
    let background = GenRequest {
        model: "up-model".into(),
        input: Input::Chat(vec![ChatMessage::new(
            "user",
            "one two three four five six seven eight nine ten",
        )]),
        params: Default::default(),
        priority: Priority::Background,
        extra: Default::default(),
        backend: None,
    };
    let mut stream = app.state.backend.generate(background).await.unwrap();
    assert!(matches!(stream.next().await, Some(Ok(GenEvent::Delta(_)))));
    assert_eq!(app.state.backend.load().running_background, 1);
    let user = send(&app, "a user question", "batch");
    let mut rest = Vec::new();
    while let Some(ev) = stream.next().await {
        rest.push(ev);
    }
    assert!(
        matches!(rest.last(), Some(Err(BackendError::Overloaded { .. }))),
        "{rest:?}"
    );
    assert!(!rest
        .iter()
        .any(|e| matches!(e, Ok(GenEvent::Finish { .. }))));
    assert_eq!(user.await.unwrap(), "You asked: a user question");
    assert_eq!(up_backend.calls(), 2);
    let idle = || {
        let l = app.state.backend.load();
        (l.running, l.queued) == (0, 0)
    };
    assert!(eventually(Duration::from_secs(30), idle).await);
}

/// `GET /v1/models` answered by the upstream's own list counts once against the caller's
/// request rate.
#[tokio::test]
async fn the_upstreams_model_list_counts_once_against_the_rate() {
    let up = ToolUpstream::spawn().await;
    let mut config = openai_config(up.base_url.clone());
    let doc = "[[tenants]]\nname = \"slow\"\napi_keys = [\"sk-slow\"]\n\
               [tenants.policy]\nrequests_per_minute = 1\n";
    require_tenants(&mut config, doc);
    let app = proxy_to(config).await;
    let list = || {
        app.client
            .get(app.url("/v1/models"))
            .bearer_auth("sk-slow")
            .send()
    };
    let r = list().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    // The minute's one request is spent.
    assert_eq!(list().await.unwrap().status(), 429);
}
