//! Stale answers (RFC 5861) through the server: an expired entry served at once while one
//! regeneration replaces it (`stale-while-revalidate`), or instead of an error when the
//! backend fails (`stale-if-error`), each within its window, marked stale; the request's
//! `Cache-Control` only narrows the windows. The scripted backend counts generations and
//! fails on demand; entries live one or two seconds, and the tests wait for expiry by polling
//! the entry's own expiry time.

mod common;

use std::time::Duration;

use common::*;
use reprise::config::TenantConfig;
use reprise::Config;
use reprise_backend::fake::{Failure, ScriptConfig};
use reprise_backend::BackendError;
use reprise_cache::{now_ms, EntryId};
use serde_json::Value;

/// A config whose entries live `ttl_secs`, with the given stale windows.
fn stale_config(ttl_secs: u64, while_revalidate: u64, if_error: u64) -> Config {
    let mut c = test_config();
    c.cache.ttl_secs = ttl_secs;
    c.cache.stale_while_revalidate_secs = while_revalidate;
    c.cache.stale_if_error_secs = if_error;
    c
}

fn script(reply: &str) -> ScriptConfig {
    ScriptConfig {
        reply: reply.into(),
        ..ScriptConfig::default()
    }
}

/// The entry an answer names.
fn entry_of(r: &reqwest::Response) -> EntryId {
    header(r, "x-reprise-entry").unwrap().parse().unwrap()
}

