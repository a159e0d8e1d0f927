//! Live policies over real TCP: `PUT /admin/policies` and `SIGHUP` change the semantic policy
//! and the tenants while reprise serves, keep the cache, and refuse an invalid change with the
//! running policies kept; with a real redis-server, a change made on one replica reaches the
//! others and the replicas started later. (Its own test binary: it sends SIGHUP to this
//! process.)

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

/// [`admin_config`] with keys required and the tenants of a policy document.
fn tenants_config(doc: &str, semantic: bool) -> reprise::Config {
    let mut c = admin_config();
    c.semantic.enabled = semantic;
    c.auth.required = true;
    c.tenants = reprise::policy::PolicyDocument::from_toml(doc)
        .unwrap()
        .tenants
        .unwrap();
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

/// A change sent with `If-Match` applies only over the version it names: one written
/// before another change (or a rollback) is refused, and the running policies stay.
#[tokio::test]
async fn a_change_against_an_old_version_is_refused() {
    let (app, _backend) = spawn_fake(admin_config(), ScriptConfig::default()).await;
    let read = app
        .client
        .get(app.url("/admin/policies"))
        .bearer_auth("p0licy")
        .send()
        .await
        .unwrap();
    assert_eq!(read.headers()["etag"], "\"1\"");
    let put_if = |doc: &'static str, tag: &'static str| {
        app.client
            .put(app.url("/admin/policies"))
            .bearer_auth("p0licy")
            .header("if-match", tag)
            .body(doc)
            .send()
    };
    let r = put_if("[semantic]\nthreshold = 0.95\n", "\"1\"")
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Written against version 1, which is gone.
    let r = put_if("[semantic]\nthreshold = 0.97\n", "\"1\"")
        .await
        .unwrap();
    let j = assert_openai_error(r, 412, Some("If-Match")).await;
    assert_eq!(j["error"]["code"], "version_mismatch");
    let running = policies(&app).await;
    assert_eq!(running["version"], 2);
    assert_eq!(
        running["semantic"]["threshold"].as_f64().unwrap() as f32,
        0.95
    );
    let r = put_if("[semantic]\nthreshold = 0.97\n", "not a version")
        .await
        .unwrap();
    assert_openai_error(r, 400, Some("If-Match")).await;
    // `*` or no If-Match: a change applies over whatever runs.
    let r = put_if("[semantic]\nthreshold = 0.96\n", "*").await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(policies(&app).await["version"], 3);
    assert_eq!(
        put(&app, "[semantic]\nthreshold = 0.97\n").await.status(),
        200
    );
}

/// Every `[semantic]` key the README lists changes live, and `GET` shows it.
#[tokio::test]
async fn the_context_keys_of_semantic_change_live() {
    let mut config = admin_config();
    config.semantic.enabled = true;
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let doc =
        "[semantic]\nstandalone = false\ncontext_equivalence = true\nfollowup_threshold = 0.8\n";
    assert_eq!(put(&app, doc).await.status(), 200);
    let semantic = policies(&app).await["semantic"].clone();
    assert_eq!(semantic["standalone"], false, "{semantic}");
    assert_eq!(semantic["context_equivalence"], true, "{semantic}");
    assert_eq!(semantic["followup_threshold"].as_f64().unwrap() as f32, 0.8);
    let running = app.state.policies.load();
    assert!(!running.semantic.standalone && running.semantic.context_equivalence);
    drop(running);
    // Back to `threshold`; the rest stays.
    assert_eq!(
        put(&app, "[semantic]\nfollowup_threshold = -1\n")
            .await
            .status(),
        200
    );
    let semantic = policies(&app).await["semantic"].clone();
    assert!(semantic["followup_threshold"].is_null(), "{semantic}");
    assert_eq!(semantic["context_equivalence"], true, "{semantic}");
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
    // The tier's count follows its evictions once moka has run them (under a loaded
    // machine, after the ledger's).
    let fewer = eventually_async(Duration::from_secs(10), || {
        let store = store.clone();
        async move {
            store.run_pending_tasks().await;
            store.entry_count() < held
        }
    })
    .await;
    assert!(fewer, "entries evicted from the tier");
    assert_eq!(
        ask("sk-small", 0).await,
        "exact",
        "the others' entries are kept"
    );
    // Which of big's entries its share keeps is the eviction policy's choice (moka's, not
    // strict recency): some stay, within the share.
    store.run_pending_tasks().await;
    let big = store.pool_size("big\u{1f}x");
    assert!(big.is_some_and(|b| b > 0 && b <= 6554), "big holds {big:?}");
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

/// Replicas of `admin_config` sharing the Redis at `url`.
fn replica_config(url: String, semantic: bool) -> reprise::Config {
    let mut c = admin_config();
    c.semantic.enabled = semantic;
    c.redis.url = Some(url);
    // Generous: a replica reads the shared policies at start within one command's bound, and
    // this machine may be busy.
    c.redis.timeout_ms = 2000;
    c.redis.breaker_cooldown_ms = 200;
    c
}

/// Whether `app` runs `version` with `threshold`.
async fn runs(app: &TestApp, version: u64, threshold: f64) -> bool {
    let view = policies(app).await;
    view["version"] == version
        && view["semantic"]["threshold"]
            .as_f64()
            .is_some_and(|t| (t - threshold).abs() < 1e-6)
}

/// The fields of the shared policies hash, read straight from Redis.
async fn stored_policies(url: &str) -> std::collections::HashMap<String, String> {
    let mut c = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("HGETALL")
        .arg("reprise:policies")
        .query_async(&mut c)
        .await
        .unwrap()
}

/// A threshold changed on replica A reaches replica B (same version, and B serves under it)
/// and a replica started afterwards.
#[tokio::test]
async fn a_change_on_one_replica_reaches_the_others_and_later_ones() {
    let server = RedisServer::start();
    let config = replica_config(server.url(), true);
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(config.clone(), backend.clone()).await;
    let b = spawn_replica(config.clone(), backend.clone()).await;
    let r = a.chat(&chat_body("How do I reset my password?"), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    // B has the entry, and serves this paraphrase from it under the default threshold.
    let paraphrase = chat_body("how can I reset my password");
    expect_status(&b, &paraphrase, &[], "semantic").await;

    let r = put(&a, "[semantic]\nthreshold = 0.99\n").await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["shared"], true, "{j}");
    let version = j["version"].as_u64().unwrap();
    assert!(version > 1, "{j}");
    assert!(runs(&a, version, 0.99).await);
    let reached = eventually_async(Duration::from_secs(20), || runs(&b, version, 0.99));
    assert!(reached.await, "B runs A's version: {}", policies(&b).await);
    // B now serves nothing below 0.99: the same paraphrase is no longer answered.
    let r = b
        .chat(&paraphrase, &[("cache-control", "only-if-cached")])
        .await;
    assert_eq!(r.status(), 504, "{}", cache_status(&r));
    let calls = backend.calls();
    let r = b.chat(&paraphrase, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), calls + 1);
    // (The gauge `reprise_policy_version` is process-wide: other tests here move it too, so
    // the version is checked through GET /admin/policies above.)

    // A replica started now starts with it.
    let c = spawn_replica(config, backend).await;
    assert!(runs(&c, version, 0.99).await, "{}", policies(&c).await);
}

/// A document larger than the replicas read from Redis (`redis.max_value_bytes`) is refused
/// (400), and neither this replica nor Redis changes.
#[tokio::test]
async fn a_document_the_others_could_not_read_is_refused() {
    let server = RedisServer::start();
    let mut config = replica_config(server.url(), false);
    config.redis.max_value_bytes = 4096;
    let a = spawn_replica(config, std::sync::Arc::new(scripted())).await;
    let before = policies(&a).await;
    let r = put(&a, "[semantic]\nthreshold = 0.91\n").await;
    assert_eq!(r.status(), 200);
    let version = r.json::<Value>().await.unwrap()["version"].clone();
    let stored = stored_policies(&server.url()).await;
    // Forty tenants with long names: the document grows past 4 KiB.
    let mut doc = String::new();
    for i in 0..40 {
        let name = format!("tenant-{i:02}-{}", "x".repeat(50));
        doc.push_str(&format!(
            "[[tenants]]\nname = \"{name}\"\napi_keys = [\"sk-{i}\"]\n"
        ));
    }
    let r = put(&a, &doc).await;
    let err = assert_openai_error(r, 400, None).await;
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_value_bytes"),
        "{err}"
    );
    let after = policies(&a).await;
    assert_eq!(after["version"], version, "{after}");
    assert_eq!(after["tenants"], before["tenants"], "{after}");
    assert_eq!(stored_policies(&server.url()).await, stored);
}

