//! Tenants over real TCP, with the real embedder and a real redis-server: API keys name the
//! tenant, and nothing cached, linked or learned for one tenant ever reaches another.

mod common;

use std::collections::HashSet;
use std::sync::Arc;

use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reprise::admin::Admin;
use reprise::config::{Config, TenantConfig, TenantPolicy};
use reprise_backend::fake::ScriptConfig;
use serde_json::Value;

fn tenant(name: &str, key: &str, sub_namespaces: bool) -> TenantConfig {
    TenantConfig {
        name: name.into(),
        api_keys: vec![key.into()],
        api_keys_env: None,
        api_keys_file: None,
        sub_namespaces,
        admin_token_env: None,
        candidate: None,
        policy: TenantPolicy::default(),
    }
}

fn tenants_config(required: bool) -> Config {
    let mut c = test_config();
    c.auth.required = required;
    c.tenants = vec![
        tenant("acme", "sk-acme", true),
        tenant("beta", "sk-beta", true),
        tenant("locked", "sk-locked", false),
    ];
    c
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[tokio::test]
async fn a_known_key_is_required_when_auth_is_required() {
    let (app, backend) = spawn_fake(tenants_config(true), ScriptConfig::default()).await;
    let body = chat_body("What is the capital of France?");
    for headers in [
        vec![],
        vec![("authorization", bearer("sk-nope"))],
        vec![("authorization", "Basic c2stYWNtZQ==".to_string())],
    ] {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = app.chat(&body, &h).await;
        let j = assert_openai_error(r, 401, None).await;
        assert_eq!(j["error"]["code"], "invalid_api_key", "{j}");
    }
    // Refused before the body is read: a bad body without a key is still a 401.
    let r = app
        .client
        .post(app.chat_url())
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(app.get("/v1/models").await.status(), 401);
    assert_eq!(backend.calls(), 0);
    app.state.store.run_pending_tasks().await;
    assert_eq!(app.state.store.entry_count(), 0, "nothing stored");

    let key = bearer("sk-acme");
    let r = app.chat(&body, &[("authorization", &key)]).await;
    assert_eq!(
        (r.status().as_u16(), cache_status(&r)),
        (200, "miss".into())
    );
    let r = app.chat(&body, &[("authorization", &key)]).await;
    assert_eq!(cache_status(&r), "exact");
    let models = app
        .client
        .get(app.url("/v1/models"))
        .header("authorization", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(backend.calls(), 1);
}

/// Sends `head` and `body` on a fresh connection and reads the start of the answer; an
/// answer that never comes fails after 30 s (the server would be waiting for the body).
async fn raw_exchange(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(30), s.read(&mut buf))
        .await
        .expect("an answer while the body is still owed")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

#[tokio::test]
async fn an_unknown_caller_is_refused_before_its_body_and_a_slow_body_times_out() {
    let mut config = tenants_config(true);
    config.server.body_timeout_secs = 0.5;
    let (app, backend) = spawn_fake(config, ScriptConfig::default()).await;
    // A large body announced and never sent.
    let head = |auth: &str, path: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: reprise\r\ncontent-type: application/json\r\n\
             content-length: 4000000\r\n{auth}\r\n"
        )
    };
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/feedback"] {
        let r = raw_exchange(app.addr, &head("", path), b"").await;
        assert!(r.starts_with("HTTP/1.1 401"), "{path}: {r}");
        assert!(r.contains("invalid_api_key"), "{path}: {r}");
    }
    // A known caller that trickles its body: 408 once `body_timeout_secs` has passed.
    let known = head("authorization: Bearer sk-acme\r\n", "/v1/chat/completions");
    let r = raw_exchange(app.addr, &known, b"{\"model\":").await;
    assert!(r.starts_with("HTTP/1.1 408"), "{r}");
    assert!(r.contains("request_timeout"), "{r}");
    // A body announced over the limit is a 413 before it is read.
    let over = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: reprise\r\nauthorization: Bearer sk-acme\r\n\
         content-length: {}\r\n\r\n",
        app.state.config.server.max_body_bytes + 1
    );
    let r = raw_exchange(app.addr, &over, b"").await;
    assert!(r.starts_with("HTTP/1.1 413"), "{r}");
    assert_eq!(backend.calls(), 0);
}

#[tokio::test]
async fn a_tenant_without_sub_namespaces_cannot_pick_one() {
    let (app, _backend) = spawn_fake(tenants_config(true), ScriptConfig::default()).await;
    let key = bearer("sk-locked");
    let body = chat_body("hello");
    let r = app
        .chat(
            &body,
            &[("authorization", &key), ("x-reprise-namespace", "x")],
        )
        .await;
    let j = assert_openai_error(r, 403, None).await;
    assert_eq!(j["error"]["code"], "permission_denied");
    let r = app.chat(&body, &[("authorization", &key)]).await;
    assert_eq!(r.status(), 200);
}

/// Wordings of one question each: a tenant's later wording may be a semantic hit of its own
/// earlier one.
const GROUPS: &[&[&str]] = &[
    &[
        "How do I reset my password?",
        "I forgot my password, how can I change it?",
        "how can I reset my password",
    ],
    &[
        "How do I create an account?",
        "How can I sign up for an account?",
    ],
    &[
        "What are your opening hours?",
        "When are you open?",
        "What time do you open?",
    ],
    &[
        "How do I cancel my subscription?",
        "How can I cancel my plan?",
    ],
];

