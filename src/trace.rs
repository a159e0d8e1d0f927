//! What every HTTP request goes through ([`with_layers`]), outermost first:
//!
//! - **request ids**: every request carries an `x-request-id`, the client's when it sent a
//!   sane one (1 to 128 characters of letters, digits and `-_.:`), else a fresh UUID; it is
//!   echoed on the response and written in the request log and the traces;
//! - **sensitive headers**: credentials ([`SENSITIVE`]) are marked sensitive, so they print as
//!   `Sensitive` wherever headers are logged;
//! - **an `http` span** at debug level (method, path, request id, headers), with a debug line
//!   per response (status, latency): the access log of every route, `/admin` and the
//!   passthrough included, with `RUST_LOG=info,tower_http=debug`; the events logged while a
//!   request is served then carry its span;
//! - **panics** in a handler become a 500 in the OpenAI error shape (the detail is logged,
//!   never sent), with the request id on it.

use std::any::Any;

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tower::util::MapRequestLayer;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::TraceLayer;

use crate::error::ApiError;

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

/// Drops a client's request id that is not sane (or comes more than once), so a fresh one
/// replaces it.
fn drop_insane(mut req: Request) -> Request {
    let mut ids = req.headers().get_all(&REQUEST_ID).iter();
    let keep = matches!((ids.next(), ids.next()), (Some(id), None) if sane(id.as_bytes()));
    if !keep {
        req.headers_mut().remove(&REQUEST_ID);
    }
    req
}

/// Request headers that carry credentials: API keys (`Authorization`, and the key headers
/// some clients send instead), proxy credentials and cookies.
pub static SENSITIVE: [HeaderName; 5] = [
    header::AUTHORIZATION,
    header::PROXY_AUTHORIZATION,
    header::COOKIE,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-api-key"),
];

/// The debug span of one request.
fn http_span<B>(req: &axum::http::Request<B>) -> tracing::Span {
    // Under tower-http's target, so `tower_http=debug` shows the span with its lines.
    tracing::debug_span!(
        target: "tower_http::trace::make_span",
        "http",
        method = %req.method(),
        path = req.uri().path(),
        request_id = request_id(req.headers()),
        headers = ?req.headers(),
    )
}

/// The answer to a handler that panicked: a 500 with a fixed body; the panic's message goes
/// to the log.
fn panicked(panic: Box<dyn Any + Send + 'static>) -> Response {
    let message = match panic.downcast_ref::<&str>() {
        Some(m) => m.to_string(),
        None => panic.downcast_ref::<String>().cloned().unwrap_or_default(),
    };
    ApiError::Internal(format!("a handler panicked: {message}")).into_response()
}

/// `router` with the layers every request goes through (the module header lists them).
pub fn with_layers<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    // One `Router::layer` call for the whole stack (each call wraps every route in a boxed
    // service of its own, cloned per request), outermost first: the id is set before the
    // span is made and propagated onto the 500 of a panic; the span sees headers already
    // marked.
    router.layer(
        ServiceBuilder::new()
            .layer(MapRequestLayer::new(drop_insane))
            .layer(SetSensitiveRequestHeadersLayer::new(SENSITIVE.clone()))
            .layer(SetRequestIdLayer::new(REQUEST_ID.clone(), MakeRequestUuid))
            .layer(
                TraceLayer::new_for_http()
                    .make_span_with(http_span)
                    .on_request(())
                    // 5xx answers are logged where they are made (`ApiError`), not twice.
                    .on_failure(()),
            )
            .layer(PropagateRequestIdLayer::new(REQUEST_ID.clone()))
            .layer(CatchPanicLayer::custom(panicked)),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use axum::routing::get;
    use axum::Router;
    use tower::ServiceExt;

    use super::{sane, with_layers, MAX_REQUEST_ID};

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

    async fn boom() -> &'static str {
        panic!("the detail")
    }

    /// A router of test-only routes behind the production layers.
    fn layered() -> Router {
        with_layers(
            Router::new()
                .route("/boom", get(boom))
                .route("/fine", get(|| async { "fine" })),
        )
    }

    #[tokio::test]
    async fn a_panic_is_a_500_in_the_openai_shape_with_the_request_id() {
        let req = Request::get("/boom")
            .header("x-request-id", "req-7")
            .body(Body::empty())
            .unwrap();
        let resp = layered().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(resp.headers()["x-request-id"], "req-7");
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["message"], "internal server error");
        assert!(!String::from_utf8_lossy(&body).contains("the detail"));
        // The router still answers afterwards.
        let req = Request::get("/fine").body(Body::empty()).unwrap();
        assert_eq!(
            layered().oneshot(req).await.unwrap().status(),
            StatusCode::OK
        );
    }

    #[tokio::test]
    async fn a_sane_id_is_kept_and_an_insane_or_repeated_one_replaced() {
        let id_of = |ids: &[&str]| {
            let mut req = Request::get("/fine");
            for id in ids {
                req = req.header("x-request-id", *id);
            }
            let req = req.body(Body::empty()).unwrap();
            async move {
                let resp = layered().oneshot(req).await.unwrap();
                let all: Vec<String> = resp
                    .headers()
                    .get_all("x-request-id")
                    .iter()
                    .map(|v| v.to_str().unwrap().to_string())
                    .collect();
                assert_eq!(all.len(), 1, "{all:?}");
                all[0].clone()
            }
        };
        assert_eq!(id_of(&["client-1"]).await, "client-1");
        for ids in [&["has space"][..], &["a", "b"], &["a", "a"], &[]] {
            let made = id_of(ids).await;
            assert!(uuid::Uuid::parse_str(&made).is_ok(), "{ids:?} -> {made}");
        }
    }

    /// The log's bytes, shared with the writer the subscriber makes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn credentials_never_reach_the_debug_log() {
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        // The test's runtime runs on this thread: the subscriber sees the request.
        let _guard = tracing::subscriber::set_default(subscriber);
        let req = Request::get("/fine")
            .header("authorization", "Bearer sk-very-secret")
            .header("x-api-key", "sk-also-secret")
            .header("x-request-id", "req-8")
            .header("x-reprise-namespace", "visible")
            .body(Body::empty())
            .unwrap();
        let resp = layered().oneshot(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
        assert!(text.contains("finished processing request"), "{text}");
        assert!(text.contains("req-8") && text.contains("visible"), "{text}");
        assert!(text.contains("Sensitive"), "{text}");
        assert!(!text.contains("secret"), "{text}");
    }
}
