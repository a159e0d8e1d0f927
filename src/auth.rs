//! Who is asking: API keys name the tenant.
//!
//! A request's tenant comes from its key (`Authorization: Bearer <key>`), never from a
//! header; `x-reprise-namespace` only picks a sub-namespace inside it. Every cache key,
//! partition, conversation link and learned follow-up is computed over the *scoped* namespace
//! [`Tenant::namespace`] returns, so no header can reach another tenant's entries.
//!
//! Without `[[tenants]]` there is one implicit, anonymous tenant whose namespaces are the
//! header values as they are (reprise as it was before tenants, keys of existing entries
//! unchanged). A configured tenant's namespaces are `<tenant>␟<sub-namespace>`: the separator
//! is a control character that no header value can carry, so an anonymous request cannot
//! name a tenant's namespace either.
//!
//! Keys are kept as SHA-256 digests (the config may hold only digests); a presented key is
//! hashed and looked up, so the lookup's timing says nothing about the stored keys.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use anyhow::Context as _;
use axum::http::{header, HeaderMap};
use governor::clock::QuantaInstant;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, NotUntil, Quota, RateLimiter};
use sha2::{Digest as _, Sha256};

use crate::candidate::{Arm, Candidate};
use crate::config::{Config, TenantPolicy};
use crate::error::ApiError;
use crate::headers::{DEFAULT_NAMESPACE, NAMESPACE_HEADER};

/// Separates a configured tenant's name from its sub-namespace in a scoped namespace.
const SCOPE_SEP: char = '\u{1f}';
/// Longest tenant name, in bytes.
pub const MAX_TENANT_NAME_BYTES: usize = 64;

/// Longest API key accepted (longer ones are simply unknown).
const MAX_KEY_BYTES: usize = 512;

/// The SHA-256 digest of an API key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyDigest([u8; 32]);

impl KeyDigest {
    /// The digest of a presented key.
    pub fn of(key: &str) -> Self {
        KeyDigest(Sha256::digest(key.as_bytes()).into())
    }

    /// A configured key: `sha256:<64 hex digits>`, or the key itself (1 to 512 visible ASCII
    /// characters).
    pub fn parse(configured: &str) -> Result<Self, String> {
        if let Some(hex_digits) = configured.strip_prefix("sha256:") {
            let mut d = [0u8; 32];
            hex::decode_to_slice(hex_digits, &mut d)
                .map_err(|_| "a `sha256:` key needs 64 hex digits".to_string())?;
            return Ok(KeyDigest(d));
        }
        if configured.is_empty()
            || configured.len() > MAX_KEY_BYTES
            || !configured.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err("a key is 1 to 512 visible ASCII characters".into());
        }
        Ok(KeyDigest::of(configured))
    }
}

/// The configured form of a digest, `sha256:<64 hex digits>` ([`KeyDigest::parse`] reads it
/// back): what a key may be written as where the key itself must not be.
impl std::fmt::Display for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

/// Who a request comes from.
pub struct Tenant {
    /// The configured name; `None` for the anonymous tenant.
    name: Option<String>,
    /// Whether `x-reprise-namespace` may pick a sub-namespace.
    sub_namespaces: bool,
    /// What it may do (the anonymous tenant: `[auth.anonymous]`).
    policy: TenantPolicy,
    /// `policy.requests_per_minute`, when set (kept across policy versions that keep it).
    limiter: Option<Arc<DefaultDirectRateLimiter>>,
    /// `policy.tokens_per_minute`, when set (kept likewise).
    token_limiter: Option<Arc<DefaultDirectRateLimiter>>,
    /// The digest of its admin token (from `admin_token_env`), when it has one.
    admin_token: Option<blake3::Hash>,
    /// Its candidate policy (`[tenants.candidate]`), kept across versions that keep it.
    candidate: Option<Arc<Candidate>>,
}

