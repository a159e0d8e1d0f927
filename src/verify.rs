//! Checks of semantic hits in the background (`[semantic] verify_hits`): the backend answers
//! a served question afresh and a judge decides whether the cached answer serves it.
//!
//! A check never delays or displaces a client: it is sampled (every n-th hit, so the share is
//! exact), starts only on a spare slot (where the backend tells its capacity: a slot free
//! beyond waiting user requests, within `prefetch.max_capacity_share`; elsewhere only while
//! no client request is running on the backend), is preempted by the backend when a user
//! request needs its slot, runs one at a time at background priority, and spends at most
//! `verify_tokens_per_minute` (charged its `max_tokens` up front, with the judge prompt's
//! one-word reply); a check that does not fit is skipped, not queued. The judge prompt
//! carries none of the client's settings (stop strings, penalties, `response_format`). Its verdict counts
//! like a verdict from feedback: evidence for the learned threshold
//! ([`crate::bounds`]) and, when wrong, a refusal of that question by the entry.
//!
//! Judges (`verify_judge`): `similarity`, the embedding similarity of the two answers against
//! `answer_threshold`; `prompt`, the backend asked whether the cached answer serves the
//! question as well as its own (an answer other than yes or no is no verdict).

use std::num::NonZeroU32;
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use reprise_backend::{ChatMessage, FinishReason, GenRequest, Input, Priority};
use reprise_cache::Entry;
use tokio::sync::Semaphore;

use crate::bounds::Source;
use crate::config::{SemanticConfig, VerifyJudge};
use crate::feedback::Served;
use crate::share::ExactShare;
use crate::state::AppState;

/// Longest answer a check waits for, in tokens.
const MAX_CHECK_TOKENS: u32 = 512;
/// Tokens the judge prompt's reply may take (one word).
const JUDGE_TOKENS: u32 = 4;

/// The checks' budget and sampling.
pub struct Verifier {
    hits: ExactShare,
    running: Arc<Semaphore>,
    tokens: Option<DefaultDirectRateLimiter>,
}

/// What became of a hit offered for a check (counted in `reprise_verify_checks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// Not sampled.
    NotSampled,
    /// Skipped: a client request is running, a check is running, or the budget is spent.
    Skipped,
    /// Started.
    Started,
}

impl Verifier {
    /// A verifier for `[semantic]`.
    pub fn new(cfg: &SemanticConfig) -> Verifier {
        Verifier {
            hits: ExactShare::default(),
            running: Arc::new(Semaphore::new(1)),
            tokens: NonZeroU32::new(cfg.verify_tokens_per_minute)
                .map(|n| RateLimiter::direct(Quota::per_minute(n))),
        }
    }
}

/// Offers a served semantic hit for a check: `served` is what the response served, `req`
/// the question asked, `similarity` where it was found.
pub fn offer(
    state: &Arc<AppState>,
    served: Served,
    id: String,
    req: &GenRequest,
    entry: &Arc<Entry>,
    similarity: f32,
) -> Offer {
    if !state.verifier.hits.take(state.config.semantic.verify_hits) {
        return Offer::NotSampled;
    }
    let outcome = start(state, served, id, req, entry, similarity);
    state.metrics.verify(match outcome {
        Offer::Started => "started",
        _ => "skipped",
    });
    outcome
}

