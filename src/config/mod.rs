//! Configuration: one TOML file, `REPRISE__SECTION__KEY` environment overrides on top,
//! validated once into [`Config`].
//!
//! Every key has a default, so a file names only what it changes. Unknown keys and bad values
//! are start-up errors that name the key. `reprise.example.toml` at the repository root lists
//! every key with its default; keep it in step with this file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Toml};
use figment::Figment;
use serde::Deserialize;

mod degrade;
mod log;
mod observe;
mod prefetch;
mod routes;
mod semantic;
mod stats;
mod tenants;
mod traces;

pub use degrade::{DegradeConfig, DegradeStep};
pub use log::LogConfig;
pub use observe::{MetricsConfig, Price, SloConfig, MAX_SLO_SECS};
pub use prefetch::PrefetchConfig;
pub use routes::RouteConfig;
pub use semantic::{SemanticConfig, VerifyJudge};
pub use stats::StatsConfig;
use tenants::validate_tenants;
pub use tenants::{
    AuthConfig, CandidateConfig, CandidateMode, TenantConfig, TenantPolicy, UserPriority,
    CLIENT_CONTROLS,
};
pub use traces::{traces_url, TracingConfig};

/// The whole configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// HTTP server.
    pub server: ServerConfig,
    /// Where misses go: the one backend, without `[[backends]]`; with them, only its
    /// request-wide limits apply (`max_tokens_cap`, and `default_max_tokens` as what a request
    /// without `max_tokens` is charged against its tenant's token budget).
    pub backend: BackendConfig,
    /// Several named backends (`[[backends]]`, each a `[backend]` table with a `name`), chosen
    /// by `[[routes]]`; empty: `[backend]` is the only one.
    pub backends: Vec<BackendConfig>,
    /// Which backend answers which requests (`[[routes]]`): by requested model or alias,
    /// tenant and prompt size, each with an optional fallback.
    pub routes: Vec<RouteConfig>,
    /// Exact tier and entry lifetime.
    pub cache: CacheConfig,
    /// Near-duplicate tier.
    pub semantic: SemanticConfig,
    /// Request log.
    pub log: LogConfig,
    /// Latency targets (the dashboard, the alerts and the traces of slow requests use them,
    /// and `[degrade]` as the routes' default).
    pub slo: SloConfig,
    /// What a request does when its backend would answer too late for the SLO.
    pub degrade: DegradeConfig,
    /// Metric labels and prices.
    pub metrics: MetricsConfig,
    /// Per-interval rollups for `GET /admin/stats`.
    pub stats: StatsConfig,
    /// OpenTelemetry traces (off without `otlp_endpoint`).
    pub tracing: TracingConfig,
    /// Shared Redis tier (absent `url`: memory only).
    pub redis: reprise_cache::redis::RedisConfig,
    /// Predictive prefetch and refresh-ahead.
    pub prefetch: PrefetchConfig,
    /// Verdicts on served answers (`POST /v1/feedback`).
    pub feedback: FeedbackConfig,
    /// Whether `/v1` needs an API key.
    pub auth: AuthConfig,
    /// The tenants and their API keys (`[[tenants]]`); none: one implicit tenant, as without
    /// authentication.
    pub tenants: Vec<TenantConfig>,
    /// The file this configuration was read from (`SIGHUP` reads it again); not a key.
    #[serde(skip)]
    pub source: Option<PathBuf>,
}

/// `[server]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on (`reprise serve --listen` overrides it).
    pub listen: SocketAddr,
    /// Largest accepted request body in bytes; larger bodies get 413.
    pub max_body_bytes: usize,
    /// Longest a connection may take to start a request once accepted, and an HTTP/1.1
    /// connection to send a request's headers or to wait idle between requests, in seconds
    /// (closed after that); an HTTP/2 connection is pinged at this interval and closed when
    /// a ping goes unanswered as long.
    pub header_timeout_secs: f64,
    /// Connections open at once at most; one more is closed as soon as it is accepted
    /// (`reprise_connections_refused_total`). Keep it under the process's file-descriptor
    /// limit (`ulimit -n`), less what Redis, the upstream and files take.
    pub max_connections: usize,
    /// Longest a client may take to send a request body, in seconds (408 after that). The
    /// body is read only once the caller is known (with `[auth] required`, a missing or unknown key is a 401 before
    /// it), and a client that trickles its body holds a connection at most this long.
    pub body_timeout_secs: f64,
    /// Longest a request may take, in seconds, counted from its arrival: a non-streaming
    /// request end to end, a streaming one until its first token (504 after that).
    pub request_timeout_secs: f64,
    /// Longest the cache lookup of a request may take (exact and semantic, the conversation's
    /// turn links, embedding and the gate together), in seconds, within the request's time:
    /// past it the request goes on as a miss (`reprise_lookup_timeouts_total`), so a slow
    /// Redis or a long embedder queue delays an answer by at most this much.
    pub lookup_timeout_secs: f64,
    /// Longest a request waits for its first token from the backend, in seconds (504 after
    /// that). Applies to streaming and non-streaming requests.
    pub first_token_timeout_secs: f64,
    /// Longest gap between two tokens of an answer, in seconds: a backend that stalls
    /// mid-answer is cut off there (never cached); a stream then ends with an error event, a
    /// non-streaming request gets 504. Background generations (prefetch, refresh) too. A
    /// forwarded stream (tools, ...) is cut off mid-body after such a gap between chunks; and
    /// an answer holding an upstream slot (forwarded, or passed through other than a read or
    /// an upload) whose client leaves a chunk unread this long is cut off, freeing the slot;
    /// a read's or an upload's answer is cut off when its upstream sends nothing this long.
    pub token_timeout_secs: f64,
    /// On shutdown, longest the server waits for open requests (long streams included) to
    /// end before closing them, in seconds; the snapshot and the Redis write queue are saved
    /// after that either way.
    pub shutdown_timeout_secs: f64,
    /// Name of the environment variable holding the admin token for `/admin/*` endpoints
    /// (unset: those endpoints answer 401 to everyone).
    pub admin_token_env: Option<String>,
    /// Name of the environment variable holding the token `/metrics` asks for
    /// (`Authorization: Bearer`; the admin token is taken too). Without it, `/metrics` is
    /// open where no `[[tenants]]` are configured, and asks for the admin token where they
    /// are (its series name tenants and what they asked for: never shown to a tenant's key).
    pub metrics_token_env: Option<String>,
    /// Serve `/admin/*` only on this address (e.g. a private interface), not on `listen`
    /// (absent: on `listen`, behind the admin token).
    pub admin_listen: Option<SocketAddr>,
    /// An environment variable holding a secret every replica shares: policy versions shared
    /// through Redis are then signed with it, and one not signed with it is refused (unset:
    /// shared versions are as trustworthy as whoever can write to Redis).
    pub policy_key_env: Option<String>,
}