impl Tenant {
    /// A tenant; `before` is the same tenant in the running policies, whose rate limiters it
    /// keeps where its rates did not change (a policy change is no way around a limit).
    fn new(
        name: Option<String>,
        sub_namespaces: bool,
        policy: TenantPolicy,
        before: Option<&Tenant>,
    ) -> Tenant {
        let per_minute = |n: u32, kept: Option<&Arc<DefaultDirectRateLimiter>>, was: u32| {
            let n = NonZeroU32::new(n)?;
            match kept {
                Some(l) if was == n.get() => Some(l.clone()),
                _ => Some(Arc::new(RateLimiter::direct(Quota::per_minute(n)))),
            }
        };
        let limiter = per_minute(
            policy.requests_per_minute,
            before.and_then(|t| t.limiter.as_ref()),
            before.map_or(0, |t| t.policy.requests_per_minute),
        );
        let token_limiter = per_minute(
            policy.tokens_per_minute,
            before.and_then(|t| t.token_limiter.as_ref()),
            before.map_or(0, |t| t.policy.tokens_per_minute),
        );
        Tenant {
            name,
            sub_namespaces,
            limiter,
            token_limiter,
            policy,
            admin_token: None,
            candidate: None,
        }
    }

    /// Its candidate policy, while it has one.
    pub fn candidate(&self) -> Option<&Arc<Candidate>> {
        self.candidate.as_ref()
    }

    /// The semantic rules its requests on `arm` are looked up under: the candidate's on the
    /// candidate's side, else its own.
    pub fn semantic_rules(&self, arm: Arm) -> &[reprise_policies::semantic::Rule] {
        match (arm, &self.candidate) {
            (Arm::Candidate, Some(c)) => &c.config().semantic_rules,
            _ => &self.policy.semantic_rules,
        }
    }

    /// Its policy.
    pub fn policy(&self) -> &TenantPolicy {
        &self.policy
    }

    /// Charges `tokens` against its token budget (a request about to go to the backend): 429
    /// with the seconds until they fit, or 400 when they never fit in a minute's budget.
    pub fn take_tokens(&self, tokens: u32) -> Result<(), ApiError> {
        self.charge(tokens, "`max_tokens`", "max_tokens")
    }

    /// Whether it has a token budget (`tokens_per_minute`).
    pub fn has_token_budget(&self) -> bool {
        self.token_limiter.is_some()
    }

    /// Charges what a passthrough request's body of `bytes` bytes is estimated to cost: a
    /// token for every [`BYTES_PER_TOKEN`] bytes (the estimate OpenAI's own rate limits make
    /// of a request's input). 429 or 400 as [`Tenant::take_tokens`].
    pub fn take_body_tokens(&self, bytes: usize) -> Result<(), ApiError> {
        let tokens = u32::try_from(bytes.div_ceil(BYTES_PER_TOKEN).max(1)).unwrap_or(u32::MAX);
        self.charge(tokens, "the request body's estimated", "input")
    }

    /// Charges `tokens`; `what` and `param` name them in a refusal that can never fit.
    fn charge(&self, tokens: u32, what: &str, param: &str) -> Result<(), ApiError> {
        let Some(limiter) = &self.token_limiter else {
            return Ok(());
        };
        // Nothing is free: a charge of 0 (a bound that slipped through) costs one token.
        let n = NonZeroU32::new(tokens).unwrap_or(NonZeroU32::MIN);
        match limiter.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(ApiError::RateLimited {
                retry_after_secs: retry_after(&not_until),
            }),
            Err(_) => Err(ApiError::invalid(
                format!(
                    "{what} {tokens} tokens exceed this API key's budget of {} tokens a minute",
                    self.policy.tokens_per_minute
                ),
                Some(param),
            )),
        }
    }

    /// Counts one request against its rate limit: 429 with the seconds until the next one
    /// is allowed.
    pub fn take_request(&self) -> Result<(), ApiError> {
        let Some(limiter) = &self.limiter else {
            return Ok(());
        };
        limiter.check().map_err(|not_until| ApiError::RateLimited {
            retry_after_secs: retry_after(&not_until),
        })
    }

    /// The configured name, or "" for the anonymous tenant.
    pub fn name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }

    /// The scoped namespace of a request that sent `header` (`x-reprise-namespace`, already
    /// checked for length and characters).
    pub fn namespace(&self, header: Option<&str>) -> Result<String, ApiError> {
        let Some(name) = &self.name else {
            return Ok(header.unwrap_or(DEFAULT_NAMESPACE).to_string());
        };
        if header.is_some() && !self.sub_namespaces {
            return Err(ApiError::Forbidden(format!(
                "this API key may not choose a namespace (`{NAMESPACE_HEADER}`)"
            )));
        }
        Ok(scope(name, header.unwrap_or(DEFAULT_NAMESPACE)))
    }
}

