//! Predictive prefetch and refresh-ahead over real TCP: after a pattern of turns was seen, a
//! new session reaching the first turn gets the follow-up answered from an entry generated in
//! the background (`x-reprise-cache: prefetch`, then a normal entry); background work never
//! starts beside an interactive request and keeps to its budgets; hot entries are renewed
//! before they expire; learned counts survive a restart through Redis.
//!
//! The scripted backend answers "You asked: <last user message>", so an answer names the
//! question it was generated for. A probe wrapped around it records, for every background
//! generation, whether an interactive one was running when it started and how many background
//! streams ran at once. Assertions poll with generous timeouts; none measures durations.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use reprise::config::BackendKind;
use reprise::prefetch::{PrefetchStats, Snapshot};
use reprise::Config;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::llama::{LlamaBackend, LlamaConfig};
use reprise_backend::{Backend, BackendError, GenRequest, GenStream, Priority};
use reprise_cache::redis::{RedisConfig, RedisTier};
use reprise_cache::testing::RedisServer;
use reprise_cache::{EntryId, Origin};
use serde_json::json;

/// Generous bound for anything that happens in the background.
const WAIT: Duration = Duration::from_secs(30);

const X: &str = "How do I create an account?";
const Y: &str = "How do I reset my password?";
/// A paraphrase of `Y` the semantic tier serves `Y`'s answer for.
const Y_PARAPHRASE: &str = "I forgot my password, how can I change it?";

/// A test configuration with prefetch on.
fn prefetch_config(semantic: bool) -> Config {
    let mut c = test_config();
    c.semantic.enabled = semantic;
    c.prefetch.enabled = true;
    c
}

/// Counts what the background does, around a scripted backend.
#[derive(Default)]
struct ProbeCounts {
    /// Background requests are refused (user requests are answered).
    fail_background: std::sync::atomic::AtomicBool,
    background_started: AtomicUsize,
    background_beside_interactive: AtomicUsize,
    background_active: AtomicUsize,
    background_peak: AtomicUsize,
}

#[derive(Clone)]
struct Probe {
    inner: ScriptedBackend,
    counts: Arc<ProbeCounts>,
}

/// Decrements the active background count when its stream ends.
struct ActiveGuard(Arc<ProbeCounts>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.background_active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Backend for Probe {
    // Written out as `async_trait` expands it (the root crate does not depend on the macro).
    fn generate<'a, 'b>(
        &'a self,
        req: GenRequest,
    ) -> Pin<Box<dyn Future<Output = Result<GenStream, BackendError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(async move {
            let background = req.priority == Priority::Background;
            if background {
                let c = &self.counts;
                c.background_started.fetch_add(1, Ordering::SeqCst);
                if c.fail_background.load(Ordering::SeqCst) {
                    return Err(BackendError::Unavailable("background refused".into()));
                }
                if self.inner.interactive_load() > 0 {
                    c.background_beside_interactive
                        .fetch_add(1, Ordering::SeqCst);
                }
                let active = c.background_active.fetch_add(1, Ordering::SeqCst) + 1;
                c.background_peak.fetch_max(active, Ordering::SeqCst);
                let guard = ActiveGuard(c.clone());
                let stream = match self.inner.generate(req).await {
                    Ok(s) => s,
                    Err(e) => return Err(e),
                };
                let stream: GenStream = Box::pin(stream.map(move |ev| {
                    let _keep = &guard;
                    ev
                }));
                return Ok(stream);
            }
            self.inner.generate(req).await
        })
    }

    fn models(&self) -> Vec<String> {
        self.inner.models()
    }

    fn ready(&self) -> bool {
        true
    }

    fn interactive_load(&self) -> usize {
        self.inner.interactive_load()
    }

    fn load(&self) -> reprise_backend::Load {
        self.inner.load()
    }
}

/// A server over a probed scripted backend.
async fn spawn_probe(config: Config, script: ScriptConfig) -> (TestApp, Probe) {
    let probe = Probe {
        inner: ScriptedBackend::new(script),
        counts: Arc::new(ProbeCounts::default()),
    };
    let app = spawn_app(config, Arc::new(probe.clone())).await;
    (app, probe)
}

/// [`spawn_probe`] with the Redis tier of `config` (the worker restores and saves there).
async fn spawn_probe_replica(config: Config, script: ScriptConfig) -> (TestApp, Probe) {
    let probe = Probe {
        inner: ScriptedBackend::new(script),
        counts: Arc::new(ProbeCounts::default()),
    };
    let app = spawn_replica(config, Arc::new(probe.clone())).await;
    (app, probe)
}

fn stats(app: &TestApp) -> PrefetchStats {
    app.state.prefetch.as_ref().expect("prefetch on").stats()
}

/// One single-turn prompt of a session; returns the cache outcome.
async fn ask(app: &TestApp, session: &str, text: &str) -> String {
    let r = app
        .chat(&chat_body(text), &[("x-reprise-session", session)])
        .await;
    assert_eq!(r.status(), 200);
    cache_status(&r)
}

/// The id of the entry whose answer names `question`.
fn entry_answering(app: &TestApp, question: &str) -> Option<EntryId> {
    let text = format!("You asked: {question}");
    app.state
        .store
        .entries()
        .into_iter()
        .find(|e| e.text == text)
        .map(|e| e.id)
}

/// The id of the entry stored for the question `prompt` (as matched by the semantic tier).
fn entry_asked(app: &TestApp, prompt: &str) -> EntryId {
    app.state
        .store
        .entries()
        .into_iter()
        .find(|e| e.prompt == prompt)
        .unwrap_or_else(|| panic!("an entry for {prompt:?}"))
        .id
}

/// Drops an entry from the memory tier, so that only a new generation can bring it back.
async fn forget(app: &TestApp, id: EntryId) {
    app.state.store.remove_local(id).await;
    app.state.store.run_pending_tasks().await;
}

/// Several sessions ask `X` then `Y` (single-turn prompts linked by session id); then `Y`'s
/// entry is dropped, so only a prefetch can bring it back before it is asked.
async fn learn_x_then_y(app: &TestApp, sessions: usize) {
    for i in 0..sessions {
        let s = format!("learn-{i}");
        ask(app, &s, X).await;
        ask(app, &s, Y).await;
    }
    assert!(
        eventually(WAIT, || stats(app).links >= sessions as u64).await,
        "{:?}",
        stats(app)
    );
    forget(app, entry_answering(app, Y).expect("Y was answered")).await;
}

