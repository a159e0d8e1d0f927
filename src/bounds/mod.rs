//! Learned thresholds under an error bound (`[semantic] delta`, a tenant's `policy.delta`):
//! the verdicts on answers matched by meaning, kept per tenant and scope, and the threshold
//! they allow ([`reprise_policies::bound`] decides; this module keeps the evidence and
//! reports it). A scope is the semantic rule a request was looked up under (its own
//! threshold), on the canary's candidate side or not: evidence gathered under one threshold
//! never moves another rule's, and a candidate's verdicts never move the running policy's.
//!
//! Verdicts come from `POST /v1/feedback` on semantic and prefetch hits (at the similarity the
//! hit was served at) and from checked near misses: a miss whose best candidate was under the
//! threshold, once the backend answered it, is judged against the candidate's answer by
//! embedding similarity (`[semantic] answer_threshold`), the share `verify_near_misses` of
//! them, off the request path and without another backend call. Near misses are what let a
//! threshold fall: verdicts on served hits only ever speak of similarities already served.
//!
//! With Redis the replicas pool their evidence: every `[semantic] evidence_sync_secs` each
//! publishes its own verdicts (all tenants and scopes, by similarity bin) as its field of one
//! shared hash, and reads the other replicas' fields; a threshold is learned from its own
//! verdicts plus the others' last published ones. Each replica writes only its own field,
//! so nothing is counted twice; a restarted replica has a new id, and what it had learned
//! before keeps counting under the old one until that field is a week old. What another
//! replica wrote is checked (bins, counts, known tenants, bounded scopes) before it is used.
//!
//! Beside the scopes, the verdicts that name an entry are kept per entry ([`Entries`]): an
//! entry with verdicts of its own is judged at the threshold they allow it, the others at
//! their scope's (thresholds per entry where evidence allows, per scope otherwise).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use reprise_cache::{now_ms, EntryId};
use reprise_policies::bound::{Evidence, Learned};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::share::ExactShare;
use crate::state::AppState;

mod entries;

pub use entries::Entries;

/// Confidence of the bound: the wrong share is at most `delta` with probability 95 %.
const ALPHA: f64 = 0.05;
/// Verdicts kept per tenant before old ones weigh half.
const DECAY_AT: f64 = 100_000.0;
/// The shared hash (under the Redis prefix) whose fields are the replicas' evidence.
const SHARED: &str = "bounds:evidence";
/// Replicas whose evidence is read.
const MAX_REPLICAS: usize = 256;
/// A replica's published evidence counts this long after it was written; a live replica
/// publishes again at least every [`REPUBLISH`], verdicts or not.
const SHARED_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// See [`SHARED_TTL`].
const REPUBLISH: Duration = Duration::from_secs(24 * 3600);
/// Scopes read per tenant from another replica, and the longest scope name: a replica's
/// rules are configured, so more is not a real configuration.
const MAX_SCOPES: usize = 256;
/// See [`MAX_SCOPES`].
const MAX_SCOPE_BYTES: usize = 512;

/// Verdicts by tenant, then scope.
type Scoped = HashMap<String, HashMap<String, Evidence>>;
/// One scope's (or entry's) verdicts as kept and shared: (bin, right, wrong) of the bins
/// holding any.
type Bins = Vec<(u8, f64, f64)>;

/// The scope of a request's learned threshold: its semantic rule's (see
/// [`reprise_policies::semantic::scope`]), marked when it was looked up under the canary's
/// candidate with that candidate's fingerprint: a new candidate (its gate off, say) starts
/// from no evidence, not from the verdicts on the one it replaced.
pub fn scope(
    rule: Option<&reprise_policies::semantic::Rule>,
    arm: crate::candidate::Arm,
    candidate: Option<u64>,
) -> String {
    let s = reprise_policies::semantic::scope(rule);
    match arm {
        crate::candidate::Arm::Candidate => {
            format!("{}{s}", candidate_prefix(candidate.unwrap_or(0)))
        }
        _ => s,
    }
}

/// What every candidate scope starts with.
const CANDIDATE: &str = "candidate:";

