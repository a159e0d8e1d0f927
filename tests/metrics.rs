//! What analysts read, checked against what happened: the request metrics by tenant and
//! model, what hits saved (tokens, backend seconds, cost), gate rejections and near misses,
//! request ids in the log, and the exposition as Prometheus's own `promtool` reads it.
//!
//! The metrics recorder is process-wide, so every test here uses a tenant of its own and
//! asserts only on series labelled with it (or on differences).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use reprise::config::{Price, TenantConfig};
use reprise::harness::RedisServer;
use reprise::Config;
use reprise_backend::fake::ScriptConfig;
use serde_json::Value;

/// A config with one tenant, a price for the scripted model and a request log.
fn config(tenant_name: &str, key: &str, log: &Path) -> Config {
    let mut c = test_config();
    c.tenants = vec![TenantConfig::with_key(tenant_name, key)];
    c.metrics.prices.insert(
        "fake".into(),
        Price {
            prompt_per_million: 1000.0,
            completion_per_million: 3000.0,
        },
    );
    c.log.request_log = Some(log.to_path_buf());
    c
}

async fn wait_for_lines(path: &Path, n: usize) -> Vec<Value> {
    assert!(
        eventually(Duration::from_secs(10), || log_lines(path).len() >= n).await,
        "{} log lines, wanted {n}",
        log_lines(path).len()
    );
    log_lines(path)
}

#[tokio::test]
async fn a_mix_of_hits_and_misses_adds_up_to_what_hits_saved() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let script = ScriptConfig {
        token_delay: Duration::from_millis(5),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config("mix", "sk-mix", &log), script).await;
    let key = [("authorization", "Bearer sk-mix")];
    let mut usage = Vec::new();
    for (q, repeats) in [
        ("How long is the warranty?", 2),
        ("Where is my parcel now?", 1),
    ] {
        let r = app.chat(&chat_body(q), &key).await;
        assert_eq!(cache_status(&r), "miss");
        let j: Value = r.json().await.unwrap();
        let u = &j["usage"];
        let (p, c) = (
            u["prompt_tokens"].as_u64().unwrap(),
            u["completion_tokens"].as_u64().unwrap(),
        );
        assert!(p > 0 && c > 0, "{j}");
        usage.push((p, c, repeats));
        for _ in 0..repeats {
            let r = app.chat(&chat_body(q), &key).await;
            assert_eq!(cache_status(&r), "exact");
        }
    }
    assert_eq!(backend.calls(), 2);
    let lines = wait_for_lines(&log, 5).await;
    let text = app.metrics_text().await;
    let mine =
        |outcome: &'static str| vec![("outcome", outcome), ("tenant", "mix"), ("model", "fake")];
    assert_eq!(
        sample(&text, "reprise_requests_total", &mine("exact")),
        Some(3.0)
    );
    assert_eq!(
        sample(&text, "reprise_requests_total", &mine("miss")),
        Some(2.0)
    );
    assert_eq!(
        sample(
            &text,
            "reprise_time_to_first_token_seconds_count",
            &mine("exact")
        ),
        Some(3.0)
    );
    let prompt: u64 = usage.iter().map(|(p, _, n)| p * n).sum();
    let completion: u64 = usage.iter().map(|(_, c, n)| c * n).sum();
    let tm = [("tenant", "mix"), ("model", "fake")];
    let kind = |k| [("tenant", "mix"), ("model", "fake"), ("kind", k)];
    assert_eq!(
        sample(&text, "reprise_saved_tokens_total", &kind("prompt")),
        Some(prompt as f64)
    );
    assert_eq!(
        sample(&text, "reprise_saved_tokens_total", &kind("completion")),
        Some(completion as f64)
    );
    let cost = sample(&text, "reprise_saved_cost", &tm).unwrap();
    let want = (prompt as f64 * 1000.0 + completion as f64 * 3000.0) / 1e6;
    assert!((cost - want).abs() < 1e-9, "{cost} vs {want}");
    // Backend seconds saved: each hit saves its entry's recorded generation time, which took
    // at least a token delay per streamed token after the first.
    let hits: Vec<_> = lines.iter().filter(|l| l["outcome"] == "exact").collect();
    assert_eq!(hits.len(), 3);
    let mut saved_ms = 0.0;
    for h in &hits {
        let ms = h["saved_backend_ms"].as_f64().unwrap();
        let tokens = h["saved_completion_tokens"].as_f64().unwrap();
        assert!(ms >= 5.0 * (tokens - 1.0), "{h}");
        saved_ms += ms;
        assert_eq!(h["tier"], "memory");
        assert!(h["ttft_ms"].as_f64().is_some());
    }
    let seconds = sample(&text, "reprise_saved_backend_seconds", &tm).unwrap();
    assert!((seconds - saved_ms / 1000.0).abs() < 1e-6, "{seconds}");
    // Misses save nothing; every line names its request, its response and its question.
    for l in &lines {
        assert!(!l["request_id"].as_str().unwrap().is_empty(), "{l}");
        assert!(l["id"].as_str().unwrap().starts_with("chatcmpl-"), "{l}");
        assert_eq!(l["model"], "fake");
        assert_eq!(l["tenant"], "mix");
        assert!(l["question"].as_str().unwrap().ends_with('?'), "{l}");
        if l["outcome"] == "miss" {
            assert!(l.get("saved_prompt_tokens").is_none(), "{l}");
        }
    }
}

