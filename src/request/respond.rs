//! Step 9 of the request path: the response, as JSON or SSE, with the cache status headers.
//! A generation's first event is awaited before answering, so a backend that fails at once
//! becomes a real status code (502/504/429); later failures travel in-band.

use std::sync::Arc;

use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use reprise_backend::{BackendError, FinishReason, GenEvent, Usage};
use reprise_cache::Entry;

use crate::bookkeeping::Bookkeeping;
use crate::degraded::{set_degraded, Degraded};
use crate::error::ApiError;
use crate::flight::Subscriber;
use crate::headers::{set_cache_status, set_entry, set_similarity, set_stale};
use crate::lookup::Hit;
use crate::metrics::Outcome;
use crate::openai::Renderer;
use crate::request::sse::SseState;
use crate::request::Parsed;
use crate::state::AppState;

/// Answers from a cached entry, as JSON or SSE.
pub fn hit(parsed: &Parsed, renderer: Renderer, hit: Hit, book: &mut Bookkeeping) -> Response {
    let Hit {
        entry,
        outcome,
        similarity,
    } = hit;
    book.outcome = outcome;
    book.served_from(&entry, outcome);
    book.first_token();
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
        // The bookkeeping moves into the stream so the request is counted when the body is
        // done.
        let book = book.take();
        let stream = async_stream::stream! {
            let _book = book;
            for ev in events {
                yield Ok::<_, std::convert::Infallible>(ev);
            }
        };
        Sse::new(stream).into_response()
    } else {
        axum::Json(renderer.full(&entry.text, reason, usage)).into_response()
    };
    set_cache_status(&mut resp, outcome, Some(&entry));
    if let Some(sim) = similarity {
        set_similarity(&mut resp, sim);
    }
    resp
}

/// Answers from an expired entry (stale-while-revalidate, stale-if-error): as a hit of the
/// exact tier (its outcome in the metrics), marked stale in the headers and degraded in the
/// log line and `reprise_degraded_total`.
pub fn stale(
    parsed: &Parsed,
    renderer: Renderer,
    entry: Arc<Entry>,
    kind: Degraded,
    book: &mut Bookkeeping,
) -> Response {
    // Before `hit`, which may move the bookkeeping into a stream.
    book.degraded(kind);
    let served = Hit {
        entry: entry.clone(),
        outcome: Outcome::Exact,
        similarity: None,
    };
    let mut resp = hit(parsed, renderer, served, book);
    set_stale(&mut resp, &entry, kind);
    resp
}

/// Answers from a generation (led or joined).
pub async fn generation(
    state: &Arc<AppState>,
    parsed: &Parsed,
    renderer: Renderer,
    mut sub: Subscriber,
    outcome: Outcome,
    book: &mut Bookkeeping,
    deadline: tokio::time::Instant,
) -> Result<Response, ApiError> {
    let server = &state.config.server;
    // The entry the flight's answer is stored as (none when it is not stored).
    let entry = sub.entry();
    // Wait for the first event before answering, so a backend that fails at once becomes a
    // real status code.
    let first_by = deadline.min(tokio::time::Instant::now() + server.first_token_timeout());
    let first = tokio::time::timeout_at(first_by, sub.next())
        .await
        .map_err(|_| ApiError::Timeout)?;
    let first = match first {
        Some(Ok(ev)) => ev,
        Some(Err(e)) => return Err(e.into()),
        None => return Err(ApiError::Internal("generation ended without events".into())),
    };
    book.first_token();
    // A fallback backend answered: the response names its model and says it is degraded.
    let fallback = sub.fallback().map(str::to_string);
    let renderer = match &fallback {
        Some(model) => {
            book.degraded(Degraded::Fallback);
            book.record.model = model.clone();
            renderer.with_model(model)
        }
        None => renderer,
    };
    // Whether the answer is stored: it has an entry to be stored as, no fallback answered,
    // and (known before answering a whole response) no content filter cut it short.
    let mut stored = entry.is_some() && fallback.is_none();
    let mut resp = if parsed.stream {
        let mut sse = SseState::new(renderer, parsed.include_usage);
        let mut book = book.take();
        // Until its last events are ready to send: a client that leaves before is recorded
        // as gone (`client_closed`), not as served whole.
        let initial = sse.push(Ok(first));
        if !sse.done {
            book.stream_started();
        }
        let stream = async_stream::stream! {
            for ev in initial {
                yield Ok::<_, std::convert::Infallible>(ev);
            }
            while !sse.done {
                let next = sub.next().await;
                let events = sse.push_next(next, &mut book);
                if sse.done {
                    book.stream_ended();
                }
                for ev in events {
                    yield Ok(ev);
                }
            }
        };
        Sse::new(stream).into_response()
    } else {
        let mut text = String::new();
        let mut ev: Option<Result<GenEvent, BackendError>> = Some(Ok(first));
        let (reason, usage) = loop {
            match ev {
                Some(Ok(GenEvent::Delta(d))) => text.push_str(&d),
                Some(Ok(GenEvent::Finish { reason, usage })) => {
                    stored &= reason != reprise_backend::FinishReason::ContentFilter;
                    break (reason, usage);
                }
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
    set_cache_status(&mut resp, outcome, None);
    if outcome == Outcome::Miss && !stored {
        crate::headers::set_not_stored(&mut resp);
    }
    if fallback.is_some() {
        set_degraded(&mut resp, Degraded::Fallback);
    } else if let Some(id) = entry.filter(|_| stored) {
        set_entry(&mut resp, id);
    }
    Ok(resp)
}
