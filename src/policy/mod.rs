//! The policies that can change while reprise runs: the semantic defaults and rules, `[auth]`
//! and the tenants with their keys and policies.
//!
//! They live in one [`Policies`] value behind an `ArcSwap` in the state: a request loads it
//! once (a pointer read) and sees one consistent version; a change builds and validates a
//! whole new value first and swaps it in atomically, so an invalid change never takes effect
//! and the cache is kept. Changes come from `PUT /admin/policies` (a TOML document) and, for
//! `reprise serve --config FILE`, from `SIGHUP` (the file is read again). Each change bumps
//! [`Policies::version`] (`GET /admin/policies`, metric `reprise_policy_version`). A tenant's
//! rate limiters carry over to the new version while its rates stay the same.
//!
//! With Redis, a change made on one replica reaches every replica (`share.rs`).

mod share;

use std::collections::HashMap;
use std::sync::Arc;

use reprise_policies::semantic::{Rule, SemanticPolicy};
use serde::{Deserialize, Serialize};

use crate::auth::Tenants;
use crate::config::{AuthConfig, CandidateConfig, Config, TenantConfig};
use crate::state::AppState;

pub use share::{sync, PolicyKey};

/// The live policies.
pub struct Policies {
    /// 1 at start, one more with every change; with Redis, the version shared by every
    /// replica.
    pub version: u64,
    /// The newest version shared through Redis that these policies include (0: none); a
    /// shared version is applied here only when newer.
    shared: u64,
    /// The semantic defaults (`[semantic]` enabled, threshold, top_k, gate).
    pub semantic: SemanticPolicy,
    /// `[[semantic.rules]]`.
    pub rules: Vec<Rule>,
    /// `[auth]` and `[[tenants]]`.
    pub tenants: Tenants,
    /// The configuration they came from: the base of the next change, and the view.
    config: Config,
}

impl Policies {
    /// The policies of a validated configuration (tenants' keys read from their variables
    /// and files).
    pub fn from_config(config: &Config, version: u64) -> anyhow::Result<Policies> {
        Policies::build(config, version, None)
    }

    fn build(config: &Config, version: u64, before: Option<&Tenants>) -> anyhow::Result<Policies> {
        let s = &config.semantic;
        Ok(Policies {
            version,
            shared: 0,
            semantic: SemanticPolicy {
                enabled: s.enabled,
                threshold: s.threshold,
                top_k: s.top_k,
                gate: s.gate,
                standalone: s.standalone,
                context_equivalence: s.context_equivalence,
                followup_threshold: s.followup_threshold,
            },
            rules: s.rules.clone(),
            tenants: Tenants::load(config, before)?,
            config: config.clone(),
        })
    }

    /// The next version: `doc`'s sections on top of these policies (sections it leaves out
    /// stay as they are; the configuration's other sections need a restart to change). The
    /// semantic tier cannot be switched on while running without its model: a document that
    /// needs it when `semantic_loaded` is false is refused.
    pub fn next(&self, doc: PolicyDocument, semantic_loaded: bool) -> anyhow::Result<Policies> {
        let mut c = self.config.clone();
        if let Some(s) = doc.semantic {
            c.semantic.enabled = s.enabled.unwrap_or(c.semantic.enabled);
            c.semantic.threshold = s.threshold.unwrap_or(c.semantic.threshold);
            c.semantic.top_k = s.top_k.unwrap_or(c.semantic.top_k);
            c.semantic.gate = s.gate.unwrap_or(c.semantic.gate);
            c.semantic.standalone = s.standalone.unwrap_or(c.semantic.standalone);
            c.semantic.context_equivalence = s
                .context_equivalence
                .unwrap_or(c.semantic.context_equivalence);
            if let Some(t) = s.followup_threshold {
                // A negative number takes it back to `threshold`.
                c.semantic.followup_threshold = (t >= 0.0).then_some(t);
            }
            c.semantic.rules = s.rules.unwrap_or(c.semantic.rules);
        }
        c.auth = doc.auth.unwrap_or(c.auth);
        c.tenants = doc.tenants.unwrap_or(c.tenants);
        anyhow::ensure!(
            semantic_loaded || !c.semantic.enabled,
            "semantic.enabled: the semantic tier was off at start (its model is not loaded); \
             switching it on needs a restart"
        );
        c.validate()?;
        let mut next = Policies::build(&c, self.version + 1, Some(&self.tenants))?;
        next.shared = self.shared;
        Ok(next)
    }

    /// The configured tenants' names.
    pub fn tenant_names(&self) -> impl Iterator<Item = &str> {
        self.config.tenants.iter().map(|t| t.name.as_str())
    }

