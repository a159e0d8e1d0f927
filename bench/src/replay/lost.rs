//! Where prefetch's gain is lost: each measured turn the prefetch side answered with a miss,
//! classed by the prefetch jobs that had finished before it was asked
//! ([`reprise::prefetch::Prefetcher::finished_jobs`]: what each asked, and whether it ended
//! with an answer generated or found in the cache).
//!
//! A miss whose question was answered by a prefetch in its own context (the same earlier
//! turns, word for word) before it was asked was lost to matching: prefetched in the very
//! wording asked, the answer was not found when asked (its entry gone, or stored apart);
//! prefetched in another wording of the question, the asked one was neither an alias nor
//! close enough by meaning (told apart by whether the wording asked shares the question
//! cluster of a wording prefetched, or only its family, or neither). One whose question was
//! answered only after a context of the same questions in other words was lost to context:
//! the prediction after this context's wording did not include it. One prefetched here only
//! after it was asked, or whose job ended without an answer, was late. The rest were never
//! predicted here: the predictor's part.
//!
//! Those lost to context and those never predicted here are classed further by the last
//! prediction made in their context before they were asked
//! ([`reprise::prefetch::Prefetcher::predictions_made`]): none was made (a first turn, or
//! the record no longer held), it rested on too few observations, their question was not
//! among the follow-ups seen, fell under `min_probability`, was cut by `max_predictions`,
//! or was kept and its job not finished before the turn. With the true transition table
//! (`--domain`), those not among the follow-ups or under `min_probability` are also counted
//! by whether the table puts them under `min_probability` too (the reference ceiling does
//! not predict those either).

use reprise::prefetch::{FinishedJob, PredictionRecord};

use super::ceiling::Truth;
use super::report::pct;
use super::*;

/// A question asked in a context: as worded or by intent.
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
    /// Answered here, in the wording asked, before the turn.
    pub(super) same_wording: usize,
    /// Answered here, in another wording of the question, before the turn.
    pub(super) other_wording: usize,
    /// Of those: the wording asked is in the question cluster of a wording prefetched (as
    /// the clusters stand at the end of the run); else in the family of one (as regrouping
    /// at `regroup_family_score` would join them); else in neither.
    pub(super) other_wording_same_cluster: usize,
    pub(super) other_wording_same_family: usize,
    pub(super) other_wording_apart: usize,
    /// Answered before the turn only in another wording of the context.
    pub(super) other_context: usize,
    /// Prefetched here, but answered only after the turn, or not at all.
    pub(super) late: usize,
    /// Never prefetched here.
    pub(super) never: usize,
    /// Those answered only in another context, and those never prefetched, by the last
    /// prediction made in their context.
    pub(super) other_context_why: Unpredicted,
    pub(super) never_why: Unpredicted,
}

/// Why a question was not prefetched in its context: the last prediction made there before
/// it was asked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Unpredicted {
    /// The turn is a conversation's first: no answer before it to predict from.
    pub(super) first_turn: usize,
    /// No prediction recorded in its context before it (not learned, or no longer held).
    pub(super) no_record: usize,
    /// The prediction rested on too few observations and made none.
    pub(super) too_few: usize,
    /// Its question was not among the follow-ups the counts knew.
    pub(super) not_followed: usize,
    /// Under `min_probability`.
    pub(super) under_min_probability: usize,
    /// Cut by `max_predictions` (more probable questions filled them).
    pub(super) over_max_predictions: usize,
    /// Predicted, and its job not finished before the turn (queued, dropped or running).
    pub(super) predicted: usize,
    /// Of those not followed or under `min_probability`: the predictions that rested on the
    /// answer's own counts (its context), its question's cluster, or similar answers.
    pub(super) missed_on_entry: usize,
    pub(super) missed_on_cluster: usize,
    pub(super) missed_on_similar: usize,
    /// Of those not followed or under `min_probability`: the ones the true transition table
    /// (`--domain`) puts under `min_probability` too, which the reference ceiling does not
    /// predict either.
    pub(super) improbable_in_truth: usize,
}

impl Unpredicted {
    fn class(
        &mut self,
        r: &TurnResult,
        records: &Records,
        intent_of: &HashMap<String, String>,
        truth: Option<&Truth>,
    ) {
        if r.history.is_empty() {
            self.first_turn += 1;
            return;
        }
        let Some(record) = records.last_before(&r.history, r.asked_at) else {
            self.no_record += 1;
            return;
        };
        let is_asked = |text: &str| intent_of.get(text) == Some(&r.intent);
        if matches!(record.basis, "too_few" | "unknown") {
            self.too_few += 1;
        } else if record.kept.iter().any(|k| is_asked(k)) {
            self.predicted += 1;
        } else {
            match record.passed_over.iter().find(|(q, _, _)| is_asked(q)) {
                Some((_, _, "max_predictions")) => {
                    self.over_max_predictions += 1;
                    return;
                }
                Some(_) => self.under_min_probability += 1,
                None => self.not_followed += 1,
            }
            let improbable = truth.and_then(|t| t.under(&r.history_intents, &r.intent));
            self.improbable_in_truth += usize::from(improbable == Some(true));
            match record.basis {
                "entry" => self.missed_on_entry += 1,
                "cluster" => self.missed_on_cluster += 1,
                _ => self.missed_on_similar += 1,
            }
        }
    }
}

