//! The operators' API under `/admin`: invalidation, live policies, explain, stats.
//!
//! Two kinds of token open it (`Authorization: Bearer <token>`): the global admin token
//! (`server.admin_token_env`) reaches everything; a tenant's admin token
//! (`[[tenants]] admin_token_env`) reaches only that tenant: its entries, namespaces and
//! tags, and explain as that tenant; never the policies. Tokens are compared as digests in
//! constant time, so a guess learns neither how much of it was right nor the token's length.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
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

/// The digest a secret is compared by: of one length whatever the secret's.
pub fn secret_digest(secret: &str) -> blake3::Hash {
    blake3::hash(secret.as_bytes())
}

/// Whether two secret digests are equal, in time independent of both.
pub fn same_digest(a: &blake3::Hash, b: &blake3::Hash) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(
        a.as_bytes().as_slice(),
        b.as_bytes().as_slice(),
    ))
}

/// Changes (any request but a read) a tenant's admin may make a minute, in bursts of up to
/// as many: each delete fences or marks what it deleted on every replica, and a filtered or
/// tag delete scans every entry, so one tenant's loop of them would push other tenants'
/// fences out and load every replica. The global admin is not held to it.
pub const TENANT_CHANGES_PER_MINUTE: u32 = 120;

/// The limiter of tenant admins' changes.
pub fn tenant_changes_limiter() -> governor::DefaultKeyedRateLimiter<String> {
    let per_minute = std::num::NonZeroU32::new(TENANT_CHANGES_PER_MINUTE).expect("not zero");
    governor::RateLimiter::keyed(governor::Quota::per_minute(per_minute))
}

/// Middleware of every `/admin` route: a caller without a valid admin token gets 401
/// before its path, query or body is read (the handlers then find its scope again); a
/// tenant's admin past [`TENANT_CHANGES_PER_MINUTE`] changes gets 429 with `Retry-After`.
pub async fn gate(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let admin = match authorize(&state, req.headers()) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    // `POST /admin/explain` reads, with a body.
    let reads = matches!(*req.method(), Method::GET | Method::HEAD)
        || req.uri().path().trim_end_matches('/') == "/admin/explain";
    if let (Admin::Tenant(t), false) = (&admin, reads) {
        if let Err(not_until) = state.admin_changes.check_key(&t.name().to_string()) {
            use governor::clock::Clock;
            let wait = not_until.wait_time_from(state.admin_changes.clock().now());
            let retry_after_secs = wait.as_secs() + 1;
            return ApiError::RateLimited { retry_after_secs }.into_response();
        }
    }
    next.run(req).await
}

/// Filtered deletes running at once: each scans every entry this replica holds and every
/// entry Redis keeps, so two at once would only share the same reads. The global admin's
/// and the tenants' admins' have a slot each, so that tenants cannot keep the operator
/// waiting; a delete that finds its slot taken gets 429 with `Retry-After`.
#[derive(Debug)]
pub struct Scans {
    global: tokio::sync::Semaphore,
    tenants: tokio::sync::Semaphore,
}

impl Default for Scans {
    fn default() -> Self {
        Scans {
            global: tokio::sync::Semaphore::new(1),
            tenants: tokio::sync::Semaphore::new(1),
        }
    }
}

/// What a filtered delete (`DELETE /admin/entries`) selects: every field given must match.
/// The same on the replica that runs it and on those it tells
/// ([`reprise_cache::redis::ReplicationEvent::DeleteWhere`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// The tenant whose entries are selected (empty: the anonymous tenant's).
    pub tenant: Option<String>,
    /// The model whose entries are selected.
    pub model: Option<String>,
    /// Entries created at or before this time (Unix milliseconds) are selected.
    pub created_until_ms: Option<u64>,
}

impl Selection {
    /// What it selects, as the store's fence of a filtered delete takes it.
    pub fn delete_filter(&self) -> reprise_cache::DeleteFilter {
        let selection = self.clone();
        Arc::new(move |e| selection.matches(e))
    }

    /// Whether the filter selects `e`.
    pub fn matches(&self, e: &reprise_cache::Entry) -> bool {
        self.tenant
            .as_deref()
            .is_none_or(|t| crate::auth::scope_of(&e.namespace) == t)
            && self.model.as_deref().is_none_or(|m| e.model == m)
            && self.created_until_ms.is_none_or(|u| e.created_ms <= u)
    }
}

