//! The shared Redis tier through the server: replicas share hits, restarts keep them, outages
//! fail no request, invalidation reaches every replica. Real redis-server processes on free
//! loopback ports; the real embedder for semantic hits.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise::Config;
use reprise_cache::testing::{RedisCluster, RedisServer};
use serde_json::{json, Value};

fn redis_config(url: String) -> Config {
    let mut c = test_config();
    c.semantic.enabled = true;
    c.redis.url = Some(url);
    c.redis.breaker_cooldown_ms = 300;
    c
}

#[tokio::test]
async fn two_replicas_share_exact_and_semantic_hits_both_ways() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;

    assert_eq!(
        cache_status(&a.chat(&chat_body("How do I reset my password?"), &[]).await),
        "miss"
    );
    // B: exact (from Redis) and semantic (replicated into B's index).
    expect_status(&b, &chat_body("How do I reset my password?"), &[], "exact").await;
    expect_status(
        &b,
        &chat_body("I forgot my password, how can I change it?"),
        &[],
        "semantic",
    )
    .await;
    // The other way round.
    assert_eq!(
        cache_status(
            &b.chat(&chat_body("What is the capital of France?"), &[])
                .await
        ),
        "miss"
    );
    expect_status(
        &a,
        &chat_body("Which city is the capital of France?"),
        &[],
        "semantic",
    )
    .await;
    expect_status(
        &a,
        &chat_body("What is the capital of France?"),
        &[],
        "exact",
    )
    .await;
    assert_eq!(backend.calls(), 2);
}

#[tokio::test]
async fn restarted_replica_gets_its_hits_back_from_redis() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    a.chat(&chat_body("How do I export a PNG?"), &[]).await;
    a.state.store.redis().unwrap().flush().await.unwrap();
    drop(a);
    let a2 = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    expect_status(&a2, &chat_body("How do I export a PNG?"), &[], "exact").await;
    // The index is rebuilt from Redis: a paraphrase hits.
    expect_status(
        &a2,
        &chat_body("How can I export a PNG file?"),
        &[],
        "semantic",
    )
    .await;
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn redis_outage_fails_no_request_and_recovers_by_itself() {
    let mut redis = RedisServer::start();
    let backend = scripted();
    let app = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    app.chat(&chat_body("before the outage"), &[]).await;
    redis.stop();
    for i in 0..20 {
        let r = app
            .chat(&chat_body(&format!("during the outage {i}")), &[])
            .await;
        assert_eq!(r.status(), 200, "a Redis outage must not fail requests");
    }
    // Memory still serves what it has.
    assert_eq!(
        cache_status(&app.chat(&chat_body("before the outage"), &[]).await),
        "exact"
    );
    let ready = app.readiness().await;
    assert_eq!(ready["redis"]["up"], false, "{ready}");
    redis.restart();
    // Writes resume without restarting reprise: a fresh replica sees a new answer.
    let mut resumed = false;
    for i in 0..50 {
        let q = format!("after the outage {i}");
        app.chat(&chat_body(&q), &[]).await;
        let _ = app.state.store.redis().unwrap().flush().await;
        let other = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
        let r = other
            .chat(&chat_body(&q), &[("cache-control", "only-if-cached")])
            .await;
        if cache_status(&r) == "exact" {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(resumed, "writes to Redis resumed after it came back");
}

#[tokio::test]
async fn foreign_values_under_the_prefix_are_skipped() {
    let redis = RedisServer::start();
    let backend = scripted();
    let app = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    app.chat(&chat_body("a real entry"), &[]).await;
    app.state.store.redis().unwrap().flush().await.unwrap();
    // Overwrite every stored value with garbage.
    let out = std::process::Command::new("redis-cli")
        .args([
            "-p",
            &redis.port().to_string(),
            "--scan",
            "--pattern",
            "reprise:*",
        ])
        .output()
        .unwrap();
    for key in String::from_utf8_lossy(&out.stdout).lines() {
        let t = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port().to_string(), "type", key])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&t.stdout).trim() == "string" {
            std::process::Command::new("redis-cli")
                .args(["-p", &redis.port().to_string(), "set", key, "\u{1}garbage{"])
                .output()
                .unwrap();
        }
    }
    // A new replica finds only garbage: misses, no crash, requests answered.
    let other = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let r = other.chat(&chat_body("a real entry"), &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
}

