//! Thresholds per entry under an error bound (`semantic.delta`), over real HTTP with the real
//! ONNX embedder: an entry's own verdicts raise or lower the threshold it is served at,
//! while the other entries of its scope keep the scope's.
//!
//! Similarities with the bundled MiniLM (measured): "How do I reset my password?" against
//! "What are the steps to reset my password?" 0.946, "I forgot my password, how can I change
//! it?" 0.894 (0.836 between those two, outside a refusal's radius of 0.9); "How do I cancel my
//! subscription?" against "How do I end my subscription?" 0.884.

mod common;

use common::*;
use reprise::bounds::Source;
use reprise::Config;
use reprise_cache::EntryId;
use serde_json::{json, Value};

const PASSWORD: &str = "How do I reset my password?";
const STEPS: &str = "What are the steps to reset my password?";
const FORGOT: &str = "I forgot my password, how can I change it?";
const CANCEL: &str = "How do I cancel my subscription?";
const END: &str = "How do I end my subscription?";

fn bounded(delta: f64, threshold: f32) -> Config {
    let mut c = test_config();
    c.semantic.enabled = true;
    c.semantic.delta = delta;
    c.semantic.threshold = threshold;
    c.semantic.min_threshold = 0.5;
    // Only the verdicts the test gives.
    c.semantic.verify_near_misses = 0.0;
    c
}

/// Stores `text`'s answer (a miss) and returns its entry.
async fn stored(app: &TestApp, text: &str) -> EntryId {
    let r = app.chat(&chat_body(text), &[]).await;
    assert_eq!(cache_status(&r), "miss", "{text}");
    header(&r, "x-reprise-entry").unwrap().parse().unwrap()
}

/// Verdicts on `entry` in the running scope, as feedback or a near-miss check records them.
fn record(app: &TestApp, entry: Option<EntryId>, similarity: f32, wrong: bool, n: usize) {
    for _ in 0..n {
        let source = Source::NearMiss;
        app.state
            .bounds
            .record(&app.state, "", "*/*", entry, similarity, wrong, source);
    }
}

