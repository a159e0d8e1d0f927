//! A backend that forwards misses to any OpenAI-compatible server.
//!
//! Every request goes upstream as a streaming request (`stream: true` with
//! `stream_options.include_usage`), whatever the client asked: the server needs the tokens
//! as they come to fan them out to streaming clients and to measure time to first token, and
//! it assembles whole answers itself. Connections are pooled and kept alive by reqwest.
//!
//! Requests the cache cannot represent (tools, several choices, images…) and the API's other
//! endpoints (embeddings, files, …) go through [`Backend::forward`] instead: the client's
//! body is sent unchanged and the answer streamed back unchanged.
//!
//! With `max_concurrent` (0: unlimited) at most that many generations and forwarded
//! completions are upstream at once; the others wait for a slot by priority (interactive,
//! then batch aged into interactive after `priority_aging`, then background), at most
//! `max_queue` of them, beyond which the request is refused with `Overloaded` (429). A
//! background generation holding a slot that a user request needs is preempted: its stream
//! ends with `Overloaded` (never cached) and the upstream request is closed as the stream
//! stops. The line is the crate's priority semaphore (`slots`), shared with the scripted
//! backend.

use std::time::Duration;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

use crate::slots::{Permit, Slots};
use crate::{
    Backend, BackendError, BoundField, FinishReason, ForwardRequest, Forwarded, GenEvent,
    GenRequest, GenStream, Input, Load, Priority, Usage,
};

/// Most bytes of one generation's upstream stream (its SSE framing included): an upstream
/// that ignores `max_tokens`, or sends a line without end, is cut off there (an error, never
/// cached). A 16k-token answer streams about 4 MB.
pub const MAX_STREAM_BYTES: usize = 32 * 1024 * 1024;
/// Most bytes of an upstream's failure body read for its message.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// Settings of an [`OpenAiBackend`].
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Base URL including the version prefix, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Bearer token sent upstream, if any.
    pub api_key: Option<String>,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Idle keep-alive connections kept per host.
    pub pool_max_idle: usize,
    /// Models accepted; empty means any (the upstream decides).
    pub models: Vec<String>,
    /// Generations and forwarded completions upstream at once; 0 is unlimited.
    pub max_concurrent: usize,
    /// With `max_concurrent`: requests that may wait for a slot; beyond, `Overloaded`.
    pub max_queue: usize,
    /// With `max_concurrent`: a batch request waiting this long is served as interactive;
    /// `None`: never.
    pub priority_aging: Option<Duration>,
    /// The field a chat completion's bound is sent as, unless the client named
    /// `max_completion_tokens` (then always that).
    pub bound_field: BoundField,
}

// Hand-written so the API key never reaches logs.
impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_max_idle", &self.pool_max_idle)
            .field("models", &self.models)
            .field("max_concurrent", &self.max_concurrent)
            .field("max_queue", &self.max_queue)
            .field("priority_aging", &self.priority_aging)
            .finish()
    }
}

/// The upstream backend.
pub struct OpenAiBackend {
    cfg: OpenAiConfig,
    client: reqwest::Client,
    /// User requests (interactive and batch) upstream or waiting.
    interactive: Arc<AtomicUsize>,
    /// Generations and forwarded completions upstream or waiting (for `load` when unlimited).
    in_flight: Arc<AtomicUsize>,
    /// The concurrency limit, when `max_concurrent` sets one.
    slots: Option<Slots>,
}

impl OpenAiBackend {
    /// Builds the pooled client.
    pub fn new(cfg: OpenAiConfig) -> Result<Self, BackendError> {
        let client = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            .pool_max_idle_per_host(cfg.pool_max_idle)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            // Following a redirect would re-send the body and the key to wherever the upstream
            // points; a 3xx is an upstream failure (502) instead.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| BackendError::Internal(format!("http client: {e}")))?;
        let slots = (cfg.max_concurrent > 0)
            .then(|| Slots::new(cfg.max_concurrent, Some(cfg.max_queue), cfg.priority_aging));
        Ok(OpenAiBackend {
            cfg,
            client,
            interactive: Default::default(),
            in_flight: Default::default(),
            slots,
        })
    }

