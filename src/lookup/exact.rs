//! Step 4 of the request path: the exact lookup, by the blake3 key of the canonical request
//! (memory, then Redis with promotion; see [`reprise_cache::Store::find`]).

use reprise_cache::{ByKey, Digest};

use crate::lookup::Wants;
use crate::metrics::Tier;
use crate::state::AppState;

/// What `key` leads to for a request that `wants` this fresh an answer. `counted` records
/// the lookups in the metrics (client traffic only).
pub async fn find(state: &AppState, key: &Digest, wants: Wants, counted: bool) -> ByKey {
    let (found, probe) = state.store.find(key, |e| wants.fresh(e)).await;
    if counted {
        state.metrics.lookup(Tier::Exact, probe.memory);
        if let Some(hit) = probe.redis {
            state.metrics.lookup(Tier::Redis, hit);
        }
    }
    found
}
