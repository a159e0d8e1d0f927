//! Verdicts on served answers: `POST /v1/feedback` with `{"id": "<a response's id>",
//! "verdict": "wrong" | "right"}`.
//!
//! Every response reprise answers from the cache or generates has a fresh `id`; what it
//! served is remembered under that id for `[feedback] window_secs` ([`Responses`]: in memory
//! within `memory_bytes`, each tenant within its own part of it, so one tenant's traffic never
//! makes another's responses forgotten; hits matched by meaning and canary requests also in
//! Redis when configured, so any replica takes their verdict). A verdict names a response of the
//! caller's own tenant; another tenant's id is as unknown as one never sent (404). A response
//! takes one verdict: a second is a 404.
//!
//! A `wrong` verdict on a semantic or prefetch hit means the entry does not answer that
//! question: the key that led the question to it (linked when it was served) is removed, and
//! the entry gets a [`Refusal`]: it is never served again to that question, nor to questions
//! within `[feedback] radius` of it in the same partition (the lookup's judge refuses it,
//! verdict `refused`). The refusal travels with the entry, so every replica sharing Redis
//! honours it. The entry still answers its own question. A verdict on a canary's request
//! counts on its side. Every verdict is counted (`reprise_feedback_total`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use moka::ops::compute::Op;
use moka::sync::Cache;
use parking_lot::RwLock;
use reprise_cache::entry::Refusal;
use reprise_cache::{Digest, EntryId, Vector};
use serde::{Deserialize, Serialize};

use crate::config::FeedbackConfig;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::reqlog::LogRecord;
use crate::state::AppState;

/// Longest response id accepted.
const MAX_ID_BYTES: usize = 128;
/// Longest question text remembered: as much as the embedder may read of one (its window
/// ends within the tokenizer's longest scan), so a refusal's neighbourhood is centred on
/// the vector the question was matched by.
pub const MAX_QUESTION_BYTES: usize = reprise_embedder::SCAN_BYTES[1];
/// Largest remembered response read back from Redis.
const MAX_RECORD_BYTES: usize = 64 * 1024;

/// What one response served.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Served {
    /// The tenant's name ("" for the anonymous tenant).
    pub tenant: String,
    /// The entry that answered (or that the generated answer is stored as; none when it is
    /// not stored).
    pub entry: Option<EntryId>,
    /// How it was answered.
    pub outcome: Outcome,
    /// The request's exact key.
    pub key: Digest,
    /// The question matched by meaning and the partition it was asked in (when the request
    /// was looked up by meaning or resolved as a conversation); at most [`MAX_QUESTION_BYTES`]
    /// of the text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question: Option<(Digest, String)>,
    /// The canary side it was on (`true`: the candidate's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<bool>,
    /// The candidate of that canary ([`crate::candidate::Candidate::fingerprint`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<u64>,
    /// The similarity a semantic hit was served at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub similarity: Option<f32>,
    /// The scope of the threshold it was served under (see [`crate::bounds::scope`]).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub scope: String,
    /// An exact hit through a key that leads to another wording's answer (linked by an
    /// earlier hit by meaning, or by prefetch): wrong, it is refused as a hit by meaning is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aliased: bool,
    /// A check's verdict on it ([`crate::verify`]) counted as evidence: a client's verdict
    /// after it counts as none (it still refuses), so one hit is never counted twice.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checked: bool,
}

impl Served {
    /// Whether the record is shared with the other replicas (through Redis, when
    /// configured): only where a verdict acts beyond counting, hits matched by meaning
    /// (refusals) and canary requests; the rest stay on their replica, so every response
    /// does not cost a Redis write.
    fn is_shared(&self) -> bool {
        self.by_meaning() || self.canary.is_some()
    }

    /// Whether it answered another wording's question: matched by meaning or prefetched, or
    /// an exact hit through a key such a match linked.
    fn by_meaning(&self) -> bool {
        matches!(self.outcome, Outcome::Semantic | Outcome::Prefetch)
            || (self.aliased && self.outcome == Outcome::Exact)
    }

    fn weight(&self) -> u32 {
        let text = self.question.as_ref().map_or(0, |(_, t)| t.len());
        let strings = self.tenant.len() + self.scope.len() + text;
        u32::try_from(std::mem::size_of::<Served>() + 64 + strings)
            .unwrap_or(u32::MAX)
            // moka's bookkeeping for the item.
            .saturating_add(reprise_cache::ITEM_OVERHEAD)
    }
}