/// A plain key in a document is stored in Redis only as its digest, and still names the
/// tenant on every replica.
#[tokio::test]
async fn keys_reach_redis_only_as_digests() {
    let server = RedisServer::start();
    let config = replica_config(server.url(), false);
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(config.clone(), backend.clone()).await;
    let b = spawn_replica(config, backend).await;
    let doc = "[auth]\nrequired = true\n[[tenants]]\nname = \"acme\"\n\
               api_keys = [\"sk-plain-secret-1\"]\n";
    let r = put(&a, doc).await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["shared"], true, "{j}");

    let stored = stored_policies(&server.url()).await;
    assert_eq!(stored["version"], j["version"].to_string());
    let digest = reprise::auth::KeyDigest::of("sk-plain-secret-1").to_string();
    assert!(stored["doc"].contains(&digest), "{stored:?}");
    for value in stored.values() {
        assert!(!value.contains("sk-plain-secret-1"), "{stored:?}");
    }
    // B learns the key from the digest. (Until B runs the change it serves anyone as the
    // anonymous tenant: it is known to run it once a keyless request is refused.)
    let body = chat_body("hello");
    let key = [("authorization", "Bearer sk-plain-secret-1")];
    let applied = eventually_async(Duration::from_secs(20), || async {
        b.chat(&body, &[]).await.status() == 401
    });
    assert!(applied.await, "B runs the change: {}", policies(&b).await);
    assert_eq!(b.chat(&body, &key).await.status(), 200);
}

