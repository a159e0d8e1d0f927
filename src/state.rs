//! The shared state of one server: configuration, backend, cache tiers, in-flight
//! generations, metrics. Built once at start-up ([`AppState::build`]) or by tests from parts
//! ([`AppState::new`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use reprise_backend::fake::{ScriptConfig, ScriptedBackend};
use reprise_backend::llama::LlamaBackend;
use reprise_backend::openai::{OpenAiBackend, OpenAiConfig};
use reprise_backend::Backend;
use reprise_cache::redis::RedisTier;
use reprise_cache::semantic::SemanticIndex;
use reprise_cache::Store;
use reprise_embedder::{Embedder, EmbedderConfig, FastEmbedder};

use crate::config::{BackendKind, Config};
use crate::cpu::CpuPool;
use crate::flight::{Flights, InFlightParaphrases};
use crate::metrics::Metrics;
use crate::observe::Observer;
use crate::policy::Policies;
use crate::prefetch::Prefetcher;
use crate::reqlog::RequestLog;
use crate::routes::Router;

/// Everything a request handler needs.
pub struct AppState {
    /// Validated configuration.
    pub config: Config,
    /// Where misses go: the [`Router`] over every backend, as one backend (a generation
    /// goes to the backend serving its model).
    pub backend: Arc<dyn Backend>,
    /// The backends and routes: which backend answers a request, and its fallback.
    pub router: Arc<Router>,
    /// Model names accepted; empty means any (an upstream decides).
    pub models: Vec<String>,
    /// The cache: memory (L1), Redis (L2, when configured), semantic index (when enabled).
    pub store: Store,
    /// Turns prompts into vectors, when the semantic tier is on.
    pub embedder: Option<Arc<dyn Embedder>>,
    /// Generations in flight, by exact key.
    pub flights: Flights,
    /// Expired entries being regenerated (stale-while-revalidate): one regeneration per
    /// entry, whichever of its keys asked.
    pub revalidating: parking_lot::Mutex<std::collections::HashSet<reprise_cache::EntryId>>,
    /// Generations in flight, by semantic partition (paraphrases follow them).
    pub paraphrases: InFlightParaphrases,
    /// Where the request path's CPU-bound work runs (the false-hit gate, the embedder's
    /// window), off the async workers.
    pub cpu: CpuPool,
    /// Metric handles.
    pub metrics: Metrics,
    /// Per-request JSON log, when configured.
    pub request_log: Option<RequestLog>,
    /// Per-interval rollups of the requests served (`GET /admin/stats`).
    pub stats: crate::stats::Stats,
    /// Traces of requests, exported when `[tracing] otlp_endpoint` is set.
    pub traces: Option<crate::otel::Traces>,
    /// Completed rebuilds of this replica's memory and index from Redis.
    pub rebuilds: std::sync::atomic::AtomicU64,
    /// Asks the periodic snapshot ([`crate::config::CacheConfig::snapshot_interval_secs`])
    /// to save now: after an admin delete, so that a crash cannot bring deleted answers back.
    pub snapshot_wanted: Arc<tokio::sync::Notify>,
    /// Follow-up prediction and background generation, when enabled.
    pub prefetch: Option<Arc<Prefetcher>>,
    /// Where served requests are reported (to the prefetcher), when prefetch is on.
    pub observer: Option<Observer>,
    /// The policies that can change while running (semantic defaults and rules, tenants);
    /// load once per request.
    pub policies: ArcSwap<Policies>,
    /// Serialises policy changes, local and shared (held while a change is published).
    pub policy_change: tokio::sync::Mutex<()>,
    /// The secret that signs policy versions shared through Redis (`server.policy_key_env`).
    pub(crate) policy_key: Option<crate::policy::PolicyKey>,
    /// Checks of semantic hits in the background (`semantic.verify_hits`).
    pub(crate) verifier: crate::verify::Verifier,
    /// Verdicts on answers matched by meaning, per tenant: the learned thresholds.
    pub bounds: crate::bounds::Bounds,
    /// Canonical forms of context messages, for context equivalence
    /// (`lookup::equivalence`).
    pub context_forms: crate::lookup::equivalence::Forms,
    /// Responses that can still be given a verdict (`POST /v1/feedback`).
    pub responses: crate::feedback::Responses,
    /// Each tenant admin's changes (deletes, policy changes), within
    /// [`crate::admin::TENANT_CHANGES_PER_MINUTE`].
    pub admin_changes: governor::DefaultKeyedRateLimiter<String>,
    /// The filtered deletes running (each scans every entry here and in Redis): one of the
    /// global admin's and one of any tenant admin's at a time ([`crate::admin::Scans`]).
    pub admin_scans: crate::admin::Scans,
    /// Canary candidates this replica rolled back (the latest
    /// [`crate::policy::MAX_ROLLBACKS`]), for `GET /admin/policies`.
    pub rollbacks: parking_lot::Mutex<std::collections::VecDeque<serde_json::Value>>,
    ready: AtomicBool,
}

