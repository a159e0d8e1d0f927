//! `POST /admin/explain`: the request path up to the lookup, without the backend and without
//! changing anything a client sees: what would be served for a request and why (exact key,
//! partition, the semantic policy applied, every candidate with its similarity and verdict).

use std::sync::Arc;

use axum::http::HeaderMap;
use serde_json::{json, Value};

use crate::candidate::Arm;
use crate::error::ApiError;
use crate::lookup::{self, semantic, Wants};
use crate::openai::Endpoint;
use crate::request::{parse, policy, Controls, Request};
use crate::state::AppState;

/// What `body`, sent to `endpoint` by `tenant` (a configured name; none: the anonymous
/// tenant) with `headers` (namespace, Cache-Control, threshold), would be answered with.
pub async fn explain(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    tenant: Option<&str>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Value, ApiError> {
    let policies = state.policies.load_full();
    let tenant = match tenant {
        Some(name) => policies.tenants.named(name).ok_or_else(|| {
            ApiError::invalid(format!("no tenant `{name}` is configured"), Some("tenant"))
        })?,
        None => policies.tenants.anonymous(),
    };
    let mut parsed = match parse(endpoint, body)? {
        Request::Cacheable(p) => p,
        Request::Forward(f) => {
            return Ok(json!({
                "tenant": tenant.name(),
                "would_serve": {"outcome": "forward", "because": f.param},
            }))
        }
    };
    let ctl = Controls::from_headers(headers, &tenant)?;
    // Looked up as the model its route serves it as, as the request path does.
    let input = &parsed.req.input;
    let chars = || crate::routes::prompt_chars(input);
    let (backend, own_default) = match state.router.choose(&parsed.req.model, tenant.name(), chars)
    {
        Some(choice) => {
            parsed.req.model = choice.model;
            let own_default = choice.primary.backend.default_max_tokens();
            (Some(choice.primary.name.clone()), own_default)
        }
        None => (None, None),
    };
    policy::cap_max_tokens(state, &tenant, &mut parsed.req, own_default)?;
    let access = policy::access(state, &tenant, &ctl);
    let stale = policy::stale_windows(state, &tenant, &ctl);
    let wants = Wants {
        threshold: ctl.threshold,
        freshness: ctl.cache.freshness(),
        arm: Arm::Current,
        stale,
    };
    let req = &parsed.req;
    let ask = lookup::Ask {
        namespace: &ctl.namespace,
        endpoint,
        req,
        read: access.read,
        write: false,
        wants,
        counted: false,
    };
    let found = lookup::lookup(state, ask).await;
    let plan = &found.plan;
    let mut candidates = Vec::new();
    if let (Some(policy), Some(partition), Some(embedding), Some(embedder)) = (
        found.policy.as_ref(),
        plan.partition.as_ref(),
        plan.embedding.as_deref(),
        state.embedder.as_ref(),
    ) {
        let q = semantic::Question {
            text: plan.read(),
            embedding,
            partition,
            key: &plan.exact,
            scope: crate::auth::scope_of(&ctl.namespace),
        };
        for c in state.store.search(partition, embedding, policy.top_k) {
            let per_entry = found.per_entry.as_ref();
            let threshold = semantic::threshold_of(state, policy, per_entry, c.id);
            let (verdict, entry) =
                semantic::judge(state, embedder, policy, threshold, &q, wants, &c).await;
            candidates.push(json!({
                "entry": c.id.to_string(),
                "similarity": c.similarity,
                "threshold": threshold,
                "prompt": entry.as_ref().map(|e| e.prompt.clone()),
                "verdict": verdict.as_str(),
            }));
        }
    }
    let would_serve = match &found.hit {
        Some(hit) => json!({
            "outcome": hit.outcome.as_str(),
            "entry": hit.entry.id.to_string(),
            "similarity": hit.similarity,
        }),
        None if found
            .stale
            .as_ref()
            .is_some_and(|e| stale.while_revalidate(e.expires_ms, reprise_cache::now_ms())) =>
        {
            json!({
                "outcome": "stale",
                "degraded": crate::degraded::Degraded::StaleWhileRevalidate.header_value(),
                "entry": found.stale.as_ref().map(|e| e.id.to_string()),
            })
        }
        None if !access.generate => json!({"outcome": "not_cached"}),
        None if access.write => json!({"outcome": "miss"}),
        None => json!({"outcome": "bypass"}),
    };
    Ok(json!({
        "tenant": tenant.name(),
        "namespace": crate::auth::sub_namespace(&ctl.namespace),
        "exact_key": hex::encode(plan.exact),
        "exact_key_too_old": found.exact_taken,
        "stale_entry": found.stale.as_ref().map(|e| json!({
            "entry": e.id.to_string(),
            "expired_secs": e.expired_for_ms() / 1000,
        })),
        "read": access.read,
        "write": access.write,
        "partition": plan.partition.map(hex::encode),
        "matched_text": (!plan.prompt.is_empty()).then_some(&plan.prompt),
        "policy": found.policy.map(|p| json!({
            "enabled": p.enabled, "threshold": p.threshold, "top_k": p.top_k, "gate": p.gate,
        })),
        "candidates": candidates,
        "backend": backend,
        "model": parsed.req.model,
        "would_serve": would_serve,
        "policy_version": policies.version,
    }))
}