/// Waits until entry `id` of `app` is `past_ms` past its expiry (polling its expiry time).
async fn wait_past_expiry(app: &TestApp, id: EntryId, past_ms: u64) {
    let expires = eventually_expiry(app, id).await;
    while now_ms() < expires + past_ms {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn eventually_expiry(app: &TestApp, id: EntryId) -> u64 {
    for _ in 0..500 {
        if let Some(e) = app.state.store.entries().into_iter().find(|e| e.id == id) {
            return e.expires_ms;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("entry {id} was never stored");
}

/// Asserts that `r` is a stale answer of `kind` from `entry`, and returns its text.
async fn assert_stale(r: reqwest::Response, kind: &str, entry: EntryId) -> String {
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(header(&r, "x-reprise-degraded").as_deref(), Some(kind));
    let status = header(&r, "cache-status").unwrap();
    let ttl = status
        .split("; ")
        .find_map(|p| p.strip_prefix("ttl="))
        .unwrap_or_else(|| panic!("no ttl in {status}"));
    assert!(ttl.parse::<i64>().unwrap() < 0, "{status}");
    assert!(status.starts_with("reprise; hit; "), "{status}");
    assert!(status.ends_with(&format!("detail={kind}")), "{status}");
    assert!(header(&r, "age").is_some(), "Age as for hits");
    assert_eq!(entry_of(&r), entry);
    content(r).await
}

/// Within the stale-while-revalidate window an expired answer is served at once (before
/// the regeneration has finished), several concurrent requests start one regeneration, and
/// then the fresh answer is an ordinary hit.
#[tokio::test]
async fn stale_while_revalidate_answers_at_once_and_regenerates_once() {
    let (app, backend) = spawn_fake(stale_config(2, 60, 0), script("first")).await;
    let body = chat_body("What is the weather like?");
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let old = entry_of(&r);
    wait_past_expiry(&app, old, 0).await;

    // The regeneration is slow: the stale answers must not wait for it.
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_secs(3),
        ..script("second")
    });
    let answers = futures::future::join_all((0..5).map(|_| app.chat(&body, &[]))).await;
    assert_eq!(
        backend.completed(),
        1,
        "answered before the regeneration ended"
    );
    for r in answers {
        assert_eq!(
            assert_stale(r, "stale-while-revalidate", old).await,
            "first"
        );
    }
    // One regeneration for all five.
    assert!(eventually(Duration::from_secs(10), || backend.completed() == 2).await);
    assert_eq!(backend.calls(), 2);

    // The fresh answer replaced it: an ordinary hit.
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(header(&r, "x-reprise-degraded"), None);
    assert_eq!(header(&r, "cache-status").unwrap(), "reprise; hit");
    assert_ne!(entry_of(&r), old);
    assert_eq!(content(r).await, "second");
    assert_eq!(backend.calls(), 2);

    // Counted under the tier that served it, and as degraded.
    let metrics = app.metrics_text().await;
    let degraded = metrics
        .lines()
        .find(|l| l.starts_with("reprise_degraded_total{kind=\"stale_while_revalidate\"}"))
        .unwrap_or_else(|| panic!("no degraded series in\n{metrics}"));
    let n: f64 = degraded.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(n >= 5.0, "{degraded}");
}

/// Every wording that leads to one expired entry (its own, and the aliases hits by meaning
/// linked) starts one regeneration of it between them, not one each.
#[tokio::test]
async fn one_regeneration_per_entry_whatever_wording_asks() {
    let mut config = stale_config(2, 60, 0);
    config.semantic.enabled = true;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let own = chat_body("How do I reset my password?");
    let old = entry_of(&app.chat(&own, &[]).await);
    let other = chat_body("I forgot my password, how can I change it?");
    let r = app.chat(&other, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    wait_past_expiry(&app, old, 0).await;
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_secs(2),
        ..script("second")
    });
    let calls = backend.calls();
    // While background work is shed (the SLO at risk), the stale answer is served alone.
    app.state.router.shed_background(Duration::from_millis(800));
    assert_stale(app.chat(&own, &[]).await, "stale-while-revalidate", old).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(backend.calls(), calls, "not regenerated while shed");
    let state = app.state.clone();
    assert!(eventually(Duration::from_secs(5), || !state.router.shedding()).await);
    let (a, b) = futures::future::join(app.chat(&own, &[]), app.chat(&other, &[])).await;
    assert_stale(a, "stale-while-revalidate", old).await;
    assert_stale(b, "stale-while-revalidate", old).await;
    let b = backend.clone();
    assert!(eventually(Duration::from_secs(10), || b.completed() == calls + 1).await);
    assert_eq!(backend.calls(), calls + 1, "one regeneration");
}

/// A wrong verdict that comes after the answer was renewed (stale-while-revalidate took its
/// keys, the wording reported wrong among them) refuses the renewal too: the question is
/// not served the renewed answer.
#[tokio::test]
async fn a_verdict_after_a_renewal_refuses_the_renewed_answer_too() {
    let mut config = stale_config(2, 60, 0);
    config.semantic.enabled = true;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let own = chat_body("How do I reset my password?");
    let old = entry_of(&app.chat(&own, &[]).await);
    let other = chat_body("I forgot my password, how can I change it?");
    let r = app.chat(&other, &[]).await;
    assert_eq!(cache_status(&r), "semantic");
    let served = r.json::<Value>().await.unwrap()["id"].clone();
    wait_past_expiry(&app, old, 0).await;
    backend.set_config(script("second"));
    let calls = backend.calls();
    assert_stale(app.chat(&own, &[]).await, "stale-while-revalidate", old).await;
    let b = backend.clone();
    assert!(eventually(Duration::from_secs(10), || b.completed() == calls + 1).await);
    // The wording is served the renewal now (by its key, once the renewal took the old
    // entry's keys; by meaning just before).
    let r = app.chat(&other, &[]).await;
    assert!(["exact", "semantic"].contains(&cache_status(&r).as_str()));
    assert_ne!(entry_of(&r), old);
    content(r).await;
    let r = feedback(
        &app,
        serde_json::json!({"id": served, "verdict": "wrong"}),
        None,
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["refused"], true);
    let calls = backend.calls();
    let r = app.chat(&other, &[]).await;
    assert_eq!(cache_status(&r), "miss", "not the renewed answer either");
    content(r).await;
    assert_eq!(backend.calls(), calls + 1);
    assert_eq!(cache_status(&app.chat(&own, &[]).await), "exact");
}

/// Past the stale-while-revalidate window an expired answer is an ordinary miss (it is still
/// kept, for the longer stale-if-error window, but the backend answers).
#[tokio::test]
async fn beyond_the_stale_while_revalidate_window_it_is_a_miss() {
    let (app, backend) = spawn_fake(stale_config(1, 1, 60), script("first")).await;
    let body = chat_body("Which way is north?");
    let old = entry_of(&app.chat(&body, &[]).await);
    wait_past_expiry(&app, old, 1100).await;
    backend.set_config(script("second"));
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(header(&r, "x-reprise-degraded"), None);
    assert_eq!(content(r).await, "second");
    assert_eq!(backend.calls(), 2);
}

/// With the backend failing, an expired answer within the stale-if-error window is served
/// (JSON and SSE) instead of the error, also when the first token does not come in time; a
/// question with nothing stale still gets the clear error, and so does a request that asks
/// for no stale answer.
#[tokio::test]
async fn stale_if_error_answers_instead_of_a_backend_failure() {
    let mut config = stale_config(1, 0, 60);
    config.server.first_token_timeout_secs = 0.5;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let body = chat_body("Is the bridge open?");
    let old = entry_of(&app.chat(&body, &[]).await);
    wait_past_expiry(&app, old, 0).await;

    backend.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let r = app.chat(&body, &[]).await;
    assert_eq!(assert_stale(r, "stale-if-error", old).await, "first");
    let mut streamed = body.clone();
    streamed["stream"] = Value::Bool(true);
    let r = app.chat(&streamed, &[]).await;
    assert_eq!(cache_status(&r), "stale");
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(sse_text(&data), "first");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));

    // Nothing stale for a new question: the error as before.
    let r = app.chat(&chat_body("Is the tunnel open?"), &[]).await;
    assert_eq!(cache_status(&r), "error");
    assert_eq!(header(&r, "x-reprise-degraded"), None);
    assert_openai_error(r, 502, None).await;
    // A client that takes no stale answer gets the error too.
    let r = app
        .chat(&body, &[("cache-control", "stale-if-error=0")])
        .await;
    assert_openai_error(r, 502, None).await;

    // No first token within the first-token timeout: a failure too.
    backend.set_failure(Failure::None);
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_secs(5),
        ..script("late")
    });
    let r = app.chat(&body, &[]).await;
    assert_eq!(assert_stale(r, "stale-if-error", old).await, "first");
}

