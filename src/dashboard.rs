//! The operators' dashboard: `GET /dashboard`, a page that polls `GET /admin/stats` and draws
//! it (hit rates, latency against the SLO, savings, prefetch, missed questions, the pairs
//! served by meaning, gate rejections).
//!
//! The page, its script, its style sheet and its icon are compiled into the binary
//! (`src/dashboard/`), so it works with no network beyond reprise and no CDN. It holds no
//! data and needs no token: its script reads the admin token from the URL fragment
//! (`/dashboard#token=...`, which browsers never send) or a field (kept in
//! `sessionStorage`) and sends it on each `/admin/stats` request. The page is served where
//! the admin API is (the main listener, or `server.admin_listen`), so those requests are
//! same-origin.
//!
//! Every asset carries a strict Content-Security-Policy: only scripts, styles and requests to
//! this origin, no inline script or style, no framing. The script writes server text with
//! `textContent` only (questions are user text), so even a question shaped like markup stays
//! text.

use axum::http::{header, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The Content-Security-Policy of every dashboard response.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
     img-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

const INDEX_HTML: &str = include_str!("dashboard/index.html");
const APP_JS: &str = include_str!("dashboard/app.js");
const APP_CSS: &str = include_str!("dashboard/app.css");
const ICON_SVG: &str = include_str!("dashboard/icon.svg");

/// The dashboard's routes: the page and its assets under `/dashboard/`. They need no state,
/// so they merge into either router (the API's or the admin listener's).
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/dashboard",
            get(|| async { asset(INDEX_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/dashboard/app.js",
            get(|| async { asset(APP_JS, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/dashboard/app.css",
            get(|| async { asset(APP_CSS, "text/css; charset=utf-8") }),
        )
        .route(
            "/dashboard/icon.svg",
            get(|| async { asset(ICON_SVG, "image/svg+xml") }),
        )
}

/// One embedded asset with its type and the dashboard's security headers.
fn asset(body: &'static str, content_type: &'static str) -> Response {
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        ),
        // Types are exact, so browsers must not guess them.
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        // The assets change with the binary: browsers revalidate rather than keep an old
        // script beside a new server.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (
            HeaderName::from_static("x-frame-options"),
            HeaderValue::from_static("DENY"),
        ),
    ];
    (headers, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page loads its script and style from files (CSP: no inline script or style).
    #[test]
    fn the_page_has_no_inline_script_or_style() {
        assert!(INDEX_HTML.contains(r#"<script src="/dashboard/app.js" defer></script>"#));
        assert!(!INDEX_HTML.contains("<script>"));
        assert!(!INDEX_HTML.contains("<style"));
        assert!(!INDEX_HTML.contains("style="));
        let handler = INDEX_HTML.split([' ', '\n']).find(|word| {
            let name = word.split('=').next().unwrap_or("");
            word.contains('=')
                && name.starts_with("on")
                && name[2..].chars().all(|c| c.is_ascii_lowercase())
        });
        assert_eq!(handler, None, "no inline event handlers");
    }

    /// Server text reaches the page as text only.
    #[test]
    fn the_script_never_parses_markup() {
        for sink in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!APP_JS.contains(sink), "app.js uses {sink}");
        }
    }
}