/// A hit reported wrong raises its entry's own threshold above the similarity it was served
/// at, for every wording of that entry's question (not only those around the one reported),
/// while the scope, whose verdicts are mostly right, keeps serving the other entries at its
/// own threshold.
#[tokio::test]
async fn a_wrong_verdict_raises_the_entry_it_judged_alone() {
    let (app, _backend) = spawn_fake(bounded(0.05, 0.86), Default::default()).await;
    let password = stored(&app, PASSWORD).await;
    stored(&app, CANCEL).await;
    // The scope's evidence: many right verdicts on other entries' hits.
    record(&app, None, 0.97, false, 60);
    let r = app.chat(&chat_body(STEPS), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let sim = similarity(&r);
    let id = r.json::<Value>().await.unwrap()["id"].clone();
    let r = feedback(&app, json!({"id": id, "verdict": "wrong"}), None).await;
    assert_eq!(r.status(), 200);
    let scope = app.state.bounds.threshold("", "*/*", 0.05, 0.86, 0.5);
    assert_eq!(
        scope.threshold, 0.86,
        "the scope keeps its threshold: {scope:?}"
    );
    let own = app
        .state
        .bounds
        .entry_threshold(password, 0.05, 0.86, 0.5)
        .expect("the entry has a verdict of its own");
    assert!(own.threshold > sim, "{own:?} vs {sim}");

    // Another wording of the same question, far from the one reported (no refusal holds
    // it), above the scope's threshold: not served that entry any more.
    let r = app.chat(&chat_body(FORGOT), &[]).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "served under the entry's raised threshold"
    );
    // Another entry at a like similarity is served at the scope's threshold.
    let r = app.chat(&chat_body(END), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert!(similarity(&r) < own.threshold);

    let m = app.metrics_text().await;
    let raised = sample(
        &m,
        "reprise_semantic_entry_thresholds_total",
        &[("tenant", "anonymous"), ("effect", "raised")],
    );
    assert!(raised.is_some_and(|n| n >= 1.0), "{m}");
    let held = sample(&m, "reprise_semantic_entries_with_evidence", &[]);
    assert_eq!(held, Some(1.0), "{m}");
}

/// Right verdicts on an entry's near misses, enough to certify the band, let that entry
/// serve under its scope's threshold; an entry whose near misses were wrong does not, and
/// neither does the scope, whose verdicts are half wrong. The request log names the
/// threshold that admitted the hit.
#[tokio::test]
async fn an_entrys_own_right_verdicts_open_a_band_for_it_alone() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut config = bounded(0.3, 0.97);
    config.log.request_log = Some(log.clone());
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    let password = stored(&app, PASSWORD).await;
    let cancel = stored(&app, CANCEL).await;
    // Not yet: both entries follow the scope.
    assert_eq!(
        cache_status(&app.chat(&chat_body(FORGOT), &[]).await),
        "miss"
    );
    record(&app, Some(password), 0.85, false, 40);
    record(&app, Some(cancel), 0.85, true, 40);
    let scope = app.state.bounds.threshold("", "*/*", 0.3, 0.97, 0.5);
    assert_eq!(scope.threshold, 0.97, "{scope:?}");
    let own = |id| {
        app.state
            .bounds
            .entry_threshold(id, 0.3, 0.97, 0.5)
            .unwrap()
    };
    let loosened = own(password);
    assert!(
        loosened.learned && loosened.threshold <= 0.85,
        "{loosened:?}"
    );
    assert!(loosened.wrong_upper <= 0.3, "{loosened:?}");
    assert_eq!(own(cancel).threshold, 0.97);

    // A new wording (its answer stored above was under another key) of the entry's
    // question under the scope's threshold: served by the entry.
    let asked = "Can you help me reset my password?";
    let r = app.chat(&chat_body(asked), &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let sim = similarity(&r);
    assert!(sim < 0.97 && sim >= loosened.threshold, "{sim}");
    assert_eq!(content(r).await, format!("You asked: {PASSWORD}"));
    // The other entry is not.
    assert_eq!(cache_status(&app.chat(&chat_body(END), &[]).await), "miss");
    // A client's own threshold still only raises.
    let strict = [("x-reprise-threshold", "0.95")];
    let other = "How do I recover my password?";
    assert_eq!(
        cache_status(&app.chat(&chat_body(other), &strict).await),
        "miss"
    );

    let m = app.metrics_text().await;
    let effect = |e| {
        sample(
            &m,
            "reprise_semantic_entry_thresholds_total",
            &[("tenant", "anonymous"), ("effect", e)],
        )
    };
    assert!(effect("loosened").is_some_and(|n| n >= 1.0), "{m}");
    let semantic = || {
        log_lines(&log)
            .into_iter()
            .find(|l| l["outcome"] == "semantic")
    };
    let logged = eventually(std::time::Duration::from_secs(5), || semantic().is_some());
    assert!(logged.await, "the hit's line");
    let hit = semantic().unwrap();
    let threshold = hit["threshold"].as_f64().unwrap();
    assert!(
        (threshold - f64::from(loosened.threshold)).abs() < 1e-6,
        "{hit}"
    );
}

/// The verdicts of near misses checked over HTTP reach their candidate's own evidence.
#[tokio::test]
async fn checked_near_misses_are_evidence_of_their_candidate() {
    let mut config = bounded(0.05, 0.97);
    config.semantic.verify_near_misses = 1.0;
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    let password = stored(&app, PASSWORD).await;
    assert_eq!(app.state.bounds.entries_with_evidence(), 0);
    assert_eq!(
        cache_status(&app.chat(&chat_body(FORGOT), &[]).await),
        "miss"
    );
    let state = app.state.clone();
    let judged = eventually(std::time::Duration::from_secs(10), || {
        state
            .bounds
            .entry_threshold(password, 0.05, 0.97, 0.5)
            .is_some()
    })
    .await;
    assert!(judged, "no evidence of the near miss's candidate");
}

/// Candidates are each judged at their own threshold: a closer one without verdicts of its
/// own, under the scope's threshold, does not keep a farther one whose entry's own threshold
/// admits it from being served. The metric names the tenant.
#[tokio::test]
async fn a_closer_candidate_under_the_scope_threshold_does_not_hide_a_loosened_one() {
    let mut config = bounded(0.3, 0.97);
    config.auth.required = true;
    config.tenants = vec![reprise::config::TenantConfig {
        name: "acme".into(),
        api_keys: vec!["sk-acme".into()],
        api_keys_env: None,
        api_keys_file: None,
        sub_namespaces: false,
        admin_token_env: None,
        candidate: None,
        policy: Default::default(),
    }];
    let (app, _backend) = spawn_fake(config, Default::default()).await;
    let key = [("authorization", "Bearer sk-acme")];
    let ask = |text: &'static str| {
        let app = &app;
        async move { app.chat(&chat_body(text), &key).await }
    };
    let entry = |r: &reqwest::Response| -> EntryId {
        header(r, "x-reprise-entry").unwrap().parse().unwrap()
    };
    let r = ask(PASSWORD).await;
    assert_eq!(cache_status(&r), "miss");
    let r = ask(FORGOT).await;
    assert_eq!(cache_status(&r), "miss");
    let forgot = entry(&r);
    let r = ask(CANCEL).await;
    assert_eq!(cache_status(&r), "miss");
    let cancel = entry(&r);
    for (id, wrong) in [(forgot, false), (cancel, true)] {
        for _ in 0..40 {
            let source = Source::NearMiss;
            app.state
                .bounds
                .record(&app.state, "acme", "*/*", Some(id), 0.80, wrong, source);
        }
    }
    let scope = app.state.bounds.threshold("acme", "*/*", 0.3, 0.97, 0.5);
    assert_eq!(scope.threshold, 0.97, "{scope:?}");
    // Closest to the first question (0.946, no verdicts of its own: 0.97), then to the
    // second (0.836, its own threshold 0.80).
    let r = ask(STEPS).await;
    assert_eq!(cache_status(&r), "semantic");
    assert!(similarity(&r) < 0.9, "served by the farther candidate");
    assert_eq!(content(r).await, format!("You asked: {FORGOT}"));
    let m = app.metrics_text().await;
    let loosened = sample(
        &m,
        "reprise_semantic_entry_thresholds_total",
        &[("tenant", "acme"), ("effect", "loosened")],
    );
    assert!(loosened.is_some_and(|n| n >= 1.0), "{m}");
}
