//! Requests that only an upstream can answer, sent there as they came and answered with
//! the upstream's status, headers and body as they arrive. Nothing is looked up, stored or
//! learned from them.
//!
//! - **forward**: a completion that asks for more than a cached text answer can give (tools,
//!   `n > 1`, images, log-probabilities, audio), classified by [`crate::request::parse`];
//! - **passthrough**: another `/v1/...` endpoint that `backend.passthrough` opens (embeddings,
//!   moderations, models, ...), reached from the router's fallback;
//! - [`paths`]: which passthrough paths are safe (plain paths below the base URL only);
//! - [`body`]: the answer's body within its time limits.

mod body;
mod paths;
mod scrub;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use reprise_backend::ForwardRequest;
use reprise_policies::cacheable::Uncacheable;

use crate::bookkeeping::Bookkeeping;
use crate::error::ApiError;
use crate::headers::set_cache_status;
use crate::metrics::Outcome;
use crate::openai::Endpoint;
use crate::state::AppState;
use body::{upstream_headers, upstream_response, BodyLimits};

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
    /// The `max_tokens` (or `max_completion_tokens`) it asks for.
    pub max_tokens: Option<u32>,
    /// How many answers it asks for (`n`, `best_of`).
    pub answers: u32,
    /// The backend its route chose, by name (`None`: the upstream serving `model`).
    pub backend: Option<String>,
}

impl Forward {
    pub(crate) fn new(
        model: String,
        stream: Option<bool>,
        u: Uncacheable,
        max_tokens: Option<u32>,
        answers: Option<u32>,
    ) -> Self {
        Forward {
            model,
            stream: stream.unwrap_or(false),
            param: u.param,
            field: u.field,
            max_tokens,
            answers: answers.unwrap_or(1).max(1),
            backend: None,
        }
    }

    /// The refusal when the backend its route chose cannot forward it (the in-process llama
    /// backend answers with text only).
    pub fn needs_upstream(&self) -> ApiError {
        ApiError::invalid(
            format!(
                "`{}` needs an OpenAI-compatible upstream (backend.kind = \"openai\"): the \
                 in-process llama backend answers with text only",
                self.param
            ),
            Some(&self.param),
        )
    }
}

/// The body of `f` naming `model` (the model its route serves it as; unchanged when it
/// already does).
pub fn with_model(body: Bytes, f: &mut Forward, model: &str) -> Result<Bytes, ApiError> {
    if f.model == model {
        return Ok(body);
    }
    f.model = model.to_string();
    set_field(&body, "model", model.into())
}

/// `body` (a JSON object, parsed once already) with `key` set to `value`.
pub(crate) fn set_field(
    body: &[u8],
    key: &str,
    value: serde_json::Value,
) -> Result<Bytes, ApiError> {
    let mut doc: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    doc.insert(key.into(), value);
    Ok(Bytes::from(
        serde_json::to_vec(&doc).expect("a JSON map serialises"),
    ))
}

/// Sends a request the cache cannot represent upstream as it came (the request path has
/// admitted it, and refused it with [`Forward::needs_upstream`] where its route's backend
/// cannot forward) and streams the answer back as it arrives, taking one of the upstream's
/// slots at `priority` (`backend.max_concurrent`). Nothing is looked up, stored or learned
/// from it.
pub async fn forward(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
    f: Forward,
    priority: reprise_backend::Priority,
    book: &mut Bookkeeping,
) -> Result<Response, ApiError> {
    book.outcome = Outcome::Bypass;
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
        // The body may have been rewritten (the tenant's max_tokens cap): its length is its
        // own, not the client's.
        headers: upstream_headers(headers, "application/json")
            .into_iter()
            .filter(|(name, _)| name != "content-length")
            .collect(),
        model: Some(f.model),
        body: body.into(),
        priority: Some(priority),
        backend: f.backend,
    };
    let answer = tokio::time::timeout_at(headers_by, state.backend.forward(req))
        .await
        .map_err(|_| ApiError::Timeout)??;
    let answer = for_the_caller(state, answer);
    let book = book.take();
    // A stream's first chunk may follow its headers after the whole prefill.
    let limits = match deadline {
        Some(d) => BodyLimits::Deadline(d),
        None => BodyLimits::Stream {
            first_by: headers_by,
            gap: server.token_timeout(),
        },
    };
    Ok(upstream_response(
        answer,
        limits,
        Some(server.token_timeout()),
        book,
    ))
}

/// The upstream's answer as this caller may see it: with tenants, nothing of what the shared
/// upstream account says about the others ([`scrub`]).
fn for_the_caller(
    state: &AppState,
    answer: reprise_backend::Forwarded,
) -> reprise_backend::Forwarded {
    scrub::for_the_caller(answer, !state.policies.load().tenants.is_empty())
}

/// Whether a passthrough request's body is an upload: sent to an endpoint that takes files
/// (audio transcriptions and translations, image edits and variations, videos, files, upload
/// parts and container files) as `multipart/*` or `application/octet-stream` (the media type read without regard
/// to case). The path decides, not the client's media type alone: a JSON body labelled as an
/// upload is read, slotted and charged like any other (upstreams parse JSON whatever the
/// label says).
fn is_upload(path: &str, headers: &HeaderMap) -> bool {
    let path = path.trim_end_matches('/');
    let segments: Vec<&str> = path.split('/').collect();
    let takes_files = matches!(
        segments.as_slice(),
        ["audio", "transcriptions" | "translations"]
            | ["images", "edits" | "variations"]
            | ["files"]
            | ["videos"]
            | ["uploads", _, "parts"]
            | ["containers", _, "files"]
    );
    takes_files && is_upload_media(headers)
}