#[tokio::test]
async fn single_turn_session_gets_the_follow_up_prefetched() {
    let (app, probe) = spawn_probe(prefetch_config(true), ScriptConfig::default()).await;
    learn_x_then_y(&app, 3).await;
    let before = stats(&app);
    // A new session reaches X: Y is predicted and generated in the background.
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(
        eventually(WAIT, || stats(&app).completed > before.completed).await,
        "{:?}",
        stats(&app)
    );
    assert!(probe.counts.background_started.load(Ordering::SeqCst) >= 1);
    let bg: Vec<GenRequest> = probe
        .inner
        .requests()
        .into_iter()
        .filter(|r| r.priority == Priority::Background)
        .collect();
    assert!(
        bg.iter().any(|r| format!("{:?}", r.input).contains(Y)),
        "{bg:?}"
    );
    let calls = probe.inner.calls();
    // The session asks Y in other words: served from the prefetched entry.
    let r = app
        .chat(&chat_body(Y_PARAPHRASE), &[("x-reprise-session", "new")])
        .await;
    assert_eq!(cache_status(&r), "prefetch");
    assert_eq!(r.headers()["cache-status"], "reprise; hit; detail=prefetch");
    assert_eq!(content(r).await, format!("You asked: {Y}"));
    assert_eq!(probe.inner.calls(), calls, "no backend call for the hit");
    assert!(eventually(WAIT, || stats(&app).hits == 1).await);
    // After its first use it is a normal entry.
    assert_eq!(ask(&app, "other", Y_PARAPHRASE).await, "exact");
    assert_eq!(ask(&app, "third", Y).await, "exact");
}

