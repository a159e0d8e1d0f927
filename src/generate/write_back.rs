//! Step 8 of the request path for misses: storing a finished answer.

use std::sync::Arc;

use reprise_backend::{FinishReason, Usage};
use reprise_cache::{now_ms, Entry, EntryId, Vector};

use crate::lookup::WritePlan;
use crate::observe::Observation;
use crate::state::AppState;

/// Stores a finished answer in every tier (Redis queued, memory, index) under the plan's
/// exact key and turn link, and reports it to the prefetcher when the plan asks. `gen_ms`:
/// how long the backend took (what a hit on the entry saves).
pub(crate) async fn write_back(
    state: &AppState,
    plan: WritePlan,
    text: String,
    reason: FinishReason,
    usage: Usage,
    gen_ms: u32,
) -> EntryId {
    let now = now_ms();
    let ttl_secs = state
        .policies
        .load()
        .tenants
        .for_namespace(&plan.namespace)
        .policy()
        .ttl_secs
        .unwrap_or(state.config.cache.ttl_secs);
    let ttl = ttl_secs * 1000;
    let keys = plan.keys(&text);
    let entry = Arc::new(Entry {
        id: plan.id,
        namespace: plan.namespace,
        model: plan.model,
        text,
        finish_reason: reason.as_str().to_string(),
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        prompt: plan.prompt,
        partition: plan.partition.unwrap_or([0; 32]),
        embedder: state
            .embedder
            .as_ref()
            .filter(|_| plan.embedding.is_some())
            .map(|e| e.fingerprint()),
        embedding: plan.embedding.as_deref().and_then(Vector::finite),
        origin: plan.origin,
        tags: plan.tags,
        refusals: Vec::new(),
        created_ms: now,
        expires_ms: now + ttl,
        gen_ms,
    });
    let id = entry.id;
    state.store.insert(entry.clone(), &keys).await;
    if let (Some(observer), Some(o)) = (&state.observer, plan.observe) {
        observer.served(Observation {
            namespace: entry.namespace.clone(),
            endpoint: o.endpoint,
            request: o.request,
            session: o.session,
            prev_entry: o.prev_entry,
            entry,
            may_store: true,
            generated: true,
        });
    }
    state.metrics.cache_writes.increment(1);
    id
}