/// A version that is not valid on replica B (it runs without the semantic tier, which A's
/// policies switch on) leaves B serving under its own, counted; a later valid version from
/// another replica is applied.
#[tokio::test]
async fn a_version_invalid_on_a_replica_leaves_it_running() {
    let server = RedisServer::start();
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(replica_config(server.url(), true), backend.clone()).await;
    let b = spawn_replica(replica_config(server.url(), false), backend.clone()).await;
    let failures = || async {
        let text = b.metrics_text().await;
        text.lines()
            .find_map(|l| l.strip_prefix("reprise_policy_sync_failures_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let before = failures().await;
    let r = put(&a, "[semantic]\nthreshold = 0.95\n").await;
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["shared"], true, "{j}");
    let counted = eventually_async(Duration::from_secs(20), || async {
        failures().await > before
    });
    assert!(counted.await, "B counted the failure");
    let view = policies(&b).await;
    assert_eq!(view["version"], 1, "{view}");
    assert_eq!(view["semantic"]["enabled"], false, "{view}");
    let r = b.chat(&chat_body("still serving?"), &[]).await;
    assert_eq!(r.status(), 200);

    // A replica like B cannot build on a version it cannot run: its change is refused
    // rather than written over what it could not read (the running policies stay).
    let c = spawn_replica(replica_config(server.url(), false), backend).await;
    let r = put(&c, "[semantic]\nthreshold = 0.9\n").await;
    assert_openai_error(r, 400, None).await;
    assert_eq!(policies(&c).await["version"], 1);
    // A version B can run, published where the shared one runs: B takes it.
    let r = put(&a, "[semantic]\nenabled = false\nthreshold = 0.9\n").await;
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["shared"], true, "{j}");
    let version = j["version"].as_u64().unwrap();
    assert!(version > 2, "{j}");
    let reached = eventually_async(Duration::from_secs(20), || runs(&b, version, 0.9));
    assert!(reached.await, "{}", policies(&b).await);
}

/// With a policy key, a stored version not signed with it (a forgery, or a document from
/// before the key or its format) is not applied, and does not block changes: one made on a
/// replica is published over it and reaches the others.
#[tokio::test]
async fn a_version_not_signed_with_the_key_is_written_over() {
    const KEY_VAR: &str = "REPRISE_TEST_POLICIES_UNSIGNED_KEY";
    std::env::set_var(KEY_VAR, "a secret every replica shares");
    let server = RedisServer::start();
    let mut c = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("reprise:policies")
        .arg("version")
        .arg(7)
        .arg("doc")
        .arg("{\"semantic\": {\"threshold\": 0.5}}")
        .query_async(&mut c)
        .await
        .unwrap();
    let mut config = replica_config(server.url(), true);
    config.server.policy_key_env = Some(KEY_VAR.into());
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(config.clone(), backend.clone()).await;
    let b = spawn_replica(config, backend).await;
    assert!(runs(&a, 1, 0.86).await, "{}", policies(&a).await);
    let r = put(&a, "[semantic]\nthreshold = 0.95\n").await;
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["shared"], true, "{j}");
    let version = j["version"].as_u64().unwrap();
    assert!(version > 7, "{j}");
    let reached = eventually_async(Duration::from_secs(20), || runs(&b, version, 0.95));
    assert!(reached.await, "{}", policies(&b).await);
}

/// Two replicas changing different sections at the same time: both changes hold, and both
/// replicas end on the same version.
#[tokio::test]
async fn concurrent_changes_on_two_replicas_end_on_one_version() {
    let server = RedisServer::start();
    let config = replica_config(server.url(), false);
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(config.clone(), backend.clone()).await;
    let b = spawn_replica(config, backend).await;
    let tenants = "[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme\"]\n";
    let (ra, rb) = tokio::join!(put(&a, "[semantic]\nthreshold = 0.97\n"), put(&b, tenants));
    assert_eq!((ra.status().as_u16(), rb.status().as_u16()), (200, 200));
    let (ja, jb): (Value, Value) = (ra.json().await.unwrap(), rb.json().await.unwrap());
    assert_eq!(
        (&ja["shared"], &jb["shared"]),
        (&Value::Bool(true), &Value::Bool(true))
    );
    assert_ne!(ja["version"], jb["version"], "two changes, two versions");
    let last = ja["version"].as_u64().max(jb["version"].as_u64()).unwrap();
    for app in [&a, &b] {
        let both = eventually_async(Duration::from_secs(20), || async {
            let view = policies(app).await;
            runs(app, last, 0.97).await && view["tenants"][0]["name"] == "acme"
        });
        assert!(both.await, "{}", policies(app).await);
    }
}

/// With Redis down, a replica starts on its file's policies and a change holds on it alone
/// (`"shared": false`); once Redis is back, the next shared version replaces it.
#[tokio::test]
async fn without_redis_a_change_holds_here_until_a_shared_one_replaces_it() {
    let mut server = RedisServer::start();
    server.stop();
    let config = replica_config(server.url(), false);
    let backend = std::sync::Arc::new(scripted());
    let a = spawn_replica(config.clone(), backend.clone()).await;
    assert_eq!(policies(&a).await["version"], 1);
    let r = put(&a, "[semantic]\nthreshold = 0.91\n").await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(
        (&j["version"], &j["shared"]),
        (&2.into(), &false.into()),
        "{j}"
    );
    assert!(runs(&a, 2, 0.91).await);

    server.restart();
    let b = spawn_replica(config, backend).await;
    let shared = eventually_async(Duration::from_secs(20), || async {
        let r = put(&b, "[semantic]\nthreshold = 0.93\n").await;
        r.json::<Value>().await.unwrap()["shared"] == true
    });
    assert!(shared.await, "B shares once Redis is back");
    let version = policies(&b).await["version"].as_u64().unwrap();
    let reached = eventually_async(Duration::from_secs(20), || runs(&a, version, 0.93));
    assert!(reached.await, "{}", policies(&a).await);
}

/// Tenants `name` with `policy` (TOML lines of `[tenants.policy]`) and `candidate` (of
/// `[tenants.candidate]`, none when empty), one document.
fn tenants_doc(tenants: &[(&str, &str, &str)]) -> String {
    let mut doc = String::new();
    for (name, policy, candidate) in tenants {
        doc.push_str(&format!(
            "[[tenants]]\nname = \"{name}\"\napi_keys = [\"sk-{name}\"]\n"
        ));
        if !policy.is_empty() {
            doc.push_str(&format!("[tenants.policy]\n{policy}\n"));
        }
        if !candidate.is_empty() {
            doc.push_str(&format!("[tenants.candidate]\n{candidate}\n"));
        }
    }
    doc
}

async fn ask_as(app: &TestApp, tenant: &str, text: &str) -> reqwest::Response {
    let auth = format!("Bearer sk-{tenant}");
    app.chat(&chat_body(text), &[("authorization", &auth)])
        .await
}