/// Upper bound of the server timeouts (one year).
const MAX_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// Longest lifetime of an answer (the memory tier refuses lifetimes of 1,000 years).
const MAX_TTL_SECS: u64 = 10 * 365 * 24 * 3600;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("valid default address"),
            max_body_bytes: 4 * 1024 * 1024,
            request_timeout_secs: 300.0,
            body_timeout_secs: 30.0,
            header_timeout_secs: 30.0,
            max_connections: 4096,
            lookup_timeout_secs: 2.0,
            first_token_timeout_secs: 60.0,
            token_timeout_secs: 60.0,
            shutdown_timeout_secs: 30.0,
            admin_token_env: None,
            metrics_token_env: None,
            admin_listen: None,
            policy_key_env: None,
        }
    }
}

impl ServerConfig {
    /// `header_timeout_secs` as a duration.
    pub fn header_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.header_timeout_secs)
    }
    /// `body_timeout_secs` as a duration.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.body_timeout_secs)
    }
    /// `request_timeout_secs` as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.request_timeout_secs)
    }
    /// `lookup_timeout_secs` as a duration.
    pub fn lookup_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.lookup_timeout_secs)
    }
    /// `first_token_timeout_secs` as a duration.
    pub fn first_token_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.first_token_timeout_secs)
    }
    /// `shutdown_timeout_secs` as a duration.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.shutdown_timeout_secs)
    }
    /// `token_timeout_secs` as a duration.
    pub fn token_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.token_timeout_secs)
    }
}

/// Which backend answers misses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    /// llama.cpp in-process with a local GGUF model (the embedded default).
    #[default]
    Llama,
    /// Any OpenAI-compatible server over HTTP.
    Openai,
    /// A scripted backend that answers instantly from a template; for tests and benchmarks.
    Fake,
}

