//! [`Rollup`]: what the requests of one interval add up to, mergeable across intervals and
//! replicas. Every part is a sum (counts, savings, histogram buckets) or a bounded summary
//! (the [`TopK`] lists), so merging two rollups is adding them, and every part is bounded
//! whatever the traffic: tenant labels, gate reasons and list lengths by constants, texts by
//! [`MAX_TEXT_CHARS`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::hist::Histogram;
use super::topk::{Detail, TopK};
use crate::metrics::RequestMetrics;
use crate::reqlog::{cut, LogRecord};

/// Most tenant labels in one rollup's `by_tenant`; the rest count under [`OTHER`].
pub const MAX_TENANT_LABELS: usize = 256;
/// Most gate reasons in one rollup (the gate has a fixed handful); the rest under [`OTHER`].
pub const MAX_GATE_REASONS: usize = 32;
/// Longest question kept, in characters (the request log already cuts them to
/// `log.question_chars`; a log read by `reprise report` may come from anywhere).
pub const MAX_TEXT_CHARS: usize = 4096;
/// Longest entry id kept (ids are 32 hex digits).
const MAX_ID_CHARS: usize = 64;
/// The label of what is past a bound.
pub const OTHER: &str = "other";

/// What a rollup reads of one finished request: borrowed from a [`LogRecord`] (the live
/// server) or from a parsed log line (`reprise report`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Facts<'a> {
    /// The tenant (empty: anonymous).
    pub tenant: &'a str,
    /// exact, semantic, prefetch, miss, bypass or error (anything else is not counted).
    pub outcome: &'a str,
    /// Where an exact hit was found (`memory` or `redis`).
    pub tier: Option<&'a str>,
    /// The best candidate's similarity.
    pub similarity: Option<f32>,
    /// The entry that answered.
    pub entry_id: Option<&'a str>,
    /// `pass` or the gate's reason.
    pub gate: Option<&'a str>,
    /// Time to the first token, milliseconds.
    pub ttft_ms: Option<f64>,
    /// Whole request, milliseconds.
    pub total_ms: f64,
    /// What a hit saved.
    pub saved_prompt_tokens: u64,
    /// What a hit saved.
    pub saved_completion_tokens: u64,
    /// What a hit saved, backend milliseconds.
    pub saved_backend_ms: u64,
    /// What a hit saved, at the configured prices.
    pub saved_cost: f64,
    /// The question, as logged.
    pub question: Option<&'a str>,
    /// For a hit by meaning: the question the entry was generated for.
    pub matched: Option<&'a str>,
}

impl<'a> From<&'a LogRecord> for Facts<'a> {
    fn from(r: &'a LogRecord) -> Self {
        Facts {
            tenant: &r.tenant,
            outcome: r.outcome,
            tier: r.tier,
            similarity: r.similarity,
            entry_id: r.entry_id.as_deref(),
            gate: r.gate,
            ttft_ms: r.ttft_ms,
            total_ms: r.total_ms,
            saved_prompt_tokens: u64::from(r.saved_prompt_tokens),
            saved_completion_tokens: u64::from(r.saved_completion_tokens),
            saved_backend_ms: u64::from(r.saved_backend_ms),
            saved_cost: r.saved_cost,
            question: r.question.as_deref(),
            matched: r.matched.as_deref(),
        }
    }
}

/// Requests by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Outcomes {
    /// Exact hits.
    pub exact: u64,
    /// Hits by meaning.
    pub semantic: u64,
    /// Hits on prefetched entries.
    pub prefetch: u64,
    /// Misses (generated).
    pub miss: u64,
    /// Requests the cache did not read (forwarded, or `no-cache`/`no-store`).
    pub bypass: u64,
    /// Failed requests.
    pub error: u64,
}

impl Outcomes {
    fn slot(&mut self, outcome: &str) -> Option<&mut u64> {
        Some(match outcome {
            "exact" => &mut self.exact,
            "semantic" => &mut self.semantic,
            "prefetch" => &mut self.prefetch,
            "miss" => &mut self.miss,
            "bypass" => &mut self.bypass,
            "error" => &mut self.error,
            _ => return None,
        })
    }

    fn merge(&mut self, o: &Outcomes) {
        self.exact += o.exact;
        self.semantic += o.semantic;
        self.prefetch += o.prefetch;
        self.miss += o.miss;
        self.bypass += o.bypass;
        self.error += o.error;
    }

    /// Hits of every kind.
    pub fn hits(&self) -> u64 {
        self.exact + self.semantic + self.prefetch
    }
}

