//! Candidate policies tried beside a tenant's running one (`[tenants.candidate]`).
//!
//! A candidate is another set of the tenant's semantic rules (threshold, top_k, gate, on/off).
//! - **Shadow**: every request is looked up under both; the answer served is the running
//!   policy's. Each lookup is classed by what the candidate would have done: the same hit,
//!   the same miss, a hit where the running policy missed (`would_hit`), a miss where it hit
//!   (`would_miss`), or another entry (`different`), with the candidate's similarity.
//! - **Canary**: `percent` of the requests (every n-th, so the share is exact at any count)
//!   are served under the candidate, the rest under the running policy (the control). Once
//!   each side has answered `min_requests`, after every request the candidate is judged
//!   against the control: error rate, P95 latency (both sides keep latencies at the pace of
//!   the smaller side, compared over the span both cover once each has 20 there), share of
//!   hits reported wrong, hit rate. Shares are compared beyond
//!   chance (a one-sided 99 % interval of the difference must clear the bound). A candidate
//!   worse beyond the configured bounds is rolled back (a policy change that removes it, so every replica
//!   drops it); a good one is promoted by one admin call (`POST /admin/policies/promote`).
//!
//! The state (counts, latencies) belongs to the candidate, not to the policy version: a
//! change of anything else keeps it, as it keeps rate limiters.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use serde_json::json;

use crate::config::{CandidateConfig, CandidateMode};
use crate::metrics::Outcome;
use crate::share::ExactShare;

/// Latencies kept per canary side for its P95.
const LATENCY_SAMPLES: usize = 1024;

/// Latencies each side needs, over the common span, before P95s are compared: below this a
/// P95 is the slowest request or close to it.
const MIN_LATENCY_SAMPLES: usize = 20;

/// Which policy a request is looked up (and served) under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arm {
    /// The running policy (no candidate, or the canary's control side).
    #[default]
    Current,
    /// The candidate (the canary's side).
    Candidate,
    /// The running policy, with the candidate's lookup beside it.
    Shadow,
}

/// What a shadow lookup found against what was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShadowResult {
    /// Both served the same entry.
    AgreeHit,
    /// Both missed.
    AgreeMiss,
    /// The candidate would have served an entry where the running policy missed.
    WouldHit,
    /// The candidate would have missed where the running policy served an entry.
    WouldMiss,
    /// Both hit, different entries.
    Different,
}

impl ShadowResult {
    /// Every result, in the order of the counts.
    pub const ALL: [ShadowResult; 5] = [
        ShadowResult::AgreeHit,
        ShadowResult::AgreeMiss,
        ShadowResult::WouldHit,
        ShadowResult::WouldMiss,
        ShadowResult::Different,
    ];

    /// Metric label and JSON key.
    pub fn as_str(self) -> &'static str {
        match self {
            ShadowResult::AgreeHit => "agree_hit",
            ShadowResult::AgreeMiss => "agree_miss",
            ShadowResult::WouldHit => "would_hit",
            ShadowResult::WouldMiss => "would_miss",
            ShadowResult::Different => "different",
        }
    }

    /// The result for the entry served (`served`) and the one the candidate would serve.
    pub fn of<T: PartialEq>(served: Option<T>, candidate: Option<T>) -> ShadowResult {
        match (served, candidate) {
            (None, None) => ShadowResult::AgreeMiss,
            (None, Some(_)) => ShadowResult::WouldHit,
            (Some(_), None) => ShadowResult::WouldMiss,
            (Some(a), Some(b)) if a == b => ShadowResult::AgreeHit,
            _ => ShadowResult::Different,
        }
    }
}

/// One side of a canary.
#[derive(Debug, Default)]
struct Side {
    requests: u64,
    hits: u64,
    errors: u64,
    /// Hits reported wrong (`POST /v1/feedback`).
    wrong: u64,
    /// The latest latencies, in seconds, with when each was recorded.
    latencies: VecDeque<(Instant, f64)>,
    /// Which requests' latencies are kept.
    sampled: ExactShare,
}