    /// Whether requests without a known key are admitted (as the anonymous tenant).
    pub fn admits_anonymous(&self) -> bool {
        !self.config.auth.required
    }

    /// The tenants' shares of the memory tier (`None`: no tenant has one).
    pub fn memory_shares(&self) -> Option<Shares> {
        Shares::of(&self.config, |p| p.memory_share)
    }

    /// The tenants' shares of the prefetch budgets (`None`: no tenant has one).
    pub fn prefetch_shares(&self) -> Option<Shares> {
        Shares::of(&self.config, |p| p.prefetch_share)
    }

    /// A document that removes tenant `tenant`'s candidate (`None`: it has none).
    pub fn without_candidate(&self, tenant: &str) -> Option<PolicyDocument> {
        self.without_candidate_if(tenant, |_| true)
    }

    /// [`Policies::without_candidate`] when `judged` is the candidate tenant `tenant` has
    /// now: a rollback removes the candidate it judged, never one an operator put in its
    /// place meanwhile.
    pub fn without_judged_candidate(
        &self,
        tenant: &str,
        judged: &CandidateConfig,
    ) -> Option<PolicyDocument> {
        self.without_candidate_if(tenant, |c| c == judged)
    }

    fn without_candidate_if(
        &self,
        tenant: &str,
        which: impl Fn(&CandidateConfig) -> bool,
    ) -> Option<PolicyDocument> {
        let mut tenants = self.config.tenants.clone();
        let t = tenants.iter_mut().find(|t| t.name == tenant)?;
        t.candidate.take_if(|c| which(c))?;
        Some(PolicyDocument {
            tenants: Some(tenants),
            ..PolicyDocument::default()
        })
    }

    /// A document that makes tenant `tenant`'s candidate its policy: the candidate's
    /// semantic rules become its own, and the candidate goes. Not a candidate judged worse
    /// (its rollback under way): promoting it would race the rollback.
    pub fn promoting(&self, tenant: &str) -> Result<PolicyDocument, String> {
        if self
            .tenants
            .named(tenant)
            .and_then(|t| t.candidate().cloned())
            .is_some_and(|c| c.is_rolled_back())
        {
            return Err(format!(
                "tenant `{tenant}`'s candidate was judged worse and is being rolled back"
            ));
        }
        let mut tenants = self.config.tenants.clone();
        let t = tenants
            .iter_mut()
            .find(|t| t.name == tenant)
            .ok_or_else(|| format!("no tenant `{tenant}`"))?;
        let c = t
            .candidate
            .take()
            .ok_or_else(|| format!("tenant `{tenant}` has no candidate policy"))?;
        t.policy.semantic_rules = c.semantic_rules;
        Ok(PolicyDocument {
            tenants: Some(tenants),
            ..PolicyDocument::default()
        })
    }

    /// The effective policies as JSON (no keys: only how many each tenant has).
    pub fn view(&self) -> serde_json::Value {
        let p = &self.semantic;
        serde_json::json!({
            "version": self.version,
            "semantic": {
                "enabled": p.enabled,
                "threshold": p.threshold,
                "top_k": p.top_k,
                "gate": p.gate,
                "standalone": p.standalone,
                "context_equivalence": p.context_equivalence,
                "followup_threshold": self.config.semantic.followup_threshold,
                "rules": self.rules.iter().map(rule_view).collect::<Vec<_>>(),
            },
            "auth": {
                "required": self.config.auth.required,
                "anonymous": policy_view(&self.config.auth.anonymous),
            },
            "tenants": self.config.tenants.iter().map(|t| {
                serde_json::json!({
                    "name": t.name,
                    "api_keys": self.tenants.key_count(&t.name),
                    "sub_namespaces": t.sub_namespaces,
                    "policy": policy_view(&t.policy),
                    "candidate": self
                        .tenants
                        .named(&t.name)
                        .and_then(|t| t.candidate().map(|c| c.view())),
                })
            }).collect::<Vec<_>>(),
        })
    }
}

/// A tenant's policy as `GET /admin/policies` shows it.
fn policy_view(p: &crate::config::TenantPolicy) -> serde_json::Value {
    serde_json::json!({
        "read_only": p.read_only,
        "models": p.models,
        "max_tokens": p.max_tokens,
        "ttl_secs": p.ttl_secs,
        "controls": p.controls,
        "requests_per_minute": p.requests_per_minute,
        "tokens_per_minute": p.tokens_per_minute,
        "semantic_rules": p.semantic_rules.iter().map(rule_view).collect::<Vec<_>>(),
        "memory_share": p.memory_share,
        "prefetch_share": p.prefetch_share,
        "delta": p.delta,
        "priority": p.priority,
        "max_priority": p.max_priority,
        "stale_while_revalidate_secs": p.stale_while_revalidate_secs,
        "stale_if_error_secs": p.stale_if_error_secs,
    })
}

