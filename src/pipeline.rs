//! The request path, top to bottom:
//!
//! 1. **parse** the body into a [`GenRequest`] (OpenAI error shape on bad input);
//! 2. **controls** from headers: namespace, `Cache-Control`, threshold;
//! 3. **policy**: may this request read / write the cache?
//! 4. **exact lookup** by the blake3 key of the canonical request;
//! 5. **semantic lookup**: embed the last user turn, search its partition (namespace, model,
//!    parameters, conversation context), check the false-hit gate;
//! 6. **single-flight**: join an identical generation already running, or lead a new one;
//! 7. **backend** generation, driven by a task that records events for every waiter;
//! 8. **write-back** once the generation finished (never for errors, cut-off streams or
//!    abandoned generations), then the response is rendered as JSON or SSE.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use reprise_backend::{
    BackendError, ChatMessage, FinishReason, ForwardRequest, GenEvent, GenRequest, Input, Priority,
    SamplingParams, Usage,
};
use reprise_cache::{now_ms, Digest, Entry, EntryId, Origin};
use serde_json::Value;

use crate::error::ApiError;
use crate::flight::{End, Flight, Joined, Subscriber};
use crate::key::{self, Conversation, KeyHasher};
use crate::metrics::{Outcome, Tier};
use crate::openai::{
    ChatCompletionRequest, CompletionRequest, Content, Endpoint, Prompt, Renderer,
};
use crate::prefetch::Observation;
use crate::reqlog::LogRecord;
use crate::state::AppState;

/// Header naming the tenant namespace.
pub const NAMESPACE_HEADER: &str = "x-reprise-namespace";
/// Response header saying how the request was answered.
pub const CACHE_HEADER: &str = "x-reprise-cache";
/// Response header with the similarity of a semantic hit.
pub const SIMILARITY_HEADER: &str = "x-reprise-similarity";
/// Request header raising the similarity threshold for this request.
pub const THRESHOLD_HEADER: &str = "x-reprise-threshold";
/// Request header linking consecutive single-turn prompts of one session (for prefetch).
pub const SESSION_HEADER: &str = "x-reprise-session";
/// Request header with comma-separated invalidation tags for the stored answer.
pub const TAGS_HEADER: &str = "x-reprise-tags";
/// The namespace of requests that name none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// A parsed request.
pub struct Parsed {
    /// What the backend would be asked.
    pub req: GenRequest,
    /// Answer as SSE.
    pub stream: bool,
    /// Send a usage chunk at the end of the stream.
    pub include_usage: bool,
    /// The OpenAI `user` field.
    pub user: Option<String>,
}

/// What [`parse`] makes of a body.
pub enum Request {
    /// Answered from the cache, or generated and stored.
    Cacheable(Parsed),
    /// Asks for more than a cached text answer can give; goes upstream as it came.
    Forward(Forward),
}

/// A request that only an upstream can answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forward {
    /// The model the body names.
    pub model: String,
    /// The client asked for a stream.
    pub stream: bool,
    /// The field that needs the upstream, as a path: `tools`, `messages[2].tool_calls`, `n`.
    pub param: String,
    /// The same field without indices, for the metric label: `tools`, `messages.tool_calls`.
    pub field: &'static str,
}

impl Forward {
    fn new(model: String, stream: Option<bool>, (param, field): (String, &'static str)) -> Self {
        Forward {
            model,
            stream: stream.unwrap_or(false),
            param,
            field,
        }
    }
}

/// Chat request fields whose answer is more than text: tool calls, log-probabilities, audio.
const CHAT_FORWARD_FIELDS: &[&str] = &[
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "audio",
    "modalities",
    "web_search_options",
];

/// Message fields of tool and audio conversations, which the cache's text-only messages
/// cannot carry.
const MESSAGE_FORWARD_FIELDS: &[(&str, &str)] = &[
    ("tool_calls", "messages.tool_calls"),
    ("tool_call_id", "messages.tool_call_id"),
    ("function_call", "messages.function_call"),
    ("audio", "messages.audio"),
];

/// Completions request fields whose answer is more than one text.
const COMPLETION_FORWARD_FIELDS: &[&str] = &["best_of", "logprobs", "echo", "suffix"];

/// Whether a field's value asks for something: not null, `false`, `[]`, `""`, a
/// `modalities` of text only or a `best_of` of 1.
fn asks_for(field: &str, v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => false,
        Value::Array(a) if field == "modalities" => a.iter().any(|m| m.as_str() != Some("text")),
        Value::Array(a) => !a.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Number(n) if field == "best_of" => n.as_u64() != Some(1),
        _ => true,
    }
}

