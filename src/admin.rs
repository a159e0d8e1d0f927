//! The operators' API under `/admin`: invalidation, live policies, explain.
//!
//! Two kinds of token open it (`Authorization: Bearer <token>`): the global admin token
//! (`server.admin_token_env`) reaches everything; a tenant's admin token
//! (`[[tenants]] admin_token_env`) reaches only that tenant: its entries, namespaces and
//! tags, and explain as that tenant; never the policies. Tokens are compared as digests in
//! constant time, so a guess learns neither how much of it was right nor the token's length.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::Json;
use serde_json::json;

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::openai::Endpoint;
use crate::request;
use crate::state::AppState;

/// Who an admin call comes from.
pub enum Admin {
    /// The global admin token: everything.
    Global,
    /// A tenant's admin token: that tenant only.
    Tenant(Arc<Tenant>),
}

/// Whether `a` and `b` are equal, in time independent of both (digests of one length).
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (blake3::hash(a.as_bytes()), blake3::hash(b.as_bytes()));
    bool::from(subtle::ConstantTimeEq::ct_eq(
        a.as_bytes().as_slice(),
        b.as_bytes().as_slice(),
    ))
}

/// The admin the request's bearer token names, or 401.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<Admin, ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|t| !t.is_empty())
        .ok_or(ApiError::Unauthorized)?;
    let global = state
        .config
        .server
        .admin_token_env
        .as_ref()
        .and_then(|var| std::env::var(var).ok())
        .filter(|t| !t.is_empty());
    if global.is_some_and(|expected| same_secret(given, &expected)) {
        return Ok(Admin::Global);
    }
    state
        .policies
        .load()
        .tenants
        .by_admin_token(given)
        .map(Admin::Tenant)
        .ok_or(ApiError::Unauthorized)
}

/// Only the global admin.
fn global_only(admin: &Admin) -> Result<(), ApiError> {
    match admin {
        Admin::Global => Ok(()),
        Admin::Tenant(_) => Err(ApiError::Forbidden(
            "a tenant's admin token does not reach the policies".into(),
        )),
    }
}

fn redis_error(e: reprise_cache::redis::RedisError) -> ApiError {
    ApiError::Internal(format!("redis: {e}"))
}

/// `DELETE /admin/entries/{id}`: everywhere; a tenant's admin only reaches its own entries
/// (another tenant's entry counts as not found).
pub async fn delete_entry(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    let id: reprise_cache::EntryId = id
        .parse()
        .map_err(|_| ApiError::invalid("not an entry id", Some("id")))?;
    if let Admin::Tenant(t) = &admin {
        let Some(entry) = state.store.fetch(id).await else {
            return Ok(Json(json!({"deleted": 0})));
        };
        if crate::auth::scope_of(&entry.namespace) != t.name() {
            return Ok(Json(json!({"deleted": 0})));
        }
    }
    let deleted = state.store.delete(id).await.map_err(redis_error)?;
    Ok(Json(json!({"deleted": u64::from(deleted)})))
}

/// `?tenant=NAME` of `DELETE /admin/namespaces/{namespace}`.
#[derive(serde::Deserialize)]
pub struct TenantQuery {
    /// The namespace is one of this configured tenant's (none: the anonymous tenant's).
    tenant: Option<String>,
}

/// `DELETE /admin/namespaces/{namespace}[?tenant=NAME]`: every entry of one namespace; a
/// tenant's admin names a namespace of its own tenant.
pub async fn delete_namespace(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
    Query(q): Query<TenantQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    let tenant = match (&admin, q.tenant) {
        (Admin::Global, t) => t,
        (Admin::Tenant(t), None) => Some(t.name().to_string()),
        (Admin::Tenant(t), Some(named)) if named == t.name() => Some(named),
        (Admin::Tenant(_), Some(_)) => {
            return Err(ApiError::Forbidden(
                "a tenant's admin token reaches only its own tenant".into(),
            ))
        }
    };
    let namespace = match &tenant {
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

/// `DELETE /admin/tags/{tag}`: every entry stored with the tag; a tenant's admin deletes
/// only its own tenant's (those this replica holds, each everywhere).
pub async fn delete_tag(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(tag): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let deleted = match authorize(&state, &headers)? {
        Admin::Global => state.store.delete_tag(&tag).await.map_err(redis_error)?,
        Admin::Tenant(t) => {
            let mut n = 0;
            for e in state.store.entries() {
                if crate::auth::scope_of(&e.namespace) == t.name() && e.tags.contains(&tag) {
                    n += u64::from(state.store.delete(e.id).await.map_err(redis_error)?);
                }
            }
            n
        }
    };
    Ok(Json(json!({"deleted": deleted})))
}

/// `?tenant=NAME&endpoint=completions` of `POST /admin/explain`.
#[derive(serde::Deserialize)]
pub struct ExplainQuery {
    /// The configured tenant asking (none: the anonymous tenant).
    tenant: Option<String>,
    /// `chat` (default) or `completions`.
    endpoint: Option<String>,
}

/// `POST /admin/explain`: what a request body (with its namespace, Cache-Control and
/// threshold headers) would be answered with, and why; nothing is generated. A tenant's
/// admin explains as its own tenant.
pub async fn explain(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<ExplainQuery>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let tenant = match authorize(&state, &headers)? {
        Admin::Global => q.tenant,
        Admin::Tenant(t) => Some(t.name().to_string()),
    };
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
        request::explain::explain(&state, endpoint, tenant.as_deref(), &headers, &body).await?;
    Ok(Json(view))
}

/// `GET /admin/policies`: the live policies, their version, and the tenants (how many keys
/// each, never the keys). Global admin only.
pub async fn get_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    global_only(&authorize(&state, &headers)?)?;
    Ok(Json(state.policies.load().view()))
}

/// `PUT /admin/policies`: applies a policy document (TOML: `[semantic]` policy keys,
/// `[auth]`, `[[tenants]]`); 400 with the reason when it is invalid (the running policies
/// stay), else the new version. Global admin only.
pub async fn put_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    global_only(&authorize(&state, &headers)?)?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::invalid("the policy document is not UTF-8", None))?;
    let doc = crate::policy::PolicyDocument::from_toml(text)
        .map_err(|e| ApiError::invalid(format!("invalid policy document: {e}"), None))?;
    let version = crate::policy::apply(&state, doc)
        .map_err(|e| ApiError::invalid(format!("policy refused: {e:#}"), None))?;
    Ok(Json(json!({"version": version})))
}
