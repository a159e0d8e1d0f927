//! reprise's HTTP headers: the request controls it reads and the cache status it writes.

use axum::http::HeaderValue;
use axum::response::Response;
use reprise_cache::{Entry, EntryId};

use crate::metrics::Outcome;

/// Header naming the tenant namespace.
pub const NAMESPACE_HEADER: &str = "x-reprise-namespace";
/// Response header saying how the request was answered.
pub const CACHE_HEADER: &str = "x-reprise-cache";
/// Response header naming the entry that answered, or that a miss stores its answer as (an
/// operator can act on a reported answer by it: `DELETE /admin/entries/{id}`).
pub const ENTRY_HEADER: &str = "x-reprise-entry";
/// Response header naming how an answer was degraded (`stale-while-revalidate`,
/// `stale-if-error`, ...; see [`crate::degraded`]); absent on ordinary answers.
pub const DEGRADED_HEADER: &str = "x-reprise-degraded";
/// Response header with the similarity of a semantic hit.
pub const SIMILARITY_HEADER: &str = "x-reprise-similarity";
/// Request header raising the similarity threshold for this request.
pub const THRESHOLD_HEADER: &str = "x-reprise-threshold";
/// Request header linking consecutive single-turn prompts of one session (for prefetch).
pub const SESSION_HEADER: &str = "x-reprise-session";
/// Request header with comma-separated invalidation tags for the stored answer.
pub const TAGS_HEADER: &str = "x-reprise-tags";
/// Request header asking for a scheduling class: `interactive` or `batch` (capped by the
/// tenant's `max_priority`).
pub const PRIORITY_HEADER: &str = "x-reprise-priority";
/// The namespace of requests that name none.
pub const DEFAULT_NAMESPACE: &str = "default";

/// Sets `x-reprise-similarity`.
pub fn set_similarity(resp: &mut Response, sim: f32) {
    if let Ok(v) = HeaderValue::from_str(&format!("{sim:.4}")) {
        resp.headers_mut().insert(SIMILARITY_HEADER, v);
    }
}

/// Sets `x-reprise-entry`.
pub fn set_entry(resp: &mut Response, id: EntryId) {
    if let Ok(v) = HeaderValue::from_str(&id.to_string()) {
        resp.headers_mut().insert(ENTRY_HEADER, v);
    }
}

/// Sets `x-reprise-cache`, `Cache-Status` (RFC 9211) and, on hits, `Age` and
/// `x-reprise-entry`.
pub fn set_cache_status(resp: &mut Response, outcome: Outcome, entry: Option<&Entry>) {
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
        set_entry(resp, e.id);
    }
}

/// A miss whose answer is not stored (nothing may be written, a fallback or a content
/// filter answered): `Cache-Status` without `stored`.
pub fn set_not_stored(resp: &mut Response) {
    resp.headers_mut().insert(
        "cache-status",
        HeaderValue::from_static("reprise; fwd=miss"),
    );
}

/// Marks a hit on an expired entry as stale: `x-reprise-cache: stale`, `Cache-Status` with
/// the (negative) seconds since it expired as its `ttl` (RFC 9211) and the kind as detail,
/// and `x-reprise-degraded`. `Age` and `x-reprise-entry` are set as for any hit.
pub fn set_stale(resp: &mut Response, entry: &Entry, kind: crate::degraded::Degraded) {
    set_cache_status(resp, Outcome::Exact, Some(entry));
    // Stale from its first millisecond past expiry: never `ttl=0`.
    let ttl = entry.expired_for_ms().div_ceil(1000).max(1);
    let status = format!("reprise; hit; ttl=-{ttl}; detail={}", kind.header_value());
    let h = resp.headers_mut();
    h.insert(CACHE_HEADER, HeaderValue::from_static("stale"));
    if let Ok(v) = HeaderValue::from_str(&status) {
        h.insert("cache-status", v);
    }
    crate::degraded::set_degraded(resp, kind);
}
