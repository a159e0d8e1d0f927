//! Step 2 of the request path: the controls a client sets in headers (namespace, scoped to
//! the caller's tenant, `Cache-Control`, threshold, session, tags, priority within the
//! tenant's cap), and admission (ready, model served).

use axum::http::HeaderMap;
use reprise_policies::cache::{CacheControlError, Directives};

use reprise_backend::Priority;

use crate::auth::Tenant;
use crate::bookkeeping::Bookkeeping;
use crate::config::UserPriority;
use crate::error::ApiError;
use crate::headers::{
    NAMESPACE_HEADER, PRIORITY_HEADER, SESSION_HEADER, TAGS_HEADER, THRESHOLD_HEADER,
};
use crate::state::AppState;

/// Most tags one request may set in `x-reprise-tags`.
pub const MAX_TAGS: usize = 32;

/// Longest tag `x-reprise-tags` may set, in bytes.
pub const MAX_TAG_BYTES: usize = 128;

/// Longest namespace `x-reprise-namespace` may name, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 128;

#[derive(Debug, Clone)]
pub struct Controls {
    /// The scoped namespace: the caller's tenant and the sub-namespace its
    /// `x-reprise-namespace` picked (see [`crate::auth`]).
    pub namespace: String,
    /// `Cache-Control`: no-cache, no-store, only-if-cached (answer from the cache or fail
    /// with 504; never call the backend, never store), max-age=N (only answers at most N
    /// seconds old may be served), stale-while-revalidate=N and stale-if-error=N (narrow the
    /// policy's stale windows).
    pub cache: Directives,
    /// Similarity threshold requested by the client (only ever raises the configured one).
    pub threshold: Option<f32>,
    /// Session id linking consecutive prompts (`x-reprise-session`).
    pub session: Option<String>,
    /// Invalidation tags for the entry this request creates (`x-reprise-tags: a,b`): at
    /// most [`MAX_TAGS`], each at most [`MAX_TAG_BYTES`] (they are stored with the entry, in
    /// memory and in Redis's tag index).
    pub tags: Vec<String>,
    /// The scheduling class the backend serves it at: `x-reprise-priority` (`interactive`
    /// or `batch`), else the tenant's `priority`, never above its `max_priority` (a request
    /// asking for more is served at the cap).
    pub priority: Priority,
}

