//! Degradation when the SLO is at risk (`[degrade]`): once the backend's recent service
//! times say a request would wait past its route's SLO, it is answered by a cached
//! paraphrase at a looser threshold (the gate still on), an expired entry, the route's
//! fallback, or a 429 with `Retry-After`, in the configured order, each labelled; background
//! work is shed. The same requests on an idle backend are ordinary misses.
//!
//! The scripted primary has one slot and answers after a fixed first-token delay, which
//! teaches the prediction its service time; a slow streaming request then holds the slot.
//! The tests assert which answer comes and how it is labelled, never how long it took.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use reprise::config::{BackendConfig, BackendKind, DegradeStep, RouteConfig};
use reprise::Config;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::Backend;
use serde_json::{json, Value};

const SMALL: &str = "small-model";
const LARGE: &str = "large-model";
/// What the request holding the primary's slot asks.
const HOLDER_PROMPT: &str = "Tell me a long story that holds the slot.";
/// The primary's service time while it teaches the prediction.
const SERVICE: Duration = Duration::from_millis(600);

fn config(order: &[DegradeStep]) -> Config {
    let mut c = test_config();
    let table = |name: &str| BackendConfig {
        name: name.into(),
        kind: BackendKind::Fake,
        ..BackendConfig::default()
    };
    c.backends = vec![table("small"), table("large")];
    c.routes = vec![toml::from_str::<RouteConfig>(
        "model = \"auto\"\nbackend = \"small\"\nfallback = \"large\"",
    )
    .unwrap()];
    // An idle primary meets it (one service time); one request ahead breaks it.
    c.slo.ttft_secs = 1.0;
    c.slo.total_secs = 1.0;
    c.degrade.enabled = true;
    c.degrade.order = order.to_vec();
    c
}

struct Rig {
    app: TestApp,
    small: ScriptedBackend,
    large: ScriptedBackend,
    holders: Vec<tokio::task::JoinHandle<reqwest::Response>>,
}

async fn rig(c: Config) -> Rig {
    c.validate().expect("valid");
    let script = |model: &str, slots| {
        ScriptedBackend::new(ScriptConfig {
            model: model.into(),
            reply: format!("{model} says: {{prompt}}"),
            first_token_delay: SERVICE,
            slots,
            max_queue: slots.map(|_| 16),
            ..ScriptConfig::default()
        })
    };
    let (small, large) = (script(SMALL, Some(1)), script(LARGE, None));
    let backends: Vec<(&str, Arc<dyn Backend>)> = vec![
        ("small", Arc::new(small.clone())),
        ("large", Arc::new(large.clone())),
    ];
    let app = spawn_routed(c, backends).await;
    Rig {
        app,
        small,
        large,
        holders: Vec::new(),
    }
}

impl Rig {
    /// Teaches the prediction the primary's service time (a miss on an idle backend).
    async fn teach(&self) {
        let r = self
            .app
            .chat(&chat_for("auto", "A question to learn from"), &[])
            .await;
        assert_eq!(r.status(), 200);
        assert!(header(&r, "x-reprise-degraded").is_none());
    }

    /// A slow streamed request holds the primary's only slot.
    async fn hold(&mut self) {
        self.small.set_token_delay(Duration::from_millis(400));
        let mut body = chat_for("auto", HOLDER_PROMPT);
        body["stream"] = json!(true);
        let (client, url) = (self.app.client.clone(), self.app.chat_url());
        self.holders.push(tokio::spawn(async move {
            client.post(url).json(&body).send().await.unwrap()
        }));
        assert!(eventually(Duration::from_secs(30), || self.small.active() == 1).await);
    }

    /// The holders finish.
    async fn release(&mut self) {
        self.small.set_token_delay(Duration::ZERO);
        for h in self.holders.drain(..) {
            let r = h.await.unwrap();
            assert_eq!(r.status(), 200);
            r.text().await.unwrap();
        }
        assert!(eventually(Duration::from_secs(30), || self.small.active() == 0).await);
    }
}

async fn model_of(r: reqwest::Response) -> String {
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    v["model"].as_str().unwrap().to_string()
}