/// Hits by the tier that answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tiers {
    /// Exact hits from this replica's memory (and exact hits whose tier was not noted).
    pub memory: u64,
    /// Exact hits read from Redis.
    pub redis: u64,
    /// Hits by meaning.
    pub semantic: u64,
    /// Hits on prefetched entries.
    pub prefetch: u64,
}

impl Tiers {
    fn merge(&mut self, o: &Tiers) {
        self.memory += o.memory;
        self.redis += o.redis;
        self.semantic += o.semantic;
        self.prefetch += o.prefetch;
    }
}

/// One tenant's requests and hits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TenantCounts {
    /// Requests.
    pub requests: u64,
    /// Hits of every kind.
    pub hits: u64,
}

/// One histogram for hits and one for misses (misses and bypasses: the backend answered).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HitMiss {
    /// Hits of every kind.
    pub hit: Histogram,
    /// Misses and bypasses.
    pub miss: Histogram,
}

impl HitMiss {
    fn merge(&mut self, o: &HitMiss) {
        self.hit.merge(&o.hit);
        self.miss.merge(&o.miss);
    }

    /// Hits and misses together.
    pub fn both(&self) -> Histogram {
        let mut h = self.hit.clone();
        h.merge(&self.miss);
        h
    }
}

/// What hits saved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Savings {
    /// Prompt tokens of the generations hits replaced.
    pub prompt_tokens: u64,
    /// Completion tokens of the generations hits replaced.
    pub completion_tokens: u64,
    /// Backend seconds of the generations hits replaced.
    pub backend_seconds: f64,
    /// Their price at `[metrics.prices]`.
    pub cost: f64,
}

impl Savings {
    fn merge(&mut self, o: &Savings) {
        self.prompt_tokens += o.prompt_tokens;
        self.completion_tokens += o.completion_tokens;
        self.backend_seconds += o.backend_seconds;
        self.cost += o.cost;
    }
}

/// The prefetcher's work in the interval (sampled from its counters; not per tenant).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefetchCounts {
    /// Prefetched answers stored (refresh-ahead renewals left out).
    pub completed: u64,
    /// Prefetched entries served for the first time.
    pub hits: u64,
    /// Prefetched entries gone unserved.
    pub wasted: u64,
}

impl PrefetchCounts {
    fn merge(&mut self, o: &PrefetchCounts) {
        self.completed += o.completed;
        self.hits += o.hits;
        self.wasted += o.wasted;
    }

    /// What was counted between `earlier` and `self` (totals since start).
    pub fn since(&self, earlier: &PrefetchCounts) -> PrefetchCounts {
        PrefetchCounts {
            completed: self.completed.saturating_sub(earlier.completed),
            hits: self.hits.saturating_sub(earlier.hits),
            wasted: self.wasted.saturating_sub(earlier.wasted),
        }
    }
}

/// A missed question's detail: the best similarity any candidate reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct BestSimilarity(pub Option<f32>);

impl Detail for BestSimilarity {
    fn absorb(&mut self, other: &Self) {
        self.0 = match (self.0, other.0) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// A served pair's detail: its similarity and the entry that answered (of the most similar
/// occurrence).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Served {
    /// Similarity of the question to the entry's.
    pub similarity: f32,
    /// The entry.
    pub entry_id: String,
}

impl Detail for Served {
    fn absorb(&mut self, other: &Self) {
        if other.similarity > self.similarity {
            *self = other.clone();
        }
    }
}

/// What the requests of one interval add up to.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Rollup {
    /// Requests counted.
    pub requests: u64,
    /// By outcome.
    pub by_outcome: Outcomes,
    /// Hits by tier.
    pub by_tier: Tiers,
    /// By tenant label (`anonymous` for requests without a tenant).
    pub by_tenant: BTreeMap<String, TenantCounts>,
    /// Whole-request latency, milliseconds.
    pub latency: HitMiss,
    /// Time to the first token, milliseconds.
    pub ttft: HitMiss,
    /// What hits saved.
    pub saved: Savings,
    /// The prefetcher's work.
    pub prefetch: PrefetchCounts,
    /// Best candidates the gate rejected, by reason.
    pub gate_rejections: BTreeMap<String, u64>,
    /// Questions missed (or bypassed) most often, with the best similarity seen.
    pub top_missed: TopK<String, BestSimilarity>,
    /// (question, matched question) pairs served by meaning most often.
    pub top_pairs: TopK<(String, String), Served>,
}

/// Counts `n` under `key` in a map of at most `max` keys ([`OTHER`] past it).
fn bump(map: &mut BTreeMap<String, u64>, key: &str, n: u64, max: usize) {
    let key = if map.contains_key(key) || map.len() < max.saturating_sub(1) {
        key
    } else {
        OTHER
    };
    *map.entry(key.to_string()).or_default() += n;
}

