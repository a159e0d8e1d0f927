//! Generation backends for reprise.
//!
//! A [`Backend`] turns a [`GenRequest`] (chat messages or a raw prompt plus sampling
//! parameters) into a stream of [`GenEvent`]s: text deltas as they are decoded, then exactly
//! one [`GenEvent::Finish`] carrying the finish reason and token usage. A stream that ends
//! without `Finish` was cut off and must never be cached.
//!
//! Implementations:
//! - [`llama::LlamaBackend`]: llama.cpp in-process (continuous batching, priority classes).
//! - [`openai::OpenAiBackend`]: any OpenAI-compatible upstream over HTTP.
//! - [`fake::ScriptedBackend`]: a scripted backend for timing, failure-injection and counting tests.

use std::pin::Pin;

use bytes::Bytes;
use futures::Stream;
use serde::{Deserialize, Serialize};

pub mod cpu;
pub mod fake;
pub mod llama;
pub mod openai;
mod slots;

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Input {
    /// A chat conversation; the backend applies the model's chat template.
    Chat(Vec<ChatMessage>),
    /// A raw prompt (the completions endpoint); no template is applied.
    Prompt(String),
}

impl Input {
    /// About the heap bytes it holds: its texts, and each message's role and name.
    pub fn heap_bytes(&self) -> usize {
        match self {
            Input::Prompt(p) => p.len(),
            Input::Chat(msgs) => msgs
                .iter()
                .map(|m| {
                    let name = m.name.as_ref().map_or(0, String::len);
                    std::mem::size_of::<ChatMessage>()
                        + m.role.len()
                        + m.content.len()
                        + name
                        + map_heap_bytes(&m.extra)
                })
                .sum(),
        }
    }
}

/// About the heap bytes a JSON value holds (its strings and keys, and a fixed cost per node).
pub fn json_heap_bytes(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    const NODE: usize = std::mem::size_of::<Value>();
    match v {
        Value::String(s) => NODE + s.len(),
        Value::Array(a) => NODE + a.iter().map(json_heap_bytes).sum::<usize>(),
        Value::Object(m) => NODE + map_heap_bytes(m),
        _ => NODE,
    }
}

/// One chat message, reduced to the parts a text model consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `developer`.
    pub role: String,
    /// The message text (multi-part content is joined by the HTTP layer).
    pub content: String,
    /// The participant's name, when the client gave one. Part of the cache key and sent to
    /// upstreams; llama.cpp's chat templates have no place for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The message's other fields, neither null nor empty (`prefix`, `reasoning_content`,
    /// ...): part of the cache key and sent to upstreams as they came; llama.cpp's chat
    /// templates read none. A content given as text parts some of which carry fields of
    /// their own (a gateway's `cache_control`) is here too, as given, under
    /// [`GIVEN_PARTS`]: upstreams get it in place of `content`.
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The [`ChatMessage::extra`] field that holds a content's parts as given (`content`
/// itself holds their joined text).
pub const GIVEN_PARTS: &str = "\0content_parts";

impl std::hash::Hash for ChatMessage {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.role.hash(state);
        self.content.hash(state);
        self.name.hash(state);
        canonical_json(&self.extra).hash(state);
    }
}

/// `map` as JSON with its keys in order: equal maps give equal text, whatever order their
/// keys came in.
pub fn canonical_json(map: &serde_json::Map<String, serde_json::Value>) -> String {
    let keyed: std::collections::BTreeMap<_, _> = map.iter().collect();
    serde_json::to_string(&keyed).unwrap_or_default()
}

/// About the heap bytes a JSON object's keys and values hold.
fn map_heap_bytes(map: &serde_json::Map<String, serde_json::Value>) -> usize {
    map.iter().map(|(k, v)| k.len() + json_heap_bytes(v)).sum()
}

impl ChatMessage {
    /// Whether it is its role and text only (no participant name, no other field): what
    /// can be compared by meaning or stand for an entry's answer as given.
    pub fn is_plain(&self) -> bool {
        self.name.is_none() && self.extra.is_empty()
    }

    /// A message without a participant name.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            name: None,
            extra: serde_json::Map::new(),
        }
    }
}

/// Sampling parameters that change the output.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Upper bound on generated tokens; `None` lets the backend pick its default.
    pub max_tokens: Option<u32>,
    /// 0 means greedy decoding.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// The client named `max_tokens` `max_completion_tokens` (chat): an upstream is sent it
    /// under that name (reasoning models refuse `max_tokens`). Not part of the answer: the
    /// cache does not tell the two apart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub max_completion_tokens_named: bool,
    /// `max_tokens` is the bound the backend applies to a request without one
    /// ([`Backend::default_max_tokens`]): the same answer as asking for none, so the cache
    /// keys it alike (a tenant given a token budget, which writes the bound in, keeps its
    /// entries).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub max_tokens_is_default: bool,
}

/// The field a chat completion's token bound is sent upstream as. OpenAI's reasoning models
/// refuse `max_tokens`; most other OpenAI-compatible servers read it. The legacy completions
/// endpoint only knows `max_tokens`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BoundField {
    /// `max_tokens`.
    #[default]
    MaxTokens,
    /// `max_completion_tokens`.
    MaxCompletionTokens,
}