/// Random traffic from three callers (two tenants and the anonymous one) over two replicas
/// sharing Redis, with every namespace header (including one that names a tenant), every
/// Cache-Control, sessions (prefetch on) and second turns: the first time a caller asks
/// anything of a question in a namespace, it is never answered from the cache, and carries no
/// `Age`. A caller's own repeats are hits, so the property is not vacuous.
#[tokio::test]
async fn tenants_never_share_answers_links_or_predictions() {
    let server = RedisServer::start();
    let mut config = tenants_config(false);
    config.semantic.enabled = true;
    config.prefetch.enabled = true;
    config.prefetch.min_probability = 0.1;
    config.redis.url = Some(server.url());
    let backend = Arc::new(scripted());
    let replicas = [
        spawn_replica(config.clone(), backend.clone()).await,
        spawn_replica(config, backend).await,
    ];
    let callers = [Some("sk-acme"), Some("sk-beta"), None];
    let namespaces = [None, Some("support"), Some("acme"), Some("beta")];
    let controls = [
        None,
        Some("max-age=3600"),
        Some("no-cache"),
        Some("only-if-cached"),
    ];
    let mut rng = StdRng::seed_from_u64(7);
    // (caller, namespace, question, turn) seen so far.
    let mut asked: HashSet<(usize, usize, usize, bool)> = HashSet::new();
    let (mut hits, mut firsts) = (0, 0);
    for i in 0..160 {
        let caller = rng.random_range(0..callers.len());
        let ns = rng.random_range(0..namespaces.len());
        let group = rng.random_range(0..GROUPS.len());
        let wording = GROUPS[group][rng.random_range(0..GROUPS[group].len())];
        let second_turn = rng.random_bool(0.25);
        let control = controls[rng.random_range(0..controls.len())];
        let replica = &replicas[rng.random_range(0..replicas.len())];
        let body: Value = if second_turn {
            convo(&[
                ("user", wording),
                ("assistant", &format!("You asked: {wording}")),
                ("user", "Can you tell me more?"),
            ])
        } else {
            chat_body(wording)
        };
        let session = format!("s{}-{caller}", i / 4);
        let mut headers: Vec<(&str, String)> = vec![("x-reprise-session", session)];
        if let Some(k) = callers[caller] {
            headers.push(("authorization", bearer(k)));
        }
        if let Some(n) = namespaces[ns] {
            headers.push(("x-reprise-namespace", n.to_string()));
        }
        if let Some(c) = control {
            headers.push(("cache-control", c.to_string()));
        }
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let r = replica.chat(&body, &h).await;
        let status = cache_status(&r);
        let hit = matches!(status.as_str(), "exact" | "semantic" | "prefetch");
        let first = asked.insert((caller, ns, group, second_turn));
        if first {
            firsts += 1;
            assert!(
                !hit,
                "request {i}: caller {caller} namespace {:?} asked {wording:?} (second turn: \
                 {second_turn}) for the first time and got `{status}`",
                namespaces[ns]
            );
            assert!(r.headers().get("age").is_none(), "request {i}: an Age");
        }
        if hit {
            hits += 1;
        }
        let _ = r.bytes().await;
    }
    assert!(firsts > 30, "{firsts} first asks");
    assert!(
        hits > 10,
        "only {hits} hits: the cache must serve each caller's repeats"
    );
}

fn with_policy(name: &str, key: &str, policy: TenantPolicy) -> TenantConfig {
    TenantConfig {
        policy,
        ..tenant(name, key, true)
    }
}

/// One server with a tenant per policy, all keys required.
async fn policy_app(policies: Vec<(&str, TenantPolicy)>, semantic: bool) -> (TestApp, Backend) {
    let mut c = test_config();
    c.auth.required = true;
    c.semantic.enabled = semantic;
    c.tenants = policies
        .into_iter()
        .map(|(name, p)| with_policy(name, &format!("sk-{name}"), p))
        .collect();
    c.tenants.push(tenant("free", "sk-free", true));
    spawn_fake(c, ScriptConfig::default()).await
}

type Backend = reprise_backend::fake::ScriptedBackend;

