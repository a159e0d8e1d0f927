//! `[auth]` and `[[tenants]]`: API keys, each tenant's policy and its candidate policy, and
//! their validation.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{invalid, Config, ConfigError};

/// `[auth]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// `/v1` answers 401 (`invalid_api_key`) to a request without a known key. Off: a request
    /// with no key or an unknown one is served as the anonymous tenant, which shares nothing
    /// with the configured tenants. Needs at least one `[[tenants]]`.
    pub required: bool,
    /// `[auth.anonymous]`: the anonymous tenant's policy (the fields of `[tenants.policy]`
    /// but the shares: it shares what the tenants with one leave), so callers without a
    /// known key can be held to a rate, a token budget, read-only... Absent: no limits.
    /// Left out of a shared policy document when it sets nothing, so replicas of an earlier
    /// release (which know no such field) still read the documents of this one.
    #[serde(skip_serializing_if = "TenantPolicy::is_unlimited")]
    pub anonymous: TenantPolicy,
}

/// `[[tenants]]`: one application (or customer) and the API keys that name it. The tenant of
/// a request comes from its key (`Authorization: Bearer <key>`), never from a header; every
/// cached answer, conversation link and learned follow-up belongs to one tenant.
///
/// Serialised only into the policy document shared through Redis, whose keys are digests by
/// then (`crate::policy`).
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// Name (1 to 64 letters, digits, `-`, `_`, `.`; not `-`, `anonymous` or `other`); unique.
    pub name: String,
    /// Its API keys: the key itself, or `sha256:<64 hex digits>` of it (so the file holds no
    /// secret).
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// An environment variable holding more keys, comma-separated (same forms).
    #[serde(default)]
    pub api_keys_env: Option<String>,
    /// A file holding more keys, one per line (same forms; blank lines and `#` comments
    /// skipped).
    #[serde(default)]
    pub api_keys_file: Option<PathBuf>,
    /// Whether `x-reprise-namespace` may pick a sub-namespace inside this tenant (off: such a
    /// request gets 403).
    #[serde(default = "yes")]
    pub sub_namespaces: bool,
    /// An environment variable holding this tenant's admin token: `/admin` calls with it
    /// reach only this tenant's entries, namespaces and tags (and explain as this tenant).
    #[serde(default)]
    pub admin_token_env: Option<String>,
    /// What the tenant may do and how its answers are cached.
    #[serde(default)]
    pub policy: TenantPolicy,
    /// A candidate lookup policy tried beside the running one (`[tenants.candidate]`).
    #[serde(default)]
    pub candidate: Option<CandidateConfig>,
}

/// How a candidate policy is tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CandidateMode {
    /// Every request is also looked up under the candidate; what is served does not change.
    Shadow,
    /// `percent` of the requests are served under the candidate, and compared with the rest.
    Canary,
}

/// `[tenants.candidate]`: a candidate of the tenant's lookup policy (its semantic rules),
/// tried in shadow or canary mode. Everything else of the tenant's policy stays.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CandidateConfig {
    /// `shadow` or `canary`.
    pub mode: CandidateMode,
    /// The candidate's semantic rules, in place of `policy.semantic_rules` (same form; a rule
    /// without selectors applies to every namespace and model of the tenant).
    #[serde(default)]
    pub semantic_rules: Vec<reprise_policies::semantic::Rule>,
    /// Canary: the share of requests served under the candidate, in percent (0, 100).
    #[serde(default = "CandidateConfig::default_percent")]
    pub percent: f64,
    /// Canary: requests each side must have answered before the candidate is judged.
    #[serde(default = "CandidateConfig::default_min_requests")]
    pub min_requests: u64,
    /// Canary: rolled back when its error rate exceeds the rest's by more than this (0.02:
    /// two points).
    #[serde(default = "CandidateConfig::default_max_error_rate_increase")]
    pub max_error_rate_increase: f64,
    /// Canary: rolled back when its P95 latency exceeds the rest's by more than this factor.
    #[serde(default = "CandidateConfig::default_max_latency_ratio")]
    pub max_latency_ratio: f64,
    /// Canary: rolled back when its hit rate falls below this share of the rest's (0: not
    /// judged).
    #[serde(default)]
    pub min_hit_rate_ratio: f64,
    /// Canary: rolled back when the share of its hits reported wrong (`POST /v1/feedback`)
    /// exceeds the rest's by more than this.
    #[serde(default = "CandidateConfig::default_max_error_rate_increase")]
    pub max_wrong_hit_rate_increase: f64,
}