impl AppState {
    /// Assembles a state from parts (tests inject a scripted backend or a shared embedder).
    /// Nothing runs in the background until [`crate::tasks::start`].
    pub fn new(
        config: Config,
        backend: Arc<dyn Backend>,
        embedder: Option<Arc<dyn Embedder>>,
    ) -> anyhow::Result<Arc<AppState>> {
        Self::with_redis(config, backend, embedder, None)
    }

    /// Like [`AppState::new`], with a connected Redis tier.
    pub fn with_redis(
        config: Config,
        backend: Arc<dyn Backend>,
        embedder: Option<Arc<dyn Embedder>>,
        redis: Option<RedisTier>,
    ) -> anyhow::Result<Arc<AppState>> {
        let name = config.backend.name.clone();
        Self::with_backends(config, vec![(name, backend)], embedder, redis)
    }

    /// Like [`AppState::with_redis`], with several named backends (`[[backends]]`, in their
    /// order) that `config.routes` choose between.
    pub fn with_backends(
        config: Config,
        backends: Vec<(String, Arc<dyn Backend>)>,
        embedder: Option<Arc<dyn Embedder>>,
        redis: Option<RedisTier>,
    ) -> anyhow::Result<Arc<AppState>> {
        let router = Arc::new(Router::new(backends, &config.routes, &config.slo)?);
        let backend: Arc<dyn Backend> = router.clone();
        let models = router.model_names();
        // The `model` label's values: what is served, allowed or priced; the rest is `other`.
        let labelled = models
            .iter()
            .chain(&config.metrics.models)
            .chain(config.metrics.prices.keys())
            .chain(config.tenants.iter().flat_map(|t| &t.policy.models))
            .cloned();
        let metrics = Metrics::with_models(labelled);
        metrics.slo(config.slo.total_secs, config.slo.ttft_secs);
        let embedder = embedder.filter(|_| config.semantic.enabled);
        let index = embedder.as_ref().map(|e| {
            let index = SemanticIndex::new(e.dim(), config.semantic.index.clone());
            Arc::new(index.for_embedder(e.fingerprint()))
        });
        let evictions = metrics.cache_evictions.clone();
        let store = Store::new(
            config.cache.memory_bytes,
            config.cache.ttl(),
            // Expired entries are kept for the longer stale window, to be served stale.
            config.cache.stale_retention(),
            redis,
            index,
            // Size and expiry only: deletes (admin, namespace, tag, resync) are not evictions.
            Some(Arc::new(move |cause: moka::notification::RemovalCause| {
                if cause.was_evicted() {
                    evictions.increment(1)
                }
            })),
        );
        let request_log = match &config.log.request_log {
            Some(path) => Some(
                RequestLog::open(
                    path,
                    config.log.request_log_max_bytes as usize,
                    config.log.request_log_files,
                )
                .with_context(|| format!("cannot open request log {}", path.display()))?,
            ),
            None => None,
        };
        let traces = crate::otel::Traces::start(&config)
            .context("cannot start exporting traces ([tracing])")?;
        let prefetch = config
            .prefetch
            .enabled
            .then(|| Prefetcher::new(config.prefetch.clone()));
        if let (Some(p), Some(e)) = (&prefetch, &embedder) {
            p.set_embedder(e.fingerprint());
        }
        let observer = prefetch.as_ref().map(|p| p.observer());
        let policies = Policies::from_config(&config, 1)?;
        metrics.policy_version.set(1.0);
        // Memory holds nothing yet: sharing it out scans nothing.
        let memory_shares = policies.memory_shares();
        store.set_memory_shares(
            memory_shares.map(|s| s.of_memory(config.cache.memory_bytes)),
            1,
        );
        if let Some(p) = &prefetch {
            p.set_shares(policies.prefetch_shares());
        }
        let responses = crate::feedback::Responses::new(
            &config.feedback,
            crate::feedback::Budgets::of(&policies, config.feedback.memory_bytes),
        );
        let stats = crate::stats::Stats::new(&config.stats);
        let verifier = crate::verify::Verifier::new(&config.semantic);
        let policy_key = match &config.server.policy_key_env {
            Some(var) => {
                let secret = std::env::var(var).with_context(|| {
                    format!("server.policy_key_env names `{var}`, which is not set")
                })?;
                anyhow::ensure!(
                    !secret.is_empty(),
                    "server.policy_key_env: `{var}` is empty"
                );
                Some(crate::policy::PolicyKey::new(&secret))
            }
            None => None,
        };
        let context_forms =
            crate::lookup::equivalence::Forms::new(config.semantic.context_forms_bytes);
        let bounds = crate::bounds::Bounds::new(config.semantic.entry_evidence_bytes);
        Ok(Arc::new(AppState {
            config,
            backend,
            router,
            models,
            store,
            embedder,
            flights: Flights::default(),
            revalidating: Default::default(),
            paraphrases: Default::default(),
            cpu: CpuPool::per_core(),
            metrics,
            request_log,
            stats,
            traces,
            prefetch,
            observer,
            policies: ArcSwap::from_pointee(policies),
            policy_change: Default::default(),
            rollbacks: Default::default(),
            responses,
            admin_changes: crate::admin::tenant_changes_limiter(),
            admin_scans: Default::default(),
            bounds,
            context_forms,
            verifier,
            policy_key,
            rebuilds: Default::default(),
            snapshot_wanted: Default::default(),
            ready: AtomicBool::new(true),
        }))
    }

