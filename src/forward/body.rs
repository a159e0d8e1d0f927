//! The body of a forwarded answer: passed on chunk by chunk within its time limits, with the
//! request's bookkeeping done when it ends.

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use futures::StreamExt;

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
    /// No limit (files and other non-completion endpoints).
    None,
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

/// The client's response to a forwarded or passed-through request: the upstream's status,
/// headers and body as they come, within `limits`. A client error from the upstream counts
/// as an error in the metrics.
pub(super) fn upstream_response(
    answer: reprise_backend::Forwarded,
    limits: BodyLimits,
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
    let body = async_stream::stream! {
        // When the stream's last data came (its first: the first token).
        let mut data_at = None::<tokio::time::Instant>;
        let mut bytes = 0usize;
        loop {
            let next = match (limits, data_at) {
                (BodyLimits::None, _) => Ok(upstream.next().await),
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
    set_cache_status(&mut resp, outcome, None);
    resp
}
