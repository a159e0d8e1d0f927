//! Routes: the OpenAI endpoints, models, health, readiness and metrics.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::extract::{Path, Query};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::openai::Endpoint;
use crate::state::AppState;
use crate::{forward, request};

/// The router over a built state.
pub fn app(state: Arc<AppState>) -> Router {
    let limit = state.config.server.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/admin/entries/{id}", delete(delete_entry))
        .route("/admin/namespaces/{namespace}", delete(delete_namespace))
        .route("/admin/tags/{tag}", delete(delete_tag))
        .route("/admin/policies", get(get_policies).put(put_policies))
        .route("/admin/explain", post(explain))
        .fallback(fallback)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    request::handle(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    request::handle(state, Endpoint::Completion, headers, body).await
}

/// The configured models; without a list, an upstream's own list.
async fn models(
    State(state): State<Arc<AppState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = state.policies.load().tenants.admit(&headers) {
        return e.into_response();
    }
    if state.models.is_empty() {
        let (get, empty) = (axum::http::Method::GET, axum::body::Body::empty());
        if let Some(resp) = forward::passthrough(&state, get, &uri, &headers, empty).await {
            return resp;
        }
    }
    let data: Vec<_> = state
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "reprise"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// Liveness: the process answers.
pub async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if !state.is_ready() {
        return ApiError::NotReady.into_response();
    }
    // Redis being down degrades the cache, not the service: still ready, and says so.
    let redis = state.store.redis().map(|r| {
        let h = r.health();
        json!({"up": h.up, "breaker_open": h.breaker_open,
               "queued_writes": h.queued_writes, "dropped_writes": h.dropped_writes})
    });
    let rebuilds = state.rebuilds.load(std::sync::atomic::Ordering::Relaxed);
    Json(json!({"status": "ready", "redis": redis, "index_rebuilds": rebuilds})).into_response()
}

/// Checks `Authorization: Bearer <token>` against the token named by
/// `server.admin_token_env`.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let expected = state
        .config
        .server
        .admin_token_env
        .as_ref()
        .and_then(|var| std::env::var(var).ok())
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::Unauthorized)?;
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(ApiError::Unauthorized)?;
    // Constant-time, length included: the digests have one length, so the comparison tells
    // an attacker neither how much of a guess was right nor how long the token is.
    let (given, expected) = (
        blake3::hash(given.as_bytes()),
        blake3::hash(expected.as_bytes()),
    );
    if bool::from(subtle::ConstantTimeEq::ct_eq(
        given.as_bytes().as_slice(),
        expected.as_bytes().as_slice(),
    )) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

fn redis_error(e: reprise_cache::redis::RedisError) -> ApiError {
    ApiError::Internal(format!("redis: {e}"))
}

async fn delete_entry(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    let id: reprise_cache::EntryId = id
        .parse()
        .map_err(|_| ApiError::invalid("not an entry id", Some("id")))?;
    let deleted = state.store.delete(id).await.map_err(redis_error)?;
    Ok(Json(json!({"deleted": u64::from(deleted)})))
}

/// `?tenant=NAME` of `DELETE /admin/namespaces/{namespace}`.
#[derive(serde::Deserialize)]
struct TenantQuery {
    /// The namespace is one of this configured tenant's (none: the anonymous tenant's).
    tenant: Option<String>,
}

async fn delete_namespace(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
    Query(q): Query<TenantQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    let namespace = match &q.tenant {
        Some(tenant) => state
            .policies
            .load()
            .tenants
            .scoped(tenant, &namespace)
            .ok_or_else(|| {
                ApiError::invalid(
                    format!("no tenant `{tenant}` is configured"),
                    Some("tenant"),
                )
            })?,
        None => namespace,
    };
    let deleted = state
        .store
        .delete_namespace(&namespace)
        .await
        .map_err(redis_error)?;
    Ok(Json(json!({"deleted": deleted})))
}

/// `?tenant=NAME&endpoint=completions` of `POST /admin/explain`.
#[derive(serde::Deserialize)]
struct ExplainQuery {
    /// The configured tenant asking (none: the anonymous tenant).
    tenant: Option<String>,
    /// `chat` (default) or `completions`.
    endpoint: Option<String>,
}

/// What a request body (with its namespace, Cache-Control and threshold headers) would be
/// answered with, and why; nothing is generated.
async fn explain(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<ExplainQuery>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    let endpoint = match q.endpoint.as_deref() {
        None | Some("chat") => Endpoint::Chat,
        Some("completions") => Endpoint::Completion,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("endpoint `{other}`: `chat` or `completions`"),
                Some("endpoint"),
            ))
        }
    };
    let view =
        request::explain::explain(&state, endpoint, q.tenant.as_deref(), &headers, &body).await?;
    Ok(Json(view))
}

/// The live policies, their version, and the tenants (how many keys each, never the keys).
async fn get_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    Ok(Json(state.policies.load().view()))
}

/// Applies a policy document (TOML: `[semantic]` policy keys, `[auth]`, `[[tenants]]`): 400
/// with the reason when it is invalid (the running policies stay), else the new version.
async fn put_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::invalid("the policy document is not UTF-8", None))?;
    let doc = crate::policy::PolicyDocument::from_toml(text)
        .map_err(|e| ApiError::invalid(format!("invalid policy document: {e}"), None))?;
    let version = crate::policy::apply(&state, doc)
        .map_err(|e| ApiError::invalid(format!("policy refused: {e:#}"), None))?;
    Ok(Json(json!({"version": version})))
}

async fn delete_tag(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tag): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorize(&state, &headers)?;
    let deleted = state.store.delete_tag(&tag).await.map_err(redis_error)?;
    Ok(Json(json!({"deleted": deleted})))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    state.update_gauges();
    let body = crate::metrics::prometheus().render();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        body,
    )
        .into_response()
}

/// Other `/v1/...` requests go to an upstream that can take them; the rest is 404.
async fn fallback(
    State(state): State<Arc<AppState>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    match forward::passthrough(&state, method, &uri, &headers, body).await {
        Some(resp) => resp,
        None => not_found().await,
    }
}

async fn not_found() -> Response {
    let body = json!({"error": {
        "message": "unknown endpoint",
        "type": "invalid_request_error",
        "param": null,
        "code": "not_found",
    }});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}