/// The question clusters at the end of a run, and the families regrouping at
/// `regroup_family_score` would make of them, as wording → index.
pub(super) struct Grouping {
    cluster_of: HashMap<String, usize>,
    family_of: HashMap<String, usize>,
}

impl Grouping {
    pub(super) fn new(clusters: Vec<Vec<String>>, families: Vec<Vec<String>>) -> Grouping {
        let index = |groups: Vec<Vec<String>>| -> HashMap<String, usize> {
            groups
                .into_iter()
                .enumerate()
                .flat_map(|(i, g)| g.into_iter().map(move |w| (w, i)))
                .collect()
        };
        Grouping {
            cluster_of: index(clusters),
            family_of: index(families),
        }
    }

    fn same(map: &HashMap<String, usize>, a: &str, b: &str) -> bool {
        map.get(a).is_some_and(|x| map.get(b) == Some(x))
    }
}

/// Prediction records by their context (the user turns they followed), oldest first.
struct Records<'a> {
    by_context: HashMap<&'a [String], Vec<&'a PredictionRecord>>,
}

impl<'a> Records<'a> {
    fn new(records: &'a [PredictionRecord]) -> Self {
        let mut by_context: HashMap<&[String], Vec<&PredictionRecord>> = HashMap::new();
        for r in records {
            by_context.entry(&r.questions).or_default().push(r);
        }
        Records { by_context }
    }

    fn last_before(&self, context: &[String], at: Instant) -> Option<&'a PredictionRecord> {
        self.by_context
            .get(context)?
            .iter()
            .rev()
            .find(|r| r.at < at)
            .copied()
    }
}

/// When each question was first answered by a prefetch, and first asked at all.
#[derive(Default)]
struct Seen {
    answered: HashMap<Asked, Instant>,
    tried: HashMap<Asked, Instant>,
}

impl Seen {
    fn note(&mut self, key: Asked, job: &FinishedJob) {
        let answered = matches!(job.outcome, "generated" | "cached");
        if answered {
            let at = self.answered.entry(key.clone()).or_insert(job.at);
            *at = (*at).min(job.at);
        }
        let at = self.tried.entry(key).or_insert(job.at);
        *at = (*at).min(job.at);
    }

    fn answered_before(&self, key: &Asked, asked: Instant) -> bool {
        self.answered.get(key).is_some_and(|&at| at < asked)
    }
}

/// Classes the measured misses of `results` by the prefetch jobs `jobs`; `intent_of` maps a
/// wording to its intent.
pub(super) fn lost(
    results: &[TurnResult],
    jobs: &[FinishedJob],
    predictions: &[PredictionRecord],
    intent_of: &HashMap<String, String>,
    grouping: &Grouping,
    truth: Option<&Truth>,
) -> Lost {
    let records = Records::new(predictions);
    // The wordings answered by a prefetch for a question (by intent) in a context, and when.
    let mut wordings: HashMap<Asked, Vec<(&str, Instant)>> = HashMap::new();
    // Context and question as worded; the question by intent in the context as worded; both
    // by intent.
    let (mut worded, mut meant, mut by_intent) =
        (Seen::default(), Seen::default(), Seen::default());
    for job in jobs {
        let Some((asked, before)) = job.questions.split_last() else {
            continue;
        };
        worded.note(
            Asked {
                context: before.to_vec(),
                question: asked.clone(),
            },
            job,
        );
        let Some(intent) = intent_of.get(asked) else {
            continue;
        };
        if matches!(job.outcome, "generated" | "cached") {
            wordings
                .entry(Asked {
                    context: before.to_vec(),
                    question: intent.clone(),
                })
                .or_default()
                .push((asked.as_str(), job.at));
        }
        meant.note(
            Asked {
                context: before.to_vec(),
                question: intent.clone(),
            },
            job,
        );
        let intents: Option<Vec<String>> =
            before.iter().map(|t| intent_of.get(t).cloned()).collect();
        if let Some(context) = intents {
            by_intent.note(
                Asked {
                    context,
                    question: intent.clone(),
                },
                job,
            );
        }
    }
    let mut out = Lost::default();
    for r in results {
        out.turns += 1;
        if r.served != Served::Miss {
            continue;
        }
        out.misses += 1;
        let as_worded = Asked {
            context: r.history.clone(),
            question: r.text.clone(),
        };
        let as_meant = Asked {
            context: r.history.clone(),
            question: r.intent.clone(),
        };
        let elsewhere = Asked {
            context: r.history_intents.clone(),
            question: r.intent.clone(),
        };
        if worded.answered_before(&as_worded, r.asked_at) {
            out.same_wording += 1;
        } else if meant.answered_before(&as_meant, r.asked_at) {
            out.other_wording += 1;
            let prefetched: Vec<&str> = wordings.get(&as_meant).map_or(Vec::new(), |w| {
                w.iter()
                    .filter(|(_, at)| *at < r.asked_at)
                    .map(|(t, _)| *t)
                    .collect()
            });
            let with = |map| prefetched.iter().any(|t| Grouping::same(map, t, &r.text));
            if with(&grouping.cluster_of) {
                out.other_wording_same_cluster += 1;
            } else if with(&grouping.family_of) {
                out.other_wording_same_family += 1;
            } else {
                out.other_wording_apart += 1;
            }
        } else if by_intent.answered_before(&elsewhere, r.asked_at) {
            out.other_context += 1;
            out.other_context_why.class(r, &records, intent_of, truth);
        } else if meant.tried.contains_key(&as_meant) {
            out.late += 1;
        } else {
            out.never += 1;
            out.never_why.class(r, &records, intent_of, truth);
        }
    }
    out
}

