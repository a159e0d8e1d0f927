//! Predictions: the follow-up clusters of an entry, ranked by estimated probability, from the
//! entry's own counts, else its cluster's, else those of entries with a similar embedding.

use std::collections::HashMap;

use reprise_cache::EntryId;

use super::{cosine, Model, Node};

/// Neighbours pooled for a rarely seen node.
const MAX_NEIGHBOURS: usize = 16;
/// Clusters of one family prefetched for one answer at most (the most asked first).
const MAX_FAMILY_CLUSTERS: usize = 4;
/// Follow-ups passed over that a prediction reports at most (the most probable first).
const MAX_PASSED_OVER: usize = 8;

/// Thresholds of a prediction.
#[derive(Debug, Clone, Copy)]
pub struct PredictParams {
    /// Lowest probability kept.
    pub min_probability: f64,
    /// Most predictions returned.
    pub max_predictions: usize,
    /// Lowest decayed count of observations with a known outcome a prediction rests on.
    pub min_observations: f64,
    /// Lowest cosine similarity of a neighbour whose counts a rarely seen node borrows.
    pub similar_threshold: f32,
}

/// A predicted follow-up.
///
/// The prefetcher asks `prompt` and aliases `wordings`; `target`, `cluster` and `borrowed`
/// describe the prediction (tests, debug output).
#[derive(Debug, Clone)]
#[allow(dead_code)]
pub struct Prediction {
    /// The entry that answered this follow-up most often before.
    pub target: EntryId,
    /// The follow-up's cluster.
    pub cluster: u64,
    /// What to ask: the cluster's most used wording.
    pub prompt: String,
    /// The cluster's other observed wordings, most used first (at most
    /// [`MAX_WORDINGS`](super::MAX_WORDINGS)).
    pub wordings: Vec<String>,
    /// Estimated probability that the next turn asks it (in any of its wordings, or of its
    /// family's: see [`super::RegroupParams::family_score`]).
    pub probability: f64,
    /// Whether the counts were borrowed (from the cluster or from similar entries).
    pub borrowed: bool,
}

/// What a prediction rested on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// The entry's own counts (seen at least `min_observations` times).
    Entry,
    /// Its cluster's: every wording of the question, in every context.
    Cluster,
    /// Those of entries with a similar embedding (and its own).
    Similar,
    /// Too few observations anywhere: nothing predicted.
    TooFew,
    /// The entry is not known (or its namespace).
    Unknown,
}

impl Basis {
    /// Its name in diagnostics.
    pub fn as_str(self) -> &'static str {
        match self {
            Basis::Entry => "entry",
            Basis::Cluster => "cluster",
            Basis::Similar => "similar",
            Basis::TooFew => "too_few",
            Basis::Unknown => "unknown",
        }
    }
}

/// A follow-up a prediction saw and did not keep.
#[derive(Debug, Clone)]
pub struct PassedOver {
    /// The follow-up cluster's representative wording.
    pub prompt: String,
    /// Its estimated probability.
    pub probability: f64,
    /// Why: `"min_probability"` (under it) or `"max_predictions"` (more probable questions
    /// filled them).
    pub reason: &'static str,
}

/// A prediction with what it rested on and what it passed over (diagnostics: `reprise-bench
/// replay` tells from them why a follow-up was not prefetched).
#[derive(Debug, Clone)]
pub struct Explained {
    pub predictions: Vec<Prediction>,
    pub basis: Basis,
    /// The most probable follow-ups not kept, at most 8.
    pub passed_over: Vec<PassedOver>,
}

impl Model {
    /// Ranks the follow-up clusters of `id`: [`Model::explain_prediction`]'s predictions.
    #[cfg(test)]
    pub fn predict(
        &self,
        ns: &str,
        id: EntryId,
        p: &PredictParams,
        now_ms: u64,
    ) -> Vec<Prediction> {
        self.explain_prediction(ns, id, p, now_ms).predictions
    }