#[tokio::test]
async fn request_ids_are_kept_when_sane_and_made_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let (app, _) = spawn_fake(config("ids", "sk-ids", &log), ScriptConfig::default()).await;
    let body = chat_body("What time is it in Oslo?");
    let r = app
        .chat(
            &body,
            &[
                ("authorization", "Bearer sk-ids"),
                ("x-request-id", "trace-me-42"),
            ],
        )
        .await;
    assert_eq!(r.headers()["x-request-id"], "trace-me-42");
    let long = "x".repeat(500);
    let r = app
        .chat(
            &body,
            &[("authorization", "Bearer sk-ids"), ("x-request-id", &long)],
        )
        .await;
    let made = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_ne!(made, long);
    assert_eq!(made.len(), 36, "a UUID: {made}");
    // Errors carry one too.
    let bad = serde_json::json!({"model": "fake", "messages": "not a list"});
    let r = app.chat(&bad, &[("authorization", "Bearer sk-ids")]).await;
    assert_eq!(r.status(), 400);
    assert!(r.headers().contains_key("x-request-id"));
    let lines = wait_for_lines(&log, 2).await;
    assert_eq!(lines[0]["request_id"], "trace-me-42");
    assert_eq!(lines[1]["request_id"], made.as_str());
}

#[tokio::test]
async fn hits_by_meaning_record_their_pair_and_rejections_their_reason() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut c = config("sem", "sk-sem", &log);
    c.semantic.enabled = true;
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    let key = [("authorization", "Bearer sk-sem")];
    let rejections_before = app.metrics_text().await;
    let asked = [
        "How do I enable two-factor authentication?",
        "How can I turn on two-factor authentication?",
        "How do I disable two-factor authentication?",
    ];
    let mut statuses = Vec::new();
    for q in asked {
        statuses.push(cache_status(&app.chat(&chat_body(q), &key).await));
    }
    assert_eq!(statuses, ["miss", "semantic", "miss"]);
    let lines = wait_for_lines(&log, 3).await;
    // The hit by meaning: what it saved, and the pair an auditor reads.
    let hit = &lines[1];
    assert_eq!(hit["matched"], asked[0]);
    assert_eq!(hit["question"], asked[1]);
    assert!(hit["saved_completion_tokens"].as_u64().unwrap() > 0);
    // The rejected near duplicate: counted under its reason, and its similarity kept as a
    // near miss.
    let reason = lines[2]["gate"].as_str().unwrap();
    assert_ne!(reason, "pass");
    let text = app.metrics_text().await;
    let count =
        |t: &str| sample(t, "reprise_gate_rejections_total", &[("reason", reason)]).unwrap_or(0.0);
    assert!(count(&text) >= count(&rejections_before) + 1.0);
    let sem = [("tenant", "sem")];
    assert_eq!(
        sample(&text, "reprise_miss_similarity_count", &sem),
        Some(1.0)
    );
    let sum = sample(&text, "reprise_miss_similarity_sum", &sem).unwrap();
    let logged = lines[2]["similarity"].as_f64().unwrap();
    assert!((sum - logged).abs() < 1e-3, "{sum} vs {logged}");
    // Buckets reach below 0.5, where most misses' best similarity is (else a quantile there
    // is only interpolated).
    let low = [("tenant", "sem"), ("le", "0.3")];
    assert!(sample(&text, "reprise_miss_similarity_bucket", &low).is_some());
    for stage in ["exact", "embed", "search", "first_token"] {
        let n = sample(
            &text,
            "reprise_stage_duration_seconds_count",
            &[("stage", stage)],
        );
        assert!(n.is_some_and(|n| n >= 1.0), "stage {stage}");
    }
}