    fn check_model(&self, model: &str) -> Result<(), BackendError> {
        if self.cfg.models.is_empty() || self.cfg.models.iter().any(|m| m == model) {
            Ok(())
        } else {
            Err(BackendError::UnknownModel(model.to_string()))
        }
    }

    /// Counts one request in flight (and one user request, unless `priority` is background)
    /// until the guard is dropped.
    fn load_guard(&self, priority: Priority) -> LoadGuard {
        let user = priority.is_user().then(|| {
            self.interactive.fetch_add(1, Ordering::SeqCst);
            self.interactive.clone()
        });
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        LoadGuard {
            all: self.in_flight.clone(),
            user,
        }
    }

    /// Waits for a slot at `priority` when the concurrency is limited.
    async fn slot(&self, priority: Priority) -> Result<Option<Permit>, BackendError> {
        match &self.slots {
            Some(slots) => Ok(Some(slots.enter(priority)?.wait().await?)),
            None => Ok(None),
        }
    }

    /// Sends a request upstream with the configured key; an unreachable upstream is an error.
    async fn request(
        &self,
        mut http: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, BackendError> {
        if let Some(key) = &self.cfg.api_key {
            http = http.bearer_auth(key);
        }
        http.send().await.map_err(|e| {
            if e.is_timeout() {
                BackendError::Timeout
            } else {
                BackendError::Unavailable(format!("upstream unreachable: {e}"))
            }
        })
    }

    /// Sends a request upstream; an unreachable upstream or a failure status is an error.
    async fn send(&self, http: reqwest::RequestBuilder) -> Result<reqwest::Response, BackendError> {
        let resp = self.request(http).await?;
        let status = resp.status();
        if !status.is_success() {
            let retry = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            let text = read_capped(resp, MAX_ERROR_BODY_BYTES).await;
            return Err(status_error(status, retry, &text));
        }
        Ok(resp)
    }

    fn url(&self, input: &Input) -> String {
        let base = self.cfg.base_url.trim_end_matches('/');
        match input {
            Input::Chat(_) => format!("{base}/chat/completions"),
            Input::Prompt(_) => format!("{base}/completions"),
        }
    }
}

/// Response headers of a forwarded request that reach the client (besides `x-ratelimit-*`).
const PASSED_BACK_HEADERS: &[&str] = &[
    "content-type",
    "content-disposition",
    "retry-after",
    "x-request-id",
    "openai-processing-ms",
];

/// The upstream request body; a chat completion's bound goes as `field` unless the client
/// named `max_completion_tokens`.
fn body(req: &GenRequest, field: BoundField) -> Value {
    let mut b = Map::new();
    // Extra fields first so that the interpreted ones below always win.
    for (k, v) in &req.extra {
        b.insert(k.clone(), v.clone());
    }
    b.insert("model".into(), json!(req.model));
    match &req.input {
        Input::Chat(msgs) => {
            // Role, content, the name and the other fields the client gave, as given; a
            // content given as parts with fields of their own goes as those parts.
            let msgs: Vec<Value> = msgs
                .iter()
                .map(|m| {
                    let mut v = serde_json::to_value(m).unwrap_or(Value::Null);
                    if let Some(o) = v.as_object_mut() {
                        if let Some(parts) = o.remove(crate::GIVEN_PARTS) {
                            o.insert("content".into(), parts);
                        }
                    }
                    v
                })
                .collect();
            b.insert("messages".into(), Value::Array(msgs));
        }
        Input::Prompt(p) => {
            b.insert("prompt".into(), json!(p));
        }
    }
    b.insert("stream".into(), json!(true));
    b.insert("stream_options".into(), json!({"include_usage": true}));
    let p = &req.params;
    let opt = |b: &mut Map<String, Value>, k: &str, v: Option<Value>| {
        if let Some(v) = v {
            b.insert(k.into(), v);
        }
    };
    let cap = match p.max_completion_tokens_named {
        true => BoundField::MaxCompletionTokens,
        false => field,
    }
    .on(matches!(req.input, Input::Chat(_)))
    .as_str();
    opt(&mut b, cap, p.max_tokens.map(|v| json!(v)));
    opt(&mut b, "temperature", p.temperature.map(|v| json!(v)));
    opt(&mut b, "top_p", p.top_p.map(|v| json!(v)));
    opt(&mut b, "seed", p.seed.map(|v| json!(v)));
    opt(
        &mut b,
        "presence_penalty",
        p.presence_penalty.map(|v| json!(v)),
    );
    opt(
        &mut b,
        "frequency_penalty",
        p.frequency_penalty.map(|v| json!(v)),
    );
    if !p.stop.is_empty() {
        b.insert("stop".into(), json!(p.stop));
    }
    Value::Object(b)
}

/// Maps a non-success upstream status to an error; the upstream's own message is passed on
/// only for client errors (it describes the client's request, not our internals).
fn status_error(status: reqwest::StatusCode, retry_after: Option<u64>, body: &str) -> BackendError {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/message"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| format!("upstream rejected the request ({status})"));
    let param = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/param"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let code = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/code"))
        .and_then(Value::as_str);
    match status.as_u16() {
        404 | 400 if code == Some("model_not_found") => BackendError::UnknownModel(message),
        // A 404 with an error body is the upstream's word on the model (vLLM's and Ollama's
        // carry no `model_not_found` code); one without is a path it does not serve (a wrong
        // `base_url`): the upstream's fault, not the client's.
        404 if parsed.is_some() => BackendError::UnknownModel(message),
        404 => BackendError::Unavailable(format!("upstream answered {status}: {message}")),
        429 => BackendError::Overloaded {
            retry_after_secs: retry_after.unwrap_or(1),
        },
        401 | 403 => BackendError::Internal(format!("upstream refused credentials ({status})")),
        400..=499 => BackendError::InvalidRequest { message, param },
        _ => BackendError::Unavailable(format!("upstream answered {status}")),
    }
}