/// `[backend]`: one flat table; which keys apply depends on `kind`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    /// The backend's name in `[[backends]]`, which `[[routes]]` refer to (`default` for
    /// `[backend]`).
    pub name: String,
    /// `llama`, `openai` or `fake`.
    pub kind: BackendKind,
    /// llama: path of the GGUF model file.
    pub model: PathBuf,
    /// Name under which the model is served (`/v1/models`, the `model` field). llama and fake:
    /// defaults to the GGUF file stem / `fake`. openai: if set, the only model accepted;
    /// requests naming another model get 404.
    pub model_name: Option<String>,
    /// openai: extra model names accepted besides `model_name` (empty and no `model_name`:
    /// any model is passed through and the upstream decides).
    pub models: Vec<String>,
    /// openai: base URL including the version prefix, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: Option<String>,
    /// openai: name of the environment variable that holds the API key (the key itself never
    /// appears in config files or logs).
    pub api_key_env: Option<String>,
    /// openai: the API's other endpoints (first path segment under `/v1/`, e.g. `embeddings`,
    /// `files`, `responses`) passed to the upstream unchanged and uncached, with the upstream's
    /// key: every method and sub-path of a listed endpoint. `models` also makes `/v1/models`
    /// the upstream's list when no model is configured. The model list applies to the
    /// completion endpoints only. `[]` closes them all.
    pub passthrough: Vec<String>,
    /// openai: the field a chat completion's token bound is sent as (`max_tokens` or
    /// `max_completion_tokens`; reasoning models refuse `max_tokens`): a bound reprise writes
    /// in (a tenant's cap, a budget's charge) and, on answers reprise generates, a client's
    /// `max_tokens` (a request forwarded as it came keeps the client's own field). A client's
    /// `max_completion_tokens` is always sent as that.
    pub max_tokens_field: reprise_backend::BoundField,
    /// openai: TCP connect timeout in seconds.
    pub connect_timeout_secs: f64,
    /// openai: idle keep-alive connections kept per upstream host.
    pub pool_max_idle: usize,
    /// llama: total context size in tokens, shared by the parallel sequences; one request
    /// holds at most `n_ctx - n_ctx / parallel` of it (prompt and answer).
    pub n_ctx: u32,
    /// llama: CPU threads used for decoding.
    pub n_threads: i32,
    /// llama: layers offloaded to the GPU (needs a build with the `cuda` feature; ignored
    /// with a log line otherwise).
    pub n_gpu_layers: u32,
    /// llama: sequences decoded together (continuous batching slots).
    pub parallel: usize,
    /// llama, and openai with `max_concurrent`: requests allowed to wait for a slot; beyond
    /// that requests get 429 (a user request evicts the newest waiting background one
    /// instead).
    pub max_queue: usize,
    /// openai: generations and forwarded completions sent upstream at once (0: unlimited).
    /// The others wait for a slot by priority, interactive first, then batch, then
    /// background work (which is preempted when a user request waits). It also tells
    /// background work the upstream's capacity, so prefetch runs on spare slots rather than
    /// only while no user request runs.
    pub max_concurrent: usize,
    /// llama, and openai with `max_concurrent`: a batch request (`x-reprise-priority: batch`
    /// or its tenant's `priority`) waiting longer than this many seconds for a slot is served
    /// as interactive, so interactive traffic cannot starve it. 0: never (batch waits as long
    /// as interactive requests keep coming).
    pub priority_aging_secs: f64,
    /// llama and fake: `max_tokens` used when a request does not set one.
    pub default_max_tokens: u32,
    /// The largest `max_tokens` (or `max_completion_tokens`) any request may ask for; above
    /// it 400. One request cannot reserve a whole context or an unbounded upstream answer.
    /// A request without one is not given it (its key and the backend's default stay),
    /// unless its tenant has a token budget (`tokens_per_minute`): then it is given what it
    /// is charged (keyed as no bound where that is the backend's own default: the same
    /// answer).
    pub max_tokens_cap: u32,
    /// fake: reply template; `{prompt}` is replaced by the last user message.
    pub fake_reply: String,
    /// fake: delay between streamed tokens in milliseconds.
    pub fake_token_delay_ms: u64,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            name: "default".to_string(),
            kind: BackendKind::Llama,
            model: PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            model_name: None,
            models: Vec::new(),
            base_url: None,
            api_key_env: None,
            passthrough: ["embeddings", "moderations", "models"]
                .map(String::from)
                .to_vec(),
            max_tokens_field: Default::default(),
            connect_timeout_secs: 5.0,
            pool_max_idle: 64,
            n_ctx: 4096,
            n_threads: default_threads(),
            n_gpu_layers: 0,
            parallel: 4,
            max_queue: 64,
            max_concurrent: 0,
            priority_aging_secs: 5.0,
            default_max_tokens: 256,
            max_tokens_cap: 4096,
            fake_reply: "You asked: {prompt}".to_string(),
            fake_token_delay_ms: 0,
        }
    }
}

impl BackendConfig {
    /// The llama engine settings this table describes.
    pub fn llama_config(&self) -> reprise_backend::llama::LlamaConfig {
        reprise_backend::llama::LlamaConfig {
            model: self.model.clone(),
            model_name: self.model_name.clone(),
            n_ctx: self.n_ctx,
            n_threads: self.n_threads,
            n_gpu_layers: self.n_gpu_layers,
            parallel: self.parallel,
            max_queue: self.max_queue,
            default_max_tokens: self.default_max_tokens,
            priority_aging_secs: self.priority_aging_secs,
            ..Default::default()
        }
    }

    /// `priority_aging_secs` as a duration; `None` when aging is off (0).
    pub fn priority_aging(&self) -> Option<Duration> {
        (self.priority_aging_secs > 0.0).then(|| Duration::from_secs_f64(self.priority_aging_secs))
    }

    /// Checks one backend's table: `[backend]` (`name` `None`) or one of `[[backends]]`
    /// (its keys reported as `backends.KEY`, the message naming the backend).
    pub(crate) fn validate(&self, name: Option<&str>) -> Result<(), ConfigError> {
        let table = if name.is_some() {
            "backends"
        } else {
            "backend"
        };
        let key = |k: &str| format!("{table}.{k}");
        let why = |reason: &str| match name {
            Some(n) => format!("backend `{n}`: {reason}"),
            None => reason.to_string(),
        };
        match self.kind {
            BackendKind::Openai => {
                let Some(url) = &self.base_url else {
                    return Err(invalid(
                        key("base_url"),
                        why("required when kind = \"openai\""),
                    ));
                };
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(invalid(
                        key("base_url"),
                        why(&format!("`{url}` is not an http(s) URL")),
                    ));
                }
                if let Some(e) = self
                    .passthrough
                    .iter()
                    .find(|e| !crate::openai::API_ROOTS.contains(&e.as_str()))
                {
                    return Err(invalid(
                        key("passthrough"),
                        why(&format!(
                            "`{e}` is not an endpoint that can pass through (one of: {})",
                            crate::openai::API_ROOTS.join(", ")
                        )),
                    ));
                }
            }
            BackendKind::Llama => {
                if self.parallel == 0 {
                    return Err(invalid(key("parallel"), why("must be at least 1")));
                }
                if self.n_threads <= 0 {
                    return Err(invalid(key("n_threads"), why("must be at least 1")));
                }
                if self.n_ctx < 64 {
                    return Err(invalid(key("n_ctx"), why("must be at least 64")));
                }
            }
            BackendKind::Fake => {}
        }
        if self.default_max_tokens == 0 {
            return Err(invalid(key("default_max_tokens"), why("must be positive")));
        }
        if self.max_queue == 0 {
            return Err(invalid(key("max_queue"), why("must be at least 1")));
        }
        if !(self.priority_aging_secs >= 0.0 && self.priority_aging_secs <= MAX_TIMEOUT_SECS) {
            return Err(invalid(
                key("priority_aging_secs"),
                why(&format!(
                    "must be 0 (off) or a number of seconds up to {MAX_TIMEOUT_SECS}"
                )),
            ));
        }
        if !(self.connect_timeout_secs > 0.0 && self.connect_timeout_secs <= MAX_TIMEOUT_SECS) {
            return Err(invalid(
                key("connect_timeout_secs"),
                why(&format!(
                    "must be more than 0 and at most {MAX_TIMEOUT_SECS} seconds"
                )),
            ));
        }
        if self.max_tokens_cap < self.default_max_tokens {
            return Err(invalid(
                key("max_tokens_cap"),
                why("must be at least default_max_tokens"),
            ));
        }
        Ok(())
    }
}