/// The name metrics give `scope`: a candidate's without its fingerprint. A tenant has one
/// candidate at a time, and each replaced candidate's series would stay in `/metrics` for
/// the life of the process: the next candidate's figures take the same series.
pub fn scope_label(scope: &str) -> String {
    match scope
        .strip_prefix(CANDIDATE)
        .and_then(|rest| rest.split_once(':'))
    {
        Some((fingerprint, rule))
            if fingerprint.len() == 16 && fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            format!("{CANDIDATE}{rule}")
        }
        _ => scope.to_string(),
    }
}

/// What the scopes of the candidate with `fingerprint` start with.
fn candidate_prefix(fingerprint: u64) -> String {
    format!("{CANDIDATE}{fingerprint:016x}:")
}

/// A miss whose best candidate was under the threshold, to be judged once the backend
/// answered it ([`check_near_miss`]).
#[derive(Debug, Clone)]
pub struct NearMiss {
    /// The tenant's name.
    pub tenant: String,
    /// The scope of its threshold.
    pub scope: String,
    /// The best candidate.
    pub candidate: EntryId,
    /// The candidate's similarity.
    pub similarity: f32,
}

/// One replica's evidence as published.
#[derive(Debug, Serialize, Deserialize)]
struct Published {
    /// When it was written (milliseconds since the Unix epoch).
    at_ms: u64,
    /// Each tenant's verdicts ("" for the anonymous one) by scope, as (bin, right, wrong).
    tenants: HashMap<String, HashMap<String, Bins>>,
    /// The verdicts of the entries with the most (see [`Entries`]); absent from what a
    /// replica of an earlier release wrote.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    entries: entries::Shared,
}

/// Where a verdict came from (metric label).
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// `POST /v1/feedback`.
    Feedback,
    /// A near miss checked against the backend's answer.
    NearMiss,
    /// A hit checked in the background ([`crate::verify`]).
    Verified,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Feedback => "feedback",
            Source::NearMiss => "near_miss",
            Source::Verified => "verified",
        }
    }
}

/// The evidence of every tenant ("" for the anonymous one) and scope, and of every entry
/// with verdicts of its own.
pub struct Bounds {
    /// This replica's own verdicts.
    evidence: Mutex<Scoped>,
    /// The other replicas' verdicts, as last read from Redis (locked after `evidence`).
    peers: Mutex<Scoped>,
    /// Verdicts recorded since the last publication.
    unpublished: AtomicBool,
    /// When the evidence was last published (ms since the epoch; 0: never).
    published_ms: AtomicU64,
    /// Near misses seen, for sampling.
    near_misses: ExactShare,
    /// The verdicts of entries, for thresholds per entry.
    entries: Entries,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds::new(crate::config::SemanticConfig::default().entry_evidence_bytes)
    }
}

impl Bounds {
    /// Evidence kept, with at most `entry_bytes` of entries' own verdicts.
    pub fn new(entry_bytes: u64) -> Self {
        Bounds {
            evidence: Mutex::default(),
            peers: Mutex::default(),
            unpublished: AtomicBool::new(false),
            published_ms: AtomicU64::new(0),
            near_misses: ExactShare::default(),
            entries: Entries::new(entry_bytes),
        }
    }

    /// Whether the next near miss is checked, for a `share` of them (every n-th, so the
    /// share is exact at any count).
    pub fn sample(&self, share: f64) -> bool {
        self.near_misses.take(share)
    }