/// The first of `fields` that a request asks for, else `n > 1`, as (`param`, metric label).
fn top_level_forward_field(
    fields: &[&'static str],
    extra: &serde_json::Map<String, Value>,
    n: Option<u32>,
) -> Option<(String, &'static str)> {
    if let Some(f) = fields
        .iter()
        .find(|f| extra.get(**f).is_some_and(|v| asks_for(f, v)))
    {
        return Some((f.to_string(), *f));
    }
    n.is_some_and(|n| n > 1).then(|| ("n".to_string(), "n"))
}

/// The first field of a chat request that needs the upstream, as (`param`, metric label).
fn chat_forward_field(r: &ChatCompletionRequest) -> Option<(String, &'static str)> {
    if let Some(found) = top_level_forward_field(CHAT_FORWARD_FIELDS, &r.extra, r.n) {
        return Some(found);
    }
    for (i, m) in r.messages.iter().enumerate() {
        if matches!(m.role.as_str(), "tool" | "function") {
            return Some((format!("messages[{i}].role"), "messages.role"));
        }
        if let Some((f, label)) = MESSAGE_FORWARD_FIELDS
            .iter()
            .find(|(f, _)| m.extra.get(*f).is_some_and(|v| asks_for(f, v)))
        {
            return Some((format!("messages[{i}].{f}"), *label));
        }
        if let Some(Content::Parts(parts)) = &m.content {
            if parts.iter().any(|p| p.kind != "text") {
                return Some((format!("messages[{i}].content"), "messages.content"));
            }
        }
    }
    None
}

/// The first field of a completions request that needs the upstream.
fn completion_forward_field(r: &CompletionRequest) -> Option<(String, &'static str)> {
    top_level_forward_field(COMPLETION_FORWARD_FIELDS, &r.extra, r.n).or_else(|| {
        matches!(&r.prompt, Prompt::Many(v) if v.len() > 1)
            .then(|| ("prompt".to_string(), "prompt"))
            .or_else(|| {
                matches!(&r.prompt, Prompt::Tokens(_)).then(|| ("prompt".to_string(), "prompt"))
            })
    })
}

/// Request controls taken from headers.
#[derive(Debug, Clone)]
pub struct Controls {
    /// Tenant namespace.
    pub namespace: String,
    /// `Cache-Control: no-cache`: do not read, do store the fresh answer.
    pub no_cache: bool,
    /// `Cache-Control: no-store`: neither read nor write.
    pub no_store: bool,
    /// `Cache-Control: only-if-cached`: answer from the cache or fail with 504; never call
    /// the backend, never store (RFC 9111).
    pub only_if_cached: bool,
    /// Similarity threshold requested by the client (only ever raises the configured one).
    pub threshold: Option<f32>,
    /// `Cache-Control: max-age=N`: only answers at most N seconds old may be served.
    pub max_age_secs: Option<u64>,
    /// Session id linking consecutive prompts (`x-reprise-session`).
    pub session: Option<String>,
    /// Invalidation tags for the entry this request creates (`x-reprise-tags: a,b`).
    pub tags: Vec<String>,
}

impl Controls {
    /// Reads and validates the control headers.
    pub fn from_headers(headers: &HeaderMap) -> Result<Controls, ApiError> {
        let namespace = match headers.get(NAMESPACE_HEADER) {
            None => DEFAULT_NAMESPACE.to_string(),
            Some(v) => {
                let s = v.to_str().map_err(|_| ApiError::BadHeader {
                    header: NAMESPACE_HEADER,
                    reason: "must be visible ASCII".into(),
                })?;
                if s.is_empty() || s.len() > 128 {
                    return Err(ApiError::BadHeader {
                        header: NAMESPACE_HEADER,
                        reason: "must be 1 to 128 characters".into(),
                    });
                }
                s.to_string()
            }
        };
        let mut no_cache = false;
        let mut no_store = false;
        let mut only_if_cached = false;
        let mut max_age_secs: Option<u64> = None;
        for v in headers.get_all(axum::http::header::CACHE_CONTROL) {
            for directive in v.to_str().unwrap_or("").split(',') {
                let directive = directive.trim().to_ascii_lowercase();
                match directive.as_str() {
                    "no-cache" => no_cache = true,
                    "no-store" => no_store = true,
                    "only-if-cached" => only_if_cached = true,
                    d => {
                        if let Some(value) = d.strip_prefix("max-age=") {
                            let value = value.trim_matches('"');
                            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                                return Err(ApiError::BadHeader {
                                    header: "cache-control",
                                    reason: "max-age must be a whole number of seconds".into(),
                                });
                            }
                            // RFC 9111 1.2.2: values too large to represent count as 2^31.
                            let secs = value.parse::<u64>().map_or(1 << 31, |s| s.min(1 << 31));
                            // Several max-age directives: the strictest wins.
                            max_age_secs = Some(max_age_secs.map_or(secs, |m| m.min(secs)));
                        }
                    }
                }
            }
        }
        let threshold = match headers.get(THRESHOLD_HEADER) {
            None => None,
            Some(v) => {
                let t: f32 = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .filter(|t: &f32| t.is_finite() && (0.0..=1.0).contains(t))
                    .ok_or_else(|| ApiError::BadHeader {
                        header: THRESHOLD_HEADER,
                        reason: "must be a number between 0 and 1".into(),
                    })?;
                Some(t)
            }
        };
        Ok(Controls {
            namespace,
            no_cache,
            no_store,
            only_if_cached,
            threshold,
            max_age_secs,
            tags: headers
                .get(TAGS_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(|v| {
                    v.split(',')
                        .map(str::trim)
                        .filter(|t| !t.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default(),
            session: headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .filter(|s| !s.is_empty() && s.len() <= 256)
                .map(str::to_string),
        })
    }
}

/// Entry point of both completion endpoints.
pub async fn handle(
    state: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let mut trace = Trace::new(&state, endpoint);
    match serve(&state, endpoint, &headers, body, &mut trace).await {
        Ok(resp) => resp,
        Err(e) => {
            trace.fail(&e);
            let mut resp = e.into_response();
            set_cache_headers(&mut resp, Outcome::Error, None);
            resp
        }
    }
}

async fn serve(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    trace: &mut Trace,
) -> Result<Response, ApiError> {
    // 1. Parse.
    let body = body.map_err(|e| body_error(e, state.config.server.max_body_bytes))?;
    let parsed = match parse(endpoint, &body)? {
        Request::Cacheable(parsed) => parsed,
        Request::Forward(f) => return forward(state, endpoint, headers, body, f, trace).await,
    };
    // 2. Controls.
    let ctl = admit(state, headers, &parsed.req.model, trace)?;
    // 3. Policy.
    let access = reprise_policies::cache::access(
        state.config.cache.enabled,
        reprise_policies::cache::Directives {
            no_cache: ctl.no_cache,
            no_store: ctl.no_store,
            only_if_cached: ctl.only_if_cached,
        },
    );
    let (read, write) = (access.read, access.write);
    let renderer = Renderer::new(endpoint, &parsed.req.model);

    // 4. Exact and 5. semantic lookup.
    let found = lookup(
        state,
        &ctl.namespace,
        endpoint,
        &parsed.req,
        read,
        write,
        Accept {
            threshold: ctl.threshold,
            max_age_secs: ctl.max_age_secs,
        },
        trace,
    )
    .await;
    let session = ctl.session.clone().or_else(|| parsed.user.clone());
    if let Some(hit) = found.hit {
        if write && hit.outcome != Outcome::Exact {
            // An exact repeat of this phrasing, and the next turn of this conversation, find
            // the entry directly next time (an exact hit found it by these keys already).
            let mut keys = Vec::new();
            if !found.exact_taken {
                keys.push(found.plan.exact);
            }
            keys.extend(found.plan.turn_key(&hit.entry.text));
            for k in keys {
                state.memory.alias(k, hit.entry.id).await;
                if let Some(redis) = &state.redis {
                    redis.alias(k, hit.entry.id, hit.entry.ttl_left());
                }
            }
        }
        if hit.entry.origin == Origin::Prefetch {
            // A prefetched entry says so on its first use; after that it is a normal entry.
            let mut used = (*hit.entry).clone();
            used.origin = Origin::Live;
            state.memory.insert_entry(Arc::new(used)).await;
            if let Some(p) = &state.prefetch {
                p.used(hit.entry.id);
            }
        }
        if let Some(p) = &state.prefetch {
            p.observe(Observation {
                namespace: ctl.namespace.clone(),
                endpoint,
                request: parsed.req.clone(),
                session,
                prev_entry: found.prev_entry,
                entry: hit.entry.clone(),
            });
        }
        return Ok(respond_hit(
            &parsed,
            renderer,
            hit.entry,
            hit.outcome,
            hit.similarity,
            trace,
        ));
    }
    let exact = found.plan.exact;
    let mut plan = found.plan;
    plan.tags = ctl.tags.clone();
    if state.prefetch.is_some() {
        plan.observe = Some(ObserveLater {
            endpoint,
            request: parsed.req.clone(),
            session,
            prev_entry: found.prev_entry,
        });
    }

    if !access.forward {
        return Err(ApiError::NotCached);
    }

    // 6. Single-flight, 7. backend, 8. write-back (in the driver task).
    let outcome = if write {
        Outcome::Miss
    } else {
        Outcome::Bypass
    };
    trace.outcome = outcome;
    // A paraphrase of a question being generated right now waits for that answer.
    if let (true, Some(policy), Some(partition), Some(embedding)) = (
        read && write,
        found.policy,
        plan.partition,
        plan.embedding.clone(),
    ) {
        let twin = state
            .twins
            .find(&partition, &embedding, policy.threshold, |p| {
                !policy.gate || reprise_policies::gate(&plan.prompt, p).is_pass()
            });
        if let Some(sub) = twin.and_then(|(key, sim)| state.flights.follow(&key).map(|s| (s, sim)))
        {
            let (sub, sim) = sub;
            state.metrics.singleflight_joins.increment(1);
            trace.outcome = Outcome::Semantic;
            trace.record.similarity = Some(sim);
            let mut resp =
                respond_generation(state, &parsed, renderer, sub, Outcome::Semantic, trace).await?;
            set_similarity(&mut resp, sim);
            return Ok(resp);
        }
    }
    let sub = if write {
        match state.flights.join(exact) {
            Joined::Follower(sub) => {
                state.metrics.singleflight_joins.increment(1);
                sub
            }
            Joined::Leader(flight, sub) => {
                if let (Some(partition), Some(embedding)) = (plan.partition, plan.embedding.clone())
                {
                    state
                        .twins
                        .register(partition, exact, plan.prompt.clone(), embedding);
                }
                spawn_generation(
                    state.clone(),
                    flight,
                    Some(exact),
                    parsed.req.clone(),
                    Some(plan),
                );
                sub
            }
        }
    } else {
        let (flight, sub) = state.flights.solo();
        spawn_generation(state.clone(), flight, None, parsed.req.clone(), None);
        sub
    };
    respond_generation(state, &parsed, renderer, sub, outcome, trace).await
}

/// Reads the control headers and checks that the server is ready and serves `model`.
fn admit(
    state: &AppState,
    headers: &HeaderMap,
    model: &str,
    trace: &mut Trace,
) -> Result<Controls, ApiError> {
    let ctl = Controls::from_headers(headers)?;
    trace.record.namespace = ctl.namespace.clone();
    if !state.is_ready() {
        return Err(ApiError::NotReady);
    }
    if !state.models.is_empty() && !state.models.iter().any(|m| m == model) {
        return Err(ApiError::UnknownModel(model.to_string()));
    }
    Ok(ctl)
}

/// Sends a request the cache cannot represent upstream as it came and streams the answer
/// back as it arrives. Nothing is looked up, stored or learned from it.
async fn forward(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
    f: Forward,
    trace: &mut Trace,
) -> Result<Response, ApiError> {
    let ctl = admit(state, headers, &f.model, trace)?;
    if ctl.only_if_cached {
        return Err(ApiError::NotCached);
    }
    if !state.backend.forwards() {
        return Err(ApiError::invalid(
            format!(
                "`{}` needs an OpenAI-compatible upstream (backend.kind = \"openai\"): the \
                 in-process llama backend answers with text only",
                f.param
            ),
            Some(&f.param),
        ));
    }
    trace.outcome = Outcome::Bypass;
    state.metrics.forwarded(f.field);
    let server = &state.config.server;
    // A non-streaming upstream sends its headers only once the whole answer is ready, so the
    // whole request has one deadline; a stream has the first-token timeout for its headers.
    let deadline = (!f.stream).then(|| tokio::time::Instant::now() + server.request_timeout());
    let headers_by =
        deadline.unwrap_or_else(|| tokio::time::Instant::now() + server.first_token_timeout());
    let req = ForwardRequest {
        method: axum::http::Method::POST,
        path: match endpoint {
            Endpoint::Chat => "chat/completions",
            Endpoint::Completion => "completions",
        }
        .to_string(),
        headers: passed_on_headers(headers, "application/json"),
        model: Some(f.model),
        body: body.into(),
        interactive: true,
    };
    let answer = tokio::time::timeout_at(headers_by, state.backend.forward(req))
        .await
        .map_err(|_| ApiError::Timeout)??;
    let trace = std::mem::replace(trace, Trace::detached());
    // A stream's first chunk may follow its headers after the whole prefill.
    let limits = match deadline {
        Some(d) => BodyLimits::Deadline(d),
        None => BodyLimits::Stream {
            first_by: headers_by,
            gap: server.token_timeout(),
        },
    };
    Ok(forwarded_response(answer, limits, trace))
}

/// Request headers that travel with a forwarded request; a missing content type is `default`.
fn passed_on_headers(headers: &HeaderMap, default_type: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> =
        ["content-type", "content-length", "accept", "openai-beta"]
            .into_iter()
            .filter_map(|name| {
                Some((
                    name.to_string(),
                    headers.get(name)?.to_str().ok()?.to_string(),
                ))
            })
            .collect();
    if !out.iter().any(|(name, _)| name == "content-type") && !default_type.is_empty() {
        out.push(("content-type".into(), default_type.into()));
    }
    out
}

/// How long a forwarded body may take.
#[derive(Debug, Clone, Copy)]
enum BodyLimits {
    /// No limit (files and other non-completion endpoints).
    None,
    /// The whole body by then.
    Deadline(tokio::time::Instant),
    /// A stream: its first chunk (its first token) by `first_by`, then at most `gap` between
    /// two chunks.
    Stream {
        first_by: tokio::time::Instant,
        gap: std::time::Duration,
    },
}

/// The client's response to a forwarded request: the upstream's status, headers and body as
/// they come, within `limits`. A client error from the upstream counts as an error in the
/// metrics.
fn forwarded_response(
    answer: reprise_backend::Forwarded,
    limits: BodyLimits,
    mut trace: Trace,
) -> Response {
    let stream = matches!(limits, BodyLimits::Stream { .. });
    let status = axum::http::StatusCode::from_u16(answer.status)
        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let outcome = if status.is_success() {
        Outcome::Bypass
    } else {
        trace.failed(match status.as_u16() {
            429 => "overloaded",
            500.. => "unavailable",
            _ => "invalid_request",
        });
        Outcome::Error
    };
    let mut upstream = answer.body;
    let body = async_stream::stream! {
        loop {
            let next = match limits {
                BodyLimits::None => Ok(upstream.next().await),
                BodyLimits::Deadline(d) => tokio::time::timeout_at(d, upstream.next()).await,
                BodyLimits::Stream { first_by, .. } if trace.first_token.is_none() => {
                    tokio::time::timeout_at(first_by, upstream.next()).await
                }
                BodyLimits::Stream { gap, .. } => tokio::time::timeout(gap, upstream.next()).await,
            };
            match next {
                Ok(Some(Ok(chunk))) => {
                    if stream {
                        trace.first_token();
                    }
                    yield Ok::<Bytes, std::io::Error>(chunk);
                }
                Ok(Some(Err(e))) => {
                    // The status is sent: cutting the body off is all that is left to say.
                    trace.failed(e.kind());
                    yield Err(std::io::Error::other(e));
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    trace.failed(ApiError::Timeout.kind());
                    yield Err(std::io::Error::other("the request timed out"));
                    break;
                }
            }
        }
    };
    let mut resp = Response::new(axum::body::Body::from_stream(body));
    *resp.status_mut() = status;
    for (name, value) in answer.headers {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::try_from(name),
            HeaderValue::from_str(&value),
        ) {
            resp.headers_mut().insert(name, value);
        }
    }
    set_cache_headers(&mut resp, outcome, None);
    resp
}

/// Whether a forwarded path is a plain path below the upstream's base URL: no empty, `.` or
/// `..` segment (also percent-encoded, which URL parsing resolves), no encoded slash, no
/// backslash. Otherwise `/v1/../admin` would reach the upstream's other paths with reprise's
/// key, and `/v1/chat/completions/` would slip past reprise's own route.
fn plain_api_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || lower.contains('\\') {
        return false;
    }
    lower
        .split('/')
        .map(|seg| seg.replace("%2e", "."))
        .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// The endpoint of a `/v1/...` path that `backend.passthrough` opens to the upstream, if any.
fn passthrough_endpoint<'a>(state: &'a AppState, path: &str) -> Option<&'a str> {
    if !state.backend.forwards() || !plain_api_path(path) {
        return None;
    }
    let root = path.split('/').next()?;
    // The completion endpoints are reprise's own, whatever the method or suffix.
    if matches!(root, "chat" | "completions") {
        return None;
    }
    state
        .config
        .backend
        .passthrough
        .iter()
        .find(|e| e.as_str() == root)
        .map(String::as_str)
}

/// A `/v1/...` request to another endpoint of the API that `backend.passthrough` lists: sent
/// to the OpenAI-compatible upstream as it came (method, path, query, body) and its answer
/// passed back unchanged, so that an app can point its whole OpenAI base URL at reprise.
/// `None` when the endpoint is not open (the caller answers 404).
pub async fn passthrough(
    state: &Arc<AppState>,
    method: axum::http::Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Option<Response> {
    let path = uri.path().strip_prefix("/v1/")?;
    let endpoint = passthrough_endpoint(state, path)?;
    let result = async {
        if !state.is_ready() {
            return Err(ApiError::NotReady);
        }
        let label = crate::openai::API_ROOTS
            .iter()
            .find(|r| **r == endpoint)
            .copied()
            .unwrap_or("other");
        state.metrics.passed_through(label);
        let req = ForwardRequest {
            method,
            path: match uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path.to_string(),
            },
            headers: passed_on_headers(headers, ""),
            model: None,
            // Streamed, not buffered: uploads (files, audio) can be large, and the upstream
            // enforces its own limits.
            body: reqwest::Body::wrap_stream(body.into_data_stream()),
            interactive: false,
        };
        let server = &state.config.server;
        let answer = tokio::time::timeout(server.request_timeout(), state.backend.forward(req))
            .await
            .map_err(|_| ApiError::Timeout)??;
        // Not a completion: no request metrics, no request log.
        Ok(forwarded_response(
            answer,
            BodyLimits::None,
            Trace::detached(),
        ))
    }
    .await;
    Some(result.unwrap_or_else(|e| {
        let mut resp = e.into_response();
        set_cache_headers(&mut resp, Outcome::Error, None);
        resp
    }))
}

/// Maps the axum body rejection to our error shape.
fn body_error(e: BytesRejection, limit: usize) -> ApiError {
    if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::BodyTooLarge { limit }
    } else {
        ApiError::invalid(format!("could not read the request body: {e}"), None)
    }
}