/// The bytes of response records each tenant may hold: a tenant with a `memory_share` that
/// share of `[feedback] memory_bytes`, every other tenant (the anonymous one included, where
/// keys are not required) an equal part of what is left; a tenant no longer configured
/// none.
#[derive(Debug, Clone, PartialEq)]
pub struct Budgets {
    named: HashMap<String, u64>,
    /// The tenants without a share ("" the anonymous one, where it is admitted).
    unnamed: std::collections::HashSet<String>,
    each: u64,
}

impl Budgets {
    /// The parts of `bytes` under `policies`.
    pub fn of(policies: &crate::policy::Policies, bytes: u64) -> Budgets {
        let (named, rest) = match policies.memory_shares() {
            Some(s) => {
                let parts = s.of_memory(bytes);
                (parts.pools, parts.rest)
            }
            None => (HashMap::new(), bytes),
        };
        let mut unnamed: std::collections::HashSet<String> = policies
            .tenant_names()
            .filter(|n| !named.contains_key(*n))
            .map(String::from)
            .collect();
        if policies.admits_anonymous() {
            unnamed.insert(String::new());
        }
        Budgets {
            each: rest / unnamed.len().max(1) as u64,
            named,
            unnamed,
        }
    }

    /// Tenant `tenant`'s part.
    fn of_tenant(&self, tenant: &str) -> u64 {
        match self.named.get(tenant) {
            Some(b) => *b,
            None if self.unnamed.contains(tenant) => self.each,
            None => 0,
        }
    }
}

/// A remembered response and when it is forgotten.
#[derive(Clone)]
struct Record {
    served: Arc<Served>,
    until: Instant,
    /// A verdict was given on it: kept so until `until`, so that a check ending after it
    /// is told so (not taken for a response forgotten), and a second verdict is unknown.
    spent: bool,
}

/// What a change of a remembered record found ([`Responses::change_unspent`]).
enum Found {
    /// The record as it was, now changed.
    Unspent(Record),
    /// A verdict was given on it already; left as it is.
    Spent,
    /// Not remembered here.
    Absent,
}

/// Forgets a record at its `until`, wherever it was inserted last (moved to a resized pool,
/// put back after a failed take), so a response is never remembered past its window.
struct Until;

impl moka::Expiry<String, Record> for Until {
    fn expire_after_create(&self, _: &String, r: &Record, now: Instant) -> Option<Duration> {
        Some(r.until.saturating_duration_since(now))
    }
}

/// One tenant's records, within `bytes`: the oldest forgotten first (moka's default admission
/// would turn away every new response id, never read before, once the pool is full).
fn pool(bytes: u64) -> Cache<String, Record> {
    Cache::builder()
        .eviction_policy(moka::policy::EvictionPolicy::lru())
        .max_capacity(bytes)
        .weigher(|k: &String, r: &Record| r.served.weight().saturating_add(k.len() as u32))
        .expire_after(Until)
        .build()
}

/// The tenants' pools of records and their budgets.
struct Pools {
    budgets: Budgets,
    by_tenant: HashMap<String, Cache<String, Record>>,
}

/// The responses that can still be given a verdict.
pub struct Responses {
    pools: Arc<RwLock<Pools>>,
    config: FeedbackConfig,
}

impl Responses {
    /// An empty memory of responses, shared out by `budgets`.
    pub fn new(config: &FeedbackConfig, budgets: Budgets) -> Responses {
        Responses {
            pools: Arc::new(RwLock::new(Pools {
                budgets,
                by_tenant: HashMap::new(),
            })),
            config: config.clone(),
        }
    }

    /// Shares the memory out anew (the tenants or their shares changed): a tenant's records
    /// move to a pool of its new size (the oldest forgotten where it shrank), a gone tenant's
    /// are dropped. On a blocking thread of the current runtime (the records are copied one
    /// by one; requests wait for the pools meanwhile, as a policy change is rare).
    pub fn set_budgets(&self, budgets: Budgets) -> tokio::task::JoinHandle<()> {
        let pools = self.pools.clone();
        tokio::task::spawn_blocking(move || reshare(&pools, budgets))
    }