/// An expired answer deleted while the request waited for the backend is not served stale
/// when the backend then fails: the failure is the answer.
#[tokio::test]
async fn an_answer_deleted_meanwhile_is_not_served_stale() {
    let mut config = stale_config(1, 0, 60);
    config.server.first_token_timeout_secs = 1.0;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let body = chat_body("Is the ferry running?");
    let old = entry_of(&app.chat(&body, &[("x-reprise-tags", "ferry")]).await);
    wait_past_expiry(&app, old, 0).await;
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_secs(5),
        ..script("late")
    });
    let asking = {
        let (client, url, body) = (app.client.clone(), app.chat_url(), body.clone());
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap() })
    };
    let b = backend.clone();
    assert!(eventually(Duration::from_secs(10), || b.active() == 1).await);
    assert_eq!(app.state.store.delete_tag("ferry").await.unwrap(), 1);
    let r = asking.await.unwrap();
    assert_eq!(header(&r, "x-reprise-degraded"), None);
    assert_openai_error(r, 504, None).await;
}

/// Stale-if-error off, for a tenant (its window 0 while the global one keeps the entry) or
/// for the whole server (the default): the backend's failure is the answer.
#[tokio::test]
async fn without_a_stale_if_error_window_the_failure_is_the_answer() {
    let mut config = stale_config(1, 0, 60);
    let mut off = TenantConfig::with_key("off", "sk-off");
    off.policy.stale_if_error_secs = Some(0);
    config.tenants = vec![off];
    let (app, backend) = spawn_fake(config, script("first")).await;
    let auth = [("authorization", "Bearer sk-off")];
    let body = chat_body("Is the ferry running?");
    let old = entry_of(&app.chat(&body, &auth).await);
    wait_past_expiry(&app, old, 0).await;
    backend.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let asking = [auth[0], ("cache-control", "stale-if-error=60")];
    let r = app.chat(&body, &asking).await;
    assert_eq!(cache_status(&r), "error");
    assert_openai_error(r, 502, None).await;

    let (app, backend) = spawn_fake(stale_config(1, 0, 0), script("first")).await;
    let old = entry_of(&app.chat(&body, &[]).await);
    wait_past_expiry(&app, old, 0).await;
    backend.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let r = app
        .chat(&body, &[("cache-control", "stale-if-error=60")])
        .await;
    assert_eq!(cache_status(&r), "error");
    assert_openai_error(r, 502, None).await;
}

