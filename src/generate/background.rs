//! Background generation: prefetch and refresh-ahead generate requests nobody asked yet;
//! stale-while-revalidate regenerates, behind a stale answer, the request it answered; and
//! [`room`]: whether the backend has spare slots for such work now.

use std::sync::Arc;

use reprise_backend::{BackendError, GenEvent, GenRequest, Priority, Usage};
use reprise_cache::{Entry, EntryId, Origin};

use crate::lookup::{self, Wants, WritePlan};
use crate::openai::Endpoint;
use crate::state::AppState;

/// Background work's room on the backend now, from [`reprise_backend::Backend::load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    /// More background generations that may start now: slots free beyond what waiting user
    /// requests need, within `prefetch.max_capacity_share`.
    pub spare: usize,
    /// The slots background work may hold at once (the share of the capacity).
    pub slots: usize,
}

/// Spare slots for background work on the backend a generation of `req` goes to
/// ([`crate::routes::Router::target_for`]), or
/// `None` when that backend cannot tell its capacity (an upstream without `max_concurrent`,
/// the unlimited scripted backend): callers then run background work only while it runs no
/// user request ([`users_on`]). `starting`: background generations the caller started that
/// no backend may see yet (their lookup runs before the backend is asked), counted as
/// holding a slot here whichever backend they go to; background requests the backend has
/// queued count as holding a slot. Another backend's load never counts: with a busy
/// upstream beside it, an idle llama still has room.
pub fn room(state: &AppState, req: &GenRequest, starting: usize) -> Option<Room> {
    use reprise_policies::prefetch::{background_slots, spare_slots, Slots};
    let load = state.router.target_for(req)?.backend.load();
    if load.capacity == 0 {
        return None;
    }
    let seen = load.running_background + load.queued_background();
    let unseen = starting.saturating_sub(seen);
    let share = state.config.prefetch.max_capacity_share;
    let slots = Slots {
        capacity: load.capacity,
        running: load.running + load.queued_background() + unseen,
        background: seen + unseen,
        queued_user: load.queued_user(),
        kept_free: load.kept_free,
    };
    // A user request found its backend too slow for its SLO (`[degrade]`): background work
    // is shed first, no new generation starts.
    let spare = match state.router.shedding() {
        true => 0,
        false => spare_slots(slots, share),
    };
    Some(Room {
        spare,
        slots: background_slots(load.capacity, share),
    })
}

/// User requests running or waiting on the backend a generation of `req` goes to: where
/// [`room`] is `None`, background work for it starts only when this is 0.
pub fn users_on(state: &AppState, req: &GenRequest) -> usize {
    state
        .router
        .target_for(req)
        .map_or(0, |t| t.backend.interactive_load())
}

/// What a background generation came to.
#[derive(Debug)]
pub enum Background {
    /// The cache can already answer the request in its context with this entry (exactly or
    /// semantically); nothing was generated.
    Cached(Arc<Entry>),
    /// Generated and stored.
    Generated {
        /// The new entry.
        id: EntryId,
        /// Its token usage.
        usage: Usage,
    },
    /// Nothing was asked of the backend: the embedder had no spare room for background
    /// work (an answer stored without its vector could never be found by a paraphrase).
    Skipped,
    /// The backend failed, was preempted, or the answer was incomplete; nothing stored.
    Failed {
        /// Why.
        error: BackendError,
        /// The pieces of answer it decoded before (a token each, near enough): what it spent.
        decoded: u64,
    },
}

/// Generates `req` at background priority and stores the answer as an entry of `origin`,
/// unless the cache can already answer it (`check_cache`). Used by prefetch (the follow-up as
/// it will arrive) and refresh-ahead (`check_cache = false`: the entry exists but is expiring).
/// Background flights are never joined by interactive requests: a preempted background
/// generation must not fail a user's request.
pub async fn generate_in_background(
    state: &Arc<AppState>,
    namespace: &str,
    endpoint: Endpoint,
    req: GenRequest,
    origin: Origin,
    check_cache: bool,
) -> Background {
    generate_tagged(
        state,
        namespace,
        endpoint,
        req,
        origin,
        check_cache,
        Vec::new(),
    )
    .await
}

