//! The one error type the HTTP layer returns, rendered in the OpenAI error shape
//! `{"error":{"message","type","param","code"}}`.
//!
//! 4xx bodies explain what was wrong with the request. 5xx bodies never carry internal
//! detail: the detail goes to the log, the client gets a fixed message.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use reprise_backend::BackendError;
use serde_json::json;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON or does not have the expected shape.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the client.
        message: String,
        /// The offending field, if known.
        param: Option<String>,
    },
    /// The body is larger than `server.max_body_bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The configured limit.
        limit: usize,
    },
    /// The model is not served here.
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// A request header has a bad value.
    #[error("invalid value for header `{header}`: {reason}")]
    BadHeader {
        /// Header name.
        header: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A known path asked with a method it does not take.
    #[error("this endpoint does not take that method")]
    MethodNotAllowed,
    /// The client did not send its whole body within `server.body_timeout_secs`.
    #[error("the request body did not arrive within {secs} seconds")]
    BodyTimeout {
        /// The limit.
        secs: f64,
    },
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The request took longer than the configured timeout.
    #[error("the request timed out")]
    Timeout,
    /// `Cache-Control: only-if-cached` and nothing cached answers the request.
    #[error("no cached answer for this request")]
    NotCached,
    /// The backend or models are still loading.
    #[error("the server is not ready")]
    NotReady,
    /// A store the request needs (Redis, for shared records) cannot be reached now: retry.
    #[error("{0}")]
    Unavailable(String),
    /// The embedder's queue stayed full: the semantic lookup this request needed could not run.
    #[error("the server is overloaded; retry in {retry_after_secs} s")]
    Overloaded {
        /// Seconds until a retry may find room.
        retry_after_secs: u64,
    },
    /// An admin endpoint was called without the right token.
    #[error("unauthorized")]
    Unauthorized,
    /// `/v1` needs a known API key (`[auth] required`) and the request had none.
    #[error("incorrect or missing API key")]
    InvalidApiKey,
    /// The caller's key does not allow what the request asks for.
    #[error("{0}")]
    Forbidden(String),
    /// A change made against a version (`If-Match`) that is no longer the running one.
    #[error("{0}")]
    PreconditionFailed(String),
    /// The caller's tenant sent more requests than its policy allows.
    #[error("rate limit reached; retry in {retry_after_secs} s")]
    RateLimited {
        /// Seconds until a request is allowed again.
        retry_after_secs: u64,
    },
    /// What the request names does not exist (or is not the caller's).
    #[error("{message}")]
    NotFound {
        /// What was not found, for the client.
        message: String,
        /// The field that named it.
        param: Option<&'static str>,
    },
    /// Something that should not happen; the detail is logged, never sent.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// Shorthand for an invalid request about one field.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    /// Low-cardinality label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::InvalidRequest { .. } => "invalid_request",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::UnknownModel(_) => "unknown_model",
            ApiError::BadHeader { .. } => "bad_header",
            ApiError::Backend(e) => e.kind(),
            ApiError::Timeout => "timeout",
            ApiError::BodyTimeout { .. } => "body_timeout",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::NotCached => "not_cached",
            ApiError::NotReady => "not_ready",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::Unauthorized => "unauthorized",
            ApiError::InvalidApiKey => "invalid_api_key",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::PreconditionFailed(_) => "precondition_failed",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::NotFound { .. } => "not_found",
            ApiError::Internal(_) => "internal",
        }
    }

    /// HTTP status for this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::BadHeader { .. } => StatusCode::BAD_REQUEST,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::UnknownModel(_) | ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::Timeout | ApiError::NotCached => StatusCode::GATEWAY_TIMEOUT,
            ApiError::NotReady | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unauthorized | ApiError::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::PreconditionFailed(_) => StatusCode::PRECONDITION_FAILED,
            // Like a full backend queue: a capacity limit, retried after `Retry-After`.
            ApiError::RateLimited { .. } | ApiError::Overloaded { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Backend(e) => match e {
                BackendError::Unavailable(_) | BackendError::Internal(_) => StatusCode::BAD_GATEWAY,
                BackendError::Timeout => StatusCode::GATEWAY_TIMEOUT,
                BackendError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
                BackendError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
                BackendError::UnknownModel(_) => StatusCode::NOT_FOUND,
            },
        }
    }

    /// The OpenAI error object: `(message, type, param, code)`. Server-side failures get a
    /// fixed message so no internal detail leaks.
    pub fn body(&self) -> serde_json::Value {
        let (message, kind, param, code): (String, &str, Option<String>, Option<&str>) = match self
        {
            ApiError::InvalidRequest { message, param } => (
                message.clone(),
                "invalid_request_error",
                param.clone(),
                None,
            ),
            ApiError::BodyTooLarge { .. } => (
                self.to_string(),
                "invalid_request_error",
                None,
                Some("request_too_large"),
            ),
            ApiError::UnknownModel(_) => (
                self.to_string(),
                "invalid_request_error",
                Some("model".into()),
                Some("model_not_found"),
            ),
            ApiError::BadHeader { header, .. } => (
                self.to_string(),
                "invalid_request_error",
                Some((*header).into()),
                None,
            ),
            ApiError::BodyTimeout { .. } => (
                self.to_string(),
                "invalid_request_error",
                None,
                Some("request_timeout"),
            ),
            ApiError::MethodNotAllowed => (
                self.to_string(),
                "invalid_request_error",
                None,
                Some("method_not_allowed"),
            ),
            ApiError::Timeout => (
                "the request timed out waiting for the model".into(),
                "server_error",
                None,
                Some("timeout"),
            ),
            ApiError::NotCached => (
                self.to_string(),
                "invalid_request_error",
                None,
                Some("not_cached"),
            ),
            ApiError::NotReady => (
                "the server is still loading; retry shortly".into(),
                "server_error",
                None,
                Some("not_ready"),
            ),
            ApiError::Unavailable(m) => (m.clone(), "server_error", None, Some("unavailable")),
            ApiError::Unauthorized => (
                "missing or invalid admin token".into(),
                "invalid_request_error",
                None,
                Some("unauthorized"),
            ),
            ApiError::InvalidApiKey => (
                "Incorrect or missing API key: send `Authorization: Bearer <key>` with a key \
                 configured for a tenant"
                    .into(),
                "invalid_request_error",
                None,
                Some("invalid_api_key"),
            ),
            ApiError::Forbidden(m) => (
                m.clone(),
                "invalid_request_error",
                None,
                Some("permission_denied"),
            ),
            ApiError::PreconditionFailed(m) => (
                m.clone(),
                "invalid_request_error",
                Some("If-Match".into()),
                Some("version_mismatch"),
            ),
            ApiError::Overloaded { .. } => (
                self.to_string(),
                "rate_limit_error",
                None,
                Some("overloaded"),
            ),
            ApiError::RateLimited { .. } => (
                self.to_string(),
                "rate_limit_error",
                None,
                Some("rate_limit_exceeded"),
            ),
            ApiError::NotFound { message, param } => (
                message.clone(),
                "invalid_request_error",
                param.map(str::to_string),
                Some("not_found"),
            ),
            ApiError::Internal(_) => ("internal server error".into(), "server_error", None, None),
            ApiError::Backend(e) => match e {
                BackendError::Unavailable(_) | BackendError::Internal(_) => (
                    "the model backend failed to answer".into(),
                    "server_error",
                    None,
                    Some("upstream_error"),
                ),
                BackendError::Timeout => (
                    "the model backend timed out".into(),
                    "server_error",
                    None,
                    Some("timeout"),
                ),
                BackendError::Overloaded { .. } => (
                    "the model backend is overloaded; retry later".into(),
                    "rate_limit_error",
                    None,
                    Some("rate_limit_exceeded"),
                ),
                BackendError::InvalidRequest { message, param } => (
                    message.clone(),
                    "invalid_request_error",
                    param.clone(),
                    None,
                ),
                BackendError::UnknownModel(m) => (
                    format!("the model `{m}` does not exist"),
                    "invalid_request_error",
                    Some("model".into()),
                    Some("model_not_found"),
                ),
            },
        };
        json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        // A 504 for `only-if-cached` is the answer the client asked for, not a failure.
        if status.is_server_error() && !matches!(self, ApiError::NotCached) {
            tracing::warn!(error = %self, kind = self.kind(), "request failed");
        }
        let mut resp = (status, axum::Json(self.body())).into_response();
        if let ApiError::Backend(BackendError::Overloaded { retry_after_secs }) = &self {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs.max(&1).to_owned()),
            );
        }
        if let ApiError::RateLimited { retry_after_secs }
        | ApiError::Overloaded { retry_after_secs } = &self
        {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after_secs));
        }
        if let ApiError::NotReady | ApiError::Unavailable(_) = &self {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_errors_do_not_leak_detail() {
        let e = ApiError::Backend(BackendError::Unavailable(
            "connect 10.1.2.3:443 refused".into(),
        ));
        assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
        let body = e.body().to_string();
        assert!(!body.contains("10.1.2.3"), "{body}");
        let e = ApiError::Internal("secret path /etc/x".into());
        assert!(!e.body().to_string().contains("/etc/x"));
    }

    #[test]
    fn overload_sets_retry_after() {
        let resp = ApiError::Backend(BackendError::Overloaded {
            retry_after_secs: 2,
        })
        .into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "2");
    }
}