    /// Builds the state the configuration describes: loads the model and the embedder
    /// (blocking work runs on the blocking pool; progress is logged); with Redis, the
    /// policies shared by the other replicas replace the file's when there are some.
    pub async fn build(config: Config) -> anyhow::Result<Arc<AppState>> {
        let backends = build_backends(&config).await?;
        let embedder = build_embedder(&config).await?;
        let redis = connect_redis(&config).await?;
        let state = AppState::with_backends(config, backends, embedder, redis)?;
        crate::policy::sync(&state).await;
        Ok(state)
    }

    /// Whether it can serve: started, and some backend is up (one that is down fails its
    /// generations at once, which its routes' fallbacks and stale answers cover).
    pub fn is_ready(&self) -> bool {
        self.accepting() && self.router.any_ready()
    }

    /// Whether it takes requests: started and not stopping. Cache hits are served whatever
    /// the backends' state.
    pub fn accepting(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Marks the server ready or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Refreshes gauges that are read rather than counted.
    pub fn update_gauges(&self) {
        if let Some(r) = self.store.redis() {
            let h = r.health();
            metrics::gauge!("reprise_redis_up").set(if h.up { 1.0 } else { 0.0 });
            metrics::gauge!("reprise_redis_breaker_open").set(if h.breaker_open {
                1.0
            } else {
                0.0
            });
        }
        self.metrics
            .cache_entries
            .set(self.store.entry_count() as f64);
        self.metrics
            .cache_bytes
            .set(self.store.weighted_size() as f64);
        metrics::gauge!("reprise_semantic_entries_with_evidence")
            .set(self.bounds.entries_with_evidence() as f64);
        if let Some(index) = self.store.index() {
            metrics::gauge!("reprise_semantic_index_vectors").set(index.len() as f64);
            let (graphs, widest) = index.graph_summary();
            metrics::gauge!("reprise_semantic_index_graphs").set(graphs as f64);
            // Counted by the index as it searches; exposed from the start.
            metrics::counter!("reprise_semantic_graph_searches_total").increment(0);
            metrics::counter!("reprise_semantic_graph_filtered_searches_total").increment(0);
            metrics::gauge!("reprise_semantic_index_search_width").set(widest as f64);
            for result in ["found", "missed"] {
                metrics::counter!("reprise_semantic_recall_checks_total", "result" => result)
                    .increment(0);
            }
        }
        // Read from each backend as it is now, by name (two backends' lines set from inside
        // them, unnamed, overwrote each other).
        for t in self.router.targets() {
            let load = t.backend.load();
            let background = load.queued.saturating_sub(load.queued_user());
            for (class, n) in [
                ("interactive", load.queued_interactive),
                ("batch", load.queued_batch),
                ("background", background),
            ] {
                metrics::gauge!(crate::metrics::QUEUE_LENGTH, "backend" => t.name.clone(), "class" => class)
                    .set(n as f64);
            }
        }
    }
}

/// Connects the Redis tier when `[redis] url` (or `cluster_urls`) is set. A Redis that is
/// down at start is not an error: the tier reconnects by itself.
pub async fn connect_redis(config: &Config) -> anyhow::Result<Option<RedisTier>> {
    if !config.redis.is_enabled() {
        return Ok(None);
    }
    // The tier makes its metric handles when it connects: the recorder must exist by then,
    // or they record nothing (the test harness connects before building the state).
    crate::metrics::prometheus();
    let replica = format!("{}-{}", std::process::id(), uuid::Uuid::new_v4().simple());
    let tier = RedisTier::connect(config.redis.clone(), replica)
        .await
        .context("invalid [redis] configuration")?;
    Ok(Some(tier))
}

/// Loads the embedder when the semantic tier is enabled.
pub async fn build_embedder(config: &Config) -> anyhow::Result<Option<Arc<dyn Embedder>>> {
    if !config.semantic.enabled {
        return Ok(None);
    }
    let cfg = embedder_config(config);
    tracing::info!(model_dir = %cfg.model_dir.display(), "loading embedder");
    let e = tokio::task::spawn_blocking(move || FastEmbedder::load(cfg))
        .await
        .context("embedder loader panicked")??;
    Ok(Some(Arc::new(e)))
}

/// The local embedder's settings, from `[semantic]`.
pub fn embedder_config(config: &Config) -> EmbedderConfig {
    EmbedderConfig {
        model_dir: config.semantic.model_dir.clone(),
        onnx_runtime: config.semantic.onnx_runtime.clone(),
        batch_wait_us: config.semantic.batch_wait_us,
        max_batch: config.semantic.max_batch,
        batch_tokens: config.semantic.embedder_batch_tokens,
        memory_bytes: config.semantic.embedder_memory_bytes,
        cache_bytes: config.semantic.embedding_cache_bytes,
        queue_texts: config.semantic.embedder_queue_texts,
        queue_bytes: config.semantic.embedder_queue_bytes,
        queue_wait_ms: config.semantic.embedder_queue_wait_ms,
        threads: config.semantic.embedder_threads.max(1),
        ..EmbedderConfig::default()
    }
}

/// Creates the backend of `[backend]` (one backend; see [`build_backends`]).
pub async fn build_backend(config: &Config) -> anyhow::Result<Arc<dyn Backend>> {
    build_one(&config.backend).await
}

/// Builds every backend of the configuration, named: `[[backends]]` in order, or the one
/// `[backend]`.
pub async fn build_backends(config: &Config) -> anyhow::Result<Vec<(String, Arc<dyn Backend>)>> {
    let mut built = Vec::new();
    for b in config.backend_tables() {
        let backend = build_one(b)
            .await
            .with_context(|| format!("backend `{}`", b.name))?;
        built.push((b.name.clone(), backend));
    }
    Ok(built)
}

/// Builds the backend one table describes.
async fn build_one(b: &crate::config::BackendConfig) -> anyhow::Result<Arc<dyn Backend>> {
    // The recorder must exist before a backend records what it found at load.
    crate::metrics::prometheus();
    Ok(match b.kind {
        BackendKind::Fake => Arc::new(ScriptedBackend::new(ScriptConfig {
            model: b.model_name.clone().unwrap_or_else(|| "fake".into()),
            reply: b.fake_reply.clone(),
            rules: Vec::new(),
            first_token_delay: Duration::ZERO,
            token_delay: Duration::from_millis(b.fake_token_delay_ms),
            default_max_tokens: b.default_max_tokens,
            slots: None,
            max_queue: None,
            priority_aging: b.priority_aging(),
            // A served scripted backend keeps no request log: nothing reads it.
            log_len: 0,
        })),
        BackendKind::Openai => {
            let api_key = match &b.api_key_env {
                Some(var) => Some(std::env::var(var).with_context(|| {
                    format!("backend.api_key_env names `{var}`, which is not set")
                })?),
                None => None,
            };
            let mut models = b.models.clone();
            models.extend(b.model_name.clone());
            Arc::new(OpenAiBackend::new(OpenAiConfig {
                base_url: b.base_url.clone().unwrap_or_default(),
                api_key,
                connect_timeout: Duration::from_secs_f64(b.connect_timeout_secs),
                pool_max_idle: b.pool_max_idle,
                models,
                max_concurrent: b.max_concurrent,
                max_queue: b.max_queue,
                priority_aging: b.priority_aging(),
                bound_field: b.max_tokens_field,
            })?)
        }
        BackendKind::Llama => {
            let cfg = b.llama_config();
            tracing::info!(model = %cfg.model.display(), "loading model");
            let backend = tokio::task::spawn_blocking(move || LlamaBackend::load(cfg))
                .await
                .context("model loader panicked")??;
            Arc::new(backend)
        }
    })
}