/// Parses and validates a request body. A request that asks for more than a text answer
/// (tools, several choices, images, log-probabilities) is only checked for the fields reprise
/// itself reads; the upstream validates the rest.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request, ApiError> {
    fn de<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
        let de = &mut serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                return ApiError::invalid(format!("the body is not valid JSON: {inner}"), None);
            }
            let param = (path != ".").then_some(path);
            ApiError::InvalidRequest {
                message: format!("invalid request: {inner}"),
                param,
            }
        })
    }
    let (req, stream, include_usage, user, n) = match endpoint {
        Endpoint::Chat => {
            let r: ChatCompletionRequest = de(body)?;
            if r.messages.is_empty() {
                return Err(ApiError::invalid(
                    "`messages` must not be empty",
                    Some("messages"),
                ));
            }
            if let Some(found) = chat_forward_field(&r) {
                return Ok(Request::Forward(Forward::new(r.model, r.stream, found)));
            }
            let mut msgs = Vec::with_capacity(r.messages.len());
            for (i, m) in r.messages.into_iter().enumerate() {
                if !matches!(
                    m.role.as_str(),
                    "system" | "developer" | "user" | "assistant" | "tool"
                ) {
                    return Err(ApiError::invalid(
                        format!("unknown role `{}`", m.role),
                        Some(&format!("messages[{i}].role")),
                    ));
                }
                let content = match m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t,
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            // Other part types went to `Forward` above.
                            match p.text {
                                Some(t) => text.push_str(&t),
                                None => {
                                    return Err(ApiError::invalid(
                                        "a `text` content part needs a `text` string",
                                        Some(&format!("messages[{i}].content")),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                msgs.push(ChatMessage {
                    role: m.role,
                    content,
                    name: m.name,
                });
            }
            let params = SamplingParams {
                max_tokens: r.max_completion_tokens.or(r.max_tokens),
                temperature: r.temperature,
                top_p: r.top_p,
                seed: r.seed,
                stop: r.stop.map(|s| s.into_vec()).unwrap_or_default(),
                presence_penalty: r.presence_penalty,
                frequency_penalty: r.frequency_penalty,
            };
            let req = GenRequest {
                model: r.model,
                input: Input::Chat(msgs),
                params,
                priority: Priority::Interactive,
                extra: r.extra,
            };
            (
                req,
                r.stream.unwrap_or(false),
                r.stream_options.is_some_and(|o| o.include_usage),
                r.user,
                r.n,
            )
        }
        Endpoint::Completion => {
            let r: CompletionRequest = de(body)?;
            if let Some(found) = completion_forward_field(&r) {
                return Ok(Request::Forward(Forward::new(r.model, r.stream, found)));
            }
            let prompt = match r.prompt {
                Prompt::One(p) => p,
                Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
                Prompt::Many(_) | Prompt::Tokens(_) => {
                    return Err(ApiError::invalid(
                        "`prompt` must not be empty",
                        Some("prompt"),
                    ))
                }
            };
            let params = SamplingParams {
                max_tokens: r.max_tokens,
                temperature: r.temperature,
                top_p: r.top_p,
                seed: r.seed,
                stop: r.stop.map(|s| s.into_vec()).unwrap_or_default(),
                presence_penalty: r.presence_penalty,
                frequency_penalty: r.frequency_penalty,
            };
            let req = GenRequest {
                model: r.model,
                input: Input::Prompt(prompt),
                params,
                priority: Priority::Interactive,
                extra: r.extra,
            };
            (
                req,
                r.stream.unwrap_or(false),
                r.stream_options.is_some_and(|o| o.include_usage),
                r.user,
                r.n,
            )
        }
    };
    // `n > 1` went to `Forward` above.
    if n == Some(0) {
        return Err(ApiError::invalid("`n` must be at least 1", Some("n")));
    }
    let p = &req.params;
    if p.temperature.is_some_and(|t| !(0.0..=2.0).contains(&t)) {
        return Err(ApiError::invalid(
            "`temperature` must be between 0 and 2",
            Some("temperature"),
        ));
    }
    if p.top_p.is_some_and(|t| !(t > 0.0 && t <= 1.0)) {
        return Err(ApiError::invalid(
            "`top_p` must be in (0, 1]",
            Some("top_p"),
        ));
    }
    if p.max_tokens == Some(0) {
        return Err(ApiError::invalid(
            "`max_tokens` must be at least 1",
            Some("max_tokens"),
        ));
    }
    if p.stop.len() > 4 || p.stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "`stop` takes up to 4 non-empty strings",
            Some("stop"),
        ));
    }
    for (name, v) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if v.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return Err(ApiError::invalid(
                format!("`{name}` must be between -2 and 2"),
                Some(name),
            ));
        }
    }
    Ok(Request::Cacheable(Parsed {
        req,
        stream,
        include_usage,
        user,
    }))
}