fn start(
    state: &Arc<AppState>,
    served: Served,
    id: String,
    req: &GenRequest,
    entry: &Arc<Entry>,
    similarity: f32,
) -> Offer {
    let v = &state.verifier;
    // On spare slots where the backend tells its capacity (like prefetch), else only while
    // no user request runs.
    match crate::generate::room(state, req, 0) {
        Some(room) if room.spare == 0 => return Offer::Skipped,
        Some(_) => {}
        None if crate::generate::users_on(state, req) > 0 => return Offer::Skipped,
        None => {}
    }
    let Ok(permit) = v.running.clone().try_acquire_owned() else {
        return Offer::Skipped;
    };
    let mut fresh = req.clone();
    fresh.priority = Priority::Background;
    // The judge prompt is a second generation, charged with the first.
    let judged = match state.config.semantic.verify_judge {
        VerifyJudge::Prompt => JUDGE_TOKENS,
        VerifyJudge::Similarity => 0,
    };
    // Never more than a minute's budget, or it could never be charged.
    let budget = state.config.semantic.verify_tokens_per_minute;
    let most = MAX_CHECK_TOKENS.min(budget.saturating_sub(judged)).max(1);
    let max = fresh.params.max_tokens.unwrap_or(most).min(most);
    fresh.params.max_tokens = Some(max);
    fresh.params.max_tokens_is_default = false;
    let within = match (&v.tokens, NonZeroU32::new(max + judged)) {
        (Some(l), Some(n)) => matches!(l.check_n(n), Ok(Ok(()))),
        _ => false,
    };
    if !within {
        return Offer::Skipped;
    }
    let (state, entry) = (state.clone(), entry.clone());
    tokio::spawn(async move {
        let _permit = permit;
        // A reference cut off at its token cap is no measure of a whole cached answer.
        let Some(answer) = generate(&state, fresh.clone(), true).await else {
            return;
        };
        let Some(wrong) = judge(&state, &served, &fresh, &entry, &answer).await else {
            return;
        };
        // One verdict of evidence a response: a client's came first, and counted.
        let tenant = &served.tenant;
        if state.responses.mark_checked(&state, tenant, &id).await {
            let source = Source::Verified;
            let scope = &served.scope;
            state.bounds.record(
                &state,
                tenant,
                scope,
                served.entry,
                similarity,
                wrong,
                source,
            );
        } else {
            state.metrics.verify("superseded");
        }
        if wrong {
            crate::feedback::refuse(&state, &served).await;
        }
    });
    Offer::Started
}

/// The backend's answer to `req` (none when it fails or stalls, or with `whole`, when it
/// stopped at its token cap).
async fn generate(state: &AppState, req: GenRequest, whole: bool) -> Option<String> {
    let (text, reason, _) = crate::generate::answer(state, req).await.ok()?;
    (!whole || reason != FinishReason::Length).then_some(text)
}

/// Whether the cached answer is wrong for the question (none: no verdict).
async fn judge(
    state: &AppState,
    served: &Served,
    req: &GenRequest,
    entry: &Entry,
    fresh: &str,
) -> Option<bool> {
    match state.config.semantic.verify_judge {
        VerifyJudge::Similarity => {
            let embedder = state.embedder.as_ref()?;
            let texts = [fresh.to_string(), entry.text.clone()];
            let v = embedder
                .embed_many_spare(&served.tenant, &texts)
                .await
                .ok()?;
            let same = reprise_embedder::cosine(&v[0], &v[1]);
            Some(same < state.config.semantic.answer_threshold)
        }
        VerifyJudge::Prompt => {
            let question = served.question.as_ref().map(|(_, q)| q.as_str())?;
            // The question's model and backend, none of its other settings: a stop string,
            // a penalty or a `response_format` of the client's would garble the one word.
            let mut ask = req.clone();
            ask.params = reprise_backend::SamplingParams {
                max_tokens: Some(JUDGE_TOKENS),
                temperature: Some(0.0),
                ..Default::default()
            };
            ask.extra.clear();
            ask.input = Input::Chat(vec![
                ChatMessage::new(
                    "system",
                    "You judge answers. Reply with one word: yes or no.",
                ),
                ChatMessage::new("user", judge_prompt(question, &entry.text, fresh)),
            ]);
            let reply = generate(state, ask, false).await?;
            parse_yes_no(&reply).map(|serves| !serves)
        }
    }
}

/// The judge prompt: does `cached` serve `question` as well as `reference`?
fn judge_prompt(question: &str, cached: &str, reference: &str) -> String {
    format!(
        "Question:\n{question}\n\nCandidate answer:\n{cached}\n\nReference answer:\n{reference}\n\n\
         Does the candidate answer serve the question as well as the reference answer? \
         Answer yes or no."
    )
}

/// `yes` → true, `no` → false, anything else → none.
fn parse_yes_no(reply: &str) -> Option<bool> {
    let word: String = reply
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphabetic())
        .collect::<String>()
        .to_lowercase();
    match word.as_str() {
        "yes" => Some(true),
        "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_replies_are_yes_no_or_nothing() {
        assert_eq!(parse_yes_no(" Yes."), Some(true));
        assert_eq!(parse_yes_no("no, it does not"), Some(false));
        assert_eq!(parse_yes_no("Maybe"), None);
        assert_eq!(parse_yes_no(""), None);
        assert!(judge_prompt("q?", "a", "b").contains("Candidate answer:\na"));
    }
}
