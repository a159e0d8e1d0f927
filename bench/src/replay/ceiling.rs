//! The reference ceiling (`--domain`): what a predictor that knew the true transitions and
//! grouped every wording perfectly would reach, counted like the run.

use super::report::pct;
use super::*;

/// Computes and prints the reference ceiling when `--domain` is given.
pub(super) fn print_ceiling(
    a: &ReplayArgs,
    sessions: &[Session],
) -> anyhow::Result<Option<Ceiling>> {
    let Some(Truth { domain, min_p }) = Truth::load(a)? else {
        return Ok(None);
    };
    let max_predictions = PrefetchConfig::default().max_predictions;
    let mut first = None;
    for (table, histories, label) in [
        (
            Table::True,
            Histories::AsWorded,
            "true transition table, every wording of a question matched, histories matched \
             as worded, as reprise's partitions",
        ),
        (
            Table::True,
            Histories::ByIntent,
            "true transition table, every wording of a question matched, histories matched \
             by intent, perfect context equivalence",
        ),
        (
            Table::Counted,
            Histories::AsWorded,
            "transitions counted by intent from the sessions replayed before, every wording \
             of a question matched, histories matched as worded",
        ),
    ] {
        let c = ceiling(
            sessions,
            a.warmup,
            &domain,
            min_p,
            max_predictions,
            histories,
            table,
        );
        println!(
            "reference ceiling ({label}, unlimited compute; min_probability {min_p}): hit rate \
             {} -> {} = {:.2}x, unused {} (counted as the run counts), never used {}",
            pct(c.off),
            pct(c.on),
            c.on / c.off.max(1e-9),
            pct(c.unused),
            pct(c.never_used)
        );
        first.get_or_insert(c);
    }
    let c = first.expect("two ceilings");
    Ok(Some(c))
}

/// How the reference ceiling matches two conversations' histories.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Histories {
    /// The same questions in the same words.
    AsWorded,
    /// The same questions in any words.
    ByIntent,
}

/// Where the reference ceiling's transition probabilities come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    /// The domain's: what generated the sessions.
    True,
    /// Counted by intent from the sessions replayed before (their transitions and ends), as a
    /// predictor that grouped every wording perfectly but learned from the same traffic would
    /// know them: the part of the true table's gain that finite data leaves.
    Counted,
}

/// The sessions' domain, as far as the reference ceiling needs it.
#[derive(Debug, Deserialize)]
struct Domain {
    /// Intent → next intent (or `END`) → probability.
    transitions: HashMap<String, HashMap<String, f64>>,
}

/// Hit rates of the reference ceiling over the measured sessions, counted as the run counts
/// its own (see [`ceiling`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Ceiling {
    /// Turns the cache alone answers: the same question (any wording) asked before in the same
    /// context. The run's "off" side counts exact and semantic hits alike.
    pub(super) off: f64,
    /// Turns the cache or a prefetch answers.
    pub(super) on: f64,
    /// As the run reports it: prefetches generated in the measured part less the turns a
    /// prefetch served there (warm-up prefetches included), over those generated.
    pub(super) unused: f64,
    /// Prefetches generated in the measured part that no turn ever used, over those
    /// generated (each generation followed to the end).
    pub(super) never_used: f64,
}

/// The follow-ups of a table's row with their probabilities; after a conversation's first
/// turn, `END` is impossible and the rest share its probability (as the session generator
/// does).
fn follow_ups(row: &HashMap<String, f64>, first: bool) -> impl Iterator<Item = (f64, &str)> {
    let total: f64 = row
        .iter()
        .filter(|(k, _)| !(first && k.as_str() == "END"))
        .map(|(_, v)| v)
        .sum();
    row.iter()
        .filter(|(k, _)| k.as_str() != "END")
        .map(move |(k, v)| (v / total.max(1e-12), k.as_str()))
}

/// The true transition table, to tell which follow-ups the reference ceiling predicts
/// (`--domain`).
pub(super) struct Truth {
    domain: Domain,
    min_p: f64,
}

impl Truth {
    /// The table of `--domain`, if given, at the run's `min_probability`.
    pub(super) fn load(a: &ReplayArgs) -> anyhow::Result<Option<Truth>> {
        let Some(path) = &a.domain else {
            return Ok(None);
        };
        Ok(Some(Truth {
            domain: serde_json::from_str(&std::fs::read_to_string(path)?)?,
            min_p: a
                .min_probability
                .unwrap_or(PrefetchConfig::default().min_probability),
        }))
    }

    /// A table given as JSON, at `min_p`.
    #[cfg(test)]
    pub(super) fn from_json(json: &str, min_p: f64) -> Truth {
        Truth {
            domain: serde_json::from_str(json).expect("a domain"),
            min_p,
        }
    }

    /// Whether the true table puts `intent` under `min_probability` after the questions
    /// `before` (their intents, oldest first; `None` for a first turn, where nothing is
    /// predicted).
    pub(super) fn under(&self, before: &[String], intent: &str) -> Option<bool> {
        let last = before.last()?;
        let p = self
            .domain
            .transitions
            .get(last)
            .and_then(|row| follow_ups(row, before.len() == 1).find(|(_, k)| *k == intent))
            .map_or(0.0, |(p, _)| p);
        Some(p < self.min_p)
    }
}