async fn ask(
    app: &TestApp,
    tenant: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> reqwest::Response {
    let key = bearer(&format!("sk-{tenant}"));
    let mut h = vec![("authorization", key.as_str())];
    h.extend_from_slice(extra);
    app.chat(body, &h).await
}

#[tokio::test]
async fn a_tenant_over_its_rate_is_told_when_to_retry_and_others_are_not() {
    let limited = TenantPolicy {
        requests_per_minute: 2,
        ..TenantPolicy::default()
    };
    let (app, _backend) = policy_app(vec![("slow", limited)], false).await;
    let body = chat_body("hello");
    for _ in 0..2 {
        assert_eq!(ask(&app, "slow", &body, &[]).await.status(), 200);
    }
    let r = ask(&app, "slow", &body, &[]).await;
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(retry >= 1, "{retry}");
    let j = assert_openai_error(r, 429, None).await;
    assert_eq!(j["error"]["code"], "rate_limit_exceeded");
    assert_eq!(ask(&app, "free", &body, &[]).await.status(), 200);
    // The refusal counts under its tenant (the metrics, the statistics and the request log
    // all read the same record).
    let m = app.metrics_text().await;
    let refused = [("tenant", "slow"), ("outcome", "error"), ("model", "other")];
    assert_eq!(
        sample(&m, "reprise_requests_total", &refused),
        Some(1.0),
        "{m}"
    );
}

/// Callers without a known key are held to `[auth.anonymous]`: over its rate they get 429
/// while a tenant's key is unaffected, and a read-only anonymous policy stores nothing.
#[tokio::test]
async fn the_anonymous_tenant_keeps_to_its_own_policy() {
    let mut c = tenants_config(false);
    c.auth.anonymous = TenantPolicy {
        requests_per_minute: 2,
        ..TenantPolicy::default()
    };
    let (app, _backend) = spawn_fake(c, ScriptConfig::default()).await;
    let body = chat_body("Anyone may ask this");
    for _ in 0..2 {
        assert_eq!(app.chat(&body, &[]).await.status(), 200);
    }
    let r = app.chat(&body, &[]).await;
    assert!(r.headers().contains_key("retry-after"));
    assert_openai_error(r, 429, None).await;
    // An unknown key is the anonymous tenant too; a known one has its own rate.
    let unknown = bearer("sk-nobody");
    let r = app.chat(&body, &[("authorization", &unknown)]).await;
    assert_openai_error(r, 429, None).await;
    let acme = bearer("sk-acme");
    assert_eq!(
        app.chat(&body, &[("authorization", &acme)]).await.status(),
        200
    );

    let mut c = tenants_config(false);
    c.auth.anonymous = TenantPolicy {
        read_only: true,
        max_tokens: 64,
        ..TenantPolicy::default()
    };
    let (app, backend) = spawn_fake(c, ScriptConfig::default()).await;
    for _ in 0..2 {
        let r = app.chat(&body, &[]).await;
        assert_eq!(cache_status(&r), "bypass");
        content(r).await;
    }
    assert_eq!(
        backend.calls(),
        2,
        "nothing stored for the anonymous tenant"
    );
    // Its cap: a request asking for more is refused, one asking for none gets the cap.
    let mut long = chat_body("Tell me everything");
    long["max_tokens"] = 100.into();
    assert_openai_error(app.chat(&long, &[]).await, 400, Some("max_tokens")).await;
    assert_eq!(backend.calls(), 2);
    content(app.chat(&chat_body("Tell me a little"), &[]).await).await;
    let asked = backend.requests().pop().unwrap();
    assert_eq!(asked.params.max_tokens, Some(64));
    // The running policies show it.
    let view = app.state.policies.load().view();
    assert_eq!(view["auth"]["anonymous"]["max_tokens"], 64, "{view}");
    assert_eq!(
        view["auth"]["anonymous"]["max_priority"], "interactive",
        "{view}"
    );
}

#[tokio::test]
async fn tenant_policies_bound_what_a_key_may_do() {
    let (app, backend) = policy_app(
        vec![
            (
                "reader",
                TenantPolicy {
                    read_only: true,
                    ..TenantPolicy::default()
                },
            ),
            (
                "narrow",
                TenantPolicy {
                    models: vec!["another-model".into()],
                    ..TenantPolicy::default()
                },
            ),
            (
                "capped",
                TenantPolicy {
                    max_tokens: 100,
                    controls: vec!["max-age".into()],
                    ttl_secs: Some(60),
                    ..TenantPolicy::default()
                },
            ),
        ],
        false,
    )
    .await;
    // Read-only: answered, never stored.
    let body = chat_body("read me");
    for _ in 0..2 {
        let r = ask(&app, "reader", &body, &[]).await;
        assert_eq!(cache_status(&r), "bypass");
    }
    assert_eq!(backend.calls(), 2);
    // Models outside the tenant's list do not exist for it.
    let r = ask(&app, "narrow", &body, &[]).await;
    let j = assert_openai_error(r, 404, Some("model")).await;
    assert_eq!(j["error"]["code"], "model_not_found");
    // max_tokens above the cap is refused; without one the cap applies (the key with the
    // cap written out is the same request).
    let mut big = chat_body("capped question");
    big["max_tokens"] = 500.into();
    assert_openai_error(
        ask(&app, "capped", &big, &[]).await,
        400,
        Some("max_tokens"),
    )
    .await;
    let r = ask(&app, "capped", &chat_body("capped question"), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let mut explicit = chat_body("capped question");
    explicit["max_tokens"] = 100.into();
    assert_eq!(
        cache_status(&ask(&app, "capped", &explicit, &[]).await),
        "exact"
    );
    // Only the controls it was given.
    let r = ask(&app, "capped", &explicit, &[("cache-control", "no-cache")]).await;
    let j = assert_openai_error(r, 403, None).await;
    assert_eq!(j["error"]["code"], "permission_denied");
    let r = ask(
        &app,
        "capped",
        &explicit,
        &[("cache-control", "max-age=60")],
    )
    .await;
    assert_eq!(cache_status(&r), "exact");
    // Its own lifetime.
    let e = app
        .state
        .store
        .entries()
        .into_iter()
        .find(|e| e.text.contains("capped question"))
        .unwrap();
    assert_eq!(e.expires_ms - e.created_ms, 60_000);
}

#[tokio::test]
async fn a_tenant_rule_turns_the_semantic_tier_off_for_it_only() {
    let off = TenantPolicy {
        semantic_rules: vec![reprise_policies::semantic::Rule {
            enabled: Some(false),
            ..Default::default()
        }],
        ..TenantPolicy::default()
    };
    let (app, _backend) = policy_app(vec![("exact-only", off)], true).await;
    for (tenant, want) in [("exact-only", "miss"), ("free", "semantic")] {
        let r = ask(&app, tenant, &chat_body("How do I reset my password?"), &[]).await;
        assert_eq!(cache_status(&r), "miss");
        let paraphrase = chat_body("I forgot my password, how can I change it?");
        let r = ask(&app, tenant, &paraphrase, &[]).await;
        assert_eq!(cache_status(&r), want, "{tenant}");
    }
}

#[tokio::test]
async fn an_operator_deletes_one_tenants_namespace_only() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_TENANT_ADMIN_TOKEN", "adm1n");
    let mut config = tenants_config(false);
    config.server.admin_token_env = Some("REPRISE_TEST_TENANT_ADMIN_TOKEN".into());
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let body = chat_body("keep or drop");
    let acme = bearer("sk-acme");
    let acme_h = [
        ("authorization", acme.as_str()),
        ("x-reprise-namespace", "support"),
    ];
    // The anonymous tenant's namespace "support" is another namespace.
    let anon_h = [("x-reprise-namespace", "support")];
    for h in [&acme_h[..], &anon_h[..]] {
        assert_eq!(cache_status(&app.chat(&body, h).await), "miss");
    }
    let delete = |q: &str| {
        app.client
            .delete(app.url(&format!("/admin/namespaces/support{q}")))
            .bearer_auth("adm1n")
            .send()
    };
    assert_eq!(delete("?tenant=nobody").await.unwrap().status(), 400);
    let r = delete("?tenant=acme").await.unwrap();
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["deleted"], 1);
    assert_eq!(
        cache_status(&app.chat(&body, &acme_h).await),
        "miss",
        "deleted"
    );
    assert_eq!(
        cache_status(&app.chat(&body, &anon_h).await),
        "exact",
        "kept"
    );
}

