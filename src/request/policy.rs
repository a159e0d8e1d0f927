//! Step 3 of the request path: what the request may do with the cache, from the
//! configuration, the tenant's policy and its `Cache-Control` (decided in
//! [`reprise_policies::cache`]), and the tenant's `max_tokens` cap.

use reprise_backend::GenRequest;
use reprise_policies::cache::Access;

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::request::Controls;
use crate::state::AppState;

/// read = enabled && !no-cache && !no-store; write = enabled && !no-store &&
/// !only-if-cached && the tenant is not read-only; generate (call the backend on a miss) =
/// !only-if-cached.
pub fn access(state: &AppState, tenant: &Tenant, ctl: &Controls) -> Access {
    let mut access = reprise_policies::cache::access(state.config.cache.enabled, ctl.cache);
    access.write &= !tenant.policy().read_only;
    access
}

/// Applies the tenant's `max_tokens` cap: a request without `max_tokens` gets the cap, one
/// above it is refused (400) rather than silently cut short.
pub fn cap_max_tokens(tenant: &Tenant, req: &mut GenRequest) -> Result<(), ApiError> {
    let cap = tenant.policy().max_tokens;
    if cap == 0 {
        return Ok(());
    }
    match req.params.max_tokens {
        None => req.params.max_tokens = Some(cap),
        Some(n) if n > cap => {
            return Err(ApiError::invalid(
                format!("`max_tokens` may be at most {cap} for this API key"),
                Some("max_tokens"),
            ))
        }
        Some(_) => {}
    }
    Ok(())
}
