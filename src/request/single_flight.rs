//! Steps 6 and 7 of the request path: a miss follows a generation already running for the
//! same exact key, or for a paraphrase of it in the same partition (above the threshold,
//! through the gate), or leads a new generation ([`crate::generate::spawn`]). [`follow`] runs
//! before the request is degraded or charged (following costs the backend nothing);
//! [`join`] after, and follows too when a generation started in between.

use std::sync::Arc;

use reprise_backend::Priority;
use reprise_cache::Digest;
use reprise_policies::cache::Access;
use reprise_policies::semantic::SemanticPolicy;

use crate::bookkeeping::Bookkeeping;
use crate::error::ApiError;
use crate::flight::{Joined, Subscriber};
use crate::lookup::semantic::{meanings_apart, vet};
use crate::lookup::WritePlan;
use crate::metrics::Outcome;
use crate::request::Parsed;
use crate::routes::Fallback;
use crate::state::AppState;

/// The generation a request waits for.
pub struct Joining {
    /// Its events, from the start.
    pub subscriber: Subscriber,
    /// The similarity of the paraphrase whose generation it follows, if it follows one.
    pub similarity: Option<f32>,
}

/// Follows a generation already running for the request's exact key, or for a paraphrase
/// of it in its partition, if there is one: such a request costs the backend nothing, so it
/// is neither degraded nor charged to the tenant's budget. Only a request that may write
/// follows (one that may not runs its own generation), and only a generation of its own
/// priority or higher, or one already answering (see [`crate::flight::Flights::join`]).
pub async fn follow(
    state: &Arc<AppState>,
    plan: &WritePlan,
    policy: Option<&SemanticPolicy>,
    priority: Priority,
    access: Access,
    book: &mut Bookkeeping,
) -> Option<Joining> {
    if !access.write {
        return None;
    }
    if let Some(subscriber) = state.flights.follow(&plan.exact, priority) {
        state.metrics.singleflight_joins.increment(1);
        return Some(Joining {
            subscriber,
            similarity: None,
        });
    }
    follow_paraphrase(state, plan, policy, priority, access, book).await
}

/// A paraphrase of a question being generated right now waits for that answer.
async fn follow_paraphrase(
    state: &Arc<AppState>,
    plan: &WritePlan,
    policy: Option<&SemanticPolicy>,
    priority: Priority,
    access: Access,
    book: &mut Bookkeeping,
) -> Option<Joining> {
    let (true, Some(policy), Some(partition), Some(embedding)) = (
        access.read && access.write,
        policy,
        plan.partition,
        plan.embedding.as_ref(),
    ) else {
        return None;
    };
    let found = paraphrase_in_flight(state, plan, policy, &partition, embedding).await;
    let (subscriber, sim) = found.and_then(|(key, sim)| {
        let sub = state.flights.follow_by_meaning(&key, priority);
        sub.map(|s| (s, sim))
    })?;
    state.metrics.singleflight_joins.increment(1);
    book.outcome = Outcome::Semantic;
    book.record.similarity = Some(sim);
    Some(Joining {
        subscriber,
        similarity: Some(sim),
    })
}

/// What starting a generation takes: its fallback (when its backend is saturated or
/// refuses), and the charge against the tenant's token budget, made only when this request
/// starts it (following a running one costs nothing).
pub struct Leading<F> {
    pub fallback: Option<Fallback>,
    pub charge: F,
}

/// Joins or starts the generation that answers `parsed` (see [`Leading`]); the charge's
/// refusal when it would start one. A request that may not write runs its own generation
/// and stores nothing.
pub async fn join(
    state: &Arc<AppState>,
    parsed: &Parsed,
    plan: WritePlan,
    policy: Option<SemanticPolicy>,
    access: Access,
    leading: Leading<impl FnOnce() -> Result<(), ApiError>>,
    book: &mut Bookkeeping,
) -> Result<Joining, ApiError> {
    let Leading { fallback, charge } = leading;
    // A paraphrase in flight may have started since [`follow`] looked.
    let priority = parsed.req.priority;
    if let Some(joined) =
        follow_paraphrase(state, &plan, policy.as_ref(), priority, access, book).await
    {
        return Ok(joined);
    }
    let subscriber = if access.write {
        let exact = plan.exact;
        match state
            .flights
            .join_admitted(exact, plan.id, priority, charge)?
        {
            Joined::Follower(sub) => {
                state.metrics.singleflight_joins.increment(1);
                sub
            }
            Joined::Leader(flight, sub) => {
                if let (Some(partition), Some(embedding)) = (plan.partition, plan.embedding.clone())
                {
                    let prompt = Arc::from(reprise_policies::gate::capped(plan.read()));
                    state
                        .paraphrases
                        .register(&flight, partition, exact, prompt, embedding);
                }
                crate::generate::spawn(
                    state.clone(),
                    flight,
                    Some(exact),
                    parsed.req.clone(),
                    Some(plan),
                    fallback,
                );
                sub
            }
        }
    } else {
        charge()?;
        let (flight, sub) = state.flights.solo(None);
        let req = parsed.req.clone();
        crate::generate::spawn(state.clone(), flight, None, req, None, fallback);
        sub
    };
    Ok(Joining {
        subscriber,
        similarity: None,
    })
}

/// The most similar question in flight in `partition` (at or above the threshold) whose
/// prompt passes the gate against this one, as a cached candidate must (the substitution
/// check included): its exact key and the similarity. The registry is locked only to copy
/// the candidates out; the gate runs after, off the async workers, on what the embedder
/// reads of each prompt (the rest is in the partition).
async fn paraphrase_in_flight(
    state: &AppState,
    plan: &WritePlan,
    policy: &SemanticPolicy,
    partition: &Digest,
    embedding: &[f32],
) -> Option<(Digest, f32)> {
    let similar = state
        .paraphrases
        .similar(partition, embedding, policy.threshold);
    if similar.is_empty() || !policy.gate {
        return similar.first().map(|(key, sim, _)| (*key, *sim));
    }
    let query = reprise_policies::gate::capped(plan.read()).to_owned();
    let threshold = state.config.semantic.substitution_threshold;
    // Those through the gate, best first, up to the first that swaps no words (taken as is).
    let passing = state
        .cpu
        .run(move || {
            let mut passing = Vec::new();
            for (key, sim, prompt) in similar {
                let (verdict, swapped) = vet(&query, &prompt, threshold > 0.0);
                if verdict.is_pass() {
                    let last = swapped.is_none();
                    passing.push((key, sim, swapped));
                    if last {
                        break;
                    }
                }
            }
            passing
        })
        .await;
    let scope = crate::auth::scope_of(&plan.namespace);
    for (key, sim, swapped) in passing {
        let apart = match (swapped, &state.embedder) {
            (Some(words), Some(e)) => meanings_apart(e.as_ref(), scope, threshold, words).await,
            // No embedder to judge the swapped words: apart, as when it cannot tell.
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !apart {
            return Some((key, sim));
        }
    }
    None
}