/// Seconds a filtered delete that found its slot taken is told to wait.
const SCAN_RETRY_SECS: u64 = 5;

impl Scans {
    /// The slot of `admin`'s filtered delete, held while it runs.
    pub fn take(&self, admin: &Admin) -> Result<tokio::sync::SemaphorePermit<'_>, ApiError> {
        let slot = match admin {
            Admin::Global => &self.global,
            Admin::Tenant(_) => &self.tenants,
        };
        slot.try_acquire().map_err(|_| ApiError::RateLimited {
            retry_after_secs: SCAN_RETRY_SECS,
        })
    }
}

/// A query string as `T`; a bad one is a 400 in the OpenAI error shape, and so is an
/// unknown parameter (the admin queries deny them: a misspelt filter must not widen a
/// delete).
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::invalid(e.body_text(), None)),
        }
    }
}

/// The query of a call that takes no parameter: any is a 400 (`DELETE
/// /admin/tags/t?tenant=acme` must not delete the tag of every tenant).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoQuery {}

/// A path parameter as `T`; a bad one is a 400 in the OpenAI error shape.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::invalid(e.body_text(), None)),
        }
    }
}

/// An admin request's body, read after the token was checked, within the body limits.
async fn admin_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    let server = &state.config.server;
    crate::http::read_body(headers, body, server.max_body_bytes, server.body_timeout()).await
}

/// The admin the request's bearer token names, or 401.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<Admin, ApiError> {
    let given = bearer(headers).ok_or(ApiError::Unauthorized)?;
    let global = configured_secret(&state.config.server.admin_token_env);
    let given = secret_digest(given);
    if global.is_some_and(|expected| same_digest(&given, &secret_digest(&expected))) {
        return Ok(Admin::Global);
    }
    state
        .policies
        .load()
        .tenants
        .by_admin_token(&given)
        .map(Admin::Tenant)
        .ok_or(ApiError::Unauthorized)
}

/// Whether the request may read `/metrics`: with a metrics token configured, its bearer
/// token is that one or the global admin's; without one, anybody where no tenants are
/// configured, and the global admin only where they are (a tenant's series are not for
/// another tenant's key). Fails closed: a token named but unset opens nothing.
pub fn may_scrape(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let server = &state.config.server;
    let open = server.metrics_token_env.is_none()
        && state.config.tenants.is_empty()
        && state.policies.load().tenants.is_empty();
    if open {
        return Ok(());
    }
    let given = bearer(headers).ok_or(ApiError::Unauthorized)?;
    let given = secret_digest(given);
    let allowed = [
        configured_secret(&server.metrics_token_env),
        configured_secret(&server.admin_token_env),
    ];
    match allowed
        .iter()
        .flatten()
        .any(|t| same_digest(&given, &secret_digest(t)))
    {
        true => Ok(()),
        false => Err(ApiError::Unauthorized),
    }
}

/// The secret held by the environment variable a setting names, when it names one that is
/// set and not empty (none otherwise: nothing is opened by an unset secret).
pub fn configured_secret(var: &Option<String>) -> Option<String> {
    var.as_ref()
        .and_then(|v| std::env::var(v).ok())
        .filter(|t| !t.is_empty())
}

/// The request's bearer token, when it has a non-empty one.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|t| !t.is_empty())
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

/// The tenant an admin call is about: the one it `asked` for, or for a tenant's admin its
/// own (asking for another is 403).
fn tenant_scope(admin: &Admin, asked: Option<String>) -> Result<Option<String>, ApiError> {
    match (admin, asked) {
        (Admin::Global, t) => Ok(t),
        (Admin::Tenant(t), None) => Ok(Some(t.name().to_string())),
        (Admin::Tenant(t), Some(named)) if named == t.name() => Ok(Some(named)),
        (Admin::Tenant(_), Some(_)) => Err(ApiError::Forbidden(
            "a tenant's admin token reaches only its own tenant".into(),
        )),
    }
}