/// What a write-back stores, gathered along the request path.
#[derive(Debug, Clone)]
pub struct WritePlan {
    /// The exact key the new entry is stored under.
    pub exact: Digest,
    /// Tenant.
    pub namespace: String,
    /// Model.
    pub model: String,
    /// The text matched semantically (empty when the request has none).
    pub prompt: String,
    /// Semantic partition, when the request can be matched semantically.
    pub partition: Option<Digest>,
    /// Embedding of `prompt`.
    pub embedding: Option<Arc<[f32]>>,
    /// Context and query of this turn, to link the answer to the next turn's context.
    pub turn: Option<(Digest, Digest)>,
    /// Live, prefetch or refresh.
    pub origin: Origin,
    /// Report the stored entry to the prefetcher (live requests, when prefetch is on).
    pub observe: Option<ObserveLater>,
    /// Invalidation tags from `x-reprise-tags`.
    pub tags: Vec<String>,
}

/// What the prefetcher is told about a miss once its answer is stored.
#[derive(Debug, Clone)]
pub struct ObserveLater {
    /// Endpoint of the request.
    pub endpoint: Endpoint,
    /// The request as asked.
    pub request: GenRequest,
    /// Session id (`x-reprise-session` or the `user` field).
    pub session: Option<String>,
    /// The entry that answered the previous turn.
    pub prev_entry: Option<EntryId>,
}

impl WritePlan {
    /// The key that links "this context, this query, this answer" to the entry that answered,
    /// so a later turn whose history contains this exchange resolves its context to the entry.
    fn turn_key(&self, answer: &str) -> Option<Digest> {
        let (context, query) = self.turn?;
        Some(turn_key(
            &self.namespace,
            &self.model,
            &context,
            &query,
            answer,
        ))
    }
}

fn turn_key(
    namespace: &str,
    model: &str,
    context: &Digest,
    query: &Digest,
    answer: &str,
) -> Digest {
    let mut h = KeyHasher::new("turn");
    h.str(namespace)
        .str(model)
        .digest(context)
        .digest(query)
        .str(answer);
    h.finish()
}

/// The entry a key points at: memory (L1), then Redis (L2), whose hits are promoted into this
/// replica's memory and index. `counted` records the lookups in the metrics.
/// What a key leads to.
enum ByKey {
    /// An entry fresh enough for the request.
    Fresh(Arc<Entry>),
    /// Only an entry too old for the request (`Cache-Control: max-age`).
    Stale,
    /// Nothing.
    Absent,
}

