//! The request path of both completion endpoints, top to bottom. Each step has a file:
//!
//! 0. **identify**: the API key names the tenant ([`crate::auth`]), within its rate limit;
//! 1. **parse** ([`parse`]): the body becomes a [`reprise_backend::GenRequest`], or a
//!    [`Forward`] for the upstream ([`crate::forward`]);
//! 2. **controls** ([`controls`]): namespace (inside the tenant), `Cache-Control`, threshold, session, tags,
//!    priority (within the tenant's cap) from headers; ready and model checks; then the
//!    route ([`crate::routes`]): the backend that answers and the model it is served as;
//! 3. **policy** ([`policy`]): may this request read, write, call the backend? (the
//!    configuration, the tenant's policy, `Cache-Control`); the tenant's `max_tokens` cap;
//! 4. **exact lookup** ([`crate::lookup::exact`]) by the blake3 key of the canonical request;
//! 5. **semantic lookup** ([`crate::lookup::semantic`]): the last user turn by meaning, in its
//!    partition, through the false-hit gate (both lookups live in [`crate::lookup`] because
//!    background generation shares them); without a fresh answer, an expired one within the
//!    stale-while-revalidate window is served at once, marked stale, while one regeneration
//!    replaces it ([`crate::generate::revalidate`]);
//!    a miss whose backend is predicted to answer too late for its route's SLO is answered
//!    another way ([`degrade`]: a paraphrase at a looser threshold, an expired entry, the
//!    route's fallback backend, or 429), and background work is shed;
//! 6. **single-flight** ([`single_flight`]): follow an identical generation, or a paraphrase
//!    being generated, or lead a new one;
//! 7. **generation** ([`crate::generate`]): a driver task runs the backend into the flight;
//! 8. **write-back**: a miss is stored by the driver task when it finished
//!    ([`crate::generate::write_back`], never for errors, cut-off streams or abandoned
//!    generations); a hit links this request's keys to the entry ([`write_back`]);
//! 9. **respond** ([`respond`], [`sse`]): JSON or SSE, with the cache status headers; a
//!    generation that fails before answering is answered from an expired entry within the
//!    stale-if-error window instead, when there is one.
//!
//! The request's metrics and log line are kept by a [`Bookkeeping`] that is written when the
//! response is done.

mod controls;
mod degrade;
pub(crate) mod explain;
mod parse;
mod policy;
mod respond;
mod single_flight;
mod sse;
pub(crate) mod write_back;

use std::sync::Arc;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::auth::Tenant;
use crate::bookkeeping::{Bookkeeping, CanarySide};
use crate::candidate::Arm;
use crate::config::CandidateMode;
use crate::degraded::{set_degraded, Degraded};
use crate::error::ApiError;
use crate::feedback::{self, Served};
pub use crate::forward::Forward;
use crate::headers::set_cache_status;
use crate::lookup::{self, ObserveLater, Wants};
use crate::metrics::Outcome;
use crate::openai::{Endpoint, Renderer};
use crate::routes::Fallback;
use crate::state::AppState;
use controls::admit;
pub use controls::{
    priority_of, session_id, Controls, MAX_NAMESPACE_BYTES, MAX_SESSION_BYTES, MAX_TAGS,
    MAX_TAG_BYTES,
};
use degrade::Degradation;
pub use parse::{parse, Parsed, Request};

/// Entry point of both completion endpoints.
pub async fn handle(
    state: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut book = Bookkeeping::new(&state, endpoint);
    if book.is_detailed() {
        book.record.request_id = crate::trace::request_id(&headers).to_string();
        book.record.trace_parent = crate::otel::parent(&headers);
    }
    match serve(&state, endpoint, &headers, body, &mut book).await {
        Ok(resp) => resp,
        Err(e) => {
            book.fail(&e);
            let mut resp = e.into_response();
            set_cache_status(&mut resp, Outcome::Error, None);
            resp
        }
    }
}