/// A canary whose candidate reads questions as standing alone, where the running policy does
/// not, stores nothing the running policy would not: after the candidate is removed, a
/// question asked alone is not served the answer written after another conversation.
#[tokio::test]
async fn a_candidates_standalone_answers_stay_in_their_conversation() {
    let candidate = "mode = \"canary\"\npercent = 100\nmin_requests = 100000\n\
                     max_latency_ratio = 1000\n\
                     [[tenants.candidate.semantic_rules]]\nstandalone = true";
    let mut config = tenants_config(&tenants_doc(&[("t", "", candidate)]), true);
    config.semantic.standalone = false;
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let auth = [("authorization", "Bearer sk-t")];
    let puppy = convo(&[
        ("user", "What is a good name for a golden retriever puppy?"),
        ("assistant", "Maple, Biscuit and Sunny are popular choices."),
        ("user", "How far away is the Moon from Earth?"),
    ]);
    let r = app.chat(&puppy, &auth).await;
    assert_eq!(cache_status(&r), "miss");
    let r = app.chat(&puppy, &auth).await;
    assert_eq!(cache_status(&r), "exact");
    // Asked alone (on the candidate's side still): the answer after the other conversation
    // was stored in that conversation, not alone.
    let alone = convo(&[("user", "How far is the Moon from the Earth?")]);
    let r = app.chat(&alone, &auth).await;
    assert_eq!(cache_status(&r), "miss", "nothing was stored alone");
    let calls = backend.calls();
    // The candidate removed: the running policy's side reads no answer it would not store.
    assert_eq!(
        put(&app, &tenants_doc(&[("t", "", "")])).await.status(),
        200
    );
    let other = convo(&[("user", "How far is the Moon from Earth?")]);
    let r = app.chat(&other, &auth).await;
    assert_eq!(cache_status(&r), "semantic", "the lone answer, asked alone");
    assert_eq!(
        content(r).await,
        "You asked: How far is the Moon from the Earth?"
    );
    assert_eq!(backend.calls(), calls);
}

/// A rollback judged on one candidate while an operator put another in its place removes
/// nothing: the operator's candidate stays.
#[tokio::test]
async fn a_rollback_removes_the_candidate_it_judged_not_its_replacement() {
    let canary = |percent: u32| {
        format!(
            "mode = \"canary\"\npercent = {percent}\nmin_requests = 1\nmax_latency_ratio = 1000\n\
             [[tenants.candidate.semantic_rules]]\nenabled = false"
        )
    };
    let config = tenants_config(&tenants_doc(&[("t", "", &canary(50))]), false);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let judged = app
        .state
        .policies
        .load()
        .tenants
        .named("t")
        .unwrap()
        .candidate()
        .unwrap()
        .clone();
    assert_eq!(
        put(&app, &tenants_doc(&[("t", "", &canary(10))]))
            .await
            .status(),
        200
    );
    use reprise::metrics::Outcome;
    // Every request of its side fails: worse beyond chance after a few.
    let reason = (0..100)
        .find_map(|_| {
            let control = judged.record(false, Outcome::Miss, 0.01);
            control.or(judged.record(true, Outcome::Error, 0.01))
        })
        .expect("worse than the control");
    reprise::policy::roll_back(
        app.state.clone(),
        "t".into(),
        judged.config().clone(),
        reason,
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let view = policies(&app).await;
    assert_eq!(candidate_view(&view, "t")["percent"], 10.0);
    // Nothing was rolled back, so nothing says so.
    assert_eq!(view["rollbacks"], serde_json::json!([]), "{view}");
}

/// A verdict on a response served beside a candidate that was replaced since counts against
/// neither: not against the candidate now tried.
#[tokio::test]
async fn a_verdict_counts_against_the_candidate_it_was_served_beside() {
    let canary = |min: u32| format!("mode = \"canary\"\npercent = 50\nmin_requests = {min}");
    let (app, _backend) = spawn_fake(
        tenants_config(&tenants_doc(&[("t", "", &canary(1000))]), false),
        ScriptConfig::default(),
    )
    .await;
    let ask = || async {
        let r = ask_as(&app, "t", ORIGINALS[1]).await;
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["id"].clone()
    };
    let wrong = |id: Value| {
        app.client
            .post(app.url("/v1/feedback"))
            .bearer_auth("sk-t")
            .json(&serde_json::json!({"id": id, "verdict": "wrong"}))
            .send()
    };
    // The 2nd and 4th requests are the first candidate's; then another takes its place.
    let mut old = Vec::new();
    for _ in 0..4 {
        old.push(ask().await);
    }
    let doc = tenants_doc(&[("t", "", &canary(999))]);
    assert_eq!(put(&app, &doc).await.status(), 200);
    let mut new = Vec::new();
    for _ in 0..4 {
        new.push(ask().await);
    }
    let sides = candidate_view(&policies(&app).await, "t").clone();
    assert_eq!(sides["candidate"]["requests"], 2, "{sides}");
    for id in [&old[1], &old[3]] {
        assert_eq!(wrong(id.clone()).await.unwrap().status(), 200);
    }
    let sides = candidate_view(&policies(&app).await, "t").clone();
    assert_eq!(sides["candidate"]["wrong_hit_rate"], 0.0, "{sides}");
    // One of its own: one of its two hits.
    assert_eq!(wrong(new[1].clone()).await.unwrap().status(), 200);
    let sides = candidate_view(&policies(&app).await, "t").clone();
    assert_eq!(sides["candidate"]["wrong_hit_rate"], 0.5, "{sides}");
}

/// A candidate's learned-threshold evidence lives as long as the candidate: once another
/// takes its place, the first's verdicts are dropped (with the next new scope) and a late
/// verdict on it learns nothing, so replaced candidates do not pile up in memory.
#[tokio::test]
async fn a_replaced_candidates_evidence_is_dropped() {
    let canary = |min: u32| format!("mode = \"canary\"\npercent = 50\nmin_requests = {min}");
    let (app, _backend) = spawn_fake(
        tenants_config(&tenants_doc(&[("t", "delta = 0.05", &canary(1000))]), false),
        ScriptConfig::default(),
    )
    .await;
    let fingerprint = || {
        let policies = app.state.policies.load();
        let t = policies.tenants.named("t").unwrap();
        t.candidate().unwrap().fingerprint()
    };
    use reprise::bounds::{scope, Source};
    use reprise::candidate::Arm;
    let scope_of = |f: u64| scope(None, Arm::Candidate, Some(f));
    let verdicts = |s: &str| app.state.bounds.threshold("t", s, 0.05, 0.86, 0.7).verdicts;
    let record = |s: &str| {
        let source = Source::Feedback;
        app.state
            .bounds
            .record(&app.state, "t", s, None, 0.9, false, source);
    };
    let first = scope_of(fingerprint());
    record(&first);
    record("*/*");
    assert_eq!(verdicts(&first), 1.0);
    let doc = tenants_doc(&[("t", "delta = 0.05", &canary(999))]);
    assert_eq!(put(&app, &doc).await.status(), 200);
    let second = scope_of(fingerprint());
    assert_ne!(first, second, "another candidate");
    record(&first);
    assert_eq!(
        verdicts(&first),
        1.0,
        "a late verdict on the first learns nothing"
    );
    record(&second);
    assert_eq!(verdicts(&second), 1.0);
    assert_eq!(
        verdicts(&first),
        0.0,
        "the first candidate's evidence is gone"
    );
    assert_eq!(verdicts("*/*"), 1.0, "the running policy's stays");
}

fn candidate_view<'a>(view: &'a Value, tenant: &str) -> &'a Value {
    let tenants = view["tenants"].as_array().unwrap();
    &tenants.iter().find(|t| t["name"] == tenant).unwrap()["candidate"]
}

