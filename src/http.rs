//! Routes: the OpenAI endpoints, models, health, readiness and metrics.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::error::ApiError;
use crate::openai::Endpoint;
use crate::pipeline;
use crate::state::AppState;

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
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    pipeline::handle(state, Endpoint::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    pipeline::handle(state, Endpoint::Completion, headers, body).await
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let data: Vec<_> = state
        .models
        .iter()
        .map(|m| json!({"id": m, "object": "model", "created": 0, "owned_by": "reprise"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// Liveness: the process answers.
pub async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.is_ready() {
        Json(json!({"status": "ready"})).into_response()
    } else {
        ApiError::NotReady.into_response()
    }
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

async fn not_found() -> Response {
    let body = json!({"error": {
        "message": "unknown endpoint",
        "type": "invalid_request_error",
        "param": null,
        "code": "not_found",
    }});
    (StatusCode::NOT_FOUND, Json(body)).into_response()
}