/// A Redis failure as the admin API's answer: one that may pass (down, its breaker open, a
/// timeout) is a 503 with `Retry-After` (every change here may be sent again as it was);
/// any other a 500.
fn redis_error(e: reprise_cache::redis::RedisError) -> ApiError {
    use reprise_cache::redis::RedisError as E;
    match e {
        E::Unavailable | E::Timeout | E::Connection(_) => ApiError::Unavailable(
            "the shared cache (Redis) cannot be reached; nothing is lost by sending it again"
                .into(),
        ),
        e => ApiError::Internal(format!("redis: {e}")),
    }
}

/// `DELETE /admin/entries/{id}`: everywhere; a tenant's admin only reaches its own entries
/// (another tenant's entry counts as not found). An id no tier holds is marked deleted all
/// the same, for any admin: the answer it names may still be generating (its id is
/// announced with the first byte), and is then never stored.
pub async fn delete_entry(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    _: ApiQuery<NoQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    let id: reprise_cache::EntryId = id
        .parse()
        .map_err(|_| ApiError::invalid("not an entry id", Some("id")))?;
    if let Admin::Tenant(t) = &admin {
        // Expired entries kept for stale answers are the tenant's to delete too. Redis not
        // answering is an error, not a "not found" (the entry may be there).
        let held = state.store.get_kept(id).await.map_err(redis_error)?;
        if held
            .as_ref()
            .is_some_and(|e| crate::auth::scope_of(&e.namespace) != t.name())
        {
            return Ok(Json(json!({"deleted": 0})));
        }
        // Held by Redis but not readable (over `max_value_bytes`, undecodable): whose it is
        // cannot be told, so it is not this tenant's to delete. (An id no tier holds is
        // marked deleted: an answer still being generated, announced by its id.)
        if let Some(redis) = state.store.redis().filter(|_| held.is_none()) {
            let there = redis.exists_many(&[id]).await.map_err(redis_error)?;
            if there.first() == Some(&true) {
                return Ok(Json(json!({"deleted": 0})));
            }
        }
    }
    let deleted = state.store.delete(id).await.map_err(redis_error)?;
    Ok(deleted_json(&state, u64::from(deleted)))
}

/// The answer to a delete of `n` entries. Deletions ask for a snapshot at once: without
/// Redis, a crash before the next periodic one would bring them back at the restart.
fn deleted_json(state: &AppState, n: u64) -> Json<serde_json::Value> {
    if n > 0 {
        state.snapshot_wanted.notify_one();
    }
    Json(json!({"deleted": n}))
}

/// The filters of `DELETE /admin/entries`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntryFilter {
    /// Entries of this configured tenant (`-`: the anonymous tenant's).
    tenant: Option<String>,
    /// Entries generated by this model.
    model: Option<String>,
    /// Entries at least this many seconds old (0: every entry).
    older_than_secs: Option<u64>,
}

/// `DELETE /admin/entries?tenant=&model=&older_than_secs=`: every entry matching all the
/// filters given (at least one), each deleted everywhere; entries are found among those
/// this replica holds and those Redis keeps. A tenant's admin deletes only its own.
pub async fn delete_entries(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiQuery(f): ApiQuery<EntryFilter>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    if f.tenant.is_none() && f.model.is_none() && f.older_than_secs.is_none() {
        return Err(ApiError::invalid(
            "name at least one of `tenant`, `model`, `older_than_secs`",
            None,
        ));
    }
    let _scan = state.admin_scans.take(&admin)?;
    let tenant = match tenant_scope(&admin, f.tenant)? {
        Some(t) if t == "-" => Some(String::new()),
        t => t,
    };
    let now = reprise_cache::now_ms();
    let selection = Selection {
        tenant,
        model: f.model,
        created_until_ms: f
            .older_than_secs
            .map(|s| now.saturating_sub(s.saturating_mul(1000))),
    };
    // The other replicas first: they fence what it selects (answers being generated there
    // are not stored after it) and drop what they hold of it, answers whose puts never
    // reached Redis included (which the scan below cannot find). Then this replica's fence
    // (a delete Redis refused to announce fences nothing here either).
    if let Some(redis) = state.store.redis() {
        redis
            .announce_delete_where(
                selection.tenant.as_deref(),
                selection.model.as_deref(),
                selection.created_until_ms,
            )
            .await
            .map_err(redis_error)?;
    }
    state.store.fence_where(selection.delete_filter());
    let deleted = state
        .store
        .delete_where(|e| selection.matches(e))
        .await
        .map_err(redis_error)?;
    Ok(deleted_json(&state, deleted))
}