impl CandidateConfig {
    fn default_percent() -> f64 {
        10.0
    }
    fn default_min_requests() -> u64 {
        100
    }
    fn default_max_error_rate_increase() -> f64 {
        0.02
    }
    fn default_max_latency_ratio() -> f64 {
        1.5
    }
}

/// `[tenants.policy]`: one tenant's overrides of the global policy.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantPolicy {
    /// Read-only: its requests are answered from the cache or generated, never stored.
    pub read_only: bool,
    /// Models it may ask for (empty: every model served); others get 404 `model_not_found`.
    pub models: Vec<String>,
    /// Largest `max_tokens` it may ask for; a request without one gets this (0: no cap). A
    /// larger request gets 400. At most `backend.max_tokens_cap`.
    pub max_tokens: u32,
    /// Lifetime of the answers it stores, in seconds, at most `cache.ttl_secs` (absent:
    /// `cache.ttl_secs`).
    pub ttl_secs: Option<u64>,
    /// Its stale-while-revalidate window in seconds, at most
    /// `cache.stale_while_revalidate_secs` (absent: that; 0: off for this tenant). Expired
    /// entries are kept for the global windows, so a tenant can only narrow them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_while_revalidate_secs: Option<u64>,
    /// Its stale-if-error window in seconds, at most `cache.stale_if_error_secs` (absent:
    /// that; 0: off for this tenant).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stale_if_error_secs: Option<u64>,
    /// Client controls it may use: any of `no-cache`, `no-store`, `only-if-cached`,
    /// `max-age`, `stale-while-revalidate`, `stale-if-error` (`Cache-Control` directives),
    /// `threshold` (`x-reprise-threshold`), `tags` (`x-reprise-tags`). Using another gets
    /// 403.
    pub controls: Vec<String>,
    /// Requests per minute (0: unlimited); beyond it 429 with `Retry-After`.
    pub requests_per_minute: u32,
    /// Tokens per minute its misses may ask the backend for (0: unlimited): each request
    /// that goes to the backend is charged its `max_tokens` up front; one without is given
    /// (and charged) this tenant's `max_tokens` cap, else `backend.default_max_tokens`, so no
    /// answer is longer than it was charged for. Beyond the budget 429 with `Retry-After`, and
    /// a request larger than a whole minute's budget 400. Cache hits cost nothing. A
    /// passthrough request that is not a read (embeddings, moderations, ...) is charged its
    /// input, a token for every 4 bytes of its body (uploads, multipart, are not charged). At least
    /// what a request without `max_tokens` is charged.
    pub tokens_per_minute: u32,
    /// Semantic overrides for this tenant, before the global `[[semantic.rules]]`: the first
    /// rule whose `namespace` (inside the tenant) and `model` match sets `enabled`,
    /// `threshold`, `top_k`, `gate`, `standalone`, `context_equivalence`,
    /// `followup_threshold`.
    pub semantic_rules: Vec<reprise_policies::semantic::Rule>,
    /// Its share of the memory tier (`cache.memory_bytes`), in (0, 1]: its entries and keys
    /// are held within that share, so its flood evicts only its own entries. Tenants without
    /// a share (and the anonymous tenant) share what the others leave. The shares of all
    /// tenants add up to at most 1.
    pub memory_share: Option<f64>,
    /// Its share of the prefetch budgets (`prefetch.max_tokens_per_minute`, and
    /// `prefetch.max_backend_share` or, where the backend tells its capacity, the background
    /// slots of `prefetch.max_capacity_share`, at least one) and of the prefetch queue, in
    /// (0, 1]; tenants without one share what the others leave. The shares add up to at most 1.
    pub prefetch_share: Option<f64>,
    /// Its bound on the share of wrong semantic hits, in place of `semantic.delta`.
    pub delta: Option<f64>,
    /// The priority of its requests that send no `x-reprise-priority`: `interactive` or
    /// `batch` (absent: `max_priority`, so interactive unless capped).
    pub priority: Option<UserPriority>,
    /// The highest priority its requests get: `interactive` (no cap) or `batch`. A request
    /// asking for more (`x-reprise-priority: interactive` from a tenant capped at `batch`) is
    /// served at the cap, not refused: the header is a wish, the policy decides.
    pub max_priority: UserPriority,
}

