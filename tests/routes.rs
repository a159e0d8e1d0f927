//! Several backends and routes through the server: a requested model or alias, a tenant and a
//! prompt size pick the backend; the request is cached as the model that answers (answers of
//! different models never mix); a saturated or refusing primary sends the request to its
//! route's fallback, whose answer names its model, is marked degraded and is not stored.
//! Scripted backends count their calls; the last test routes between two real llama.cpp
//! engines.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise::config::{BackendConfig, BackendKind, RouteConfig, TenantConfig};
use reprise::Config;
use reprise_backend::fake::{Failure, ScriptConfig, ScriptedBackend};
use reprise_backend::{Backend, BackendError};
use serde_json::{json, Value};

const SMALL: &str = "small-model";
const LARGE: &str = "large-model";

fn table(name: &str, kind: BackendKind) -> BackendConfig {
    BackendConfig {
        name: name.into(),
        kind,
        ..BackendConfig::default()
    }
}

fn route(toml: &str) -> RouteConfig {
    toml::from_str(toml).unwrap()
}

/// The admin token's variable, unique to this test binary.
const TOKEN_VAR: &str = "REPRISE_TEST_ROUTES_ADMIN_TOKEN";

/// Two scripted backends, `small` and `large`, and `routes` between them.
fn config(routes: &[&str]) -> Config {
    std::env::set_var(TOKEN_VAR, "r0utes");
    let mut c = test_config();
    c.server.admin_token_env = Some(TOKEN_VAR.into());
    c.backends = vec![
        table("small", BackendKind::Fake),
        table("large", BackendKind::Fake),
    ];
    c.routes = routes.iter().map(|r| route(r)).collect();
    c.validate().expect("valid");
    c
}

fn scripted(model: &str, cfg: ScriptConfig) -> ScriptedBackend {
    ScriptedBackend::new(ScriptConfig {
        model: model.into(),
        reply: format!("{model} says: {{prompt}}"),
        ..cfg
    })
}

/// A scripted backend with `slots` decode slots and a waiting line of 8.
fn slotted(model: &str, slots: usize) -> ScriptedBackend {
    scripted(
        model,
        ScriptConfig {
            slots: Some(slots),
            max_queue: Some(8),
            ..Default::default()
        },
    )
}

async fn spawn(c: Config, small: &ScriptedBackend, large: &ScriptedBackend) -> TestApp {
    let backends: Vec<(&str, Arc<dyn Backend>)> = vec![
        ("small", Arc::new(small.clone())),
        ("large", Arc::new(large.clone())),
    ];
    spawn_routed(c, backends).await
}