/// [`generate_in_background`], storing the answer with invalidation `tags` (refresh-ahead
/// gives the renewed entry the tags of the one it replaces, so a tag delete still reaches it).
pub async fn generate_tagged(
    state: &Arc<AppState>,
    namespace: &str,
    endpoint: Endpoint,
    mut req: GenRequest,
    origin: Origin,
    check_cache: bool,
    tags: Vec<String>,
) -> Background {
    if state
        .policies
        .load()
        .tenants
        .for_namespace(namespace)
        .policy()
        .read_only
    {
        // Nothing may be stored for a read-only tenant, so nothing is generated for it.
        return Background::Failed {
            error: BackendError::InvalidRequest {
                message: "the tenant is read-only".into(),
                param: None,
            },
            decoded: 0,
        };
    }
    req.priority = Priority::Background;
    // Not client traffic: kept out of the lookup metrics analysts read.
    let ask = lookup::Ask {
        namespace,
        endpoint,
        req: &req,
        read: check_cache,
        write: true,
        wants: Wants::default(),
        counted: false,
    };
    let looking = lookup::lookup(state, ask);
    let Ok(found) = tokio::time::timeout(state.config.server.lookup_timeout(), looking).await
    else {
        return Background::Failed {
            error: BackendError::Timeout,
            decoded: 0,
        };
    };
    if let Some(hit) = found.hit {
        return Background::Cached(hit.entry);
    }
    // The embedder had no spare room for background work: nothing is generated (an entry
    // stored without its vector could never be found by a paraphrase); tried again later.
    if found.embed_overloaded.is_some() {
        return Background::Skipped;
    }
    let mut plan = found.plan;
    plan.origin = origin;
    plan.tags = tags;
    let (exact, plan_id) = (plan.exact, plan.id);
    let (flight, mut sub) = state.flights.solo(Some(plan.id));
    super::spawn(state.clone(), flight, None, req, Some(plan), None);
    let (mut usage, mut decoded) = (None, 0);
    // Past a deadline the subscriber is dropped: the flight, abandoned, stops the backend.
    let mut deadlines = super::Deadlines::new(&state.config.server);
    loop {
        match deadlines.next(sub.next()).await {
            Ok(Some(Ok(GenEvent::Finish { usage: u, .. }))) => usage = Some(u),
            Ok(Some(Ok(GenEvent::Delta(_)))) => decoded += 1,
            Ok(Some(Err(error))) | Err(error) => return Background::Failed { error, decoded },
            Ok(None) => break,
        }
    }
    // Only the entry this generation stored: the key may still lead to the one it renews,
    // or to one a client's miss stored meanwhile.
    let stored = state.store.get_by_key(&exact).await;
    match (usage, stored.filter(|e| e.id == plan_id)) {
        (Some(usage), Some(entry)) => Background::Generated {
            id: entry.id,
            usage,
        },
        (usage, _) => Background::Failed {
            error: BackendError::Internal("no entry after generation".into()),
            decoded: usage.map_or(decoded, |u| u64::from(u.completion_tokens)),
        },
    }
}

/// Stale-while-revalidate: regenerates `req`, whose client was just answered from the expired
/// entry `stale`, in the background, and stores the answer as a miss would (`plan`, from the
/// request's own lookup: its exact key, turn links, partition); the keys that led to `stale`
/// then lead to the new entry (as refresh-ahead repoints them), so every wording served the
/// old answer gets the new one.
///
/// Once per entry (whichever of its keys asked) and per exact key: the generation is a
/// flight in the registry under that key, started only when none is under way for it
/// (concurrent stale answers of one question start one regeneration; a miss of the same
/// question that arrives meanwhile follows it). `admit` (the tenant's token budget) is
/// asked under the registry's lock, only by the caller that would start it. It runs at the request's priority, since interactive requests may follow
/// it, within the deadlines of work nobody waits on; a failure leaves the stale entry as it
/// is. Returns whether a regeneration started.
pub(crate) fn revalidate(
    state: &Arc<AppState>,
    req: GenRequest,
    plan: WritePlan,
    stale: EntryId,
    admit: impl FnOnce() -> bool,
) -> bool {
    let exact = plan.exact;
    // One per entry too: the aliases a hit by meaning linked to it are other keys.
    let Some(renewing) = Renewing::of(state, stale) else {
        return false;
    };
    let Some((flight, mut sub)) = state.flights.lead(exact, plan.id, req.priority, admit) else {
        return false;
    };
    // A paraphrase asked meanwhile follows it, as it would follow a miss.
    if let (Some(partition), Some(embedding)) = (plan.partition, plan.embedding.clone()) {
        let prompt = Arc::from(reprise_policies::gate::capped(plan.read()));
        state
            .paraphrases
            .register(&flight, partition, exact, prompt, embedding);
    }
    let id = plan.id;
    super::spawn(state.clone(), flight, Some(exact), req, Some(plan), None);
    let state = state.clone();
    // The only subscriber: it keeps the flight alive to the end, or drops it (and so stops
    // the backend) past a deadline.
    tokio::spawn(async move {
        let _renewing = renewing;
        let mut deadlines = super::Deadlines::new(&state.config.server);
        loop {
            match deadlines.next(sub.next()).await {
                Ok(Some(Ok(_))) => {}
                Ok(None) => break,
                Ok(Some(Err(e))) | Err(e) => {
                    tracing::debug!(error = %e, "stale-while-revalidate: regeneration failed");
                    return;
                }
            }
        }
        if let Some(new) = state.store.get(id).await {
            state.store.repoint(stale, &new).await;
        }
    });
    true
}

/// An expired entry being regenerated, registered in [`AppState::revalidating`] until this
/// is dropped.
struct Renewing {
    state: Arc<AppState>,
    entry: EntryId,
}

impl Renewing {
    /// Registers `entry`; `None` when a regeneration of it is under way already.
    fn of(state: &Arc<AppState>, entry: EntryId) -> Option<Renewing> {
        state.revalidating.lock().insert(entry).then(|| Renewing {
            state: state.clone(),
            entry,
        })
    }
}

impl Drop for Renewing {
    fn drop(&mut self) {
        self.state.revalidating.lock().remove(&self.entry);
    }
}