impl Side {
    /// Counts a request; keeps its latency when it is among the `keep` share (0 to 1).
    fn record(&mut self, outcome: Outcome, secs: f64, keep: f64) {
        self.requests += 1;
        match outcome {
            Outcome::Exact | Outcome::Semantic | Outcome::Prefetch => self.hits += 1,
            Outcome::Error => self.errors += 1,
            Outcome::Miss | Outcome::Bypass => {}
        }
        if !self.sampled.take(keep) {
            return;
        }
        if self.latencies.len() == LATENCY_SAMPLES {
            self.latencies.pop_front();
        }
        self.latencies.push_back((Instant::now(), secs));
    }

    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.requests.max(1) as f64
    }

    /// Hits reported wrong, at most its hits: a verdict can reach a replica that did not
    /// count the hit (the response record is shared), and must not make the share pass 1.
    fn wrong_hits(&self) -> u64 {
        self.wrong.min(self.hits)
    }

    /// The share of its hits reported wrong.
    fn wrong_hit_rate(&self) -> f64 {
        self.wrong_hits() as f64 / self.hits.max(1) as f64
    }

    /// When its oldest kept latency was recorded.
    fn oldest(&self) -> Option<Instant> {
        self.latencies.front().map(|(at, _)| *at)
    }

    /// The P95 of the latencies recorded since `since` (all kept ones: `None`), with how
    /// many there are.
    fn p95_since(&self, since: Option<Instant>) -> (f64, usize) {
        let mut v: Vec<f64> = self
            .latencies
            .iter()
            .filter(|(at, _)| since.is_none_or(|s| *at >= s))
            .map(|(_, secs)| *secs)
            .collect();
        if v.is_empty() {
            return (0.0, 0);
        }
        v.sort_unstable_by(f64::total_cmp);
        let p95 = v[((v.len() as f64 * 0.95).ceil() as usize).clamp(1, v.len()) - 1];
        (p95, v.len())
    }

    fn p95(&self) -> f64 {
        self.p95_since(None).0
    }

    fn view(&self) -> serde_json::Value {
        json!({
            "requests": self.requests,
            "hit_rate": self.rate(self.hits),
            "error_rate": self.rate(self.errors),
            "wrong_hit_rate": self.wrong_hit_rate(),
            "p95_ms": self.p95() * 1000.0,
        })
    }
}

/// A tenant's candidate and what was seen of it.
pub struct Candidate {
    config: CandidateConfig,
    /// The canary's share of requests.
    assigned: ExactShare,
    control: Mutex<Side>,
    candidate: Mutex<Side>,
    shadow: [AtomicU64; 5],
    /// Set once the candidate was judged worse: it is being removed.
    rolled_back: AtomicBool,
    /// Names its configuration on every replica (see [`Candidate::fingerprint`]).
    fingerprint: u64,
    /// The share of each side's requests whose latency it keeps (control, candidate): the
    /// smaller side's share of all requests over its own, so both keep latencies at one pace
    /// and their kept samples span the same time.
    keep: (f64, f64),
}

impl Candidate {
    /// A candidate with nothing seen yet.
    pub fn new(config: CandidateConfig) -> Candidate {
        let fingerprint = serde_json::to_vec(&config).map_or(0, |bytes| {
            let hash = blake3::hash(&bytes);
            u64::from_le_bytes(hash.as_bytes()[..8].try_into().expect("eight bytes"))
        });
        let p = (config.percent / 100.0).clamp(0.0, 1.0);
        let keep = |mine: f64, other: f64| match mine > 0.0 {
            true => (other / mine).min(1.0),
            false => 1.0,
        };
        Candidate {
            fingerprint,
            keep: (keep(1.0 - p, p), keep(p, 1.0 - p)),
            config,
            assigned: ExactShare::default(),
            control: Mutex::default(),
            candidate: Mutex::default(),
            shadow: Default::default(),
            rolled_back: AtomicBool::new(false),
        }
    }

    /// The candidate as configured.
    pub fn config(&self) -> &CandidateConfig {
        &self.config
    }

