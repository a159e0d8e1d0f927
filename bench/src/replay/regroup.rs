//! `--regroup-curve`: tuning `prefetch.regroup_score` on labelled sessions (the prefetch side's
//! clusters regrouped at each score, judged by the turns' intents).

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

/// `--regroup-curve`: the prefetch side's question clusters (learned with regrouping off)
/// regrouped at each score, judged by intent; the chosen score for each `--target-mixed` and
/// the configured score's point.
pub(super) fn regroup_report(
    a: &ReplayArgs,
    side: &Side,
    intent_of: &HashMap<String, String>,
) -> anyhow::Result<()> {
    let p = prefetcher(&side.server.state)
        .ok_or_else(|| anyhow::anyhow!("the prefetch side has no prefetcher"))?;
    let configured = side.server.state.config.prefetch.regroup_score;
    let at = |score: f32| {
        judge_grouping(
            score,
            &p.regrouped_clusters(DEFAULT_NAMESPACE, score),
            intent_of,
        )
    };
    eprintln!("regrouping at 31 scores");
    let curve: Vec<Grouping> = (30..=60).map(|i| at(i as f32 * 0.05)).collect();
    let alone = judge_grouping(f32::INFINITY, &p.clusters(DEFAULT_NAMESPACE), intent_of);
    println!("== reprise bench replay --regroup-curve ==");
    println!(
        "sessions played {}{}; intents {}, wordings clustered {}",
        side.done.load(Ordering::Relaxed),
        a.half
            .map(|h| format!(" ({h:?} half, split seed {})", a.split_seed))
            .unwrap_or_default(),
        alone.intents,
        alone.wordings
    );
    println!(
        "score | clusters | clusters per intent | clusters mixing intents | wordings misplaced"
    );
    let line = |g: &Grouping| {
        format!(
            "{} | {} | {:.2} | {} | {} ({})",
            if g.score.is_finite() {
                format!("{:.2}", g.score)
            } else {
                "none (embedding alone)".into()
            },
            g.clusters,
            g.spread(),
            g.mixed,
            g.misplaced,
            pct(g.misplaced_share()).trim()
        )
    };
    println!("{}", line(&alone));
    for g in &curve {
        println!("{}", line(g));
    }
    let conf = at(configured);
    println!("configured regroup_score: {}", line(&conf));
    let mut chosen = Vec::new();
    for &target in &a.target_misplaced {
        match choose_score(&curve, target) {
            Some(g) => {
                println!("target misplaced <= {:.1} %: {}", target * 100.0, line(&g));
                chosen.push(json!({"target_misplaced": target, "score": g.score}));
            }
            None => println!(
                "target misplaced <= {:.1} %: no score up to 3.00 meets it",
                target * 100.0
            ),
        }
    }
    if let Some(path) = &a.json {
        let point = |g: &Grouping| {
            json!({"score": g.score, "clusters": g.clusters, "mixed": g.mixed,
                "wordings": g.wordings, "misplaced": g.misplaced, "intents": g.intents})
        };
        let out = json!({
            "half": a.half.map(|h| format!("{h:?}")), "split_seed": a.split_seed,
            "embedding_alone": point(&alone),
            "configured": point(&conf),
            "curve": curve.iter().map(point).collect::<Vec<_>>(),
            "chosen": chosen,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
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
}
