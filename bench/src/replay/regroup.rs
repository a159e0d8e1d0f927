//! `--regroup-curve`: tuning `prefetch.regroup_score` on labelled sessions. For each split
//! seed, the prefetch side's clusters of each half are learned in a repeatable play and
//! regrouped (on a copy) at each score, judged by the turns' intents; each seed chooses on its
//! tuning half and is reported on its held-out half.

use super::report::pct;
use super::*;

/// The question clusters regrouping leaves at one score, judged by the turns' intents.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Grouping {
    score: f32,
    clusters: usize,
    /// Clusters holding wordings of more than one intent.
    mixed: usize,
    /// Wordings clustered (of a known intent).
    wordings: usize,
    /// Wordings not of their cluster's most common intent: each can be served another
    /// intent's prefetched answer.
    misplaced: usize,
    /// Intents (with a clustered wording).
    intents: usize,
}

impl Grouping {
    fn misplaced_share(&self) -> f64 {
        self.misplaced as f64 / self.wordings.max(1) as f64
    }

    /// Clusters per intent: 1.0 is every intent in one cluster (mixed ones count for each
    /// intent they hold).
    fn spread(&self) -> f64 {
        (self.clusters + self.mixed) as f64 / self.intents.max(1) as f64
    }
}

/// Judges `clusters` (each a list of wordings) by `intent_of`; wordings of unknown intent are
/// left out.
fn judge_grouping(
    score: f32,
    clusters: &[Vec<String>],
    intent_of: &HashMap<String, String>,
) -> Grouping {
    let mut g = Grouping {
        score,
        clusters: clusters.len(),
        mixed: 0,
        wordings: 0,
        misplaced: 0,
        intents: 0,
    };
    let mut intents = std::collections::HashSet::new();
    for c in clusters {
        let mut count: HashMap<&str, usize> = HashMap::new();
        for w in c {
            if let Some(i) = intent_of.get(w) {
                *count.entry(i.as_str()).or_default() += 1;
                intents.insert(i.as_str());
            }
        }
        let total: usize = count.values().sum();
        let most = count.values().copied().max().unwrap_or(0);
        g.wordings += total;
        g.misplaced += total - most;
        g.mixed += usize::from(count.len() > 1);
    }
    g.intents = intents.len();
    g
}

/// The lowest score of `curve` (ascending scores) whose misplaced wordings are at most
/// `target` of those clustered.
fn choose_score(curve: &[Grouping], target: f64) -> Option<Grouping> {
    curve
        .iter()
        .find(|g| g.wordings > 0 && g.misplaced as f64 <= target * g.wordings as f64)
        .copied()
}

/// The curve of one half of one split.
struct Curve {
    sessions: usize,
    /// Turns whose learning the play did not see in time (0 for a repeatable curve).
    unsynced: usize,
    /// The clusters as learned (the embedding alone).
    alone: Grouping,
    /// Regrouped at each of [`scores`].
    points: Vec<Grouping>,
    /// Regrouped at the configured `regroup_score`.
    configured: Grouping,
}

/// The scores of the curve: 1.50 to 3.00 by 0.05.
fn scores() -> Vec<f32> {
    (30..=60).map(|i| i as f32 * 0.05).collect()
}

