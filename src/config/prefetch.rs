//! `[prefetch]`: predictive prefetch and refresh-ahead.

use serde::Deserialize;

use super::MAX_TIMEOUT_SECS;

/// `[prefetch]`: predictive prefetch and refresh-ahead. Both spend backend compute on answers
/// nobody asked for yet, so both are off by default.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefetchConfig {
    /// Predict follow-ups and generate them in the background. Off by default: every
    /// prefetch costs a backend generation that may never be used.
    pub enabled: bool,
    /// Lowest estimated probability of a follow-up worth prefetching (0 to 1).
    pub min_probability: f64,
    /// Most follow-up questions prefetched after one answer (a family of clusters, see
    /// `regroup_family_score`, counts once, with at most 4 of its clusters).
    pub max_predictions: usize,
    /// Lowest (decayed) number of times an answer was served, with what followed known
    /// (the serving being predicted for is not counted), before its follow-up
    /// probabilities are trusted; rarer answers borrow counts from similar ones.
    pub min_observations: f64,
    /// Lowest cosine similarity of an answer whose follow-ups a rarely seen answer borrows.
    pub similar_threshold: f32,
    /// Lowest cosine similarity at which a question is counted as another wording of a
    /// cluster's representative (the false-hit gate must pass too, whatever
    /// `semantic.gate` says). Looser than the serving threshold: wordings that the semantic
    /// tier would not serve for each other still share their follow-up counts, and a
    /// prefetched answer is made reachable for the cluster's observed wordings.
    pub cluster_threshold: f32,
    /// Also ask the model itself for likely follow-ups of an answer that traffic predicts
    /// fewer than `max_predictions` follow-ups for (one background prompt per answer, its
    /// questions then prefetched like the others). Off by default: it spends a generation on
    /// every new answer, and the model's guesses are less often asked than observed ones.
    pub propose: bool,
    /// Most follow-up questions taken from one proposal (1 to 16).
    pub propose_questions: usize,
    /// Most observed wordings of a predicted follow-up (besides the one generated) whose
    /// requests, in the same context, are pointed at the prefetched answer; 0 points none.
    /// A cluster keeps at most 16 wordings, so 15 points them all.
    pub max_wordings: usize,
    /// Also merge clusters that are one question by how they are used: wordings asked in
    /// the same places of conversations and followed by the same questions, although their
    /// embeddings are too far apart for `cluster_threshold` (see `regroup_score`).
    pub regroup: bool,
    /// Lowest score of such a merge: cosine of the two questions plus cosine of what
    /// follows each plus cosine of what precedes each (each a count-weighted mean of the
    /// neighbouring questions' embeddings with the share of conversations that end or
    /// start there), at most 3; a side without links is left out and the rest scaled. The
    /// default is the median over five split seeds of the lowest score leaving at most 2 %
    /// of wordings in another intent's cluster on the tuning half of the dev sessions
    /// (`reprise-bench replay --regroup-curve`, a repeatable pass; docs/BENCHMARKS.md).
    pub regroup_score: f32,
    /// Lowest score (as `regroup_score`) of two clusters counted as one question's family
    /// though not merged: a prediction adds up a family's counts, so a follow-up asked in
    /// several wordings kept apart passes `min_probability` as one question, and each of
    /// its clusters (at most 4: those that followed the answer first, then the family's
    /// others, which the question may be asked in as well) is prefetched with only its own
    /// wordings (no answer is aliased across
    /// clusters, so a looser score costs generations, not wrong hits). At or above
    /// `regroup_score`: no families.
    pub regroup_family_score: f32,
    /// Lowest cosine of two questions merged by `regroup` (questions that share nothing are
    /// never merged, however alike their neighbours).
    pub regroup_min_cosine: f32,
    /// Lowest (decayed) number of times each of two clusters was served before they may be
    /// merged by `regroup`; also the links (at least 1) one of them needs on a side
    /// (follow-ups or predecessors) for that side to count.
    pub regroup_min_seen: f64,
    /// Half-life of the learned counts in seconds: old habits fade.
    pub half_life_secs: f64,
    /// Bytes the learned model may hold (questions, their vectors and follow-up counts, over
    /// every namespace); past it the tenant holding the most forgets first, its least
    /// recently used first, so one tenant's flood of questions cannot empty the others'.
    /// Questions longer than 4 KiB are not learned.
    pub model_bytes: u64,
    /// Background generations (prefetch and refresh) running at once.
    pub max_concurrent: usize,
    /// Tokens background generations may produce per sliding minute; none start once spent.
    pub max_tokens_per_minute: u64,
    /// Share of wall time (0 to 1) background generations may have run over the last minute.
    /// Applies only where the backend cannot tell its capacity (see `max_capacity_share`).
    pub max_backend_share: f64,
    /// Share of the backend's slots (0 to 1) background work (prefetch, refresh-ahead, checks
    /// of hits) may hold at once, at least one slot unless 0: where the backend tells its
    /// capacity (llama's `parallel`, an upstream's `max_concurrent`), background work starts
    /// when a slot is free beyond what waiting user requests need, within this share, and is
    /// preempted when a user request needs its slot. It replaces `max_backend_share` and the
    /// "only while no user request runs" rule there; where the capacity is unknown (an
    /// upstream without `max_concurrent`), those still apply.
    pub max_capacity_share: f64,
    /// Regenerate hot entries before they expire (needs `enabled`).
    pub refresh_ahead: bool,
    /// How close to expiry, in seconds, a hot entry is regenerated.
    pub refresh_window_secs: f64,
    /// Hits that make an entry hot.
    pub refresh_min_hits: u64,
    /// With Redis: how often, in seconds, the learned counts are saved there when they
    /// changed (they are also saved on shutdown).
    pub persist_interval_secs: f64,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            enabled: false,
            min_probability: 0.2,
            max_predictions: 3,
            min_observations: 2.0,
            similar_threshold: 0.8,
            cluster_threshold: 0.8,
            propose: false,
            propose_questions: 2,
            max_wordings: 15,
            regroup: true,
            regroup_score: 2.55,
            regroup_family_score: 2.35,
            regroup_min_cosine: 0.4,
            regroup_min_seen: 3.0,
            half_life_secs: 3600.0,
            model_bytes: 64 * 1024 * 1024,
            max_concurrent: 1,
            max_tokens_per_minute: 20_000,
            max_backend_share: 0.5,
            max_capacity_share: 0.5,
            refresh_ahead: false,
            refresh_window_secs: 300.0,
            refresh_min_hits: 3,
            persist_interval_secs: 30.0,
        }
    }
}