/// A priority a client may ask for (`x-reprise-priority`) or a tenant's policy may set;
/// background work (prefetch, refresh, checks of hits) is below both and never chosen by a
/// client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UserPriority {
    /// A user waits for the answer: served first.
    #[default]
    Interactive,
    /// Work that can wait: served after interactive requests (aged into interactive after
    /// `backend.priority_aging_secs`), before background work.
    Batch,
}

impl UserPriority {
    /// The value of `x-reprise-priority` (ASCII case and surrounding spaces ignored).
    pub fn parse(value: &str) -> Option<UserPriority> {
        let v = value.trim();
        if v.eq_ignore_ascii_case("interactive") {
            Some(UserPriority::Interactive)
        } else if v.eq_ignore_ascii_case("batch") {
            Some(UserPriority::Batch)
        } else {
            None
        }
    }

    /// The backends' scheduling class.
    pub fn class(self) -> reprise_backend::Priority {
        match self {
            UserPriority::Interactive => reprise_backend::Priority::Interactive,
            UserPriority::Batch => reprise_backend::Priority::Batch,
        }
    }
}

impl TenantPolicy {
    /// The priority a request of this tenant is served at: what it asked for (`asked`) or
    /// else the tenant's default, never above `max_priority`.
    pub fn priority(&self, asked: Option<UserPriority>) -> UserPriority {
        asked
            .or(self.priority)
            .unwrap_or_default()
            .max(self.max_priority)
    }
}

/// The client controls a tenant may be allowed.
pub const CLIENT_CONTROLS: &[&str] = &[
    "no-cache",
    "no-store",
    "only-if-cached",
    "max-age",
    "stale-while-revalidate",
    "stale-if-error",
    "threshold",
    "tags",
];

impl TenantPolicy {
    /// Whether it is the default policy (no limit, no override).
    pub fn is_unlimited(&self) -> bool {
        *self == TenantPolicy::default()
    }
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy {
            read_only: false,
            models: Vec::new(),
            max_tokens: 0,
            ttl_secs: None,
            stale_while_revalidate_secs: None,
            stale_if_error_secs: None,
            controls: CLIENT_CONTROLS.iter().map(|c| c.to_string()).collect(),
            requests_per_minute: 0,
            tokens_per_minute: 0,
            semantic_rules: Vec::new(),
            memory_share: None,
            prefetch_share: None,
            delta: None,
            priority: None,
            max_priority: UserPriority::Interactive,
        }
    }
}

impl TenantPolicy {
    /// Its stale windows: its own where set, else the global ones (`global`, from `[cache]`).
    pub fn stale_windows(
        &self,
        global: reprise_policies::cache::StaleWindows,
    ) -> reprise_policies::cache::StaleWindows {
        reprise_policies::cache::StaleWindows {
            while_revalidate_secs: self
                .stale_while_revalidate_secs
                .unwrap_or(global.while_revalidate_secs),
            if_error_secs: self.stale_if_error_secs.unwrap_or(global.if_error_secs),
        }
    }
}

fn yes() -> bool {
    true
}

impl TenantConfig {
    /// A tenant known by one API key, with namespaces of its own and the default policy.
    pub fn with_key(name: &str, key: &str) -> Self {
        TenantConfig {
            name: name.into(),
            api_keys: vec![key.into()],
            api_keys_env: None,
            api_keys_file: None,
            sub_namespaces: true,
            admin_token_env: None,
            candidate: None,
            policy: TenantPolicy::default(),
        }
    }
}

impl std::fmt::Debug for TenantConfig {
    // Keys are secrets: never in Debug output or logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantConfig")
            .field("name", &self.name)
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("api_keys_env", &self.api_keys_env)
            .field("api_keys_file", &self.api_keys_file)
            .field("sub_namespaces", &self.sub_namespaces)
            .field("admin_token_env", &self.admin_token_env)
            .field("policy", &self.policy)
            .field("candidate", &self.candidate)
            .finish()
    }
}

/// Endpoints whose objects (files, threads, batches, ...) live in the upstream account: not
/// open to the upstream once tenants share it.
pub const STATEFUL_ROOTS: &[&str] = &[
    "assistants",
    "batches",
    "containers",
    "conversations",
    "evals",
    "files",
    "fine_tuning",
    "responses",
    "threads",
    "uploads",
    "vector_stores",
];

/// Names no tenant may take: how the admin API and the metrics name the anonymous tenant,
/// and how the statistics name the tenants past their bound.
pub const RESERVED_TENANT_NAMES: [&str; 3] = ["-", "anonymous", crate::stats::rollup::OTHER];