impl ByKey {
    fn fresh(self) -> Option<Arc<Entry>> {
        match self {
            ByKey::Fresh(e) => Some(e),
            _ => None,
        }
    }
}

/// The entry a key leads to, in memory then in Redis, if it is fresh enough for `accept`.
/// A memory entry that is too old may have been replaced by another replica, so Redis is
/// asked then too.
async fn find_by_key(state: &AppState, key: &Digest, counted: bool, accept: Accept) -> ByKey {
    let (hit, stale) = accept.sort(state.memory.get_by_key(key).await);
    if counted {
        state.metrics.lookup(Tier::Exact, hit.is_some());
    }
    if let Some(entry) = hit {
        return ByKey::Fresh(entry);
    }
    let miss = |stale: bool| if stale { ByKey::Stale } else { ByKey::Absent };
    let Some(redis) = state.redis.as_ref() else {
        return miss(stale);
    };
    let (l2, l2_stale) = accept.sort(redis.get_by_key(key).await.ok().flatten());
    if counted {
        state.metrics.lookup(Tier::Redis, l2.is_some());
    }
    let Some(l2) = l2 else {
        return miss(stale || l2_stale);
    };
    let entry = crate::replication::install(state, l2).await;
    state.memory.alias(*key, entry.id).await;
    ByKey::Fresh(entry)
}

/// A conversation's resolved context.
struct Context {
    /// The context of this turn (to link this turn's answer for the next turn).
    turn: Digest,
    /// The turn context plus any messages pending before the query (they are not matched by
    /// meaning, so they must match exactly).
    partition: Digest,
    /// Digest of this turn's query messages.
    query: Digest,
    /// The entry that answered the previous exchange, when reprise served it.
    prev_entry: Option<EntryId>,
}

/// Resolves a conversation's context: the preamble, then each earlier exchange. An exchange
/// that reprise itself answered stands for the entry that answered it, so two histories that
/// reached the same answer through different phrasings share one context.
async fn resolve_context(
    state: &AppState,
    namespace: &str,
    model: &str,
    conv: &Conversation<'_>,
) -> Context {
    let mut ctx = key::messages_digest("preamble", &conv.preamble);
    let mut prev_entry = None;
    for (msgs, answer) in &conv.turns {
        let query = key::messages_digest("query", msgs);
        let link = turn_key(namespace, model, &ctx, &query, &answer.content);
        let mut h;
        // L2 too: the link may have been written by another replica.
        match find_by_key(state, &link, false, Accept::default())
            .await
            .fresh()
        {
            Some(entry) => {
                h = KeyHasher::new("ctx-entry");
                h.str(&entry.id.to_string());
                prev_entry = Some(entry.id);
            }
            None => {
                h = KeyHasher::new("ctx-raw");
                h.digest(&ctx).digest(&query).str(&answer.content);
                prev_entry = None;
            }
        }
        ctx = h.finish();
    }
    let mut query_msgs = conv.pending.clone();
    query_msgs.push(conv.last);
    let query = key::messages_digest("query", &query_msgs);
    let mut h = KeyHasher::new("ctx-pending");
    h.digest(&ctx);
    for m in &conv.pending {
        h.message(m);
    }
    Context {
        turn: ctx,
        partition: h.finish(),
        query,
        prev_entry,
    }
}

/// A servable entry found for a request.
pub struct Hit {
    /// The entry.
    pub entry: Arc<Entry>,
    /// Exact, semantic or prefetch.
    pub outcome: Outcome,
    /// Cosine similarity for semantic hits.
    pub similarity: Option<f32>,
}

/// What the cache knows about one request.
pub struct Lookup {
    /// What a write-back of this request's answer would store (keys, partition, embedding).
    pub plan: WritePlan,
    /// A servable entry, when one was found.
    pub hit: Option<Hit>,
    /// The entry that answered the previous turn of this conversation, when reprise served it.
    pub prev_entry: Option<EntryId>,
    /// The semantic policy applied, when the request could be matched semantically.
    pub policy: Option<reprise_policies::semantic::SemanticPolicy>,
    /// The exact key leads to an entry, only one too old for this request: a paraphrase's
    /// answer served instead must not take the key from it.
    pub exact_taken: bool,
}

/// What a request accepts from the cache besides the configured policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Accept {
    /// Similarity threshold requested by the client (only ever raises the configured one).
    pub threshold: Option<f32>,
    /// Oldest answer the client takes, in seconds (`Cache-Control: max-age`).
    pub max_age_secs: Option<u64>,
}

impl Accept {
    /// Whether `entry` is young enough.
    fn fresh(&self, entry: &Entry) -> bool {
        self.max_age_secs
            .is_none_or(|max| now_ms().saturating_sub(entry.created_ms) <= max.saturating_mul(1000))
    }

    /// Splits what a tier returned into a servable entry and whether an older one was there.
    fn sort<E: std::borrow::Borrow<Entry>>(&self, found: Option<E>) -> (Option<E>, bool) {
        match found {
            Some(e) if self.fresh(e.borrow()) => (Some(e), false),
            Some(_) => (None, true),
            None => (None, false),
        }
    }
}

/// Steps 4 and 5: exact lookup, then semantic lookup. Always fills the write plan (only the
/// parts `write` needs) and reads only when `read`.
#[allow(clippy::too_many_arguments)]
pub async fn lookup(
    state: &Arc<AppState>,
    namespace: &str,
    endpoint: Endpoint,
    req: &GenRequest,
    read: bool,
    write: bool,
    accept: Accept,
    trace: &mut Trace,
) -> Lookup {
    let exact = key::exact_key(namespace, endpoint, req);
    let plan = WritePlan {
        exact,
        namespace: namespace.to_string(),
        model: req.model.clone(),
        prompt: String::new(),
        partition: None,
        embedding: None,
        turn: None,
        origin: Origin::Live,
        observe: None,
        tags: Vec::new(),
    };
    let mut found = Lookup {
        plan,
        hit: None,
        prev_entry: None,
        policy: None,
        exact_taken: false,
    };
    // Background lookups (detached traces) are not client traffic: keep them out of the
    // lookup metrics analysts read.
    let counted = trace.state.is_some();
    // Exact first: a hit needs no conversation analysis (the hot path), unless the prefetcher
    // wants to know which earlier answer this turn followed.
    let exact_hit = if read {
        // Too old for this client is a miss; a generated answer then takes the key over.
        let by_key = find_by_key(state, &exact, counted, accept).await;
        found.exact_taken = matches!(by_key, ByKey::Stale);
        by_key.fresh()
    } else {
        None
    };
    if exact_hit.is_some() && state.prefetch.is_none() {
        found.hit = exact_hit.map(|entry| Hit {
            outcome: hit_outcome(&entry, Outcome::Exact),
            entry,
            similarity: None,
        });
        return found;
    }
    // The conversation: what is matched by meaning, and the context it must match in.
    let (query, context) = match &req.input {
        Input::Prompt(p) => (Some(p.clone()), key::messages_digest("preamble", &[])),
        Input::Chat(msgs) => match key::split_conversation(msgs) {
            Some(conv) => {
                let ctx = resolve_context(state, namespace, &req.model, &conv).await;
                found.plan.turn = Some((ctx.turn, ctx.query));
                found.prev_entry = ctx.prev_entry;
                (Some(conv.last.content.clone()), ctx.partition)
            }
            None => (None, [0; 32]),
        },
    };
    if let Some(entry) = exact_hit {
        found.hit = Some(Hit {
            outcome: hit_outcome(&entry, Outcome::Exact),
            entry,
            similarity: None,
        });
        return found;
    }
    let (Some(query), Some(sem)) = (query, &state.semantic) else {
        return found;
    };
    let cfg = &state.config.semantic;
    let policy = reprise_policies::semantic::resolve(
        reprise_policies::semantic::SemanticPolicy {
            enabled: cfg.enabled,
            threshold: cfg.threshold,
            top_k: cfg.top_k,
            gate: cfg.gate,
        },
        &cfg.rules,
        namespace,
        &req.model,
        accept.threshold,
    );
    if !policy.enabled || (!read && !write) {
        return found;
    }
    found.policy = Some(policy);
    let partition = key::partition_key(namespace, endpoint, req, &context);
    found.plan.partition = Some(partition);
    found.plan.prompt = query.clone();
    let t = Instant::now();
    let embedding = match sem.embedder.embed(&query).await {
        Ok(e) => e,
        Err(e) => {
            // The semantic tier is an optimisation: a failing embedder degrades to exact-only.
            tracing::warn!(error = %e, "embedding failed; semantic tier skipped");
            return found;
        }
    };
    trace.record.embed_ms = Some(ms(t));
    found.plan.embedding = Some(embedding.clone());
    if !read {
        return found;
    }
    let t = Instant::now();
    let threshold = policy.threshold;
    let candidates = sem.index.search(&partition, &embedding, policy.top_k);
    for c in candidates {
        if trace.record.similarity.is_none() {
            trace.record.similarity = Some(c.similarity);
        }
        if c.similarity < threshold {
            break;
        }
        let entry = match state.memory.get(c.id).await {
            Some(e) => e,
            None => match &state.redis {
                Some(redis) => match redis.get(c.id).await {
                    Ok(Some(e)) => crate::replication::install(state, e).await,
                    _ => {
                        sem.index.remove(c.id);
                        continue;
                    }
                },
                None => {
                    sem.index.remove(c.id);
                    continue;
                }
            },
        };
        if !accept.fresh(&entry) {
            continue;
        }
        if policy.gate {
            let verdict = reprise_policies::gate(&query, &entry.prompt);
            if !verdict.is_pass() {
                if trace.record.gate.is_none() {
                    trace.record.gate = verdict.reason();
                }
                continue;
            }
            if substituted_meaning(sem, cfg.substitution_threshold, &query, &entry.prompt).await {
                if trace.record.gate.is_none() {
                    trace.record.gate = Some("substitution");
                }
                continue;
            }
        }
        trace.record.gate = Some("pass");
        trace.record.similarity = Some(c.similarity);
        found.hit = Some(Hit {
            outcome: hit_outcome(&entry, Outcome::Semantic),
            entry,
            similarity: Some(c.similarity),
        });
        break;
    }
    trace.record.search_ms = Some(ms(t));
    if counted {
        state.metrics.lookup(Tier::Semantic, found.hit.is_some());
    }
    found
}