#[tokio::test]
async fn misses_spend_the_tenants_token_budget_and_hits_are_free() {
    let budget = TenantPolicy {
        tokens_per_minute: 300,
        ..TenantPolicy::default()
    };
    let (app, backend) = policy_app(vec![("metered", budget)], false).await;
    let with_max = |text: &str, n: u32| {
        let mut b = chat_body(text);
        b["max_tokens"] = n.into();
        b
    };
    let first = with_max("first question", 200);
    assert_eq!(
        cache_status(&ask(&app, "metered", &first, &[]).await),
        "miss"
    );
    for _ in 0..3 {
        assert_eq!(
            cache_status(&ask(&app, "metered", &first, &[]).await),
            "exact"
        );
    }
    // 100 tokens left this minute.
    let r = ask(&app, "metered", &with_max("second question", 200), &[]).await;
    assert!(r.headers().contains_key("retry-after"));
    let j = assert_openai_error(r, 429, None).await;
    assert_eq!(j["error"]["code"], "rate_limit_exceeded");
    // More than a whole minute's budget can never pass.
    let r = ask(&app, "metered", &with_max("third question", 500), &[]).await;
    assert_openai_error(r, 400, Some("max_tokens")).await;
    // Another tenant has its own budget (none).
    let r = ask(&app, "free", &with_max("second question", 200), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(backend.calls(), 2);
}

/// A tenant admin's tag delete wins over the tenant's answers with the tag that were being
/// generated when it came: they are served, never stored. Another tenant's are stored.
#[tokio::test]
async fn a_tenants_tag_delete_wins_over_its_answers_on_their_way() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_ACME_TAG_ADMIN_TOKEN", "acme-tagger");
    let mut config = tenants_config(true);
    config.tenants[0].admin_token_env = Some("REPRISE_TEST_ACME_TAG_ADMIN_TOKEN".into());
    let script = ScriptConfig {
        first_token_delay: std::time::Duration::from_millis(800),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let ask = |key: &'static str, cache: Option<&'static str>| {
        let app = &app;
        async move {
            let key = bearer(key);
            let mut h = vec![
                ("authorization", key.as_str()),
                ("x-reprise-tags", "pricing"),
            ];
            if let Some(c) = cache {
                h.push(("cache-control", c));
            }
            cache_status(&app.chat(&chat_body("What does the plan cost?"), &h).await)
        }
    };
    let delete = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        app.client
            .delete(app.url("/admin/tags/pricing"))
            .bearer_auth("acme-tagger")
            .send()
            .await
            .unwrap()
            .status()
    };
    let (acme, beta, deleted) = tokio::join!(ask("sk-acme", None), ask("sk-beta", None), delete);
    assert_eq!((acme.as_str(), beta.as_str()), ("miss", "miss"));
    assert_eq!(deleted, 200);
    // Only if cached: an error where nothing is stored.
    assert_eq!(ask("sk-acme", Some("only-if-cached")).await, "error");
    assert_eq!(ask("sk-beta", Some("only-if-cached")).await, "exact");
}