/// The model a JSON answer names and its text.
async fn answer(r: reqwest::Response) -> (String, String) {
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    (
        v["model"].as_str().unwrap().to_string(),
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

/// An alias routes short prompts to one backend and long ones to another, each answered and
/// cached as the model that answered: the same prompt asked by that model's own name is an
/// exact hit, asked of the other model a miss.
#[tokio::test]
async fn an_alias_routes_by_prompt_size_and_caches_per_served_model() {
    let c = config(&[
        "model = \"auto\"\nmax_prompt_chars = 40\nbackend = \"small\"",
        "model = \"auto\"\nbackend = \"large\"",
    ]);
    let (small, large) = (
        scripted(SMALL, Default::default()),
        scripted(LARGE, Default::default()),
    );
    let app = spawn(c, &small, &large).await;

    let models: Value = app.get("/v1/models").await.json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [SMALL, LARGE, "auto"]);

    let short = "What is a route?";
    let (model, text) = answer(app.chat(&chat_for("auto", short), &[]).await).await;
    assert_eq!(model, SMALL);
    assert!(text.starts_with("small-model says:"), "{text}");
    let long = "Explain in detail how a request finds the backend that answers it.";
    assert!(long.chars().count() > 40);
    let (model, text) = answer(app.chat(&chat_for("auto", long), &[]).await).await;
    assert_eq!(model, LARGE);
    assert!(text.starts_with("large-model says:"), "{text}");
    assert_eq!((small.calls(), large.calls()), (1, 1));

    // Cached as the served model: the model's own name finds the alias's answer...
    let r = app.chat(&chat_for(SMALL, short), &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(answer(r).await.0, SMALL);
    // ...and another model never does.
    let r = app.chat(&chat_for(LARGE, short), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(answer(r).await.0, LARGE);
    assert_eq!((small.calls(), large.calls()), (1, 2));

    // `POST /admin/explain` looks the alias up as the model it is served as.
    let e: Value = app
        .client
        .post(app.url("/admin/explain"))
        .bearer_auth("r0utes")
        .json(&chat_for("auto", short))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(e["backend"], "small");
    assert_eq!(e["model"], SMALL);
    assert_eq!(e["would_serve"]["outcome"], "exact", "{e}");

    // A model nothing serves and no route names: the OpenAI 404.
    let r = app.chat(&chat_for("gpt-unknown", short), &[]).await;
    assert_openai_error(r, 404, Some("model")).await;
}

/// A tenant's route sends its requests for a model to another backend; other tenants keep
/// the backend that serves the model.
#[tokio::test]
async fn a_tenant_route_sends_its_requests_elsewhere() {
    let mut c = config(&[]);
    c.tenants = vec![
        TenantConfig::with_key("acme", "acme-key"),
        TenantConfig::with_key("others", "other-key"),
    ];
    c.routes = vec![
        route(&format!(
            "tenant = \"acme\"\nmodel = \"{SMALL}\"\nbackend = \"large\""
        )),
        route("tenant = \"acme\"\nmodel = \"acme-special\"\nbackend = \"large\""),
    ];
    c.validate().unwrap();
    let (small, large) = (
        scripted(SMALL, Default::default()),
        scripted(LARGE, Default::default()),
    );
    let app = spawn(c, &small, &large).await;
    let acme = [("authorization", "Bearer acme-key")];
    let other = [("authorization", "Bearer other-key")];
    let (model, _) = answer(app.chat(&chat_for(SMALL, "hello there"), &acme).await).await;
    assert_eq!(model, LARGE);
    let (model, _) = answer(app.chat(&chat_for(SMALL, "hello there"), &other).await).await;
    assert_eq!(model, SMALL);
    assert_eq!((small.calls(), large.calls()), (1, 1));
    // A tenant's own alias is listed to it only.
    let listed = |key: &'static str| {
        let req = app.client.get(app.url("/v1/models")).bearer_auth(key);
        async move {
            let v: Value = req.send().await.unwrap().json().await.unwrap();
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(listed("acme-key").await, [SMALL, LARGE, "acme-special"]);
    assert_eq!(listed("other-key").await, [SMALL, LARGE]);
}

/// Backends that serve any model (upstreams without a model list) are told apart by the
/// route: a tenant routed to the second one is answered by it, for a model no backend names,
/// and so are the generations that follow from its requests.
#[tokio::test]
async fn a_route_to_one_of_two_any_model_backends_reaches_that_one() {
    let mut c = config(&[]);
    c.tenants = vec![
        TenantConfig::with_key("acme", "acme-key"),
        TenantConfig::with_key("others", "other-key"),
    ];
    c.routes = vec![route("tenant = \"acme\"\nbackend = \"large\"")];
    c.validate().unwrap();
    // Both serve any model.
    let (first, second) = (
        scripted("", Default::default()),
        scripted("", Default::default()),
    );
    let app = spawn(c, &first, &second).await;
    let acme = [("authorization", "Bearer acme-key")];
    let other = [("authorization", "Bearer other-key")];
    for (i, model) in ["gpt-x", "gpt-y"].iter().enumerate() {
        let r = app
            .chat(&chat_for(model, &format!("question {i}")), &acme)
            .await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!((first.calls(), second.calls()), (0, 2));
    let r = app.chat(&chat_for("gpt-x", "question 9"), &other).await;
    assert_eq!(r.status(), 200);
    assert_eq!((first.calls(), second.calls()), (1, 2));
}

/// A primary whose only slot a user request holds sends the next request to the fallback:
/// answered at once, naming the fallback's model, marked degraded, not stored; once the
/// primary is free, the same question goes to it again (a miss, not the fallback's answer).
#[tokio::test]
async fn a_saturated_primary_sends_the_next_request_to_the_fallback() {
    let c = config(&["model = \"auto\"\nbackend = \"small\"\nfallback = \"large\""]);
    let small = slotted(SMALL, 1);
    let large = scripted(LARGE, Default::default());
    let app = spawn(c, &small, &large).await;
    let before = degraded_fallbacks(&app).await;

    // Hold the primary's slot: a slow answer streaming.
    small.set_token_delay(Duration::from_millis(200));
    let mut held = chat_for("auto", "Tell me a long story about slots.");
    held["stream"] = json!(true);
    let holder = {
        let (client, url) = (app.client.clone(), app.chat_url());
        tokio::spawn(async move { client.post(url).json(&held).send().await.unwrap() })
    };
    assert!(eventually(Duration::from_secs(30), || small.active() == 1).await);

    let r = app
        .chat(&chat_for("auto", "Which backend answers me?"), &[])
        .await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    assert!(header(&r, "x-reprise-entry").is_none(), "not stored");
    assert_eq!(
        header(&r, "cache-status").as_deref(),
        Some("reprise; fwd=miss")
    );
    let (model, text) = answer(r).await;
    assert_eq!(model, LARGE);
    assert!(text.starts_with("large-model says:"), "{text}");
    assert_eq!((small.calls(), large.calls()), (1, 1));
    assert!(degraded_fallbacks(&app).await > before);

    // A streamed answer from the fallback names its model in every chunk.
    let mut body = chat_for("auto", "And a streamed one?");
    body["stream"] = json!(true);
    let r = app.chat(&body, &[]).await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    let text = r.text().await.unwrap();
    let chunks = sse_json(&text);
    assert!(!chunks.is_empty());
    assert!(chunks.iter().all(|c| c["model"] == LARGE), "{text}");

    // The holder finishes; the question the fallback answered goes to the primary now.
    small.set_token_delay(Duration::ZERO);
    assert_eq!(holder.await.unwrap().status(), 200);
    assert!(eventually(Duration::from_secs(30), || small.active() == 0).await);
    let r = app
        .chat(&chat_for("auto", "Which backend answers me?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert!(header(&r, "x-reprise-degraded").is_none());
    assert_eq!(answer(r).await.0, SMALL);
    assert_eq!(small.calls(), 2);
}

/// A primary that refuses at once (unreachable, overloaded) is replaced by the fallback; one
/// that refuses the request itself (invalid) is not: its error is the answer.
#[tokio::test]
async fn a_refusing_primary_falls_back_but_an_invalid_request_does_not() {
    let c = config(&["model = \"auto\"\nbackend = \"small\"\nfallback = \"large\""]);
    let (small, large) = (
        scripted(SMALL, Default::default()),
        scripted(LARGE, Default::default()),
    );
    let app = spawn(c, &small, &large).await;
    small.set_failure(Failure::AtStart(BackendError::Unavailable(
        "connection refused".into(),
    )));
    let r = app.chat(&chat_for("auto", "Are you there?"), &[]).await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    assert_eq!(answer(r).await.0, LARGE);
    small.set_failure(Failure::AtStart(BackendError::Overloaded {
        retry_after_secs: 1,
    }));
    let r = app.chat(&chat_for("auto", "Still there?"), &[]).await;
    assert_eq!(answer(r).await.0, LARGE);

    small.set_failure(Failure::AtStart(BackendError::InvalidRequest {
        message: "prompt too long".into(),
        param: Some("messages".into()),
    }));
    let r = app
        .chat(&chat_for("auto", "A prompt the primary refuses"), &[])
        .await;
    assert_openai_error(r, 400, Some("messages")).await;
    assert_eq!(large.calls(), 2);

    // Without a fallback on the route, an unreachable primary is a 502.
    small.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let r = app
        .chat(&chat_for(SMALL, "Direct to the primary"), &[])
        .await;
    assert_eq!(r.status(), 502);
    assert_eq!(large.calls(), 2);
}

/// `reprise_degraded_total{kind="fallback"}`.
async fn degraded_fallbacks(app: &TestApp) -> f64 {
    series(app, "reprise_degraded_total{kind=\"fallback\"}").await
}

/// Each backend's waiting line is its own series (`backend` and `class`): requests queued
/// for one backend's only slot show under its name, not under the other's.
#[tokio::test]
async fn each_backend_reports_its_own_queue() {
    let mut c = test_config();
    c.backends = vec![
        table("queued-small", BackendKind::Fake),
        table("queued-large", BackendKind::Fake),
    ];
    c.routes = vec![route("model = \"auto\"\nbackend = \"queued-small\"")];
    c.validate().expect("valid");
    let small = slotted(SMALL, 1);
    let large = scripted(LARGE, Default::default());
    let backends: Vec<(&str, Arc<dyn Backend>)> = vec![
        ("queued-small", Arc::new(small.clone())),
        ("queued-large", Arc::new(large.clone())),
    ];
    let app = spawn_routed(c, backends).await;
    small.set_token_delay(Duration::from_millis(200));
    let ask = |text: &str| {
        let (client, url) = (app.client.clone(), app.chat_url());
        let mut body = chat_for("auto", text);
        body["stream"] = json!(true);
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap() })
    };
    let holder = ask("Tell me a long story about queues.");
    assert!(eventually(Duration::from_secs(30), || small.active() == 1).await);
    let waiting = ask("Which backend answers me?");
    assert!(eventually(Duration::from_secs(30), || small.load().queued == 1).await);
    let line = |backend: &str| {
        format!("reprise_backend_queue_length{{backend=\"{backend}\",class=\"interactive\"}}")
    };
    assert_eq!(series(&app, &line("queued-small")).await, 1.0);
    let text = app.metrics_text().await;
    assert!(
        text.contains(&format!("{} 0", line("queued-large"))),
        "{text}"
    );
    small.set_token_delay(Duration::ZERO);
    assert_eq!(holder.await.unwrap().status(), 200);
    assert_eq!(waiting.await.unwrap().status(), 200);
    assert_eq!(series(&app, &line("queued-small")).await, 0.0);
}

/// The value of one series of the exposition (0 when absent).
async fn series(app: &TestApp, name: &str) -> f64 {
    let text = app.metrics_text().await;
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Backend series are labelled by backend: calls and refusals count under the backend asked
/// (a refusal the fallback answered included), a stream's failure under the backend streaming.
#[tokio::test]
async fn backend_calls_and_errors_are_counted_per_backend() {
    // Names of their own: the exposition is shared by every test of this binary.
    let (p, f) = ("primary-counted", "fallback-counted");
    let mut c = config(&[]);
    c.backends = vec![table(p, BackendKind::Fake), table(f, BackendKind::Fake)];
    c.routes = vec![route(&format!(
        "model = \"auto\"\nbackend = \"{p}\"\nfallback = \"{f}\""
    ))];
    c.validate().unwrap();
    let (primary, fallback) = (
        scripted(SMALL, Default::default()),
        scripted(LARGE, Default::default()),
    );
    let app = spawn_routed(
        c,
        vec![
            (p, Arc::new(primary.clone())),
            (f, Arc::new(fallback.clone())),
        ],
    )
    .await;
    let calls = |b: &str| format!("reprise_backend_calls_total{{backend=\"{b}\"}}");
    let errors =
        |b: &str, k: &str| format!("reprise_backend_errors_total{{backend=\"{b}\",kind=\"{k}\"}}");
    // Exposed at 0 before anything ran.
    let text = app.metrics_text().await;
    for name in [
        calls(p),
        calls(f),
        errors(p, "timeout"),
        errors(f, "internal"),
    ] {
        assert!(text.contains(&format!("{name} 0")), "{name} in\n{text}");
    }

    // The primary refuses; the fallback answers.
    primary.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let r = app.chat(&chat_for("auto", "Who answers?"), &[]).await;
    assert_eq!(answer(r).await.0, LARGE);
    // The fallback's stream breaks off after its first words.
    primary.set_failure(Failure::AtStart(BackendError::Overloaded {
        retry_after_secs: 1,
    }));
    fallback.set_failure(Failure::AfterChunks(1));
    let r = app.chat(&chat_for("auto", "And now?"), &[]).await;
    assert!(r.status().is_server_error(), "{}", r.status());

    assert_eq!(series(&app, &calls(p)).await, 2.0);
    assert_eq!(series(&app, &calls(f)).await, 2.0);
    assert_eq!(series(&app, &errors(p, "unavailable")).await, 1.0);
    assert_eq!(series(&app, &errors(p, "overloaded")).await, 1.0);
    assert_eq!(series(&app, &errors(f, "unavailable")).await, 1.0);
    assert_eq!(series(&app, &errors(f, "overloaded")).await, 0.0);
    let text = app.metrics_text().await;
    assert!(
        text.contains(&format!(
            "reprise_backend_duration_seconds_count{{backend=\"{f}\"}} 2"
        )),
        "{text}"
    );
}

/// The JSON chunks of an SSE body.
fn sse_json(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// Two real llama.cpp engines from `[[backends]]` (the bundled GGUF twice, served under two
/// names, one slot each), built as `reprise serve` builds them: the alias goes to the first;
/// while a long generation holds its slot, the next request is answered by the second,
/// naming it and marked degraded.
#[tokio::test]
async fn two_llama_backends_route_by_alias_and_fall_back_when_saturated() {
    let llama = |name: &str| BackendConfig {
        name: name.into(),
        ..small_llama(&format!("smol-{name}"))
    };
    let mut c = test_config();
    c.backends = vec![llama("hot"), llama("cold")];
    c.routes = vec![route(
        "model = \"auto\"\nbackend = \"hot\"\nfallback = \"cold\"",
    )];
    c.validate().unwrap();
    let backends = reprise::state::build_backends(&c)
        .await
        .expect("models load");
    let state = reprise::AppState::with_backends(c, backends, None, None).expect("state builds");
    let app = try_serve(state).await.unwrap();

    let (model, text) = answer(
        app.chat(&chat_for("auto", "What is the capital of France?"), &[])
            .await,
    )
    .await;
    assert_eq!(model, "smol-hot");
    assert!(!text.trim().is_empty());

    // A long raw-prompt continuation holds the hot engine's only slot.
    let holder = hold_llama_slot(&app, "auto").await;

    let r = app
        .chat(&chat_for("auto", "Name a primary colour."), &[])
        .await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    let (model, text) = answer(r).await;
    assert_eq!(model, "smol-cold");
    assert!(!text.trim().is_empty());
    drop(holder);
}

/// Background work asks the backend its own generation goes to: a user request streaming on
/// an upstream-like backend of unknown capacity does not hold back prefetching for a model
/// whose backend has free slots (summed together, the unknown capacity made every backend
/// wait for the busy one to be idle).
#[tokio::test]
async fn background_work_uses_the_spare_slots_of_its_own_backend() {
    let mut c = config(&[]);
    c.prefetch.enabled = true;
    c.prefetch.max_capacity_share = 1.0;
    c.validate().unwrap();
    let small = slotted(SMALL, 2);
    // Unlimited: it cannot tell its capacity.
    let large = scripted(LARGE, Default::default());
    let app = spawn(c, &small, &large).await;
    let state = &app.state;
    let prefetch = state.prefetch.as_ref().expect("prefetch on");
    let ask = |session: String, text: &'static str| {
        let app = &app;
        async move {
            let r = app
                .chat(&chat_for(SMALL, text), &[("x-reprise-session", &session)])
                .await;
            assert_eq!(r.status(), 200);
        }
    };
    // Learn "X then Y" on the small model's backend.
    for i in 0..3 {
        ask(format!("learn-{i}"), "Where do I start?").await;
        ask(format!("learn-{i}"), "And what comes next?").await;
    }
    assert!(eventually(Duration::from_secs(30), || prefetch.stats().links >= 3).await);
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = prefetch.stats();
            s.active == 0 && s.waiting == 0
        })
        .await
    );

    // A user request streams on the large backend for a while.
    large.set_token_delay(Duration::from_millis(500));
    let mut held = chat_for(LARGE, "Tell me a long story about upstreams.");
    held["stream"] = json!(true);
    let holder = {
        let (client, url) = (app.client.clone(), app.chat_url());
        tokio::spawn(async move { client.post(url).json(&held).send().await.unwrap() })
    };
    assert!(eventually(Duration::from_secs(30), || large.active() == 1).await);
    let (small_req, large_req) = (background_for(SMALL), background_for(LARGE));
    let room = reprise::generate::room(state, &small_req, 0).expect("the small backend has slots");
    assert_eq!(room.spare, 2, "{room:?}");
    assert_eq!(
        reprise::generate::room(state, &large_req, 0),
        None,
        "unknown"
    );
    assert_eq!(reprise::generate::users_on(state, &large_req), 1);
    assert_eq!(reprise::generate::users_on(state, &small_req), 0);

    // X again in a new session: its follow-up is dispatched on the small backend's spare
    // slot while the large one is still busy with its user.
    let started = prefetch.stats().started;
    ask("new".into(), "Where do I start?").await;
    assert!(
        eventually(Duration::from_secs(10), || prefetch.stats().started
            > started)
        .await,
        "{:?}",
        prefetch.stats()
    );
    assert_eq!(
        large.active(),
        1,
        "the large backend's user was still streaming"
    );
    large.set_token_delay(Duration::ZERO);
    assert_eq!(holder.await.unwrap().status(), 200);
}

/// One backend down leaves the service up: cache hits are served, a new question goes to the
/// route's fallback, and `/readyz` stays ready and names the backend that is down; with every
/// backend down it is not ready, and hits are still served.
#[tokio::test]
async fn a_backend_down_leaves_hits_and_the_fallback_serving() {
    let c = config(&["model = \"auto\"\nbackend = \"small\"\nfallback = \"large\""]);
    let (small, large) = (
        scripted(SMALL, Default::default()),
        scripted(LARGE, Default::default()),
    );
    let app = spawn(c, &small, &large).await;
    let asked = chat_for("auto", "What is a cache?");
    let (model, _) = answer(app.chat(&asked, &[]).await).await;
    assert_eq!(model, SMALL);
    small.set_ready(false);
    assert_eq!(cache_status(&app.chat(&asked, &[]).await), "exact");
    let r = app.chat(&chat_for("auto", "What is a queue?"), &[]).await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    let (model, _) = answer(r).await;
    assert_eq!(model, LARGE);
    let ready = app.readiness().await;
    assert_eq!(ready["backends"]["small"], false, "{ready}");
    assert_eq!(ready["backends"]["large"], true, "{ready}");
    large.set_ready(false);
    assert_eq!(app.get("/readyz").await.status(), 503);
    assert_eq!(cache_status(&app.chat(&asked, &[]).await), "exact");
    // A new question with nothing up to answer it: 503, asked of no backend.
    let calls = (small.calls(), large.calls());
    let r = app.chat(&chat_for("auto", "What is a stack?"), &[]).await;
    assert!(r.headers().contains_key("retry-after"));
    let j = assert_openai_error(r, 503, None).await;
    assert_eq!(j["error"]["code"], "not_ready", "{j}");
    assert_eq!((small.calls(), large.calls()), calls);
}

/// Background work asks the backend a route chose for its request, not the first serving
/// its model.
#[tokio::test]
async fn background_room_is_read_on_the_backend_the_route_chose() {
    let first = scripted("", Default::default());
    let second = scripted(
        "",
        ScriptConfig {
            slots: Some(2),
            max_queue: Some(8),
            ..Default::default()
        },
    );
    let app = spawn(config(&[]), &first, &second).await;
    let mut req = background_for("gpt-x");
    // Without a route's choice the first (capacity unknown) serves it.
    assert_eq!(reprise::generate::room(&app.state, &req, 0), None);
    req.backend = Some("large".into());
    let room = reprise::generate::room(&app.state, &req, 0).expect("the second tells its slots");
    assert!(room.slots > 0, "{room:?}");
}
