//! Where prefetch's gain is lost (`replay` with the scripted backend): each measured turn the
//! prefetch side answered with a miss, classed by what its background generations had asked
//! the backend for by then (the scripted backend keeps every request it got, in order).
//!
//! A miss whose question (by intent) was prefetched in its own context (the same earlier
//! turns, word for word) before it was asked was lost to timing or to matching: prefetched in
//! the very wording asked, the answer was not ready or not kept; prefetched in another
//! wording of the question, it was not matched (no alias, and by meaning under the threshold
//! or refused by the gate). One whose question was prefetched only after a context of the
//! same questions in other words was lost to context matching. The rest were never predicted
//! in time: the predictor's part.

use reprise_backend::{GenRequest, Input, Priority};

use super::report::pct;
use super::*;

/// A prefetch asked of the backend: its context (the earlier user turns) and question.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Asked {
    context: Vec<String>,
    question: String,
}

/// The measured misses of one side, by where they were lost.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lost {
    pub(super) turns: usize,
    pub(super) misses: usize,
    /// Prefetched in this context, in the wording asked, before the turn.
    pub(super) same_wording: usize,
    /// Prefetched in this context, in another wording of the question, before the turn.
    pub(super) other_wording: usize,
    /// Prefetched before the turn only in another wording of the context.
    pub(super) other_context: usize,
    /// Prefetched in this context (by intent) only after the turn was asked.
    pub(super) late: usize,
    /// Never prefetched in this context.
    pub(super) never: usize,
}

/// Classes the measured misses of `results` by the background requests in `log` (the
/// backend's requests in call order); `intent_of` maps a wording to its intent.
pub(super) fn lost(
    results: &[TurnResult],
    log: &[GenRequest],
    intent_of: &HashMap<String, String>,
) -> Lost {
    // The first call at which each was asked: context and question as worded; the question
    // by intent in the context as worded; both by intent.
    let mut worded: HashMap<Asked, usize> = HashMap::new();
    let mut meant: HashMap<Asked, usize> = HashMap::new();
    let mut by_intent: HashMap<Asked, usize> = HashMap::new();
    for (i, req) in log.iter().enumerate() {
        if req.priority != Priority::Background {
            continue;
        }
        let Input::Chat(messages) = &req.input else {
            continue;
        };
        let users: Vec<&str> = messages
            .iter()
            .filter(|m| m.role == "user")
            .map(|m| m.content.as_str())
            .collect();
        let Some((asked, before)) = users.split_last() else {
            continue;
        };
        let context: Vec<String> = before.iter().map(|t| t.to_string()).collect();
        worded
            .entry(Asked {
                context: context.clone(),
                question: asked.to_string(),
            })
            .or_insert(i);
        let Some(intent) = intent_of.get(*asked) else {
            continue;
        };
        meant
            .entry(Asked {
                context,
                question: intent.clone(),
            })
            .or_insert(i);
        let intents: Option<Vec<String>> =
            before.iter().map(|t| intent_of.get(*t).cloned()).collect();
        if let Some(context) = intents {
            by_intent
                .entry(Asked {
                    context,
                    question: intent.clone(),
                })
                .or_insert(i);
        }
    }
    let mut out = Lost::default();
    for r in results {
        out.turns += 1;
        if r.served != Served::Miss {
            continue;
        }
        out.misses += 1;
        let before = |at: Option<&usize>| at.is_some_and(|&i| i < r.calls_before);
        let worded = worded.get(&Asked {
            context: r.history.clone(),
            question: r.text.clone(),
        });
        let by_meaning = meant.get(&Asked {
            context: r.history.clone(),
            question: r.intent.clone(),
        });
        let elsewhere = by_intent.get(&Asked {
            context: r.history_intents.clone(),
            question: r.intent.clone(),
        });
        if before(worded) {
            out.same_wording += 1;
        } else if before(by_meaning) {
            out.other_wording += 1;
        } else if before(elsewhere) {
            out.other_context += 1;
        } else if worded.or(by_meaning).or(elsewhere).is_some() {
            out.late += 1;
        } else {
            out.never += 1;
        }
    }
    out
}