/// The tenants' shares of one budget: the tenants given a share, by name, and what is left
/// for the others (the anonymous tenant included), as fractions of the budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Shares {
    /// Tenant name → its share.
    pub pools: HashMap<String, f64>,
    /// The share of every tenant without one, together.
    pub rest: f64,
}

impl Shares {
    fn of(
        config: &Config,
        share: impl Fn(&crate::config::TenantPolicy) -> Option<f64>,
    ) -> Option<Shares> {
        let pools: HashMap<String, f64> = config
            .tenants
            .iter()
            .filter_map(|t| share(&t.policy).map(|s| (t.name.clone(), s)))
            .collect();
        if pools.is_empty() {
            return None;
        }
        let rest = (1.0 - pools.values().sum::<f64>()).max(0.0);
        Some(Shares { pools, rest })
    }

    /// The same shares of `bytes` of memory, pooled by tenant.
    pub fn of_memory(&self, bytes: u64) -> reprise_cache::MemoryShares {
        let part = |s: f64| (bytes as f64 * s) as u64;
        reprise_cache::MemoryShares {
            pool_of: crate::auth::scope_of,
            pools: self
                .pools
                .iter()
                .map(|(n, s)| (n.clone(), part(*s)))
                .collect(),
            rest: part(self.rest),
        }
    }
}

pub(crate) fn rule_view(r: &Rule) -> serde_json::Value {
    serde_json::json!({
        "namespace": r.namespace, "model": r.model, "enabled": r.enabled,
        "threshold": r.threshold, "top_k": r.top_k, "gate": r.gate,
    })
}

/// A policy document (`PUT /admin/policies`, the policy sections of the configuration file
/// on `SIGHUP`, or the version shared through Redis): each section given replaces the
/// running one; absent ones stay.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyDocument {
    /// `[semantic]`: only the policy keys (enabled, threshold, top_k, gate, rules).
    pub semantic: Option<SemanticDocument>,
    /// `[auth]`.
    pub auth: Option<AuthConfig>,
    /// `[[tenants]]` (the whole list).
    pub tenants: Option<Vec<TenantConfig>>,
}

/// The changeable keys of `[semantic]`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SemanticDocument {
    /// `semantic.enabled`.
    pub enabled: Option<bool>,
    /// `semantic.threshold`.
    pub threshold: Option<f32>,
    /// `semantic.top_k`.
    pub top_k: Option<usize>,
    /// `semantic.gate`.
    pub gate: Option<bool>,
    /// `semantic.standalone`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub standalone: Option<bool>,
    /// `semantic.context_equivalence`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_equivalence: Option<bool>,
    /// `semantic.followup_threshold` (a negative number: none, `threshold` applies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub followup_threshold: Option<f32>,
    /// `[[semantic.rules]]` (the whole list).
    pub rules: Option<Vec<Rule>>,
}

impl PolicyDocument {
    /// A document of whole sections ([`PolicyDocument::of_config`]'s, read back): a
    /// `[semantic]` key left out is at its default, not unchanged.
    pub fn whole(mut self) -> PolicyDocument {
        let d = crate::config::SemanticConfig::default();
        if let Some(s) = &mut self.semantic {
            s.standalone.get_or_insert(d.standalone);
            s.context_equivalence.get_or_insert(d.context_equivalence);
            s.followup_threshold
                .get_or_insert(d.followup_threshold.unwrap_or(-1.0));
        }
        self
    }

    /// Parses a TOML document.
    pub fn from_toml(text: &str) -> Result<PolicyDocument, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// The policy sections of a whole configuration (a re-read configuration file). The
    /// keys added to `[semantic]` later are written only where they differ from their
    /// defaults, so a replica of an earlier release still reads the document (see
    /// [`PolicyDocument::whole`] for the reading side).
    pub fn of_config(c: &Config) -> PolicyDocument {
        let s = &c.semantic;
        let d = crate::config::SemanticConfig::default();
        PolicyDocument {
            semantic: Some(SemanticDocument {
                enabled: Some(s.enabled),
                threshold: Some(s.threshold),
                top_k: Some(s.top_k),
                gate: Some(s.gate),
                standalone: (s.standalone != d.standalone).then_some(s.standalone),
                context_equivalence: (s.context_equivalence != d.context_equivalence)
                    .then_some(s.context_equivalence),
                followup_threshold: s.followup_threshold,
                rules: Some(s.rules.clone()),
            }),
            auth: Some(c.auth.clone()),
            tenants: Some(c.tenants.clone()),
        }
    }
}

/// What [`apply`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// The version now running here.
    pub version: u64,
    /// Whether the change was stored in Redis for the other replicas. Without Redis, or when
    /// Redis could not be reached, it holds on this replica only.
    pub shared: bool,
}