impl PrefetchConfig {
    /// Checks value ranges; the error names the key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let unit = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !unit(self.min_probability) {
            return Err(("prefetch.min_probability", "must be between 0 and 1".into()));
        }
        if !unit(f64::from(self.similar_threshold)) {
            return Err((
                "prefetch.similar_threshold",
                "must be between 0 and 1".into(),
            ));
        }
        if !unit(f64::from(self.cluster_threshold)) {
            return Err((
                "prefetch.cluster_threshold",
                "must be between 0 and 1".into(),
            ));
        }
        if !(self.regroup_score.is_finite() && (-3.0..=3.0).contains(&self.regroup_score)) {
            return Err(("prefetch.regroup_score", "must be between -3 and 3".into()));
        }
        if !(self.regroup_family_score.is_finite()
            && (-3.0..=3.0).contains(&self.regroup_family_score))
        {
            return Err((
                "prefetch.regroup_family_score",
                "must be between -3 and 3".into(),
            ));
        }
        if !(self.regroup_min_cosine.is_finite() && (-1.0..=1.0).contains(&self.regroup_min_cosine))
        {
            return Err((
                "prefetch.regroup_min_cosine",
                "must be between -1 and 1".into(),
            ));
        }
        if !(self.regroup_min_seen.is_finite() && self.regroup_min_seen >= 0.0) {
            return Err(("prefetch.regroup_min_seen", "must not be negative".into()));
        }
        if !unit(self.max_backend_share) {
            return Err((
                "prefetch.max_backend_share",
                "must be between 0 and 1".into(),
            ));
        }
        if !unit(self.max_capacity_share) {
            return Err((
                "prefetch.max_capacity_share",
                "must be between 0 and 1".into(),
            ));
        }
        if !(self.min_observations.is_finite() && self.min_observations >= 0.0) {
            return Err(("prefetch.min_observations", "must not be negative".into()));
        }
        if !(self.half_life_secs > 0.0 && self.half_life_secs <= MAX_TIMEOUT_SECS) {
            return Err((
                "prefetch.half_life_secs",
                format!("must be positive and at most {MAX_TIMEOUT_SECS} seconds"),
            ));
        }
        if self.propose && self.propose_questions == 0 {
            return Err((
                "prefetch.propose_questions",
                "must be at least 1 when prefetch.propose is on".into(),
            ));
        }
        // Each question is a generation queued for prefetch, and the proposal's own answer
        // is bounded at 32 tokens a question.
        if self.propose_questions > 16 {
            return Err(("prefetch.propose_questions", "must be at most 16".into()));
        }
        if self.max_concurrent == 0 {
            return Err(("prefetch.max_concurrent", "must be at least 1".into()));
        }
        if !(self.refresh_window_secs >= 0.0 && self.refresh_window_secs <= MAX_TIMEOUT_SECS) {
            return Err((
                "prefetch.refresh_window_secs",
                format!("must be 0 or more, at most {MAX_TIMEOUT_SECS} seconds"),
            ));
        }
        if !(self.persist_interval_secs > 0.0 && self.persist_interval_secs <= MAX_TIMEOUT_SECS) {
            return Err((
                "prefetch.persist_interval_secs",
                format!("must be positive and at most {MAX_TIMEOUT_SECS} seconds"),
            ));
        }
        Ok(())
    }
}