/// Prints where the prefetch side's measured misses were lost (scripted backend only).
pub(super) fn print_lost(side: &Side, intent_of: &HashMap<String, String>) {
    let Some(scripted) = &side.scripted else {
        return;
    };
    let l = lost(&side.results.lock(), &scripted.requests(), intent_of);
    let share = |n: usize| pct(n as f64 / l.turns.max(1) as f64);
    println!(
        "-- where {}'s misses were (each measured miss, by what the backend had been asked \
         in the background before it) --",
        side.name
    );
    println!(
        "misses {} of {} turns ({})",
        l.misses,
        l.turns,
        share(l.misses)
    );
    println!(
        "  its question prefetched in this context before it was asked: in the wording asked {} \
         (not ready or not kept), in another wording {} (not matched)",
        share(l.same_wording),
        share(l.other_wording)
    );
    println!(
        "  prefetched before only in another wording of the context: {}",
        share(l.other_context)
    );
    println!(
        "  prefetched in this context only after it was asked: {}",
        share(l.late)
    );
    println!("  never prefetched in this context: {}", share(l.never));
}

#[cfg(test)]
mod tests {
    use super::*;
    use reprise_backend::{ChatMessage, SamplingParams};

    fn asked(priority: Priority, turns: &[&str]) -> GenRequest {
        let mut messages = Vec::new();
        for (i, t) in turns.iter().enumerate() {
            if i > 0 {
                messages.push(ChatMessage::new("assistant", "an answer"));
            }
            messages.push(ChatMessage::new("user", *t));
        }
        GenRequest {
            model: "fake".into(),
            input: Input::Chat(messages),
            params: SamplingParams::default(),
            priority,
            extra: Default::default(),
            backend: None,
        }
    }

    fn turn(history: &[&str], text: &str, calls_before: usize, served: Served) -> TurnResult {
        let intent = |t: &str| t.split(' ').next().unwrap_or_default().to_string();
        TurnResult {
            depth: history.len() + 1,
            text: text.into(),
            intent: intent(text),
            history: history.iter().map(|t| t.to_string()).collect(),
            history_intents: history.iter().map(|t| intent(t)).collect(),
            calls_before,
            served,
            false_hit: false,
            total_s: 0.0,
            ttft_s: 0.0,
        }
    }

    /// Each miss is classed by the background requests before it; hits and user requests
    /// count for nothing.
    #[test]
    fn misses_are_classed_by_what_was_prefetched_before_them() {
        // Wordings start with their intent: "price ..." is intent "price".
        let intent_of: HashMap<String, String> = [
            "hello there",
            "hello friend",
            "price please",
            "price now",
            "refund how",
        ]
        .iter()
        .map(|t| (t.to_string(), t.split(' ').next().unwrap().to_string()))
        .collect();
        let log = vec![
            asked(Priority::Interactive, &["hello there", "refund how"]),
            asked(Priority::Background, &["hello there", "price please"]),
            asked(Priority::Background, &["hello friend", "refund how"]),
        ];
        let results = vec![
            turn(&["hello there"], "price please", 3, Served::Miss),
            turn(&["hello there"], "price now", 3, Served::Miss),
            turn(&["hello there"], "refund how", 3, Served::Miss),
            turn(&["hello friend"], "hello there", 3, Served::Miss),
            turn(&["hello there"], "price please", 1, Served::Miss),
            turn(&["hello there"], "price please", 3, Served::Prefetch),
        ];
        let l = lost(&results, &log, &intent_of);
        assert_eq!(
            l,
            Lost {
                turns: 6,
                misses: 5,
                same_wording: 1,
                other_wording: 1,
                other_context: 1,
                late: 1,
                never: 1,
            }
        );
    }
}
