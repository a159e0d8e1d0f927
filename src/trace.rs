//! Request ids: every request carries an `x-request-id`, the client's when it sent a sane
//! one (1 to 128 characters of letters, digits and `-_.:`), else a fresh UUID; it is echoed
//! on the response and written in the request log.

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};

/// The request id header.
pub static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest request id kept from a client.
pub const MAX_REQUEST_ID: usize = 128;

/// The request's id (set by [`with_request_ids`]; empty outside it).
pub fn request_id(headers: &HeaderMap) -> &str {
    headers
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn sane(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID
        && id
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(b))
}

/// Drops a client's request id that is not sane, so a fresh one replaces it.
async fn drop_insane(mut req: Request, next: Next) -> Response {
    let ok = req
        .headers()
        .get_all(&REQUEST_ID)
        .iter()
        .map(|v| sane(v.as_bytes()))
        .collect::<Vec<_>>();
    if ok != [true] {
        req.headers_mut().remove(&REQUEST_ID);
    }
    next.run(req).await
}

/// `router` with request ids: taken or made, echoed on the response.
pub fn with_request_ids<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router
        .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone()))
        .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
        .layer(axum::middleware::from_fn(drop_insane))
}

#[cfg(test)]
mod tests {
    use super::{sane, MAX_REQUEST_ID};

    #[test]
    fn only_short_plain_ids_are_kept() {
        assert!(sane(b"req-42_a.b:c"));
        assert!(!sane(b""));
        assert!(!sane(b"has space"));
        assert!(!sane(b"line\nbreak"));
        assert!(!sane("ü".as_bytes()));
        assert!(!sane(&[b'a'; MAX_REQUEST_ID + 1]));
        assert!(sane(&[b'a'; MAX_REQUEST_ID]));
    }
}