const ORIGINALS: &[&str] = &[
    "How do I reset my password?",
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What time does the store open on Sunday?",
    "How do I cancel my subscription?",
];

const PROBES: &[&str] = &[
    "how do I reset my password",
    "I forgot my password, how can I change it?",
    "What's the capital city of France?",
    "How many legs do spiders have?",
    "When does the shop open on Sundays?",
    "How can I cancel my subscription?",
    "Can you help me reset my password please?",
    "Which city is the capital of France?",
    "What is the weather in Paris today?",
    "Tell me a joke about cats",
];

/// Shadow mode: what the candidate would have served is counted per request, and matches a
/// replay of the same traffic under the candidate; what is served does not change.
#[tokio::test]
async fn shadow_counts_match_a_replay_under_the_candidate() {
    let strict = "[[tenants.policy.semantic_rules]]\nthreshold = 0.97";
    let lax = "[[tenants.candidate.semantic_rules]]\nthreshold = 0.75";
    let shadow = format!("mode = \"shadow\"\n{lax}");
    let lax_policy = "[[tenants.policy.semantic_rules]]\nthreshold = 0.75";
    let writable = tenants_doc(&[
        ("shadowed", strict, &shadow),
        ("control", strict, ""),
        ("replay", lax_policy, ""),
    ]);
    let config = tenants_config(&writable, true);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    for q in ORIGINALS {
        for t in ["shadowed", "control", "replay"] {
            assert_eq!(cache_status(&ask_as(&app, t, q).await), "miss");
        }
    }
    // From now on nothing is stored, so each probe meets the same entries on every side.
    let read_only = |p: &str| format!("read_only = true\n{p}");
    let doc = tenants_doc(&[
        ("shadowed", &read_only(strict), &shadow),
        ("control", &read_only(strict), ""),
        ("replay", &read_only(lax_policy), ""),
    ]);
    assert_eq!(put(&app, &doc).await.status(), 200);
    let counts = |view: &Value| candidate_view(view, "shadowed")["shadow"].clone();
    let mut before = counts(&policies(&app).await);
    let mut would_hit = 0;
    for q in PROBES {
        let served = cache_status(&ask_as(&app, "shadowed", q).await);
        let control = cache_status(&ask_as(&app, "control", q).await);
        let replay = cache_status(&ask_as(&app, "replay", q).await);
        assert_eq!(served, control, "{q}: the shadow changes nothing served");
        let after = counts(&policies(&app).await);
        let moved: Vec<&str> = [
            "agree_hit",
            "agree_miss",
            "would_hit",
            "would_miss",
            "different",
        ]
        .into_iter()
        .filter(|k| after[k] != before[k])
        .collect();
        assert_eq!(moved.len(), 1, "{q}: one result per request: {after}");
        let candidate_hit = matches!(moved[0], "agree_hit" | "would_hit" | "different");
        let served_hit = matches!(moved[0], "agree_hit" | "would_miss" | "different");
        // Read-only, a miss is answered as `bypass`.
        let hit = |s: &str| matches!(s, "exact" | "semantic" | "prefetch");
        assert_eq!(
            candidate_hit,
            hit(&replay),
            "{q}: {} vs replay {replay}",
            moved[0]
        );
        assert_eq!(
            served_hit,
            hit(&served),
            "{q}: {} vs served {served}",
            moved[0]
        );
        would_hit += usize::from(moved[0] == "would_hit");
        before = after;
    }
    assert!(
        would_hit > 0,
        "the looser candidate gains hits on these probes"
    );
    let m = app.metrics_text().await;
    assert!(
        m.contains(r#"reprise_shadow_lookups_total{tenant="shadowed",result="would_hit"}"#),
        "{m}"
    );
}

/// A shadow candidate with the running rules agrees with what is served on a follow-up
/// question matched at its own (lower) threshold: the candidate is judged at the threshold
/// it would serve at, follow-up or learned, not at the plain one.
#[tokio::test]
async fn a_shadow_candidate_like_the_running_policy_agrees_on_follow_ups() {
    let rules = "threshold = 0.97\nfollowup_threshold = 0.5";
    let policy = format!("[[tenants.policy.semantic_rules]]\n{rules}");
    let shadow = format!("mode = \"shadow\"\n[[tenants.candidate.semantic_rules]]\n{rules}");
    let config = tenants_config(&tenants_doc(&[("alike", &policy, &shadow)]), true);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let auth = [("authorization", "Bearer sk-alike")];
    let turn = |question: &str| {
        convo(&[
            ("user", "How do I reset my password?"),
            ("assistant", "Open the settings and choose Reset password."),
            ("user", question),
        ])
    };
    let r = app
        .chat(&turn("How do I do that on my phone?"), &auth)
        .await;
    assert_eq!(cache_status(&r), "miss");
    content(r).await;
    let counts = |view: &Value| candidate_view(view, "alike")["shadow"].clone();
    let before = counts(&policies(&app).await);
    let r = app
        .chat(&turn("And how would I do that from my phone?"), &auth)
        .await;
    assert_eq!(cache_status(&r), "semantic", "matched as a follow-up");
    let sim = similarity(&r);
    assert!(sim < 0.97, "below the plain threshold: {sim}");
    let after = counts(&policies(&app).await);
    assert_eq!(
        after["agree_hit"].as_u64().unwrap(),
        before["agree_hit"].as_u64().unwrap() + 1,
        "{after}"
    );
    assert_eq!(after["would_miss"], before["would_miss"], "{after}");
}

/// Under an error bound (`delta`), a shadow candidate with the running rules is judged at
/// the threshold learned from the verdicts of the scope its rules match (a shadow serves
/// nothing, so no verdict is ever taken on its side): where wrong verdicts raised the
/// running threshold above a paraphrase, the candidate agrees that it is a miss.
#[tokio::test]
async fn a_shadow_candidate_under_a_bound_reads_the_evidence_of_its_scope() {
    let rules = "[[tenants.policy.semantic_rules]]\nthreshold = 0.8";
    let policy = format!("delta = 0.05\n{rules}");
    let shadow = "mode = \"shadow\"\n[[tenants.candidate.semantic_rules]]\nthreshold = 0.8";
    let config = tenants_config(&tenants_doc(&[("bounded", &policy, shadow)]), true);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let (original, paraphrase) = (ORIGINALS[0], PROBES[1]);
    let r = ask_as(&app, "bounded", original).await;
    assert_eq!(cache_status(&r), "miss");
    content(r).await;
    let embedder = app.state.embedder.clone().unwrap();
    let (a, b) = (
        embedder.embed(original).await.unwrap(),
        embedder.embed(paraphrase).await.unwrap(),
    );
    let sim = reprise_embedder::cosine(&a, &b);
    assert!(sim >= 0.8, "a paraphrase the rules match: {sim}");
    // Wrong verdicts at that similarity in the running scope (the rule's, "*/*").
    for _ in 0..6 {
        app.state.bounds.record(
            &app.state,
            "bounded",
            "*/*",
            None,
            sim,
            true,
            reprise::bounds::Source::Feedback,
        );
    }
    let counts = |view: &Value| candidate_view(view, "bounded")["shadow"].clone();
    let before = counts(&policies(&app).await);
    let r = ask_as(&app, "bounded", paraphrase).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "the learned threshold rose above {sim}"
    );
    let after = counts(&policies(&app).await);
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        n(&after, "agree_miss"),
        n(&before, "agree_miss") + 1,
        "{after}"
    );
    assert_eq!(n(&after, "would_hit"), n(&before, "would_hit"), "{after}");
}