/// A tenant's admin token reaches its own tenant only.
#[tokio::test]
async fn a_tenants_admin_token_reaches_only_its_tenant() {
    // The variable names are unique to this test, so no other test reads or writes them.
    std::env::set_var("REPRISE_TEST_ACME_ADMIN_TOKEN", "acme-admin");
    std::env::set_var("REPRISE_TEST_GLOBAL_ADMIN_TOKEN", "global-admin");
    let mut config = tenants_config(true);
    config.server.admin_token_env = Some("REPRISE_TEST_GLOBAL_ADMIN_TOKEN".into());
    config.tenants[0].admin_token_env = Some("REPRISE_TEST_ACME_ADMIN_TOKEN".into());
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let store = |key: &'static str, text: &'static str| {
        let app = &app;
        async move {
            let key = bearer(key);
            let h = [
                ("authorization", key.as_str()),
                ("x-reprise-namespace", "support"),
                ("x-reprise-tags", "t"),
            ];
            let r = app.chat(&chat_body(text), &h).await;
            assert_eq!(cache_status(&r), "miss");
            r.headers()["x-reprise-entry"].to_str().unwrap().to_string()
        }
    };
    let status = |key: &'static str, text: &'static str| {
        let app = &app;
        async move {
            let key = bearer(key);
            let h = [
                ("authorization", key.as_str()),
                ("x-reprise-namespace", "support"),
                ("cache-control", "only-if-cached"),
            ];
            cache_status(&app.chat(&chat_body(text), &h).await)
        }
    };
    let acme_1 = store("sk-acme", "acme one").await;
    store("sk-acme", "acme two").await;
    let beta_1 = store("sk-beta", "beta one").await;
    let admin = |method: reqwest::Method, path: &str, token: &str| {
        app.client
            .request(method, app.url(path))
            .bearer_auth(token)
            .send()
    };
    let deleted = |r: reqwest::Response| async move {
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["deleted"]
            .as_u64()
            .unwrap()
    };
    let del = reqwest::Method::DELETE;
    // Another tenant's entry is not found for it.
    let r = admin(
        del.clone(),
        &format!("/admin/entries/{beta_1}"),
        "acme-admin",
    )
    .await;
    assert_eq!(deleted(r.unwrap()).await, 0);
    assert_eq!(status("sk-beta", "beta one").await, "exact");
    let r = admin(
        del.clone(),
        &format!("/admin/entries/{acme_1}"),
        "acme-admin",
    )
    .await;
    assert_eq!(deleted(r.unwrap()).await, 1);
    assert_eq!(status("sk-acme", "acme one").await, "error");
    // Its tags: only its own entries.
    let r = admin(del.clone(), "/admin/tags/t", "acme-admin").await;
    assert_eq!(deleted(r.unwrap()).await, 1);
    assert_eq!(status("sk-acme", "acme two").await, "error");
    assert_eq!(status("sk-beta", "beta one").await, "exact");
    // Not another tenant's namespace, not the policies, not with a wrong token.
    let r = admin(
        del.clone(),
        "/admin/namespaces/support?tenant=beta",
        "acme-admin",
    )
    .await;
    assert_eq!(r.unwrap().status(), 403);
    let r = admin(reqwest::Method::GET, "/admin/policies", "acme-admin").await;
    assert_eq!(r.unwrap().status(), 403);
    let r = admin(del.clone(), "/admin/tags/t", "acme-admin-not").await;
    assert_eq!(r.unwrap().status(), 401);
    // The global token reaches everything.
    let r = admin(reqwest::Method::GET, "/admin/policies", "global-admin").await;
    assert_eq!(r.unwrap().status(), 200);
    let r = admin(
        del.clone(),
        "/admin/namespaces/support?tenant=beta",
        "global-admin",
    )
    .await;
    assert_eq!(deleted(r.unwrap()).await, 1);
    assert_eq!(status("sk-beta", "beta one").await, "error");
    // Names no request may give are refused (each delete would fence its name everywhere).
    let long = "n".repeat(129);
    for (path, token, param) in [
        (
            format!("/admin/namespaces/{long}?tenant=acme"),
            "acme-admin",
            "namespace",
        ),
        (format!("/admin/tags/{long}"), "acme-admin", "tag"),
        (format!("/admin/tags/{long}"), "global-admin", "tag"),
        (
            format!("/admin/namespaces/{}", "n".repeat(200)),
            "global-admin",
            "namespace",
        ),
    ] {
        let r = admin(del.clone(), &path, token).await.unwrap();
        assert_openai_error(r, 400, Some(param)).await;
    }
    // A tenant's namespace named in full by the global admin is not too long.
    let r = admin(
        del,
        &format!("/admin/namespaces/{}", "n".repeat(193)),
        "global-admin",
    )
    .await;
    assert_eq!(deleted(r.unwrap()).await, 0);
}