/// Applies a document to the running state: validated, built, swapped in, and with Redis
/// shared with the other replicas; or why it was refused (the running policies stay).
pub async fn apply(state: &AppState, doc: PolicyDocument) -> anyhow::Result<Applied> {
    apply_change(state, &move |_| Ok(doc.clone())).await
}

/// Like [`apply`], for a change computed from the running policies (a rollback, a
/// promotion): computed under the change lock, and again on top of any newer version shared
/// meanwhile, so a change made elsewhere in between is never undone.
pub async fn apply_change(
    state: &AppState,
    change: &(dyn Fn(&Policies) -> anyhow::Result<PolicyDocument> + Send + Sync),
) -> anyhow::Result<Applied> {
    // One change at a time, so two concurrent changes cannot both take the same version and
    // a version from Redis waits for a change being shared. An async lock: sharing awaits
    // Redis while holding it.
    let _guard = state.policy_change.lock().await;
    if let Some(redis) = state.store.redis() {
        return share::publish(state, redis, change).await;
    }
    let current = state.policies.load_full();
    let next = current.next(change(&current)?, state.embedder.is_some())?;
    let version = install(state, next);
    tracing::info!(version, "policies changed");
    Ok(Applied {
        version,
        shared: false,
    })
}

/// Swaps `next` in (the caller holds the change lock); its version.
fn install(state: &AppState, next: Policies) -> u64 {
    let version = next.version;
    let memory_changed = next.memory_shares() != state.policies.load().memory_shares();
    state.policies.store(Arc::new(next));
    state.metrics.policy_version.set(version as f64);
    share_budgets(state, memory_changed);
    version
}

/// Rolls tenant `tenant`'s canary back for `reason`: a policy change that removes its
/// candidate `judged` (shared with the other replicas like any change), recorded in the
/// state's rollbacks and counted. Runs on its own task: it is judged as a request ends. A
/// candidate that is no longer the tenant's (an operator replaced it meanwhile) stays.
pub fn roll_back(state: Arc<AppState>, tenant: String, judged: CandidateConfig, reason: String) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        // Computed from the policies running when the change is made; gone already (another
        // replica's rollback, an operator's change): nothing to do, nothing to report.
        let (t, c) = (tenant.clone(), judged.clone());
        let change = move |p: &Policies| {
            p.without_judged_candidate(&t, &c).ok_or_else(|| {
                anyhow::anyhow!("tenant `{t}` no longer has the candidate that was judged")
            })
        };
        if state
            .policies
            .load()
            .without_judged_candidate(&tenant, &judged)
            .is_none()
        {
            return;
        }
        // Recorded once it is done: a change that lost the race (an operator's promote or
        // replacement first) rolled nothing back.
        match apply_change(&state, &change).await {
            Ok(a) => {
                tracing::warn!(
                    tenant,
                    reason,
                    version = a.version,
                    "canary policy rolled back"
                );
                state.metrics.canary_rollback(&tenant);
                let mut log = state.rollbacks.lock();
                if log.len() == MAX_ROLLBACKS {
                    log.pop_front();
                }
                log.push_back(serde_json::json!({
                    "tenant": tenant, "reason": reason, "time_ms": reprise_cache::now_ms(),
                }));
            }
            Err(e) => tracing::error!(tenant, error = %format!("{e:#}"), "canary not removed"),
        }
    });
}

/// Rollbacks remembered for `GET /admin/policies`.
pub const MAX_ROLLBACKS: usize = 32;

/// Shares the memory tier and the prefetch budgets out as the running policies say. The
/// memory tier is re-pooled off the async workers (it scans what memory holds); of two quick
/// changes the later wins, whatever order their tasks run in (changes are numbered here, as
/// policy versions adopted from Redis need not grow).
fn share_budgets(state: &AppState, memory_changed: bool) {
    static CHANGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(2);
    let policies = state.policies.load();
    if let Some(prefetch) = &state.prefetch {
        prefetch.set_shares(policies.prefetch_shares());
    }
    let feedback = crate::feedback::Budgets::of(&policies, state.config.feedback.memory_bytes);
    drop(state.responses.set_budgets(feedback));
    if !memory_changed {
        return;
    }
    let bytes = state.config.cache.memory_bytes;
    let shares = policies.memory_shares().map(|s| s.of_memory(bytes));
    let store = state.store.clone();
    let change = CHANGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tokio::spawn(async move {
        let memory = store.clone();
        let _ = tokio::task::spawn_blocking(move || memory.set_memory_shares(shares, change)).await;
        // What no longer fits its share leaves now, not with the next write.
        store.run_pending_tasks().await;
    });
}