/// Whether the two prompts differ by substituted words whose meanings are far apart
/// ("home" vs "car" insurance), judged by the embedder; `threshold` 0 turns the check off.
async fn substituted_meaning(
    sem: &crate::state::Semantic,
    threshold: f32,
    query: &str,
    candidate: &str,
) -> bool {
    if threshold <= 0.0 {
        return false;
    }
    let Some((a, b)) = reprise_policies::gate::substitution(query, candidate) else {
        return false;
    };
    match sem.embedder.embed_many(&[a, b]).await {
        Ok(v) => reprise_embedder::cosine(&v[0], &v[1]) < threshold,
        // Cannot tell: the candidate already passed the threshold and the gate.
        Err(_) => false,
    }
}

/// A prefetched entry says so on its first use; after that it is a normal entry.
fn hit_outcome(entry: &Entry, tier: Outcome) -> Outcome {
    match entry.origin {
        Origin::Prefetch => Outcome::Prefetch,
        _ => tier,
    }
}

/// What a background generation came to.
#[derive(Debug)]
pub enum Background {
    /// The cache can already answer the request in its context with this entry (exactly or
    /// semantically); nothing was generated.
    Cached(Arc<Entry>),
    /// Generated and stored.
    Generated {
        /// The new entry.
        id: EntryId,
        /// Its token usage.
        usage: Usage,
    },
    /// The backend failed, was preempted, or the answer was incomplete; nothing stored.
    Failed(BackendError),
}

/// Generates `req` at background priority and stores the answer as an entry of `origin`,
/// unless the cache can already answer it (`check_cache`). Used by prefetch (the follow-up as
/// it will arrive) and refresh-ahead (`check_cache = false`: the entry exists but is expiring).
/// Background flights are never joined by interactive requests: a preempted background
/// generation must not fail a user's request.
pub async fn generate_in_background(
    state: &Arc<AppState>,
    namespace: &str,
    endpoint: Endpoint,
    mut req: GenRequest,
    origin: Origin,
    check_cache: bool,
) -> Background {
    req.priority = Priority::Background;
    let mut trace = Trace::detached();
    let found = lookup(
        state,
        namespace,
        endpoint,
        &req,
        check_cache,
        true,
        Accept::default(),
        &mut trace,
    )
    .await;
    if let Some(hit) = found.hit {
        return Background::Cached(hit.entry);
    }
    let mut plan = found.plan;
    plan.origin = origin;
    let exact = plan.exact;
    let (flight, mut sub) = state.flights.solo();
    spawn_generation(state.clone(), flight, None, req, Some(plan));
    let mut usage = None;
    while let Some(ev) = sub.next().await {
        match ev {
            Ok(GenEvent::Finish { usage: u, .. }) => usage = Some(u),
            Ok(GenEvent::Delta(_)) => {}
            Err(e) => return Background::Failed(e),
        }
    }
    match (usage, state.memory.get_by_key(&exact).await) {
        (Some(usage), Some(entry)) => Background::Generated {
            id: entry.id,
            usage,
        },
        _ => Background::Failed(BackendError::Internal("no entry after generation".into())),
    }
}

/// Starts the task that runs one generation into `flight` and writes the entry back.
pub fn spawn_generation(
    state: Arc<AppState>,
    flight: Arc<Flight>,
    key: Option<Digest>,
    req: GenRequest,
    plan: Option<WritePlan>,
) {
    let twin = plan
        .as_ref()
        .and_then(|p| p.partition.map(|partition| (partition, p.exact)));
    tokio::spawn(async move {
        let start = Instant::now();
        state.metrics.backend_calls.increment(1);
        let result = tokio::select! {
            r = run_generation(&state, &flight, req) => r,
            _ = flight.cancelled().cancelled() => Err(BackendError::Internal("abandoned by every client".into())),
        };
        state
            .metrics
            .backend_duration
            .record(start.elapsed().as_secs_f64());
        match result {
            Ok((text, reason, usage)) => {
                // Stored before the waiters learn of the end, so a request that arrives right
                // after a client got its answer finds it (a moka insert is microseconds).
                if let Some(plan) = plan {
                    write_back(&state, plan, text, reason, usage).await;
                }
                flight.end(End::Finished);
            }
            Err(e) => {
                state.metrics.incomplete_generations.increment(1);
                flight.end(End::Failed(e));
            }
        }
        if let Some(key) = key {
            state.flights.remove(&key, &flight);
        }
        if let Some((partition, exact)) = twin {
            state.twins.remove(&partition, &exact);
        }
    });
}

/// Runs the backend stream into the flight; returns the assembled answer only if a finish
/// reason was seen.
async fn run_generation(
    state: &AppState,
    flight: &Flight,
    req: GenRequest,
) -> Result<(String, FinishReason, Usage), BackendError> {
    // A stall between tokens cuts a generation off (background ones too: a stalled upstream
    // would hold a prefetch permit forever). The first token may wait in the backend's
    // queue; clients bound that with the first-token timeout.
    let gap = state.config.server.token_timeout();
    let mut stream = state.backend.generate(req).await?;
    let mut text = String::new();
    let mut started = false;
    loop {
        let next = if started {
            tokio::time::timeout(gap, stream.next())
                .await
                .map_err(|_| BackendError::Timeout)?
        } else {
            stream.next().await
        };
        started = true;
        let Some(ev) = next else { break };
        match ev? {
            GenEvent::Delta(d) => {
                text.push_str(&d);
                flight.push(GenEvent::Delta(d));
            }
            GenEvent::Finish { reason, usage } => {
                flight.push(GenEvent::Finish { reason, usage });
                return Ok((text, reason, usage));
            }
        }
    }
    Err(BackendError::Unavailable(
        "the backend stream ended without a finish reason".into(),
    ))
}