impl Rollup {
    /// Counts one finished request (a verdict line, or any unknown outcome, is not counted).
    pub fn add(&mut self, rec: &LogRecord) -> bool {
        self.add_facts(&Facts::from(rec))
    }

    /// Counts one finished request; `false` (nothing counted) when its outcome is not one of
    /// a request's.
    pub fn add_facts(&mut self, f: &Facts<'_>) -> bool {
        let Some(n) = self.by_outcome.slot(f.outcome) else {
            return false;
        };
        *n += 1;
        self.requests += 1;
        let hit = matches!(f.outcome, "exact" | "semantic" | "prefetch");
        let backend = matches!(f.outcome, "miss" | "bypass");
        match (f.outcome, f.tier) {
            ("exact", Some("redis")) => self.by_tier.redis += 1,
            ("exact", _) => self.by_tier.memory += 1,
            ("semantic", _) => self.by_tier.semantic += 1,
            ("prefetch", _) => self.by_tier.prefetch += 1,
            _ => {}
        }
        let label = RequestMetrics::tenant_label(f.tenant);
        let key =
            if self.by_tenant.contains_key(label) || self.by_tenant.len() < MAX_TENANT_LABELS - 1 {
                label
            } else {
                OTHER
            };
        // Looked up by the borrowed label first: a request does not allocate one.
        let t = match self.by_tenant.get_mut(key) {
            Some(t) => t,
            None => self.by_tenant.entry(key.to_string()).or_default(),
        };
        t.requests += 1;
        t.hits += u64::from(hit);
        if hit || backend {
            let (latency, ttft) = if hit {
                (&mut self.latency.hit, &mut self.ttft.hit)
            } else {
                (&mut self.latency.miss, &mut self.ttft.miss)
            };
            latency.record(f.total_ms);
            if let Some(ms) = f.ttft_ms {
                ttft.record(ms);
            }
        }
        if hit {
            self.saved.merge(&Savings {
                prompt_tokens: f.saved_prompt_tokens,
                completion_tokens: f.saved_completion_tokens,
                backend_seconds: f.saved_backend_ms as f64 / 1000.0,
                cost: if f.saved_cost.is_finite() {
                    f.saved_cost
                } else {
                    0.0
                },
            });
        }
        if let Some(reason) = f.gate.filter(|g| *g != "pass") {
            bump(&mut self.gate_rejections, reason, 1, MAX_GATE_REASONS);
        }
        let text = |t: Option<&str>| t.and_then(|t| cut(t, MAX_TEXT_CHARS));
        if backend {
            if let Some(q) = text(f.question) {
                let sim = f.similarity.filter(|s| s.is_finite());
                self.top_missed.add(q, BestSimilarity(sim));
            }
        }
        if matches!(f.outcome, "semantic" | "prefetch") {
            if let (Some(q), Some(m)) = (text(f.question), text(f.matched)) {
                let served = Served {
                    similarity: f.similarity.filter(|s| s.is_finite()).unwrap_or(0.0),
                    entry_id: f
                        .entry_id
                        .and_then(|id| cut(id, MAX_ID_CHARS))
                        .unwrap_or_default(),
                };
                self.top_pairs.add((q, m), served);
            }
        }
        true
    }

    /// Adds another rollup (of another interval or replica) to this one.
    pub fn merge(&mut self, o: &Rollup) {
        self.requests += o.requests;
        self.by_outcome.merge(&o.by_outcome);
        self.by_tier.merge(&o.by_tier);
        for (name, c) in &o.by_tenant {
            let key = if self.by_tenant.contains_key(name)
                || self.by_tenant.len() < MAX_TENANT_LABELS - 1
            {
                name.as_str()
            } else {
                OTHER
            };
            let t = self.by_tenant.entry(key.to_string()).or_default();
            t.requests += c.requests;
            t.hits += c.hits;
        }
        self.latency.merge(&o.latency);
        self.ttft.merge(&o.ttft);
        self.saved.merge(&o.saved);
        self.prefetch.merge(&o.prefetch);
        for (reason, n) in &o.gate_rejections {
            bump(&mut self.gate_rejections, reason, *n, MAX_GATE_REASONS);
        }
        self.top_missed.merge(&o.top_missed);
        self.top_pairs.merge(&o.top_pairs);
    }