async fn serve(
    state: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Body,
    book: &mut Bookkeeping,
) -> Result<Response, ApiError> {
    // One deadline for the whole request, from its arrival: the lookup, the wait for the
    // first token and (without streaming) the whole answer are within it.
    let deadline = tokio::time::Instant::now() + state.config.server.request_timeout();
    // 0. Who is asking: the API key names the tenant (401 before anything else is read),
    //    within its rate limit (429).
    let tenant = state.policies.load().tenants.identify(headers)?;
    // Counted under its tenant from here on, its refusals (429, a bad body) included.
    book.record.tenant = tenant.name().to_string();
    tenant.take_request()?;
    // 1. Read (only now: an unknown caller never makes the server hold a body) and parse.
    let server = &state.config.server;
    let timeout = server.body_timeout().min(server.request_timeout());
    let body = crate::http::read_body(headers, body, server.max_body_bytes, timeout).await?;
    let mut parsed = match parse(endpoint, &body)? {
        Request::Cacheable(parsed) => parsed,
        Request::Forward(mut f) => {
            // Only an upstream can answer it: admitted like any request (within the tenant's
            // cap and token budget), then sent there.
            let ctl = admit(state, headers, &tenant, &f.model, book)?;
            if ctl.cache.only_if_cached {
                return Err(ApiError::NotCached);
            }
            // Routed like any request: to the upstream of its route, as that model (its
            // size: the body's characters, tools and all).
            let chars = || String::from_utf8_lossy(&body).chars().count();
            let choice = route(state, &tenant, &f.model, chars)?;
            // Refused before the tenant's token budget is charged for it.
            if !choice.primary.backend.forwards() {
                return Err(f.needs_upstream());
            }
            let body = crate::forward::with_model(body, &mut f, &choice.model)?;
            f.backend = Some(choice.primary.name.clone());
            let chat = endpoint == Endpoint::Chat;
            let field = choice.primary.backend.bound_field().on(chat);
            let body = policy::cap_forward(state, &tenant, &mut f, body, field)?;
            let forwarding =
                crate::forward::forward(state, endpoint, headers, body, f, ctl.priority, book);
            return Box::pin(forwarding).await;
        }
    };
    // 2. Controls (the priority the backend serves it at among them).
    let ctl = admit(state, headers, &tenant, &parsed.req.model, book)?;
    parsed.req.priority = ctl.priority;
    // Which backend answers, as which model (routes, aliases): the request is looked up,
    // generated and stored as that model, so answers of different models never mix.
    let input = &parsed.req.input;
    let choice = route(state, &tenant, &parsed.req.model, || {
        crate::routes::prompt_chars(input)
    })?;
    parsed.req.model = choice.model.clone();
    parsed.req.backend = Some(choice.primary.name.clone());
    let own_default = choice.primary.backend.default_max_tokens();
    policy::cap_max_tokens(state, &tenant, &mut parsed.req, own_default)?;
    // 3. Policy.
    let access = policy::access(state, &tenant, &ctl);
    let renderer = Renderer::new(endpoint, &parsed.req.model);
    if book.is_detailed() {
        book.record.id = renderer.id().to_string();
        // Before the lookup, so a request cancelled during it is logged with its question.
        book.question(question_of(&parsed.req));
    }
    book.record.model = parsed.req.model.clone();

    // 4. Exact and 5. semantic lookup.
    let arm = candidate_arm(&tenant, book);
    let stale_windows = policy::stale_windows(state, &tenant, &ctl);
    let wants = Wants {
        threshold: ctl.threshold,
        freshness: ctl.cache.freshness(),
        arm,
        stale: stale_windows,
    };
    let counted = book.is_counted();
    let within = tokio::time::Instant::now() + state.config.server.lookup_timeout();
    let ask = lookup::Ask {
        namespace: &ctl.namespace,
        endpoint,
        req: &parsed.req,
        read: access.read,
        write: access.write,
        wants,
        counted,
    };
    let looking = lookup::lookup(state, ask);
    let mut found = match tokio::time::timeout_at(within.min(deadline), looking).await {
        Ok(found) => found,
        Err(_) => {
            // A slow Redis or a long embedder queue: answered as a miss rather than late.
            state.metrics.lookup_timeout();
            tracing::warn!(namespace = %ctl.namespace, "cache lookup timed out; going on as a miss");
            lookup::Lookup::unmatched(&ctl.namespace, endpoint, &parsed.req)
        }
    };
    book.note(&found.notes);
    let exact = found
        .hit
        .as_ref()
        .is_some_and(|h| h.outcome == Outcome::Exact);
    if !book.is_detailed() && !exact {
        // Without a log or traces, only the stats read it (misses, hits by meaning).
        book.question(question_of(&parsed.req));
    }
    let session = ctl
        .session
        .clone()
        .or_else(|| parsed.user.as_deref().and_then(controls::session_id));
    let observe = state.observer.is_some().then(|| ObserveLater {
        endpoint,
        request: parsed.req.clone(),
        session,
        prev_entry: found.prev_entry,
    });
    // Copied only when something will read it (feedback, checks of hits).
    let wanted = state.config.feedback.enabled || state.config.semantic.verify_hits > 0.0;
    let question = wanted
        .then(|| feedback::question(found.plan.partition, found.plan.read()))
        .flatten();
    let key = found.plan.exact;
    let scope = found.scope.clone();
    let aliased = found.aliased;
    let served =
        |entry: Option<_>, outcome: Outcome, sim: Option<f32>, book: &Bookkeeping| Served {
            tenant: tenant.name().to_string(),
            entry,
            outcome,
            key,
            question: question.clone(),
            canary: book.canary.as_ref().map(|c| c.on_candidate),
            candidate: book.canary.as_ref().map(|c| c.candidate.fingerprint()),
            similarity: sim,
            scope: scope.clone(),
            aliased: aliased && outcome == Outcome::Exact,
            checked: false,
        };
    if let Some(hit) = found.hit.take() {
        // 8. Write-back of a hit: this phrasing's keys now lead to the entry (boxed: an exact
        // hit, the hot path, rarely has anything to write).
        if write_back::has_work(state, &hit, access.write) {
            Box::pin(write_back::link_hit(
                state,
                &found,
                &hit,
                access.write,
                observe,
            ))
            .await;
        }
        // 9. Respond (remembered for feedback under the response's id).
        let s = served(Some(hit.entry.id), hit.outcome, hit.similarity, book);
        state.responses.remember(state, renderer.id(), s.clone());
        if let (Outcome::Semantic, Some(sim)) = (hit.outcome, hit.similarity) {
            if state.config.semantic.verify_hits > 0.0 {
                let id = renderer.id().to_string();
                crate::verify::offer(state, s, id, &parsed.req, &hit.entry, sim);
            }
        }
        return Ok(respond::hit(&parsed, renderer, hit, book));
    }
    // Nothing fresh; an expired entry within the stale-while-revalidate window is served at
    // once while one regeneration replaces it (when this request may write and generate,
    // within the tenant's token budget; otherwise it is only served).
    // Not one deleted since it was read (by id, namespace or tag).
    let stale = found.stale.take().filter(|e| !state.store.gone(e));
    // What a generation for this request is charged against the tenant's token budget.
    let charge = parsed
        .req
        .params
        .max_tokens
        .unwrap_or(state.config.backend.default_max_tokens);
    let now = reprise_cache::now_ms();
    if let Some(entry) = stale
        .clone()
        .filter(|e| stale_windows.while_revalidate(e.expires_ms, now))
    {
        let tags = merged_tags(&entry.tags, &ctl.tags);
        // Beyond the tag limit the renewed answer could not be stored: not generated. Nor
        // while background work is shed (the SLO at risk): the stale answer is served alone.
        if access.write
            && access.generate
            && tags.len() <= controls::MAX_TAGS
            && !state.router.shedding()
        {
            let mut plan = found.plan;
            plan.tags = tags;
            plan.observe = observe;
            let admit = || tenant.take_tokens(charge).is_ok();
            crate::generate::revalidate(state, parsed.req.clone(), plan, entry.id, admit);
        }
        let s = served(Some(entry.id), Outcome::Exact, None, book);
        let kind = Degraded::StaleWhileRevalidate;
        return Ok(answer_stale(state, &parsed, renderer, entry, kind, s, book));
    }
    // The embedder's queue is full: the semantic lookup this request needed did not run.
    // Answering it from the backend would hand the backend every request while the embedder
    // is overloaded; the client is asked to retry instead.
    if let (true, Some(retry_after_secs)) = (access.read, found.embed_overloaded) {
        return Err(ApiError::Overloaded { retry_after_secs });
    }
    if !access.generate {
        return Err(ApiError::NotCached);
    }
    // 6. Single-flight, 7. generation (8. write-back in the driver task).
    book.outcome = if access.write {
        Outcome::Miss
    } else {
        Outcome::Bypass
    };
    // A generation already running for this question answers it at no cost to the backend:
    // followed before anything is degraded or charged.
    let priority = parsed.req.priority;
    let following = single_flight::follow(
        state,
        &found.plan,
        found.policy.as_ref(),
        priority,
        access,
        book,
    );
    // The steps after the lookup (the gate on paraphrases in flight, a looser search) wait
    // for the CPU pool: within the request's deadline, past it not at all.
    let following = tokio::time::timeout_at(deadline, following);
    let joined = match Box::pin(following).await.ok().flatten() {
        Some(joined) => joined,
        None => {
            // The backend would answer too late for the route's SLO: answered another way.
            let mut fallback = choice.fallback.clone().map(|target| Fallback {
                target,
                force: false,
            });
            let now = reprise_cache::now_ms();
            let stale_ok = stale
                .as_ref()
                .filter(|e| stale_windows.if_error(e.expires_ms, now));
            let (namespace, priority) = (&ctl.namespace, parsed.req.priority);
            let primary_up = choice.primary.backend.ready();
            let degraded = if primary_up {
                let degrading =
                    degrade::degrade(state, &choice, priority, &found, namespace, wants, stale_ok);
                let degrading = tokio::time::timeout_at(deadline, degrading);
                Box::pin(degrading).await.ok().flatten()
            } else {
                // The route's backend is down (a stopped engine): its fallback answers when
                // it is up, else an expired entry within stale-if-error, else a 503 before
                // anything is charged.
                let up = choice.fallback.as_ref().filter(|f| f.backend.ready());
                Some(match (up, stale_ok) {
                    (Some(f), _) => Degradation::Fallback(Fallback {
                        target: f.clone(),
                        force: true,
                    }),
                    (None, Some(entry)) => Degradation::Stale(entry.clone()),
                    (None, None) => return Err(ApiError::NotReady),
                })
            };
            match degraded {
                Some(Degradation::Loose(hit)) => {
                    let s = served(Some(hit.entry.id), hit.outcome, hit.similarity, book);
                    state.responses.remember(state, renderer.id(), s);
                    // Before `hit`, which may move the bookkeeping into a stream.
                    book.degraded(Degraded::LooseThreshold);
                    let mut resp = respond::hit(&parsed, renderer, hit, book);
                    set_degraded(&mut resp, Degraded::LooseThreshold);
                    return Ok(resp);
                }
                Some(Degradation::Stale(entry)) => {
                    let s = served(Some(entry.id), Outcome::Exact, None, book);
                    // A busy backend is no error: a stale answer in its place says which.
                    let kind = if primary_up {
                        Degraded::StaleUnderLoad
                    } else {
                        Degraded::StaleIfError
                    };
                    return Ok(answer_stale(state, &parsed, renderer, entry, kind, s, book));
                }
                Some(Degradation::Fallback(f)) => fallback = Some(f),
                Some(Degradation::Refuse(retry_after_secs)) => {
                    return Err(ApiError::Overloaded { retry_after_secs })
                }
                None => {}
            }
            // Past the deadline (the steps above waited for the CPU pool): nothing is asked of
            // the backend, nor charged.
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::Timeout);
            }
            // The backend will be asked: charged against the tenant's token budget, once this
            // request leads its generation (following one already running costs nothing).
            let charge = || tenant.take_tokens(charge);
            let mut plan = found.plan;
            plan.tags = ctl.tags.clone();
            plan.near_miss = near_miss_to_check(state, &tenant, &found.notes, scope.clone());
            plan.observe = observe;
            let policy = found.policy;
            let leading = single_flight::Leading { fallback, charge };
            let joining = single_flight::join(state, &parsed, plan, policy, access, leading, book);
            // Cancelled only while it looks for a paraphrase in flight, before it starts or
            // charges anything: past the deadline there is no one to answer.
            Box::pin(tokio::time::timeout_at(deadline, joining))
                .await
                .map_err(|_| ApiError::Timeout)??
        }
    };
    // A follower's tags go with the answer it is served (the leader's are in its plan).
    if !ctl.tags.is_empty() {
        joined.subscriber.add_tags(&ctl.tags);
    }
    // 9. Respond (remembered for feedback under the response's id).
    let outcome = book.outcome;
    let s = served(joined.subscriber.entry(), outcome, joined.similarity, book);
    state.responses.remember(state, renderer.id(), s);
    let generated = Box::pin(respond::generation(
        state,
        &parsed,
        renderer.clone(),
        joined.subscriber,
        outcome,
        book,
        deadline,
    ))
    .await;
    let mut resp = match generated {
        // The backend failed before answering: an expired entry within the stale-if-error
        // window answers instead of the error.
        // The entry was read before the generation: one deleted meanwhile is not served.
        Err(e) if backend_failed(&e) => {
            let now = reprise_cache::now_ms();
            let servable = |e: &Arc<reprise_cache::Entry>| {
                stale_windows.if_error(e.expires_ms, now) && !state.store.gone(e)
            };
            match stale.filter(servable) {
                Some(entry) => {
                    tracing::debug!(error = %e, "generation failed; answered stale");
                    let s = served(Some(entry.id), Outcome::Exact, None, book);
                    let kind = Degraded::StaleIfError;
                    let resp = answer_stale(state, &parsed, renderer, entry, kind, s, book);
                    return Ok(resp);
                }
                None => return Err(e),
            }
        }
        other => other?,
    };
    if let Some(sim) = joined.similarity {
        crate::headers::set_similarity(&mut resp, sim);
    }
    Ok(resp)
}