    /// Runs `f` on tenant `tenant`'s pool (made on its first response) while the pools
    /// cannot be shared out anew: a record is never put into, or taken from, a pool being
    /// replaced.
    fn with_pool<R>(&self, tenant: &str, f: impl FnOnce(&Cache<String, Record>) -> R) -> R {
        {
            let pools = self.pools.read();
            if let Some(p) = pools.by_tenant.get(tenant) {
                return f(p);
            }
        }
        let mut pools = self.pools.write();
        let bytes = pools.budgets.of_tenant(tenant);
        let p = pools
            .by_tenant
            .entry(tenant.to_string())
            .or_insert_with(|| pool(bytes));
        f(p)
    }

    /// Carries out pending evictions now (moka defers them), so the memory is within its
    /// budget when this returns.
    pub fn run_pending_tasks(&self) {
        for p in self.pools.read().by_tenant.values() {
            p.run_pending_tasks();
        }
    }

    /// The bytes of records held (all tenants).
    #[cfg(test)]
    fn weighted_size(&self) -> u64 {
        let pools = self.pools.read();
        pools.by_tenant.values().map(|p| p.weighted_size()).sum()
    }

    /// Remembers what response `id` served (in Redis too, queued, when configured).
    pub fn remember(&self, state: &AppState, id: &str, served: Served) {
        if !self.config.enabled {
            return;
        }
        if let Some(redis) = state.store.redis().filter(|_| served.is_shared()) {
            if let Ok(bytes) = serde_json::to_vec(&served) {
                redis.put_blob_for(&blob_name(id), bytes, self.config.window());
            }
        }
        let record = Record {
            until: Instant::now() + self.config.window(),
            served: Arc::new(served),
            spent: false,
        };
        let tenant = record.served.tenant.clone();
        self.with_pool(&tenant, |p| p.insert(id.to_string(), record));
    }