impl BoundField {
    /// The field of a chat completion's bound (`chat`), or of a legacy completion's, which
    /// knows only `max_tokens`.
    pub fn on(self, chat: bool) -> BoundField {
        match chat {
            true => self,
            false => BoundField::MaxTokens,
        }
    }

    /// The field's name in a request body.
    pub fn as_str(self) -> &'static str {
        match self {
            BoundField::MaxTokens => "max_tokens",
            BoundField::MaxCompletionTokens => "max_completion_tokens",
        }
    }
}

/// Scheduling class of a request, highest first (the order of the variants). Waiting
/// requests are served interactive first, then batch, then background; a batch request that
/// waited longer than the backend's aging time is served as interactive, so a steady
/// interactive stream cannot starve it. Background work only runs on spare capacity and is
/// preempted (its stream ends with [`BackendError::Overloaded`]) when a user request
/// (interactive or batch) needs its slot; a running batch generation is never preempted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// A user is waiting for this answer.
    #[default]
    Interactive,
    /// A user's request that can wait (`x-reprise-priority: batch`, or its tenant's policy):
    /// served after interactive ones, before background work.
    Batch,
    /// Prefetch, refresh-ahead and checks of hits; never chosen by a client.
    Background,
}

impl Priority {
    /// Low-cardinality label for metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Batch => "batch",
            Priority::Background => "background",
        }
    }

    /// Whether a user asked for this (interactive or batch): it counts as interactive load and
    /// preempts background work.
    pub fn is_user(self) -> bool {
        self != Priority::Background
    }
}

/// What a backend is doing now: routing, wait prediction and background work read it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Generations it runs at once (llama: parallel slots; an upstream: its concurrency
    /// limit); 0 when unlimited or unknown.
    pub capacity: usize,
    /// Generations running now (holding a slot).
    pub running: usize,
    /// Of `running`, those at background priority.
    pub running_background: usize,
    /// Generations waiting for a slot.
    pub queued: usize,
    /// Of `queued`, those served at interactive rank: interactive requests, and batch
    /// requests waiting past the priority aging (served before a new interactive one).
    pub queued_interactive: usize,
    /// Of `queued`, batch requests not yet aged.
    pub queued_batch: usize,
    /// Free slots it never gives background work (llama with more than one slot keeps
    /// one for the next user request): background work started beyond them would wait.
    pub kept_free: usize,
}

impl Load {
    /// User requests (interactive and batch) waiting for a slot.
    pub fn queued_user(&self) -> usize {
        self.queued_interactive + self.queued_batch
    }

    /// Background generations waiting for a slot.
    pub fn queued_background(&self) -> usize {
        self.queued.saturating_sub(self.queued_user())
    }
}

/// A generation request as the backends see it.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    /// The model name the client asked for.
    pub model: String,
    /// Chat messages or raw prompt.
    pub input: Input,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Scheduling class.
    pub priority: Priority,
    /// Fields the HTTP layer did not interpret, passed through to upstream backends verbatim.
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// The backend a route chose for it, by its configured name (`None`: the one serving
    /// `model`). Read only by a router of several backends; not part of any cache key.
    pub backend: Option<String>,
}

impl GenRequest {
    /// About the heap bytes it holds: its input, model name, stop strings and the fields
    /// passed through (`extra`, which a client fills up to the body limit).
    pub fn heap_bytes(&self) -> usize {
        let stops: usize = self.params.stop.iter().map(String::len).sum();
        self.input.heap_bytes() + self.model.len() + stops + map_heap_bytes(&self.extra)
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
    /// The upstream filtered the content.
    ContentFilter,
}

impl FinishReason {
    /// The OpenAI wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ContentFilter => "content_filter",
        }
    }
}

/// Token counts of one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: u32,
    /// Tokens generated.
    pub completion_tokens: u32,
}

impl Usage {
    /// Prompt plus completion tokens (saturating: the counts come from an upstream or a
    /// stored entry).
    pub fn total_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// One step of a generation stream.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// Newly decoded text (always whole UTF-8 characters).
    Delta(String),
    /// The generation completed; always the last event of a complete stream.
    Finish {
        /// Why it ended.
        reason: FinishReason,
        /// Token counts.
        usage: Usage,
    },
}

/// Errors a backend reports, before or during a stream.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The backend cannot be reached (connection refused, reset).
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The backend did not answer in time.
    #[error("backend timed out")]
    Timeout,
    /// The queue is full; retry after the given number of seconds.
    #[error("backend overloaded")]
    Overloaded {
        /// Suggested `Retry-After` in seconds.
        retry_after_secs: u64,
    },
    /// The backend rejected the request as invalid (a 4xx upstream, a prompt too long).
    #[error("{message}")]
    InvalidRequest {
        /// Human-readable reason, safe to show to the client.
        message: String,
        /// The offending parameter, if known.
        param: Option<String>,
    },
    /// The model is not served by this backend.
    #[error("model `{0}` is not served")]
    UnknownModel(String),
    /// The backend answered something it should not have, or failed internally.
    #[error("backend failure: {0}")]
    Internal(String),
}