#[tokio::test]
async fn invalidation_reaches_every_replica_and_needs_the_token() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_ADMIN_TOKEN", "s3cret");
    let redis = RedisServer::start();
    let backend = scripted();
    let mut cfg = redis_config(redis.url());
    cfg.server.admin_token_env = Some("REPRISE_TEST_ADMIN_TOKEN".into());
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let ns = [("x-reprise-namespace", "tenant-x")];
    a.chat(&chat_body("first question"), &ns).await;
    a.chat(
        &chat_body("second question"),
        &[
            ("x-reprise-namespace", "tenant-x"),
            ("x-reprise-tags", "docs-v1"),
        ],
    )
    .await;
    expect_status(&b, &chat_body("first question"), &ns, "exact").await;
    expect_status(&b, &chat_body("second question"), &ns, "exact").await;

    let r = a
        .client
        .delete(a.url("/admin/tags/docs-v1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = a
        .client
        .delete(a.url("/admin/tags/docs-v1"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = a
        .client
        .delete(a.url("/admin/tags/docs-v1"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        poll_status(&b, &chat_body("second question"), &ns, "error").await,
        "error",
        "tag gone on B"
    );
    assert_eq!(
        poll_status(&a, &chat_body("second question"), &ns, "error").await,
        "error",
        "tag gone on A"
    );
    assert_eq!(
        poll_status(&b, &chat_body("first question"), &ns, "exact").await,
        "exact",
        "untagged kept"
    );

    let r = b
        .client
        .delete(b.url("/admin/namespaces/tenant-x"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert!(j["deleted"].as_u64().unwrap() >= 1, "{j}");
    assert_eq!(
        poll_status(&a, &chat_body("first question"), &ns, "error").await,
        "error",
        "namespace gone on A"
    );
    assert_eq!(
        poll_status(&b, &chat_body("first question"), &ns, "error").await,
        "error",
        "namespace gone on B"
    );

    // One entry by id.
    let r = a.chat(&chat_body("third question"), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let id = a
        .state
        .store
        .entries()
        .into_iter()
        .find(|e| e.prompt == "third question")
        .unwrap()
        .id;
    expect_status(&b, &chat_body("third question"), &[], "exact").await;
    let r = a
        .client
        .delete(a.url(&format!("/admin/entries/{id}")))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    expect_status(&b, &chat_body("third question"), &[], "error").await;
}

/// A tag delete reaches the answers another replica holds with the tag that Redis never got
/// (its puts dropped: a full write queue, an open breaker), which the delete could not find
/// in Redis: that replica drops them on the delete's event.
#[tokio::test]
async fn a_tag_delete_reaches_answers_redis_never_held() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_TAG_SWEEP_TOKEN", "t4gs");
    let redis = RedisServer::start();
    let backend = scripted();
    let mut cfg = redis_config(redis.url());
    cfg.server.admin_token_env = Some("REPRISE_TEST_TAG_SWEEP_TOKEN".into());
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let mut dropping = cfg.clone();
    // Every write of this replica is dropped (no write fits the queue).
    dropping.redis.write_queue_bytes = 1;
    let b = spawn_replica(dropping, Arc::new(backend.clone())).await;
    let q = chat_body("a tagged question");
    let r = b.chat(&q, &[("x-reprise-tags", "docs-v2")]).await;
    assert_eq!(cache_status(&r), "miss");
    expect_status(&b, &q, &[], "exact").await;
    assert_eq!(
        poll_status(&a, &q, &[], "error").await,
        "error",
        "not in Redis"
    );
    let r = a
        .client
        .delete(a.url("/admin/tags/docs-v2"))
        .bearer_auth("t4gs")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    expect_status(&b, &q, &[], "error").await;
}

/// A filtered delete (`DELETE /admin/entries`) sent to one replica reaches answers another
/// replica holds that Redis never had; what it does not select stays.
#[tokio::test]
async fn a_filtered_delete_reaches_answers_redis_never_held() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_FILTER_SWEEP_TOKEN", "f1lt");
    let redis = RedisServer::start();
    let backend = scripted();
    let mut cfg = redis_config(redis.url());
    cfg.server.admin_token_env = Some("REPRISE_TEST_FILTER_SWEEP_TOKEN".into());
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let mut dropping = cfg.clone();
    // Every write of this replica is dropped (no write fits the queue).
    dropping.redis.write_queue_bytes = 1;
    let b = spawn_replica(dropping, Arc::new(backend.clone())).await;
    let old = chat_body("an old question");
    assert_eq!(cache_status(&b.chat(&old, &[]).await), "miss");
    expect_status(&b, &old, &[], "exact").await;
    // Three seconds apart, so the delete tells them apart on a slow machine too.
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let new = chat_body("a new question");
    assert_eq!(cache_status(&b.chat(&new, &[]).await), "miss");
    expect_status(&b, &new, &[], "exact").await;
    let r = a
        .client
        .delete(a.url("/admin/entries?older_than_secs=3"))
        .bearer_auth("f1lt")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    expect_status(&b, &old, &[], "error").await;
    expect_status(&b, &new, &[], "exact").await;
}

/// A tenant admin's tag delete, sent to one replica, wins on every replica over the
/// tenant's answers with the tag still on their way there (the other replicas fence the tag
/// within the tenant on the delete's event); another tenant's answers with the tag stay.
#[tokio::test]
async fn a_tenants_tag_delete_reaches_answers_on_their_way_on_other_replicas() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_REPLICA_TAG_TOKEN", "acme-tags");
    let redis = RedisServer::start();
    let backend =
        reprise_backend::fake::ScriptedBackend::new(reprise_backend::fake::ScriptConfig {
            first_token_delay: Duration::from_millis(800),
            ..Default::default()
        });
    let mut cfg = redis_config(redis.url());
    cfg.semantic.enabled = false;
    cfg.auth.required = true;
    let doc = "[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme\"]\n\
               admin_token_env = \"REPRISE_TEST_REPLICA_TAG_TOKEN\"\n\
               [[tenants]]\nname = \"beta\"\napi_keys = [\"sk-beta\"]\n";
    cfg.tenants = reprise::policy::PolicyDocument::from_toml(doc)
        .unwrap()
        .tenants
        .unwrap();
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(cfg, Arc::new(backend.clone())).await;
    let q = chat_body("What does the plan cost?");
    let ask = |key: &'static str, cache: Option<&'static str>| {
        let (b, q) = (&b, &q);
        async move {
            let auth = format!("Bearer {key}");
            let mut h = vec![
                ("authorization", auth.as_str()),
                ("x-reprise-tags", "pricing"),
            ];
            if let Some(c) = cache {
                h.push(("cache-control", c));
            }
            cache_status(&b.chat(q, &h).await)
        }
    };
    let delete = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.client
            .delete(a.url("/admin/tags/pricing"))
            .bearer_auth("acme-tags")
            .send()
            .await
            .unwrap()
            .status()
    };
    let (acme, beta, deleted) = tokio::join!(ask("sk-acme", None), ask("sk-beta", None), delete);
    assert_eq!((acme.as_str(), beta.as_str()), ("miss", "miss"));
    assert_eq!(deleted, 200);
    assert_eq!(ask("sk-acme", Some("only-if-cached")).await, "error");
    assert_eq!(ask("sk-beta", Some("only-if-cached")).await, "exact");
}

/// A filtered delete sent to one replica wins on every replica over the answers it selects
/// still on their way there (the others fence it on the delete's event); answers it does not
/// select are stored.
#[tokio::test]
async fn a_filtered_delete_reaches_answers_on_their_way_on_other_replicas() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_REPLICA_FILTER_TOKEN", "f3nce");
    let redis = RedisServer::start();
    let backend =
        reprise_backend::fake::ScriptedBackend::new(reprise_backend::fake::ScriptConfig {
            first_token_delay: Duration::from_millis(800),
            ..Default::default()
        });
    let mut cfg = redis_config(redis.url());
    cfg.semantic.enabled = false;
    cfg.server.admin_token_env = Some("REPRISE_TEST_REPLICA_FILTER_TOKEN".into());
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(cfg, Arc::new(backend.clone())).await;
    let ask = |namespace: &'static str, cache: Option<&'static str>| {
        let b = &b;
        async move {
            let mut h = vec![("x-reprise-namespace", namespace)];
            if let Some(c) = cache {
                h.push(("cache-control", c));
            }
            let q = chat_body("What does the plan cost?");
            cache_status(&b.chat(&q, &h).await)
        }
    };
    let delete = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        a.client
            .delete(a.url("/admin/entries?model=fake"))
            .bearer_auth("f3nce")
            .send()
            .await
            .unwrap()
            .status()
    };
    let (first, deleted) = tokio::join!(ask("one", None), delete);
    assert_eq!(first, "miss");
    assert_eq!(deleted, 200);
    assert_eq!(ask("one", Some("only-if-cached")).await, "error");
    // Asked after the delete: stored.
    assert_eq!(ask("two", None).await, "miss");
    let q = chat_body("What does the plan cost?");
    expect_status(&b, &q, &[("x-reprise-namespace", "two")], "exact").await;
    // Still not stored, here nor in Redis for a replica that starts now.
    assert_eq!(ask("one", Some("only-if-cached")).await, "error");
    expect_status(&a, &q, &[("x-reprise-namespace", "one")], "error").await;
}

/// A tenant's admin cannot delete by id an entry Redis holds but no replica can read (over
/// `max_value_bytes`, undecodable): whose it is cannot be told, so it is not the tenant's.
#[tokio::test]
async fn a_tenants_admin_cannot_delete_an_entry_nobody_can_read() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_UNREADABLE_TOKEN", "acme-unread");
    let redis = RedisServer::start();
    let mut cfg = redis_config(redis.url());
    cfg.semantic.enabled = false;
    cfg.auth.required = true;
    let doc = "[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme\"]\n\
               admin_token_env = \"REPRISE_TEST_UNREADABLE_TOKEN\"\n";
    cfg.tenants = reprise::policy::PolicyDocument::from_toml(doc)
        .unwrap()
        .tenants
        .unwrap();
    let a = spawn_replica(cfg, Arc::new(scripted())).await;
    let id = reprise_cache::EntryId::random();
    let key = format!("reprise:e:{{{id}}}");
    let mut c = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg("x".repeat(9 << 20))
        .query_async(&mut c)
        .await
        .unwrap();
    let r = a
        .client
        .delete(a.url(&format!("/admin/entries/{id}")))
        .bearer_auth("acme-unread")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["deleted"], 0);
    let there: u64 = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(there, 1, "left alone");
}