    /// Records a verdict on a candidate of `tenant` (the entry `entry`, when known) found at
    /// `similarity` under the threshold of `scope`.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        state: &AppState,
        tenant: &str,
        scope: &str,
        entry: Option<EntryId>,
        similarity: f32,
        wrong: bool,
        source: Source,
    ) {
        let verdict = if wrong { "wrong" } else { "right" };
        state.metrics.verdict(tenant, source.as_str(), verdict);
        // Only the tenant's candidate in force learns: a verdict on a replaced candidate's
        // answer would learn for nobody, and each candidate's scope would stay for good.
        let policies = state.policies.load();
        let t = match tenant {
            "" => Some(policies.tenants.anonymous()),
            name => policies.tenants.named(name),
        };
        let Some(t) = t else {
            return;
        };
        let current = t.candidate().map(|c| candidate_prefix(c.fingerprint()));
        let live = |s: &str| {
            !s.starts_with(CANDIDATE) || current.as_deref().is_some_and(|c| s.starts_with(c))
        };
        if !live(scope) {
            return;
        }
        {
            let mut all = self.evidence.lock();
            let scopes = all.entry(tenant.to_string()).or_default();
            if !scopes.contains_key(scope) {
                // A new scope: the replaced candidates' go, and the tenants no longer
                // configured (a scope is about 1.6 KB, and the map lives as long as the
                // process).
                scopes.retain(|s, _| live(s));
                all.retain(|name, _| {
                    name == tenant || name.is_empty() || policies.tenants.named(name).is_some()
                });
            }
            let e = all
                .entry(tenant.to_string())
                .or_default()
                .entry(scope.to_string())
                .or_default();
            e.record(similarity, wrong);
            if e.total() > DECAY_AT {
                e.decay();
            }
        }
        // An entry's own threshold is the running policy's: a candidate's verdicts stay in
        // its scope. Kept only where a bound uses it.
        let bounded = delta_of(state, &t) > 0.0;
        if let (Some(id), false, true) = (entry, scope.starts_with(CANDIDATE), bounded) {
            self.entries.record(id, similarity, wrong);
        }
        self.unpublished.store(true, Ordering::Relaxed);
    }

    /// The threshold `tenant` serves at in `scope` under `delta`, from `configured`
    /// (`floor`: the lowest it may learn).
    pub fn threshold(
        &self,
        tenant: &str,
        scope: &str,
        delta: f64,
        configured: f32,
        floor: f32,
    ) -> Learned {
        let floor = floor.min(configured);
        let own = self.evidence.lock();
        let peers = self.peers.lock();
        fn of<'a>(m: &'a Scoped, tenant: &str, scope: &str) -> Option<&'a Evidence> {
            m.get(tenant).and_then(|s| s.get(scope))
        }
        match (of(&own, tenant, scope), of(&peers, tenant, scope)) {
            (Some(e), None) | (None, Some(e)) => e.threshold(delta, ALPHA, configured, floor),
            (Some(e), Some(p)) => {
                let mut all = e.clone();
                all.merge(p);
                all.threshold(delta, ALPHA, configured, floor)
            }
            (None, None) => Evidence::default().threshold(delta, ALPHA, configured, floor),
        }
    }

    /// The threshold `entry` serves at under `delta`, from its scope's learned threshold
    /// `scope_threshold` (`floor`: the lowest it may learn); `None` when no replica has a
    /// verdict on it (it serves at its scope's). See [`Entries`].
    pub fn entry_threshold(
        &self,
        entry: EntryId,
        delta: f64,
        scope_threshold: f32,
        floor: f32,
    ) -> Option<Learned> {
        self.entries
            .threshold(entry, delta, ALPHA, scope_threshold, floor)
    }

    /// Entries with verdicts of this replica's own.
    pub fn entries_with_evidence(&self) -> u64 {
        self.entries.count()
    }

    /// How many verdicts of this replica's own each entry that has any holds.
    pub fn entry_verdicts(&self) -> Vec<f64> {
        self.entries.totals()
    }

    /// This replica's own evidence, as a snapshot keeps it (see [`Bounds::restore`]).
    pub fn saved(&self) -> serde_json::Value {
        serde_json::to_value(self.own_published()).unwrap_or_default()
    }

    /// This replica's own evidence, as published.
    fn own_published(&self) -> Published {
        Published {
            at_ms: now_ms(),
            tenants: self.own_bins(),
            entries: self.entries.published(),
        }
    }

    /// Takes back the evidence a snapshot kept ([`Bounds::saved`]) into this replica's own,
    /// as [`Bounds::pull`] takes a peer's: of tenants configured here, at most
    /// [`MAX_SCOPES`] scopes each, checked bin by bin. Without it a restart without Redis
    /// forgot every verdict, and thresholds that wrong verdicts had raised fell back to
    /// the configured ones. Returns the scopes taken.
    pub fn restore(&self, state: &AppState, saved: serde_json::Value) -> usize {
        let Ok(mut p) = serde_json::from_value::<Published>(saved) else {
            tracing::warn!("bounds: the snapshot's evidence does not decode; not loaded");
            return 0;
        };
        // As old as a peer's that no longer counts: not taken either.
        if now_ms().saturating_sub(p.at_ms) > SHARED_TTL.as_millis() as u64 {
            tracing::info!("bounds: the snapshot's evidence is over a week old; not loaded");
            return 0;
        }
        let policies = state.policies.load_full();
        let mut taken = HashMap::new();
        let entries = self.entries.restore(std::mem::take(&mut p.entries));
        tracing::info!(
            entries,
            "bounds: entries' own verdicts taken from the snapshot"
        );
        admit(p, &policies, &mut taken, "snapshot");
        let n = taken.values().map(HashMap::len).sum();
        let mut own = self.evidence.lock();
        for (tenant, scopes) in taken {
            let mine = own.entry(tenant).or_default();
            for (scope, e) in scopes {
                mine.entry(scope).or_default().merge(&e);
            }
        }
        n
    }

    /// This replica's own evidence by tenant and scope, as bins.
    fn own_bins(&self) -> HashMap<String, HashMap<String, Bins>> {
        self.evidence
            .lock()
            .iter()
            .map(|(t, scopes)| {
                let bins = scopes.iter().map(|(s, e)| (s.clone(), e.bins())).collect();
                (t.clone(), bins)
            })
            .collect()
    }

    /// Publishes this replica's evidence to Redis when verdicts came since the last time, or
    /// the last publication is [`REPUBLISH`] old (a queued write; dropped writes are tried
    /// again next time). Nothing without Redis.
    pub fn publish(&self, state: &AppState) {
        let Some(redis) = state.store.redis() else {
            return;
        };
        let now = now_ms();
        let due = now.saturating_sub(self.published_ms.load(Ordering::Relaxed))
            >= REPUBLISH.as_millis() as u64;
        if !self.unpublished.swap(false, Ordering::Relaxed) && !due {
            return;
        }
        let published = self.own_published();
        let written = serde_json::to_vec(&published)
            .is_ok_and(|bytes| redis.put_field(SHARED, redis.replica_id(), bytes, SHARED_TTL));
        if written {
            self.published_ms.store(now, Ordering::Relaxed);
        } else {
            self.unpublished.store(true, Ordering::Relaxed);
            tracing::debug!("bounds: evidence not published (write dropped)");
        }
    }

    /// Reads the other replicas' evidence from Redis and makes it the peers' evidence (of
    /// tenants configured here, at most [`MAX_SCOPES`] scopes each, at most [`SHARED_TTL`]
    /// old, checked bin by bin). When Redis cannot be read, the last peers' evidence stays.
    pub async fn pull(&self, state: &AppState) {
        let Some(redis) = state.store.redis() else {
            return;
        };
        let fields = match redis.get_fields(&[SHARED.to_string()], MAX_REPLICAS).await {
            Ok(mut got) => got.pop().unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "bounds: other replicas' evidence not read");
                return;
            }
        };
        let now = now_ms();
        let policies = state.policies.load_full();
        let mut peers: Scoped = HashMap::new();
        let mut entries = Vec::new();
        // Fields of replicas gone for good (every restart publishes under a new id, and each
        // write keeps the hash): removed, so the hash holds live replicas only and reading
        // at most MAX_REPLICAS of its fields reaches them.
        let mut gone = Vec::new();
        for (replica, bytes) in fields {
            if replica == redis.replica_id() {
                continue;
            }
            let Ok(p) = serde_json::from_slice::<Published>(&bytes) else {
                tracing::debug!(replica, "bounds: undecodable evidence skipped");
                continue;
            };
            if now.saturating_sub(p.at_ms) > SHARED_TTL.as_millis() as u64 {
                // Removed only as read: a replica that published again meanwhile keeps it.
                gone.push((replica, bytes));
                continue;
            }
            let mut p = p;
            entries.push(std::mem::take(&mut p.entries));
            admit(p, &policies, &mut peers, &replica);
        }
        *self.peers.lock() = peers;
        self.entries.set_peers(entries);
        if let Err(e) = redis.del_fields(SHARED, &gone).await {
            tracing::debug!(error = %e, "bounds: stale evidence not removed");
        }
    }
}