    /// Ranks the follow-up clusters of `id`. The counts come from the node itself when it
    /// was seen at least `min_observations` times (its own context says most), else from its
    /// cluster (every wording of the question, in every context), else from the nodes with a
    /// similar embedding. Observations are counted with their outcome known: the latest one,
    /// while it awaits its follow-up, is left out (see [`Model::observe`]).
    pub fn explain_prediction(
        &self,
        ns: &str,
        id: EntryId,
        p: &PredictParams,
        now_ms: u64,
    ) -> Explained {
        let nothing = |basis| Explained {
            predictions: Vec::new(),
            basis,
            passed_over: Vec::new(),
        };
        let hl = self.half_life_ms;
        let Some(space) = self.namespaces.get(ns) else {
            return nothing(Basis::Unknown);
        };
        let Some(node) = space.nodes.get(&id) else {
            return nothing(Basis::Unknown);
        };
        let live = |c: Option<u64>| c.filter(|c| space.clusters.contains_key(c));
        let own_cluster = live(node.cluster);
        // Counts by follow-up cluster, with the entry that carried the most of each.
        let mut counts: HashMap<u64, (f64, EntryId, f64)> = HashMap::new();
        let add_nodes = |sources: &[&Node], counts: &mut HashMap<u64, (f64, EntryId, f64)>| {
            for src in sources {
                for (target, count) in &src.next {
                    if *target == id {
                        continue;
                    }
                    // A target forgotten since (or never seen served) has no prompt to ask.
                    let Some(cid) = space.nodes.get(target).and_then(|t| live(t.cluster)) else {
                        continue;
                    };
                    // The same question again (merged wordings make such loops): its answer
                    // is the one just served.
                    if Some(cid) == own_cluster {
                        continue;
                    }
                    let v = count.value(now_ms, hl);
                    let e = counts.entry(cid).or_insert((0.0, *target, 0.0));
                    e.0 += v;
                    if v > e.2 {
                        e.1 = *target;
                        e.2 = v;
                    }
                }
            }
        };
        // Outcomes known: an observation still awaiting its follow-up (the one this
        // prediction is made for) is not a conversation that ended.
        let own = node.known(now_ms, hl);
        let cluster_seen = own_cluster
            .and_then(|c| space.clusters.get(&c))
            .map_or(0.0, |c| c.known(now_ms, hl));
        let (total, basis) = if own >= p.min_observations {
            add_nodes(&[node], &mut counts);
            (own, Basis::Entry)
        } else if cluster_seen >= p.min_observations {
            let c = &space.clusters[&own_cluster.unwrap_or_default()];
            for (target, count) in &c.next {
                if space.clusters.contains_key(target) && Some(*target) != own_cluster {
                    // The representative entry is unknown at cluster level: the best node
                    // target is looked up below when needed.
                    counts.insert(*target, (count.value(now_ms, hl), id, 0.0));
                }
            }
            (cluster_seen, Basis::Cluster)
        } else {
            let mut sources: Vec<&Node> = vec![node];
            if let Some(emb) = &node.embedding {
                let mut near: Vec<(f32, &Node)> = space
                    .nodes
                    .iter()
                    .filter(|(k, n)| **k != id && !n.next.is_empty())
                    .filter_map(|(_, n)| {
                        let s = cosine(emb, n.embedding.as_deref()?);
                        (s >= p.similar_threshold).then_some((s, n))
                    })
                    .collect();
                near.sort_by(|a, b| b.0.total_cmp(&a.0));
                sources.extend(near.into_iter().take(MAX_NEIGHBOURS).map(|(_, n)| n));
            }
            let total: f64 = sources.iter().map(|n| n.known(now_ms, hl)).sum();
            add_nodes(&sources, &mut counts);
            (total, Basis::Similar)
        };
        if total < p.min_observations || total <= 0.0 {
            return nothing(Basis::TooFew);
        }
        let borrowed = basis != Basis::Entry;
        // A question asked in wordings regrouping keeps apart (its family) is one follow-up:
        // its clusters' counts add up, and each of them is prefetched with its own wordings.
        let family = |cid: u64| space.families.get(&cid).copied().unwrap_or(cid);
        let mut by_family: HashMap<u64, f64> = HashMap::new();
        for (cid, (count, _, _)) in &counts {
            *by_family.entry(family(*cid)).or_default() += count;
        }
        // Under `min_probability`: (probability, cluster); named only if among the reported.
        let mut under: Vec<(f64, u64)> = Vec::new();
        // The prediction of cluster `cid` (`target` is `id` where no entry is known for it).
        let make = |cid: u64, target: EntryId, probability: f64| {
            let c = &space.clusters[&cid];
            let mut words: Vec<(f64, &str)> = c
                .wordings
                .iter()
                .map(|w| (w.used.value(now_ms, hl), w.text.as_str()))
                .collect();
            // Most used first; the representative (first) wins ties.
            words.sort_by(|a, b| b.0.total_cmp(&a.0));
            let prompt = words.first().map_or(c.prompt.as_str(), |w| w.1).to_string();
            let target = if target == id {
                // Cluster-level counts: any entry of that cluster will do as a name.
                space
                    .nodes
                    .iter()
                    .find(|(_, n)| n.cluster == Some(cid))
                    .map_or(id, |(k, _)| *k)
            } else {
                target
            };
            Prediction {
                target,
                cluster: cid,
                wordings: words.iter().skip(1).map(|w| w.1.to_string()).collect(),
                prompt,
                probability,
                borrowed,
            }
        };
        let mut out: Vec<(f64, u64, Prediction)> = counts
            .iter()
            .filter_map(|(&cid, &(count, target, _))| {
                let probability = (by_family[&family(cid)] / total).min(1.0);
                if probability < p.min_probability {
                    under.push((probability, cid));
                    return None;
                }
                Some((count, family(cid), make(cid, target, probability)))
            })
            .collect();
        // A family predicted is one question, whichever of its wordings comes next: its
        // clusters that never followed this answer are prefetched too, after those that did
        // (weighed below every count, the most asked of them first).
        let predicted: HashMap<u64, f64> = out
            .iter()
            .map(|(_, fam, pr)| (*fam, pr.probability))
            .collect();
        if !predicted.is_empty() {
            for (&cid, root) in &space.families {
                let Some(&probability) = predicted.get(root) else {
                    continue;
                };
                if counts.contains_key(&cid) || Some(cid) == own_cluster {
                    continue;
                }
                let Some(c) = space.clusters.get(&cid) else {
                    continue;
                };
                let weight = -1.0 / (1.0 + c.seen.value(now_ms, hl));
                out.push((weight, *root, make(cid, id, probability)));
            }
        }
        // Most probable first, a family's clusters together, its most asked first.
        out.sort_by(|a, b| {
            (b.2.probability.total_cmp(&a.2.probability))
                .then(a.1.cmp(&b.1))
                .then(b.0.total_cmp(&a.0))
                .then(a.2.cluster.cmp(&b.2.cluster))
        });
        // `max_predictions` questions (a family counts once), at most
        // `MAX_FAMILY_CLUSTERS` clusters of each.
        let mut kept: Vec<(u64, usize)> = Vec::new();
        let mut predictions = Vec::new();
        let mut passed_over: Vec<PassedOver> = Vec::new();
        for (_, fam, prediction) in out {
            match kept.last_mut() {
                Some((f, n)) if *f == fam => {
                    if *n == MAX_FAMILY_CLUSTERS {
                        continue;
                    }
                    *n += 1;
                }
                _ => {
                    if kept.len() == p.max_predictions {
                        passed_over.push(PassedOver {
                            prompt: prediction.prompt,
                            probability: prediction.probability,
                            reason: "max_predictions",
                        });
                        continue;
                    }
                    kept.push((fam, 1));
                }
            }
            predictions.push(prediction);
        }
        under.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        passed_over.extend(
            under
                .into_iter()
                .take(MAX_PASSED_OVER)
                .map(|(probability, cid)| PassedOver {
                    prompt: space.clusters[&cid].prompt.clone(),
                    probability,
                    reason: "min_probability",
                }),
        );
        passed_over.sort_by(|a, b| b.probability.total_cmp(&a.probability));
        passed_over.truncate(MAX_PASSED_OVER);
        Explained {
            predictions,
            basis,
            passed_over,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use super::super::same_text;
    use crate::prefetch::model::tests::params;

    #[test]
    fn counts_become_probabilities() {
        let mut m = Model::new(3600.0);
        let (x, y, z) = (EntryId(1), EntryId(2), EntryId(3));
        for i in 0..4 {
            m.observe("ns", x, "x?", None, 1000, same_text);
            let next = if i < 3 { y } else { z };
            m.observe(
                "ns",
                next,
                if i < 3 { "y?" } else { "z?" },
                None,
                1000,
                same_text,
            );
            m.link("ns", x, next, true, 1000);
        }
        let p = m.predict("ns", x, &params(), 1000);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].target, y);
        assert_eq!(p[0].prompt, "y?");
        assert!((p[0].probability - 0.75).abs() < 1e-9);
        assert!((p[1].probability - 0.25).abs() < 1e-9);
        assert!(!p[0].borrowed);
        assert_eq!(m.prefers_multi("ns", 1000), Some(true));
    }

