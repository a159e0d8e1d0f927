//! Routes: the OpenAI endpoints, models, health, readiness, metrics, the admin API
//! ([`crate::admin`]) and the dashboard ([`crate::dashboard`]), served where the admin API is.

use std::sync::Arc;

use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::openai::Endpoint;
use crate::state::AppState;
use crate::{admin, forward, request};

/// The router over a built state: the API and the admin API.
pub fn app(state: Arc<AppState>) -> Router {
    api(state, true)
}

/// The API, with the admin routes and the dashboard when `with_admin` (without them when
/// they are served on `server.admin_listen`).
pub fn api(state: Arc<AppState>, with_admin: bool) -> Router {
    let limit = state.config.server.max_body_bytes;
    let router = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/feedback", post(feedback))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics));
    let router = if with_admin {
        router.merge(admin_routes(&state))
    } else {
        router
    };
    crate::trace::with_layers(
        router
            .fallback(fallback)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(limit)),
    )
    .with_state(state)
}

/// The admin API and the dashboard alone, for `server.admin_listen`.
pub fn admin_app(state: Arc<AppState>) -> Router {
    let limit = state.config.server.max_body_bytes;
    crate::trace::with_layers(
        admin_routes(&state)
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(limit)),
    )
    .with_state(state)
}

/// The `/admin` routes ([`crate::admin`]), behind the admin token (checked before anything
/// of the request is read: a caller without one gets 401 whatever it sent), and the
/// dashboard that reads them.
fn admin_routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    let gate = axum::middleware::from_fn_with_state(state.clone(), admin::gate);
    let admin = Router::new()
        .route("/admin/entries", delete(admin::delete_entries))
        .route("/admin/entries/{id}", delete(admin::delete_entry))
        .route(
            "/admin/namespaces/{namespace}",
            delete(admin::delete_namespace),
        )
        .route("/admin/tags/{tag}", delete(admin::delete_tag))
        .route(
            "/admin/policies",
            get(admin::get_policies).put(admin::put_policies),
        )
        .route("/admin/policies/promote", post(admin::promote))
        .route("/admin/explain", post(admin::explain))
        .route("/admin/stats", get(admin::stats))
        .route_layer(gate);
    crate::dashboard::routes().merge(admin)
}

/// A known path asked with a method it does not take: 405 in the OpenAI error shape.
pub(crate) async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    request::handle(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    request::handle(state, Endpoint::Completion, headers, body).await
}

/// Reads a request body once its caller is admitted: at most `limit` bytes (413 beyond, at
/// once when `Content-Length` says so), within `timeout` (408 after: a client trickling its
/// body holds its connection no longer).
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(e)) => {
            let e = e.into_inner();
            if e.is::<http_body_util::LengthLimitError>() {
                Err(ApiError::BodyTooLarge { limit })
            } else {
                Err(ApiError::invalid(
                    format!("could not read the request body: {e}"),
                    None,
                ))
            }
        }
        Err(_) => Err(ApiError::BodyTimeout {
            secs: timeout.as_secs_f64(),
        }),
    }
}

/// `POST /v1/feedback` ([`crate::feedback`]).
async fn feedback(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    match crate::feedback::handle(&state, &headers, body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The configured models; without a list, an upstream's own list.
async fn models(
    State(state): State<Arc<AppState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    let tenant = match state.policies.load().tenants.admit(&headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    // A tenant kept to some models sees those it may use (of those served, when listed).
    let allowed = &tenant.policy().models;
    let listed: Vec<&String> = match allowed.is_empty() {
        // Another tenant's route aliases are its own business.
        true => state
            .models
            .iter()
            .filter(|m| !state.router.alias_of_others(m, tenant.name()))
            .collect(),
        false => allowed
            .iter()
            .filter(|m| state.models.is_empty() || state.models.contains(m))
            .collect(),
    };
    if listed.is_empty() && allowed.is_empty() {
        let (get, empty) = (axum::http::Method::GET, axum::body::Body::empty());
        let asked =
            forward::passthrough_for(&state, Some(tenant.clone()), get, &uri, &headers, empty);
        if let Some(resp) = asked.await {
            return resp;
        }
    }
    let data: Vec<_> = listed
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "reprise"}))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// Liveness: the process answers.
pub async fn healthz() -> &'static str {
    "ok"
}

/// Readiness: started, and some backend up. Its details (backends, Redis's write queue,
/// index rebuilds) are for whoever may read `/metrics`; anybody else reads the status only.
async fn readyz(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if !state.is_ready() {
        return ApiError::NotReady.into_response();
    }
    if crate::admin::may_scrape(&state, &headers).is_err() {
        return Json(json!({"status": "ready"})).into_response();
    }
    // Redis being down degrades the cache, not the service: still ready, and says so.
    let redis = state.store.redis().map(|r| {
        let h = r.health();
        json!({"up": h.up, "breaker_open": h.breaker_open,
               "queued_writes": h.queued_writes, "dropped_writes": h.dropped_writes})
    });
    let rebuilds = state.rebuilds.load(std::sync::atomic::Ordering::Relaxed);
    // One backend down degrades the service (its routes fall back, cache hits are served):
    // still ready while another is up, and says which.
    let backends: serde_json::Map<String, serde_json::Value> = state
        .router
        .readiness()
        .into_iter()
        .map(|(name, up)| (name.to_string(), up.into()))
        .collect();
    Json(
        json!({"status": "ready", "redis": redis, "index_rebuilds": rebuilds,
                "backends": backends}),
    )
    .into_response()
}

async fn metrics(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = crate::admin::may_scrape(&state, &headers) {
        return e.into_response();
    }
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