/// Answers from an expired entry (`kind` says why), remembered for feedback as `served`.
fn answer_stale(
    state: &Arc<AppState>,
    parsed: &Parsed,
    renderer: Renderer,
    entry: Arc<reprise_cache::Entry>,
    kind: Degraded,
    served: Served,
    book: &mut Bookkeeping,
) -> Response {
    state.responses.remember(state, renderer.id(), served);
    respond::stale(parsed, renderer, entry, kind, book)
}

/// The backend (route) that answers a request of `tenant` for `model`; 404 when none serves
/// it.
fn route(
    state: &AppState,
    tenant: &Tenant,
    model: &str,
    prompt_chars: impl FnOnce() -> usize,
) -> Result<crate::routes::Choice, ApiError> {
    state
        .router
        .choose(model, tenant.name(), prompt_chars)
        .ok_or_else(|| ApiError::UnknownModel(model.to_string()))
}

/// Whether a failed generation is one a stale answer may stand in for (stale-if-error): the
/// backend unavailable, overloaded, failing or timing out, or no first token within the
/// first-token deadline. A request the backend refuses (invalid, unknown model) is not.
fn backend_failed(e: &ApiError) -> bool {
    use reprise_backend::BackendError as B;
    matches!(
        e,
        ApiError::Timeout
            | ApiError::Backend(
                B::Unavailable(_) | B::Timeout | B::Overloaded { .. } | B::Internal(_)
            )
    )
}