    /// Applies the bounds to a rollup read from elsewhere (Redis): label counts, list lengths,
    /// text lengths.
    pub fn bound(&mut self) {
        if self.by_tenant.len() > MAX_TENANT_LABELS {
            let extra = self.by_tenant.split_off(
                &self
                    .by_tenant
                    .keys()
                    .nth(MAX_TENANT_LABELS - 1)
                    .cloned()
                    .unwrap_or_default(),
            );
            let other = self.by_tenant.entry(OTHER.to_string()).or_default();
            for c in extra.values() {
                other.requests += c.requests;
                other.hits += c.hits;
            }
        }
        if self.gate_rejections.len() > MAX_GATE_REASONS {
            let all = std::mem::take(&mut self.gate_rejections);
            for (reason, n) in all {
                bump(&mut self.gate_rejections, &reason, n, MAX_GATE_REASONS);
            }
        }
        let cut_text = |s: &mut String, max: usize| {
            if let Some((at, _)) = s.char_indices().nth(max) {
                s.truncate(at);
            }
        };
        self.top_missed.bound();
        for c in self.top_missed.counters_mut() {
            cut_text(&mut c.key, MAX_TEXT_CHARS);
        }
        self.top_pairs.bound();
        for c in self.top_pairs.counters_mut() {
            cut_text(&mut c.key.0, MAX_TEXT_CHARS);
            cut_text(&mut c.key.1, MAX_TEXT_CHARS);
            cut_text(&mut c.detail.entry_id, MAX_ID_CHARS);
        }
    }

    /// Drops the question lists (what a byte budget gives up first).
    pub fn drop_detail(&mut self) {
        self.top_missed.clear();
        self.top_pairs.clear();
    }

    /// Whether the question lists are empty.
    pub fn has_detail(&self) -> bool {
        !self.top_missed.is_empty() || !self.top_pairs.is_empty()
    }