/// A name an admin request gives (a namespace, a tag): 1 to `longest` bytes, as the request
/// path allows, else a 400 naming `param`.
fn within(param: &'static str, name: &str, longest: usize) -> Result<(), ApiError> {
    if name.is_empty() || name.len() > longest {
        return Err(ApiError::invalid(
            format!("a {param} is 1 to {longest} bytes"),
            Some(param),
        ));
    }
    Ok(())
}

/// `?tenant=NAME` of `DELETE /admin/namespaces/{namespace}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantQuery {
    /// The namespace is one of this configured tenant's (none: the anonymous tenant's).
    tenant: Option<String>,
}

/// `DELETE /admin/namespaces/{namespace}[?tenant=NAME]`: every entry of one namespace; a
/// tenant's admin names a namespace of its own tenant.
pub async fn delete_namespace(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiPath(namespace): ApiPath<String>,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    let tenant = tenant_scope(&admin, q.tenant)?;
    // A tenant's namespace as its clients name it; the global admin may name one scoped to
    // a tenant (its name, the separator, the namespace). Longer names match no entry, and
    // each delete fences its name on every replica for a while.
    let longest = match &tenant {
        Some(_) => request::MAX_NAMESPACE_BYTES,
        None => crate::auth::MAX_TENANT_NAME_BYTES + 1 + request::MAX_NAMESPACE_BYTES,
    };
    within("namespace", &namespace, longest)?;
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
    Ok(deleted_json(&state, deleted))
}

/// `DELETE /admin/tags/{tag}`: every entry stored with the tag; a tenant's admin deletes
/// only its own tenant's (those this replica holds and those Redis keeps, each everywhere).
pub async fn delete_tag(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiPath(tag): ApiPath<String>,
    _: ApiQuery<NoQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let admin = authorize(&state, &headers)?;
    within("tag", &tag, request::MAX_TAG_BYTES)?;
    // A tenant's tag delete scans every entry (the global one reads the tag's index set).
    let _scan = match admin {
        Admin::Tenant(_) => Some(state.admin_scans.take(&admin)?),
        Admin::Global => None,
    };
    let deleted = match admin {
        Admin::Global => state.store.delete_tag(&tag).await.map_err(redis_error)?,
        Admin::Tenant(t) => {
            // Answers of the tenant on their way with the tag are not stored after it, here
            // and (told first) on every replica, which drops what it holds with the tag.
            let prefix = crate::auth::scope(t.name(), "");
            if let Some(redis) = state.store.redis() {
                redis
                    .announce_tag_within(&prefix, &tag)
                    .await
                    .map_err(redis_error)?;
            }
            state.store.fence_tag_within(&prefix, &tag);
            // Each entry by id (here and in Redis, marked there against late puts).
            state
                .store
                .delete_where(|e| {
                    crate::auth::scope_of(&e.namespace) == t.name() && e.tags.contains(&tag)
                })
                .await
                .map_err(redis_error)?
        }
    };
    Ok(deleted_json(&state, deleted))
}

/// `?tenant=NAME&endpoint=completions` of `POST /admin/explain`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
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
    ApiQuery(q): ApiQuery<ExplainQuery>,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    let tenant = tenant_scope(&authorize(&state, &headers)?, q.tenant)?;
    let body = admin_body(&state, &headers, body).await?;
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

/// `?minutes=N&tenant=NAME` of `GET /admin/stats`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsQuery {
    /// Minutes back from now (default 60; at most the span of `[stats] intervals`). Read as
    /// text so that a bad value gets the OpenAI error shape.
    minutes: Option<String>,
    /// One tenant's requests (`anonymous`: those without a tenant).
    tenant: Option<String>,
}

/// `GET /admin/stats?minutes=N&tenant=NAME`: requests, hits, latency, savings and prefetch per
/// interval, merged across replicas ([`crate::stats`]); a tenant's admin sees only its own
/// tenant's.
pub async fn stats(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<StatsQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let tenant = tenant_scope(&authorize(&state, &headers)?, q.tenant)?;
    crate::stats::view(&state, q.minutes.as_deref(), tenant.as_deref())
        .await
        .map(Json)
}