/// Bytes per token of the estimate for an upstream that sends no usage.
const BYTES_PER_TOKEN: usize = 4;

/// Decoding state of one upstream stream: turns chunks into events and remembers the finish
/// reason and usage, which arrive in separate chunks when usage is included.
#[derive(Default)]
struct ChunkState {
    finish: Option<FinishReason>,
    usage: Usage,
    /// The upstream sent a usage chunk. One that ignores `stream_options.include_usage`
    /// (older servers, some gateways) sends none: the usage is then estimated, the generated
    /// tokens as the chunks that carried text (a streaming server sends a token or more a
    /// chunk) and the prompt's from its bytes, rather than stored and served as 0 and 0.
    usage_seen: bool,
    /// Chunks that carried text.
    text_chunks: u32,
    /// The prompt's tokens estimated from its bytes.
    prompt_estimate: u32,
    /// The model declined (`delta.refusal`, structured outputs): its refusal is passed on as
    /// the text, and the answer ends as one a filter stopped, never stored as an answer.
    refused: bool,
}

impl ChunkState {
    /// The state of a stream answering `req`.
    fn for_request(req: &GenRequest) -> ChunkState {
        let bytes = match &req.input {
            Input::Prompt(p) => p.len(),
            Input::Chat(msgs) => msgs
                .iter()
                .map(|m| m.role.len() + m.content.len() + m.name.as_ref().map_or(0, String::len))
                .sum(),
        };
        ChunkState {
            prompt_estimate: u32::try_from(bytes.div_ceil(BYTES_PER_TOKEN)).unwrap_or(u32::MAX),
            ..ChunkState::default()
        }
    }