/// Validates one policy (a tenant's at `tenants.policy`, `tenant` its name; or the
/// anonymous tenant's at `auth.anonymous`) against the rest of `config`.
fn check_policy(
    config: &Config,
    policy: &TenantPolicy,
    at: &'static str,
    tenant: Option<&str>,
) -> Result<(), ConfigError> {
    let key = |field: &str| format!("{at}.{field}");
    let who = match tenant {
        Some(name) => format!("tenant `{name}`"),
        None => "the anonymous tenant".to_string(),
    };
    if let Some(c) = policy
        .controls
        .iter()
        .find(|c| !CLIENT_CONTROLS.contains(&c.as_str()))
    {
        return Err(invalid(
            key("controls"),
            format!("{who}: unknown control `{c}`"),
        ));
    }
    if policy
        .ttl_secs
        .is_some_and(|ttl| ttl == 0 || ttl > config.cache.ttl_secs)
    {
        // Keys live at most cache.ttl_secs in memory: a longer lifetime would leave
        // answers no key leads to.
        return Err(invalid(
            key("ttl_secs"),
            format!("{who}: must be positive and at most cache.ttl_secs"),
        ));
    }
    for (field, window, global) in [
        (
            "stale_while_revalidate_secs",
            policy.stale_while_revalidate_secs,
            config.cache.stale_while_revalidate_secs,
        ),
        (
            "stale_if_error_secs",
            policy.stale_if_error_secs,
            config.cache.stale_if_error_secs,
        ),
    ] {
        // Expired entries are kept only as long as the global windows say.
        if window.is_some_and(|w| w > global) {
            return Err(invalid(
                key(field),
                format!("{who}: must be at most cache.{field}"),
            ));
        }
    }
    let global_cap = config.backend.max_tokens_cap;
    if policy.max_tokens > global_cap {
        return Err(invalid(
            key("max_tokens"),
            format!("{who}: above backend.max_tokens_cap ({global_cap})"),
        ));
    }
    let unasked = match policy.max_tokens {
        0 => config.backend.default_max_tokens,
        cap => cap,
    };
    if policy.tokens_per_minute > 0 && policy.tokens_per_minute < unasked {
        // Every request without `max_tokens` would be refused, naming a field it never
        // sent.
        return Err(invalid(
            key("tokens_per_minute"),
            format!(
                "{who}: below what a request without `max_tokens` is charged \
                 ({unasked}: its max_tokens, else backend.default_max_tokens)"
            ),
        ));
    }
    if policy.priority.is_some_and(|p| p < policy.max_priority) {
        return Err(invalid(
            key("priority"),
            format!("{who}: above its max_priority (interactive is above batch)"),
        ));
    }
    if tenant.is_none() {
        // The anonymous tenant shares what the tenants with a share leave.
        for (field, share) in [
            ("memory_share", policy.memory_share),
            ("prefetch_share", policy.prefetch_share),
        ] {
            if share.is_some() {
                return Err(invalid(
                    key(field),
                    format!("{who} shares what the tenants with a share leave"),
                ));
            }
        }
    }
    let rules_at = match tenant {
        Some(_) => "tenants.policy.semantic_rules",
        None => "auth.anonymous.semantic_rules",
    };
    super::check_rules(&policy.semantic_rules, rules_at, tenant)
}