/// A tenant given a token budget keeps its entries: a request without `max_tokens` is then
/// given the bound it is charged, which is the bound the backend applies anyway, and is
/// keyed as before; an explicit other bound is another answer.
#[tokio::test]
async fn a_token_budget_keeps_the_tenants_entries() {
    let config = tenants_config(&tenants_doc(&[("metered", "", "")]), false);
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let auth = [("authorization", "Bearer sk-metered")];
    let q = chat_body(ORIGINALS[0]);
    assert_eq!(cache_status(&app.chat(&q, &auth).await), "miss");
    expect_status(&app, &q, &auth, "exact").await;
    let budget = tenants_doc(&[("metered", "tokens_per_minute = 100000", "")]);
    assert_eq!(put(&app, &budget).await.status(), 200);
    assert_eq!(cache_status(&app.chat(&q, &auth).await), "exact");
    let mut shorter = q.clone();
    shorter["max_tokens"] = 9.into();
    assert_eq!(cache_status(&app.chat(&shorter, &auth).await), "miss");
    assert_eq!(backend.calls(), 2);
}

/// Canary mode: a share of requests is served under the candidate; a candidate worse than the
/// rest (here it turns the semantic tier off while the backend fails, so its side errs where
/// the other is answered from the cache) is rolled back by itself, for every replica; a good
/// one is promoted by one call.
#[tokio::test]
async fn a_canary_worse_than_the_rest_is_rolled_back_and_a_good_one_promoted() {
    let canary = "mode = \"canary\"\npercent = 50\nmin_requests = 5\nmax_latency_ratio = 1000\n\
                  [[tenants.candidate.semantic_rules]]\nenabled = false";
    let writable = tenants_doc(&[("tried", "", canary)]);
    let config = tenants_config(&writable, true);
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    // The answer is stored (this request may be on either side: both store on a miss).
    assert_eq!(
        cache_status(&ask_as(&app, "tried", ORIGINALS[0]).await),
        "miss"
    );
    let read_only = tenants_doc(&[("tried", "read_only = true", canary)]);
    assert_eq!(put(&app, &read_only).await.status(), 200);
    let version = policies(&app).await["version"].as_u64().unwrap();
    backend.set_failure(reprise_backend::fake::Failure::AtStart(
        reprise_backend::BackendError::Unavailable("injected".into()),
    ));
    let paraphrase = "I forgot my password, how can I change it?";
    let mut statuses = Vec::new();
    for _ in 0..40 {
        let r = ask_as(&app, "tried", paraphrase).await;
        statuses.push(r.status().as_u16());
    }
    // Both sides were served until the candidate was judged: hits on the control's, errors
    // on the candidate's.
    assert!(
        statuses.contains(&200) && statuses.iter().any(|s| *s >= 500),
        "{statuses:?}"
    );
    let app_state = app.state.clone();
    let removed = eventually(Duration::from_secs(10), || {
        app_state
            .policies
            .load()
            .tenants
            .named("tried")
            .unwrap()
            .candidate()
            .is_none()
    })
    .await;
    assert!(removed, "the candidate is removed by a policy change");
    let view = policies(&app).await;
    assert!(view["version"].as_u64().unwrap() > version);
    assert!(candidate_view(&view, "tried").is_null());
    let rollback = &view["rollbacks"][0];
    assert_eq!(rollback["tenant"], "tried");
    assert!(
        rollback["reason"].as_str().unwrap().contains("error rate"),
        "{rollback}"
    );
    // Every later request is on the running policy: answered from the cache.
    for _ in 0..6 {
        assert_eq!(
            cache_status(&ask_as(&app, "tried", paraphrase).await),
            "semantic"
        );
    }
    let m = app.metrics_text().await;
    assert!(
        m.contains(r#"reprise_canary_rollbacks_total{tenant="tried"} 1"#),
        "{m}"
    );

    // A candidate that is as good is promoted by one call: its rules become the tenant's.
    let good =
        "mode = \"canary\"\npercent = 10\n[[tenants.candidate.semantic_rules]]\nthreshold = 0.75";
    assert_eq!(
        put(&app, &tenants_doc(&[("tried", "", good)]))
            .await
            .status(),
        200
    );
    let promote = |tenant: &str| {
        app.client
            .post(app.url(&format!("/admin/policies/promote?tenant={tenant}")))
            .bearer_auth("p0licy")
            .send()
    };
    // Judged worse, its rollback under way: promoting it would race the rollback.
    let judged = app
        .state
        .policies
        .load()
        .tenants
        .named("tried")
        .unwrap()
        .candidate()
        .unwrap()
        .clone();
    let worse = (0..100).find_map(|_| {
        use reprise::metrics::Outcome;
        let control = judged.record(false, Outcome::Exact, 0.01);
        control.or(judged.record(true, Outcome::Error, 0.01))
    });
    assert!(worse.is_some());
    let r = promote("tried").await.unwrap();
    let j = assert_openai_error(r, 400, Some("tenant")).await;
    assert!(
        j["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rolled back"),
        "{j}"
    );
    let good = good.replace("percent = 10", "percent = 11");
    assert_eq!(
        put(&app, &tenants_doc(&[("tried", "", &good)]))
            .await
            .status(),
        200
    );
    let r = promote("tried").await.unwrap();
    assert_eq!(r.status(), 200);
    let view = policies(&app).await;
    assert!(candidate_view(&view, "tried").is_null());
    let tried = &view["tenants"][0]["policy"];
    assert_eq!(tried["semantic_rules"][0]["threshold"], 0.75, "{tried}");
    let r = promote("tried").await.unwrap();
    assert_openai_error(r, 400, Some("tenant")).await;
}

/// Under an error bound, a wording a hit by meaning linked to an entry (its alias) is
/// matched by meaning again on every repeat: once wrong verdicts raised the threshold past
/// its similarity it is a miss, not an exact hit on the linked answer; the entry's own
/// question is still answered.
#[tokio::test]
async fn under_a_bound_a_linked_wording_is_held_to_the_learned_threshold() {
    let policy = "delta = 0.05\n[[tenants.policy.semantic_rules]]\nthreshold = 0.8";
    let config = tenants_config(&tenants_doc(&[("bounded", policy, "")]), true);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let (original, paraphrase) = (ORIGINALS[0], PROBES[1]);
    let r = ask_as(&app, "bounded", original).await;
    assert_eq!(cache_status(&r), "miss");
    content(r).await;
    let r = ask_as(&app, "bounded", paraphrase).await;
    assert_eq!(cache_status(&r), "semantic");
    let sim = similarity(&r);
    content(r).await;
    // The repeat is matched by meaning again (the same entry), not by the alias.
    let r = ask_as(&app, "bounded", paraphrase).await;
    assert_eq!(cache_status(&r), "semantic");
    content(r).await;
    for _ in 0..6 {
        app.state.bounds.record(
            &app.state,
            "bounded",
            "*/*",
            None,
            sim,
            true,
            reprise::bounds::Source::Feedback,
        );
    }
    let r = ask_as(&app, "bounded", paraphrase).await;
    assert_eq!(cache_status(&r), "miss", "the threshold rose past {sim}");
    content(r).await;
    let r = ask_as(&app, "bounded", original).await;
    assert_eq!(cache_status(&r), "exact");
}

/// A client that leaves its streamed answer midway says nothing of the policy that answered
/// it: neither side of a canary counts it (its error would count against whichever side it
/// fell on); requests read to the end are counted.
#[tokio::test]
async fn a_canary_does_not_count_clients_that_left() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let canary = "mode = \"canary\"\npercent = 50\nmin_requests = 1000\nmax_latency_ratio = 1000";
    let mut config = tenants_config(&tenants_doc(&[("tried", "", canary)]), false);
    config.log.request_log = Some(path.clone());
    let script = ScriptConfig {
        token_delay: Duration::from_millis(30),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let auth = [("authorization", "Bearer sk-tried")];
    let ask = |i: usize| {
        let mut body = chat_body(&format!("question {i}: {}", "word ".repeat(40)));
        body["stream"] = true.into();
        body
    };
    let counted = |view: &Value| {
        let c = candidate_view(view, "tried");
        c["control"]["requests"].as_u64().unwrap() + c["candidate"]["requests"].as_u64().unwrap()
    };
    for i in 0..6 {
        let r = app.chat(&ask(i), &auth).await;
        let mut chunks = r.bytes_stream();
        futures::StreamExt::next(&mut chunks)
            .await
            .unwrap()
            .unwrap();
    }
    assert!(eventually(Duration::from_secs(20), || log_lines(&path).len() == 6).await);
    assert!(log_lines(&path)
        .iter()
        .all(|l| l["error"] == "client_closed"));
    assert_eq!(counted(&policies(&app).await), 0);
    for i in 6..12 {
        let r = app.chat(&ask(i), &auth).await;
        assert!(r.text().await.unwrap().ends_with("data: [DONE]\n\n"));
    }
    assert!(eventually(Duration::from_secs(20), || log_lines(&path).len() == 12).await);
    assert_eq!(counted(&policies(&app).await), 6);
}

/// Hits of the candidate's side reported wrong beyond the bound roll the canary back.
#[tokio::test]
async fn a_canary_whose_hits_are_reported_wrong_is_rolled_back() {
    // Latency is not what this test judges: a generous bound keeps noise out of it.
    let canary = "mode = \"canary\"\npercent = 50\nmin_requests = 3\nmax_latency_ratio = 1000";
    let doc = tenants_doc(&[("judged", "", canary)]);
    let config = tenants_config(&doc, false);
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    // Every second request is the candidate's (the 2nd, the 4th, ...): twelve each, every
    // one a hit but the first.
    let mut ids = Vec::new();
    for _ in 0..24 {
        let r = ask_as(&app, "judged", ORIGINALS[1]).await;
        assert_eq!(r.status(), 200);
        ids.push(r.json::<Value>().await.unwrap()["id"].clone());
    }
    let view = policies(&app).await;
    let sides = candidate_view(&view, "judged");
    assert_eq!(sides["candidate"]["requests"], 12, "{sides}");
    assert!(sides["rolled_back"] == false);
    let wrong = |id: &Value| {
        app.client
            .post(app.url("/v1/feedback"))
            .bearer_auth("sk-judged")
            .json(&serde_json::json!({"id": id, "verdict": "wrong"}))
            .send()
    };
    // A wrong verdict on a control response is no reason; nor are two on the candidate's
    // (2 of 12 against 1 of 11 is chance).
    for i in [2, 1, 3] {
        assert_eq!(wrong(&ids[i]).await.unwrap().status(), 200);
    }
    let sides = candidate_view(&policies(&app).await, "judged").clone();
    assert_eq!(sides["candidate"]["wrong_hit_rate"], 2.0 / 12.0, "{sides}");
    assert!(sides["rolled_back"] == false, "{sides}");
    // Eight of twelve is not.
    for i in [5, 7, 9, 11, 13, 15] {
        assert_eq!(wrong(&ids[i]).await.unwrap().status(), 200);
    }
    let state = app.state.clone();
    let removed = eventually(Duration::from_secs(10), || {
        state
            .policies
            .load()
            .tenants
            .named("judged")
            .unwrap()
            .candidate()
            .is_none()
    })
    .await;
    assert!(removed);
    let view = policies(&app).await;
    let reason = view["rollbacks"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("wrong hits"), "{reason}");
}

/// A canary's candidate, served, keeps the raise an entry's own wrong verdict gave it, but
/// not the band its own right verdicts opened: both were taken under the running policy,
/// and only an answer found wrong is wrong under any policy.
#[tokio::test]
async fn a_canary_keeps_entries_raises_but_not_their_bands() {
    let candidate = "mode = \"canary\"\npercent = 100\nmin_requests = 100000\n\
                     max_latency_ratio = 1000\n\
                     [[tenants.candidate.semantic_rules]]\nthreshold = 0.86";
    let doc = tenants_doc(&[("t", "delta = 0.3", candidate)]);
    let mut config = tenants_config(&doc, true);
    config.semantic.threshold = 0.97;
    config.semantic.min_threshold = 0.5;
    config.semantic.verify_near_misses = 0.0;
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    // Generated and stored, never matched.
    let stored = |text: &'static str| {
        let app = &app;
        async move {
            let headers = [
                ("authorization", "Bearer sk-t"),
                ("cache-control", "no-cache"),
            ];
            let r = app.chat(&chat_body(text), &headers).await;
            assert_eq!(cache_status(&r), "miss");
            let id: reprise_cache::EntryId =
                header(&r, "x-reprise-entry").unwrap().parse().unwrap();
            id
        }
    };
    let password = stored("How do I reset my password?").await;
    let forgot = stored("I forgot my password, how can I change it?").await;
    // Under the running policy: the first entry served wrongly at 0.946, the second's near
    // misses at 0.80 right forty times.
    let record = |id, similarity, wrong| {
        let source = reprise::bounds::Source::Feedback;
        app.state
            .bounds
            .record(&app.state, "t", "*/*", Some(id), similarity, wrong, source);
    };
    record(password, 0.946, true);
    for _ in 0..40 {
        record(forgot, 0.80, false);
    }
    let own = |id| {
        app.state
            .bounds
            .entry_threshold(id, 0.3, 0.86, 0.5)
            .unwrap()
    };
    assert!(own(password).threshold > 0.946, "{:?}", own(password));
    assert!(own(forgot).threshold <= 0.80, "{:?}", own(forgot));
    // 0.946 from the first (raised past it), 0.836 from the second (under the candidate's
    // 0.86; only its own band would admit it).
    let r = ask_as(&app, "t", "What are the steps to reset my password?").await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "{:?}",
        header(&r, "x-reprise-similarity")
    );
}
