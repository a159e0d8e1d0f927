//! Live policies over real TCP: `PUT /admin/policies` and `SIGHUP` change the semantic policy
//! and the tenants while reprise serves, keep the cache, and refuse an invalid change with the
//! running policies kept. (Its own test binary: it sends SIGHUP to this process.)

mod common;

use std::time::Duration;

use common::*;
use reprise_backend::fake::ScriptConfig;
use serde_json::Value;

const TOKEN_VAR: &str = "REPRISE_TEST_POLICIES_ADMIN_TOKEN";

fn admin_config() -> reprise::Config {
    // The variable name is unique to this test binary.
    std::env::set_var(TOKEN_VAR, "p0licy");
    let mut c = test_config();
    c.server.admin_token_env = Some(TOKEN_VAR.into());
    c
}

async fn put(app: &TestApp, doc: &str) -> reqwest::Response {
    app.client
        .put(app.url("/admin/policies"))
        .bearer_auth("p0licy")
        .body(doc.to_string())
        .send()
        .await
        .unwrap()
}

async fn policies(app: &TestApp) -> Value {
    let r = app
        .client
        .get(app.url("/admin/policies"))
        .bearer_auth("p0licy")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

#[tokio::test]
async fn a_threshold_change_takes_effect_on_the_next_request_and_keeps_the_cache() {
    let mut config = admin_config();
    config.semantic.enabled = true;
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let r = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(
            &chat_body("I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(policies(&app).await["version"], 1);

    // Without the admin token: refused.
    let r = app
        .client
        .put(app.url("/admin/policies"))
        .body("[semantic]\nthreshold = 0.99\n")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = put(&app, "[semantic]\nthreshold = 0.99\n").await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["version"], 2);
    // Another paraphrase, below 0.99: now a miss. The original is still cached.
    let r = app
        .chat(&chat_body("how can I reset my password"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let r = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "exact", "the cache is kept");
    assert_eq!(backend.calls(), 2);

    // Invalid documents are refused with the reason; the running policy stays.
    for (doc, reason) in [
        ("[semantic]\nthreshold = 1.5\n", "semantic.threshold"),
        ("[semantic]\nmodel_dir = \"x\"\n", "model_dir"),
        ("[auth]\nrequired = true\n", "auth.required"),
        ("not toml [", "invalid policy document"),
    ] {
        let r = put(&app, doc).await;
        let j = assert_openai_error(r, 400, None).await;
        let message = j["error"]["message"].as_str().unwrap();
        assert!(message.contains(reason), "{doc}: {message}");
    }
    let view = policies(&app).await;
    assert_eq!(view["version"], 2);
    assert!((view["semantic"]["threshold"].as_f64().unwrap() - 0.99).abs() < 1e-6);
    let metrics = app.metrics_text().await;
    assert!(metrics.contains("reprise_policy_version"), "{metrics}");
}

/// A tenant given a memory share while it holds more than that share is cut down to it at
/// once; the cache of the others is kept.
#[tokio::test]
async fn a_memory_share_given_live_applies_to_what_is_held() {
    let mut config = admin_config();
    config.cache.memory_bytes = 64 * 1024;
    let tenants = "[[tenants]]\nname = \"big\"\napi_keys = [\"sk-big\"]\n\
                   [[tenants]]\nname = \"small\"\napi_keys = [\"sk-small\"]\n";
    let doc = reprise::policy::PolicyDocument::from_toml(tenants).unwrap();
    config.tenants = doc.tenants.unwrap();
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let ask = |key: &'static str, i: usize| {
        let app = &app;
        async move {
            let body = chat_body(&format!(
                "question {i} of a tenant, padded with a few words"
            ));
            let auth = format!("Bearer {key}");
            cache_status(&app.chat(&body, &[("authorization", &auth)]).await)
        }
    };
    for i in 0..40 {
        assert_eq!(ask("sk-big", i).await, "miss");
    }
    assert_eq!(ask("sk-small", 0).await, "miss");
    app.state.store.run_pending_tasks().await;
    assert_eq!(app.state.store.pool_size("big\u{1f}x"), None);
    let held = app.state.store.entry_count();
    assert_eq!(held, 41);

    let shared = "[[tenants]]\nname = \"big\"\napi_keys = [\"sk-big\"]\n\
                  [tenants.policy]\nmemory_share = 0.1\n\
                  [[tenants]]\nname = \"small\"\napi_keys = [\"sk-small\"]\n";
    assert_eq!(put(&app, shared).await.status(), 200);
    let store = app.state.store.clone();
    let cut = eventually_async(Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            store.run_pending_tasks().await;
            store.pool_size("big\u{1f}x").is_some_and(|b| b <= 6554)
        }
    })
    .await;
    assert!(cut, "big's entries cut down to its share");
    assert!(app.state.store.entry_count() < held);
    assert_eq!(
        ask("sk-small", 0).await,
        "exact",
        "the others' entries are kept"
    );
    assert_eq!(ask("sk-big", 39).await, "exact", "the newest of big's stay");
    assert_eq!(ask("sk-big", 0).await, "miss", "the oldest went");
    let view = policies(&app).await;
    assert_eq!(view["tenants"][0]["policy"]["memory_share"], 0.1);
}