/// Validates `[auth]` and `[[tenants]]` (names, controls, lifetimes, rules, keys, candidates,
/// shares) against the rest of `config`.
pub(super) fn validate_tenants(config: &Config) -> Result<(), ConfigError> {
    check_policy(config, &config.auth.anonymous, "auth.anonymous", None)?;
    if config.auth.required && config.tenants.is_empty() {
        return Err(invalid(
            "auth.required",
            "needs at least one [[tenants]] entry with API keys",
        ));
    }
    if !config.tenants.is_empty() {
        // One upstream account holds every tenant's objects: a tenant listing or reading
        // them would see the others'.
        let open = config
            .forwarding_backend()
            .map(|b| b.passthrough.as_slice());
        if let Some(e) = open
            .unwrap_or_default()
            .iter()
            .find(|e| STATEFUL_ROOTS.contains(&e.as_str()))
        {
            return Err(invalid(
                "backend.passthrough",
                format!(
                    "`{e}` keeps objects in the upstream account, which [[tenants]] would share \
                     (stateless endpoints only: embeddings, moderations, models, audio, images)"
                ),
            ));
        }
    }
    let mut names = std::collections::HashSet::new();
    for t in &config.tenants {
        let ok = (1..=crate::auth::MAX_TENANT_NAME_BYTES).contains(&t.name.len())
            && t.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(invalid(
                "tenants.name",
                format!(
                    "`{}`: 1 to 64 letters, digits, `-`, `_` or `.`",
                    t.name.escape_debug()
                ),
            ));
        }
        if RESERVED_TENANT_NAMES.contains(&t.name.as_str()) {
            // `-` names the anonymous tenant in the admin API, `anonymous` is its label in
            // the metrics and statistics, `other` the statistics' row of the tenants past
            // their bound: a tenant by any of them would share those views.
            return Err(invalid(
                "tenants.name",
                format!("`{}` is a reserved name", t.name),
            ));
        }
        if !names.insert(t.name.as_str()) {
            return Err(invalid("tenants.name", format!("`{}` twice", t.name)));
        }
        check_policy(config, &t.policy, "tenants.policy", Some(&t.name))?;
        let name = Some(t.name.as_str());
        if let Some(c) = &t.candidate {
            let bad = |key, reason: &str| invalid(key, format!("tenant `{}`: {reason}", t.name));
            if c.mode == CandidateMode::Canary && !(c.percent > 0.0 && c.percent < 100.0) {
                return Err(bad("tenants.candidate.percent", "must be in (0, 100)"));
            }
            if c.min_requests == 0 {
                return Err(bad("tenants.candidate.min_requests", "must be positive"));
            }
            if !(c.max_error_rate_increase >= 0.0 && c.max_error_rate_increase <= 1.0) {
                return Err(bad(
                    "tenants.candidate.max_error_rate_increase",
                    "must be in [0, 1]",
                ));
            }
            if !(c.max_latency_ratio >= 1.0 && c.max_latency_ratio.is_finite()) {
                return Err(bad(
                    "tenants.candidate.max_latency_ratio",
                    "must be at least 1",
                ));
            }
            if !(0.0..=1.0).contains(&c.max_wrong_hit_rate_increase) {
                return Err(bad(
                    "tenants.candidate.max_wrong_hit_rate_increase",
                    "must be in [0, 1]",
                ));
            }
            if !(0.0..=1.0).contains(&c.min_hit_rate_ratio) {
                return Err(bad(
                    "tenants.candidate.min_hit_rate_ratio",
                    "must be in [0, 1]",
                ));
            }
            super::check_rules(&c.semantic_rules, "tenants.candidate.semantic_rules", name)?;
        }
        for (key, share) in [
            ("tenants.policy.memory_share", t.policy.memory_share),
            ("tenants.policy.prefetch_share", t.policy.prefetch_share),
        ] {
            if share.is_some_and(|s| !(s > 0.0 && s <= 1.0)) {
                return Err(invalid(
                    key,
                    format!("tenant `{}`: must be in (0, 1]", t.name),
                ));
            }
        }
        for k in &t.api_keys {
            crate::auth::KeyDigest::parse(k)
                .map_err(|e| invalid("tenants.api_keys", format!("tenant `{}`: {e}", t.name)))?;
        }
    }
    for (key, sum) in [
        (
            "tenants.policy.memory_share",
            config
                .tenants
                .iter()
                .filter_map(|t| t.policy.memory_share)
                .sum::<f64>(),
        ),
        (
            "tenants.policy.prefetch_share",
            config
                .tenants
                .iter()
                .filter_map(|t| t.policy.prefetch_share)
                .sum::<f64>(),
        ),
    ] {
        // A little slack for shares like 0.1 written ten times.
        if sum > 1.0 + 1e-9 {
            return Err(invalid(
                key,
                format!("the tenants' shares add up to {sum}, above 1"),
            ));
        }
        // Whole shares leave nothing to the tenants without one (the anonymous tenant
        // included, when keys are not required): refused rather than caching nothing.
        let someone_without = !config.auth.required
            || config.tenants.iter().any(|t| match key {
                "tenants.policy.memory_share" => t.policy.memory_share.is_none(),
                _ => t.policy.prefetch_share.is_none(),
            });
        if sum > 1.0 - 1e-9 && someone_without {
            return Err(invalid(
                key,
                "the shares add up to 1, leaving nothing to the tenants without one",
            ));
        }
    }
    Ok(())
}
