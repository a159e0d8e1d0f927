//! The body of a forwarded answer: passed on chunk by chunk within its time limits, with the
//! request's bookkeeping done when it ends.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc::error::SendTimeoutError;

use crate::bookkeeping::Bookkeeping;
use crate::error::ApiError;
use crate::headers::set_cache_status;
use crate::metrics::Outcome;

/// Request headers that travel with a forwarded request; a missing content type is `default`.
pub(super) fn upstream_headers(headers: &HeaderMap, default_type: &str) -> Vec<(String, String)> {
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
pub(super) enum BodyLimits {
    /// Each chunk within this long of the one before (of the start, for the first): reads
    /// and uploads, which hold no slot and may be large, but must not be held for ever by
    /// an upstream that stopped sending.
    Idle(Duration),
    /// The whole body by then.
    Deadline(tokio::time::Instant),
    /// A stream: its first event with data (its first token) by `first_by`, then at most
    /// `gap` between two such events, and at most `MAX_STREAM_BYTES` in all (a generation's
    /// own cap: an upstream that never stops would hold its slot for as long as the client
    /// reads). Comment lines (`: keep-alive`) are passed on but meet neither time limit: an
    /// upstream that only keeps the connection open is cut off.
    Stream {
        first_by: tokio::time::Instant,
        gap: std::time::Duration,
    },
}

/// Whether a chunk of an event stream holds more than comment lines (`: keep-alive`) and
/// blank ones. A line cut between two chunks counts as data in the second.
fn carries_data(chunk: &[u8]) -> bool {
    chunk
        .split(|b| *b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .any(|line| !line.is_empty() && !line.starts_with(b":"))
}

/// Chunks of an answer held for a client that reads slower than its upstream sends.
const PUMP_CHUNKS: usize = 8;

/// `body` sent on from a task of its own, so that a client that stops reading cannot keep
/// what the body holds (an upstream slot) for as long as its connection lasts: a chunk the
/// client has not taken within `stall` ends the body there, and the response is cut off
/// with an error (never ended as if whole). A client that leaves ends it at once, even while
/// the upstream sends nothing. `delivered` (the request's bookkeeping, handed over when the
/// body ended) is told the stream ended only once the client has taken every chunk: a
/// client that leaves with chunks unread is recorded as gone.
fn pumped<S>(
    body: S,
    stall: Duration,
    delivered: tokio::sync::oneshot::Receiver<Bookkeeping>,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send
where
    S: Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel(PUMP_CHUNKS);
    let stalled = Arc::new(AtomicBool::new(false));
    let flag = stalled.clone();
    tokio::spawn(async move {
        let mut body = std::pin::pin!(body);
        loop {
            let item = tokio::select! {
                _ = tx.closed() => break,
                item = body.next() => item,
            };
            let Some(item) = item else { break };
            match tx.send_timeout(item, stall).await {
                Ok(()) => {}
                Err(SendTimeoutError::Timeout(_)) => {
                    flag.store(true, Ordering::SeqCst);
                    tracing::debug!(
                        stall_secs = stall.as_secs_f64(),
                        "a client stopped reading an upstream's answer; cut off"
                    );
                    break;
                }
                Err(SendTimeoutError::Closed(_)) => break,
            }
        }
    });
    async_stream::stream! {
        while let Some(item) = rx.recv().await {
            yield item;
        }
        if stalled.load(Ordering::SeqCst) {
            yield Err(std::io::Error::other("the client stopped reading"));
        } else if let Ok(mut book) = delivered.await {
            book.stream_ended();
        }
    }
}

/// The client's response to a forwarded or passed-through request: the upstream's status,
/// headers and body as they come, within `limits`. A client error from the upstream counts
/// as an error in the metrics. `reader_stall`, for an answer that holds an upstream slot:
/// how long the client may leave a chunk unread before the body is cut off ([`pumped`]).
/// A client that leaves before the body's end is recorded as `client_closed`.
pub(super) fn upstream_response(
    answer: reprise_backend::Forwarded,
    limits: BodyLimits,
    reader_stall: Option<Duration>,
    mut book: Bookkeeping,
) -> Response {
    let stream = matches!(limits, BodyLimits::Stream { .. });
    let status = axum::http::StatusCode::from_u16(answer.status)
        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let outcome = if status.is_success() {
        Outcome::Bypass
    } else {
        book.failed(match status.as_u16() {
            429 => "overloaded",
            500.. => "unavailable",
            _ => "invalid_request",
        });
        Outcome::Error
    };
    let mut upstream = answer.body;
    book.stream_started();
    // Pumped, the bookkeeping is handed to the client's side when the body ends (see
    // `pumped`); otherwise the body's end is the client's.
    let (hand_over, delivered) = tokio::sync::oneshot::channel::<Bookkeeping>();
    let mut hand_over = reader_stall.is_some().then_some(hand_over);
    let body = async_stream::stream! {
        // When the stream's last data came (its first: the first token).
        let mut data_at = None::<tokio::time::Instant>;
        let mut bytes = 0usize;
        loop {
            let next = match (limits, data_at) {
                (BodyLimits::Idle(gap), _) => tokio::time::timeout(gap, upstream.next()).await,
                (BodyLimits::Deadline(d), _) => tokio::time::timeout_at(d, upstream.next()).await,
                (BodyLimits::Stream { first_by, .. }, None) => {
                    tokio::time::timeout_at(first_by, upstream.next()).await
                }
                (BodyLimits::Stream { gap, .. }, Some(at)) => {
                    tokio::time::timeout_at(at + gap, upstream.next()).await
                }
            };
            match next {
                Ok(Some(Ok(chunk))) => {
                    bytes = bytes.saturating_add(chunk.len());
                    if stream && bytes > reprise_backend::openai::MAX_STREAM_BYTES {
                        book.failed("unavailable");
                        yield Err(std::io::Error::other("the upstream's stream is over its size cap"));
                        break;
                    }
                    if stream && carries_data(&chunk) {
                        book.first_token();
                        data_at = Some(tokio::time::Instant::now());
                    }
                    yield Ok::<Bytes, std::io::Error>(chunk);
                }
                Ok(Some(Err(e))) => {
                    // The status is sent: cutting the body off is all that is left to say.
                    book.failed(e.kind());
                    yield Err(std::io::Error::other(e));
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    book.failed(ApiError::Timeout.kind());
                    yield Err(std::io::Error::other("the request timed out"));
                    break;
                }
            }
        }
        match hand_over.take() {
            Some(to) => {
                let _ = to.send(book);
            }
            None => book.stream_ended(),
        }
    };
    let body = match reader_stall {
        Some(stall) => axum::body::Body::from_stream(pumped(body, stall, delivered)),
        None => axum::body::Body::from_stream(body),
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    for (name, value) in answer.headers {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::try_from(name),
            HeaderValue::from_str(&value),
        ) {
            resp.headers_mut().insert(name, value);
        }
    }
    set_cache_status(&mut resp, outcome, None);
    resp
}