/// Merges the evidence `p` holds into `into`: of tenants configured in `policies`, at most
/// [`MAX_SCOPES`] scopes each, each checked bin by bin (`from`: whose, for the log).
fn admit(p: Published, policies: &crate::policy::Policies, into: &mut Scoped, from: &str) {
    for (tenant, scopes) in p.tenants {
        if !(tenant.is_empty() || policies.tenants.named(&tenant).is_some()) {
            continue;
        }
        let mine = into.entry(tenant.clone()).or_default();
        for (scope, bins) in scopes.into_iter().take(MAX_SCOPES) {
            // A replica's own evidence decays past DECAY_AT: more is not its own.
            let e = Evidence::from_bins(&bins, 2.0 * DECAY_AT);
            let Some(e) = e.filter(|_| scope.len() <= MAX_SCOPE_BYTES) else {
                tracing::debug!(from, tenant, "bounds: invalid evidence skipped");
                continue;
            };
            if mine.len() < MAX_SCOPES || mine.contains_key(&scope) {
                mine.entry(scope).or_default().merge(&e);
            }
        }
    }
}

/// Starts the task that shares evidence with the other replicas every
/// `semantic.evidence_sync_secs` (with Redis, when that is not 0); it publishes once more
/// when stopped (the shutdown then flushes the Redis writes).
pub fn start(state: &Arc<AppState>, tracker: &TaskTracker, stop: CancellationToken) {
    let every = state.config.semantic.evidence_sync_secs;
    if state.store.redis().is_none() || every == 0 {
        return;
    }
    let weak = Arc::downgrade(state);
    tracker.spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(every));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let Some(state) = weak.upgrade() else { return };
            state.bounds.publish(&state);
            state.bounds.pull(&state).await;
        }
        if let Some(state) = weak.upgrade() {
            state.bounds.publish(&state);
        }
    });
}