fn default_threads() -> i32 {
    std::thread::available_parallelism()
        .map(|n| n.get().min(8) as i32)
        .unwrap_or(2)
}

/// `[cache]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Master switch: when false every request goes to the backend and nothing is stored.
    pub enabled: bool,
    /// Bytes of answers held in memory (the in-process tier); least recently used go first.
    pub memory_bytes: u64,
    /// Lifetime of an entry in seconds.
    pub ttl_secs: u64,
    /// Without Redis: save the memory tier here on shutdown and load it at start, so a restart
    /// keeps the cache and the semantic index (off when absent; with `[redis]` a config
    /// error, since Redis keeps the cache then).
    pub snapshot_path: Option<PathBuf>,
    /// With `snapshot_path`: also save every this many seconds while running (written to a
    /// temporary file, then renamed over the last), so a crash loses at most one interval.
    /// 0: no periodic save (on shutdown, and within 5 s of a delete or a refusal, only).
    pub snapshot_interval_secs: u64,
    /// Earlier exchanges of a conversation looked up by their turn links (so differently
    /// worded turns that reprise answered with the same entry share later hits); the ones
    /// after join the context by their raw text (and an answer past them is stored without
    /// turn links, which nothing would read).
    pub context_turns: usize,
    /// Stale-while-revalidate (RFC 5861): for this many seconds after an entry expired, a
    /// request for it (by its exact key) is answered from it at once, marked stale, while
    /// one regeneration in the background replaces it. 0 (the default) turns it off; at most
    /// [`MAX_STALE_SECS`]. A tenant's policy and the request's `Cache-Control` may narrow it.
    pub stale_while_revalidate_secs: u64,
    /// Stale-if-error (RFC 5861): for this many seconds after an entry expired, a request for
    /// it whose generation fails (backend unavailable, overloaded or failing, or no first
    /// token in time) is answered from it, marked stale, instead of the error. 0 (the
    /// default) turns it off; at most [`MAX_STALE_SECS`]. Narrowed like the other.
    ///
    /// Expired entries are kept (in memory, weighing in `memory_bytes`, and in Redis) for
    /// the longer of the two windows past their expiry, never as fresh answers.
    pub stale_if_error_secs: u64,
}

/// The longest stale window (`cache.stale_while_revalidate_secs`,
/// `cache.stale_if_error_secs`): seven days.
pub const MAX_STALE_SECS: u64 = 7 * 24 * 3600;

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            memory_bytes: 256 * 1024 * 1024,
            ttl_secs: 24 * 3600,
            snapshot_path: None,
            snapshot_interval_secs: 300,
            context_turns: 32,
            stale_while_revalidate_secs: 0,
            stale_if_error_secs: 0,
        }
    }
}

impl CacheConfig {
    /// `ttl_secs` as a duration.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs)
    }

    /// The stale windows of the global policy.
    pub fn stale_windows(&self) -> reprise_policies::cache::StaleWindows {
        reprise_policies::cache::StaleWindows {
            while_revalidate_secs: self.stale_while_revalidate_secs,
            if_error_secs: self.stale_if_error_secs,
        }
    }

    /// How long expired entries are kept past their expiry: the longer stale window (a
    /// tenant's windows are at most these).
    pub fn stale_retention(&self) -> Duration {
        Duration::from_secs(self.stale_windows().longest_secs())
    }
}

/// `[feedback]`: verdicts on served answers. Every response reprise answers from the cache or
/// generates is remembered for `window_secs` (in memory within `memory_bytes`, and in Redis
/// when configured) so `POST /v1/feedback` can name it by its `id`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedbackConfig {
    /// Remember responses and accept verdicts (off: `POST /v1/feedback` answers 404).
    pub enabled: bool,
    /// How long after it was sent a response can be given a verdict, in seconds.
    pub window_secs: u64,
    /// Bytes of remembered responses held in memory (the oldest go first): a tenant with a
    /// `memory_share` holds that share of it, every other tenant (the anonymous one
    /// included) an equal part of the rest.
    pub memory_bytes: u64,
    /// A semantic or prefetch hit reported wrong is never served again to its question, nor to
    /// questions at least this similar to it in the same context.
    pub radius: f32,
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        FeedbackConfig {
            enabled: true,
            window_secs: 3600,
            memory_bytes: 32 * 1024 * 1024,
            radius: 0.9,
        }
    }
}

impl FeedbackConfig {
    /// `window_secs` as a duration.
    pub fn window(&self) -> Duration {
        Duration::from_secs(self.window_secs)
    }
}