    /// About how many bytes the rollup holds (the structure, its labels and texts).
    pub fn approx_bytes(&self) -> u64 {
        // The fixed part: counts, four histograms of 62 buckets.
        let mut n = 2_400usize;
        n += self.by_tenant.keys().map(|k| k.len() + 64).sum::<usize>();
        n += self
            .gate_rejections
            .keys()
            .map(|k| k.len() + 48)
            .sum::<usize>();
        n += self
            .top_missed
            .counters()
            .iter()
            .map(|c| c.key.len() + 64)
            .sum::<usize>();
        n += self
            .top_pairs
            .counters()
            .iter()
            .map(|c| c.key.0.len() + c.key.1.len() + c.detail.entry_id.len() + 96)
            .sum::<usize>();
        n as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(outcome: &'static str, question: &str, total_ms: f64) -> LogRecord {
        LogRecord {
            outcome,
            total_ms,
            ttft_ms: Some(total_ms / 2.0),
            question: Some(question.to_string()),
            ..Default::default()
        }
    }

    /// A varied stream: every outcome, tiers, tenants, gate reasons, savings, pairs.
    fn stream() -> Vec<LogRecord> {
        let mut out = Vec::new();
        for i in 0..600u32 {
            let mut r = match i % 6 {
                0 => rec("miss", &format!("question {}", i % 37), f64::from(i)),
                1 => LogRecord {
                    tier: Some(if i % 4 == 1 { "redis" } else { "memory" }),
                    saved_prompt_tokens: 10,
                    saved_completion_tokens: 20,
                    saved_backend_ms: 1500,
                    saved_cost: 0.25,
                    ..rec("exact", "q", 0.5)
                },
                2 => LogRecord {
                    similarity: Some(0.8 + (i % 10) as f32 / 100.0),
                    matched: Some(format!("matched {}", i % 5)),
                    entry_id: Some(format!("{:032x}", i % 5)),
                    saved_completion_tokens: 7,
                    ..rec("semantic", &format!("asked {}", i % 5), 3.0)
                },
                3 => LogRecord {
                    gate: Some(if i % 4 == 3 { "negation" } else { "pass" }),
                    similarity: Some(0.7),
                    ..rec("bypass", "bypassed", 100.0)
                },
                4 => rec("error", "failed", 1.0),
                _ => rec("prefetch", "p", 2.0),
            };
            r.tenant = ["", "acme", "beta"][(i % 3) as usize].to_string();
            out.push(r);
        }
        out.push(LogRecord {
            outcome: "feedback",
            ..Default::default()
        });
        out
    }

    #[test]
    fn adding_in_parts_and_merging_equals_adding_all() {
        let recs = stream();
        let mut all = Rollup::default();
        let mut parts = vec![Rollup::default(); 4];
        for (i, r) in recs.iter().enumerate() {
            all.add(r);
            parts[i % 4].add(r);
        }
        let mut merged = Rollup::default();
        for p in &parts {
            merged.merge(p);
        }
        // Float sums may differ in their last bits with the order of addition.
        assert!((merged.saved.cost - all.saved.cost).abs() < 1e-9);
        assert!((merged.saved.backend_seconds - all.saved.backend_seconds).abs() < 1e-9);
        merged.saved.cost = all.saved.cost;
        merged.saved.backend_seconds = all.saved.backend_seconds;
        assert_eq!(merged, all);
        assert_eq!(all.requests, 600, "the verdict line is not a request");
        assert_eq!(all.by_outcome.miss, 100);
        assert_eq!(all.by_outcome.hits(), 300);
        assert_eq!(all.by_tier.redis + all.by_tier.memory, 100);
        assert_eq!(all.by_tier.redis, 50);
        assert_eq!(all.by_tenant["anonymous"].requests, 200);
        assert_eq!(all.saved.prompt_tokens, 1000);
        assert_eq!(all.saved.completion_tokens, 100 * 20 + 100 * 7);
        assert!((all.saved.cost - 25.0).abs() < 1e-9);
        assert_eq!(all.gate_rejections["negation"], 50);
        assert_eq!(all.latency.hit.count(), 300);
        assert_eq!(all.latency.miss.count(), 200);
        let top = all.top_pairs.sorted()[0];
        assert_eq!(top.count, 20);
        assert_eq!(top.key.1, top.key.0.replace("asked", "matched"));
        // Serialised and read back, it is the same rollup.
        let json = serde_json::to_string(&all).unwrap();
        assert_eq!(serde_json::from_str::<Rollup>(&json).unwrap(), all);
    }

    #[test]
    fn a_dominant_missed_question_is_found_with_its_best_similarity() {
        let mut r = Rollup::default();
        for i in 0..20_000u32 {
            let mut m = if i % 5 == 0 {
                rec("miss", "How do I cancel my plan?", 10.0)
            } else {
                rec("miss", &format!("rare question {i}"), 10.0)
            };
            m.similarity = Some(if i == 500 { 0.84 } else { 0.5 });
            r.add(&m);
        }
        let top = r.top_missed.sorted()[0];
        assert_eq!(top.key, "How do I cancel my plan?");
        assert!(top.count >= 4000);
        assert_eq!(top.detail, BestSimilarity(Some(0.84)));
    }

    #[test]
    fn bounds_hold_under_100k_distinct_questions_and_tenants() {
        let mut r = Rollup::default();
        let long = "x".repeat(10_000);
        for i in 0..100_000u32 {
            let mut m = rec("miss", &format!("{i} {long}"), 10.0);
            m.tenant = format!("t{i}");
            m.gate = Some(if i % 2 == 0 { "pass" } else { "reason" });
            r.add(&m);
            let mut s = rec("semantic", &format!("s{i}"), 1.0);
            s.matched = Some(format!("m{i}"));
            r.add(&s);
        }
        assert_eq!(r.requests, 200_000);
        assert!(r.top_missed.counters().len() <= super::super::topk::K);
        assert!(r.top_pairs.counters().len() <= super::super::topk::K);
        assert!(r.by_tenant.len() <= MAX_TENANT_LABELS);
        assert_eq!(
            r.by_tenant.values().map(|c| c.requests).sum::<u64>(),
            200_000
        );
        assert!(r
            .top_missed
            .counters()
            .iter()
            .all(|c| c.key.chars().count() <= MAX_TEXT_CHARS));
        assert!(r.approx_bytes() < 400_000, "{}", r.approx_bytes());
        let mut merged = r.clone();
        merged.merge(&r);
        assert!(merged.by_tenant.len() <= MAX_TENANT_LABELS);
        assert!(merged.top_missed.counters().len() <= super::super::topk::K);
    }

    #[test]
    fn a_rollup_read_from_elsewhere_is_bounded() {
        let mut r = Rollup::default();
        for i in 0..1000 {
            r.by_tenant.insert(format!("t{i}"), TenantCounts::default());
            r.gate_rejections.insert(format!("g{i}"), 1);
        }
        r.top_missed
            .add("y".repeat(MAX_TEXT_CHARS + 10), BestSimilarity(None));
        r.bound();
        assert!(r.by_tenant.len() <= MAX_TENANT_LABELS);
        assert_eq!(r.gate_rejections.len(), MAX_GATE_REASONS);
        assert_eq!(r.gate_rejections.values().sum::<u64>(), 1000);
        assert_eq!(r.top_missed.sorted()[0].key.len(), MAX_TEXT_CHARS);
    }
}