impl Controls {
    /// Reads and validates the control headers of a request from `tenant`.
    pub fn from_headers(headers: &HeaderMap, tenant: &Tenant) -> Result<Controls, ApiError> {
        let namespace = match headers.get(NAMESPACE_HEADER) {
            None => None,
            Some(v) => {
                let s = v.to_str().map_err(|_| ApiError::BadHeader {
                    header: NAMESPACE_HEADER,
                    reason: "must be visible ASCII".into(),
                })?;
                if s.is_empty() || s.len() > MAX_NAMESPACE_BYTES {
                    return Err(ApiError::BadHeader {
                        header: NAMESPACE_HEADER,
                        reason: format!("must be 1 to {MAX_NAMESPACE_BYTES} characters"),
                    });
                }
                Some(s)
            }
        };
        let namespace = tenant.namespace(namespace)?;
        let bad = |e: CacheControlError| ApiError::BadHeader {
            header: "cache-control",
            reason: e.to_string(),
        };
        // A value `to_str` cannot read is refused, not skipped: it may hold a `no-store`.
        let values = headers.get_all(axum::http::header::CACHE_CONTROL);
        let values = values
            .iter()
            .map(|v| {
                v.to_str()
                    .map_err(|_| bad(CacheControlError::NotVisibleAscii))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let cache = Directives::parse(values).map_err(bad)?;
        let threshold = match headers.get(THRESHOLD_HEADER) {
            None => None,
            Some(v) => {
                let t: f32 = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse().ok())
                    .filter(|t: &f32| t.is_finite() && (0.0..=1.0).contains(t))
                    .ok_or_else(|| ApiError::BadHeader {
                        header: THRESHOLD_HEADER,
                        reason: "must be a number between 0 and 1".into(),
                    })?;
                Some(t)
            }
        };
        Ok(Controls {
            namespace,
            cache,
            threshold,
            priority: priority_of(headers, tenant)?,
            tags: tags(headers)?,
            session: headers
                .get(SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .and_then(session_id),
        })
    }
}

/// Longest session id taken (`x-reprise-session`, or the body's `user`): a longer one is
/// ignored, as if none was given (it only links prompts for prefetch).
pub const MAX_SESSION_BYTES: usize = 256;

/// `id` as a session id, when it is one: not empty, at most [`MAX_SESSION_BYTES`].
pub fn session_id(id: &str) -> Option<String> {
    (!id.is_empty() && id.len() <= MAX_SESSION_BYTES).then(|| id.to_string())
}

/// The scheduling class a request of `tenant` is served at: `x-reprise-priority`, else the
/// tenant's `priority`, never above its `max_priority`; a value that is no class is a 400.
pub fn priority_of(headers: &HeaderMap, tenant: &Tenant) -> Result<Priority, ApiError> {
    let asked = headers.get(PRIORITY_HEADER).map(priority).transpose()?;
    Ok(tenant.policy().priority(asked).class())
}

/// The class `x-reprise-priority` asks for: `interactive` or `batch`, else a 400.
fn priority(value: &axum::http::HeaderValue) -> Result<UserPriority, ApiError> {
    value
        .to_str()
        .ok()
        .and_then(UserPriority::parse)
        .ok_or_else(|| ApiError::BadHeader {
            header: PRIORITY_HEADER,
            reason: "must be `interactive` or `batch`".into(),
        })
}

/// The tags of `x-reprise-tags` (comma-separated; several header lines add up), within the
/// bounds.
fn tags(headers: &HeaderMap) -> Result<Vec<String>, ApiError> {
    let bad = |reason: String| ApiError::BadHeader {
        header: TAGS_HEADER,
        reason,
    };
    let mut tags = Vec::new();
    for value in headers.get_all(TAGS_HEADER) {
        let value = value
            .to_str()
            .map_err(|_| bad("must be visible ASCII".into()))?;
        for tag in value.split(',').map(str::trim).filter(|t| !t.is_empty()) {
            if tag.len() > MAX_TAG_BYTES {
                return Err(bad(format!(
                    "each tag must be at most {MAX_TAG_BYTES} bytes"
                )));
            }
            if tags.len() == MAX_TAGS {
                return Err(bad(format!("at most {MAX_TAGS} tags")));
            }
            tags.push(tag.to_string());
        }
    }
    Ok(tags)
}

impl Controls {
    /// The client controls this request uses, by the names a tenant policy allows them.
    pub fn used(&self) -> Vec<&'static str> {
        let c = &self.cache;
        [
            (c.no_cache, "no-cache"),
            (c.no_store, "no-store"),
            (c.only_if_cached, "only-if-cached"),
            (c.max_age_secs.is_some(), "max-age"),
            (
                c.stale_while_revalidate_secs.is_some(),
                "stale-while-revalidate",
            ),
            (c.stale_if_error_secs.is_some(), "stale-if-error"),
            (self.threshold.is_some(), "threshold"),
            (!self.tags.is_empty(), "tags"),
        ]
        .into_iter()
        .filter_map(|(used, name)| used.then_some(name))
        .collect()
    }
}

/// Reads the control headers of a request from `tenant` and checks that the server is ready
/// and serves `model`.
pub fn admit(
    state: &AppState,
    headers: &HeaderMap,
    tenant: &Tenant,
    model: &str,
    book: &mut Bookkeeping,
) -> Result<Controls, ApiError> {
    let ctl = Controls::from_headers(headers, tenant)?;
    book.record.tenant = tenant.name().to_string();
    book.record.namespace = crate::auth::sub_namespace(&ctl.namespace).to_string();
    if !state.accepting() {
        return Err(ApiError::NotReady);
    }
    let allowed = &tenant.policy().models;
    if (!state.models.is_empty() && !state.models.iter().any(|m| m == model))
        || (!allowed.is_empty() && !allowed.iter().any(|m| m == model))
    {
        return Err(ApiError::UnknownModel(model.to_string()));
    }
    if let Some(c) = ctl
        .used()
        .into_iter()
        .find(|c| !tenant.policy().controls.iter().any(|allowed| allowed == c))
    {
        return Err(ApiError::Forbidden(format!(
            "this API key may not use the `{c}` control"
        )));
    }
    Ok(ctl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_id_is_short_and_not_empty() {
        assert_eq!(session_id("chat-42").as_deref(), Some("chat-42"));
        assert_eq!(session_id(""), None);
        let longest = "u".repeat(MAX_SESSION_BYTES);
        assert_eq!(session_id(&longest), Some(longest.clone()));
        assert_eq!(session_id(&format!("{longest}u")), None);
    }
}