    /// Takes what response `id` served: one verdict a response, however many arrive at once
    /// on however many replicas. A record shared through Redis is taken there (swapped for
    /// "spent" in one step, after the queued write that stored it); one kept here only, by
    /// marking it spent in memory (in one step against a check marking it).
    async fn take(
        &self,
        state: &AppState,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Arc<Served>>, ApiError> {
        let spend = |r: &Record| Record {
            spent: true,
            ..r.clone()
        };
        let held = match self.change_unspent(tenant, id, spend) {
            Found::Spent => return Ok(None),
            Found::Unspent(r) => Some(r),
            Found::Absent => None,
        };
        let until = held.as_ref().map(|r| r.until);
        let here = held.map(|r| r.served);
        let Some(redis) = state
            .store
            .redis()
            .filter(|_| here.as_ref().is_none_or(|s| s.is_shared()))
        else {
            return Ok(here);
        };
        match redis.take_blob(&blob_name(id), SPENT.to_vec()).await {
            Ok(Some(bytes)) if bytes.as_slice() != SPENT && bytes.len() <= MAX_RECORD_BYTES => {
                let shared: Option<Served> = serde_json::from_slice(&bytes).ok();
                // A check that marked it in Redis (here or on another replica) counted.
                let checked = shared.as_ref().is_some_and(|s| s.checked);
                Ok(match (here, shared) {
                    (Some(h), _) if checked && !h.checked => Some(Arc::new(Served {
                        checked: true,
                        ..(*h).clone()
                    })),
                    (Some(h), _) => Some(h),
                    (None, s) => s.map(Arc::new),
                })
            }
            // Never reached Redis (a dropped queued write, an eviction): the copy held here
            // counts; without one, the id is unknown.
            Ok(None) => Ok(here),
            // Spent already (on another replica), or not a record.
            Ok(Some(_)) => Ok(None),
            // Redis unreachable: counted here, the verdict could be counted again by a
            // replica that takes the record once Redis is back. Refused (the record kept for
            // a retry): one verdict a response holds over every replica.
            Err(e) => {
                tracing::warn!(error = %e, "feedback: cannot take the response record in redis");
                if let (Some(served), Some(until)) = (here, until) {
                    let record = Record {
                        served,
                        until,
                        spent: false,
                    };
                    self.with_pool(tenant, |p| p.insert(id.to_string(), record));
                }
                Err(records_unreachable())
            }
        }
    }

    /// Marks response `id` of tenant `tenant` as judged by a check, unless a verdict was
    /// given on it already: whether the check's verdict counts as evidence. One verdict a
    /// response counts, the first: the mark and a client's take are each one step, in memory
    /// and in Redis, so of a check and a verdict racing on any replicas one counts. A
    /// response no longer remembered (or feedback off) can take no client's verdict: the
    /// check's counts. A Redis error counts it too (the one case where a hit may count
    /// twice, should a client's verdict reach another replica).
    pub async fn mark_checked(&self, state: &AppState, tenant: &str, id: &str) -> bool {
        if !self.config.enabled {
            return true;
        }
        let check = |r: &Record| Record {
            served: Arc::new(Served {
                checked: true,
                ..(*r.served).clone()
            }),
            ..r.clone()
        };
        let found = self.change_unspent(tenant, id, check);
        let Some(redis) = state.store.redis() else {
            return !matches!(found, Found::Spent);
        };
        let copy = match found {
            Found::Spent => return false,
            Found::Unspent(r) if !r.served.is_shared() => return true,
            Found::Unspent(r) => r.served,
            // Forgotten here: Redis may hold it (another replica served it).
            Found::Absent => match self.find(state, tenant, id).await {
                Ok(Some(s)) => s,
                _ => return true,
            },
        };
        let marked = Served {
            checked: true,
            ..(*copy).clone()
        };
        let Ok(bytes) = serde_json::to_vec(&marked) else {
            return true;
        };
        match redis.mark_blob(&blob_name(id), SPENT.to_vec(), bytes).await {
            Ok(Some(counts)) => counts,
            // Never reached Redis: what is held here decides.
            Ok(None) => true,
            Err(e) => {
                tracing::warn!(error = %e, "feedback: cannot mark a checked response in redis");
                true
            }
        }
    }

    /// Replaces record `id` of tenant `tenant` by `change` of it unless it is spent, in one
    /// step against any other such change (a client's take, a check's mark).
    fn change_unspent(
        &self,
        tenant: &str,
        id: &str,
        change: impl FnOnce(&Record) -> Record,
    ) -> Found {
        let mut found = Found::Absent;
        self.with_pool(tenant, |p| {
            p.entry_by_ref(id).and_compute_with(|e| match e {
                Some(e) if e.value().spent => {
                    found = Found::Spent;
                    Op::Nop
                }
                Some(e) => {
                    let record = e.into_value();
                    let changed = change(&record);
                    found = Found::Unspent(record);
                    Op::Put(changed)
                }
                None => Op::Nop,
            })
        });
        found
    }

    /// What response `id` served, if it is remembered here (among tenant `tenant`'s
    /// responses) or in Redis (an error when Redis cannot tell).
    async fn find(
        &self,
        state: &AppState,
        tenant: &str,
        id: &str,
    ) -> Result<Option<Arc<Served>>, ApiError> {
        if let Some(r) = self.with_pool(tenant, |p| p.get(id)) {
            return Ok((!r.spent).then_some(r.served));
        }
        let Some(redis) = state.store.redis() else {
            return Ok(None);
        };
        let bytes = redis
            .get_blob(&blob_name(id), MAX_RECORD_BYTES)
            .await
            .map_err(|_| records_unreachable())?;
        Ok(bytes.and_then(|b| serde_json::from_slice(&b).ok().map(Arc::new)))
    }
}

/// Shares `pools` out by `budgets`: each tenant's records, newest kept where its pool
/// shrank, in a pool of its new size; a gone tenant's dropped.
fn reshare(pools: &RwLock<Pools>, budgets: Budgets) {
    let mut pools = pools.write();
    if pools.budgets == budgets {
        return;
    }
    let old = std::mem::take(&mut pools.by_tenant);
    for (tenant, records) in old {
        let bytes = budgets.of_tenant(&tenant);
        if bytes == 0 {
            continue;
        }
        let records = if bytes == pools.budgets.of_tenant(&tenant) {
            records
        } else {
            let resized = pool(bytes);
            let mut held: Vec<(Arc<String>, Record)> = records.iter().collect();
            // Oldest first: the pool forgets the least recently put where it is full.
            held.sort_by_key(|(_, r)| r.until);
            for (id, r) in held {
                resized.insert(String::clone(&id), r);
            }
            resized.run_pending_tasks();
            resized
        };
        pools.by_tenant.insert(tenant, records);
    }
    pools.budgets = budgets;
}

/// The answer to a verdict while Redis, where the response records are shared, cannot be
/// reached: try again (503).
fn records_unreachable() -> ApiError {
    ApiError::Unavailable("the shared response records cannot be reached; retry the verdict".into())
}

/// What a record taken in Redis is replaced with.
const SPENT: &[u8] = b"spent";

fn blob_name(id: &str) -> String {
    format!("response:{id}")
}

/// The body of `POST /v1/feedback`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Verdict {
    id: String,
    verdict: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Wrong,
    Right,
}