/// The request's directives only narrow the policy's windows: asking for more than the
/// policy gives nothing more, asking for less (or 0) gets less; a bad value is a 400 like a
/// bad `max-age`; a tenant's policy narrows the global windows and may forbid the
/// directives.
#[tokio::test]
async fn the_request_narrows_the_windows_never_widens_them() {
    // Expired entries are kept a minute; the tenants' windows are shorter.
    let mut config = stale_config(1, 60, 0);
    let mut short = TenantConfig::with_key("short", "sk-short");
    short.policy.stale_while_revalidate_secs = Some(1);
    let mut narrow = TenantConfig::with_key("narrow", "sk-narrow");
    narrow.policy.stale_while_revalidate_secs = Some(0);
    let mut gated = TenantConfig::with_key("gated", "sk-gated");
    gated.policy.controls = vec!["max-age".into()];
    config.tenants = vec![short, narrow, gated];
    let (app, backend) = spawn_fake(config, script("first")).await;

    // Asking for an hour past a policy of one second: a miss once that second has passed.
    let short = ("authorization", "Bearer sk-short");
    let body = chat_body("How tall is the tower?");
    let old = entry_of(&app.chat(&body, &[short]).await);
    wait_past_expiry(&app, old, 1100).await;
    let long = [short, ("cache-control", "stale-while-revalidate=3600")];
    assert_eq!(cache_status(&app.chat(&body, &long).await), "miss");

    // Asking for 0 within the policy's window: no stale answer.
    let body = chat_body("How deep is the lake?");
    let old = entry_of(&app.chat(&body, &[]).await);
    wait_past_expiry(&app, old, 0).await;
    let none = [("cache-control", "stale-while-revalidate=0")];
    assert_eq!(cache_status(&app.chat(&body, &none).await), "miss");
    assert_eq!(backend.calls(), 4);

    for bad in [
        "stale-while-revalidate=soon",
        "stale-if-error=-1",
        "stale-if-error=",
    ] {
        let r = app.chat(&body, &[("cache-control", bad)]).await;
        let j = assert_openai_error(r, 400, Some("cache-control")).await;
        let message = j["error"]["message"].as_str().unwrap();
        assert!(message.contains("whole number of seconds"), "{message}");
    }

    // A tenant whose window is 0: its expired answers are misses.
    let auth = [("authorization", "Bearer sk-narrow")];
    let body = chat_body("How wide is the river?");
    let old = entry_of(&app.chat(&body, &auth).await);
    wait_past_expiry(&app, old, 0).await;
    assert_eq!(cache_status(&app.chat(&body, &auth).await), "miss");
    // A tenant not allowed the directives: 403.
    let r = app
        .chat(
            &body,
            &[
                ("authorization", "Bearer sk-gated"),
                ("cache-control", "stale-if-error=5"),
            ],
        )
        .await;
    let j = assert_openai_error(r, 403, None).await;
    assert!(j["error"]["message"]
        .as_str()
        .unwrap()
        .contains("stale-if-error"));
}

/// The stale answer is written in the request log with its kind.
#[tokio::test]
async fn the_request_log_names_the_degraded_answer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("requests.jsonl");
    let mut config = stale_config(1, 60, 0);
    config.log.request_log = Some(path.clone());
    let (app, backend) = spawn_fake(config, script("first")).await;
    let body = chat_body("Where is the station?");
    let old = entry_of(&app.chat(&body, &[]).await);
    wait_past_expiry(&app, old, 0).await;
    backend.set_failure(Failure::AtStart(BackendError::Unavailable("down".into())));
    let r = app.chat(&body, &[]).await;
    assert_eq!(cache_status(&r), "stale");
    drop(r);
    let lines = || log_lines(&path);
    assert!(eventually(Duration::from_secs(10), || lines().len() >= 2).await);
    let lines = lines();
    assert_eq!(lines[0].get("degraded"), None, "omitted when not degraded");
    assert_eq!(
        lines[1]["degraded"], "stale_while_revalidate",
        "{}",
        lines[1]
    );
    assert_eq!(lines[1]["outcome"], "exact");
    // The regeneration failed (the backend is down): the stale entry stays and answers.
    assert!(eventually(Duration::from_secs(10), || backend.calls() == 2).await);
    assert!(eventually(Duration::from_secs(10), || app.state.flights.is_empty()).await);
    let r = app.chat(&body, &[]).await;
    assert_eq!(
        assert_stale(r, "stale-while-revalidate", old).await,
        "first"
    );
}

/// An expired answer that already carries the most tags is served stale to a request that
/// brings a new tag, but not regenerated: the renewed answer could not be stored with every
/// tag (a delete by the new one must reach it), so generating it would be waste.
#[tokio::test]
async fn a_refresh_past_the_tag_limit_is_not_generated() {
    let (app, backend) = spawn_fake(stale_config(1, 60, 0), script("first")).await;
    let body = chat_body("How many tags can it carry?");
    let full: Vec<String> = (0..32).map(|i| format!("t{i}")).collect();
    let r = app
        .chat(&body, &[("x-reprise-tags", &full.join(","))])
        .await;
    assert_eq!(cache_status(&r), "miss");
    let old = entry_of(&r);
    wait_past_expiry(&app, old, 0).await;
    let r = app.chat(&body, &[("x-reprise-tags", "one-more")]).await;
    assert_eq!(
        assert_stale(r, "stale-while-revalidate", old).await,
        "first"
    );
    // A request carrying no new tag renews it.
    let r = app.chat(&body, &[("x-reprise-tags", "t0")]).await;
    assert_stale(r, "stale-while-revalidate", old).await;
    assert!(eventually(Duration::from_secs(10), || backend.calls() == 2).await);
    assert_eq!(
        backend.calls(),
        2,
        "only the second stale answer regenerated"
    );
}

