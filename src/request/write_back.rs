//! Step 8 of the request path for hits: the request's own keys are linked to the entry that
//! answered it (a miss is written back by the generation task, [`crate::generate`]).

use std::sync::Arc;

use reprise_cache::Origin;

use crate::lookup::{Hit, Lookup, ObserveLater};
use crate::metrics::Outcome;
use crate::observe::Observation;
use crate::state::AppState;

/// Whether [`link_hit`] has anything to do after `hit`: links to write, a prefetched entry's
/// first use, or an observer to tell.
pub fn has_work(state: &AppState, hit: &Hit, write: bool) -> bool {
    (write && hit.outcome != Outcome::Exact)
        || hit.entry.origin == Origin::Prefetch
        || state.observer.is_some()
}

/// After a hit: an exact repeat of this phrasing, and the next turn of this conversation,
/// find the entry directly next time (an exact hit found it by these keys already; a hit
/// matched under a canary's candidate policy is not linked); a prefetched entry becomes a
/// normal one on its first use; the prefetcher learns of the hit.
pub async fn link_hit(
    state: &AppState,
    found: &Lookup,
    hit: &Hit,
    write: bool,
    observe: Option<ObserveLater>,
) {
    if write && hit.outcome != Outcome::Exact && !found.on_candidate {
        let mut keys = Vec::new();
        if !found.exact_taken {
            keys.push(found.plan.exact);
        }
        keys.extend(found.plan.turn_keys(&hit.entry.text));
        // Only keys nothing took since the lookup: a generation for this very request that
        // ended meanwhile (or another replica's) keeps its own answer under its key.
        state.store.alias_unclaimed(&keys, &hit.entry).await;
    }
    if hit.entry.origin == Origin::Prefetch {
        // A prefetched entry says so on its first use; after that it is a normal entry.
        let mut used = (*hit.entry).clone();
        used.origin = Origin::Live;
        let used = Arc::new(used);
        state.store.replace(used.clone()).await;
        // In Redis too (off the answer's path): a replica reading it, or this one after an
        // eviction, would serve a first use again.
        if state.store.redis().is_some() {
            let store = state.store.clone();
            tokio::spawn(async move { store.update_kept(used).await });
        }
        if let Some(observer) = &state.observer {
            observer.prefetch_used(hit.entry.id);
        }
    }
    if let (Some(observer), Some(o)) = (&state.observer, observe) {
        observer.served(Observation {
            namespace: found.plan.namespace.clone(),
            endpoint: o.endpoint,
            request: o.request,
            session: o.session,
            prev_entry: o.prev_entry,
            entry: hit.entry.clone(),
            may_store: write,
            generated: false,
        });
    }
}
