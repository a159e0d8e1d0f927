//! Step 3 of the request path: what the request may do with the cache, from the
//! configuration, the tenant's policy and its `Cache-Control` (decided in
//! [`reprise_policies::cache`]), and the tenant's `max_tokens` cap.

use axum::body::Bytes;
use reprise_backend::{BoundField, GenRequest};
use reprise_policies::cache::{Access, StaleWindows};

use crate::auth::Tenant;
use crate::error::ApiError;
use crate::forward::Forward;
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

/// How long past their expiry the request takes answers (RFC 5861): the tenant's stale
/// windows (else `[cache]`'s), narrowed by the request's `Cache-Control`
/// (`stale-while-revalidate=N`, `stale-if-error=N`: a client may ask for less, never more).
pub fn stale_windows(state: &AppState, tenant: &Tenant, ctl: &Controls) -> StaleWindows {
    let global = state.config.cache.stale_windows();
    tenant.policy().stale_windows(global).narrowed(&ctl.cache)
}

/// Applies the tenant's `max_tokens` cap: a request without `max_tokens` gets the cap, one
/// above it is refused (400) rather than silently cut short. `own_default`: the bound the
/// backend that answers applies to a request without one; a request bounded by it is keyed
/// as one without.
pub fn cap_max_tokens(
    state: &AppState,
    tenant: &Tenant,
    req: &mut GenRequest,
    own_default: Option<u32>,
) -> Result<(), ApiError> {
    let p = &mut req.params;
    p.max_tokens = capped(state, tenant, p.max_tokens)?;
    p.max_tokens_is_default = p.max_tokens.is_some() && p.max_tokens == own_default;
    Ok(())
}

/// The `max_tokens` a request of `tenant` asking for `asked` gets: the cap when it asked for
/// none, 400 when it asked for more. A tenant with a token budget is charged what a request
/// may generate, so one asking for none gets `backend.default_max_tokens` (what it is
/// charged) rather than whatever an upstream's default is.
fn capped(state: &AppState, tenant: &Tenant, asked: Option<u32>) -> Result<Option<u32>, ApiError> {
    let global = state.config.backend.max_tokens_cap;
    if asked.is_some_and(|n| n > global) {
        return Err(ApiError::invalid(
            format!("`max_tokens` may be at most {global}"),
            Some("max_tokens"),
        ));
    }
    let policy = tenant.policy();
    let cap = policy.max_tokens;
    match asked {
        None if cap == 0 && policy.tokens_per_minute > 0 => {
            Ok(Some(state.config.backend.default_max_tokens))
        }
        _ if cap == 0 => Ok(asked),
        None => Ok(Some(cap)),
        Some(n) if n > cap => Err(ApiError::invalid(
            format!("`max_tokens` may be at most {cap} for this API key"),
            Some("max_tokens"),
        )),
        Some(n) => Ok(Some(n)),
    }
}

/// The tenant's `max_tokens` cap and token budget for a request sent upstream as it came:
/// one above the cap is refused, one without `max_tokens` gets the cap written into its
/// body (as `field`), and the budget is charged `max_tokens` (or the default) for each
/// answer asked.
pub fn cap_forward(
    state: &AppState,
    tenant: &Tenant,
    f: &mut Forward,
    body: Bytes,
    field: BoundField,
) -> Result<Bytes, ApiError> {
    let max_tokens = capped(state, tenant, f.max_tokens)?;
    let charge = max_tokens.unwrap_or(state.config.backend.default_max_tokens);
    tenant.take_tokens(charge.saturating_mul(f.answers))?;
    if max_tokens == f.max_tokens {
        return Ok(body);
    }
    f.max_tokens = max_tokens;
    crate::forward::set_field(&body, field.as_str(), max_tokens.into())
}