/// Stores a finished answer in every tier and links it for the next turn.
pub async fn write_back(
    state: &AppState,
    plan: WritePlan,
    text: String,
    reason: FinishReason,
    usage: Usage,
) -> EntryId {
    let now = now_ms();
    let ttl = state.config.cache.ttl_secs * 1000;
    let turn = plan.turn_key(&text);
    let entry = Arc::new(Entry {
        id: EntryId::random(),
        namespace: plan.namespace,
        model: plan.model,
        text,
        finish_reason: reason.as_str().to_string(),
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        prompt: plan.prompt,
        partition: plan.partition.unwrap_or([0; 32]),
        embedding: plan.embedding.clone(),
        origin: plan.origin,
        tags: plan.tags,
        created_ms: now,
        expires_ms: now + ttl,
    });
    let id = entry.id;
    if let Some(redis) = &state.redis {
        // Queued: Redis being slow or down never delays or fails the answer.
        let mut keys = vec![plan.exact];
        keys.extend(turn);
        redis.put_with_tags(&entry, &keys, &entry.tags);
    }
    if let (Some(p), Some(o)) = (&state.prefetch, plan.observe) {
        p.observe(Observation {
            namespace: entry.namespace.clone(),
            endpoint: o.endpoint,
            request: o.request,
            session: o.session,
            prev_entry: o.prev_entry,
            entry: entry.clone(),
        });
    }
    state.memory.insert(plan.exact, entry).await;
    if let Some(turn) = turn {
        state.memory.alias(turn, id).await;
    }
    if let (Some(sem), Some(partition), Some(embedding)) =
        (&state.semantic, plan.partition, plan.embedding)
    {
        sem.index.insert(partition, id, embedding);
    }
    state.metrics.cache_writes.increment(1);
    id
}

/// Answers from a cached entry, as JSON or SSE.
fn respond_hit(
    parsed: &Parsed,
    renderer: Renderer,
    entry: Arc<Entry>,
    outcome: Outcome,
    similarity: Option<f32>,
    trace: &mut Trace,
) -> Response {
    trace.outcome = outcome;
    trace.record.entry_id = Some(entry.id.to_string());
    trace.first_token();
    let reason = match entry.finish_reason.as_str() {
        "length" => FinishReason::Length,
        "content_filter" => FinishReason::ContentFilter,
        _ => FinishReason::Stop,
    };
    let usage = Usage {
        prompt_tokens: entry.prompt_tokens,
        completion_tokens: entry.completion_tokens,
    };
    let mut resp = if parsed.stream {
        let mut sse = SseState::new(renderer, parsed.include_usage);
        let mut events = sse.push(Ok(GenEvent::Delta(entry.text.clone())));
        events.extend(sse.push(Ok(GenEvent::Finish { reason, usage })));
        events.push(Event::default().data("[DONE]"));
        // The trace moves into the stream so the request is counted when the body is done.
        let trace = std::mem::replace(trace, Trace::detached());
        let stream = async_stream::stream! {
            let _trace = trace;
            for ev in events {
                yield Ok::<_, std::convert::Infallible>(ev);
            }
        };
        Sse::new(stream).into_response()
    } else {
        axum::Json(renderer.full(&entry.text, reason, usage)).into_response()
    };
    set_cache_headers(&mut resp, outcome, Some(&entry));
    if let Some(sim) = similarity {
        set_similarity(&mut resp, sim);
    }
    resp
}

/// Answers from a generation (led or joined).
async fn respond_generation(
    state: &Arc<AppState>,
    parsed: &Parsed,
    renderer: Renderer,
    mut sub: Subscriber,
    outcome: Outcome,
    trace: &mut Trace,
) -> Result<Response, ApiError> {
    let server = &state.config.server;
    // Wait for the first event before answering, so a backend that fails at once becomes a
    // real status code.
    let first = tokio::time::timeout(server.first_token_timeout(), sub.next())
        .await
        .map_err(|_| ApiError::Timeout)?;
    let first = match first {
        Some(Ok(ev)) => ev,
        Some(Err(e)) => return Err(e.into()),
        None => return Err(ApiError::Internal("generation ended without events".into())),
    };
    trace.first_token();
    let mut resp = if parsed.stream {
        let mut sse = SseState::new(renderer, parsed.include_usage);
        let mut trace = std::mem::replace(trace, Trace::detached());
        let initial = sse.push(Ok(first));
        let stream = async_stream::stream! {
            for ev in initial {
                yield Ok::<_, std::convert::Infallible>(ev);
            }
            while !sse.done {
                let next = sub.next().await;
                for ev in sse.push_next(next, &mut trace) {
                    yield Ok(ev);
                }
            }
        };
        Sse::new(stream).into_response()
    } else {
        let deadline = tokio::time::Instant::now() + server.request_timeout();
        let mut text = String::new();
        let mut ev: Option<Result<GenEvent, BackendError>> = Some(Ok(first));
        let (reason, usage) = loop {
            match ev {
                Some(Ok(GenEvent::Delta(d))) => text.push_str(&d),
                Some(Ok(GenEvent::Finish { reason, usage })) => break (reason, usage),
                Some(Err(e)) => return Err(e.into()),
                None => {
                    return Err(ApiError::Backend(BackendError::Unavailable(
                        "generation ended without a finish reason".into(),
                    )))
                }
            }
            ev = tokio::time::timeout_at(deadline, sub.next())
                .await
                .map_err(|_| ApiError::Timeout)?;
        };
        axum::Json(renderer.full(&text, reason, usage)).into_response()
    };
    set_cache_headers(&mut resp, outcome, None);
    Ok(resp)
}

/// Turns generation events into SSE events (kept out of the `stream!` macro so rustfmt and
/// the compiler's diagnostics reach it).
struct SseState {
    renderer: Renderer,
    include_usage: bool,
    sent_role: bool,
    done: bool,
}

impl SseState {
    fn new(renderer: Renderer, include_usage: bool) -> Self {
        SseState {
            renderer,
            include_usage,
            sent_role: false,
            done: false,
        }
    }

    fn json(v: serde_json::Value) -> Event {
        Event::default().data(v.to_string())
    }

    /// The SSE events for one generation event.
    fn push(&mut self, ev: Result<GenEvent, BackendError>) -> Vec<Event> {
        let mut out = Vec::new();
        if !self.sent_role {
            self.sent_role = true;
            if let Some(role) = self.renderer.role_chunk() {
                out.push(Self::json(role));
            }
        }
        match ev {
            Ok(GenEvent::Delta(d)) => out.push(Self::json(self.renderer.delta_chunk(&d))),
            Ok(GenEvent::Finish { reason, usage }) => {
                out.push(Self::json(self.renderer.finish_chunk(reason)));
                if self.include_usage {
                    out.push(Self::json(self.renderer.usage_chunk(usage)));
                }
                self.done = true;
            }
            Err(e) => {
                // After the 200 the error travels in-band, then the stream ends (no [DONE]).
                out.push(Self::json(ApiError::Backend(e).body()));
                self.done = true;
            }
        }
        out
    }

    /// Handles the next subscriber item, including the end of the stream.
    fn push_next(
        &mut self,
        next: Option<Result<GenEvent, BackendError>>,
        trace: &mut Trace,
    ) -> Vec<Event> {
        match next {
            Some(Ok(ev)) => {
                let finished = matches!(ev, GenEvent::Finish { .. });
                let mut out = self.push(Ok(ev));
                if finished {
                    out.push(Event::default().data("[DONE]"));
                }
                out
            }
            Some(Err(e)) => {
                trace.error = Some(e.kind());
                self.push(Err(e))
            }
            None => {
                self.done = true;
                Vec::new()
            }
        }
    }
}