/// `error` without the values it quotes: a value of the wrong type, or the source line of a
/// syntax error, may be an API key or a token, and the error is logged (at start, and on
/// every `SIGHUP`). The key's path and the line number say where to look.
fn without_values(error: figment::Error) -> figment::Error {
    use figment::error::{Actual, Kind};
    const HIDDEN: &str = "(not shown)";
    let mut errors: Vec<figment::Error> = error
        .into_iter()
        .map(|mut e| {
            match &mut e.kind {
                Kind::InvalidType(Actual::Str(v), _) | Kind::InvalidValue(Actual::Str(v), _) => {
                    *v = HIDDEN.into();
                }
                Kind::Message(m) => {
                    // A TOML syntax error shows its source line as `12 | text`.
                    let lines = m.lines().map(|l| match l.split_once(" | ") {
                        Some((n, _)) if n.trim().parse::<u64>().is_ok() => {
                            format!("{n} | {HIDDEN}")
                        }
                        _ => l.to_string(),
                    });
                    *m = lines.collect::<Vec<_>>().join("\n");
                }
                _ => {}
            }
            e
        })
        .collect();
    // Chained again, the newest at the head as before.
    let first = errors.pop().expect("an error is at least one");
    errors
        .into_iter()
        .rev()
        .fold(first, |chain, e| chain.chain(e))
}

/// A configuration that could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is missing, not TOML, has an unknown key or a value of the wrong type.
    #[error(transparent)]
    Parse(#[from] Box<figment::Error>),
    /// A value parsed but makes no sense.
    #[error("invalid config value for `{key}`: {reason}")]
    Invalid {
        /// Dotted key, e.g. `cache.memory_bytes`.
        key: std::borrow::Cow<'static, str>,
        /// What is wrong.
        reason: String,
    },
}

/// A validation error about `key`.
fn invalid(
    key: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        reason: reason.into(),
    }
}

/// Checks semantic override rules ([`reprise_policies::semantic::Rule::check`]); `at` is
/// where they are (`semantic.rules`), `owner` names their tenant in the reason.
fn check_rules(
    rules: &[reprise_policies::semantic::Rule],
    at: &str,
    owner: Option<&str>,
) -> Result<(), ConfigError> {
    for r in rules {
        if let Err((key, reason)) = r.check() {
            let reason = match owner {
                Some(t) => format!("tenant `{t}`: {reason}"),
                None => reason.to_string(),
            };
            return Err(invalid(format!("{at}.{key}"), reason));
        }
    }
    Ok(())
}