/// `--regroup-curve`: for each split seed, the curve of its tuning half and of its held-out
/// half; each seed's choice on the first, reported on the second; the median choice.
pub(super) async fn tune(a: &ReplayArgs, all: Vec<Session>) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.split_seeds.is_empty(),
        "--split-seeds needs at least one seed"
    );
    let intent_of = Arc::new(intents(&all));
    let mut runs = Vec::new();
    for &seed in &a.split_seeds {
        let tune = learn_half(a, &all, seed, Half::Tune, &intent_of).await?;
        let held = learn_half(a, &all, seed, Half::HeldOut, &intent_of).await?;
        runs.push((seed, tune, held));
    }
    println!("== reprise bench replay --regroup-curve ==");
    println!(
        "{} split seeds; per half: sessions played in file order, one at a time, each turn learned before the next; regrouping off, nothing generated in the background",
        runs.len()
    );
    for (seed, tune, held) in &runs {
        println!(
            "seed {seed}: tuning half {} sessions, {} intents, {} wordings clustered; held-out half {} sessions, {} intents, {} wordings{}",
            tune.sessions,
            tune.alone.intents,
            tune.alone.wordings,
            held.sessions,
            held.alone.intents,
            held.alone.wordings,
            match tune.unsynced + held.unsynced {
                0 => String::new(),
                n => format!(" ({n} turns not seen learned in time: this curve may vary)"),
            }
        );
    }
    let mean = |f: &dyn Fn(&(u64, Curve, Curve)) -> f64| {
        runs.iter().map(f).sum::<f64>() / runs.len() as f64
    };
    println!("score | tuning halves: clusters per intent, misplaced (mean over seeds) | held-out halves: the same");
    let row = |label: String, t: &dyn Fn(&Curve) -> Grouping| {
        println!(
            "{label} | {:.2}, {} | {:.2}, {}",
            mean(&|r| t(&r.1).spread()),
            pct(mean(&|r| t(&r.1).misplaced_share())).trim(),
            mean(&|r| t(&r.2).spread()),
            pct(mean(&|r| t(&r.2).misplaced_share())).trim(),
        );
    };
    row("none (embedding alone)".into(), &|c| c.alone);
    for (i, score) in scores().into_iter().enumerate() {
        row(format!("{score:.2}"), &|c| c.points[i]);
    }
    let configured = a
        .regroup_score
        .unwrap_or(PrefetchConfig::default().regroup_score);
    row(format!("configured {configured:.2}"), &|c| c.configured);
    let mut chosen = Vec::new();
    for &target in &a.target_misplaced {
        let mut picks = Vec::new();
        for (seed, tune, held) in &runs {
            match choose_score(&tune.points, target) {
                Some(g) => {
                    let i = tune
                        .points
                        .iter()
                        .position(|p| p.score == g.score)
                        .unwrap_or(0);
                    let h = held.points[i];
                    println!(
                        "target misplaced <= {:.1} %, seed {seed}: chose {:.2} (tuning half {}); held-out half at {:.2}: {} misplaced, {:.2} clusters per intent",
                        target * 100.0,
                        g.score,
                        pct(g.misplaced_share()).trim(),
                        g.score,
                        pct(h.misplaced_share()).trim(),
                        h.spread()
                    );
                    picks.push((g.score, h.misplaced_share()));
                }
                None => println!(
                    "target misplaced <= {:.1} %, seed {seed}: no score up to 3.00 meets it",
                    target * 100.0
                ),
            }
        }
        if picks.len() < runs.len() {
            println!(
                "target misplaced <= {:.1} %: not met on every seed; no default",
                target * 100.0
            );
            chosen.push(json!({"target_misplaced": target, "score": null}));
            continue;
        }
        let median = median_score(picks.iter().map(|p| p.0).collect());
        let held_at_choice = picks.iter().map(|p| p.1).sum::<f64>() / picks.len() as f64;
        println!(
            "target misplaced <= {:.1} %: median choice {median:.2} (choices {}); held-out misplaced at each seed's own choice, mean {}",
            target * 100.0,
            picks
                .iter()
                .map(|p| format!("{:.2}", p.0))
                .collect::<Vec<_>>()
                .join(", "),
            pct(held_at_choice).trim()
        );
        chosen.push(json!({"target_misplaced": target, "score": median,
            "choices": picks.iter().map(|p| p.0).collect::<Vec<_>>(),
            "held_out_misplaced_at_choice": held_at_choice}));
    }
    if let Some(path) = &a.json {
        let point = |g: &Grouping| {
            json!({"score": g.score, "clusters": g.clusters, "mixed": g.mixed,
                "wordings": g.wordings, "misplaced": g.misplaced, "intents": g.intents})
        };
        let curve = |c: &Curve| {
            json!({"sessions": c.sessions, "unsynced": c.unsynced,
                "embedding_alone": point(&c.alone), "configured": point(&c.configured),
                "curve": c.points.iter().map(point).collect::<Vec<_>>()})
        };
        let out = json!({
            "seeds": runs.iter().map(|(seed, t, h)| json!({"split_seed": seed,
                "tune": curve(t), "held_out": curve(h)})).collect::<Vec<_>>(),
            "chosen": chosen,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

/// The median of `scores` (the lower middle one of an even count: the less strict).
fn median_score(mut scores: Vec<f32>) -> f32 {
    scores.sort_by(f32::total_cmp);
    scores[(scores.len() - 1) / 2]
}

/// Learns the clusters of one half of `all` (see `--regroup-curve`) and judges them
/// regrouped at each score.
async fn learn_half(
    a: &ReplayArgs,
    all: &[Session],
    seed: u64,
    half: Half,
    intent_of: &Arc<HashMap<String, String>>,
) -> anyhow::Result<Curve> {
    let mut sessions = split(all.to_vec(), seed, half);
    if let Some(n) = a.limit {
        sessions.truncate(n);
    }
    let n = sessions.len();
    // One at a time, no pauses (nothing runs in the background to pause for), answers
    // without delay (their timing plays no part), all learned.
    let lockstep = ReplayArgs {
        concurrency: 1,
        think_ms: 0,
        warmup_think_ms: None,
        warmup: 0,
        token_delay_ms: 0,
        ..a.clone()
    };
    let name = match half {
        Half::Tune => "tuning half",
        Half::HeldOut => "held-out half",
    };
    let side = Arc::new(
        start_side(&lockstep, name, true, |c| {
            c.prefetch.regroup = false;
            // Nothing generated in the background: which entry answers a turn then depends
            // on the sessions alone, not on when a prefetch finished.
            c.prefetch.max_tokens_per_minute = 0;
            // Counts do not decay during the pass: how long it takes plays no part.
            c.prefetch.half_life_secs = 1e9;
        })
        .await?,
    );
    let started = Instant::now();
    play_side(
        side.clone(),
        client(&lockstep)?,
        Arc::new(sessions),
        intent_of.clone(),
        lockstep,
    )
    .await?;
    let played = started.elapsed().as_secs_f64();
    let p = prefetcher(&side.server.state)
        .ok_or_else(|| anyhow::anyhow!("the prefetch side has no prefetcher"))?;
    anyhow::ensure!(
        p.stats().started == 0,
        "a background generation ran during a --regroup-curve play"
    );
    let at = |score: f32| {
        judge_grouping(
            score,
            &p.regrouped_clusters(DEFAULT_NAMESPACE, score),
            intent_of,
        )
    };
    let curve = Curve {
        sessions: n,
        unsynced: side.unsynced.load(Ordering::Relaxed),
        alone: judge_grouping(f32::INFINITY, &p.clusters(DEFAULT_NAMESPACE), intent_of),
        points: scores().into_iter().map(at).collect(),
        configured: at(side.server.state.config.prefetch.regroup_score),
    };
    eprintln!(
        "  {name} of seed {seed}: played in {played:.0} s, regrouped at {} scores in {:.0} s",
        curve.points.len(),
        started.elapsed().as_secs_f64() - played
    );
    Ok(curve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grouping_is_judged_by_intent_and_the_lowest_safe_score_chosen() {
        let intent_of: HashMap<String, String> = [
            ("a1", "A"),
            ("a2", "A"),
            ("a3", "A"),
            ("b1", "B"),
            ("b2", "B"),
        ]
        .into_iter()
        .map(|(w, i)| (w.to_string(), i.to_string()))
        .collect();
        let c = |ws: &[&str]| ws.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        // A split in two, B whole: nothing misplaced, 3 clusters for 2 intents.
        let split = judge_grouping(
            2.8,
            &[c(&["a1", "a2"]), c(&["a3"]), c(&["b1", "b2"])],
            &intent_of,
        );
        assert_eq!(
            (split.clusters, split.mixed, split.misplaced, split.wordings),
            (3, 0, 0, 5)
        );
        assert!((split.spread() - 1.5).abs() < 1e-9);
        // a3 joins B's cluster: one wording misplaced (the minority), one mixed cluster; an
        // unknown wording counts nowhere.
        let mixed = judge_grouping(
            2.2,
            &[c(&["a1", "a2"]), c(&["b1", "b2", "a3", "stray"])],
            &intent_of,
        );
        assert_eq!(
            (mixed.clusters, mixed.mixed, mixed.misplaced, mixed.wordings),
            (2, 1, 1, 5)
        );
        let whole = judge_grouping(2.5, &[c(&["a1", "a2", "a3"]), c(&["b1", "b2"])], &intent_of);
        assert!((whole.spread() - 1.0).abs() < 1e-9);
        let curve = [mixed, whole, split];
        assert_eq!(choose_score(&curve, 0.25).map(|g| g.score), Some(2.2));
        assert_eq!(choose_score(&curve, 0.1).map(|g| g.score), Some(2.5));
        assert_eq!(choose_score(&curve[..1], 0.1), None);
    }

    #[test]
    fn the_median_choice_is_the_middle_one_or_the_lower_middle() {
        assert_eq!(median_score(vec![2.6, 2.4, 2.45]), 2.45);
        assert_eq!(median_score(vec![2.6, 2.4, 2.45, 2.5]), 2.45);
        assert_eq!(median_score(vec![2.5]), 2.5);
    }
}