/// The tags of a regenerated entry: those of the entry it replaces (so a tag delete still
/// reaches it) and the request's, every one. Beyond [`controls::MAX_TAGS`] nothing is
/// regenerated (its answer could not be stored, as on a miss: dropping a tag would let a
/// delete of it miss the answer).
fn merged_tags(old: &[String], asked: &[String]) -> Vec<String> {
    let mut tags = old.to_vec();
    for t in asked {
        if !tags.contains(t) {
            tags.push(t.clone());
        }
    }
    tags
}

/// The question of a request, as people read it: the last user turn, or the raw prompt.
fn question_of(req: &reprise_backend::GenRequest) -> &str {
    match &req.input {
        reprise_backend::Input::Prompt(p) => p,
        reprise_backend::Input::Chat(msgs) => msgs
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .or(msgs.last())
            .map_or("", |m| m.content.as_str()),
    }
}

/// The policy a request of `tenant` is looked up under: with a candidate, the side it
/// assigns (a canary's sides are recorded in `book` when the request ends).
fn candidate_arm(tenant: &Tenant, book: &mut Bookkeeping) -> Arm {
    let Some(candidate) = tenant.candidate() else {
        return Arm::Current;
    };
    let arm = candidate.assign();
    if candidate.config().mode == CandidateMode::Canary && book.is_counted() {
        book.canary = Some(CanarySide {
            tenant: tenant.name().to_string(),
            candidate: candidate.clone(),
            on_candidate: arm == Arm::Candidate,
        });
    }
    arm
}

/// The near miss of a miss to check once answered, when the tenant's threshold (that of
/// `scope`) is learned under a bound and this one is sampled (`semantic.verify_near_misses`).
fn near_miss_to_check(
    state: &AppState,
    tenant: &Tenant,
    notes: &lookup::Notes,
    scope: String,
) -> Option<crate::bounds::NearMiss> {
    let (candidate, similarity) = notes.near_miss?;
    let s = &state.config.semantic;
    let wanted = crate::bounds::delta_of(state, tenant) > 0.0 && similarity >= s.min_threshold;
    (wanted && state.bounds.sample(s.verify_near_misses)).then(|| crate::bounds::NearMiss {
        tenant: tenant.name().to_string(),
        scope,
        candidate,
        similarity,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refresh_keeps_every_tag_of_the_old_entry_and_the_request() {
        let old: Vec<String> = (0..controls::MAX_TAGS).map(|i| format!("old{i}")).collect();
        let merged = merged_tags(&old, &["old0".into(), "gdpr-user-1".into()]);
        assert_eq!(merged.len(), controls::MAX_TAGS + 1);
        assert!(merged.contains(&"gdpr-user-1".to_string()));
    }
}
