//! Answers served in a degraded way: not what the cache or the backend would normally give,
//! but better than an error or a wait. Each kind is named once here, for the response header
//! (`x-reprise-degraded`), the metric (`reprise_degraded_total{kind}`) and the request log
//! (`degraded`).
//!
//! Stale answers (RFC 5861) are the first kinds: an expired entry served within the policy's
//! stale-while-revalidate window (at once, while one regeneration replaces it) or its
//! stale-if-error window: when the backend failed, or when it is up but too busy to answer
//! within the SLO (a kind of its own, so that overload is not read as failure).

use axum::http::HeaderValue;
use axum::response::Response;

use crate::headers::DEGRADED_HEADER;

/// How an answer was degraded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Degraded {
    /// An expired entry served at once while a fresh answer is generated in the background.
    StaleWhileRevalidate,
    /// An expired entry served because the backend failed.
    StaleIfError,
    /// An expired entry served because the backend would answer too late for the SLO.
    StaleUnderLoad,
    /// An answer matched by meaning under a looser threshold than the policy's.
    LooseThreshold,
    /// An answer from a fallback instead of the backend.
    Fallback,
}

impl Degraded {
    /// Every kind, for pre-registering the metric.
    pub const ALL: [Degraded; 5] = [
        Degraded::StaleWhileRevalidate,
        Degraded::StaleIfError,
        Degraded::StaleUnderLoad,
        Degraded::LooseThreshold,
        Degraded::Fallback,
    ];

    /// The metric label and request-log value (`stale_while_revalidate`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Degraded::StaleWhileRevalidate => "stale_while_revalidate",
            Degraded::StaleIfError => "stale_if_error",
            Degraded::StaleUnderLoad => "stale_under_load",
            Degraded::LooseThreshold => "loose_threshold",
            Degraded::Fallback => "fallback",
        }
    }

    /// The `x-reprise-degraded` value (`stale-while-revalidate`, ...; the `Cache-Control`
    /// spelling for the stale kinds).
    pub fn header_value(self) -> &'static str {
        match self {
            Degraded::StaleWhileRevalidate => "stale-while-revalidate",
            Degraded::StaleIfError => "stale-if-error",
            Degraded::StaleUnderLoad => "stale-under-load",
            Degraded::LooseThreshold => "loose-threshold",
            Degraded::Fallback => "fallback",
        }
    }
}

/// Sets `x-reprise-degraded` on a response.
pub fn set_degraded(resp: &mut Response, kind: Degraded) {
    resp.headers_mut().insert(
        DEGRADED_HEADER,
        HeaderValue::from_static(kind.header_value()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_header() {
        let labels: Vec<_> = Degraded::ALL.iter().map(|d| d.as_str()).collect();
        assert_eq!(
            labels,
            [
                "stale_while_revalidate",
                "stale_if_error",
                "stale_under_load",
                "loose_threshold",
                "fallback"
            ]
        );
        for d in Degraded::ALL {
            assert_eq!(d.header_value().replace('-', "_"), d.as_str());
        }
        let mut resp = Response::new(axum::body::Body::empty());
        set_degraded(&mut resp, Degraded::StaleIfError);
        assert_eq!(resp.headers()[DEGRADED_HEADER], "stale-if-error");
    }
}
