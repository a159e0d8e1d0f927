//! The proxy over real TCP: exact tier, streaming, single-flight, controls, errors, start-up
//! and shutdown (the upstream backend and forwarding are in upstream.rs).
//! A scripted backend makes calls countable and failures injectable.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use reprise_backend::fake::{Failure, ScriptConfig};
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
    // Every chunk before the usage chunk says `"usage": null`, as OpenAI's do.
    for d in &data[..data.len() - 2] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        assert_eq!(chunk.get("usage"), Some(&Value::Null), "{d}");
    }

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

    // A value with bytes that are not visible ASCII is refused, not skipped: the no-store
    // beside them must not be lost (the answer would be stored and shared).
    let body = chat_body("controls with an odd header");
    let raw = reqwest::header::HeaderValue::from_bytes(b"no-store, x=\"caf\xc3\xa9\"").unwrap();
    let r = app
        .client
        .post(app.chat_url())
        .header("cache-control", raw)
        .json(&body)
        .send()
        .await
        .unwrap();
    let j = assert_openai_error(r, 400, Some("cache-control")).await;
    assert!(j["error"]["message"]
        .as_str()
        .unwrap()
        .contains("visible ASCII"));
    assert_eq!(backend.calls(), 4, "refused before the backend");
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss", "nothing was stored");
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
    // Beyond `backend.max_tokens_cap` (4096), under either name.
    for field in ["max_tokens", "max_completion_tokens"] {
        let body = format!(
            r#"{{"model":"fake","messages":[{{"role":"user","content":"x"}}],"{field}":4097}}"#
        );
        assert_openai_error(post(body).await.unwrap(), 400, Some("max_tokens")).await;
    }
    assert_openai_error(post(r#"{"model":"fake"}"#.into()).await.unwrap(), 400, None).await;
    // A stop string longer than 1 KiB (checked against the held-back text on every token).
    let body = format!(
        r#"{{"model":"fake","messages":[{{"role":"user","content":"x"}}],"stop":["{}"]}}"#,
        "s".repeat(1025)
    );
    assert_openai_error(post(body).await.unwrap(), 400, Some("stop")).await;
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

/// `x-reprise-tags` takes at most 32 tags of at most 128 bytes: beyond, a 400 naming the
/// header, and nothing is generated or stored; at the bounds, every tag is stored.
#[tokio::test]
async fn tags_are_bounded_in_number_and_length() {
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let body = chat_body("a tagged question");
    let tags = |n: usize, len: usize| -> String {
        (0..n)
            .map(|i| format!("{i:0>len$}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let too_many = tags(33, 4);
    let too_long = format!("ok,{}", "x".repeat(129));
    for value in [too_many.as_str(), too_long.as_str()] {
        let r = app.chat(&body, &[("x-reprise-tags", value)]).await;
        assert_openai_error(r, 400, Some("x-reprise-tags")).await;
    }
    // Several header lines add up.
    let r = app
        .client
        .post(app.chat_url())
        .json(&body)
        .header("x-reprise-tags", tags(20, 4))
        .header("x-reprise-tags", tags(13, 5))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400, Some("x-reprise-tags")).await;
    assert_eq!(backend.calls(), 0, "refused before the backend");
    assert_eq!(app.state.store.entry_count(), 0, "nothing stored");

    let most = tags(32, 128);
    let r = app.chat(&body, &[("x-reprise-tags", most.as_str())]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    let id = r.headers()["x-reprise-entry"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let entry = app.state.store.get(id).await.expect("stored");
    assert_eq!(entry.tags.len(), 32);
    assert!(entry.tags.iter().all(|t| t.len() == 128));
    assert_eq!(cache_status(&app.chat(&body, &[]).await), "exact");
    assert_eq!(backend.calls(), 1);
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

/// A generation stuck before its first token ends at the first-token timeout, however many
/// identical requests keep joining it: later ones start afresh rather than wait on it for
/// ever (and its backend slot is given back).
#[tokio::test]
async fn a_generation_stuck_before_its_first_token_is_not_joined_for_ever() {
    let mut config = test_config();
    config.server.first_token_timeout_secs = 0.4;
    let script = ScriptConfig {
        first_token_delay: Duration::from_secs(60),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let app = std::sync::Arc::new(app);
    // A request every 0.2 s for 2 s: each finds the last one's generation still in flight.
    let mut asked = Vec::new();
    for _ in 0..10 {
        let app = app.clone();
        asked.push(tokio::spawn(async move {
            app.chat(&chat_body("stuck"), &[]).await.status()
        }));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for a in asked {
        assert_eq!(a.await.unwrap(), 504);
    }
    assert!(
        backend.calls() >= 2,
        "later requests started afresh: {} generations",
        backend.calls()
    );
    assert!(eventually(Duration::from_secs(2), || backend.active() == 0).await);
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

/// A TCP relay in front of `to` that counts the connections clients opened through it.
async fn counting_relay(
    to: std::net::SocketAddr,
) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = opened.clone();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    (addr, opened)
}

/// Three requests over HTTP/2 (prior knowledge, no upgrade) share one connection, and three
/// over HTTP/1.1 share another: the server keeps connections open between requests.
#[tokio::test]
async fn h2c_and_keep_alive() {
    use std::sync::atomic::Ordering::SeqCst;
    let (app, backend) = spawn_fake(test_config(), ScriptConfig::default()).await;
    let (relay, opened) = counting_relay(app.addr).await;
    let url = format!("http://{relay}/v1/chat/completions");
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for _ in 0..3 {
        let r = h2
            .post(&url)
            .json(&chat_body("over h2"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert_eq!(r.status(), 200);
        r.bytes().await.unwrap();
    }
    assert_eq!(opened.load(SeqCst), 1, "three h2 requests, one connection");
    let h1 = reqwest::Client::builder().http1_only().build().unwrap();
    for _ in 0..3 {
        let r = h1
            .post(&url)
            .json(&chat_body("over h2"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_11);
        assert_eq!(cache_status(&r), "exact");
        // Read to the end, so the connection goes back to the client's pool.
        r.bytes().await.unwrap();
    }
    assert_eq!(
        opened.load(SeqCst),
        2,
        "three HTTP/1.1 requests, one connection"
    );
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
        "reprise_requests_total{outcome=\"exact\",tenant=\"anonymous\",model=\"fake\"}",
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

/// Lets a loader blocked opening the pipe at `.0` go on when dropped (a failed assertion
/// included, or the runtime would wait for the blocked loader forever): opens the pipe as a
/// writer (read-write, which never blocks on Linux) and leaves it open, so a loader that opens
/// it later does not block either.
struct Unblock(std::path::PathBuf);

impl Drop for Unblock {
    fn drop(&mut self) {
        let pipe = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.0);
        if let Ok(f) = pipe {
            std::mem::forget(f);
        }
    }
}

/// `run` answers `/healthz` while the model loads, 503 (OpenAI error shape) on everything
/// else, and ends with an error naming the model when the load fails. The model "file" is a
/// named pipe: the loader's open blocks until a writer opens it, so the load is provably
/// still going on while the test asks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_health_while_loading_and_fails_on_bad_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.gguf");
    let made = std::process::Command::new("mkfifo")
        .arg(&model)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut config = test_config();
    config.backend.model = model.clone();
    let unblock = Unblock(model.clone());
    let running = tokio::spawn(reprise::run(listener, config, std::future::pending()));
    // A guard against a server that does not answer at all (a hang becomes a failure).
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let r = client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .expect("/healthz answers while loading");
    assert_eq!(r.status(), 200);
    let r = client
        .post(format!("http://{addr}/healthz"))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 405, None).await;
    let r = client
        .get(format!("http://{addr}/readyz"))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 503, None).await;
    let r = client
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&chat_body("too early"))
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 503, None).await;
    assert!(!running.is_finished(), "the loader still waits on the pipe");
    // Let the load go on; no model is found in the pipe.
    drop(unblock);
    let err = running.await.unwrap().unwrap_err();
    assert!(
        format!("{err:#}").contains(model.to_str().unwrap()),
        "{err:#}"
    );
}

/// A client that leaves a streamed answer midway is recorded as gone (`client_closed`), not
/// as served whole; one that reads it to the end is a miss.
#[tokio::test]
async fn a_client_leaving_a_stream_is_recorded_as_gone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut config = test_config();
    config.log.request_log = Some(path.clone());
    let script = ScriptConfig {
        token_delay: Duration::from_millis(50),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let ask = |text: &str| {
        let mut body = chat_body(text);
        body["stream"] = json!(true);
        body
    };
    let whole = app.chat(&ask("a short one"), &[]).await;
    assert!(whole.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    let long = format!("a long one {}", "word ".repeat(60));
    let r = app.chat(&ask(&long), &[]).await;
    let mut chunks = r.bytes_stream();
    chunks.next().await.unwrap().unwrap();
    drop(chunks);
    assert!(eventually(Duration::from_secs(10), || log_lines(&path).len() == 2).await);
    let lines = log_lines(&path);
    assert_eq!(lines[0]["outcome"], "miss", "{}", lines[0]);
    assert!(lines[0]["error"].is_null(), "{}", lines[0]);
    assert_eq!(lines[1]["outcome"], "error", "{}", lines[1]);
    assert_eq!(lines[1]["error"], "client_closed", "{}", lines[1]);
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

/// Every answer names its entry: a miss the entry it is stored as (streaming or not, and so
/// does a request that joined its generation), a hit the entry that served it; an operator
/// deletes a reported answer by that name.
#[tokio::test]
async fn every_answer_names_its_entry_and_the_operator_can_delete_it() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_ENTRY_ADMIN_TOKEN", "t0ken");
    let mut config = test_config();
    config.server.admin_token_env = Some("REPRISE_TEST_ENTRY_ADMIN_TOKEN".into());
    let script = ScriptConfig {
        token_delay: Duration::from_millis(20),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let entry_of = |r: &reqwest::Response| {
        r.headers()
            .get("x-reprise-entry")
            .map(|v| v.to_str().unwrap().to_string())
    };
    let body = chat_body("name the entry");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (a, b) = tokio::join!(app.chat(&body, &[]), app.chat(&streamed, &[]));
    assert_eq!(backend.calls(), 1, "one generation for both");
    let id = entry_of(&a).expect("a miss names the entry it is stored as");
    assert_eq!(
        entry_of(&b).as_deref(),
        Some(id.as_str()),
        "the joined stream too"
    );
    let _ = (a.text().await, b.text().await);
    let hit = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&hit), "exact");
    assert_eq!(entry_of(&hit).as_deref(), Some(id.as_str()));
    // Not stored, not named.
    let r = app.chat(&body, &[("cache-control", "no-store")]).await;
    assert_eq!(cache_status(&r), "bypass");
    assert_eq!(entry_of(&r), None);
    let r = app
        .client
        .delete(app.url(&format!("/admin/entries/{id}")))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = app
        .chat(&body, &[("cache-control", "only-if-cached")])
        .await;
    assert_eq!(r.status(), 504, "deleted");
}

/// With an admin listener, `/admin` is served there only, and the API only on the other.
#[tokio::test]
async fn the_admin_api_can_live_on_its_own_listener() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_LISTENER_ADMIN_TOKEN", "l1stener");
    let mut config = test_config();
    config.backend.kind = reprise::config::BackendKind::Fake;
    config.server.admin_token_env = Some("REPRISE_TEST_LISTENER_ADMIN_TOKEN".into());
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (api_addr, admin_addr) = (api.local_addr().unwrap(), admin.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(reprise::run_with(api, Some(admin), config, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let body = chat_body("apart");
    let ready = eventually_async(Duration::from_secs(4), || async {
        let r = client
            .post(format!("http://{api_addr}/v1/chat/completions"))
            .json(&body)
            .send()
            .await;
        r.is_ok_and(|r| r.status() == 200)
    });
    assert!(ready.await, "the API came up");
    let get = |addr: std::net::SocketAddr, path: &str| {
        client
            .get(format!("http://{addr}{path}"))
            .bearer_auth("l1stener")
            .send()
    };
    assert_eq!(
        get(api_addr, "/admin/policies").await.unwrap().status(),
        404
    );
    assert_eq!(
        get(admin_addr, "/admin/policies").await.unwrap().status(),
        200
    );
    assert_eq!(get(admin_addr, "/v1/models").await.unwrap().status(), 404);
    assert_eq!(get(admin_addr, "/healthz").await.unwrap().status(), 200);
    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn an_empty_streamed_answer_still_ends_with_done() {
    let (app, _backend) = spawn_fake(
        test_config(),
        ScriptConfig {
            reply: String::new(),
            ..ScriptConfig::default()
        },
    )
    .await;
    let mut body = chat_body("say nothing");
    body["stream"] = json!(true);
    for _ in 0..2 {
        let r = app.chat(&body, &[]).await;
        let outcome = cache_status(&r);
        let data = sse_data(&r.text().await.unwrap());
        assert_eq!(
            data.last().map(String::as_str),
            Some("[DONE]"),
            "{outcome}: {data:?}"
        );
        assert_eq!(sse_text(&data), "");
        let fin: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
        assert_eq!(fin["choices"][0]["finish_reason"], "stop", "{outcome}");
    }
}

/// A request that joined a generation with tags of its own has them stored with the answer
/// it was served: a tag delete it asks for reaches that answer.
#[tokio::test]
async fn a_followers_tags_reach_the_answer_it_shared() {
    std::env::set_var("REPRISE_TEST_FOLLOWER_TAGS_TOKEN", "t4gs");
    let mut config = test_config();
    config.server.admin_token_env = Some("REPRISE_TEST_FOLLOWER_TAGS_TOKEN".into());
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    backend.set_token_delay(Duration::from_millis(200));
    let body = chat_body("one answer, two tag sets");
    let leader = {
        let (client, url, body) = (app.client.clone(), app.chat_url(), body.clone());
        tokio::spawn(async move {
            let r = client
                .post(url)
                .header("x-reprise-tags", "docs-v1")
                .json(&body)
                .send()
                .await
                .unwrap();
            r.text().await.unwrap()
        })
    };
    assert!(eventually(Duration::from_secs(30), || backend.active() == 1).await);
    let follower = app.chat(&body, &[("x-reprise-tags", "pricing")]).await;
    assert_eq!(follower.status(), 200);
    follower.text().await.unwrap();
    leader.await.unwrap();
    assert_eq!(backend.calls(), 1, "one generation for both");
    assert_eq!(cache_status(&app.chat(&body, &[]).await), "exact");
    // The follower's tag reaches it.
    let r = app
        .client
        .delete(app.url("/admin/tags/pricing"))
        .bearer_auth("t4gs")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    app.state.store.run_pending_tasks().await;
    assert_eq!(cache_status(&app.chat(&body, &[]).await), "miss");
}

/// A scripted backend whose first generation's stream panics.
#[derive(Clone)]
struct PanicsOnce {
    inner: reprise_backend::fake::ScriptedBackend,
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl reprise_backend::Backend for PanicsOnce {
    // Written out as `async_trait` expands it (the root crate does not depend on the macro).
    fn generate<'a, 'b>(
        &'a self,
        req: reprise_backend::GenRequest,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<reprise_backend::GenStream, BackendError>>
                + Send
                + 'b,
        >,
    >
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(async move {
            if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let stream: reprise_backend::GenStream = Box::pin(futures::stream::poll_fn(
                    |_| -> std::task::Poll<Option<_>> { panic!("the backend's stream panicked") },
                ));
                return Ok(stream);
            }
            self.inner.generate(req).await
        })
    }

    fn models(&self) -> Vec<String> {
        self.inner.models()
    }

    fn ready(&self) -> bool {
        true
    }
}

/// A generation whose task panics fails its request (instead of leaving it, and every
/// request that would follow it, waiting for ever); the next request generates afresh.
#[tokio::test]
async fn a_generation_that_panics_fails_its_waiters_and_the_next_request_generates() {
    let backend = PanicsOnce {
        inner: reprise_backend::fake::ScriptedBackend::new(ScriptConfig::default()),
        armed: Arc::new(std::sync::atomic::AtomicBool::new(true)),
    };
    let app = spawn_app(test_config(), Arc::new(backend.clone())).await;
    let body = chat_body("Will this one panic?");
    let failed = tokio::time::timeout(Duration::from_secs(20), app.chat(&body, &[]))
        .await
        .expect("the request ends");
    assert!(failed.status().is_server_error(), "{}", failed.status());
    let r = tokio::time::timeout(Duration::from_secs(20), app.chat(&body, &[]))
        .await
        .expect("the request ends");
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.inner.calls(), 1);
}

/// What a client reads from `stream` until the server closes it (at most `limit`; `None`:
/// still open then).
async fn read_until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let read = async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(limit, read).await.ok().map(|_| got)
}

/// A connection that asks nothing, trickles its headers, or stops inside an HTTP/2 preface
/// is closed after `server.header_timeout_secs`, as is a keep-alive connection left idle;
/// past `server.max_connections` a new connection is closed at once (and counted), and
/// clients are served again once the slots are free.
#[tokio::test]
async fn connections_that_ask_nothing_are_closed_and_their_number_is_bounded() {
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpStream;
    let mut config = test_config();
    // Long enough that the three are still held when the fourth comes, on a slow machine.
    config.server.header_timeout_secs = 3.0;
    config.server.max_connections = 3;
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let addr = app.addr;
    // A guard against a server that never closes them (the test fails, it does not hang).
    let limit = Duration::from_secs(20);
    // The harness's own keep-alive connection, if any, is closed as idle meanwhile.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut trickling = TcpStream::connect(addr).await.unwrap();
    trickling
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut preface = TcpStream::connect(addr).await.unwrap();
    preface.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    // Let the server take all three before the fourth comes.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut fourth = TcpStream::connect(addr).await.unwrap();
    let refused = read_until_closed(&mut fourth, limit).await;
    assert_eq!(
        refused.as_deref(),
        Some(&b""[..]),
        "the fourth connection was served"
    );
    for (name, stream) in [
        ("silent", &mut silent),
        ("trickling", &mut trickling),
        ("preface", &mut preface),
    ] {
        let got = read_until_closed(stream, limit).await;
        assert!(got.is_some(), "the {name} connection is still open");
    }
    // An idle keep-alive connection after its request is closed too.
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let answered = read_until_closed(&mut kept, limit).await.expect("closed");
    assert!(
        answered.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answered)
    );
    // Every slot free again: served (on a connection of its own), and the refusal counted.
    let client = reqwest::Client::new();
    let metrics = client
        .get(app.url("/metrics"))
        .bearer_auth("test-scrape")
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), 200);
    let refusals = sample(
        &metrics.text().await.unwrap(),
        "reprise_connections_refused_total",
        &[],
    );
    assert!(refusals.unwrap_or(0.0) >= 1.0, "{refusals:?}");
}