/// Prometheus's `promtool` (Debian's `prometheus` package; `scripts/setup.sh` installs it):
/// `PROMTOOL` or on the PATH.
pub fn promtool() -> PathBuf {
    let path = std::env::var_os("PROMTOOL")
        .map(PathBuf::from)
        .unwrap_or_else(|| "promtool".into());
    let found = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "promtool not found: run scripts/setup.sh (it installs Debian's prometheus package) \
         or set PROMTOOL"
    );
    path
}

/// Runs `promtool` with `args` in `dir`, feeding it `input`; panics with its output when it
/// fails.
fn run_promtool(args: &[&str], dir: &Path, input: &str) {
    use std::io::Write;
    let mut child = std::process::Command::new(promtool())
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The `reprise_*` metric names a PromQL text uses (histogram suffixes stripped).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("reprise_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let name = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        // `reprise:...` recording rules and the dashboard's own uid are not metrics.
        if rest[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == ':') {
            rest = &tail[end..];
            continue;
        }
        names.insert(name.to_string());
        rest = &tail[end..];
    }
    names
}

#[tokio::test]
async fn the_exposition_the_alerts_and_the_grafana_dashboard_agree_and_pass_promtool() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let redis = RedisServer::start();
    let mut c = config("lint", "sk-lint", &log);
    c.semantic.enabled = true;
    // Learned thresholds, so their series are exposed (an alert and two panels read them).
    c.semantic.delta = 0.05;
    c.prefetch.enabled = true;
    c.redis.url = Some(redis.url());
    let app = spawn_replica(c, std::sync::Arc::new(scripted())).await;
    let key = [("authorization", "Bearer sk-lint")];
    for q in [
        "Is the shop open on Sundays?",
        "Is the shop open on Sundays?",
        "Is the store open on Sunday?",
        "Is the shop closed on Sundays?",
    ] {
        app.chat(&chat_body(q), &key).await;
    }
    app.chat(&chat_body("x"), &[("authorization", "Bearer wrong")])
        .await;
    let text = app.metrics_text().await;
    run_promtool(&["check", "metrics"], dir.path(), &text);
    // The index (set from the scraped replica's own on each scrape).
    let vectors = sample(&text, "reprise_semantic_index_vectors", &[]);
    assert!(vectors.is_some_and(|v| v >= 1.0), "{vectors:?}");
    for name in [
        "reprise_semantic_index_graphs",
        "reprise_semantic_graph_searches_total",
        "reprise_semantic_graph_filtered_searches_total",
        "reprise_semantic_index_search_width",
    ] {
        assert!(sample(&text, name, &[]).is_some(), "{name} not exposed");
    }
    for result in ["found", "missed"] {
        let checks = sample(
            &text,
            "reprise_semantic_recall_checks_total",
            &[("result", result)],
        );
        assert!(checks.is_some(), "recall checks {result} not exposed");
    }
    // Degraded answers: every kind has a series from the start (none was served here).
    for kind in [
        "stale_while_revalidate",
        "stale_if_error",
        "stale_under_load",
        "loose_threshold",
        "fallback",
    ] {
        let n = sample(&text, "reprise_degraded_total", &[("kind", kind)]);
        assert_eq!(n, Some(0.0), "reprise_degraded_total{{kind={kind}}}");
    }

    // The alert rules: valid, and each fires on the history written for it.
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let rules = deploy.join("prometheus");
    run_promtool(&["check", "rules", "alerts.yml"], &rules, "");
    run_promtool(&["test", "rules", "alerts_test.yml"], &rules, "");

    // Every metric the rules and the Grafana dashboard read is one reprise exposes.
    let exposed: std::collections::BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    let alerts = std::fs::read_to_string(rules.join("alerts.yml")).unwrap();
    let grafana = std::fs::read_to_string(deploy.join("grafana/reprise.json")).unwrap();
    let dashboard: Value = serde_json::from_str(&grafana).unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().clone())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 10, "{}", exprs.len());
    for (what, source) in [("alerts.yml", alerts), ("reprise.json", exprs.join("\n"))] {
        let used = metric_names(&source);
        assert!(!used.is_empty());
        let missing: Vec<_> = used.difference(&exposed).collect();
        assert!(missing.is_empty(), "{what} reads {missing:?}, not exposed");
    }
}

