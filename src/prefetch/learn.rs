//! Learning from observations: each served request is counted in the model (node, cluster,
//! the link from the previous turn), its likely follow-ups are predicted and queued as
//! prefetch jobs, hits are noted for refresh-ahead, and clusters are regrouped by use.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reprise_backend::{ChatMessage, GenRequest, Input};
use reprise_cache::{now_ms, EntryId, Origin};

use super::jobs::{Job, JobKind};
use super::model::{self, PredictParams, RegroupParams};
use super::record::{self, FinishedJob, PredictionRecord};
use super::refresh::Hot;
use super::{bump, Shared};
use crate::observe::Observation;

/// Time one regrouping round may take (the model is locked meanwhile, so learning waits;
/// namespaces left over are regrouped in the next round).
const REGROUP_BUDGET: Duration = Duration::from_millis(200);
/// An observation of a live entry this young is the miss that created it, not a hit.
const CREATION_GRACE_MS: u64 = 1000;

/// Whether two clusters' representatives may be merged: the gate vets every merge, as it
/// vets every join (a cluster's wordings may be served one another's prefetched answer).
pub(super) fn may_merge(a: &str, b: &str) -> bool {
    reprise_policies::gate(a, b).is_pass()
}

/// The last answer of a session, to link its next single-turn prompt.
#[derive(Clone)]
pub(super) struct SessionLast {
    pub(super) entry: EntryId,
}

impl Shared {
    /// Records the first use of an entry this replica prefetched: counted once, however
    /// many first hits race (each finds the entry still marked prefetched), and never when
    /// it was counted wasted already.
    pub(super) fn used(&self, id: EntryId) {
        if self.prefetched.lock().remove(&id).is_none() {
            return;
        }
        bump(&self.counts.hits, 1);
        self.handles.hits.increment(1);
    }

    fn predict_params(&self) -> PredictParams {
        PredictParams {
            min_probability: self.cfg.min_probability,
            max_predictions: self.cfg.max_predictions,
            min_observations: self.cfg.min_observations,
            similar_threshold: self.cfg.similar_threshold,
        }
    }

    /// When two clusters are one question by use, as configured.
    pub(super) fn regroup_params(&self) -> RegroupParams {
        RegroupParams {
            min_score: self.cfg.regroup_score,
            min_cosine: self.cfg.regroup_min_cosine,
            min_seen: self.cfg.regroup_min_seen,
            family_score: self.cfg.regroup_family_score,
        }
    }

    /// Moves a refreshed entry's counts from `old` to `new` (see [`model::Model::rename`]) at the
    /// worker's next learning step. Called from the job tasks, which run on the async
    /// threads: they never wait for the model (regrouping may hold it for its budget).
    pub(super) fn renamed(&self, namespace: &str, old: EntryId, new: EntryId) {
        let mut renames = self.renames.lock();
        if renames.len() >= super::MAX_RENAMES {
            renames.pop_front();
        }
        renames.push_back((namespace.to_string(), old, new));
        drop(renames);
        self.wake.notify_one();
    }

    /// Remembers a prefetch job that finished (the latest, within [`record::RECORD_BYTES`]).
    pub(super) fn finished(
        &self,
        namespace: &str,
        request: &GenRequest,
        result: &crate::generate::Background,
    ) {
        use crate::generate::Background;
        let outcome = match result {
            Background::Generated { .. } => "generated",
            Background::Cached(_) => "cached",
            Background::Failed { .. } => "failed",
            Background::Skipped => "skipped",
        };
        self.finished.lock().push(FinishedJob {
            at: Instant::now(),
            namespace: record::cut(namespace),
            questions: record::questions_of(request),
            outcome,
        });
    }

    /// Applies the renames waiting (in the order they came); `true` when there were any.
    /// Blocks on the model: for the worker's blocking step.
    pub(super) fn apply_renames(&self) -> bool {
        let renames = std::mem::take(&mut *self.renames.lock());
        if renames.is_empty() {
            return false;
        }
        let mut model = self.model.lock();
        for (namespace, old, new) in renames {
            model.rename(&namespace, old, new);
        }
        true
    }

    /// Merges the clusters that are one question by use (`regroup`); returns the merges.
    pub(super) fn regroup(&self) -> usize {
        let p = self.regroup_params();
        let merged = self
            .model
            .lock()
            .regroup(&p, now_ms(), REGROUP_BUDGET, may_merge);
        if merged > 0 {
            bump(&self.counts.merges, merged as u64);
            self.handles.merges.increment(merged as u64);
            tracing::debug!(merged, "prefetch: clusters regrouped by use");
        }
        merged
    }

