//! `GET /admin/stats` over real TCP: the rollups of the requests a server answered (counts,
//! tiers, tenants, latency, savings from the answers' usage), the admin tokens that reach
//! them, and two replicas merging their rollups through a real redis-server.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise::config::{Config, TenantConfig};
use reprise_backend::fake::ScriptConfig;
use reprise_cache::testing::RedisServer;
use serde_json::Value;

fn tenant(name: &str, key: &str, admin_token_env: Option<&str>) -> TenantConfig {
    TenantConfig {
        admin_token_env: admin_token_env.map(str::to_string),
        ..TenantConfig::with_key(name, key)
    }
}

/// `GET path` with a bearer token (none: no header).
async fn get(app: &TestApp, path: &str, token: Option<&str>) -> reqwest::Response {
    let mut req = app.client.get(app.url(path));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.expect("request sent")
}

/// The stats view, 200 expected.
async fn stats(app: &TestApp, query: &str, token: &str) -> Value {
    let r = get(app, &format!("/admin/stats{query}"), Some(token)).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// The stats view once `done` holds for it, or the last one after `timeout`.
async fn stats_when(
    app: &TestApp,
    query: &str,
    token: &str,
    timeout: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = stats(app, query, token).await;
        if done(&v) || tokio::time::Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn n(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{pointer} in {v}"))
}

#[tokio::test]
async fn stats_add_up_what_was_served_and_tenants_see_their_own() {
    // The variable names are unique to this test, so no other test reads or writes them.
    std::env::set_var("REPRISE_TEST_STATS_ADMIN_TOKEN", "stats-admin");
    std::env::set_var("REPRISE_TEST_STATS_ACME_TOKEN", "stats-acme");
    let mut config = test_config();
    config.server.admin_token_env = Some("REPRISE_TEST_STATS_ADMIN_TOKEN".into());
    config.tenants = vec![
        tenant("acme", "sk-acme", Some("REPRISE_TEST_STATS_ACME_TOKEN")),
        tenant("beta", "sk-beta", None),
    ];
    config.metrics.currency = Some("USD".into());
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    let acme = "Bearer sk-acme".to_string();
    let acme = [("authorization", acme.as_str())];

    // Misses: three for acme, one anonymous; each answer's usage is what a hit on it saves.
    let mut usage = std::collections::HashMap::new();
    for (text, headers) in [
        ("What is the capital of France?", &acme[..]),
        ("How do I reset my password?", &acme[..]),
        ("Which plan includes SSO?", &acme[..]),
        ("Where is my invoice?", &[][..]),
    ] {
        let r = app.chat(&chat_body(text), headers).await;
        assert_eq!(cache_status(&r), "miss");
        let body: Value = r.json().await.unwrap();
        usage.insert(
            text,
            (
                n(&body, "/usage/prompt_tokens"),
                n(&body, "/usage/completion_tokens"),
            ),
        );
    }
    // Exact hits: twice, once, and the anonymous one once.
    let hits = [
        ("What is the capital of France?", &acme[..]),
        ("What is the capital of France?", &acme[..]),
        ("How do I reset my password?", &acme[..]),
        ("Where is my invoice?", &[][..]),
    ];
    for (text, headers) in hits {
        let r = app.chat(&chat_body(text), headers).await;
        assert_eq!(cache_status(&r), "exact");
        let _ = r.bytes().await;
    }
    assert_eq!(backend.calls(), 4);
    let (saved_prompt, saved_completion) = hits.iter().fold((0, 0), |(p, c), (text, _)| {
        (p + usage[text].0, c + usage[text].1)
    });
    assert!(saved_prompt > 0 && saved_completion > 0);

    // Requests are counted when their responses end: wait for the last one.
    let view = stats_when(
        &app,
        "?minutes=5",
        "stats-admin",
        Duration::from_secs(10),
        |v| n(v, "/totals/requests") == 8,
    )
    .await;
    assert_eq!(n(&view, "/totals/requests"), 8, "{view}");
    let t = &view["totals"];
    assert_eq!(n(t, "/by_outcome/miss"), 4);
    assert_eq!(n(t, "/by_outcome/exact"), 4);
    assert_eq!(n(t, "/by_tier/memory"), 4);
    assert_eq!(n(t, "/by_tenant/acme/requests"), 6);
    assert_eq!(n(t, "/by_tenant/acme/hits"), 3);
    assert_eq!(n(t, "/by_tenant/anonymous/requests"), 2);
    assert_eq!(n(t, "/latency/hit/count"), 4);
    assert_eq!(n(t, "/latency/miss/count"), 4);
    assert!(t["latency"]["hit"]["p95"].as_f64().unwrap() > 0.0);
    assert_eq!(n(t, "/saved/prompt_tokens"), saved_prompt);
    assert_eq!(n(t, "/saved/completion_tokens"), saved_completion);
    assert_eq!(view["replicas"], 1);
    assert_eq!(view["tenant"], Value::Null);
    assert_eq!(view["currency"], "USD");
    assert_eq!(view["interval_secs"], 60);
    assert_eq!(view["slo"]["total_secs"], 3.0);
    // The one-minute intervals covering the last five minutes (six, unless now is an
    // interval's first millisecond), oldest first, the empty ones as zeros; they add up.
    let series = view["series"].as_array().unwrap();
    let whole = n(&view, "/now_ms").is_multiple_of(60_000);
    assert_eq!(series.len(), if whole { 5 } else { 6 });
    let starts: Vec<u64> = series.iter().map(|s| n(s, "/start_ms")).collect();
    assert!(
        starts.windows(2).all(|w| w[1] == w[0] + 60_000),
        "{starts:?}"
    );
    assert_eq!(series.iter().map(|s| n(s, "/requests")).sum::<u64>(), 8);
    assert!(series[0]["latency"]["hit"]["p50"].is_null() || n(&series[0], "/requests") > 0);
    // Every miss is among the most missed questions, once.
    let missed = view["top_missed"].as_array().unwrap();
    assert_eq!(missed.len(), 4);
    assert!(missed.iter().all(|m| m["count"] == 1), "{missed:?}");
    assert!(missed
        .iter()
        .any(|m| m["question"] == "Where is my invoice?"));

    // Without a token, or with a wrong one: 401.
    assert_eq!(get(&app, "/admin/stats", None).await.status(), 401);
    assert_eq!(get(&app, "/admin/stats", Some("nope")).await.status(), 401);
    // A tenant's admin sees its own tenant only, and no other.
    let mine = stats(&app, "", "stats-acme").await;
    assert_eq!(mine["tenant"], "acme");
    assert_eq!(n(&mine, "/totals/requests"), 6);
    assert_eq!(n(&mine, "/totals/by_outcome/exact"), 3);
    assert_eq!(
        mine["totals"]["by_tenant"].as_object().unwrap().len(),
        1,
        "{mine}"
    );
    assert_eq!(mine["top_missed"].as_array().unwrap().len(), 3);
    let r = get(&app, "/admin/stats?tenant=beta", Some("stats-acme")).await;
    assert_eq!(r.status(), 403);
    // The global admin picks any tenant.
    let anon = stats(&app, "?tenant=anonymous", "stats-admin").await;
    assert_eq!(n(&anon, "/totals/requests"), 2);
    // A window beyond the ring's span is the whole span, and says so.
    let whole = stats(&app, "?minutes=100000", "stats-admin").await;
    assert_eq!(
        (whole["minutes"].as_u64(), whole["span_minutes"].as_u64()),
        (Some(1440), Some(1440))
    );
    // Not a number of minutes: 400 in the OpenAI shape.
    for bad in ["0", "-5", "ten"] {
        let r = get(
            &app,
            &format!("/admin/stats?minutes={bad}"),
            Some("stats-admin"),
        )
        .await;
        let e = assert_openai_error(r, 400, None).await;
        assert_eq!(e["error"]["param"], "minutes", "{e}");
    }
}

fn replica_config(url: String) -> Config {
    let mut c = test_config();
    c.redis.url = Some(url);
    c.server.admin_token_env = Some("REPRISE_TEST_STATS_REPLICAS_TOKEN".into());
    // One-second intervals: each replica publishes what it served a second later.
    c.stats.interval_secs = 1;
    c.stats.intervals = 600;
    c
}

#[tokio::test]
async fn replicas_sharing_redis_serve_the_sum_of_their_stats() {
    std::env::set_var("REPRISE_TEST_STATS_REPLICAS_TOKEN", "replicas-admin");
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(replica_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(replica_config(redis.url()), Arc::new(backend.clone())).await;

    // A: two misses and an exact hit.
    for (text, want) in [("alpha", "miss"), ("beta", "miss"), ("alpha", "exact")] {
        let r = a.chat(&chat_body(text), &[]).await;
        assert_eq!(cache_status(&r), want);
    }
    a.state.store.redis().unwrap().flush().await.unwrap();
    // B: a miss, and A's answer read from Redis, then from its memory.
    for (text, want) in [("gamma", "miss"), ("beta", "exact"), ("beta", "exact")] {
        let r = b.chat(&chat_body(text), &[]).await;
        assert_eq!(cache_status(&r), want);
    }

    for (name, app) in [("a", &a), ("b", &b)] {
        let view = stats_when(
            app,
            "?minutes=2",
            "replicas-admin",
            Duration::from_secs(15),
            |v| n(v, "/totals/requests") == 6 && v["replicas"] == 2,
        )
        .await;
        assert_eq!(n(&view, "/totals/requests"), 6, "{name}: {view}");
        assert_eq!(view["replicas"], 2, "{name}: {view}");
        let t = &view["totals"];
        assert_eq!(n(t, "/by_outcome/miss"), 3, "{name}");
        assert_eq!(n(t, "/by_outcome/exact"), 3, "{name}");
        assert_eq!(n(t, "/by_tier/redis"), 1, "{name}");
        assert_eq!(n(t, "/by_tier/memory"), 2, "{name}");
        assert_eq!(n(t, "/latency/miss/count"), 3, "{name}");
        // One-second intervals covering the last two minutes.
        let whole = n(&view, "/now_ms").is_multiple_of(1_000);
        let len = view["series"].as_array().unwrap().len();
        assert_eq!(len, if whole { 120 } else { 121 }, "{name}");
        assert_eq!(view["top_missed"].as_array().unwrap().len(), 3, "{name}");
    }
}