impl Config {
    /// Loads the file (if given) and the `REPRISE__SECTION__KEY` environment overrides, then
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut fig = Figment::new();
        if let Some(path) = path {
            if !path.exists() {
                return Err(ConfigError::Invalid {
                    key: "--config".into(),
                    reason: format!("file {} does not exist", path.display()),
                });
            }
            fig = fig.merge(Toml::file_exact(path));
        }
        fig = fig.merge(Env::prefixed("REPRISE__").split("__"));
        let mut config = Self::from_figment(fig)?;
        config.source = path.map(Path::to_path_buf);
        Ok(config)
    }

    /// Parses a TOML string (no environment); used by tests.
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        Self::from_figment(Figment::new().merge(Toml::string(text)))
    }

    fn from_figment(fig: Figment) -> Result<Config, ConfigError> {
        let config: Config = fig.extract().map_err(|e| Box::new(without_values(e)))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks values that parse but make no sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_tenants(self)?;
        observe::validate(self)?;
        self.log.validate()?;
        stats::validate(self)?;
        traces::validate(self)?;
        self.semantic.validate()?;
        if self
            .tenants
            .iter()
            .any(|t| t.policy.delta.is_some_and(|d| !(0.0..0.5).contains(&d)))
        {
            return Err(invalid("tenants.policy.delta", "must be in [0, 0.5)"));
        }
        if self
            .auth
            .anonymous
            .delta
            .is_some_and(|d| !(0.0..0.5).contains(&d))
        {
            return Err(invalid("auth.anonymous.delta", "must be in [0, 0.5)"));
        }
        let f = &self.feedback;
        if f.window_secs == 0 || f.window_secs > 30 * 24 * 3600 {
            return Err(invalid(
                "feedback.window_secs",
                "must be 1 to 2592000 (30 days)",
            ));
        }
        if f.memory_bytes == 0 {
            return Err(invalid("feedback.memory_bytes", "must be positive"));
        }
        if !(f.radius > 0.0 && f.radius <= 1.0) {
            return Err(invalid("feedback.radius", "must be in (0, 1]"));
        }
        if self
            .cache
            .snapshot_path
            .as_ref()
            .is_some_and(|p| p.extension().is_some_and(|e| e == "tmp"))
        {
            // Saves write `<path>.tmp` and rename it over the path: they would be one file.
            return Err(invalid("cache.snapshot_path", "must not end in `.tmp`"));
        }
        if self.cache.snapshot_path.is_some() && self.redis.is_enabled() {
            // A snapshot loaded while Redis is down would serve answers other replicas
            // deleted meanwhile, until Redis answers again.
            return Err(invalid(
                "cache.snapshot_path",
                "is for a cache without Redis: with [redis], Redis keeps the cache across restarts",
            ));
        }
        if self.cache.context_turns > 1024 {
            return Err(invalid("cache.context_turns", "must be at most 1024"));
        }
        let s = &self.server;
        if s.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be positive"));
        }
        if s.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be positive"));
        }
        for (key, secs) in [
            ("server.header_timeout_secs", s.header_timeout_secs),
            ("server.body_timeout_secs", s.body_timeout_secs),
            ("server.request_timeout_secs", s.request_timeout_secs),
            ("server.lookup_timeout_secs", s.lookup_timeout_secs),
            (
                "server.first_token_timeout_secs",
                s.first_token_timeout_secs,
            ),
            ("server.token_timeout_secs", s.token_timeout_secs),
            ("server.shutdown_timeout_secs", s.shutdown_timeout_secs),
        ] {
            // Bounded so that turning a timeout "off" with a huge value stays a valid duration.
            if !(secs > 0.0 && secs <= MAX_TIMEOUT_SECS) {
                return Err(invalid(
                    key,
                    format!("must be more than 0 and at most {MAX_TIMEOUT_SECS} seconds"),
                ));
            }
        }
        self.backend.validate(None)?;
        routes::validate(self)?;
        self.degrade.validate(self)?;
        if self.cache.memory_bytes == 0 {
            return Err(invalid("cache.memory_bytes", "must be positive"));
        }
        if self.cache.ttl_secs == 0 || self.cache.ttl_secs > MAX_TTL_SECS {
            return Err(invalid(
                "cache.ttl_secs",
                format!("must be positive and at most {MAX_TTL_SECS} (10 years)"),
            ));
        }
        for (key, secs) in [
            (
                "cache.stale_while_revalidate_secs",
                self.cache.stale_while_revalidate_secs,
            ),
            ("cache.stale_if_error_secs", self.cache.stale_if_error_secs),
        ] {
            if secs > MAX_STALE_SECS {
                return Err(invalid(
                    key,
                    format!("must be at most {MAX_STALE_SECS} (7 days)"),
                ));
            }
        }
        // Periods and waits added to a clock: one beyond a year is a mistake, and one near
        // the integer's range would overflow it.
        let (sem, redis) = (&self.semantic, &self.redis);
        for (key, secs) in [
            (
                "cache.snapshot_interval_secs",
                self.cache.snapshot_interval_secs,
            ),
            (
                "semantic.maintain_interval_secs",
                sem.maintain_interval_secs,
            ),
            ("semantic.evidence_sync_secs", sem.evidence_sync_secs),
            (
                "semantic.embedder_queue_wait_ms",
                sem.embedder_queue_wait_ms / 1000,
            ),
            ("redis.timeout_ms", redis.timeout_ms / 1000),
            ("redis.connect_timeout_ms", redis.connect_timeout_ms / 1000),
            (
                "redis.breaker_cooldown_ms",
                redis.breaker_cooldown_ms / 1000,
            ),
            (
                "backend.fake_token_delay_ms",
                self.backend.fake_token_delay_ms / 1000,
            ),
        ] {
            if secs as f64 > MAX_TIMEOUT_SECS {
                return Err(invalid(
                    key,
                    format!("must be at most {MAX_TIMEOUT_SECS} seconds (a year)"),
                ));
            }
        }
        if let Err((key, reason)) = self.prefetch.validate() {
            return Err(invalid(key, reason));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[auth]` without an anonymous policy is written as before it had one, so replicas of
    /// an earlier release read the shared documents of this one; with one, it travels.
    #[test]
    fn an_unset_anonymous_policy_is_left_out_of_shared_documents() {
        let auth = AuthConfig::default();
        assert_eq!(
            serde_json::to_value(&auth).unwrap(),
            serde_json::json!({"required": false})
        );
        let mut auth = AuthConfig::default();
        auth.anonymous.requests_per_minute = 60;
        let v = serde_json::to_value(&auth).unwrap();
        assert_eq!(v["anonymous"]["requests_per_minute"], 60);
    }

    /// A period or wait beyond a year is refused, by name, before anything adds it to a
    /// clock.
    #[test]
    fn periods_beyond_a_year_are_refused() {
        for (section, key) in [
            ("cache", "snapshot_interval_secs"),
            ("semantic", "maintain_interval_secs"),
            ("semantic", "evidence_sync_secs"),
            ("semantic", "embedder_queue_wait_ms"),
            ("redis", "timeout_ms"),
            ("redis", "connect_timeout_ms"),
            ("redis", "breaker_cooldown_ms"),
        ] {
            let toml = format!("[{section}]\n{key} = 9223372036854775807\n");
            let err = Config::from_toml(&toml).unwrap_err().to_string();
            assert!(err.contains(&format!("{section}.{key}")), "{err}");
        }
        let ok = Config::from_toml("[cache]\nsnapshot_interval_secs = 86400\n");
        assert!(ok.is_ok());
    }

    /// A configuration error names where the bad value is, never the value: it may be a
    /// key, and the error is logged.
    #[test]
    fn a_config_error_does_not_show_the_value() {
        let secret = "sk-live-0123456789";
        let wrong_type = format!("[[tenants]]\nname = \"acme\"\napi_keys = \"{secret}\"\n");
        let unclosed = format!("[[tenants]]\nname = \"acme\"\napi_keys = [\"{secret}\"\n");
        let bad_value = format!("[server]\nlisten = \"{secret}\"\n");
        for doc in [wrong_type, unclosed, bad_value] {
            let e = Config::from_toml(&doc).unwrap_err().to_string();
            assert!(!e.contains(secret), "{e}");
            assert!(
                e.contains("api_keys") || e.contains("line") || e.contains("listen"),
                "{e}"
            );
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::from_toml("").unwrap();
        assert_eq!(c.backend.kind, BackendKind::Llama);
        assert_eq!(c.server.listen.port(), 8080);
        assert!(c.cache.enabled);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::from_toml("[cache]\nmemory_byte = 5\n").unwrap_err();
        assert!(err.to_string().contains("memory_byte"), "{err}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = Config::from_toml("[cache]\nttl_secs = \"soon\"\n").unwrap_err();
        assert!(err.to_string().contains("ttl_secs"), "{err}");
    }

    #[test]
    fn bad_value_is_named() {
        let err = Config::from_toml("[semantic]\nthreshold = 1.5\n").unwrap_err();
        assert!(err.to_string().contains("semantic.threshold"), "{err}");
        let err = Config::from_toml("[backend]\nkind = \"openai\"\n").unwrap_err();
        assert!(err.to_string().contains("backend.base_url"), "{err}");
        let err = Config::from_toml(
            "[backend]\nkind = \"openai\"\nbase_url = \"http://h/v1\"\npassthrough = [\"realtime\"]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("backend.passthrough"), "{err}");
        for bad in ["0", "-1", "inf", "nan", "1e30"] {
            let err =
                Config::from_toml(&format!("[server]\ntoken_timeout_secs = {bad}\n")).unwrap_err();
            assert!(
                err.to_string().contains("server.token_timeout_secs"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn prefetch_defaults_and_validation() {
        let c = PrefetchConfig::default();
        assert!(!c.enabled && !c.refresh_ahead);
        assert!(c.validate().is_ok());
        let bad = PrefetchConfig {
            min_probability: 1.5,
            ..PrefetchConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().0, "prefetch.min_probability");
        for secs in [0.0, -1.0, f64::NAN] {
            let bad = PrefetchConfig {
                persist_interval_secs: secs,
                ..PrefetchConfig::default()
            };
            let err = bad.validate().unwrap_err();
            assert_eq!(err.0, "prefetch.persist_interval_secs");
        }
        let parsed: PrefetchConfig = toml::from_str("enabled = true\nmax_concurrent = 2").unwrap();
        assert!(parsed.enabled && parsed.max_concurrent == 2);
        assert!(toml::from_str::<PrefetchConfig>("nope = 1").is_err());
    }

    #[test]
    fn example_file_matches_the_defaults() {
        let text = include_str!("../../reprise.example.toml");
        let c = Config::from_toml(text).unwrap();
        let d = Config::default();
        assert_eq!(c.server.listen, d.server.listen);
        assert_eq!(c.server.max_body_bytes, d.server.max_body_bytes);
        assert_eq!(c.server.token_timeout_secs, d.server.token_timeout_secs);
        assert_eq!(c.backend.model, d.backend.model);
        assert_eq!(c.backend.parallel, d.backend.parallel);
        assert_eq!(c.backend.passthrough, d.backend.passthrough);
        assert_eq!(c.backend.max_concurrent, d.backend.max_concurrent);
        assert_eq!(c.backend.priority_aging_secs, d.backend.priority_aging_secs);
        assert_eq!(c.cache.memory_bytes, d.cache.memory_bytes);
        assert_eq!(c.cache.ttl_secs, d.cache.ttl_secs);
        assert_eq!(c.cache.stale_windows(), d.cache.stale_windows());
        assert_eq!(c.semantic.threshold, d.semantic.threshold);
        assert_eq!(c.semantic.model_dir, d.semantic.model_dir);
        let (i, j) = (&c.semantic.index, &d.semantic.index);
        assert_eq!(
            (i.exact_scan_max, i.hnsw_m, i.ef_construction, i.ef_search),
            (j.exact_scan_max, j.hnsw_m, j.ef_construction, j.ef_search)
        );
        assert_eq!(i.rebuild_tombstone_ratio, j.rebuild_tombstone_ratio);
        let (p, q) = (&c.prefetch, &d.prefetch);
        assert_eq!(p.enabled, q.enabled);
        assert_eq!(p.min_probability, q.min_probability);
        assert_eq!(p.max_wordings, q.max_wordings);
        assert_eq!(p.regroup, q.regroup);
        assert_eq!(p.regroup_score, q.regroup_score);
        assert_eq!(p.regroup_min_cosine, q.regroup_min_cosine);
        assert_eq!(p.regroup_min_seen, q.regroup_min_seen);
        assert_eq!(p.propose, q.propose);
        assert_eq!(p.propose_questions, q.propose_questions);
        assert_eq!(p.persist_interval_secs, q.persist_interval_secs);
        assert_eq!(p.max_capacity_share, q.max_capacity_share);
        assert_eq!(p.max_backend_share, q.max_backend_share);
    }

    #[test]
    fn tenants_and_auth() {
        let c = Config::from_toml(
            "[auth]\nrequired = true\n[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme-1\"]\n\
             [[tenants]]\nname = \"beta.2\"\napi_keys_env = \"BETA_KEYS\"\nsub_namespaces = false\n",
        )
        .unwrap();
        assert!(c.auth.required);
        assert_eq!(c.tenants.len(), 2);
        assert!(c.tenants[0].sub_namespaces && !c.tenants[1].sub_namespaces);
        assert!(
            !format!("{c:?}").contains("sk-acme-1"),
            "keys stay out of Debug"
        );
        for (text, key) in [
            ("[auth]\nrequired = true\n", "auth.required"),
            ("[[tenants]]\nname = \"a b\"\napi_keys = [\"k\"]\n", "tenants.name"),
            ("[[tenants]]\nname = \"-\"\napi_keys = [\"k\"]\n", "tenants.name"),
            ("[cache]\nsnapshot_path = \"/var/lib/reprise/cache.tmp\"\n", "cache.snapshot_path"),
            (
                "[cache]\nsnapshot_path = \"/var/lib/reprise/cache\"\n[redis]\nurl = \"redis://127.0.0.1:6379\"\n",
                "cache.snapshot_path",
            ),
            ("[[tenants]]\nname = \"anonymous\"\napi_keys = [\"k\"]\n", "tenants.name"),
            ("[[tenants]]\nname = \"other\"\napi_keys = [\"k\"]\n", "tenants.name"),
            ("[auth.anonymous]\nmemory_share = 0.1\n", "auth.anonymous.memory_share"),
            ("[semantic.index]\nhnsw_m = 1000\n", "semantic.index.hnsw_m"),
            ("[semantic.index]\nef_search = 0\n", "semantic.index.ef_search"),
            ("[semantic.index]\nexact_scan_max = 10000000\n", "semantic.index.exact_scan_max"),
            (
                "[semantic.index]\nrebuild_tombstone_ratio = 0.0\n",
                "semantic.index.rebuild_tombstone_ratio",
            ),
            (
                "[semantic.index]\nrebuild_tombstone_ratio = 1.0\n",
                "semantic.index.rebuild_tombstone_ratio",
            ),
            ("[semantic.index]\nhnsw_m = 64\n", "semantic.index.hnsw_m"),
            (
                "[semantic.index]\nef_search = 128\nef_search_max = 64\n",
                "semantic.index.ef_search_max",
            ),
            ("[semantic.index]\nrecall_target = 1.5\n", "semantic.index.recall_target"),
            (
                "[prefetch]\nregroup_family_score = 5.0\n",
                "prefetch.regroup_family_score",
            ),
            (
                "[semantic.index]\nrecall_check_every = 2000000\n",
                "semantic.index.recall_check_every",
            ),
            ("[auth.anonymous]\ndelta = 0.9\n", "auth.anonymous.delta"),
            ("[auth.anonymous]\ncontrols = [\"bogus\"]\n", "auth.anonymous.controls"),
            ("[auth.anonymous]\ntokens_per_minute = 10\n", "auth.anonymous.tokens_per_minute"),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n[tenants.policy]\nmax_tokens = 5000\n",
                "tenants.policy.max_tokens",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n[tenants.policy]\ntokens_per_minute = 100\n",
                "tenants.policy.tokens_per_minute",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n[tenants.policy]\nmax_tokens = 64\ntokens_per_minute = 60\n",
                "tenants.policy.tokens_per_minute",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n[[tenants]]\nname = \"a\"\napi_keys = [\"j\"]\n",
                "tenants.name",
            ),
            ("[[tenants]]\nname = \"a\"\napi_keys = [\"sha256:xyz\"]\n", "tenants.api_keys"),
            (
                "[prefetch]\npropose = true\npropose_questions = 134217728\n",
                "prefetch.propose_questions",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\npolicy.memory_share = 0\n",
                "tenants.policy.memory_share",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\npolicy.prefetch_share = 0.7\n\
                 [[tenants]]\nname = \"b\"\napi_keys = [\"j\"]\npolicy.prefetch_share = 0.4\n",
                "tenants.policy.prefetch_share",
            ),
        ] {
            let err = Config::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        assert!(Config::from_toml("[[tenants]]\nname = \"a\"\nkeys = []\n").is_err());
    }

    #[test]
    fn stale_windows_are_bounded_and_tenants_only_narrow_them() {
        let c = Config::default();
        assert_eq!(c.cache.stale_retention(), Duration::ZERO, "off by default");
        let c = Config::from_toml(
            "[cache]\nstale_while_revalidate_secs = 60\nstale_if_error_secs = 3600\n\
             [[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n\
             policy.stale_while_revalidate_secs = 0\npolicy.stale_if_error_secs = 600\n",
        )
        .unwrap();
        assert_eq!(c.cache.stale_retention(), Duration::from_secs(3600));
        let tenant = c.tenants[0].policy.stale_windows(c.cache.stale_windows());
        assert_eq!(
            (tenant.while_revalidate_secs, tenant.if_error_secs),
            (0, 600)
        );
        let default = TenantPolicy::default().stale_windows(c.cache.stale_windows());
        assert_eq!(
            default,
            c.cache.stale_windows(),
            "absent: the global windows"
        );
        for (text, key) in [
            (
                "[cache]\nstale_while_revalidate_secs = 604801\n",
                "cache.stale_while_revalidate_secs",
            ),
            (
                "[cache]\nstale_if_error_secs = 99999999\n",
                "cache.stale_if_error_secs",
            ),
            (
                "[cache]\nstale_if_error_secs = 60\n[[tenants]]\nname = \"a\"\n\
                 api_keys = [\"k\"]\npolicy.stale_if_error_secs = 61\n",
                "tenants.policy.stale_if_error_secs",
            ),
            (
                "[[tenants]]\nname = \"a\"\napi_keys = [\"k\"]\n\
                 policy.stale_while_revalidate_secs = 1\n",
                "tenants.policy.stale_while_revalidate_secs",
            ),
        ] {
            let err = Config::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    #[allow(clippy::result_large_err)] // figment's Jail dictates the closure's error type
    fn env_overrides_file() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("r.toml", "[cache]\nttl_secs = 10\n")?;
            jail.set_env("REPRISE__CACHE__TTL_SECS", "20");
            jail.set_env("REPRISE__SERVER__LISTEN", "127.0.0.1:9999");
            let c = Config::load(Some(Path::new("r.toml"))).unwrap();
            assert_eq!(c.cache.ttl_secs, 20);
            assert_eq!(c.server.listen.port(), 9999);
            Ok(())
        });
    }
}