    /// Learns from one observation and queues the follow-ups it predicts.
    pub(super) fn learn(&self, obs: Observation) {
        let now = now_ms();
        bump(&self.counts.observations, 1);
        let entry = &obs.entry;
        let prompt = if entry.prompt.is_empty() {
            last_user_text(&obs.request).unwrap_or_default()
        } else {
            entry.prompt.clone()
        };
        let session_key = obs
            .session
            .as_ref()
            .map(|s| (obs.namespace.clone(), s.clone()));
        // The previous turn: from the conversation history, else from the session.
        let prev = obs.prev_entry.or_else(|| {
            let key = session_key.as_ref()?;
            self.sessions.get(key).map(|s| s.entry)
        });
        let multi = has_history(&obs.request);
        // A question too long to be worth predicting is not learned (it would only take the
        // model's memory); the session still moves on to it.
        let learnable = prompt.len() <= model::MAX_PROMPT_BYTES;
        // The model compares in f32 and keeps its own copy for a new question (counted in its
        // byte budget at four bytes a component).
        // Only vectors of the running embedder are compared (an entry loaded from before a
        // model change keeps its old one).
        let ours = entry.embedder.is_some() && entry.embedder == self.embedder.get().copied();
        let embedding: Option<Arc<[f32]>> = entry
            .embedding
            .as_ref()
            .filter(|_| learnable && ours)
            .map(|v| v.to_f32().into());
        let predictions = learnable.then(|| {
            let mut model = self.model.lock();
            // One question for counting: close enough to the cluster's representative, and
            // the gate passes. The gate applies even when the semantic tier runs without it:
            // a cluster's wordings may be served one another's prefetched answer.
            let cluster_threshold = self.cfg.cluster_threshold;
            let join = |a: &str, ea: Option<&[f32]>, b: &str, eb: Option<&[f32]>| {
                a == b
                    || match (ea, eb) {
                        (Some(ea), Some(eb)) => {
                            model::cosine(ea, eb) >= cluster_threshold
                                && reprise_policies::gate(a, b).is_pass()
                        }
                        _ => false,
                    }
            };
            model.observe(
                &obs.namespace,
                entry.id,
                &prompt,
                embedding.as_ref(),
                now,
                join,
            );
            if let Some(prev) = prev.filter(|p| *p != entry.id) {
                model.link(&obs.namespace, prev, entry.id, multi, now);
                bump(&self.counts.links, 1);
            }
            if self.cfg.enabled {
                let explained =
                    model.explain_prediction(&obs.namespace, entry.id, &self.predict_params(), now);
                let style = model.prefers_multi(&obs.namespace, now);
                Some((explained, style))
            } else {
                None
            }
        });
        if let Some(key) = session_key {
            self.sessions.insert(key, SessionLast { entry: entry.id });
        }
        // Nothing generated in the background may be stored for it: nothing is queued.
        if !obs.may_store {
            return;
        }
        if self.cfg.refresh_ahead {
            self.note_hit(&obs, now);
        }
        let Some((explained, style)) = predictions.flatten() else {
            return;
        };
        self.predicted.lock().push(PredictionRecord {
            at: Instant::now(),
            namespace: record::cut(&obs.namespace),
            questions: record::questions_of(&obs.request),
            basis: explained.basis.as_str(),
            kept: explained
                .predictions
                .iter()
                .map(|p| record::cut(&p.prompt))
                .collect(),
            passed_over: explained
                .passed_over
                .iter()
                .map(|p| (record::cut(&p.prompt), p.probability, p.reason))
                .collect(),
        });
        let predictions = explained.predictions;
        bump(&self.counts.predictions, predictions.len() as u64);
        self.handles.predictions.increment(predictions.len() as u64);
        // How the next turn will arrive: with its history when the request already carries
        // one; as a replaced single-turn prompt for completions; otherwise as this
        // namespace's follow-ups usually do (with no data: single-turn when a session links
        // them, else with history).
        let multi = match &obs.request.input {
            Input::Prompt(_) => false,
            Input::Chat(_) if multi => true,
            Input::Chat(_) => style.unwrap_or(obs.session.is_none()),
        };
        // Behind everything waiting: the observed follow-ups run before the model's guesses.
        if self.cfg.propose && predictions.len() < self.cfg.max_predictions {
            self.queue_proposal(&obs, multi);
        }
        // Highest probability first: queued in reverse so the best ends up at the front.
        for p in predictions.iter().rev() {
            let Some(request) = follow_up(&obs.request, &entry.text, &p.prompt, multi) else {
                continue;
            };
            let key = crate::key::exact_key(&obs.namespace, obs.endpoint, &request);
            let aliases = p
                .wordings
                .iter()
                .take(self.cfg.max_wordings)
                .filter_map(|w| follow_up(&obs.request, &entry.text, w, multi))
                .map(|r| crate::key::exact_key(&obs.namespace, obs.endpoint, &r))
                .filter(|k| *k != key)
                .collect();
            self.enqueue(Job {
                kind: JobKind::Prefetch,
                namespace: obs.namespace.clone(),
                endpoint: obs.endpoint,
                request,
                key,
                aliases,
                tags: entry.tags.clone(),
                queued_at: Instant::now(),
            });
        }
    }