/// Whether a request's media type is one an upload is sent as.
fn is_upload_media(headers: &HeaderMap) -> bool {
    let Some(media) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let media = media
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    media.starts_with("multipart/") || media == "application/octet-stream"
}

/// Whether an upstream's answer is an event stream.
fn is_event_stream(answer: &reprise_backend::Forwarded) -> bool {
    answer.headers.iter().any(|(name, value)| {
        name.eq_ignore_ascii_case("content-type")
            && value
                .trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
    })
}

/// The `model` a JSON body names, if it is one that names one.
fn model_named(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: String,
    }
    serde_json::from_slice::<Named>(body).ok().map(|n| n.model)
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
    passthrough_for(state, None, method, uri, headers, body).await
}

/// [`passthrough`] for a caller already admitted as `admitted` (its request counted once
/// against its rate), or for the caller `headers` name.
pub async fn passthrough_for(
    state: &Arc<AppState>,
    admitted: Option<Arc<crate::auth::Tenant>>,
    method: axum::http::Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Option<Response> {
    let path = uri.path().strip_prefix("/v1/")?;
    let endpoint = paths::passthrough_endpoint(state, path)?;
    let result = async {
        // The operator's upstream key pays for it: only callers /v1 admits.
        let tenant = match admitted {
            Some(t) => t,
            None => state.policies.load().tenants.admit(headers)?,
        };
        if !state.accepting() {
            return Err(ApiError::NotReady);
        }
        // With tenants the upstream account is shared: its models (fine-tunes among them)
        // are read through reprise, never deleted by one tenant for all.
        let reads = matches!(method, axum::http::Method::GET | axum::http::Method::HEAD);
        if endpoint == "models" && !reads && !state.policies.load().tenants.is_empty() {
            return Err(ApiError::Forbidden(
                "with tenants, the upstream's models may only be read through reprise".into(),
            ));
        }
        // A request that is not a read (embeddings, moderations, image generation) is read
        // whole (within `server.max_body_bytes`), then takes one of the upstream's slots at
        // the caller's priority, as a completion does, and is charged its input to a token
        // budget. Uploads (`multipart/*`, `application/octet-stream` to an endpoint that
        // takes files: audio, files) stream as they come, uncharged and outside the slots: a slot held while a client sends its
        // upload slowly would keep everyone's completions waiting. Any other body (a JSON
        // one whatever its media type says, or none) counts as a request.
        let request = !reads && !is_upload(path, headers);
        let priority = match request {
            true => Some(crate::request::priority_of(headers, &tenant)?),
            false => None,
        };
        let allowed = tenant.policy().models.as_slice();
        let charged = tenant.has_token_budget() && request;
        let body = if allowed.is_empty() && !request {
            reqwest::Body::wrap_stream(body.into_data_stream())
        } else {
            let server = &state.config.server;
            let (limit, timeout) = (server.max_body_bytes, server.body_timeout());
            let bytes = crate::http::read_body(headers, body, limit, timeout).await?;
            if !allowed.is_empty() {
                let named = match path.strip_prefix("models/") {
                    Some(id) => Some(id.to_string()),
                    None => model_named(&bytes),
                };
                match named {
                    Some(m) if allowed.contains(&m) => {}
                    Some(m) => return Err(ApiError::UnknownModel(m)),
                    None => {
                        return Err(ApiError::Forbidden(
                            "this API key may use only its models; the request names none".into(),
                        ))
                    }
                }
            }
            if charged {
                tenant.take_body_tokens(bytes.len())?;
            }
            reqwest::Body::from(bytes)
        };
        let label = crate::openai::API_ROOTS
            .iter()
            .find(|r| **r == endpoint)
            .copied()
            .unwrap_or("other");
        state.metrics.passthrough(label);
        let req = ForwardRequest {
            method,
            path: match uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path.to_string(),
            },
            headers: upstream_headers(headers, ""),
            model: None,
            // Uploads streamed, not buffered (but for a tenant kept to some models): they can
            // be large, and the upstream enforces its own limits.
            body,
            priority,
            backend: None,
        };
        let server = &state.config.server;
        let deadline = tokio::time::Instant::now() + server.request_timeout();
        let answer = tokio::time::timeout_at(deadline, state.backend.forward(req))
            .await
            .map_err(|_| ApiError::Timeout)??;
        // A request holding a slot holds it until its answer is read: a whole answer within
        // the request's deadline, an event stream (`stream: true`) within the token
        // timeouts, so a stalled upstream cannot keep it; nor a client that stops reading
        // (cut off once it leaves a chunk unread for the token timeout). A read or an
        // upload is cut off once its upstream sends nothing for the token timeout.
        let limits = match (request, is_event_stream(&answer)) {
            (false, _) => BodyLimits::Idle(server.token_timeout()),
            (true, false) => BodyLimits::Deadline(deadline),
            (true, true) => BodyLimits::Stream {
                first_by: deadline.min(tokio::time::Instant::now() + server.first_token_timeout()),
                gap: server.token_timeout(),
            },
        };
        // Not a completion: no request metrics, no request log.
        Ok(upstream_response(
            for_the_caller(state, answer),
            limits,
            request.then(|| server.token_timeout()),
            Bookkeeping::detached(),
        ))
    }
    .await;
    Some(result.unwrap_or_else(|e| {
        let mut resp = e.into_response();
        set_cache_status(&mut resp, Outcome::Error, None);
        resp
    }))
}
