//! Step 4 of the request path: the exact lookup, by the blake3 key of the canonical request
//! (memory, then Redis with promotion; see [`reprise_cache::Store::find`]).

use reprise_cache::{ByKey, Digest};

use crate::lookup::Wants;
use crate::metrics::Tier;
use crate::state::AppState;

/// What `key` leads to for a request that `wants` this fresh an answer, and the tier that
/// had it (`memory` or `redis`). `counted` records the lookups in the metrics (client
/// traffic only).
pub async fn find(
    state: &AppState,
    key: &Digest,
    wants: Wants,
    counted: bool,
) -> (ByKey, Option<&'static str>) {
    let (found, probe) = state.store.find(key, |e| wants.fresh(e)).await;
    let tier = if probe.memory {
        Some("memory")
    } else if probe.redis == Some(true) {
        Some("redis")
    } else {
        None
    };
    if counted {
        state.metrics.lookup(Tier::Exact, probe.memory);
        if let Some(hit) = probe.redis {
            state.metrics.lookup(Tier::Redis, hit);
        }
    }
    (found, tier)
}