/// `/metrics` names tenants and what they ask: once tenants are configured it answers only
/// the metrics token or the admin token, never a tenant's API key or an anonymous scrape,
/// and with neither token set it is closed to all. A server without tenants or a metrics
/// token stays open, as scrapers expect.
#[tokio::test]
async fn metrics_need_the_scrape_or_admin_token_once_tenants_exist() {
    const ADMIN_VAR: &str = "REPRISE_TEST_SCRAPE_ADMIN_TOKEN";
    std::env::set_var(ADMIN_VAR, "scrape-admin");
    let dir = tempfile::tempdir().unwrap();
    let status = |app: &TestApp, token: Option<&'static str>| {
        let mut req = app.client.get(app.url("/metrics"));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move { req.send().await.unwrap().status().as_u16() }
    };
    let mut c = config("scrape", "sk-scrape", &dir.path().join("a.jsonl"));
    c.server.admin_token_env = Some(ADMIN_VAR.into());
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    assert_eq!(status(&app, None).await, 401);
    assert_eq!(status(&app, Some("sk-scrape")).await, 401, "a tenant's key");
    assert_eq!(
        status(&app, Some("test-scrape")).await,
        200,
        "the metrics token"
    );
    assert_eq!(
        status(&app, Some("scrape-admin")).await,
        200,
        "the admin token"
    );
    let r = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_openai_error(r, 401, None).await;
    // `/readyz` answers anybody, with its details (backends, Redis's write queue) only for
    // those who may scrape.
    let ready = |token: Option<&'static str>| {
        let mut req = app.client.get(app.url("/readyz"));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move {
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()
        }
    };
    for token in [None, Some("sk-scrape")] {
        let body = ready(token).await;
        assert_eq!(body, serde_json::json!({"status": "ready"}), "{token:?}");
    }
    let body = ready(Some("test-scrape")).await;
    assert_eq!(body["status"], "ready");
    assert!(body["backends"].is_object(), "{body}");

    // Tenants and no token set: nobody.
    let mut c = config("scrape-closed", "sk-closed", &dir.path().join("b.jsonl"));
    c.server.metrics_token_env = None;
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    assert_eq!(status(&app, None).await, 401);
    assert_eq!(status(&app, Some("sk-closed")).await, 401);

    // No tenants, no metrics token: open.
    let mut c = test_config();
    c.server.metrics_token_env = None;
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    assert_eq!(status(&app, None).await, 200);
}

#[tokio::test]
async fn deletes_are_not_counted_as_evictions() {
    const ADMIN_VAR: &str = "REPRISE_TEST_EVICTIONS_ADMIN_TOKEN";
    std::env::set_var(ADMIN_VAR, "evict-admin");
    let mut c = test_config();
    c.server.admin_token_env = Some(ADMIN_VAR.into());
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    for q in ["First question?", "Second question?", "Third question?"] {
        let r = app.chat(&chat_body(q), &[]).await;
        assert_eq!(cache_status(&r), "miss");
        content(r).await;
    }
    // Answers are written once generated, which may be after the response is sent.
    let store = &app.state.store;
    assert!(
        eventually_async(Duration::from_secs(10), || async {
            store.run_pending_tasks().await;
            store.entry_count() == 3
        })
        .await
    );
    let evictions = |m: &str| sample(m, "reprise_cache_evictions_total", &[]).unwrap_or(0.0);
    let before = evictions(&app.metrics_text().await);
    let r = app
        .client
        .delete(app.url("/admin/entries?older_than_secs=0"))
        .bearer_auth("evict-admin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["deleted"], 3);
    app.state.store.run_pending_tasks().await;
    assert_eq!(
        cache_status(&app.chat(&chat_body("First question?"), &[]).await),
        "miss"
    );
    assert_eq!(evictions(&app.metrics_text().await), before);
}

/// A request log that cannot be written loses lines, and says how many.
#[tokio::test]
async fn request_log_lines_that_cannot_be_written_are_counted() {
    let full = Path::new("/dev/full");
    if !full.exists() {
        eprintln!("skipped: no /dev/full here");
        return;
    }
    let mut c = test_config();
    c.log.request_log = Some(full.to_path_buf());
    let (app, _) = spawn_fake(c, ScriptConfig::default()).await;
    let dropped = |m: &str| {
        sample(m, "reprise_request_log_dropped_total", &[("why", "write")]).unwrap_or(0.0)
    };
    let before = dropped(&app.metrics_text().await);
    for q in ["Is the log full?", "Is it still full?"] {
        content(app.chat(&chat_body(q), &[]).await).await;
    }
    let mut now = before;
    for _ in 0..100 {
        now = dropped(&app.metrics_text().await);
        if now >= before + 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(now >= before + 2.0, "{before} → {now}");
}
