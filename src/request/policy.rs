//! Step 3 of the request path: what the request may do with the cache, from the
//! configuration and its `Cache-Control` (decided in [`reprise_policies::cache`]).

use reprise_policies::cache::Access;

use crate::request::Controls;
use crate::state::AppState;

/// read = enabled && !no-cache && !no-store; write = enabled && !no-store &&
/// !only-if-cached; forward (call the backend) = !only-if-cached.
pub fn access(state: &AppState, ctl: &Controls) -> Access {
    reprise_policies::cache::access(state.config.cache.enabled, ctl.cache)
}