    #[test]
    fn the_serving_predicted_for_is_not_counted_as_an_end() {
        let mut m = Model::new(3600.0);
        let (x, y, z) = (EntryId(1), EntryId(2), EntryId(3));
        for i in 0..4 {
            m.observe("ns", x, "x?", None, 0, same_text);
            let (next, text) = if i < 3 { (y, "y?") } else { (z, "z?") };
            m.observe("ns", next, text, None, 0, same_text);
            m.link("ns", x, next, true, 0);
        }
        let probabilities = |m: &Model, id| {
            m.predict("ns", id, &params(), 0)
                .iter()
                .map(|p| p.probability)
                .collect::<Vec<_>>()
        };
        // Served a fifth time: its follow-up is what the prediction is for, so it is no end
        // (counted as one, the estimates were 3/5 and 1/5).
        m.observe("ns", x, "x?", None, 0, same_text);
        assert_eq!(probabilities(&m, x), [0.75, 0.25]);
        // Served a sixth time with no follow-up of the fifth: that conversation ended.
        m.observe("ns", x, "x?", None, 0, same_text);
        assert_eq!(probabilities(&m, x), [0.6, 0.2]);
        // A new entry of the same question borrows its cluster's counts on the same terms:
        // seven servings, the latest awaiting, y after three of the six known.
        let x2 = EntryId(4);
        m.observe("ns", x2, "x?", None, 0, same_text);
        assert_eq!(probabilities(&m, x2), [0.5]);
        // Once its follow-up comes, every serving of the question is known.
        m.observe("ns", y, "y?", None, 0, same_text);
        m.link("ns", x2, y, true, 0);
        assert_eq!(probabilities(&m, x2), [4.0 / 7.0]);
    }

    #[test]
    fn a_new_node_borrows_from_similar_ones() {
        let mut m = Model::new(3600.0);
        let e1: Arc<[f32]> = Arc::from(vec![1.0f32, 0.0]);
        let e2: Arc<[f32]> = Arc::from(vec![0.99f32, 0.1]);
        let far: Arc<[f32]> = Arc::from(vec![0.0f32, 1.0]);
        let (x, y, x2, w) = (EntryId(1), EntryId(2), EntryId(3), EntryId(4));
        for _ in 0..3 {
            m.observe("ns", x, "x?", Some(&e1), 0, same_text);
            m.observe("ns", y, "y?", None, 0, same_text);
            m.link("ns", x, y, true, 0);
        }
        m.observe("ns", x2, "x again?", Some(&e2), 0, same_text);
        m.observe("ns", w, "w?", Some(&far), 0, same_text);
        let p = m.predict("ns", x2, &params(), 0);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].prompt, "y?");
        assert!(p[0].borrowed);
        assert!(m.predict("ns", w, &params(), 0).is_empty());
    }
}