    /// Counts a hit for refresh-ahead, remembering the request that reaches the entry.
    fn note_hit(&self, obs: &Observation, now: u64) {
        let e = &obs.entry;
        // The miss that created a live entry is its first observation, right after it was
        // stored; every other observation is a hit.
        let mut first = false;
        let hot = self.hot.get_with(e.id, || {
            first = true;
            Arc::new(Hot {
                namespace: obs.namespace.clone(),
                endpoint: obs.endpoint,
                request: obs.request.clone(),
                expires_ms: e.expires_ms,
                hits: AtomicU64::new(0),
                refreshing: std::sync::atomic::AtomicBool::new(false),
            })
        });
        let creation = first
            && e.origin == Origin::Live
            && now.saturating_sub(e.created_ms) < CREATION_GRACE_MS;
        if !creation {
            hot.hits.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Whether a request carries earlier exchanges.
pub(super) fn has_history(req: &GenRequest) -> bool {
    matches!(&req.input, Input::Chat(m) if m.iter().any(|m| m.role == "assistant"))
}

/// The last user message of a chat, or the raw prompt.
pub(super) fn last_user_text(req: &GenRequest) -> Option<String> {
    match &req.input {
        Input::Prompt(p) => Some(p.clone()),
        Input::Chat(m) => m
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone()),
    }
}

/// The follow-up request as it will arrive. `multi`: the history, the answer, then the
/// question; otherwise the same request with its last user message (or prompt) replaced.
pub(super) fn follow_up(
    req: &GenRequest,
    answer: &str,
    question: &str,
    multi: bool,
) -> Option<GenRequest> {
    let mut next = req.clone();
    match &mut next.input {
        Input::Prompt(p) => *p = question.to_string(),
        Input::Chat(msgs) if multi => {
            msgs.push(ChatMessage::new("assistant", answer));
            msgs.push(ChatMessage::new("user", question));
        }
        Input::Chat(msgs) => {
            let last = msgs.iter_mut().rev().find(|m| m.role == "user")?;
            last.content = question.to_string();
            // Parts as given were the old question's: the new one is its text alone.
            last.extra.remove(reprise_backend::GIVEN_PARTS);
        }
    }
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::chat;

    #[test]
    fn follow_ups_keep_the_request_shape() {
        let r = chat(&[("system", "be brief"), ("user", "x?")]);
        let m = follow_up(&r, "ans", "y?", true).unwrap();
        assert_eq!(
            m,
            chat(&[
                ("system", "be brief"),
                ("user", "x?"),
                ("assistant", "ans"),
                ("user", "y?")
            ])
        );
        let s = follow_up(&r, "ans", "y?", false).unwrap();
        assert_eq!(s, chat(&[("system", "be brief"), ("user", "y?")]));
        assert!(has_history(&m) && !has_history(&s));

        // The old question's parts as given do not go with the new question.
        let mut parted = r.clone();
        if let Input::Chat(msgs) = &mut parted.input {
            let parts = serde_json::json!([{"type": "text", "text": "x?", "cache_control": {}}]);
            msgs[1]
                .extra
                .insert(reprise_backend::GIVEN_PARTS.into(), parts);
        }
        let s = follow_up(&parted, "ans", "y?", false).unwrap();
        assert_eq!(s, chat(&[("system", "be brief"), ("user", "y?")]));
    }
}