/// A renewal takes the keys of the answer it replaces, but a conversation that was shown the
/// old answer is not the one shown the new: a follow-up asked after the old answer is never
/// served to one asked after the new answer, nor the other way round.
#[tokio::test]
async fn a_renewal_never_joins_the_conversations_of_its_old_and_new_answers() {
    let mut config = stale_config(2, 60, 0);
    config.semantic.enabled = true;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let question = "Write a haiku about autumn.";
    let r = app.chat(&chat_body(question), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let old = entry_of(&r);
    assert_eq!(content(r).await, "first");
    wait_past_expiry(&app, old, 0).await;
    backend.set_config(script("second"));
    assert_stale(
        app.chat(&chat_body(question), &[]).await,
        "stale-while-revalidate",
        old,
    )
    .await;
    let b = backend.clone();
    assert!(eventually(Duration::from_secs(10), || b.completed() == 2).await);
    let state = app.state.clone();
    let renewed = eventually_async(Duration::from_secs(10), || async {
        state.store.run_pending_tasks().await;
        state.store.entries().iter().any(|e| e.text == "second")
    });
    assert!(renewed.await);
    let r = app.chat(&chat_body(question), &[]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(content(r).await, "second");

    backend.set_config(script("a follow-up to the first"));
    let follow_up = "Translate it into French.";
    let after_old = convo(&[
        ("user", question),
        ("assistant", "first"),
        ("user", follow_up),
    ]);
    let r = app.chat(&after_old, &[]).await;
    assert_eq!(cache_status(&r), "miss");
    expect_status(&app, &after_old, &[], "exact").await;
    let after_new = convo(&[
        ("user", question),
        ("assistant", "second"),
        ("user", follow_up),
    ]);
    let r = app.chat(&after_new, &[]).await;
    assert_eq!(
        cache_status(&r),
        "miss",
        "served the follow-up of another answer"
    );
}

/// An expired answer reached through another wording's key (an alias a hit by meaning
/// linked) is served stale only where a fresh one would be: not to a client asking a
/// threshold the two wordings do not pass, and a wrong verdict on it refuses it to that
/// wording, while the entry's own question is still served it.
#[tokio::test]
async fn a_stale_answer_through_an_alias_passes_the_checks_a_fresh_one_does() {
    let mut config = stale_config(2, 60, 0);
    config.semantic.enabled = true;
    let (app, backend) = spawn_fake(config, script("first")).await;
    let own = chat_body("How do I reset my password?");
    let old = entry_of(&app.chat(&own, &[]).await);
    let strict = chat_body("I forgot my password, how can I change it?");
    let reported = chat_body("How can I reset my password?");
    for alias in [&strict, &reported] {
        let r = app.chat(alias, &[]).await;
        assert_eq!(cache_status(&r), "semantic");
        assert_eq!(entry_of(&r), old);
    }
    wait_past_expiry(&app, old, 0).await;
    // Regenerations are slow: what is served meanwhile is the stale answer or nothing.
    backend.set_config(ScriptConfig {
        first_token_delay: Duration::from_secs(30),
        ..script("second")
    });
    let r = app
        .chat(
            &strict,
            &[
                ("x-reprise-threshold", "0.999"),
                ("cache-control", "only-if-cached"),
            ],
        )
        .await;
    assert_eq!(
        cache_status(&r),
        "error",
        "served stale past the client's threshold"
    );

    let r = app.chat(&reported, &[]).await;
    let body = assert_stale_json(r, old).await;
    let id = body["id"].clone();
    let r = feedback(
        &app,
        serde_json::json!({"id": id, "verdict": "wrong"}),
        None,
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["refused"], true);
    let r = app
        .chat(&reported, &[("cache-control", "only-if-cached")])
        .await;
    assert_eq!(
        cache_status(&r),
        "error",
        "served stale after a wrong verdict"
    );
    assert_stale(app.chat(&own, &[]).await, "stale-while-revalidate", old).await;
}

/// [`assert_stale`] for a stale-while-revalidate answer, returning its JSON body.
async fn assert_stale_json(r: reqwest::Response, entry: EntryId) -> Value {
    assert_eq!(cache_status(&r), "stale");
    assert_eq!(entry_of(&r), entry);
    r.json().await.unwrap()
}