/// Sets `x-reprise-similarity`.
fn set_similarity(resp: &mut Response, sim: f32) {
    if let Ok(v) = HeaderValue::from_str(&format!("{sim:.4}")) {
        resp.headers_mut().insert(SIMILARITY_HEADER, v);
    }
}

/// Sets `x-reprise-cache`, `Cache-Status` (RFC 9211) and, on hits, `Age`.
fn set_cache_headers(resp: &mut Response, outcome: Outcome, entry: Option<&Entry>) {
    let h = resp.headers_mut();
    h.insert(CACHE_HEADER, HeaderValue::from_static(outcome.as_str()));
    let status = match outcome {
        Outcome::Exact => "reprise; hit",
        Outcome::Semantic => "reprise; hit; detail=semantic",
        Outcome::Prefetch => "reprise; hit; detail=prefetch",
        Outcome::Miss => "reprise; fwd=miss; stored",
        Outcome::Bypass => "reprise; fwd=bypass",
        Outcome::Error => "reprise; fwd=miss; detail=error",
    };
    h.insert("cache-status", HeaderValue::from_static(status));
    if let Some(e) = entry {
        h.insert(axum::http::header::AGE, HeaderValue::from(e.age_secs()));
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// Per-request bookkeeping: metrics and the request log, written when the request is done
/// (for streams, when the stream ends or the client goes away).
pub struct Trace {
    state: Option<Arc<AppState>>,
    start: Instant,
    outcome: Outcome,
    error: Option<&'static str>,
    first_token: Option<f64>,
    record: LogRecord,
}

impl Trace {
    fn new(state: &Arc<AppState>, endpoint: Endpoint) -> Self {
        Trace {
            state: Some(state.clone()),
            start: Instant::now(),
            outcome: Outcome::Error,
            error: None,
            first_token: None,
            record: LogRecord {
                time_ms: now_ms(),
                endpoint: match endpoint {
                    Endpoint::Chat => "/v1/chat/completions",
                    Endpoint::Completion => "/v1/completions",
                },
                ..Default::default()
            },
        }
    }

    /// A trace that records nothing (left behind when the real one moves into a stream).
    fn detached() -> Self {
        Trace {
            state: None,
            start: Instant::now(),
            outcome: Outcome::Error,
            error: None,
            first_token: None,
            record: LogRecord::default(),
        }
    }

    fn first_token(&mut self) {
        if self.first_token.is_none() {
            let t = self.start.elapsed().as_secs_f64();
            self.first_token = Some(t);
            if matches!(self.outcome, Outcome::Miss | Outcome::Bypass) {
                self.record.backend_ms = Some(t * 1000.0);
            }
        }
    }

    fn fail(&mut self, e: &ApiError) {
        self.failed(e.kind());
    }

    fn failed(&mut self, kind: &'static str) {
        self.error = Some(kind);
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        let Some(state) = self.state.take() else {
            return;
        };
        let outcome = if self.error.is_some() {
            Outcome::Error
        } else {
            self.outcome
        };
        let total = self.start.elapsed().as_secs_f64();
        state.metrics.request(outcome, total);
        if let Some(t) = self.first_token {
            state.metrics.first_token(outcome, t);
        }
        if let Some(log) = &state.request_log {
            let mut rec = std::mem::take(&mut self.record);
            rec.outcome = outcome.as_str();
            rec.error = self.error;
            rec.total_ms = total * 1000.0;
            log.write(rec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn classify(endpoint: Endpoint, body: Value) -> Result<Option<(String, &'static str)>, String> {
        match parse(endpoint, body.to_string().as_bytes()) {
            Ok(Request::Cacheable(_)) => Ok(None),
            Ok(Request::Forward(f)) => Ok(Some((f.param, f.field))),
            Err(e) => Err(e.to_string()),
        }
    }

    fn chat_with(field: &str, value: Value) -> Value {
        let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        b[field] = value;
        b
    }

    #[test]
    fn only_fields_that_ask_for_more_than_text_forward() {
        let forward = |param: &str, field: &'static str| Ok(Some((param.to_string(), field)));
        let chat = |f: &str, v: Value| classify(Endpoint::Chat, chat_with(f, v));
        assert_eq!(
            chat("tools", json!([{"type": "function"}])),
            forward("tools", "tools")
        );
        assert_eq!(chat("tools", json!([])), Ok(None));
        assert_eq!(
            chat("tool_choice", json!("none")),
            forward("tool_choice", "tool_choice")
        );
        assert_eq!(chat("logprobs", json!(false)), Ok(None));
        assert_eq!(
            chat("logprobs", json!(true)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(chat("modalities", json!(["text"])), Ok(None));
        assert_eq!(
            chat("modalities", json!(["text", "audio"])),
            forward("modalities", "modalities")
        );
        assert_eq!(chat("n", json!(1)), Ok(None));
        assert_eq!(chat("n", json!(2)), forward("n", "n"));
        assert!(chat("n", json!(0)).is_err());
        assert_eq!(
            chat("response_format", json!({"type": "json_object"})),
            Ok(None)
        );

        let msgs = |m: Value| classify(Endpoint::Chat, json!({"model": "m", "messages": m}));
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": "a"}, {"role": "function", "name": "f", "content": "1"}])
            ),
            forward("messages[1].role", "messages.role")
        );
        assert_eq!(
            msgs(json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}])),
            forward("messages[0].tool_calls", "messages.tool_calls")
        );
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
            ),
            forward("messages[0].content", "messages.content")
        );
        assert_eq!(
            msgs(
                json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
            ),
            Ok(None)
        );
        assert!(msgs(json!([{"role": "user", "content": [{"type": "text"}]}])).is_err());

        let completion = |f: &str, v: Value| {
            let mut b = json!({"model": "m", "prompt": "1, 2,"});
            b[f] = v;
            classify(Endpoint::Completion, b)
        };
        assert_eq!(completion("best_of", json!(1)), Ok(None));
        assert_eq!(
            completion("best_of", json!(3)),
            forward("best_of", "best_of")
        );
        assert_eq!(completion("echo", json!(true)), forward("echo", "echo"));
        assert_eq!(
            completion("logprobs", json!(0)),
            forward("logprobs", "logprobs")
        );
        assert_eq!(completion("prompt", json!(["a"])), Ok(None));
        assert_eq!(
            completion("prompt", json!(["a", "b"])),
            forward("prompt", "prompt")
        );
        assert!(completion("prompt", json!([])).is_err());
        assert_eq!(
            completion("prompt", json!([1, 2, 3])),
            forward("prompt", "prompt")
        );
        assert_eq!(
            completion("prompt", json!([[1, 2], [3]])),
            forward("prompt", "prompt")
        );
        assert!(completion("prompt", json!({"text": "a"})).is_err());
    }

    #[test]
    fn forwarded_paths_stay_below_the_base_url() {
        for ok in [
            "embeddings",
            "files/file-abc/content",
            "models/gpt-4o",
            "a.b/c..d",
        ] {
            assert!(plain_api_path(ok), "{ok}");
        }
        for bad in [
            "../admin",
            "files/../../admin",
            ".",
            "files/./x",
            "%2e%2e/admin",
            "%2E./admin",
            ".%2e/admin",
            "files%2f..%2fadmin",
            "files\\..\\admin",
            "embeddings/",
            "files//x",
            "",
        ] {
            assert!(!plain_api_path(bad), "{bad}");
        }
    }

    #[test]
    fn a_participant_name_is_kept() {
        let body =
            json!({"model": "m", "messages": [{"role": "user", "name": "alice", "content": "hi"}]});
        let Ok(Request::Cacheable(p)) = parse(Endpoint::Chat, body.to_string().as_bytes()) else {
            panic!("a named message is cacheable");
        };
        let Input::Chat(msgs) = &p.req.input else {
            panic!("chat input");
        };
        assert_eq!(msgs[0].name.as_deref(), Some("alice"));
    }
}