/// `reprise_slo_at_risk_total{action}` in `app`'s exposition.
async fn at_risk(app: &TestApp, action: &str) -> f64 {
    let line = format!("reprise_slo_at_risk_total{{action=\"{action}\"}} ");
    app.metrics_text()
        .await
        .lines()
        .find_map(|l| l.strip_prefix(&line).map(|v| v.parse().unwrap()))
        .unwrap_or(0.0)
}

/// With the primary idle a new question is an ordinary miss; with its slot held, the next
/// one goes to the fallback (marked), a model without a fallback route is refused with
/// `Retry-After`, and background work is shed.
#[tokio::test]
async fn a_wait_past_the_slo_degrades_to_the_fallback_then_refuses() {
    let mut rig = rig(config(&[DegradeStep::Fallback, DegradeStep::Refuse])).await;
    rig.teach().await;
    let r = rig
        .app
        .chat(&chat_for("auto", "Asked while idle"), &[])
        .await;
    assert!(
        header(&r, "x-reprise-degraded").is_none(),
        "idle: not degraded"
    );
    assert_eq!(model_of(r).await, SMALL);
    assert!(!rig.app.state.router.shedding());

    rig.hold().await;
    let fallbacks = at_risk(&rig.app, "fallback").await;
    let r = rig
        .app
        .chat(&chat_for("auto", "Asked while busy"), &[])
        .await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    assert_eq!(model_of(r).await, LARGE);
    assert_eq!(at_risk(&rig.app, "fallback").await, fallbacks + 1.0);
    assert!(rig.app.state.router.shedding(), "background work shed");

    // A fallback that is down is no way out: the next step (refused, with Retry-After).
    rig.large.set_ready(false);
    let r = rig
        .app
        .chat(&chat_for("auto", "Asked while both are out"), &[])
        .await;
    assert_openai_error(r, 429, None).await;
    rig.large.set_ready(true);

    // No route, no fallback: refused rather than queued behind the holder.
    let r = rig
        .app
        .chat(&chat_for(SMALL, "Straight to the busy model"), &[])
        .await;
    assert_eq!(r.status(), 429);
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1);
    assert_openai_error(r, 429, None).await;
    assert_eq!(rig.large.calls(), 1);
    rig.release().await;

    // Idle again: the refused question is an ordinary miss.
    let r = rig
        .app
        .chat(&chat_for(SMALL, "Straight to the busy model"), &[])
        .await;
    assert!(header(&r, "x-reprise-degraded").is_none());
    assert_eq!(model_of(r).await, SMALL);
}

/// A request for the question the busy primary is generating follows that generation: it
/// costs the backend nothing, so it is neither degraded nor refused.
#[tokio::test]
async fn a_request_following_a_running_generation_is_not_degraded() {
    let mut rig = rig(config(&[DegradeStep::Refuse])).await;
    rig.teach().await;
    rig.hold().await;
    // Refused (429) without following; followed, the holder's answer.
    let same = chat_for("auto", HOLDER_PROMPT);
    let r = rig.app.chat(&same, &[]).await;
    assert!(header(&r, "x-reprise-degraded").is_none());
    assert_eq!(model_of(r).await, SMALL);
    // The follower made no call of its own (background work may make others).
    let asked = |r: &reprise_backend::GenRequest| match &r.input {
        reprise_backend::Input::Chat(m) => m.iter().any(|m| m.content == HOLDER_PROMPT),
        reprise_backend::Input::Prompt(p) => p == HOLDER_PROMPT,
    };
    assert_eq!(rig.small.requests().iter().filter(|r| asked(r)).count(), 1);
    rig.release().await;
}

/// Without `[degrade]` the same busy moment only waits (the route's saturation fallback
/// aside): a model without a fallback is answered by the primary once the holder is done.
#[tokio::test]
async fn without_degradation_a_busy_backend_is_waited_for() {
    let mut c = config(&[DegradeStep::Refuse]);
    c.degrade.enabled = false;
    let mut rig = rig(c).await;
    rig.teach().await;
    rig.hold().await;
    let waiting = {
        let (client, url) = (rig.app.client.clone(), rig.app.chat_url());
        let body = chat_for(SMALL, "Straight to the busy model");
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap() })
    };
    // It waits in the primary's line.
    assert!(
        eventually(Duration::from_secs(30), || rig.small.load().queued_user()
            == 1)
        .await
    );
    rig.release().await;
    let r = waiting.await.unwrap();
    assert!(header(&r, "x-reprise-degraded").is_none());
    assert_eq!(model_of(r).await, SMALL);
    assert!(!rig.app.state.router.shedding());
}