impl BackendError {
    /// Low-cardinality label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::Unavailable(_) => "unavailable",
            BackendError::Timeout => "timeout",
            BackendError::Overloaded { .. } => "overloaded",
            BackendError::InvalidRequest { .. } => "invalid_request",
            BackendError::UnknownModel(_) => "unknown_model",
            BackendError::Internal(_) => "internal",
        }
    }
}

/// A stream of generation events. Dropping it cancels the generation.
pub type GenStream = Pin<Box<dyn Stream<Item = Result<GenEvent, BackendError>> + Send + 'static>>;

/// A response body passed on as it arrives. Dropping it closes the upstream request.
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes, BackendError>> + Send + 'static>>;

/// A request reprise does not answer itself, sent to the backend as the client wrote it: a
/// completion the cache cannot represent (tools, several choices, images,
/// log-probabilities), or another endpoint of the API (embeddings, files, ...).
#[derive(Debug)]
pub struct ForwardRequest {
    /// HTTP method.
    pub method: reqwest::Method,
    /// Path and query below the backend's base URL, e.g. `chat/completions`.
    pub path: String,
    /// Request headers passed on (content type, accept, API version selectors).
    pub headers: Vec<(String, String)>,
    /// The model the body names, checked against the backend's model list when known.
    pub model: Option<String>,
    /// The client's body, streamed as it arrives (uploads are not buffered); a forwarded
    /// completion's carries the tenant's `max_tokens` cap when it asked for none.
    pub body: reqwest::Body,
    /// A request a user waits for (a completion, or another endpoint's request that is not a
    /// read), at this priority: it counts as interactive load (background work backs off)
    /// and takes one of the upstream's slots (`backend.max_concurrent`) until its answer is
    /// read. `None` for reads (`GET /v1/models`), which are neither counted nor limited.
    pub priority: Option<Priority>,
    /// The backend a route chose for it, by its configured name (`None`: the upstream
    /// serving `model`). Read only by a router of several backends.
    pub backend: Option<String>,
}

/// The backend's answer to a [`ForwardRequest`], untouched: a success or a failure status
/// other than 401/403. A refused key and redirects come back as [`BackendError`].
pub struct Forwarded {
    /// HTTP status.
    pub status: u16,
    /// Response headers passed back (content type and disposition, request id,
    /// `retry-after`, rate-limit headers).
    pub headers: Vec<(String, String)>,
    /// The body, chunk by chunk as it arrives.
    pub body: ByteStream,
}

impl std::fmt::Debug for Forwarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarded")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

/// A model server that reprise sends misses to.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Starts a generation. Returns once the request was accepted (queued or started); errors
    /// that are known before any token (overload, unknown model, unreachable upstream) come back
    /// here rather than inside the stream.
    async fn generate(&self, req: GenRequest) -> Result<GenStream, BackendError>;

    /// Model names this backend serves.
    fn models(&self) -> Vec<String>;

    /// Whether the backend can take requests (model loaded, upstream configured).
    fn ready(&self) -> bool;

    /// Number of user requests (interactive and batch) queued or running; where the backend
    /// cannot tell its capacity ([`Load::capacity`] 0), background work backs off while it is
    /// above zero.
    fn interactive_load(&self) -> usize {
        0
    }

    /// What it is doing now (capacity, running and waiting generations by class); capacity 0
    /// when it is unlimited or unknown.
    fn load(&self) -> Load {
        Load::default()
    }

    /// The `max_tokens` it generates to for a request without one, when it applies one
    /// itself (llama, scripted); `None` where the answer's length is another's to decide
    /// (an upstream's default).
    fn default_max_tokens(&self) -> Option<u32> {
        None
    }

    /// The field a chat completion's token bound is sent upstream as, unless the client named
    /// `max_completion_tokens` (a bound reprise writes in, a client's `max_tokens` on an
    /// answer reprise generates).
    fn bound_field(&self) -> BoundField {
        BoundField::MaxTokens
    }

    /// Whether [`Backend::forward`] works: only an HTTP upstream can answer what reprise does
    /// not answer itself.
    fn forwards(&self) -> bool {
        false
    }

    /// Sends a request unchanged and passes the answer back unchanged (never cached).
    async fn forward(&self, req: ForwardRequest) -> Result<Forwarded, BackendError> {
        Err(BackendError::InvalidRequest {
            message: format!("this backend does not answer `{}`", req.path),
            param: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_the_fields_it_passes_through() {
        let mut req = GenRequest {
            model: "m".into(),
            input: Input::Prompt("hi".into()),
            params: SamplingParams::default(),
            priority: Priority::Interactive,
            extra: Default::default(),
            backend: None,
        };
        let bare = req.heap_bytes();
        let big = "x".repeat(1 << 20);
        req.extra.insert(
            "response_format".into(),
            serde_json::json!({"schema": [big]}),
        );
        assert!(req.heap_bytes() >= bare + (1 << 20));
    }
}