    /// Handles one `data:` payload. Returns the text delta it carried, if any.
    fn push(&mut self, data: &str) -> Result<Option<String>, BackendError> {
        let v: Value = serde_json::from_str(data)
            .map_err(|e| BackendError::Internal(format!("bad upstream chunk: {e}")))?;
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("upstream error");
            return Err(BackendError::Unavailable(msg.to_string()));
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let get = |k: &str| {
                let n = u.get(k).and_then(Value::as_u64).unwrap_or(0);
                u32::try_from(n).unwrap_or(u32::MAX)
            };
            self.usage = Usage {
                prompt_tokens: get("prompt_tokens"),
                completion_tokens: get("completion_tokens"),
            };
            self.usage_seen = true;
        }
        let Some(choice) = v.pointer("/choices/0") else {
            return Ok(None);
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish = Some(match reason {
                "stop" | "eos" | "eos_token" | "stop_sequence" | "end_turn" => FinishReason::Stop,
                "length" | "max_tokens" => FinishReason::Length,
                "content_filter" => FinishReason::ContentFilter,
                // An aborted, cancelled or failed answer (vLLM's `abort`, a gateway's
                // `error`), or one that is not text: never a finished answer to cache.
                other => {
                    return Err(BackendError::Unavailable(format!(
                        "upstream answer ended with `{}`",
                        other.chars().take(64).collect::<String>()
                    )))
                }
            });
        }
        let refusal = choice
            .pointer("/delta/refusal")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        if refusal.is_some() {
            self.refused = true;
        }
        let text = choice
            .pointer("/delta/content")
            .or_else(|| choice.get("text"))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .or(refusal)
            .map(str::to_string);
        if text.is_some() {
            self.text_chunks = self.text_chunks.saturating_add(1);
        }
        Ok(text)
    }

    /// The closing event: `Finish` if a finish reason was seen, else the stream was cut off.
    fn finish(&self) -> Result<GenEvent, BackendError> {
        match self.finish {
            Some(reason) => Ok(GenEvent::Finish {
                reason: match self.refused {
                    true => FinishReason::ContentFilter,
                    false => reason,
                },
                usage: match self.usage_seen {
                    true => self.usage,
                    false => Usage {
                        prompt_tokens: self.prompt_estimate,
                        completion_tokens: self.text_chunks,
                    },
                },
            }),
            None => Err(BackendError::Unavailable(
                "upstream stream ended without a finish reason".into(),
            )),
        }
    }
}