/// An expired entry still kept for the stale windows answers a repeat while the primary is
/// busy (marked stale), before the fallback is tried.
#[tokio::test]
async fn a_kept_expired_entry_answers_before_the_fallback() {
    let mut c = config(&[
        DegradeStep::LooseThreshold,
        DegradeStep::Stale,
        DegradeStep::Fallback,
    ]);
    c.cache.ttl_secs = 1;
    c.cache.stale_if_error_secs = 600;
    let mut rig = rig(c).await;
    rig.teach().await;
    let q = chat_for("auto", "What did we say before?");
    let r = rig.app.chat(&q, &[]).await;
    let entry = header(&r, "x-reprise-entry").unwrap();
    assert_eq!(model_of(r).await, SMALL);
    let id: reprise_cache::EntryId = entry.parse().unwrap();
    let expires = loop {
        if let Some(e) = rig
            .app
            .state
            .store
            .entries()
            .into_iter()
            .find(|e| e.id == id)
        {
            break e.expires_ms;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    while reprise_cache::now_ms() < expires + 50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    rig.hold().await;
    let r = rig.app.chat(&q, &[]).await;
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("stale-under-load")
    );
    assert_eq!(
        header(&r, "x-reprise-entry").as_deref(),
        Some(entry.as_str())
    );
    assert_eq!(rig.large.calls(), 0, "the stale entry came first");
    // A new question has nothing stale: the fallback.
    let r = rig.app.chat(&chat_for("auto", "Something new"), &[]).await;
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("fallback")
    );
    rig.release().await;
    // Both backends down: the same entry stands in for a failure, and says so.
    rig.small.set_ready(false);
    rig.large.set_ready(false);
    let r = rig.app.chat(&q, &[]).await;
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("stale-if-error")
    );
}