/// `POST /v1/feedback`: a verdict on a response of the caller's tenant. 404 for an id that is
/// unknown, too old or another tenant's; 400 for a bad body.
pub async fn handle(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<serde_json::Value, ApiError> {
    /// A verdict is an id and a word.
    const MAX_FEEDBACK_BYTES: usize = 4096;
    let tenant = state.policies.load().tenants.admit(headers)?;
    let timeout = state.config.server.body_timeout();
    let body = crate::http::read_body(headers, body, MAX_FEEDBACK_BYTES, timeout).await?;
    let v: Verdict = serde_json::from_slice(&body).map_err(|e| {
        let param = ["verdict", "id"]
            .into_iter()
            .find(|p| e.to_string().contains(&format!("`{p}`")));
        ApiError::invalid(
            format!("invalid feedback: {e}; expected {{\"id\": \"...\", \"verdict\": \"wrong\" | \"right\"}}"),
            param.or(Some("verdict")).filter(|_| !e.is_syntax()),
        )
    })?;
    let unknown = || ApiError::NotFound {
        message: format!("no response `{}` to give a verdict on", v.id.escape_debug()),
        param: Some("id"),
    };
    if !state.config.feedback.enabled || v.id.is_empty() || v.id.len() > MAX_ID_BYTES {
        return Err(unknown());
    }
    // Another tenant's response is as unknown as one never sent (and stays unspent).
    let mine = state.responses.find(state, tenant.name(), &v.id).await?;
    if mine.is_none_or(|s| s.tenant != tenant.name()) {
        return Err(unknown());
    }
    let served = state
        .responses
        .take(state, tenant.name(), &v.id)
        .await?
        .ok_or_else(unknown)?;
    let verdict = match v.verdict {
        Kind::Wrong => "wrong",
        Kind::Right => "right",
    };
    state
        .metrics
        .feedback(tenant.name(), verdict, served.outcome);
    // A check's verdict on this response counted already: one hit, one verdict of evidence.
    if let (Some(sim), false) = (served.similarity, served.checked) {
        let wrong = v.verdict == Kind::Wrong;
        let source = crate::bounds::Source::Feedback;
        state.bounds.record(
            state,
            tenant.name(),
            &served.scope,
            served.entry,
            sim,
            wrong,
            source,
        );
    }
    // The verdict line of the request log (what `reprise tune --log` joins by id).
    if let Some(log) = &state.request_log {
        log.write(LogRecord {
            time_ms: reprise_cache::now_ms(),
            request_id: crate::trace::request_id(headers).to_string(),
            id: v.id.clone(),
            tenant: tenant.name().to_string(),
            outcome: "feedback",
            verdict: Some(verdict),
            similarity: served.similarity,
            entry_id: served.entry.map(|e| e.to_string()),
            ..LogRecord::default()
        });
    }
    let mut refused = false;
    if v.verdict == Kind::Wrong {
        refused = refuse(state, &served).await;
        let hit = matches!(
            served.outcome,
            Outcome::Exact | Outcome::Semantic | Outcome::Prefetch
        );
        // Counted against the candidate it was served beside, not one put in its place.
        let candidate = tenant
            .candidate()
            .filter(|c| served.candidate == Some(c.fingerprint()));
        if let (Some(side), Some(c), true) = (served.canary, candidate, hit) {
            if let Some(reason) = c.record_wrong(side) {
                let (name, judged) = (tenant.name().to_string(), c.config().clone());
                crate::policy::roll_back(state.clone(), name, judged, reason);
            }
        }
    }
    Ok(serde_json::json!({
        "id": v.id,
        "verdict": verdict,
        "entry": served.entry.map(|e| e.to_string()),
        "refused": refused,
    }))
}

/// A semantic or prefetch hit reported wrong (or an exact hit through a key one of them
/// linked): the entry refuses the question (its exact key no longer leads there, on any
/// replica) and, when it was matched by meaning, the question's neighbourhood; so does a
/// renewal of the entry (refresh-ahead, stale-while-revalidate) the question's key leads
/// to now. Whether a refusal was added.
pub(crate) async fn refuse(state: &AppState, served: &Served) -> bool {
    let Some(id) = served.entry.filter(|_| served.by_meaning()) else {
        return false;
    };
    // Expired too: kept to be served stale, it must refuse the question there as well.
    let Ok(Some(entry)) = state.store.get_kept(id).await else {
        return false;
    };
    let mut around = None;
    if let (Some((partition, text)), Some(embedder)) = (&served.question, &state.embedder) {
        if let Ok(embedding) = embedder.embed_in(&served.tenant, text).await {
            around = Vector::finite(&embedding).map(|v| (*partition, v));
        }
    }
    let mut refusing = (*entry).clone();
    if refusing.refusals_full() && !refusing.refuses_key(&served.key) {
        // Wrong for more questions than it can keep refusing: deleted, here at once and
        // everywhere (Redis's delete tried until it lands); its own question is answered
        // afresh.
        state.store.refused_too_often(id).await;
        state.snapshot_wanted.notify_one();
        return true;
    }
    let refusal = Refusal {
        key: served.key,
        around,
    };
    let renewal = renewal_of(state, &entry, &served.key).await;
    if !refusing.refuse(refusal.clone()) {
        return false;
    }
    // Its key's link, here and on every replica, is dropped on sight (a key another answer
    // took since stays).
    state.store.update(Arc::new(refusing)).await;
    if let Some(renewal) = renewal {
        let mut refusing = (*renewal).clone();
        if refusing.refuse(refusal) {
            state.store.update(Arc::new(refusing)).await;
        }
    }
    // Without Redis, a crash before the next periodic snapshot would serve it again.
    state.snapshot_wanted.notify_one();
    true
}

/// The entry `key` leads to now when it is a renewal of `old` (the same question in the same
/// context, answered afresh by refresh-ahead or stale-while-revalidate, which took `old`'s
/// keys): a verdict on `old` that came after must refuse it too, or the question reported
/// wrong keeps being served the renewed answer.
async fn renewal_of(
    state: &AppState,
    old: &reprise_cache::Entry,
    key: &Digest,
) -> Option<Arc<reprise_cache::Entry>> {
    let (found, _) = state.store.find(key, |_| true).await;
    let now = match found {
        reprise_cache::ByKey::Fresh(e) | reprise_cache::ByKey::Expired(e) => e,
        _ => return None,
    };
    (now.id != old.id && now.partition == old.partition && now.prompt == old.prompt).then_some(now)
}

/// The question of a request looked up by meaning, to remember with its response.
pub fn question(partition: Option<Digest>, text: &str) -> Option<(Digest, String)> {
    let end = text.floor_char_boundary(MAX_QUESTION_BYTES);
    Some((partition?, text[..end].to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records are shared through Redis between replicas of different versions: the outcome
    /// keeps its wire form, the label.
    #[test]
    fn a_record_keeps_the_outcome_label_on_the_wire() {
        let served = Served {
            tenant: "acme".into(),
            entry: None,
            outcome: Outcome::Semantic,
            key: [7; 32],
            question: None,
            canary: None,
            candidate: None,
            similarity: Some(0.9),
            scope: String::new(),
            aliased: false,
            checked: false,
        };
        let json = serde_json::to_string(&served).unwrap();
        assert!(json.contains(r#""outcome":"semantic""#), "{json}");
        let back: Served = serde_json::from_str(&json).unwrap();
        assert_eq!(back.outcome, Outcome::Semantic);
        assert!(back.is_shared());
        let odd = json.replace(r#""semantic""#, r#""sideways""#);
        assert!(serde_json::from_str::<Served>(&odd).is_err());
    }

    fn served(tenant: &str) -> Served {
        Served {
            tenant: tenant.into(),
            entry: None,
            outcome: Outcome::Miss,
            key: [1; 32],
            question: None,
            canary: None,
            candidate: None,
            similarity: None,
            scope: String::new(),
            aliased: false,
            checked: false,
        }
    }

    /// One tenant's flood of responses never makes another tenant's forgotten, and the
    /// memory stays within its budget; a tenant given a share keeps to it.
    #[tokio::test]
    async fn one_tenants_responses_never_push_anothers_out() {
        let mut config = crate::config::Config::default();
        config.tenants = vec![
            crate::config::TenantConfig::with_key("a", "ka"),
            crate::config::TenantConfig::with_key("b", "kb"),
        ];
        config.feedback.memory_bytes = 64 * 1024;
        let state = crate::state::AppState::new(
            config.clone(),
            Arc::new(reprise_backend::fake::ScriptedBackend::new(
                reprise_backend::fake::ScriptConfig::default(),
            )),
            None,
        )
        .unwrap();
        let r = &state.responses;
        r.remember(&state, "b-1", served("b"));
        for i in 0..2000 {
            r.remember(&state, &format!("a-{i}"), served("a"));
        }
        r.run_pending_tasks();
        assert!(r.weighted_size() <= 64 * 1024, "{}", r.weighted_size());
        let found = r.find(&state, "b", "b-1").await.unwrap();
        assert!(found.is_some(), "b's response is still remembered");
        assert!(r.find(&state, "a", "a-1999").await.unwrap().is_some());
        assert!(
            r.find(&state, "a", "a-0").await.unwrap().is_none(),
            "a's oldest"
        );
        assert!(
            r.find(&state, "a", "b-1").await.unwrap().is_none(),
            "another tenant's response is not among a's"
        );

        // Tenant a given three quarters: its pool grows (its records kept), b's shrinks.
        let mut shared = config.clone();
        shared.tenants[0].policy.memory_share = Some(0.75);
        let policies = crate::policy::Policies::from_config(&shared, 2).unwrap();
        let budgets = Budgets::of(&policies, shared.feedback.memory_bytes);
        assert_eq!(budgets.of_tenant("a"), 48 * 1024);
        assert_eq!(
            budgets.of_tenant("b"),
            8 * 1024,
            "the rest, split with anonymous"
        );
        r.set_budgets(budgets).await.unwrap();
        assert!(r.find(&state, "a", "a-1999").await.unwrap().is_some());
        assert!(r.find(&state, "b", "b-1").await.unwrap().is_some());
        for i in 2000..6000 {
            r.remember(&state, &format!("a-{i}"), served("a"));
        }
        r.run_pending_tasks();
        assert!(r.weighted_size() <= 64 * 1024);
        assert!(r.find(&state, "b", "b-1").await.unwrap().is_some());
        // A tenant removed: its responses are dropped, and a late one of its is not kept.
        let mut without_a = config.clone();
        without_a.tenants.remove(0);
        let policies = crate::policy::Policies::from_config(&without_a, 3).unwrap();
        r.set_budgets(Budgets::of(&policies, 1 << 20))
            .await
            .unwrap();
        assert!(r.find(&state, "a", "a-5999").await.unwrap().is_none());
        assert!(r.find(&state, "b", "b-1").await.unwrap().is_some());
        r.remember(&state, "a-late", served("a"));
        r.run_pending_tasks();
        assert!(r.find(&state, "a", "a-late").await.unwrap().is_none());
    }

    /// Where every request needs a known key, the anonymous tenant gets no part.
    #[test]
    fn no_part_for_an_anonymous_tenant_that_cannot_come() {
        let mut config = crate::config::Config::default();
        config.tenants = vec![
            crate::config::TenantConfig::with_key("a", "ka"),
            crate::config::TenantConfig::with_key("b", "kb"),
        ];
        config.auth.required = true;
        let policies = crate::policy::Policies::from_config(&config, 1).unwrap();
        let b = Budgets::of(&policies, 1000);
        assert_eq!(
            (b.of_tenant("a"), b.of_tenant("b"), b.of_tenant("")),
            (500, 500, 0)
        );
    }

    /// A record is forgotten at the end of its window, also when it was moved meanwhile.
    #[test]
    fn a_record_is_forgotten_at_its_own_time() {
        let p = pool(1 << 20);
        let record = Record {
            served: Arc::new(served("a")),
            until: Instant::now() + Duration::from_millis(100),
            spent: false,
        };
        p.insert("x".into(), record.clone());
        let moved = pool(1 << 20);
        std::thread::sleep(Duration::from_millis(60));
        moved.insert("x".into(), record);
        assert!(moved.get("x").is_some());
        std::thread::sleep(Duration::from_millis(60));
        assert!(p.get("x").is_none());
        assert!(moved.get("x").is_none(), "moved, it keeps its own end");
    }
}