/// Prints where the prefetch side's measured misses were lost.
pub(super) fn print_lost(side: &Side, intent_of: &HashMap<String, String>, truth: Option<&Truth>) {
    let Some(prefetcher) = prefetcher(&side.server.state) else {
        return;
    };
    let jobs = prefetcher.finished_jobs();
    let predictions = prefetcher.predictions_made();
    let family_score = side.server.state.config.prefetch.regroup_family_score;
    let grouping = Grouping::new(
        prefetcher.clusters(DEFAULT_NAMESPACE),
        prefetcher.regrouped_clusters(DEFAULT_NAMESPACE, family_score),
    );
    let l = lost(
        &side.results.lock(),
        &jobs,
        &predictions,
        intent_of,
        &grouping,
        truth,
    );
    let share = |n: usize| pct(n as f64 / l.turns.max(1) as f64);
    println!(
        "-- where {}'s misses were (each measured miss, by the prefetch jobs finished before \
         it; the latest {} jobs) --",
        side.name,
        jobs.len()
    );
    println!(
        "misses {} of {} turns ({})",
        l.misses,
        l.turns,
        share(l.misses)
    );
    println!(
        "  its question answered by a prefetch in this context before it was asked: in the \
         wording asked {} (not found when asked), in another wording {} (not matched; the \
         wording asked in the question cluster of one prefetched {}, in another cluster of its \
         family {}, in neither {})",
        share(l.same_wording),
        share(l.other_wording),
        share(l.other_wording_same_cluster),
        share(l.other_wording_same_family),
        share(l.other_wording_apart)
    );
    println!(
        "  answered before only after another wording of the same earlier questions: {}",
        share(l.other_context)
    );
    print_why(&l.other_context_why, &share);
    println!(
        "  prefetched in this context, answered only after it was asked or not at all: {}",
        share(l.late)
    );
    println!("  never prefetched in this context: {}", share(l.never));
    print_why(&l.never_why, &share);
    println!(
        "  (by the last prediction made in the turn's context before it, of the latest {} \
         predictions)",
        predictions.len()
    );
}