/// Bytes of a passthrough request's body charged as one token against a token budget.
pub const BYTES_PER_TOKEN: usize = 4;

/// Whole seconds (at least 1) until a refused rate-limited request may be tried again.
fn retry_after(not_until: &NotUntil<QuantaInstant>) -> u64 {
    let wait = not_until.wait_time_from(DefaultClock::default().now());
    wait.as_secs_f64().ceil().max(1.0) as u64
}

/// The scoped namespace `sub` of tenant `tenant`.
pub(crate) fn scope(tenant: &str, sub: &str) -> String {
    format!("{tenant}{SCOPE_SEP}{sub}")
}

/// The tenant part of a scoped namespace ("" for the anonymous tenant): the scope of the
/// embedder's text cache, so one tenant's texts never answer another's faster.
pub fn scope_of(namespace: &str) -> &str {
    namespace
        .split_once(SCOPE_SEP)
        .map_or("", |(tenant, _)| tenant)
}

/// The sub-namespace part of a scoped namespace (for logs).
pub fn sub_namespace(namespace: &str) -> &str {
    namespace
        .split_once(SCOPE_SEP)
        .map_or(namespace, |(_, sub)| sub)
}

/// The configured tenants, by key.
pub struct Tenants {
    by_key: HashMap<KeyDigest, Arc<Tenant>>,
    by_name: HashMap<String, Arc<Tenant>>,
    anonymous: Arc<Tenant>,
    required: bool,
}