/// A rig degrading to a loose threshold (0.97, floor 0.8), then a refusal, whose primary
/// was taught its service time and answered "How do I reset my password?"; `delta`: the
/// error bound, if any.
async fn paraphrase_rig(delta: Option<f64>) -> Rig {
    let mut c = config(&[DegradeStep::LooseThreshold, DegradeStep::Refuse]);
    c.semantic.enabled = true;
    c.semantic.threshold = 0.97;
    c.degrade.loose_floor = 0.8;
    if let Some(delta) = delta {
        c.semantic.delta = delta;
    }
    let rig = rig(c).await;
    rig.teach().await;
    let r = rig
        .app
        .chat(&chat_for("auto", "How do I reset my password?"), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    model_of(r).await;
    rig
}

/// A paraphrase under the threshold but above the floor answers while the primary is busy
/// (marked loose-threshold, a semantic hit with its similarity); on an idle primary the
/// same paraphrase is a miss; a near question the gate refuses is never served loosely.
#[tokio::test]
async fn a_paraphrase_above_the_floor_answers_only_when_busy_and_never_past_the_gate() {
    let mut rig = paraphrase_rig(None).await;
    let paraphrase = chat_for("auto", "I forgot my password, how can I change it?");

    rig.hold().await;
    let r = rig.app.chat(&paraphrase, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    assert_eq!(
        header(&r, "x-reprise-degraded").as_deref(),
        Some("loose-threshold")
    );
    let sim: f32 = header(&r, "x-reprise-similarity").unwrap().parse().unwrap();
    assert!((0.8..0.97).contains(&sim), "{sim}");
    // The gate still decides: a negation is refused even loosely (then 429 by the order).
    let r = rig
        .app
        .chat(&chat_for("auto", "How do I not reset my password?"), &[])
        .await;
    assert_eq!(r.status(), 429);
    rig.release().await;

    let r = rig.app.chat(&paraphrase, &[]).await;
    assert_eq!(cache_status(&r), "miss", "idle: the configured threshold");
    assert!(header(&r, "x-reprise-degraded").is_none());
}

/// Under an error bound (`delta`) the learned threshold is the bound's: a busy backend
/// never serves a paraphrase below it, whatever the floor. The same paraphrase that the
/// floor admits without a bound is refused (the next step) here.
#[tokio::test]
async fn under_an_error_bound_degrading_never_goes_below_the_learned_threshold() {
    let mut rig = paraphrase_rig(Some(0.02)).await;

    rig.hold().await;
    let loose = at_risk(&rig.app, "loose_threshold").await;
    let r = rig
        .app
        .chat(
            &chat_for("auto", "I forgot my password, how can I change it?"),
            &[],
        )
        .await;
    assert_eq!(r.status(), 429, "refused, not served under the bound");
    assert!(header(&r, "x-reprise-similarity").is_none());
    assert_eq!(at_risk(&rig.app, "loose_threshold").await, loose);
    rig.release().await;
}

/// Background work is shed first: once a request found the backend at risk, no spare slot
/// is offered to background work for `shed_background_secs`, even when slots are free again.
#[tokio::test]
async fn background_work_is_shed_once_a_request_is_at_risk() {
    let mut c = config(&[DegradeStep::Refuse]);
    // Route-less, so the router's capacity is the primary's own.
    c.backends.truncate(1);
    c.routes.clear();
    c.prefetch.max_capacity_share = 1.0;
    c.degrade.shed_background_secs = 600.0;
    // Two slots: one request ahead beyond them waits half a service time.
    c.slo.ttft_secs = 0.8;
    c.slo.total_secs = 0.8;
    c.validate().unwrap();
    let small = ScriptedBackend::new(ScriptConfig {
        model: SMALL.into(),
        reply: "small says: {prompt}".into(),
        first_token_delay: SERVICE,
        slots: Some(2),
        max_queue: Some(16),
        ..ScriptConfig::default()
    });
    let app = spawn_routed(c, vec![("small", Arc::new(small.clone()))]).await;
    let room = || {
        reprise::generate::room(&app.state, &background_for(SMALL), 0)
            .expect("capacity known")
            .spare
    };
    let r = app
        .chat(&chat_for(SMALL, "A question to learn from"), &[])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(room(), 2, "idle: both slots spare");

    small.set_token_delay(Duration::from_millis(400));
    let holders: Vec<_> = (0..2)
        .map(|i| {
            let mut body = chat_for(SMALL, &format!("Long story {i}"));
            body["stream"] = json!(true);
            let (client, url) = (app.client.clone(), app.chat_url());
            tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap() })
        })
        .collect();
    assert!(eventually(Duration::from_secs(30), || small.active() == 2).await);
    let r = app.chat(&chat_for(SMALL, "One more while busy"), &[]).await;
    assert_eq!(r.status(), 429);
    small.set_token_delay(Duration::ZERO);
    for h in holders {
        h.await.unwrap().text().await.unwrap();
    }
    assert!(eventually(Duration::from_secs(30), || small.active() == 0).await);
    assert_eq!(room(), 0, "shed: no spare slot for background work");
}

/// The real llama.cpp engine (one slot): its service time learned from one answer, an idle
/// engine answers as usual; while a long generation holds the slot, the next request is
/// refused with `Retry-After` instead of queueing past the SLO.
#[tokio::test]
async fn a_busy_llama_engine_degrades_while_an_idle_one_answers() {
    let mut c = test_config();
    c.backend = small_llama("smol");
    // Any wait breaks it; a request that starts at once is never degraded.
    c.slo.ttft_secs = 0.05;
    c.slo.total_secs = 0.05;
    c.degrade.enabled = true;
    c.degrade.order = vec![DegradeStep::Refuse];
    c.validate().unwrap();
    let backends = reprise::state::build_backends(&c)
        .await
        .expect("model loads");
    let state = reprise::AppState::with_backends(c, backends, None, None).unwrap();
    let app = try_serve(state).await.unwrap();

    for q in ["What is the capital of France?", "Name a primary colour."] {
        let r = app.chat(&chat_for("smol", q), &[]).await;
        assert_eq!(r.status(), 200, "idle: answered");
        assert!(header(&r, "x-reprise-degraded").is_none());
    }
    let holder = hold_llama_slot(&app, "smol").await;
    let r = app
        .chat(&chat_for("smol", "Is the engine busy?"), &[])
        .await;
    assert_eq!(r.status(), 429);
    assert!(header(&r, "retry-after").is_some());
    drop(holder);
}