    /// Whether it was judged worse than the running policy (its rollback started).
    pub fn is_rolled_back(&self) -> bool {
        self.rolled_back.load(Ordering::Relaxed)
    }

    /// A digest of its configuration, the same on every replica: a response remembers the
    /// candidate it was served beside, so a verdict given after the candidate was replaced
    /// does not count against its successor.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The arm of the next request: in shadow mode always [`Arm::Shadow`]; in canary mode
    /// [`Arm::Candidate`] for `percent` of the requests (request n when ⌊n·p/100⌋ steps
    /// up), else [`Arm::Current`]. A rolled-back candidate gets no more requests.
    pub fn assign(&self) -> Arm {
        if self.rolled_back.load(Ordering::Relaxed) {
            return Arm::Current;
        }
        match self.config.mode {
            CandidateMode::Shadow => Arm::Shadow,
            CandidateMode::Canary => {
                if self.assigned.take(self.config.percent / 100.0) {
                    Arm::Candidate
                } else {
                    Arm::Current
                }
            }
        }
    }

    /// Counts one shadow lookup.
    pub fn record_shadow(&self, result: ShadowResult) {
        let i = ShadowResult::ALL
            .iter()
            .position(|r| *r == result)
            .expect("every result is listed");
        self.shadow[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The shadow counts so far, by result.
    pub fn shadow_counts(&self) -> [(ShadowResult, u64); 5] {
        std::array::from_fn(|i| (ShadowResult::ALL[i], self.shadow[i].load(Ordering::Relaxed)))
    }

    /// Records a canary request's outcome and latency on its side; the reason to roll the
    /// candidate back when this request makes it worse beyond the bounds (given once).
    pub fn record(&self, on_candidate: bool, outcome: Outcome, secs: f64) -> Option<String> {
        let side = if on_candidate {
            &self.candidate
        } else {
            &self.control
        };
        let keep = if on_candidate {
            self.keep.1
        } else {
            self.keep.0
        };
        side.lock().record(outcome, secs, keep);
        self.judged()
    }

    /// Records a hit on one side reported wrong; the reason to roll back, as
    /// [`Candidate::record`].
    pub fn record_wrong(&self, on_candidate: bool) -> Option<String> {
        let side = if on_candidate {
            &self.candidate
        } else {
            &self.control
        };
        side.lock().wrong += 1;
        self.judged()
    }

    /// The reason to roll back, given once, when the candidate is judged worse.
    fn judged(&self) -> Option<String> {
        let reason = {
            let control = self.control.lock();
            let candidate = self.candidate.lock();
            self.judge(&control, &candidate)?
        };
        // Only the first request to find it worse rolls it back.
        (!self.rolled_back.swap(true, Ordering::Relaxed)).then_some(reason)
    }

    /// Why the candidate is worse than the control beyond the bounds, once both sides have
    /// answered enough requests.
    fn judge(&self, control: &Side, candidate: &Side) -> Option<String> {
        let c = &self.config;
        if control.requests < c.min_requests || candidate.requests < c.min_requests {
            return None;
        }
        let (ce, ke) = (
            candidate.rate(candidate.errors),
            control.rate(control.errors),
        );
        let errors = (
            (candidate.errors, candidate.requests),
            (control.errors, control.requests),
        );
        if surely_more(errors.0, errors.1, c.max_error_rate_increase) {
            return Some(format!(
                "error rate {:.1} % against {:.1} % (bound: {:.1} points more)",
                ce * 100.0,
                ke * 100.0,
                c.max_error_rate_increase * 100.0
            ));
        }
        // Over the same span of time on both sides (latency changes with load), and only
        // from enough samples on each.
        let since = candidate.oldest().max(control.oldest());
        let ((cp, cn), (kp, kn)) = (candidate.p95_since(since), control.p95_since(since));
        if cn.min(kn) >= MIN_LATENCY_SAMPLES && cp > kp * c.max_latency_ratio {
            return Some(format!(
                "P95 latency {:.1} ms against {:.1} ms (bound: {}×)",
                cp * 1000.0,
                kp * 1000.0,
                c.max_latency_ratio
            ));
        }
        let (cw, kw) = (candidate.wrong_hit_rate(), control.wrong_hit_rate());
        let wrong = (
            (candidate.wrong_hits(), candidate.hits),
            (control.wrong_hits(), control.hits),
        );
        if surely_more(wrong.0, wrong.1, c.max_wrong_hit_rate_increase) {
            return Some(format!(
                "wrong hits {:.1} % against {:.1} % (bound: {:.1} points more)",
                cw * 100.0,
                kw * 100.0,
                c.max_wrong_hit_rate_increase * 100.0
            ));
        }
        let (ch, kh) = (candidate.rate(candidate.hits), control.rate(control.hits));
        if c.min_hit_rate_ratio > 0.0 && ch < kh * c.min_hit_rate_ratio {
            return Some(format!(
                "hit rate {:.1} % against {:.1} % (bound: {}× of it)",
                ch * 100.0,
                kh * 100.0,
                c.min_hit_rate_ratio
            ));
        }
        None
    }

    /// What was seen, for `GET /admin/policies`.
    pub fn view(&self) -> serde_json::Value {
        let c = &self.config;
        let mut v = json!({
            "mode": match c.mode {
                CandidateMode::Shadow => "shadow",
                CandidateMode::Canary => "canary",
            },
            "semantic_rules": c.semantic_rules.iter().map(crate::policy::rule_view).collect::<Vec<_>>(),
        });
        match c.mode {
            CandidateMode::Shadow => {
                v["shadow"] = self
                    .shadow_counts()
                    .iter()
                    .map(|(r, n)| (r.as_str().to_string(), json!(n)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            CandidateMode::Canary => {
                v["percent"] = json!(c.percent);
                v["min_requests"] = json!(c.min_requests);
                v["max_error_rate_increase"] = json!(c.max_error_rate_increase);
                v["max_latency_ratio"] = json!(c.max_latency_ratio);
                v["min_hit_rate_ratio"] = json!(c.min_hit_rate_ratio);
                v["max_wrong_hit_rate_increase"] = json!(c.max_wrong_hit_rate_increase);
                v["control"] = self.control.lock().view();
                v["candidate"] = self.candidate.lock().view();
                v["rolled_back"] = json!(self.rolled_back.load(Ordering::Relaxed));
            }
        }
        v
    }
}

/// Carries a candidate's state into a new policy version when its configuration is the same.
pub fn carry(
    config: Option<&CandidateConfig>,
    before: Option<&Arc<Candidate>>,
) -> Option<Arc<Candidate>> {
    let config = config?;
    match before {
        Some(b) if b.config() == config => Some(b.clone()),
        _ => Some(Arc::new(Candidate::new(config.clone()))),
    }
}

/// One-sided z for the canary's comparisons of shares (99 %).
const Z_99: f64 = 2.326;

/// Whether share `a` (`(count, of)`) is above share `b` by more than `bound`, beyond chance:
/// the lower end of a one-sided 99 % interval of the difference (Agresti–Caffo: one success
/// and one failure added to each side, so few or extreme counts still have a width) is over
/// `bound`. A raw difference of a few requests is noise, not a reason to roll back. The
/// canary is judged after every request, so over a long run the level is lower than 99 %.
fn surely_more(a: (u64, u64), b: (u64, u64), bound: f64) -> bool {
    let adjusted = |(k, n): (u64, u64)| {
        let n = n as f64 + 2.0;
        ((k as f64 + 1.0) / n, n)
    };
    let ((pa, na), (pb, nb)) = (adjusted(a), adjusted(b));
    let se = (pa * (1.0 - pa) / na + pb * (1.0 - pb) / nb).sqrt();
    pa - pb - Z_99 * se > bound
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_errors_more_are_noise_and_many_are_not() {
        let c = Candidate::new(CandidateConfig {
            min_requests: 100,
            max_error_rate_increase: 0.02,
            ..canary(50.0)
        });
        // 3 % against 0 % over 100 requests each: chance (Fisher's exact test: p ≈ 0.12).
        for i in 0..100 {
            assert!(c.record(false, Outcome::Miss, 0.01).is_none());
            let outcome = if i < 3 { Outcome::Error } else { Outcome::Miss };
            assert!(c.record(true, outcome, 0.01).is_none(), "at {i}");
        }
        // Half of them failing is not.
        let rolled = (0..100).any(|i| {
            let outcome = if i % 2 == 0 {
                Outcome::Error
            } else {
                Outcome::Miss
            };
            c.record(false, Outcome::Miss, 0.01);
            c.record(true, outcome, 0.01).is_some()
        });
        assert!(rolled);
    }

    #[test]
    fn latencies_are_compared_over_the_same_span_of_time() {
        // Both sides slow, then both fast: the control's kept samples move past the slow
        // period long before the candidate's (it gets nine requests to each of its one).
        let c = Candidate::new(CandidateConfig {
            min_requests: 100,
            max_latency_ratio: 1.5,
            ..canary(10.0)
        });
        for i in 0..20_000 {
            let secs = if i < 10_000 { 1.0 } else { 0.01 };
            if i == 10_000 {
                // Time passes between the two periods.
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert_eq!(c.record(i % 10 == 0, Outcome::Miss, secs), None, "at {i}");
        }
    }

    #[test]
    fn a_small_canary_is_judged_on_latency_from_enough_samples() {
        // 1 %: the control answers 99 requests to each of the candidate's, yet both keep
        // latencies at the same pace, so a slower candidate is found once it has its 20.
        let c = Candidate::new(CandidateConfig {
            min_requests: 10,
            max_latency_ratio: 1.5,
            ..canary(1.0)
        });
        let mut candidate_requests = 0;
        let mut reason = None;
        while reason.is_none() && candidate_requests < 200 {
            let on_candidate = c.assign() == Arm::Candidate;
            candidate_requests += usize::from(on_candidate);
            let secs = if on_candidate { 0.1 } else { 0.01 };
            reason = c.record(on_candidate, Outcome::Miss, secs);
        }
        let reason = reason.expect("rolled back");
        assert!(reason.contains("P95 latency"), "{reason}");
        assert!(
            (MIN_LATENCY_SAMPLES..=MIN_LATENCY_SAMPLES + 2).contains(&candidate_requests),
            "{candidate_requests}"
        );
    }

    #[test]
    fn a_verdict_on_a_hit_this_replica_never_counted_does_not_pass_every_hit() {
        let c = Candidate::new(CandidateConfig {
            min_requests: 100,
            ..canary(50.0)
        });
        for _ in 0..100 {
            c.record(false, Outcome::Miss, 0.01);
            c.record(true, Outcome::Miss, 0.01);
        }
        assert_eq!(c.record_wrong(true), None);
    }

    fn canary(percent: f64) -> CandidateConfig {
        CandidateConfig {
            mode: CandidateMode::Canary,
            semantic_rules: Vec::new(),
            percent,
            min_requests: 10,
            max_error_rate_increase: 0.05,
            max_latency_ratio: 1.5,
            min_hit_rate_ratio: 0.5,
            max_wrong_hit_rate_increase: 0.1,
        }
    }

    #[test]
    fn a_canary_gets_its_exact_share_of_requests() {
        for percent in [1.0, 10.0, 25.0, 50.0, 99.0] {
            let c = Candidate::new(canary(percent));
            let n = (0..1000).filter(|_| c.assign() == Arm::Candidate).count();
            assert_eq!(n as f64, percent * 10.0, "{percent}");
        }
        let shadow = Candidate::new(CandidateConfig {
            mode: CandidateMode::Shadow,
            ..canary(10.0)
        });
        assert!((0..10).all(|_| shadow.assign() == Arm::Shadow));
    }

    #[test]
    fn a_worse_canary_is_rolled_back_once_and_only_when_judged() {
        // Slower: rolled back once both sides have enough latencies for a P95.
        // (The control's first sample is older than the candidate's first, so outside the
        // span both cover: the control has its 20 there one request later.)
        let c = Candidate::new(canary(50.0));
        let (pairs, reason) = (1..100)
            .find_map(|n| {
                let control = c.record(false, Outcome::Miss, 0.010);
                let candidate = c.record(true, Outcome::Miss, 0.100);
                control.or(candidate).map(|reason| (n, reason))
            })
            .expect("rolled back");
        assert_eq!(pairs, MIN_LATENCY_SAMPLES + 1);
        assert!(reason.contains("P95 latency"), "{reason}");
        assert_eq!(c.record(true, Outcome::Miss, 0.100), None, "given once");
        assert_eq!(c.assign(), Arm::Current, "no more requests");

        // As good: never rolled back.
        let c = Candidate::new(canary(50.0));
        for _ in 0..50 {
            assert_eq!(c.record(false, Outcome::Exact, 0.010), None);
            assert_eq!(c.record(true, Outcome::Semantic, 0.011), None);
        }
        // More errors: half of its requests (a quarter of twenty would be within chance).
        let c = Candidate::new(canary(50.0));
        let mut reason = None;
        for i in 0..20 {
            reason = reason.or(c.record(false, Outcome::Miss, 0.01));
            let o = if i % 2 == 0 {
                Outcome::Error
            } else {
                Outcome::Miss
            };
            reason = reason.or(c.record(true, o, 0.01));
        }
        assert!(reason.unwrap().contains("error rate"));
        // Fewer hits than half the control's.
        let c = Candidate::new(canary(50.0));
        let mut reason = None;
        for i in 0..20 {
            reason = reason.or(c.record(false, Outcome::Exact, 0.01));
            let o = if i % 3 == 0 {
                Outcome::Exact
            } else {
                Outcome::Miss
            };
            reason = reason.or(c.record(true, o, 0.01));
        }
        assert!(reason.unwrap().contains("hit rate"));
        // More of its hits reported wrong.
        let c = Candidate::new(canary(50.0));
        for _ in 0..10 {
            assert_eq!(c.record(false, Outcome::Semantic, 0.01), None);
            assert_eq!(c.record(true, Outcome::Semantic, 0.01), None);
        }
        assert_eq!(c.record_wrong(false), None, "the control's: never a reason");
        assert_eq!(c.record_wrong(true), None, "one of ten against one of ten");
        // Rolled back once the difference is beyond chance: not at a few more.
        let reasons: Vec<Option<String>> = (0..9).map(|_| c.record_wrong(true)).collect();
        let at = reasons.iter().position(Option::is_some);
        assert!(at.is_some_and(|n| n >= 3), "{reasons:?}");
        assert!(reasons[at.unwrap()]
            .as_ref()
            .unwrap()
            .contains("wrong hits"));
    }

    #[test]
    fn shadow_results_compare_what_was_served() {
        assert_eq!(ShadowResult::of::<u8>(None, None), ShadowResult::AgreeMiss);
        assert_eq!(ShadowResult::of(None, Some(1)), ShadowResult::WouldHit);
        assert_eq!(ShadowResult::of(Some(1), None), ShadowResult::WouldMiss);
        assert_eq!(ShadowResult::of(Some(1), Some(1)), ShadowResult::AgreeHit);
        assert_eq!(ShadowResult::of(Some(1), Some(2)), ShadowResult::Different);
        let c = Candidate::new(CandidateConfig {
            mode: CandidateMode::Shadow,
            ..canary(10.0)
        });
        c.record_shadow(ShadowResult::WouldHit);
        c.record_shadow(ShadowResult::WouldHit);
        c.record_shadow(ShadowResult::AgreeMiss);
        let counts = c.shadow_counts();
        assert_eq!(counts[2], (ShadowResult::WouldHit, 2));
        assert_eq!(counts[1], (ShadowResult::AgreeMiss, 1));
        assert_eq!(c.view()["shadow"]["would_hit"], 2);
    }
}