impl Tenants {
    /// Reads every tenant's keys (config, environment variable, file). A key given to two
    /// tenants, or a tenant left without keys, is an error. `before` are the running tenants
    /// (on a policy change): their rate limiters carry over where the rates stay.
    pub fn load(config: &Config, before: Option<&Tenants>) -> anyhow::Result<Tenants> {
        let mut by_key = HashMap::new();
        let mut by_name = HashMap::new();
        // Admin tokens must each name one admin: a tenant's equal to another's, or to the
        // global admin's or the metrics token, would widen what it reaches.
        let server_tokens: Vec<blake3::Hash> = [
            &config.server.admin_token_env,
            &config.server.metrics_token_env,
        ]
        .into_iter()
        .filter_map(crate::admin::configured_secret)
        .map(|t| crate::admin::secret_digest(&t))
        .collect();
        let mut admin_tokens: Vec<blake3::Hash> = Vec::new();
        for t in &config.tenants {
            let was = before.and_then(|b| b.by_name.get(&t.name));
            let mut tenant = Tenant::new(
                Some(t.name.clone()),
                t.sub_namespaces,
                t.policy.clone(),
                was.map(|t| &**t),
            );
            if let Some(var) = &t.admin_token_env {
                let token = std::env::var(var).with_context(|| {
                    format!(
                        "tenant `{}`: admin_token_env names `{var}`, which is not set",
                        t.name
                    )
                })?;
                anyhow::ensure!(!token.is_empty(), "tenant `{}`: empty admin token", t.name);
                let digest = crate::admin::secret_digest(&token);
                anyhow::ensure!(
                    !admin_tokens.contains(&digest),
                    "tenant `{}`: its admin token is another tenant's",
                    t.name
                );
                anyhow::ensure!(
                    !server_tokens.contains(&digest),
                    "tenant `{}`: its admin token is the server's admin or metrics token",
                    t.name
                );
                admin_tokens.push(digest);
                tenant.admin_token = Some(digest);
            }
            tenant.candidate = crate::candidate::carry(
                t.candidate.as_ref(),
                was.and_then(|w| w.candidate.as_ref()),
            );
            let tenant = Arc::new(tenant);
            by_name.insert(t.name.clone(), tenant.clone());
            let mut keys: Vec<String> = t.api_keys.clone();
            if let Some(var) = &t.api_keys_env {
                let v = std::env::var(var).with_context(|| {
                    format!(
                        "tenant `{}`: api_keys_env names `{var}`, which is not set",
                        t.name
                    )
                })?;
                keys.extend(v.split(',').map(str::trim).map(str::to_string));
            }
            if let Some(path) = &t.api_keys_file {
                let text = std::fs::read_to_string(path).with_context(|| {
                    format!("tenant `{}`: cannot read {}", t.name, path.display())
                })?;
                keys.extend(
                    text.lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty() && !l.starts_with('#'))
                        .map(str::to_string),
                );
            }
            keys.retain(|k| !k.is_empty());
            anyhow::ensure!(!keys.is_empty(), "tenant `{}` has no API keys", t.name);
            for k in keys {
                let d = KeyDigest::parse(&k)
                    .map_err(|e| anyhow::anyhow!("tenant `{}`: {e}", t.name))?;
                if let Some(other) = by_key.insert(d, tenant.clone()) {
                    anyhow::bail!(
                        "one API key names two tenants (`{}` and `{}`)",
                        other.name(),
                        t.name
                    );
                }
            }
        }
        Ok(Tenants {
            by_key,
            by_name,
            anonymous: Arc::new(Tenant::new(
                None,
                true,
                config.auth.anonymous.clone(),
                before.map(|b| &*b.anonymous),
            )),
            required: config.auth.required,
        })
    }

    /// The tenant a scoped namespace belongs to (background work knows only the namespace).
    pub fn for_namespace(&self, namespace: &str) -> &Tenant {
        match self.by_name.get(scope_of(namespace)) {
            Some(t) => t,
            None => &self.anonymous,
        }
    }

    /// The scoped namespace `sub` of the configured tenant `tenant` (for the admin API).
    pub fn scoped(&self, tenant: &str, sub: &str) -> Option<String> {
        self.by_name
            .contains_key(tenant)
            .then(|| scope(tenant, sub))
    }

    /// The tenant whose admin token has the digest `given` (each compared in constant time).
    pub fn by_admin_token(&self, given: &blake3::Hash) -> Option<Arc<Tenant>> {
        let mut found = None;
        // Every token is compared, so the time says nothing of which tenant matched.
        for t in self.by_name.values() {
            if let Some(token) = &t.admin_token {
                if crate::admin::same_digest(given, token) {
                    found = Some(t.clone());
                }
            }
        }
        found
    }

    /// The configured tenant `name`.
    pub fn named(&self, name: &str) -> Option<Arc<Tenant>> {
        self.by_name.get(name).cloned()
    }

    /// The anonymous tenant.
    pub fn anonymous(&self) -> Arc<Tenant> {
        self.anonymous.clone()
    }

    /// How many keys name tenant `name`.
    pub fn key_count(&self, name: &str) -> usize {
        self.by_key
            .values()
            .filter(|t| t.name.as_deref() == Some(name))
            .count()
    }

    /// Whether any tenant is configured.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// [`Tenants::identify`], then one request counted against the tenant's rate limit.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        let tenant = self.identify(headers)?;
        tenant.take_request()?;
        Ok(tenant)
    }

    /// The tenant of a request: the one its key names, else the anonymous tenant unless keys
    /// are required (then 401 `invalid_api_key`).
    pub fn identify(&self, headers: &HeaderMap) -> Result<Arc<Tenant>, ApiError> {
        if self.by_key.is_empty() {
            return Ok(self.anonymous.clone());
        }
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, key) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            })
            .filter(|k| !k.is_empty() && k.len() <= MAX_KEY_BYTES);
        match key.and_then(|k| self.by_key.get(&KeyDigest::of(k))) {
            Some(t) => Ok(t.clone()),
            None if self.required => Err(ApiError::InvalidApiKey),
            None => Ok(self.anonymous.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TenantConfig;

    fn tenant(name: &str, keys: &[&str], sub_namespaces: bool) -> TenantConfig {
        TenantConfig {
            name: name.into(),
            api_keys: keys.iter().map(|k| k.to_string()).collect(),
            api_keys_env: None,
            api_keys_file: None,
            sub_namespaces,
            admin_token_env: None,
            candidate: None,
            policy: TenantPolicy::default(),
        }
    }

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {key}").parse().unwrap(),
        );
        h
    }

    fn tenants(required: bool) -> Tenants {
        let mut c = Config::default();
        c.auth.required = required;
        let digest = hex::encode(Sha256::digest(b"sk-beta"));
        c.tenants = vec![
            tenant("acme", &["sk-acme"], true),
            tenant("beta", &[&format!("sha256:{digest}")], false),
        ];
        Tenants::load(&c, None).unwrap()
    }

    /// An admin token names one admin: a tenant's equal to another's, or to the server's
    /// admin or metrics token, is refused at load (it would reach more than its tenant).
    #[test]
    fn an_admin_token_shared_with_another_admin_is_refused() {
        std::env::set_var("REPRISE_UNIT_TENANT_ADMIN_A", "t0ken-a");
        std::env::set_var("REPRISE_UNIT_TENANT_ADMIN_B", "t0ken-b");
        std::env::set_var("REPRISE_UNIT_TENANT_ADMIN_SAME", "t0ken-a");
        let with_admin = |name: &str, key: &str, var: &str| TenantConfig {
            admin_token_env: Some(var.into()),
            ..tenant(name, &[key], true)
        };
        let mut c = Config {
            tenants: vec![
                with_admin("acme", "sk-acme", "REPRISE_UNIT_TENANT_ADMIN_A"),
                with_admin("beta", "sk-beta", "REPRISE_UNIT_TENANT_ADMIN_B"),
            ],
            ..Config::default()
        };
        let t = Tenants::load(&c, None).expect("distinct tokens");
        let given = crate::admin::secret_digest("t0ken-b");
        assert_eq!(t.by_admin_token(&given).unwrap().name(), "beta");

        c.tenants[1].admin_token_env = Some("REPRISE_UNIT_TENANT_ADMIN_SAME".into());
        let e = Tenants::load(&c, None).err().expect("a shared token");
        assert!(e.to_string().contains("another tenant's"), "{e}");

        c.tenants[1].admin_token_env = Some("REPRISE_UNIT_TENANT_ADMIN_B".into());
        for server in ["admin", "metrics"] {
            let mut c = c.clone();
            let var = Some("REPRISE_UNIT_TENANT_ADMIN_B".to_string());
            match server {
                "admin" => c.server.admin_token_env = var,
                _ => c.server.metrics_token_env = var,
            }
            let e = Tenants::load(&c, None).err().expect("the server's token");
            assert!(e.to_string().contains("server's admin or metrics"), "{e}");
        }
    }

    #[test]
    fn keys_name_tenants_plain_or_as_digests() {
        let t = tenants(true);
        assert_eq!(t.identify(&bearer("sk-acme")).unwrap().name(), "acme");
        assert_eq!(t.identify(&bearer("sk-beta")).unwrap().name(), "beta");
        let mut lower = HeaderMap::new();
        lower.insert(header::AUTHORIZATION, "bearer sk-acme".parse().unwrap());
        assert_eq!(t.identify(&lower).unwrap().name(), "acme");
        for bad in [bearer("sk-nope"), bearer(""), HeaderMap::new()] {
            assert!(matches!(t.identify(&bad), Err(ApiError::InvalidApiKey)));
        }
        // A digest is not a key.
        let digest = hex::encode(Sha256::digest(b"sk-beta"));
        assert!(t.identify(&bearer(&format!("sha256:{digest}"))).is_err());
    }

    #[test]
    fn without_required_keys_unknown_callers_are_anonymous() {
        let t = tenants(false);
        let anon = t.identify(&bearer("unused")).unwrap();
        assert_eq!(anon.name(), "");
        assert_eq!(t.identify(&HeaderMap::new()).unwrap().name(), "");
        assert_eq!(t.identify(&bearer("sk-acme")).unwrap().name(), "acme");
        // No tenants at all: everyone is anonymous, keys or not.
        let none = Tenants::load(&Config::default(), None).unwrap();
        assert!(none.is_empty());
        assert_eq!(none.identify(&bearer("sk-acme")).unwrap().name(), "");
    }

    #[test]
    fn namespaces_are_scoped_to_the_tenant() {
        let t = tenants(true);
        let acme = t.identify(&bearer("sk-acme")).unwrap();
        let beta = t.identify(&bearer("sk-beta")).unwrap();
        let ns = acme.namespace(Some("support")).unwrap();
        assert_eq!((scope_of(&ns), sub_namespace(&ns)), ("acme", "support"));
        assert_ne!(acme.namespace(None).unwrap(), beta.namespace(None).unwrap());
        // beta may not pick one.
        assert!(matches!(
            beta.namespace(Some("x")),
            Err(ApiError::Forbidden(_))
        ));
        // The anonymous tenant keeps header values as they are, and no header value can be
        // a tenant's scoped namespace (the separator is not visible ASCII).
        let anon = tenants(false).identify(&HeaderMap::new()).unwrap();
        assert_eq!(anon.namespace(Some("acme")).unwrap(), "acme");
        assert_eq!(anon.namespace(None).unwrap(), DEFAULT_NAMESPACE);
        assert_eq!(scope_of("acme"), "");
        assert!(axum::http::HeaderValue::from_str(&ns)
            .ok()
            .and_then(|v| v.to_str().ok().map(str::to_string))
            .is_none());
    }

    #[test]
    fn a_key_of_two_tenants_or_a_tenant_without_keys_is_refused() {
        let mut c = Config {
            tenants: vec![tenant("a", &["k1"], true), tenant("b", &["k1"], true)],
            ..Config::default()
        };
        let err = Tenants::load(&c, None).err().unwrap().to_string();
        assert!(err.contains("two tenants"), "{err}");
        c.tenants = vec![tenant("a", &[], true)];
        let err = Tenants::load(&c, None).err().unwrap().to_string();
        assert!(err.contains("no API keys"), "{err}");
        assert!(KeyDigest::parse("sha256:abc").is_err());
        // The written form of a digest reads back as the same digest.
        let d = KeyDigest::of("sk-acme");
        assert_eq!(
            d.to_string(),
            format!("sha256:{}", hex::encode(Sha256::digest(b"sk-acme")))
        );
        assert_eq!(KeyDigest::parse(&d.to_string()), Ok(d));
        assert!(KeyDigest::parse("has space").is_err());
    }

    #[test]
    fn rate_limits_carry_over_a_policy_change_that_keeps_them() {
        let mut c = Config::default();
        let mut t = tenant("acme", &["sk-acme"], true);
        t.policy.requests_per_minute = 1;
        c.tenants = vec![t];
        let first = Tenants::load(&c, None).unwrap();
        let acme = first.named("acme").unwrap();
        acme.take_request().unwrap();
        assert!(acme.take_request().is_err());
        // A new version with the same rate: still spent.
        let same = Tenants::load(&c, Some(&first)).unwrap();
        assert!(same.named("acme").unwrap().take_request().is_err());
        // Without the running tenants (a restart), or with another rate: a fresh budget.
        assert!(Tenants::load(&c, None)
            .unwrap()
            .named("acme")
            .unwrap()
            .take_request()
            .is_ok());
        c.tenants[0].policy.requests_per_minute = 2;
        let changed = Tenants::load(&c, Some(&same)).unwrap();
        assert!(changed.named("acme").unwrap().take_request().is_ok());
    }
}