#[tokio::test]
async fn ttl_is_respected_in_both_tiers() {
    let redis = RedisServer::start();
    let backend = scripted();
    let mut cfg = redis_config(redis.url());
    cfg.cache.ttl_secs = 1;
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    a.chat(&chat_body("short lived"), &[]).await;
    a.state.store.redis().unwrap().flush().await.unwrap();
    let b = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    expect_status(&b, &chat_body("short lived"), &[], "exact").await;
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let r = a
        .chat(
            &chat_body("short lived"),
            &[("cache-control", "only-if-cached")],
        )
        .await;
    assert_eq!(r.status(), 504, "expired in memory");
    let c = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let r = c
        .chat(
            &chat_body("short lived"),
            &[("cache-control", "only-if-cached")],
        )
        .await;
    assert_eq!(r.status(), 504, "expired in Redis");
}

#[tokio::test]
async fn cluster_mode_round_trip() {
    let cluster = RedisCluster::start(3);
    let backend = scripted();
    let mut cfg = test_config();
    cfg.semantic.enabled = true;
    cfg.redis.cluster_urls = cluster.urls();
    let a = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(cfg.clone(), Arc::new(backend.clone())).await;
    for q in [
        "cluster one",
        "cluster two",
        "cluster three",
        "How do I reset my password?",
    ] {
        assert_eq!(cache_status(&a.chat(&chat_body(q), &[]).await), "miss");
    }
    for q in ["cluster one", "cluster two", "cluster three"] {
        assert_eq!(
            poll_status(&b, &chat_body(q), &[], "exact").await,
            "exact",
            "{q}"
        );
    }
    expect_status(
        &b,
        &chat_body("How can I reset my password?"),
        &[],
        "semantic",
    )
    .await;
    let r = b.chat(&json!({"model": "fake", "messages": [{"role": "user", "content": "cluster one"}], "stream": true}), &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(backend.calls(), 4);
}

#[tokio::test]
async fn conversation_context_is_shared_across_replicas() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let q1 = "How do I reset my password?";
    let r = a
        .chat(
            &json!({"model": "fake", "messages": [{"role": "user", "content": q1}]}),
            &[],
        )
        .await;
    let a1 = r.json::<Value>().await.unwrap()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let turn2 = |q: &str| {
        json!({"model": "fake", "messages": [
            {"role": "user", "content": q1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": q},
        ]})
    };
    let r = a
        .chat(&turn2("What if I no longer have access to my email?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    // On B, a paraphrase of turn 2 in the same conversation is a semantic hit: B resolves the
    // conversation's context through the link A wrote to Redis.
    expect_status(
        &b,
        &turn2("What if I can no longer access my email?"),
        &[],
        "semantic",
    )
    .await;
    assert_eq!(backend.calls(), 2);
}

/// A verdict can be given on any replica (the response is remembered in Redis), and the
/// refusal it makes travels with the entry to every replica, and survives a restart.
#[tokio::test]
async fn a_refusal_reaches_every_replica() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let original = chat_body("How do I reset my password?");
    assert_eq!(cache_status(&a.chat(&original, &[]).await), "miss");
    let asked = chat_body("I forgot my password, how can I change it?");
    expect_status(&b, &asked, &[], "semantic").await;
    // Served by B (whose exact key for it now leads to the entry), reported to A.
    let r = b.chat(&asked, &[]).await;
    let id = r.json::<serde_json::Value>().await.unwrap()["id"].clone();
    let said = |app: &TestApp| {
        app.client
            .post(app.url("/v1/feedback"))
            .json(&serde_json::json!({"id": id, "verdict": "wrong"}))
            .send()
    };
    let r = eventually_ok(|| said(&a)).await;
    assert_eq!(r["refused"], true, "{r}");
    // A replica started after the verdict (its memory rebuilt from Redis) honours it too.
    a.state.store.redis().unwrap().flush().await.unwrap();
    let c = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    // No replica serves it to that question any more; each still serves its own.
    for app in [&a, &b, &c] {
        let app_ref = app;
        let refused = eventually_async(Duration::from_secs(10), || async {
            let r = app_ref.chat(&asked, &[]).await;
            cache_status(&r) != "semantic" && cache_status(&r) != "exact"
                || content(r).await != "You asked: How do I reset my password?"
        })
        .await;
        assert!(refused, "{}", app.url(""));
        expect_status(app, &original, &[], "exact").await;
    }
}

/// Verdicts on one response sent at once, to the replica that served it and to another,
/// are taken once: one answer 200, every other 404.
#[tokio::test]
async fn a_response_takes_one_verdict_across_replicas_even_at_once() {
    let redis = RedisServer::start();
    let backend = scripted();
    let a = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    let b = spawn_replica(redis_config(redis.url()), Arc::new(backend.clone())).await;
    assert_eq!(
        cache_status(&a.chat(&chat_body("How do I reset my password?"), &[]).await),
        "miss"
    );
    let asked = chat_body("I forgot my password, how can I change it?");
    expect_status(&b, &asked, &[], "semantic").await;
    let r = b.chat(&asked, &[]).await;
    let id = r.json::<serde_json::Value>().await.unwrap()["id"].clone();
    // The record is in Redis for A to find.
    b.state.store.redis().unwrap().flush().await.unwrap();
    let verdicts = (0..8).map(|i| {
        let app = if i % 2 == 0 { &a } else { &b };
        app.client
            .post(app.url("/v1/feedback"))
            .json(&serde_json::json!({"id": id, "verdict": "right"}))
            .send()
    });
    let statuses: Vec<u16> = futures::future::join_all(verdicts)
        .await
        .into_iter()
        .map(|r| r.unwrap().status().as_u16())
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        1,
        "{statuses:?}"
    );
    assert!(
        statuses.iter().all(|s| [200, 404].contains(s)),
        "{statuses:?}"
    );
}

/// A verdict on a shared response record that Redis cannot take (the tier's breaker open) is
/// refused and the record kept: given again once Redis answers it counts, once.
#[tokio::test]
async fn a_verdict_redis_cannot_take_is_refused_then_counts_once() {
    let redis = RedisServer::start();
    let backend = scripted();
    let mut config = redis_config(redis.url());
    config.redis.breaker_cooldown_ms = 2_000;
    let a = spawn_replica(config, Arc::new(backend.clone())).await;
    assert_eq!(
        cache_status(&a.chat(&chat_body("How do I reset my password?"), &[]).await),
        "miss"
    );
    let asked = chat_body("I forgot my password, how can I change it?");
    expect_status(&a, &asked, &[], "semantic").await;
    let r = a.chat(&asked, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    // Redis stops answering: the replica's reads time out and its breaker opens.
    open_breaker(&redis.url(), a.state.store.redis().unwrap(), 1_000).await;
    let verdict = json!({"id": id, "verdict": "wrong"});
    let r = feedback(&a, verdict.clone(), None).await;
    assert!(r.headers().contains_key("retry-after"));
    let j = assert_openai_error(r, 503, None).await;
    assert_eq!(j["error"]["code"], "unavailable", "{j}");
    let message = j["error"]["message"].as_str().unwrap();
    assert!(message.contains("retry the verdict"), "{message}");
    let taken = eventually_async(Duration::from_secs(20), || async {
        feedback(&a, verdict.clone(), None).await.status() == 200
    });
    assert!(taken.await);
    assert_eq!(feedback(&a, verdict, None).await.status(), 404, "spent");
}

/// A check on one replica and a client's verdict on another, on one response: the first
/// counts, the other adds no evidence, whichever replica each ran on (Redis orders them).
#[tokio::test]
async fn a_check_and_a_verdict_on_two_replicas_count_once() {
    let redis = RedisServer::start();
    let backend =
        reprise_backend::fake::ScriptedBackend::new(reprise_backend::fake::ScriptConfig {
            rules: vec![("You judge answers".into(), "yes".into())],
            first_token_delay: Duration::from_secs(2),
            ..Default::default()
        });
    let mut config = redis_config(redis.url());
    config.semantic.verify_hits = 1.0;
    config.semantic.verify_judge = reprise::config::VerifyJudge::Prompt;
    // Each replica's evidence its own (no exchange within the test).
    config.semantic.evidence_sync_secs = 3600;
    let a = spawn_replica(config.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(config, Arc::new(backend.clone())).await;
    let evidence = |app: &TestApp| {
        app.state
            .bounds
            .threshold("", "*/*", 0.02, 0.0, 0.0)
            .verdicts
    };
    let ask = |text: &str| {
        let mut body = chat_body(text);
        body["max_tokens"] = 100.into();
        body
    };
    // The first hit B serves (the one its check is for), its id: polled with
    // `only-if-cached` until the entry reached B's index.
    let hit_on_b = |original: &'static str, asked: &'static str| {
        let (a, b) = (&a, &b);
        async move {
            a.chat(&ask(original), &[]).await;
            for _ in 0..200 {
                let r = b
                    .chat(&ask(asked), &[("cache-control", "only-if-cached")])
                    .await;
                if cache_status(&r) == "semantic" {
                    return r.json::<Value>().await.unwrap()["id"].clone();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            panic!("no semantic hit on B");
        }
    };
    // Checks superseded, as B (where they run) counts them.
    let superseded = || verify_checks(&b, "superseded");

    // The client's verdict (on A) first: counted there; B's check then finds it spent.
    let before = superseded().await;
    let id = hit_on_b(
        "How do I reset my password?",
        "I forgot my password, how can I change it?",
    )
    .await;
    let verdict = json!({"id": id, "verdict": "right"});
    let taken = eventually_async(Duration::from_secs(10), || async {
        feedback(&a, verdict.clone(), None).await.status() == 200
    });
    assert!(taken.await);
    assert_eq!(evidence(&a), 1.0);
    let ended = eventually_async(Duration::from_secs(30), || async {
        superseded().await > before
    });
    assert!(ended.await, "B's check ended superseded");

    // B's check first (counted on B); the client's verdict on A then adds nothing.
    let id = hit_on_b("Which shop sells stamps?", "Which store sells stamps?").await;
    let checked = evidence(&b) + 1.0;
    assert!(eventually(Duration::from_secs(30), || evidence(&b) >= checked).await);
    let before = evidence(&a);
    let r = feedback(&a, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(evidence(&a), before, "counted by B's check already");
}

/// Verdicts taken on one replica tighten the learned threshold of the others, and of a
/// replica started after the first one stopped (its evidence outlives it in Redis): the
/// scope's, and the judged entry's own.
#[tokio::test]
async fn verdicts_reach_the_thresholds_of_every_replica() {
    let redis = RedisServer::start();
    let backend = scripted();
    let mut config = redis_config(redis.url());
    config.semantic.delta = 0.05;
    config.semantic.evidence_sync_secs = 1;
    let a = spawn_replica(config.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(config.clone(), Arc::new(backend.clone())).await;
    let threshold = |app: &TestApp| {
        app.state
            .bounds
            .threshold("", "*/*", 0.05, 0.86, 0.7)
            .threshold
    };
    assert_eq!(threshold(&b), 0.86, "no verdicts yet");
    assert_eq!(
        cache_status(&a.chat(&chat_body("How do I reset my password?"), &[]).await),
        "miss"
    );
    let asked = chat_body("I forgot my password, how can I change it?");
    expect_status(&a, &asked, &[], "semantic").await;
    let r = a.chat(&asked, &[]).await;
    let sim = similarity(&r);
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    let r = feedback(&a, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    let entry: reprise_cache::EntryId = r.json::<Value>().await.unwrap()["entry"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let own = |app: &TestApp| {
        app.state
            .bounds
            .entry_threshold(entry, 0.05, 0.86, 0.7)
            .map(|l| l.threshold)
    };
    assert!(threshold(&a) > sim, "A learned from its own verdict");
    assert!(own(&a).is_some_and(|t| t > sim), "{:?}", own(&a));
    // B never saw the verdict; it learns it from A's published evidence.
    let state = b.state.clone();
    let shared = eventually(Duration::from_secs(10), || {
        state.bounds.threshold("", "*/*", 0.05, 0.86, 0.7).threshold > sim
            && state
                .bounds
                .entry_threshold(entry, 0.05, 0.86, 0.7)
                .is_some_and(|l| l.threshold > sim)
    })
    .await;
    assert!(
        shared,
        "B's thresholds stayed {} {:?}",
        threshold(&b),
        own(&b)
    );
    // A stops (publishing once more); a replica started afterwards learns it too, and so
    // does B still (A's evidence is not dropped with A).
    a.shutdown().await;
    let c = spawn_replica(config, Arc::new(backend.clone())).await;
    let state = c.state.clone();
    let restarted = eventually(Duration::from_secs(10), || {
        state.bounds.threshold("", "*/*", 0.05, 0.86, 0.7).threshold > sim
            && state
                .bounds
                .entry_threshold(entry, 0.05, 0.86, 0.7)
                .is_some_and(|l| l.threshold > sim)
    })
    .await;
    assert!(restarted, "C's threshold stayed {}", threshold(&c));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(threshold(&b) > sim);
}

/// Evidence of replicas gone for good (published more than a week ago) is removed from the
/// shared hash as it is read, so a hash of many past restarts still leads to the live
/// replicas' evidence (at most 256 fields are read at a time).
#[tokio::test]
async fn stale_evidence_is_pruned_and_live_evidence_reached() {
    let redis = RedisServer::start();
    let mut config = redis_config(redis.url());
    config.semantic.enabled = false;
    config.semantic.delta = 0.05;
    config.semantic.evidence_sync_secs = 0;
    let app = spawn_replica(config, Arc::new(scripted())).await;
    let key = "reprise:hash:{bounds:evidence}";
    let published = |at_ms: u64| {
        json!({"at_ms": at_ms, "tenants": {"": {"*/*": [[90, 0.0, 5.0]]}}}).to_string()
    };
    let mut args = vec![
        "-p".to_string(),
        redis.port().to_string(),
        "hset".into(),
        key.into(),
    ];
    for i in 0..300 {
        args.extend([format!("gone-{i}"), published(1_000)]);
    }
    args.extend(["live".to_string(), published(reprise_cache::now_ms())]);
    let out = std::process::Command::new("redis-cli")
        .args(&args)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "301");
    let hlen = || {
        let out = std::process::Command::new("redis-cli")
            .args(["-p", &redis.port().to_string(), "hlen", key])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    let threshold = || {
        app.state
            .bounds
            .threshold("", "*/*", 0.05, 0.86, 0.7)
            .threshold
    };
    for _ in 0..3 {
        app.state.bounds.pull(&app.state).await;
    }
    assert_eq!(hlen(), 1, "only the live replica's field is left");
    assert!(
        threshold() > 0.90,
        "its wrong verdicts at 0.90 count: {}",
        threshold()
    );
}

/// Retries `send` until it answers 200 (a queued Redis write may not have landed yet).
async fn eventually_ok<F, Fut>(send: F) -> serde_json::Value
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = reqwest::Result<reqwest::Response>>,
{
    for _ in 0..100 {
        let r = send().await.unwrap();
        if r.status() == 200 {
            return r.json().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never answered 200");
}

/// A conversation whose earlier exchanges only Redis knows (another replica answered them)
/// is resolved in a fixed number of round trips, not one or two per exchange, and to the
/// same context: a paraphrase of its last question, asked on the other replica, is a
/// semantic hit.
#[tokio::test]
async fn a_long_conversation_resolves_in_a_few_round_trips() {
    let (rounds, gets) = conversation_across_replicas(32).await;
    // The exact key, the raw links of all eight exchanges (ids, then entries), and a little
    // room for the replication stream's reads; one by one they would take sixteen.
    assert!(rounds <= 6, "{rounds} round trips");
    assert!(gets <= 2 * 8 + 2, "{gets} GETs");
}

/// Only the first `cache.context_turns` exchanges are looked up; later ones join the context
/// by their text, the same way on every replica (their hits are still shared).
#[tokio::test]
async fn exchanges_beyond_the_turn_cap_are_not_looked_up() {
    let (rounds, gets) = conversation_across_replicas(3).await;
    assert!(rounds <= 6, "{rounds} round trips");
    // The exact key and three links (ids, then entries), not eight.
    assert!(gets <= 2 * 3 + 2, "{gets} GETs");
}

/// Replica A answers a nine-question conversation; replica B is asked the last question
/// reworded after the same eight exchanges (cache only). Returns B's round trips and the GET
/// commands Redis ran for that lookup.
async fn conversation_across_replicas(context_turns: usize) -> (u64, u64) {
    let redis = RedisServer::start();
    let backend = scripted();
    let mut config = redis_config(redis.url());
    // Nothing but the lookup writes or reads Redis during the measured request.
    config.feedback.enabled = false;
    config.cache.context_turns = context_turns;
    let a = spawn_replica(config.clone(), Arc::new(backend.clone())).await;
    let b = spawn_replica(config, Arc::new(backend.clone())).await;
    let questions = [
        "How do I reset my password?",
        "What if I no longer have access to my email?",
        "Can support verify my identity another way?",
        "How long does the identity check take?",
        "Will my saved payment methods be kept?",
        "Can I turn on two-factor authentication afterwards?",
        "Which authenticator apps are supported?",
        "What happens if I lose my phone?",
        "How do I download my backup codes?",
    ];
    let mut messages: Vec<Value> = Vec::new();
    for q in questions {
        messages.push(json!({"role": "user", "content": q}));
        let r = a
            .chat(&json!({"model": "fake", "messages": messages}), &[])
            .await;
        assert_eq!(cache_status(&r), "miss");
        messages.push(json!({"role": "assistant", "content": content(r).await}));
    }
    // The last question again, reworded, after the same eight exchanges.
    messages.pop();
    messages.pop();
    messages.push(json!({"role": "user", "content": "How can I get my backup codes?"}));
    let body = json!({"model": "fake", "messages": messages});
    let cached_only = [("cache-control", "only-if-cached")];
    // Once B holds the entries (the replication stream), count B's round trips for one
    // lookup of the conversation.
    let tier = b.state.store.redis().unwrap();
    for _ in 0..200 {
        let (before, gets_before) = (tier.rounds(), get_calls(&redis));
        let r = b.chat(&body, &cached_only).await;
        if cache_status(&r) == "semantic" {
            assert_eq!(backend.calls(), questions.len());
            return (tier.rounds() - before, get_calls(&redis) - gets_before);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("B never served the paraphrase from the conversation");
}

/// GET commands the Redis server has run.
fn get_calls(redis: &RedisServer) -> u64 {
    let out = std::process::Command::new("redis-cli")
        .args(["-p", &redis.port().to_string(), "INFO", "commandstats"])
        .output()
        .expect("redis-cli runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("cmdstat_get:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// A Redis that stops answering delays an answer by the lookup deadline, not by Redis's own
/// (here, one-minute) command timeout: the request goes on as a miss.
#[tokio::test]
async fn a_stalled_redis_delays_answers_by_the_lookup_deadline_only() {
    let mut redis = RedisServer::start();
    let backend = scripted();
    let mut config = redis_config(redis.url());
    config.redis.timeout_ms = 60_000;
    config.server.lookup_timeout_secs = 0.5;
    config.feedback.enabled = false;
    let a = spawn_replica(config, Arc::new(backend.clone())).await;
    let r = a.chat(&chat_body("Is Redis reachable?"), &[]).await;
    assert_eq!(cache_status(&r), "miss", "{:?}", r.text().await);
    let port = redis.port().to_string();
    let paused = std::process::Command::new("redis-cli")
        .args(["-p", port.as_str(), "CLIENT", "PAUSE", "60000", "ALL"])
        .status()
        .expect("redis-cli runs");
    assert!(paused.success());
    let asked = chat_body("What is the capital of France?");
    let answer = tokio::time::timeout(Duration::from_secs(30), a.chat(&asked, &[])).await;
    // (A paused server does not take an UNPAUSE from a new connection either.)
    redis.stop();
    let r = answer.expect("the answer waited for Redis");
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(
        content(r).await,
        "You asked: What is the capital of France?"
    );
}

/// Expired entries are kept in Redis for the stale windows: a replica that never held one
/// (started after it expired; a rebuild loads no expired entry) serves it stale from Redis,
/// instead of its backend's failure (stale-if-error) or at once while regenerating it
/// (stale-while-revalidate); the regenerated answer reaches the replica that wrote the
/// first one through Redis as an ordinary hit.
#[tokio::test]
async fn an_expired_entry_is_served_stale_from_redis_by_a_replica_that_never_held_it() {
    use reprise_backend::fake::{Failure, ScriptConfig, ScriptedBackend};
    use reprise_backend::BackendError;

    let redis = RedisServer::start();
    let config = |while_revalidate: u64| {
        let mut c = redis_config(redis.url());
        c.semantic.enabled = false;
        c.cache.ttl_secs = 2;
        c.cache.stale_while_revalidate_secs = while_revalidate;
        c.cache.stale_if_error_secs = 60;
        c
    };
    let backend = |reply: &str| {
        ScriptedBackend::new(ScriptConfig {
            reply: reply.into(),
            ..ScriptConfig::default()
        })
    };
    let entry_of = |r: &reqwest::Response| -> reprise_cache::EntryId {
        r.headers()["x-reprise-entry"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    };
    let body = chat_body("When does the market open?");
    let a = spawn_replica(config(60), Arc::new(backend("first"))).await;
    let r = a.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let old = entry_of(&r);
    a.state.store.redis().unwrap().flush().await.unwrap();
    let expires = a.state.store.get(old).await.unwrap().expires_ms;
    while reprise_cache::now_ms() < expires {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // B: its backend is down and it never held the entry: stale-if-error from Redis.
    let down = backend("never");
    down.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let b = spawn_replica(config(0), Arc::new(down.clone())).await;
    let r = b.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(r.headers()["x-reprise-degraded"], "stale-if-error");
    assert_eq!(entry_of(&r), old);
    assert_eq!(content(r).await, "first");
    assert_eq!(down.calls(), 1, "the backend was asked first");
    assert!(b.state.store.get(old).await.is_none(), "never fresh on B");

    // C: stale-while-revalidate from Redis, and the regeneration written back to Redis.
    let fresh = backend("second");
    let c = spawn_replica(config(60), Arc::new(fresh.clone())).await;
    let r = c.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(r.headers()["x-reprise-degraded"], "stale-while-revalidate");
    assert_eq!(content(r).await, "first");
    assert!(eventually(Duration::from_secs(10), || fresh.completed() == 1).await);
    c.state.store.redis().unwrap().flush().await.unwrap();

    // A, which holds the expired entry, asks Redis and finds the fresh one.
    let r = a.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_ne!(entry_of(&r), old);
    assert_eq!(content(r).await, "second");
}