/// Replays the sessions on paper with a perfect semantic cache and the true transition
/// table, counted as the run counts:
///
/// - A turn's context is its history (empty for a first turn), so sessions whose histories
///   match share answers, as reprise's partitions do. [`Histories::AsWorded`] matches
///   histories by their wordings (reprise's partitions without context equivalence);
///   [`Histories::ByIntent`] by the questions they asked, whatever the wording (perfect
///   context equivalence: an upper bound).
/// - The cache alone answers a turn whose intent was asked before in its context, whatever
///   the wording (the run's "off" side counts semantic hits too).
/// - After every turn of intent `X`, the (at most `max_predictions`) intents with a true
///   probability of at least `min_p` are prefetched in the new context, each generated once
///   and only when the cache does not already hold it; a prefetch is credited only for a turn
///   the cache alone would have missed. Before the second turn, `END` is impossible and left
///   out, as the session generator does.
/// - Generations are counted as the run counts completed prefetches (see [`Ceiling`]).
/// - With [`Table::Counted`] the probabilities are those counted from every session replayed
///   before the current one (`END` for a session's last turn), the true table's otherwise.
fn ceiling(
    sessions: &[Session],
    warmup: usize,
    domain: &Domain,
    min_p: f64,
    max_predictions: usize,
    histories: Histories,
    table: Table,
) -> Ceiling {
    use std::collections::HashSet;
    // Intent → next intent (or `END`) → count, of the sessions replayed so far.
    let mut counted: HashMap<String, HashMap<String, f64>> = HashMap::new();
    let predict = |counted: &HashMap<String, HashMap<String, f64>>,
                   intent: &str,
                   first: bool|
     -> Vec<String> {
        let rows = match table {
            Table::True => &domain.transitions,
            Table::Counted => counted,
        };
        let Some(row) = rows.get(intent) else {
            return Vec::new();
        };
        let mut p: Vec<(f64, &str)> = follow_ups(row, first)
            .filter(|(p, _)| *p >= min_p)
            .collect();
        p.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));
        p.into_iter()
            .take(max_predictions)
            .map(|(_, k)| k.to_string())
            .collect()
    };
    // (context, intent): what the cache holds, answered by a turn or a prefetch.
    type Key<'a> = (Vec<&'a str>, String);
    let mut asked: HashSet<Key> = HashSet::new();
    // Prefetched entries not yet asked for, and whether each was generated in the measured
    // part.
    let mut pending: HashMap<Key, bool> = HashMap::new();
    let (mut n, mut off, mut on) = (0usize, 0usize, 0usize);
    let (mut generated, mut served, mut used_of_measured) = (0usize, 0usize, 0usize);
    for (si, s) in sessions.iter().enumerate() {
        let measured = si >= warmup;
        let mut path: Vec<&str> = Vec::new();
        for (t, turn) in s.turns.iter().enumerate() {
            let key = (path.clone(), turn.intent.clone());
            let cached = asked.contains(&key);
            let prefetched = !cached && pending.contains_key(&key);
            if measured {
                n += 1;
                off += usize::from(cached);
                on += usize::from(cached || prefetched);
                served += usize::from(prefetched);
            }
            if let Some(of_measured) = pending.remove(&key) {
                used_of_measured += usize::from(of_measured);
            }
            asked.insert(key);
            path.push(match histories {
                Histories::AsWorded => turn.text.as_str(),
                Histories::ByIntent => turn.intent.as_str(),
            });
            for y in predict(&counted, &turn.intent, t == 0) {
                let k = (path.clone(), y);
                if !asked.contains(&k) && !pending.contains_key(&k) {
                    pending.insert(k, measured);
                    generated += usize::from(measured);
                }
            }
        }
        // What this session teaches the counted table (after it is replayed).
        for (i, turn) in s.turns.iter().enumerate() {
            let next = s.turns.get(i + 1).map_or("END", |n| n.intent.as_str());
            *counted
                .entry(turn.intent.clone())
                .or_default()
                .entry(next.to_string())
                .or_default() += 1.0;
        }
    }
    let share = |x: usize| x as f64 / generated.max(1) as f64;
    Ceiling {
        off: off as f64 / n.max(1) as f64,
        on: on as f64 / n.max(1) as f64,
        unused: share(generated.saturating_sub(served)),
        never_used: share(generated - used_of_measured),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ceiling with the domain's table and the default `max_predictions`.
    fn by_truth(
        sessions: &[Session],
        warmup: usize,
        domain: &Domain,
        min_p: f64,
        histories: Histories,
    ) -> Ceiling {
        ceiling(sessions, warmup, domain, min_p, 3, histories, Table::True)
    }

    /// A domain where A is always followed by B, and B ends the conversation.
    fn a_then_b() -> Domain {
        serde_json::from_str(r#"{"transitions": {"A": {"B": 1.0}, "B": {"END": 1.0}}}"#).unwrap()
    }

    fn session(turns: &[(&str, &str)]) -> Session {
        Session {
            session_id: String::new(),
            turns: turns
                .iter()
                .map(|(i, t)| Turn {
                    intent: (*i).into(),
                    text: (*t).into(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_ceiling_counts_like_the_run() {
        let domain: Domain = serde_json::from_str(
            r#"{"transitions": {"A": {"B": 0.6, "C": 0.1, "END": 0.3}, "B": {"END": 1.0},
                                "C": {"B": 0.5, "END": 0.5}}}"#,
        )
        .unwrap();
        let sessions = [
            // Warm-up: prefetches B (and, at 0.1, C) after A.
            session(&[("A", "a1")]),
            // A in other words: the cache answers (any wording, shared first context); B
            // was prefetched in the warm-up after the same history.
            session(&[("A", "a2"), ("B", "b1")]),
            // A again; C is prefetched only at the lower bar.
            session(&[("A", "a1"), ("C", "c1")]),
            // A new first question: a miss; B is generated after it and never asked.
            session(&[("C", "c2")]),
        ];
        let c = by_truth(&sessions, 1, &domain, 0.2, Histories::ByIntent);
        // Five measured turns: A, A cached; B served by the warm-up's prefetch; C, C missed.
        assert!((c.off - 0.4).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.6).abs() < 1e-9, "{c:?}");
        // B is generated after each measured C and never asked: as the run counts, two
        // generations less one turn served by a prefetch is half unused; followed to the
        // end, neither was used.
        assert!((c.unused - 0.5).abs() < 1e-9, "{c:?}");
        assert!((c.never_used - 1.0).abs() < 1e-9, "{c:?}");
        // At the lower bar the warm-up also prefetched C, which serves the second C: the
        // run's counting then shows no waste at all while both generations were wasted.
        let c = by_truth(&sessions, 1, &domain, 0.1, Histories::ByIntent);
        assert!((c.off - 0.4).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.8).abs() < 1e-9, "{c:?}");
        assert!(c.unused.abs() < 1e-9, "{c:?}");
        assert!((c.never_used - 1.0).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn histories_as_worded_share_only_the_same_words() {
        let domain = a_then_b();
        let sessions = [
            session(&[("A", "a1"), ("B", "b1")]),
            session(&[("A", "a2"), ("B", "b2")]),
        ];
        // The second B follows A in other words: by intent the history matches and the
        // cache answers it; as worded it does not, and the prefetch made after a2 does.
        let by_intent = by_truth(&sessions, 1, &domain, 0.2, Histories::ByIntent);
        let as_worded = by_truth(&sessions, 1, &domain, 0.2, Histories::AsWorded);
        assert!((by_intent.off - 1.0).abs() < 1e-9, "{by_intent:?}");
        assert!((as_worded.off - 0.5).abs() < 1e-9, "{as_worded:?}");
        assert!((as_worded.on - 1.0).abs() < 1e-9, "{as_worded:?}");
    }

    /// The counted table knows what the sessions replayed before did, not what the domain
    /// says: here the domain says A is followed by C, the traffic says B.
    #[test]
    fn the_counted_table_learns_from_the_sessions_before() {
        let domain: Domain =
            serde_json::from_str(r#"{"transitions": {"A": {"C": 1.0}, "B": {"END": 1.0}}}"#)
                .unwrap();
        let sessions = [
            session(&[("A", "a1"), ("B", "b1")]),
            session(&[("A", "a2"), ("B", "b2")]),
        ];
        let args = |table| ceiling(&sessions, 1, &domain, 0.2, 3, Histories::AsWorded, table);
        let (truth, counted) = (args(Table::True), args(Table::Counted));
        // Measured: A (cached: the same empty context), then B after a2, a new context.
        assert!(
            (truth.off - 0.5).abs() < 1e-9 && (truth.on - 0.5).abs() < 1e-9,
            "{truth:?}"
        );
        assert!((counted.on - 1.0).abs() < 1e-9, "{counted:?}");
        // Nothing is counted before the first session: it prefetches nothing.
        let first_only = ceiling(
            &sessions[..1],
            0,
            &domain,
            0.2,
            3,
            Histories::AsWorded,
            Table::Counted,
        );
        assert!(first_only.on.abs() < 1e-9, "{first_only:?}");
    }

    #[test]
    fn a_prefetch_is_not_credited_for_a_turn_the_cache_answers() {
        let domain = a_then_b();
        // Both measured: the second session's B is answered by the first one's B (same
        // history), so the prefetch generated after its A is not needed, nor credited.
        let sessions = [
            session(&[("A", "a1"), ("B", "b1")]),
            session(&[("A", "a1"), ("B", "b2")]),
        ];
        let c = by_truth(&sessions, 0, &domain, 0.2, Histories::ByIntent);
        // Turns: A miss, B prefetched, A cached, B cached.
        assert!((c.off - 0.5).abs() < 1e-9, "{c:?}");
        assert!((c.on - 0.75).abs() < 1e-9, "{c:?}");
        assert!(c.unused.abs() < 1e-9 && c.never_used.abs() < 1e-9, "{c:?}");
    }
}