/// The bound of the tenant of `namespace` (0: none).
pub fn delta_of(state: &AppState, tenant: &crate::auth::Tenant) -> f64 {
    tenant.policy().delta.unwrap_or(state.config.semantic.delta)
}

/// Checks a near miss once the backend answered its question: its candidate is judged
/// against `answer`. Runs on its own task.
pub fn check_near_miss(state: &Arc<AppState>, near: NearMiss, answer: String) {
    let (Some(embedder), state) = (state.embedder.clone(), state.clone()) else {
        return;
    };
    tokio::spawn(async move {
        let Some(entry) = state.store.get(near.candidate).await else {
            return;
        };
        let texts = [answer, entry.text.clone()];
        let Ok(v) = embedder.embed_many_spare(&near.tenant, &texts).await else {
            return;
        };
        let same = reprise_embedder::cosine(&v[0], &v[1]) >= state.config.semantic.answer_threshold;
        let (tenant, scope) = (&near.tenant, &near.scope);
        state.bounds.record(
            &state,
            tenant,
            scope,
            Some(near.candidate),
            near.similarity,
            !same,
            Source::NearMiss,
        );
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidate::Arm;

    /// A candidate's scopes share their metric series with the candidates before and after
    /// it (one at a time per tenant); the running policy's keep their names.
    #[test]
    fn candidates_scopes_are_labelled_without_their_fingerprint() {
        let rule = reprise_policies::semantic::Rule {
            namespace: Some("legal".into()),
            ..Default::default()
        };
        let first = scope(Some(&rule), Arm::Candidate, Some(1));
        let second = scope(Some(&rule), Arm::Candidate, Some(u64::MAX));
        assert_ne!(first, second);
        assert_eq!(scope_label(&first), "candidate:legal/*");
        assert_eq!(scope_label(&second), scope_label(&first));
        let running = scope(Some(&rule), Arm::Current, Some(1));
        assert_eq!(scope_label(&running), running);
        assert_eq!(scope_label("candidate:x:*/*"), "candidate:x:*/*");
    }

    /// Each candidate learns from its own verdicts: one that replaced another (its gate off,
    /// say) does not start from the verdicts on the first, nor from the running policy's.
    #[test]
    fn each_candidate_has_a_scope_of_its_own() {
        let (first, second) = (
            scope(None, Arm::Candidate, Some(1)),
            scope(None, Arm::Candidate, Some(2)),
        );
        assert_ne!(first, second);
        let running = scope(None, Arm::Current, Some(1));
        assert_eq!(running, "*/*");
        assert_eq!(scope(None, Arm::Shadow, Some(1)), running);
        assert!(first != running && second != running);
    }
}