/// `GET /admin/policies`: the live policies, their version, and the tenants (how many keys
/// each, never the keys). Global admin only.
pub async fn get_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
) -> Result<impl IntoResponse, ApiError> {
    global_only(&authorize(&state, &headers)?)?;
    let policies = state.policies.load();
    let mut view = policies.view();
    view["rollbacks"] = state.rollbacks.lock().iter().cloned().collect();
    // The version as an entity tag, for `If-Match` on the next `PUT`.
    let etag = [(
        axum::http::header::ETAG,
        format!("\"{}\"", policies.version),
    )];
    Ok((etag, Json(view)))
}

/// `POST /admin/policies/promote?tenant=NAME`: the tenant's candidate policy becomes its
/// policy (a policy change like `PUT`, shared likewise); 400 when it has none. Global admin
/// only.
pub async fn promote(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<TenantQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    global_only(&authorize(&state, &headers)?)?;
    let tenant = q
        .tenant
        .ok_or_else(|| ApiError::invalid("`tenant` is required", Some("tenant")))?;
    // Checked first for a clear answer; computed again under the change lock.
    state
        .policies
        .load()
        .promoting(&tenant)
        .map_err(|e| ApiError::invalid(e, Some("tenant")))?;
    let change =
        move |p: &crate::policy::Policies| p.promoting(&tenant).map_err(|e| anyhow::anyhow!(e));
    let applied = crate::policy::apply_change(&state, &change)
        .await
        .map_err(|e| ApiError::invalid(format!("policy refused: {e:#}"), None))?;
    Ok(Json(
        json!({"version": applied.version, "shared": applied.shared}),
    ))
}

/// `PUT /admin/policies`: applies a policy document (TOML: `[semantic]` policy keys,
/// `[auth]`, `[[tenants]]`); 400 with the reason when it is invalid (the running policies
/// stay), else the new version and whether it was `shared` with the other replicas through
/// Redis (false without Redis, or when Redis could not be reached: the change then holds on
/// this replica only). Global admin only.
pub async fn put_policies(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    _: ApiQuery<NoQuery>,
    body: Body,
) -> Result<Json<serde_json::Value>, ApiError> {
    global_only(&authorize(&state, &headers)?)?;
    let body = admin_body(&state, &headers, body).await?;
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::invalid("the policy document is not UTF-8", None))?;
    let doc = crate::policy::PolicyDocument::from_toml(text)
        .map_err(|e| ApiError::invalid(format!("invalid policy document: {e}"), None))?;
    let applied = match if_match(&headers)? {
        None => crate::policy::apply(&state, doc).await,
        // Only over the version the caller read: a rollback, a promotion or another
        // operator's change since then is not undone by a document written before it.
        Some(expected) => {
            let change = move |p: &crate::policy::Policies| {
                anyhow::ensure!(
                    p.version == expected,
                    VersionMismatch {
                        expected,
                        running: p.version
                    }
                );
                Ok(doc.clone())
            };
            crate::policy::apply_change(&state, &change).await
        }
    };
    let applied = applied.map_err(|e| match e.downcast_ref::<VersionMismatch>() {
        Some(m) => ApiError::PreconditionFailed(m.to_string()),
        None => ApiError::invalid(format!("policy refused: {e:#}"), None),
    })?;
    Ok(Json(
        json!({"version": applied.version, "shared": applied.shared}),
    ))
}

/// A policy change made against a version that is no longer the running one.
#[derive(Debug, thiserror::Error)]
#[error("the policies are at version {running}, not {expected}: read them again and retry")]
struct VersionMismatch {
    expected: u64,
    running: u64,
}

/// The version an `If-Match` header names (`3`, `"3"` or `W/"3"`), if one is sent; `*`
/// (any version: the policies always exist) names none.
fn if_match(headers: &HeaderMap) -> Result<Option<u64>, ApiError> {
    let Some(v) = headers.get(axum::http::header::IF_MATCH) else {
        return Ok(None);
    };
    let bad = || ApiError::BadHeader {
        header: "If-Match",
        reason: "expected a policy version, such as \"3\"".into(),
    };
    let text = v.to_str().map_err(|_| bad())?.trim();
    if text == "*" {
        return Ok(None);
    }
    let text = text.strip_prefix("W/").unwrap_or(text).trim_matches('"');
    text.parse().map(Some).map_err(|_| bad())
}