fn print_why(u: &Unpredicted, share: &dyn Fn(usize) -> String) {
    println!(
        "    first turn {}, no prediction recorded {}, too few observations {}, not among the \
         follow-ups seen {}, under min_probability {}, cut by max_predictions {}, predicted \
         and not finished before it {}; the predictions that missed it rested on the answer's \
         own counts {}, its question's cluster {}, similar answers {}; under min_probability in \
         the true table too (not predicted by the reference ceiling either) {}",
        share(u.first_turn),
        share(u.no_record),
        share(u.too_few),
        share(u.not_followed),
        share(u.under_min_probability),
        share(u.over_max_predictions),
        share(u.predicted),
        share(u.missed_on_entry),
        share(u.missed_on_cluster),
        share(u.missed_on_similar),
        share(u.improbable_in_truth)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(questions: &[&str], at: Instant, outcome: &'static str) -> FinishedJob {
        FinishedJob {
            at,
            namespace: String::new(),
            questions: questions.iter().map(|q| q.to_string()).collect(),
            outcome,
        }
    }

    fn turn(history: &[&str], text: &str, asked_at: Instant, served: Served) -> TurnResult {
        let intent = |t: &str| t.split(' ').next().unwrap_or_default().to_string();
        TurnResult {
            depth: history.len() + 1,
            text: text.into(),
            intent: intent(text),
            history: history.iter().map(|t| t.to_string()).collect(),
            history_intents: history.iter().map(|t| intent(t)).collect(),
            asked_at,
            served,
            false_hit: false,
            total_s: 0.0,
            ttft_s: 0.0,
        }
    }

    /// Each miss is classed by the jobs answered before it; hits count for nothing.
    #[test]
    fn misses_are_classed_by_the_prefetches_answered_before_them() {
        // Wordings start with their intent: "price ..." is intent "price".
        let intent_of: HashMap<String, String> = [
            "hello there",
            "hello friend",
            "price please",
            "price now",
            "refund how",
            "delivery when",
        ]
        .iter()
        .map(|t| (t.to_string(), t.split(' ').next().unwrap().to_string()))
        .collect();
        let t0 = Instant::now();
        let (t1, t2, t3) = (
            t0 + Duration::from_secs(1),
            t0 + Duration::from_secs(2),
            t0 + Duration::from_secs(3),
        );
        let jobs = vec![
            job(&["hello there", "price please"], t1, "generated"),
            job(&["hello friend", "refund how"], t1, "cached"),
            job(&["hello there", "delivery when"], t1, "failed"),
        ];
        let results = vec![
            turn(&["hello there"], "price please", t2, Served::Miss),
            turn(&["hello there"], "price now", t2, Served::Miss),
            turn(&["hello there"], "refund how", t2, Served::Miss),
            turn(&["hello there"], "delivery when", t3, Served::Miss),
            turn(&["hello there"], "price please", t0, Served::Miss),
            turn(&["hello friend"], "hello there", t2, Served::Miss),
            turn(&["hello there"], "price please", t2, Served::Prefetch),
        ];
        // The predictions made after "hello there": refund passed over as improbable (the
        // one before, at t0, is older than the last one before the turn).
        let record = |at, passed: &[(&str, &'static str)]| PredictionRecord {
            at,
            namespace: String::new(),
            questions: vec!["hello there".into()],
            basis: "entry",
            kept: vec!["price please".into()],
            passed_over: passed
                .iter()
                .map(|(q, why)| (q.to_string(), 0.1, *why))
                .collect(),
        };
        let predictions = vec![
            record(t0, &[("refund how", "max_predictions")]),
            record(t1, &[("refund how", "min_probability")]),
        ];
        // "price now" shares the cluster of "price please", which was prefetched.
        let price = || vec![vec!["price please".to_string(), "price now".to_string()]];
        let grouping = Grouping::new(price(), price());
        let l = lost(&results, &jobs, &predictions, &intent_of, &grouping, None);
        assert_eq!(
            l,
            Lost {
                turns: 7,
                misses: 6,
                same_wording: 1,
                other_wording: 1,
                other_wording_same_cluster: 1,
                other_wording_same_family: 0,
                other_wording_apart: 0,
                other_context: 1,
                late: 2,
                never: 1,
                other_context_why: Unpredicted {
                    under_min_probability: 1,
                    missed_on_entry: 1,
                    ..Unpredicted::default()
                },
                // "hello there" after "hello friend": no prediction in that context.
                never_why: Unpredicted {
                    no_record: 1,
                    ..Unpredicted::default()
                },
            }
        );
        // With the true table: refund after a first turn's hello is 0.1 of the 0.6 that
        // goes on (under 0.2), or 0.1 of 0.4 (over it).
        let improbable = |end: f64| {
            let truth = Truth::from_json(
                &format!(
                    r#"{{"transitions": {{"hello": {{"refund": 0.1, "price": {}, "END": {end}}}}}}}"#,
                    0.9 - end
                ),
                0.2,
            );
            let l = lost(
                &results,
                &jobs,
                &predictions,
                &intent_of,
                &grouping,
                Some(&truth),
            );
            l.other_context_why.improbable_in_truth
        };
        assert_eq!(improbable(0.4), 1);
        assert_eq!(improbable(0.6), 0);
        // In clusters of their own, of one family; then in neither.
        let apart = || {
            vec![
                vec!["price please".to_string()],
                vec!["price now".to_string()],
            ]
        };
        let counts = |grouping: &Grouping| {
            let l = lost(&results, &jobs, &predictions, &intent_of, grouping, None);
            (
                l.other_wording_same_cluster,
                l.other_wording_same_family,
                l.other_wording_apart,
            )
        };
        assert_eq!(counts(&Grouping::new(apart(), price())), (0, 1, 0));
        assert_eq!(counts(&Grouping::new(apart(), apart())), (0, 0, 1));
    }
}