#[tokio::test]
async fn tenants_and_keys_change_live() {
    let (app, _backend) = spawn_fake(admin_config(), ScriptConfig::default()).await;
    let doc = "[auth]\nrequired = true\n[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-new\"]\n";
    assert_eq!(put(&app, doc).await.status(), 200);
    let body = chat_body("hello");
    assert_eq!(app.chat(&body, &[]).await.status(), 401);
    let r = app.chat(&body, &[("authorization", "Bearer sk-new")]).await;
    assert_eq!(r.status(), 200);
    let view = policies(&app).await;
    assert_eq!(view["tenants"][0]["name"], "acme");
    assert_eq!(view["tenants"][0]["api_keys"], 1);
    assert!(!view.to_string().contains("sk-new"), "keys never shown");
    // A later semantic-only change keeps the tenants.
    assert_eq!(put(&app, "[semantic]\ngate = true\n").await.status(), 200);
    let r = app.chat(&body, &[("authorization", "Bearer sk-new")]).await;
    assert_eq!(r.status(), 200);
}

#[cfg(unix)]
#[tokio::test]
async fn sighup_reads_the_configuration_file_again() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("reprise.toml");
    let file = |key: &str| {
        format!(
            "[backend]\nkind = \"fake\"\n[semantic]\nenabled = false\n[auth]\nrequired = true\n\
             [[tenants]]\nname = \"acme\"\napi_keys = [\"{key}\"]\n"
        )
    };
    std::fs::write(&path, file("sk-one")).unwrap();
    let config = reprise::Config::load(Some(&path)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(reprise::run(listener, config, async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let status = |key: &'static str| {
        let req = client
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth(key)
            .json(&chat_body("hello"));
        async move { req.send().await.map_or(0, |r| r.status().as_u16()) }
    };
    let up = eventually_async(Duration::from_secs(10), || async {
        status("sk-one").await == 200
    });
    assert!(up.await, "the server came up");
    let hangup = || {
        let pid = std::process::id().to_string();
        let ok = std::process::Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -HUP");
    };
    // A broken file changes nothing.
    std::fs::write(&path, "[auth]\nrequired = maybe\n").unwrap();
    hangup();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(status("sk-one").await, 200);
    // A new key.
    std::fs::write(&path, file("sk-two")).unwrap();
    hangup();
    let changed = eventually_async(Duration::from_secs(5), || async {
        status("sk-two").await == 200
    });
    assert!(changed.await, "the new key works after SIGHUP");
    assert_eq!(status("sk-one").await, 401, "the old key is gone");
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
}

async fn explain(app: &TestApp, body: &Value, query: &str) -> Value {
    let r = app
        .client
        .post(app.url(&format!("/admin/explain{query}")))
        .bearer_auth("p0licy")
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// `POST /admin/explain` says what would be served and why, calls no backend, stores
/// nothing, and agrees with what is then served.
#[tokio::test]
async fn explain_agrees_with_what_is_then_served() {
    let mut config = admin_config();
    config.semantic.enabled = true;
    config.tenants = vec![reprise::config::TenantConfig {
        name: "acme".into(),
        api_keys: vec!["sk-acme".into()],
        api_keys_env: None,
        api_keys_file: None,
        sub_namespaces: true,
        admin_token_env: None,
        candidate: None,
        policy: Default::default(),
    }];
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let r = app
        .chat(&chat_body("How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let stored = r.headers()["x-reprise-entry"].to_str().unwrap().to_string();
    let calls = backend.calls();

    let paraphrase = chat_body("I forgot my password, how can I change it?");
    let e = explain(&app, &paraphrase, "").await;
    assert_eq!(e["would_serve"]["outcome"], "semantic", "{e}");
    assert_eq!(e["would_serve"]["entry"], stored.as_str());
    assert_eq!(e["candidates"][0]["verdict"], "pass", "{e}");
    assert_eq!(
        e["matched_text"],
        "I forgot my password, how can I change it?"
    );
    // Another tenant has nothing to be served.
    let other = explain(&app, &paraphrase, "?tenant=acme").await;
    assert_eq!(other["would_serve"]["outcome"], "miss", "{other}");
    assert_eq!(other["candidates"].as_array().unwrap().len(), 0);
    // A negation: the candidate is close, the gate says no.
    let negation = chat_body("How do I not reset my password?");
    let n = explain(&app, &negation, "").await;
    assert_eq!(n["would_serve"]["outcome"], "miss", "{n}");
    let verdict = n["candidates"][0]["verdict"].as_str().unwrap_or_default();
    assert!(!matches!(verdict, "pass" | ""), "{n}");
    assert_eq!(backend.calls(), calls, "explaining calls no backend");

    // What is then served agrees.
    let r = app.chat(&paraphrase, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(r.headers()["x-reprise-entry"].to_str().unwrap(), stored);
    let r = app.chat(&negation, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    // Without the admin token: refused.
    let r = app
        .client
        .post(app.url("/admin/explain"))
        .json(&paraphrase)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}