#[tokio::test]
async fn multi_turn_history_gets_the_follow_up_prefetched_in_a_new_context() {
    let (app, probe) = spawn_probe(prefetch_config(true), ScriptConfig::default()).await;
    let answer = format!("You asked: {X}");
    // Three conversations under one system prompt: X, then Y with the history. (Counts
    // decay, so the two follow-ups known when X is served the third time are a little
    // under `min_observations`: nothing is prefetched yet.)
    for _ in 0..3 {
        app.chat(&convo(&[("system", "You are terse."), ("user", X)]), &[])
            .await;
        let r = app
            .chat(
                &convo(&[
                    ("system", "You are terse."),
                    ("user", X),
                    ("assistant", &answer),
                    ("user", Y),
                ]),
                &[],
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    assert!(eventually(WAIT, || stats(&app).links >= 3).await);
    // A conversation under another system prompt reaches X: a new entry (another context)
    // that borrows the follow-ups of the similar one.
    let before = stats(&app);
    let r = app
        .chat(&convo(&[("system", "You are kind."), ("user", X)]), &[])
        .await;
    assert_eq!(cache_status(&r), "miss");
    assert!(
        eventually(WAIT, || stats(&app).completed > before.completed).await,
        "{:?}",
        stats(&app)
    );
    let calls = probe.inner.calls();
    let r = app
        .chat(
            &convo(&[
                ("system", "You are kind."),
                ("user", X),
                ("assistant", &answer),
                ("user", Y_PARAPHRASE),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "prefetch");
    assert_eq!(content(r).await, format!("You asked: {Y}"));
    assert_eq!(probe.inner.calls(), calls);
}

/// With a backend that cannot tell its capacity (the scripted one without slots), background
/// work keeps to idle time.
#[tokio::test]
async fn prefetch_never_starts_beside_interactive_requests() {
    let script = ScriptConfig {
        token_delay: Duration::from_millis(15),
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(prefetch_config(false), script).await;
    learn_x_then_y(&app, 3).await;
    // Back-to-back interactive misses keep the backend busy.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver = {
        let (client, url, stop) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            stop.clone(),
        );
        tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let body = chat_body(&format!("busy question number {i} for the backend"));
                let r = client.post(&url).json(&body).send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap();
                i += 1;
            }
            i
        })
    };
    assert!(eventually(WAIT, || probe.inner.interactive_load() > 0).await);
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(eventually(WAIT, || stats(&app).queued >= 1).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let sent = driver.await.unwrap();
    assert!(sent >= 2, "{sent}");
    assert!(
        eventually(WAIT, || stats(&app).completed >= 1).await,
        "{:?}",
        stats(&app)
    );
    assert_eq!(
        probe
            .counts
            .background_beside_interactive
            .load(Ordering::SeqCst),
        0,
        "a background generation started while an interactive one ran"
    );
    assert_eq!(ask(&app, "new", Y).await, "prefetch");
}

/// With a backend that tells its capacity (two slots), background work uses the free slot
/// while a user request runs in the other.
#[tokio::test]
async fn prefetch_starts_on_a_free_slot_beside_a_running_user_request() {
    let script = ScriptConfig {
        token_delay: Duration::from_millis(15),
        slots: Some(2),
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(prefetch_config(false), script).await;
    learn_x_then_y(&app, 3).await;
    // A long answer (about 400 words) holds one slot.
    let long = vec!["word"; 400].join(" ");
    let user = {
        let (client, url) = (app.client.clone(), app.chat_url());
        tokio::spawn(async move {
            let r = client
                .post(url)
                .json(&chat_body(&long))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        })
    };
    let running = || {
        let l = probe.load();
        (l.capacity, l.running, l.running_background) == (2, 1, 0)
    };
    assert!(eventually(WAIT, running).await);
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(
        eventually(WAIT, || stats(&app).completed >= 1).await,
        "{:?}",
        stats(&app)
    );
    assert!(
        !user.is_finished(),
        "the prefetch waited for the user request to end"
    );
    assert!(
        probe
            .counts
            .background_beside_interactive
            .load(Ordering::SeqCst)
            >= 1
    );
    assert_eq!(ask(&app, "new", Y).await, "prefetch");
    user.await.unwrap();
}

/// X was followed by three different questions: all three are predicted at once.
async fn learn_three_follow_ups(app: &TestApp) -> Vec<String> {
    let follow: Vec<String> = (1..=3)
        .map(|i| format!("Which option number {i} do you recommend?"))
        .collect();
    for (i, f) in follow.iter().enumerate() {
        let s = format!("learn-{i}");
        ask(app, &s, X).await;
        ask(app, &s, f).await;
    }
    assert!(eventually(WAIT, || stats(app).links >= 3).await);
    for f in &follow {
        let id = entry_answering(app, f).unwrap();
        app.state.store.remove_local(id).await;
    }
    app.state.store.run_pending_tasks().await;
    follow
}

#[tokio::test]
async fn one_background_stream_at_a_time() {
    let script = ScriptConfig {
        token_delay: Duration::from_millis(10),
        ..ScriptConfig::default()
    };
    let mut config = prefetch_config(false);
    config.prefetch.max_concurrent = 1;
    let (app, probe) = spawn_probe(config, script).await;
    let follow = learn_three_follow_ups(&app).await;
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(
        eventually(WAIT, || stats(&app).completed >= 3).await,
        "{:?}",
        stats(&app)
    );
    assert_eq!(probe.counts.background_peak.load(Ordering::SeqCst), 1);
    assert_eq!(stats(&app).peak_active, 1);
    for f in &follow {
        assert_eq!(ask(&app, "new", f).await, "prefetch");
    }
}

#[tokio::test]
async fn token_budget_stops_further_prefetches() {
    let mut config = prefetch_config(false);
    // One answer ("You asked: Which option number N do you recommend?") is 8 tokens.
    config.prefetch.max_tokens_per_minute = 5;
    let (app, probe) = spawn_probe(config, ScriptConfig::default()).await;
    learn_three_follow_ups(&app).await;
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(eventually(WAIT, || stats(&app).completed >= 1).await);
    // The budget is spent: the other two wait. Give the worker many ticks to misbehave.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = stats(&app);
    assert_eq!(s.started, 1, "{s:?}");
    assert_eq!(s.waiting, 2, "{s:?}");
    assert!(s.tokens >= 5, "{s:?}");
    assert_eq!(probe.counts.background_started.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn refresh_ahead_renews_a_hot_entry_before_expiry() {
    let mut config = prefetch_config(false);
    config.cache.ttl_secs = 2;
    config.prefetch.refresh_ahead = true;
    config.prefetch.refresh_window_secs = 1.5;
    config.prefetch.refresh_min_hits = 2;
    let (app, probe) = spawn_probe(config, ScriptConfig::default()).await;
    let tagged = [("x-reprise-session", "a"), ("x-reprise-tags", "doc-9")];
    assert_eq!(
        cache_status(&app.chat(&chat_body(X), &tagged).await),
        "miss"
    );
    let old = entry_answering(&app, X).unwrap();
    assert_eq!(ask(&app, "b", X).await, "exact");
    assert_eq!(ask(&app, "c", X).await, "exact");
    // Another key that leads to the same answer (as a paraphrase's or a prefetched
    // wording's alias does).
    let alias: reprise_cache::Digest = [7; 32];
    let old_entry = app.state.store.get(old).await.unwrap();
    app.state.store.alias(alias, &old_entry).await;
    let refreshed = || {
        app.state
            .store
            .entries()
            .into_iter()
            .find(|e| e.origin == Origin::Refresh && e.text == format!("You asked: {X}"))
    };
    assert!(
        eventually(WAIT, || refreshed().is_some()).await,
        "{:?}",
        stats(&app)
    );
    let new = refreshed().unwrap();
    assert_ne!(new.id, old);
    assert_eq!(new.tags, ["doc-9"], "the renewed entry keeps its tags");
    // The alias follows the renewed entry.
    assert!(
        eventually(WAIT, || app.state.store.keys().contains(&(alias, new.id))).await,
        "the alias points at the renewed entry"
    );
    assert!(probe
        .inner
        .requests()
        .iter()
        .any(|r| r.priority == Priority::Background));
    assert!(stats(&app).refreshed >= 1);
    // The exact key now leads to the renewed entry, which outlives the old one.
    let calls = probe.inner.calls();
    let mut gone = false;
    let deadline = tokio::time::Instant::now() + WAIT;
    while tokio::time::Instant::now() < deadline {
        if app.state.store.get(old).await.is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the old entry expires");
    let r = app.chat(&chat_body(X), &[("x-reprise-session", "d")]).await;
    assert_eq!(cache_status(&r), "exact");
    assert_eq!(probe.inner.calls(), calls, "served without the backend");
    let via_alias = app
        .state
        .store
        .get_by_key(&alias)
        .await
        .expect("alias alive");
    assert_eq!(via_alias.id, new.id);
}

/// The counts saved in Redis, if any.
async fn saved_counts(tier: &RedisTier) -> Option<Snapshot> {
    let bytes = tier
        .get_blob(reprise::prefetch::BLOB_NAME, usize::MAX)
        .await
        .expect("redis answers")?;
    Some(serde_json::from_slice(&bytes).expect("saved counts decode"))
}

/// A saved model names the embedder that made its vectors: restored under that embedder the
/// vectors come back with the counts; under another (a changed model) the counts only, as
/// its vectors would be compared with vectors of another space.
async fn vectors_stay_with_their_embedder(tier: &RedisTier, saved: &Snapshot) {
    let made_by = saved.embedder.clone().expect("the embedder is named");
    let vectors = |snap: &Snapshot| {
        snap.namespaces
            .iter()
            .flat_map(|n| &n.nodes)
            .filter(|n| n.embedding.is_some())
            .count()
    };
    assert!(vectors(saved) > 0, "{saved:?}");
    let same = reprise::prefetch::Prefetcher::new(prefetch_config(true).prefetch);
    let mut fingerprint = [0u8; 32];
    hex::decode_to_slice(&made_by, &mut fingerprint).unwrap();
    same.set_embedder(fingerprint);
    let restored = same.restore(tier).await.unwrap();
    assert!(restored > 0);
    assert_eq!(vectors(&same.export()), vectors(saved));
    let other = reprise::prefetch::Prefetcher::new(prefetch_config(true).prefetch);
    other.set_embedder([7; 32]);
    assert_eq!(other.restore(tier).await.unwrap(), restored);
    let export = other.export();
    assert_eq!(vectors(&export), 0, "{export:?}");
    assert!(export
        .namespaces
        .iter()
        .flat_map(|n| &n.clusters)
        .all(|c| c.embedding.is_none()));
}

/// Follow-ups linked by session in namespace `ns` of `snap`.
fn session_links(snap: &Option<Snapshot>, ns: &str) -> f64 {
    snap.iter()
        .flat_map(|s| &s.namespaces)
        .filter(|n| n.name == ns)
        .map(|n| n.single)
        .sum()
}

#[tokio::test]
async fn the_worker_saves_the_counts_to_redis_while_serving() {
    let server = RedisServer::start();
    let redis = RedisConfig {
        url: Some(server.url()),
        ..RedisConfig::default()
    };
    let mut config = prefetch_config(true);
    config.redis = redis.clone();
    config.prefetch.persist_interval_secs = 0.2;
    let (app, _probe) = spawn_probe_replica(config, ScriptConfig::default()).await;
    let reader = RedisTier::connect(redis, "reader".into()).await.unwrap();
    for i in 0..3 {
        let s = format!("learn-{i}");
        ask(&app, &s, X).await;
        ask(&app, &s, Y).await;
    }
    assert!(eventually(WAIT, || stats(&app).links >= 3).await);
    // Saved by the running worker: the server is neither stopped nor dropped.
    let saved = eventually_async(WAIT, || async {
        session_links(&saved_counts(&reader).await, "default") > 0.0
    });
    assert!(saved.await, "the counts reach Redis while serving");
    // And again as more is learned (every interval, not once).
    for i in 0..2 {
        let s = format!("later-{i}");
        let h = [
            ("x-reprise-session", s.as_str()),
            ("x-reprise-namespace", "later"),
        ];
        assert_eq!(app.chat(&chat_body(X), &h).await.status(), 200);
        assert_eq!(app.chat(&chat_body(Y), &h).await.status(), 200);
    }
    let saved = eventually_async(WAIT, || async {
        session_links(&saved_counts(&reader).await, "later") > 0.0
    });
    assert!(saved.await, "later counts saved too");
}

#[tokio::test]
async fn predictions_survive_a_restart_through_the_shutdown_save() {
    let server = RedisServer::start();
    let redis = RedisConfig {
        url: Some(server.url()),
        ..RedisConfig::default()
    };
    let mut config = prefetch_config(true);
    config.redis = redis.clone();
    // No periodic save during the test: only the shutdown writes the counts.
    config.prefetch.persist_interval_secs = 3600.0;
    let (app, _probe) = spawn_probe_replica(config, ScriptConfig::default()).await;
    let reader = RedisTier::connect(redis.clone(), "reader".into())
        .await
        .unwrap();
    for i in 0..3 {
        let s = format!("learn-{i}");
        ask(&app, &s, X).await;
        ask(&app, &s, Y).await;
    }
    assert!(eventually(WAIT, || stats(&app).links >= 3).await);
    let before = saved_counts(&reader).await;
    assert_eq!(
        session_links(&before, "default"),
        0.0,
        "nothing saved yet: {before:?}"
    );
    app.shutdown().await;
    let saved = saved_counts(&reader).await;
    assert!(session_links(&saved, "default") > 0.0, "{saved:?}");
    vectors_stay_with_their_embedder(&reader, saved.as_ref().unwrap()).await;

    // A new process: empty cache (no Redis tier for entries), counts restored by the worker.
    let (app, probe) = spawn_probe(prefetch_config(true), ScriptConfig::default()).await;
    let second = RedisTier::connect(redis, "second".into()).await.unwrap();
    let p = app.state.prefetch.clone().unwrap();
    assert!(p.export().namespaces.is_empty());
    p.attach_redis(second);
    assert!(
        eventually(WAIT, || !p.export().namespaces.is_empty()).await,
        "counts restored"
    );
    // X is a miss here (a new entry); it borrows the restored follow-ups of the old X.
    assert_eq!(ask(&app, "new", X).await, "miss");
    assert!(
        eventually(WAIT, || stats(&app).completed >= 1).await,
        "{:?}",
        stats(&app)
    );
    let calls = probe.inner.calls();
    assert_eq!(ask(&app, "new", Y_PARAPHRASE).await, "prefetch");
    assert_eq!(probe.inner.calls(), calls);
}

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// An app on the real llama backend (SmolLM2, one thread, two sequences).
async fn spawn_llama(mut config: Config, max_tokens: u32) -> (TestApp, Arc<LlamaBackend>) {
    config.backend.kind = BackendKind::Llama;
    config.backend.model = models_dir().join(MODEL_FILE);
    config.backend.n_ctx = 2048;
    config.backend.n_threads = 1;
    config.backend.parallel = 2;
    config.backend.default_max_tokens = max_tokens;
    let b = &config.backend;
    assert!(b.model.is_file(), "run scripts/fetch-models.sh");
    let cfg = LlamaConfig {
        model: b.model.clone(),
        n_ctx: b.n_ctx,
        n_threads: b.n_threads,
        parallel: b.parallel,
        max_queue: 16,
        default_max_tokens: b.default_max_tokens,
        ..LlamaConfig::default()
    };
    let engine = Arc::new(
        tokio::task::spawn_blocking(move || LlamaBackend::load(cfg))
            .await
            .unwrap()
            .expect("model loads"),
    );
    (spawn_app(config, engine.clone()).await, engine)
}

#[tokio::test]
async fn llama_backend_prefetches_a_follow_up() {
    let (app, engine) = spawn_llama(prefetch_config(true), 8).await;
    let ask = |session: &'static str, text: &'static str| {
        let app = &app;
        async move {
            let body = json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
                              "max_tokens": 8, "temperature": 0});
            let r = app.chat(&body, &[("x-reprise-session", session)]).await;
            assert_eq!(r.status(), 200);
            let status = cache_status(&r);
            (status, content(r).await)
        }
    };
    for s in ["l1", "l2", "l3"] {
        ask(s, X).await;
        ask(s, Y).await;
    }
    assert!(eventually(WAIT, || stats(&app).links >= 3).await);
    forget(&app, entry_asked(&app, Y)).await;
    let generated = engine.stats().completed;
    assert_eq!(ask("new", X).await.0, "exact");
    assert!(
        eventually(Duration::from_secs(120), || stats(&app).completed >= 1).await,
        "{:?}",
        stats(&app)
    );
    assert!(
        engine.stats().completed > generated,
        "the engine generated it"
    );
    let (status, _) = ask("new", Y_PARAPHRASE).await;
    assert_eq!(status, "prefetch");
    let (status, _) = ask("again", Y_PARAPHRASE).await;
    assert_eq!(status, "exact");
}

/// Other wordings of `Y`'s question, and a look-alike question that needs another answer.
const Y_SO: &str = "How do I reset my password?";
const Y_OTHER: &str = "Where do I go to reset my password?";
const Z_LOOKALIKE: &str = "I didn't get the password reset email.";

/// Learns that `Y` follows `X` (in `Y_SO` twice, `Y_OTHER` once; the look-alike once).
async fn learn_y_after_x(mut config: Config) -> (TestApp, Probe) {
    // The semantic tier matches no paraphrase here: a hit can only come from the prefetch
    // and the aliases of its cluster's wordings.
    config.semantic.threshold = 0.99;
    // The look-alike, seen once after X, stays below the bar and is not prefetched itself.
    config.prefetch.min_probability = 0.3;
    let (app, probe) = spawn_probe(config, ScriptConfig::default()).await;
    let turn = after_x;
    // X, then Y in its most used wording twice, in another wording once; the look-alike once.
    for q in [Y_SO, Y_SO, Y_OTHER, Z_LOOKALIKE] {
        app.chat(&convo(&[("system", "You are terse."), ("user", X)]), &[])
            .await;
        let r = app.chat(&turn("You are terse.", q), &[]).await;
        assert_eq!(r.status(), 200);
        assert_eq!(content(r).await, format!("You asked: {q}"));
    }
    assert!(eventually(WAIT, || stats(&app).links >= 4).await);
    let clusters = app.state.prefetch.as_ref().unwrap().clusters("default");
    let y_cluster = clusters
        .iter()
        .find(|c| c.iter().any(|w| w == Y_SO))
        .unwrap();
    assert!(y_cluster.iter().any(|w| w == Y_OTHER), "{clusters:?}");
    assert!(!y_cluster.iter().any(|w| w == Z_LOOKALIKE), "{clusters:?}");
    (app, probe)
}

/// Lets two new contexts reach X, so that Y is prefetched in each (see [`learn_y_after_x`]);
/// returns the backend's calls once that is done.
async fn prefetch_y_in_two_new_contexts(app: &TestApp, probe: &Probe) -> usize {
    // New contexts reach X: Y is prefetched in its most used wording.
    for system in ["You are kind.", "You are brief."] {
        let r = app
            .chat(&convo(&[("system", system), ("user", X)]), &[])
            .await;
        assert_eq!(cache_status(&r), "miss");
    }
    assert!(
        eventually(WAIT, || stats(app).completed >= 2).await,
        "{:?}",
        stats(app)
    );
    probe.inner.calls()
}

/// The turn `q` after X under `system`.
fn after_x(system: &str, q: &str) -> serde_json::Value {
    let x_answer = format!("You asked: {X}");
    convo(&[
        ("system", system),
        ("user", X),
        ("assistant", &x_answer),
        ("user", q),
    ])
}

#[tokio::test]
async fn a_follow_up_in_another_known_wording_is_served_from_the_prefetch() {
    let (app, probe) = learn_y_after_x(prefetch_config(true)).await;
    let calls = prefetch_y_in_two_new_contexts(&app, &probe).await;
    let turn = after_x;
    // Asked in the other wording: served from the prefetched answer, no backend call.
    let r = app.chat(&turn("You are kind.", Y_OTHER), &[]).await;
    assert_eq!(cache_status(&r), "prefetch");
    assert_eq!(content(r).await, format!("You asked: {Y_SO}"));
    assert_eq!(probe.inner.calls(), calls, "no backend call for the hit");
    // The look-alike of another question is not served that answer.
    let r = app.chat(&turn("You are brief.", Z_LOOKALIKE), &[]).await;
    assert_ne!(cache_status(&r), "prefetch");
    assert_eq!(content(r).await, format!("You asked: {Z_LOOKALIKE}"));
}

/// Once a rule turns matching by meaning off for the namespace, a prefetched answer serves
/// the wording it was generated for only, never the other wordings its cluster learned.
#[tokio::test]
async fn no_other_wording_is_served_a_prefetch_where_meaning_is_off() {
    let (app, probe) = learn_y_after_x(prefetch_config(true)).await;
    let doc = "[[semantic.rules]]\nnamespace = \"default\"\nenabled = false\n";
    let doc = reprise::policy::PolicyDocument::from_toml(doc).unwrap();
    reprise::policy::apply(&app.state, doc).await.unwrap();
    prefetch_y_in_two_new_contexts(&app, &probe).await;
    let r = app.chat(&after_x("You are kind.", Y_SO), &[]).await;
    assert_eq!(cache_status(&r), "prefetch", "its own wording is served");
    let r = app.chat(&after_x("You are brief.", Y_OTHER), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert_eq!(content(r).await, format!("You asked: {Y_OTHER}"));
}

/// A phrase of every proposal request (its instructions), for the scripted backend's rule.
const PROPOSAL_MARK: &str = "most likely to ask next";

/// Proposal requests the backend was sent.
fn proposals_asked(probe: &Probe) -> usize {
    probe
        .inner
        .requests()
        .into_iter()
        .filter(|r| format!("{:?}", r.input).contains(PROPOSAL_MARK))
        .count()
}

#[tokio::test]
async fn the_model_proposes_follow_ups_that_traffic_has_not_shown() {
    let mut config = prefetch_config(false);
    config.prefetch.propose = true;
    let other = "How do I delete my account?";
    let script = ScriptConfig {
        rules: vec![(
            PROPOSAL_MARK.into(),
            format!("Here are the questions:\n1. {Y}\n2. {other}\n3. Can I pay by card?"),
        )],
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(config, script).await;
    let answer = format!("You asked: {X}");
    // Nothing was learned yet: only the model can guess what comes after X.
    let r = app.chat(&convo(&[("user", X)]), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert!(
        eventually(WAIT, || {
            let s = stats(&app);
            s.proposed == 2 && s.completed + s.skipped + s.cancelled + s.proposals >= s.queued
        })
        .await,
        "{:?}",
        stats(&app)
    );
    // One proposal, at background priority, quoting the conversation.
    let proposals: Vec<GenRequest> = probe
        .inner
        .requests()
        .into_iter()
        .filter(|r| format!("{:?}", r.input).contains(PROPOSAL_MARK))
        .collect();
    assert_eq!(proposals.len(), 1);
    assert_eq!(proposals[0].priority, Priority::Background);
    assert!(format!("{:?}", proposals[0].input).contains(&answer));
    // Its first two questions were prefetched in the conversation's context (the third is
    // beyond `propose_questions`).
    for q in [Y, other] {
        let r = app
            .chat(
                &convo(&[("user", X), ("assistant", &answer), ("user", q)]),
                &[],
            )
            .await;
        assert_eq!(cache_status(&r), "prefetch", "{q}");
        assert_eq!(content(r).await, format!("You asked: {q}"));
    }
    let r = app
        .chat(
            &convo(&[
                ("user", X),
                ("assistant", &answer),
                ("user", "Can I pay by card?"),
            ]),
            &[],
        )
        .await;
    assert_eq!(cache_status(&r), "miss");
    // Every new answer gets its proposal, once: the same answer again asks nothing more.
    let proposals = || proposals_asked(&probe);
    assert!(
        eventually(WAIT, || {
            let s = stats(&app);
            s.active == 0 && s.waiting == 0 && proposals() == 4
        })
        .await,
        "{:?} after {} proposals",
        stats(&app),
        proposals()
    );
    let r = app.chat(&convo(&[("user", X)]), &[]).await;
    assert_eq!(cache_status(&r), "exact");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(proposals(), 4);
}

/// A proposal that fails is charged its reserve against the token budget (what it decoded
/// is not known) but not counted as tokens generated: the tokens metric counts what the
/// backend is known to have decoded.
#[tokio::test]
async fn a_failed_proposal_counts_no_tokens_generated() {
    let mut config = prefetch_config(false);
    config.prefetch.propose = true;
    let script = ScriptConfig {
        rules: vec![(PROPOSAL_MARK.into(), format!("1. {Y}"))],
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(config, script).await;
    // Only background requests fail: the user's is answered, the proposal is refused.
    probe.counts.fail_background.store(true, Ordering::SeqCst);
    let r = app.chat(&convo(&[("user", X)]), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    content(r).await;
    assert!(
        eventually(WAIT, || {
            let s = stats(&app);
            s.cancelled >= 1 && s.active == 0
        })
        .await,
        "{:?}",
        stats(&app)
    );
    let s = stats(&app);
    assert_eq!((s.proposals, s.proposed, s.tokens), (0, 0, 0), "{s:?}");
    let asked = probe.counts.background_started.load(Ordering::SeqCst);
    assert!(asked >= 1, "the proposal was asked");
}

/// Names the admin token of this test binary (the value is set by [`admin_tenant_config`]).
const ADMIN_TOKEN_VAR: &str = "REPRISE_TEST_PREFETCH_ADMIN_TOKEN";

/// Keys required, one tenant `t` (key `sk-t`) with `policy`, and an admin token.
fn admin_tenant_config(policy: &str) -> Config {
    std::env::set_var(ADMIN_TOKEN_VAR, "pr3fetch");
    let mut c = prefetch_config(false);
    c.server.admin_token_env = Some(ADMIN_TOKEN_VAR.into());
    c.auth.required = true;
    c.tenants = reprise::policy::PolicyDocument::from_toml(&tenant_doc(policy))
        .unwrap()
        .tenants
        .unwrap();
    c
}

fn tenant_doc(policy: &str) -> String {
    format!("[[tenants]]\nname = \"t\"\napi_keys = [\"sk-t\"]\n[tenants.policy]\n{policy}\n")
}

#[tokio::test]
async fn nothing_is_generated_in_the_background_for_a_read_only_tenant() {
    let mut config = admin_tenant_config("");
    config.prefetch.propose = true;
    let script = ScriptConfig {
        rules: vec![(PROPOSAL_MARK.into(), format!("1. {Y}"))],
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(config, script).await;
    let key = [("authorization", "Bearer sk-t")];
    let proposals = || proposals_asked(&probe);
    // While it may write: X is answered, the model proposes Y, and Y is prefetched.
    let r = app.chat(&convo(&[("user", X)]), &key).await;
    assert_eq!(cache_status(&r), "miss");
    let answer = content(r).await;
    assert!(
        eventually(WAIT, || {
            let s = stats(&app);
            s.proposed == 1
                && s.active == 0
                && s.completed + s.skipped + s.cancelled + s.proposals >= s.queued
        })
        .await,
        "{:?}",
        stats(&app)
    );
    assert_eq!(proposals(), 1);
    // Made read-only, it still reads the prefetched answer; that hit would have its own
    // proposal, but nothing may be stored for this tenant any more, so nothing is asked.
    let r = app
        .client
        .put(app.url("/admin/policies"))
        .bearer_auth("pr3fetch")
        .body(tenant_doc("read_only = true"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let before = stats(&app);
    let r = app
        .chat(
            &convo(&[("user", X), ("assistant", &answer), ("user", Y)]),
            &key,
        )
        .await;
    assert_eq!(cache_status(&r), "prefetch");
    // The hit is learned from, and nothing is queued for it.
    assert!(
        eventually(WAIT, || stats(&app).observations > before.observations).await,
        "{:?}",
        stats(&app)
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stats(&app).queued, before.queued, "{:?}", stats(&app));
    assert_eq!(proposals(), 1, "{:?}", stats(&app));
    assert_eq!(stats(&app).proposals, 1);
}

#[tokio::test]
async fn proposals_are_off_by_default() {
    assert!(!reprise::prefetch::PrefetchConfig::default().propose);
    let script = ScriptConfig {
        rules: vec![(PROPOSAL_MARK.into(), Y.to_string())],
        ..ScriptConfig::default()
    };
    let (app, probe) = spawn_probe(prefetch_config(false), script).await;
    let r = app.chat(&convo(&[("user", X)]), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    assert!(eventually(WAIT, || stats(&app).observations >= 1).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(probe.inner.calls(), 1, "only the answer itself");
    assert_eq!(stats(&app).proposed, 0);
}

#[tokio::test]
async fn llama_backend_proposes_follow_ups() {
    let mut config = prefetch_config(true);
    config.prefetch.propose = true;
    let (app, _) = spawn_llama(config, 16).await;
    let question = "How do I reset my password?";
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": question}],
                      "max_tokens": 16, "temperature": 0});
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "miss");
    let answer = content(r).await;
    // The model proposes follow-ups; each is generated by the engine in the background.
    assert!(
        eventually(Duration::from_secs(120), || {
            let s = stats(&app);
            s.proposed >= 1 && s.completed + s.skipped + s.cancelled + s.proposals >= s.queued
        })
        .await,
        "{:?}",
        stats(&app)
    );
    let prefetched: Vec<String> = app
        .state
        .store
        .entries()
        .into_iter()
        .filter(|e| e.origin == Origin::Prefetch)
        .map(|e| e.prompt.clone())
        .filter(|p| !p.is_empty())
        .collect();
    assert!(!prefetched.is_empty(), "{:?}", stats(&app));
    // The user asks what the model proposed, with the history: answered from the prefetch.
    let next = &prefetched[0];
    let body = json!({"model": MODEL, "messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": next}],
        "max_tokens": 16, "temperature": 0});
    let r = app.chat(&body, &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(cache_status(&r), "prefetch", "{next}");
}

#[tokio::test]
async fn wordings_used_alike_are_regrouped_and_share_the_prefetch() {
    // Y and its paraphrase (cosine 0.89) start as two clusters (cluster_threshold 0.95) and
    // are not served for each other (semantic threshold 0.97): only their use joins them.
    let mut config = prefetch_config(true);
    config.semantic.threshold = 0.97;
    config.prefetch.cluster_threshold = 0.95;
    // Apart, each wording follows X about half the time: too rare to prefetch; together,
    // nearly always.
    config.prefetch.min_probability = 0.6;
    let (app, probe) = spawn_probe(config, ScriptConfig::default()).await;
    let together = |app: &TestApp| {
        app.state
            .prefetch
            .as_ref()
            .unwrap()
            .clusters(reprise::headers::DEFAULT_NAMESPACE)
            .iter()
            .any(|c| c.iter().any(|w| w == Y) && c.iter().any(|w| w == Y_PARAPHRASE))
    };
    // Four times each: counts decay, so three sightings are a little under three.
    for i in 0..4 {
        for (j, y) in [Y, Y_PARAPHRASE].into_iter().enumerate() {
            let s = format!("s{i}-{j}");
            ask(&app, &s, X).await;
            ask(&app, &s, y).await;
        }
    }
    assert!(eventually(WAIT, || stats(&app).links >= 8).await);
    assert!(
        eventually(WAIT, || stats(&app).merges >= 1).await,
        "{:?}",
        stats(&app)
    );
    assert!(together(&app));
    // The paraphrase's entry is gone: a new session reaching X gets Y prefetched, and the
    // paraphrase finds that answer through its alias.
    forget(&app, entry_asked(&app, Y_PARAPHRASE)).await;
    let calls = probe.inner.calls();
    // (Jobs may have run while the wordings were learned: they found Y answered.)
    let before = stats(&app);
    ask(&app, "new", X).await;
    assert!(
        eventually(WAIT, || {
            let s = stats(&app);
            s.completed + s.skipped > before.completed + before.skipped && s.active == 0
        })
        .await,
        "{:?}",
        stats(&app)
    );
    let status = ask(&app, "new", Y_PARAPHRASE).await;
    assert!(
        status == "exact" || status == "prefetch",
        "served from the alias, got {status}"
    );
    assert!(
        probe.inner.calls() <= calls + 1,
        "at most the prefetch generated"
    );
}

#[tokio::test]
async fn a_follow_up_the_cache_answers_semantically_is_not_generated_and_names_the_answer() {
    let (app, probe) = spawn_probe(prefetch_config(true), ScriptConfig::default()).await;
    let r = app.chat(&chat_body(Y), &[]).await;
    assert_eq!(cache_status(&r), "miss");
    let y = entry_asked(&app, Y);
    let calls = probe.inner.calls();
    // The paraphrase as a prefetch would ask it: the semantic tier already answers it.
    let got = in_background(&app, Y_PARAPHRASE).await;
    match got {
        // The entry it would be served: the prefetcher points the question's other
        // wordings at it.
        reprise::generate::Background::Cached(entry) => assert_eq!(entry.id, y),
        other => panic!("expected the cached answer, got {other:?}"),
    }
    assert_eq!(probe.inner.calls(), calls, "nothing generated");
}

/// `run` stops the prefetcher on shutdown, after it learned every observation already made,
/// and saves its counts in Redis: a new process restores them.
#[tokio::test]
async fn run_saves_the_learned_counts_on_shutdown() {
    let server = RedisServer::start();
    let mut config = prefetch_config(false);
    config.backend.kind = BackendKind::Fake;
    config.redis.url = Some(server.url());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(reprise::run(listener, config.clone(), async {
        let _ = stopped.await;
    }));
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let ask = |session: String, text: &'static str| {
        let req = client
            .post(&url)
            .header("x-reprise-session", session)
            .json(&chat_body(text));
        async move { req.send().await.map_or(0, |r| r.status().as_u16()) }
    };
    // Ready once the first request is answered.
    let ready = eventually_async(Duration::from_secs(10), || async {
        ask("warm-up".into(), X).await == 200
    });
    assert!(ready.await, "the server came up");
    for i in 0..3 {
        assert_eq!(ask(format!("learn-{i}"), X).await, 200);
        assert_eq!(ask(format!("learn-{i}"), Y).await, 200);
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();

    let tier = RedisTier::connect(config.redis.clone(), "check".into())
        .await
        .unwrap();
    let fresh = reprise::prefetch::Prefetcher::new(config.prefetch.clone());
    let restored = fresh.restore(&tier).await.unwrap();
    assert!(
        restored > 0,
        "the counts learned before shutdown were saved"
    );
    assert!(!fresh.export().namespaces.is_empty());
}

/// A background generation whose backend never sends a first token gives up at the
/// first-token deadline (and the backend stream is dropped), instead of holding prefetch
/// forever.
#[tokio::test]
async fn a_background_generation_that_never_starts_times_out() {
    let mut config = prefetch_config(false);
    config.server.first_token_timeout_secs = 0.5;
    let script = ScriptConfig {
        first_token_delay: Duration::from_secs(3600),
        ..ScriptConfig::default()
    };
    let (app, backend) = spawn_fake(config, script).await;
    let got = tokio::time::timeout(WAIT, in_background(&app, "What will I ask next?"))
        .await
        .expect("the background generation waited for a token that never came");
    assert!(
        matches!(
            got,
            reprise::generate::Background::Failed {
                error: BackendError::Timeout,
                decoded: 0
            }
        ),
        "{got:?}"
    );
    assert_eq!(backend.calls(), 1);
    // The abandoned flight stopped the backend's stream.
    let stopped = eventually(WAIT, || backend.active() == 0).await;
    assert!(stopped, "the backend still generates");
}

/// A background generation cut off midway reports what it decoded (what the prefetch token
/// budget is charged for it), and stores nothing.
#[tokio::test]
async fn a_cut_off_background_generation_reports_what_it_decoded() {
    let (app, backend) = spawn_fake(prefetch_config(false), ScriptConfig::default()).await;
    backend.set_failure(reprise_backend::fake::Failure::AfterChunks(3));
    let got = in_background(&app, "What will I ask after this one?").await;
    assert!(
        matches!(
            got,
            reprise::generate::Background::Failed { decoded: 3, .. }
        ),
        "{got:?}"
    );
    app.state.store.run_pending_tasks().await;
    assert_eq!(app.state.store.entry_count(), 0);
}

/// A prefetched follow-up carries the invalidation tags of the answer it follows: a tag
/// delete that removes that answer removes the prefetched one too.
#[tokio::test]
async fn a_prefetched_follow_up_carries_the_tags_of_the_answer_it_follows() {
    std::env::set_var("REPRISE_TEST_PREFETCH_TAGS_TOKEN", "pr3f");
    let mut config = prefetch_config(true);
    config.server.admin_token_env = Some("REPRISE_TEST_PREFETCH_TAGS_TOKEN".into());
    let (app, _probe) = spawn_probe(config, ScriptConfig::default()).await;
    // X is first asked with a tag: its entry carries it.
    let tagged = [
        ("x-reprise-session", "learn-0"),
        ("x-reprise-tags", "pricing"),
    ];
    assert_eq!(app.chat(&chat_body(X), &tagged).await.status(), 200);
    assert_eq!(ask(&app, "learn-0", Y).await, "miss");
    for i in 1..3 {
        let s = format!("learn-{i}");
        ask(&app, &s, X).await;
        ask(&app, &s, Y).await;
    }
    assert!(eventually(WAIT, || stats(&app).links >= 3).await);
    forget(&app, entry_answering(&app, Y).expect("Y was answered")).await;
    let before = stats(&app);
    assert_eq!(ask(&app, "new", X).await, "exact");
    assert!(eventually(WAIT, || stats(&app).completed > before.completed).await);
    let prefetched = entry_answering(&app, Y).expect("Y was prefetched");
    let entry = app.state.store.get(prefetched).await.expect("held");
    assert_eq!(entry.tags, ["pricing"]);
    let r = app
        .client
        .delete(app.url("/admin/tags/pricing"))
        .bearer_auth("pr3f")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    app.state.store.run_pending_tasks().await;
    assert!(app.state.store.get(prefetched).await.is_none());
}

/// Generates the one-turn chat `question` in the background in the default namespace, as
/// a prefetch job does (cached answers first).
async fn in_background(app: &TestApp, question: &str) -> reprise::generate::Background {
    let req = GenRequest {
        model: "fake".into(),
        input: reprise_backend::Input::Chat(vec![reprise_backend::ChatMessage::new(
            "user", question,
        )]),
        params: Default::default(),
        priority: Priority::Background,
        extra: Default::default(),
        backend: None,
    };
    reprise::generate::generate_in_background(
        &app.state,
        reprise::headers::DEFAULT_NAMESPACE,
        reprise::openai::Endpoint::Chat,
        req,
        Origin::Prefetch,
        true,
    )
    .await
}

/// Counts too large for the Redis write queue with their vectors are saved without them, and
/// counts too large even then are not saved (and say so): never a write the queue drops
/// while the worker believes it saved.
#[tokio::test]
async fn saved_counts_leave_their_vectors_out_rather_than_be_dropped() {
    use reprise::prefetch::{NamespaceSnapshot, NodeSnapshot};
    let server = RedisServer::start();
    let redis = RedisConfig {
        url: Some(server.url()),
        write_queue_bytes: 256 * 1024,
        ..RedisConfig::default()
    };
    let tier = RedisTier::connect(redis, "saver".into()).await.unwrap();
    let model = |nodes: usize, prompt_bytes: usize| {
        let p = reprise::prefetch::Prefetcher::new(prefetch_config(true).prefetch);
        p.set_embedder([3; 32]);
        let mut snap = p.export();
        snap.embedder = Some(hex::encode([3; 32]));
        snap.namespaces.push(NamespaceSnapshot {
            name: "ns".into(),
            multi: 0.0,
            single: 0.0,
            nodes: (0..nodes)
                .map(|i| NodeSnapshot {
                    id: EntryId::random().to_string(),
                    prompt: format!("{i:0prompt_bytes$}"),
                    embedding: Some(vec![0.05; 384]),
                    seen: 2.0,
                    next: Vec::new(),
                    cluster: None,
                })
                .collect(),
            clusters: Vec::new(),
            families: Vec::new(),
        });
        assert_eq!(p.import(&snap), nodes);
        p
    };
    // About 2.6 KB a node with its vector: 100 nodes pass half the queue, not without them.
    let p = model(100, 16);
    assert!(p.persist(&tier), "saved");
    tier.flush().await.unwrap();
    let saved = saved_counts(&tier).await.expect("saved");
    let nodes: Vec<_> = saved.namespaces.iter().flat_map(|n| &n.nodes).collect();
    assert_eq!(nodes.len(), 100, "every node's counts");
    assert!(nodes.iter().all(|n| n.embedding.is_none()), "no vectors");

    // Over half the queue without vectors too: not saved, and the save says so.
    let big = model(300, 1024);
    assert!(!big.persist(&tier));
    tier.flush().await.unwrap();
    let kept = saved_counts(&tier).await.expect("the earlier save stays");
    assert_eq!(
        kept.namespaces.iter().map(|n| n.nodes.len()).sum::<usize>(),
        100
    );
}