/// A tenant's admin deletes an answer still streaming by the id announced with it: it is
/// never stored, while an answer streamed beside it is.
#[tokio::test]
async fn a_tenants_admin_deletes_an_answer_still_streaming() {
    std::env::set_var("REPRISE_TEST_ACME_STREAM_ADMIN_TOKEN", "acme-stream-admin");
    let mut config = tenants_config(true);
    config.tenants[0].admin_token_env = Some("REPRISE_TEST_ACME_STREAM_ADMIN_TOKEN".into());
    let script = ScriptConfig {
        token_delay: std::time::Duration::from_millis(30),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let key = bearer("sk-acme");
    let stream = |text: &str| {
        let mut body = chat_body(text);
        body["stream"] = serde_json::json!(true);
        let h = [("authorization", key.as_str())];
        let app = &app;
        async move { app.chat(&body, &h).await }
    };
    let doomed = stream("an answer to take back").await;
    let kept = stream("an answer to keep").await;
    assert_eq!(cache_status(&doomed), "miss");
    let id = doomed.headers()["x-reprise-entry"]
        .to_str()
        .unwrap()
        .to_string();
    let kept_id = kept.headers()["x-reprise-entry"]
        .to_str()
        .unwrap()
        .to_string();
    let r = app
        .client
        .delete(app.url(&format!("/admin/entries/{id}")))
        .bearer_auth("acme-stream-admin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (a, b) = (doomed.text().await.unwrap(), kept.text().await.unwrap());
    assert!(a.ends_with("data: [DONE]\n\n") && b.ends_with("data: [DONE]\n\n"));
    let entry = |id: &str| id.parse::<reprise_cache::EntryId>().unwrap();
    let store = &app.state.store;
    let stored = eventually_async(std::time::Duration::from_secs(10), || async {
        store.get_kept(entry(&kept_id)).await.unwrap().is_some()
    })
    .await;
    assert!(stored, "the answer beside it is stored");
    assert!(store.get_kept(entry(&id)).await.unwrap().is_none());
    let h = [
        ("authorization", key.as_str()),
        ("cache-control", "only-if-cached"),
    ];
    let again = app.chat(&chat_body("an answer to take back"), &h).await;
    assert_eq!(cache_status(&again), "error");
}

/// `DELETE /admin/entries` by tenant, model and age; never without a filter.
#[tokio::test]
async fn an_operator_deletes_by_tenant_model_and_age() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_FILTER_ADMIN_TOKEN", "filter-admin");
    let mut config = tenants_config(false);
    config.server.admin_token_env = Some("REPRISE_TEST_FILTER_ADMIN_TOKEN".into());
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    for (key, text) in [("sk-acme", "a1"), ("sk-acme", "a2"), ("sk-beta", "b1")] {
        let k = bearer(key);
        let r = app.chat(&chat_body(text), &[("authorization", &k)]).await;
        assert_eq!(cache_status(&r), "miss");
    }
    app.chat(&chat_body("anonymous"), &[]).await;
    // Answers are written once generated, which may be after the response is sent.
    let store = &app.state.store;
    let written = eventually_async(std::time::Duration::from_secs(10), || async {
        store.run_pending_tasks().await;
        store.entry_count() == 4
    });
    assert!(written.await);
    let delete = |q: &str| {
        app.client
            .delete(app.url(&format!("/admin/entries{q}")))
            .bearer_auth("filter-admin")
            .send()
    };
    let count = |r: reqwest::Response| async move {
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["deleted"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(
        delete("").await.unwrap().status(),
        400,
        "no filter: nothing"
    );
    // A misspelt filter is refused, not ignored (which would widen the delete).
    let r = delete("?tenant=acme&older_than=3600").await.unwrap();
    assert_openai_error(r, 400, None).await;
    let r = app
        .client
        .delete(app.url("/admin/namespaces/default?tenat=acme"))
        .bearer_auth("filter-admin")
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400, None).await;
    // A call that takes no parameter refuses one (a tag delete is every tenant's).
    let r = app
        .client
        .delete(app.url("/admin/tags/t?tenant=acme"))
        .bearer_auth("filter-admin")
        .send()
        .await
        .unwrap();
    assert_openai_error(r, 400, None).await;
    assert_eq!(app.state.store.entry_count(), 4);
    assert_eq!(count(delete("?model=another").await.unwrap()).await, 0);
    assert_eq!(
        count(delete("?older_than_secs=3600").await.unwrap()).await,
        0
    );
    assert_eq!(count(delete("?tenant=acme").await.unwrap()).await, 2);
    assert_eq!(
        count(delete("?tenant=-&model=fake").await.unwrap()).await,
        1
    );
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    // One filtered delete at a time (each scans every entry): while the operator's runs,
    // another is told when to retry; a tenant admin's running does not hold the operator's.
    let running = app.state.admin_scans.take(&Admin::Global).unwrap();
    let r = delete("?older_than_secs=0").await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_openai_error(r, 429, None).await;
    drop(running);
    let acme = app.state.policies.load().tenants.named("acme").unwrap();
    let _tenants = app.state.admin_scans.take(&Admin::Tenant(acme)).unwrap();
    assert_eq!(count(delete("?older_than_secs=0").await.unwrap()).await, 1);
    app.state.store.run_pending_tasks().await;
    assert_eq!(app.state.store.entry_count(), 0);
}

/// A filtered delete wins over the answers it selects that were being generated when it
/// came: they are served, never stored. Answers it does not select are stored.
#[tokio::test]
async fn a_filtered_delete_wins_over_answers_on_their_way() {
    // The variable name is unique to this test, so no other test reads or writes it.
    std::env::set_var("REPRISE_TEST_FILTER_FENCE_TOKEN", "fence-admin");
    let mut config = tenants_config(true);
    config.server.admin_token_env = Some("REPRISE_TEST_FILTER_FENCE_TOKEN".into());
    let script = ScriptConfig {
        first_token_delay: std::time::Duration::from_millis(800),
        ..ScriptConfig::default()
    };
    let (app, _backend) = spawn_fake(config, script).await;
    let ask = |key: &'static str, cache: Option<&'static str>| {
        let app = &app;
        async move {
            let key = bearer(key);
            let mut h = vec![("authorization", key.as_str())];
            if let Some(c) = cache {
                h.push(("cache-control", c));
            }
            cache_status(&app.chat(&chat_body("What does the plan cost?"), &h).await)
        }
    };
    let delete = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let r = app
            .client
            .delete(app.url("/admin/entries?tenant=acme"))
            .bearer_auth("fence-admin")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.json::<Value>().await.unwrap()["deleted"]
            .as_u64()
            .unwrap()
    };
    let (acme, beta, deleted) = tokio::join!(ask("sk-acme", None), ask("sk-beta", None), delete);
    assert_eq!((acme.as_str(), beta.as_str()), ("miss", "miss"));
    assert_eq!(deleted, 0, "nothing was stored yet");
    // Only if cached: an error where nothing is stored.
    assert_eq!(ask("sk-acme", Some("only-if-cached")).await, "error");
    assert_eq!(ask("sk-beta", Some("only-if-cached")).await, "exact");
    // The fence holds back only what was on its way: a question asked after it is stored.
    assert_eq!(ask("sk-acme", None).await, "miss");
    let stored = eventually_async(std::time::Duration::from_secs(10), || async {
        ask("sk-acme", Some("only-if-cached")).await == "exact"
    });
    assert!(stored.await);
}

/// A tenant flooding the memory tier with distinct prompts evicts only its own entries: the
/// others' answers stay in memory (and keep being exact hits) beyond its share.
#[tokio::test]
async fn a_tenants_flood_leaves_the_others_entries_in_memory() {
    let share = |s: f64| TenantPolicy {
        memory_share: Some(s),
        ..TenantPolicy::default()
    };
    let mut c = test_config();
    c.auth.required = true;
    // Room in the keeping tenant's eighth for keys: each costs its tier item and its record.
    c.cache.memory_bytes = 128 * 1024;
    c.tenants = vec![
        with_policy("keep", "sk-keep", share(0.5)),
        with_policy("flood", "sk-flood", share(0.25)),
        tenant("free", "sk-free", true),
    ];
    let (app, backend) = spawn_fake(c, ScriptConfig::default()).await;
    let kept: Vec<Value> = (0..5)
        .map(|i| chat_body(&format!("keep question {i}")))
        .collect();
    for b in &kept {
        assert_eq!(cache_status(&ask(&app, "keep", b, &[]).await), "miss");
    }
    let free = chat_body("a question of the tenants without a share");
    assert_eq!(cache_status(&ask(&app, "free", &free, &[]).await), "miss");
    // Many times what a quarter of 128 KiB holds.
    for i in 0..200 {
        let b = chat_body(&format!(
            "flood question number {i} with some padding words"
        ));
        assert_eq!(cache_status(&ask(&app, "flood", &b, &[]).await), "miss");
    }
    app.state.store.run_pending_tasks().await;
    let flood = app.state.store.pool_size("flood\u{1f}x").unwrap();
    assert!(flood > 0 && flood <= 32 * 1024, "{flood}");
    let calls = backend.calls();
    for b in &kept {
        assert_eq!(cache_status(&ask(&app, "keep", b, &[]).await), "exact");
    }
    assert_eq!(cache_status(&ask(&app, "free", &free, &[]).await), "exact");
    assert_eq!(
        backend.calls(),
        calls,
        "no answer of theirs was generated again"
    );
    // The flood's oldest answers are the ones that went.
    let first = chat_body("flood question number 0 with some padding words");
    assert_eq!(cache_status(&ask(&app, "flood", &first, &[]).await), "miss");
}

/// `x-reprise-priority` picks the scheduling class within the tenant's cap: a tenant capped at
/// batch is served as batch whatever it asks, its default is the cap, and an unknown value is
/// refused before the backend is asked.
#[tokio::test]
async fn a_tenant_capped_at_batch_is_served_as_batch_whatever_it_asks() {
    use reprise::config::UserPriority;
    use reprise_backend::Priority;
    let (app, backend) = policy_app(
        vec![
            (
                "bulk",
                TenantPolicy {
                    max_priority: UserPriority::Batch,
                    ..TenantPolicy::default()
                },
            ),
            (
                "nightly",
                TenantPolicy {
                    priority: Some(UserPriority::Batch),
                    ..TenantPolicy::default()
                },
            ),
        ],
        false,
    )
    .await;
    let last = || backend.requests().pop().expect("a request").priority;
    let asks = [
        ("bulk", "interactive", Priority::Batch),
        ("bulk", "", Priority::Batch),
        ("nightly", "", Priority::Batch),
        ("nightly", "interactive", Priority::Interactive),
        ("free", "", Priority::Interactive),
        ("free", " Batch ", Priority::Batch),
    ];
    for (i, (tenant, asked, served)) in asks.into_iter().enumerate() {
        let body = chat_body(&format!("question {i}"));
        let headers: Vec<(&str, &str)> = if asked.is_empty() {
            vec![]
        } else {
            vec![("x-reprise-priority", asked)]
        };
        let r = ask(&app, tenant, &body, &headers).await;
        assert_eq!(r.status(), 200, "{tenant} {asked:?}");
        assert_eq!(last(), served, "{tenant} asking {asked:?}");
    }
    let calls = backend.calls();
    for bad in ["background", "urgent", ""] {
        let r = ask(
            &app,
            "free",
            &chat_body("never asked"),
            &[("x-reprise-priority", bad)],
        )
        .await;
        assert_openai_error(r, 400, Some("x-reprise-priority")).await;
    }
    assert_eq!(backend.calls(), calls, "refused before the backend");
}

#[test]
fn a_tenants_default_priority_above_its_cap_is_refused() {
    use reprise::config::UserPriority;
    let mut c = test_config();
    c.tenants = vec![with_policy(
        "odd",
        "sk-odd",
        TenantPolicy {
            priority: Some(UserPriority::Interactive),
            max_priority: UserPriority::Batch,
            ..TenantPolicy::default()
        },
    )];
    let err = c.validate().unwrap_err().to_string();
    assert!(err.contains("tenants.policy.priority"), "{err}");
}

#[tokio::test]
async fn a_request_only_an_upstream_can_answer_is_refused_before_it_spends_the_budget() {
    let budget = TenantPolicy {
        tokens_per_minute: 300,
        ..TenantPolicy::default()
    };
    // A scripted backend: it answers text, forwards nothing.
    let (app, backend) = policy_app(vec![("metered", budget)], false).await;
    let mut tools = chat_body("what is the weather");
    tools["tools"] = serde_json::json!([{"type": "function", "function": {"name": "weather"}}]);
    tools["max_tokens"] = 250.into();
    let r = ask(&app, "metered", &tools, &[]).await;
    assert_openai_error(r, 400, Some("tools")).await;
    // The whole minute's budget is still there.
    let mut plain = chat_body("a question");
    plain["max_tokens"] = 300.into();
    assert_eq!(
        cache_status(&ask(&app, "metered", &plain, &[]).await),
        "miss"
    );
    assert_eq!(backend.calls(), 1);
}

#[tokio::test]
async fn requests_that_follow_a_running_generation_are_not_charged_for_it() {
    let budget = TenantPolicy {
        tokens_per_minute: 300,
        ..TenantPolicy::default()
    };
    let (app, backend) = policy_app(vec![("metered", budget)], false).await;
    // A slow answer, so the others arrive while it is generated.
    backend.set_token_delay(std::time::Duration::from_millis(300));
    let mut body = chat_body("one question asked by many at once");
    body["max_tokens"] = 250.into();
    let leader = {
        let (client, url, body) = (app.client.clone(), app.chat_url(), body.clone());
        tokio::spawn(async move {
            client
                .post(url)
                .header("authorization", "Bearer sk-metered")
                .json(&body)
                .send()
                .await
                .unwrap()
        })
    };
    assert!(eventually(std::time::Duration::from_secs(30), || backend.active() == 1).await);
    // The budget holds one such request a minute: the followers cost nothing.
    let followers = futures::future::join_all((0..5).map(|_| ask(&app, "metered", &body, &[])));
    for r in followers.await {
        assert_eq!(r.status(), 200);
    }
    assert_eq!(leader.await.unwrap().status(), 200);
    assert_eq!(backend.calls(), 1);
}

/// A tenant's admin makes at most its quota of changes a minute (429 with `Retry-After`
/// past it), reads stay open, and the global admin is not held to it.
#[tokio::test]
async fn a_tenants_admin_changes_are_rate_limited() {
    std::env::set_var("REPRISE_TEST_ACME_RATE_ADMIN_TOKEN", "acme-rate-admin");
    std::env::set_var("REPRISE_TEST_GLOBAL_RATE_ADMIN_TOKEN", "global-rate-admin");
    let mut config = tenants_config(true);
    config.server.admin_token_env = Some("REPRISE_TEST_GLOBAL_RATE_ADMIN_TOKEN".into());
    config.tenants[0].admin_token_env = Some("REPRISE_TEST_ACME_RATE_ADMIN_TOKEN".into());
    let (app, _backend) = spawn_fake(config, ScriptConfig::default()).await;
    let delete = |token: &'static str| {
        let path = format!("/admin/entries/{}", reprise_cache::EntryId::random());
        let req = app.client.delete(app.url(&path)).bearer_auth(token);
        async move { req.send().await.unwrap() }
    };
    let quota = reprise::admin::TENANT_CHANGES_PER_MINUTE as usize;
    let mut refused = None;
    for _ in 0..quota + 20 {
        let r = delete("acme-rate-admin").await;
        if r.status() == 429 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status(), 200);
    }
    let r = refused.expect("refused past the quota");
    assert!(r.headers().contains_key("retry-after"));
    assert_openai_error(r, 429, None).await;
    let read = app
        .client
        .get(app.url("/admin/stats"))
        .bearer_auth("acme-rate-admin")
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200, "reads are not changes");
    assert_eq!(delete("global-rate-admin").await.status(), 200);
}