/// Decrements the in-flight counts when the stream is dropped.
struct LoadGuard {
    all: Arc<AtomicUsize>,
    user: Option<Arc<AtomicUsize>>,
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.all.fetch_sub(1, Ordering::SeqCst);
        if let Some(user) = &self.user {
            user.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// `body` up to `limit` bytes in all; past it, an error item ends it.
fn capped<S, B, E>(body: S, limit: usize) -> impl futures::Stream<Item = Result<B, String>>
where
    S: futures::Stream<Item = Result<B, E>>,
    B: AsRef<[u8]>,
    E: std::fmt::Display,
{
    let mut seen = 0usize;
    body.map(move |chunk| {
        let chunk = chunk.map_err(|e| e.to_string())?;
        seen = seen.saturating_add(chunk.as_ref().len());
        if seen > limit {
            return Err(format!("answer over {limit} bytes"));
        }
        Ok(chunk)
    })
    .take_while({
        let mut over = false;
        move |item| {
            let go = !over;
            over |= item.is_err();
            futures::future::ready(go)
        }
    })
}

/// `body` cut into whole lines (an item a line with its end, the last one as it ends), so the
/// event parser reads each byte once: it parses its whole buffer again for every chunk that
/// ends no line, and copies what follows each line it takes, which is quadratic in a long
/// line sent in pieces, or in a chunk of many blank lines (an upstream could keep a worker
/// thread busy for minutes within the stream's byte cap). Here each byte is looked at once;
/// a line is held until its end comes (the cap before this bounds it).
fn lines<S>(body: S) -> impl futures::Stream<Item = Result<bytes::Bytes, String>>
where
    S: futures::Stream<Item = Result<bytes::Bytes, String>>,
{
    async_stream::stream! {
        let mut pending = bytes::BytesMut::new();
        futures::pin_mut!(body);
        while let Some(chunk) = body.next().await {
            let mut rest = match chunk {
                Ok(c) => c,
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            // `\r`, `\n` or both end a line; "\r" then "\n" in two items is one end to the parser.
            while let Some(end) = rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
                let line = rest.split_to(end + 1);
                if pending.is_empty() {
                    yield Ok(line);
                } else {
                    pending.extend_from_slice(&line);
                    yield Ok(pending.split().freeze());
                }
            }
            pending.extend_from_slice(&rest);
        }
        if !pending.is_empty() {
            yield Ok(pending.freeze());
        }
    }
}

/// At most `limit` bytes of a response's body, as text (lossy); what comes after is not read.
async fn read_capped(resp: reqwest::Response, limit: usize) -> String {
    let mut body = resp.bytes_stream();
    let mut bytes = Vec::new();
    while let Some(Ok(chunk)) = body.next().await {
        let room = limit - bytes.len();
        bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if bytes.len() >= limit {
            break;
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The next upstream event, unless `preemption` fires first (then `Overloaded`).
async fn next_event<S>(
    events: &mut S,
    preemption: Option<&CancellationToken>,
) -> Option<Result<eventsource_stream::Event, BackendError>>
where
    S: futures::Stream<Item = Result<eventsource_stream::Event, String>> + Unpin,
{
    let next = async {
        events
            .next()
            .await
            .map(|ev| ev.map_err(|e| BackendError::Unavailable(format!("upstream stream: {e}"))))
    };
    match preemption {
        None => next.await,
        Some(token) => tokio::select! {
            biased;
            () = token.cancelled() => Some(Err(crate::slots::preempted())),
            ev = next => ev,
        },
    }
}

#[async_trait::async_trait]
impl Backend for OpenAiBackend {
    async fn generate(&self, req: GenRequest) -> Result<GenStream, BackendError> {
        self.check_model(&req.model)?;
        let guard = self.load_guard(req.priority);
        // Waiting for a slot counts as load: background work sees the request waiting.
        let permit = self.slot(req.priority).await?;
        // Only background holders are ever preempted.
        let preemption = permit
            .as_ref()
            .filter(|_| req.priority == Priority::Background)
            .map(Permit::preemption);
        let http = self
            .client
            .post(self.url(&req.input))
            .header("accept", "text/event-stream")
            .json(&body(&req, self.cfg.bound_field));
        // Preempted while the request is sent or its headers awaited: the slot goes to the
        // user at once, so the upstream request must stop too (it would run past the limit).
        // An upstream that does not know the model says so; the client hears the model it
        // asked for.
        let model = req.model.clone();
        let sending = async move {
            self.send(http).await.map_err(|e| match e {
                BackendError::UnknownModel(_) => BackendError::UnknownModel(model),
                e => e,
            })
        };
        let resp = match &preemption {
            None => sending.await?,
            Some(token) => tokio::select! {
                biased;
                () = token.cancelled() => return Err(crate::slots::preempted()),
                resp = sending => resp?,
            },
        };
        let mut events = Box::pin(lines(capped(resp.bytes_stream(), MAX_STREAM_BYTES)))
            .eventsource()
            .map(|ev| ev.map_err(|e| e.to_string()));
        let mut state = ChunkState::for_request(&req);
        let stream = async_stream::try_stream! {
            let _held = (guard, permit);
            while let Some(ev) = next_event(&mut events, preemption.as_ref()).await {
                let ev = ev?;
                if ev.data.trim() == "[DONE]" {
                    break;
                }
                if let Some(text) = state.push(&ev.data)? {
                    yield GenEvent::Delta(text);
                }
            }
            yield state.finish()?;
        };
        Ok(Box::pin(stream))
    }

    fn models(&self) -> Vec<String> {
        self.cfg.models.clone()
    }

    fn ready(&self) -> bool {
        true
    }

    fn interactive_load(&self) -> usize {
        self.interactive.load(Ordering::SeqCst)
    }

    /// With `max_concurrent`, the line's load; unlimited, capacity 0 and every request in
    /// flight running.
    fn load(&self) -> Load {
        match &self.slots {
            Some(slots) => slots.load(),
            None => Load {
                running: self.in_flight.load(Ordering::SeqCst),
                ..Load::default()
            },
        }
    }

    fn forwards(&self) -> bool {
        true
    }

    fn bound_field(&self) -> BoundField {
        self.cfg.bound_field
    }

    async fn forward(&self, req: ForwardRequest) -> Result<Forwarded, BackendError> {
        if let Some(model) = &req.model {
            self.check_model(model)?;
        }
        // A request a user waits for takes a slot like a generation (until its body is read);
        // reads (`priority` None) are neither counted nor limited.
        let guard = req.priority.map(|p| self.load_guard(p));
        let permit = match req.priority {
            Some(p) => self.slot(p).await?,
            None => None,
        };
        let url = format!("{}/{}", self.cfg.base_url.trim_end_matches('/'), req.path);
        let mut http = self.client.request(req.method, url).body(req.body);
        for (name, value) in &req.headers {
            http = http.header(name, value);
        }
        let resp = self.request(http).await?;
        let status = resp.status();
        // The upstream's answer is the client's, failures included (with their Retry-After),
        // except a refused key, which is reprise's problem, and a redirect, which is not
        // followed and would send the client elsewhere.
        if matches!(status.as_u16(), 401 | 403) || !(status.is_success() || status.as_u16() >= 400)
        {
            return Err(status_error(status, None, ""));
        }
        let headers = resp
            .headers()
            .iter()
            .filter(|(name, _)| {
                let name = name.as_str();
                PASSED_BACK_HEADERS.contains(&name) || name.starts_with("x-ratelimit-")
            })
            .filter_map(|(name, value)| Some((name.to_string(), value.to_str().ok()?.to_string())))
            .collect();
        let body = resp.bytes_stream().map(move |chunk| {
            // Counted as load, and holding its slot, until the body is done or dropped.
            let _ = (&guard, &permit);
            chunk.map_err(|e| BackendError::Unavailable(format!("upstream stream: {e}")))
        });
        Ok(Forwarded {
            status: status.as_u16(),
            headers,
            body: Box::pin(body),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An upstream that sends no usage chunk: the usage is estimated (one token a chunk of
    /// text, the prompt's from its bytes), not 0 and 0.
    #[test]
    fn usage_is_estimated_when_the_upstream_sends_none() {
        let req = GenRequest {
            model: "m".into(),
            input: Input::Prompt("x".repeat(40)),
            params: Default::default(),
            priority: Priority::Interactive,
            extra: Default::default(),
            backend: None,
        };
        let mut s = ChunkState::for_request(&req);
        for word in ["The", " answer", " is", " here"] {
            let chunk =
                json!({"choices":[{"index":0,"delta":{"content":word},"finish_reason":null}]});
            s.push(&chunk.to_string()).unwrap();
        }
        s.push(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#)
            .unwrap();
        let GenEvent::Finish { usage, .. } = s.finish().unwrap() else {
            panic!("not a finish");
        };
        assert_eq!(
            usage,
            Usage {
                prompt_tokens: 10,
                completion_tokens: 4
            }
        );
    }

    #[test]
    fn chunk_state_reads_chat_and_usage() {
        let mut s = ChunkState::default();
        let d = s
            .push(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},"finish_reason":null}]}"#)
            .unwrap();
        assert_eq!(d.as_deref(), Some("Hi"));
        assert!(s.finish().is_err(), "no finish reason yet: cut off");
        s.push(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#)
            .unwrap();
        s.push(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#,
        )
        .unwrap();
        assert_eq!(
            s.finish().unwrap(),
            GenEvent::Finish {
                reason: FinishReason::Length,
                usage: Usage {
                    prompt_tokens: 5,
                    completion_tokens: 2
                }
            }
        );
    }

    /// Token counts past `u32` from an upstream saturate, and so does their total.
    #[test]
    fn huge_usage_counts_saturate() {
        let mut s = ChunkState::default();
        s.push(r#"{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}"#)
            .unwrap();
        s.push(r#"{"choices":[],"usage":{"prompt_tokens":4294967295,"completion_tokens":99999999999}}"#)
            .unwrap();
        let GenEvent::Finish { usage, .. } = s.finish().unwrap() else {
            panic!("finished");
        };
        assert_eq!(usage.completion_tokens, u32::MAX);
        assert_eq!(usage.total_tokens(), u32::MAX);
    }

    /// An answer that ends in anything but a known finish (an abort, a gateway's error) is
    /// an error, so it is never cached as a finished answer.
    #[test]
    fn only_known_finish_reasons_finish_an_answer() {
        let chunk = |reason: &str| {
            format!(r#"{{"choices":[{{"index":0,"delta":{{}},"finish_reason":"{reason}"}}]}}"#)
        };
        for (reason, finish) in [
            ("stop", FinishReason::Stop),
            ("end_turn", FinishReason::Stop),
            ("length", FinishReason::Length),
            ("content_filter", FinishReason::ContentFilter),
        ] {
            let mut s = ChunkState::default();
            s.push(&chunk(reason)).unwrap();
            assert!(matches!(s.finish(), Ok(GenEvent::Finish { reason, .. }) if reason == finish));
        }
        for reason in ["abort", "error", "cancelled", "tool_calls"] {
            assert!(
                ChunkState::default().push(&chunk(reason)).is_err(),
                "{reason}"
            );
        }
    }

    /// A stream past its byte cap ends with an error, and nothing after it is read.
    #[tokio::test]
    async fn a_stream_past_its_cap_ends_with_an_error() {
        let chunks = (0..100).map(|_| Ok::<_, String>(vec![b'x'; 1000]));
        let items: Vec<_> = capped(futures::stream::iter(chunks), 10_500)
            .collect()
            .await;
        assert_eq!(items.len(), 11, "ten chunks, then the error");
        assert!(items[..10].iter().all(Result::is_ok));
        assert!(items[10].as_ref().unwrap_err().contains("10500 bytes"));
        let within: Vec<_> = capped(futures::stream::iter([Ok::<_, String>(b"ok")]), 10)
            .collect()
            .await;
        assert_eq!(within.len(), 1);
    }

    /// Cut into lines, a stream gives the parser the same events however its chunks fell, and
    /// each item holds one line at most: the parser never rescans what it has read.
    #[tokio::test]
    async fn lines_keep_the_events_and_hand_over_one_line_at_a_time() {
        let text = "data: {\"a\": 1}\n\n: a comment\r\ndata: one\r\ndata: two\r\n\r\n\
                    event: x\rdata: three\r\r\n\n\n\ndata: last";
        let events = |chunks: Vec<Result<bytes::Bytes, String>>, cut: bool| async move {
            let s = futures::stream::iter(chunks);
            let events: Vec<_> = if cut {
                lines(s).eventsource().collect().await
            } else {
                s.eventsource().collect().await
            };
            events
                .into_iter()
                .map(|e| e.map(|e| (e.event, e.data)).map_err(|e| e.to_string()))
                .collect::<Vec<_>>()
        };
        let whole = vec![Ok(bytes::Bytes::from(text))];
        let expected = events(whole, false).await;
        assert_eq!(expected.len(), 3, "{expected:?}");
        for size in 1..9 {
            let chunks: Vec<Result<bytes::Bytes, String>> = text
                .as_bytes()
                .chunks(size)
                .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
                .collect();
            let items: Vec<bytes::Bytes> = lines(futures::stream::iter(chunks.clone()))
                .map(Result::unwrap)
                .collect()
                .await;
            assert_eq!(
                items.concat(),
                text.as_bytes(),
                "every byte, once, in order"
            );
            for item in &items {
                let ends = item.iter().filter(|b| **b == b'\n' || **b == b'\r').count();
                assert!(ends <= 1, "one line an item: {item:?}");
                assert!(ends == 1 || item == items.last().unwrap(), "whole lines");
            }
            assert_eq!(events(chunks, true).await, expected, "chunks of {size}");
        }
        // Many blank lines in one chunk, then a line sent in small pieces: one event each.
        let mut chunks = vec![Ok(bytes::Bytes::from(vec![b'\n'; 64 * 1024]))];
        chunks.push(Ok(bytes::Bytes::from_static(b"data: ")));
        chunks.extend((0..1024).map(|_| Ok(bytes::Bytes::from(vec![b'y'; 64]))));
        chunks.push(Ok(bytes::Bytes::from_static(b"\n\n")));
        let got = events(chunks, true).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].as_ref().unwrap().1.len(), 64 * 1024);
        // An error ends the lines.
        let failing = vec![
            Ok(bytes::Bytes::from_static(b"data: x")),
            Err("cut".to_string()),
        ];
        let items: Vec<_> = lines(futures::stream::iter(failing)).collect().await;
        assert_eq!(items, vec![Err("cut".to_string())]);
    }

    /// A failure body is read only up to its cap.
    #[tokio::test]
    async fn a_failure_body_is_read_up_to_its_cap() {
        let huge = reqwest::Response::from(http::Response::new(vec![b'e'; 1 << 20]));
        assert_eq!(
            read_capped(huge, MAX_ERROR_BODY_BYTES).await.len(),
            MAX_ERROR_BODY_BYTES
        );
        let small = reqwest::Response::from(http::Response::new("bad temperature"));
        assert_eq!(
            read_capped(small, MAX_ERROR_BODY_BYTES).await,
            "bad temperature"
        );
    }

    #[test]
    fn status_mapping() {
        let e = status_error(
            reqwest::StatusCode::BAD_REQUEST,
            None,
            r#"{"error":{"message":"bad temperature","param":"temperature"}}"#,
        );
        assert!(
            matches!(e, BackendError::InvalidRequest { ref message, ref param } if message == "bad temperature" && param.as_deref() == Some("temperature"))
        );
        assert!(matches!(
            status_error(reqwest::StatusCode::TOO_MANY_REQUESTS, Some(3), ""),
            BackendError::Overloaded {
                retry_after_secs: 3
            }
        ));
        assert!(matches!(
            status_error(reqwest::StatusCode::BAD_GATEWAY, None, "x"),
            BackendError::Unavailable(_)
        ));
        // A model the upstream does not have, against a path it does not serve.
        let missing =
            r#"{"error":{"message":"The model `gpt-9` does not exist","code":"model_not_found"}}"#;
        assert!(matches!(
            status_error(reqwest::StatusCode::NOT_FOUND, None, missing),
            BackendError::UnknownModel(_)
        ));
        assert!(matches!(
            status_error(reqwest::StatusCode::NOT_FOUND, None, "404 page not found"),
            BackendError::Unavailable(_)
        ));
        let vllm = r#"{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError","code":404}"#;
        assert!(matches!(
            status_error(reqwest::StatusCode::NOT_FOUND, None, vllm),
            BackendError::UnknownModel(_)
        ));
    }

    /// The cap goes up under the name the client gave it: reasoning models refuse
    /// `max_tokens` on chat.
    #[test]
    fn the_cap_keeps_the_name_it_came_with() {
        let mut req = GenRequest {
            model: "m".into(),
            input: Input::Chat(vec![crate::ChatMessage::new("user", "hi")]),
            params: crate::SamplingParams {
                max_tokens: Some(7),
                ..Default::default()
            },
            priority: Priority::Interactive,
            extra: Default::default(),
            backend: None,
        };
        let sent = body(&req, BoundField::MaxTokens);
        assert_eq!(
            (
                sent["max_tokens"].clone(),
                sent.get("max_completion_tokens")
            ),
            (json!(7), None)
        );
        // An upstream that reads `max_completion_tokens` gets the bound as that.
        let sent = body(&req, BoundField::MaxCompletionTokens);
        assert_eq!(
            (
                sent["max_completion_tokens"].clone(),
                sent.get("max_tokens")
            ),
            (json!(7), None)
        );
        // The legacy completions endpoint knows only `max_tokens`.
        let prompt = GenRequest {
            input: Input::Prompt("hi".into()),
            ..req.clone()
        };
        let sent = body(&prompt, BoundField::MaxCompletionTokens);
        assert_eq!(sent["max_tokens"], json!(7));
        req.params.max_completion_tokens_named = true;
        let sent = body(&req, BoundField::MaxTokens);
        assert_eq!(
            (
                sent["max_completion_tokens"].clone(),
                sent.get("max_tokens")
            ),
            (json!(7), None)
        );
    }

    #[test]
    fn debug_hides_key() {
        let cfg = OpenAiConfig {
            base_url: "http://127.0.0.1:1/v1".into(),
            api_key: Some("sk-secret".into()),
            connect_timeout: Duration::from_secs(1),
            pool_max_idle: 1,
            models: vec![],
            max_concurrent: 0,
            max_queue: 64,
            priority_aging: None,
            bound_field: BoundField::MaxTokens,
        };
        assert!(!format!("{cfg:?}").contains("sk-secret"));
    }
}
