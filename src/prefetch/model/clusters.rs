//! Clusters: the wordings of one question counted as one. A prompt joins the cluster holding
//! its exact wording, else the most similar representative the join rule accepts, else founds
//! a new one; a cluster keeps its most used wordings, the representative first.

use std::collections::HashMap;
use std::sync::Arc;

use reprise_cache::EntryId;

use super::{cosine, Cluster, Decayed, JoinRule, Model, Namespace, Wording};
use super::{MAX_CLUSTERS, MAX_WORDINGS};

impl Namespace {
    /// The cluster `prompt` belongs to: the one holding this exact wording, else the most
    /// similar representative that `join` accepts, else a new one.
    fn assign(
        &mut self,
        prompt: &str,
        embedding: Option<&Arc<[f32]>>,
        now_ms: u64,
        join: &JoinRule<'_>,
    ) -> u64 {
        let emb = embedding.map(|e| &e[..]);
        let mut best: Option<(f32, u64)> = None;
        for (id, c) in &self.clusters {
            let score = if c.wordings.iter().any(|w| w.text == prompt) {
                2.0
            } else if join(prompt, emb, &c.prompt, c.embedding.as_deref()) {
                match (emb, c.embedding.as_deref()) {
                    (Some(a), Some(b)) => cosine(a, b),
                    _ => 1.0,
                }
            } else {
                continue;
            };
            // Ties go to the oldest cluster, whatever the map's order.
            if best.is_none_or(|(s, b)| score > s || (score == s && *id < b)) {
                best = Some((score, *id));
            }
        }
        if let Some((_, id)) = best {
            return id;
        }
        if self.clusters.len() >= MAX_CLUSTERS {
            forget_oldest_clusters(&mut self.clusters, MAX_CLUSTERS / 10);
        }
        let id = self.next_cluster;
        self.next_cluster += 1;
        self.clusters.insert(
            id,
            Cluster {
                prompt: prompt.to_string(),
                embedding: embedding.cloned(),
                wordings: vec![Wording {
                    text: prompt.to_string(),
                    used: Decayed::default(),
                }],
                touched_ms: now_ms,
                ..Cluster::default()
            },
        );
        id
    }

    /// The live cluster of a node, assigning one when it has none (or it was forgotten).
    pub(super) fn cluster_of(&mut self, id: EntryId, now_ms: u64, join: &JoinRule) -> Option<u64> {
        let node = self.nodes.get(&id)?;
        if let Some(c) = node.cluster.filter(|c| self.clusters.contains_key(c)) {
            return Some(c);
        }
        if node.prompt.is_empty() {
            return None;
        }
        let (prompt, emb) = (node.prompt.clone(), node.embedding.clone());
        let c = self.assign(&prompt, emb.as_ref(), now_ms, join);
        if let Some(n) = self.nodes.get_mut(&id) {
            n.cluster = Some(c);
        }
        Some(c)
    }
}

impl Model {
    /// The clusters of `ns`, each as its wordings (the representative first), for
    /// diagnostics: a cluster mixing two questions is a false hit waiting to happen.
    pub fn clusters(&self, ns: &str) -> Vec<Vec<String>> {
        self.namespaces
            .get(ns)
            .map_or_else(Vec::new, Namespace::cluster_wordings)
    }
}

impl Namespace {
    /// Every cluster as its wordings, the representative first.
    pub(super) fn cluster_wordings(&self) -> Vec<Vec<String>> {
        self.clusters
            .values()
            .map(|c| c.wordings.iter().map(|w| w.text.clone()).collect())
            .collect()
    }
}

/// Counts one more use of `text` for a cluster, keeping at most [`MAX_WORDINGS`].
pub(super) fn note_wording(c: &mut Cluster, text: &str, now_ms: u64, hl: f64) {
    if let Some(w) = c.wordings.iter_mut().find(|w| w.text == text) {
        w.used.add(1.0, now_ms, hl);
        return;
    }
    if c.wordings.len() >= MAX_WORDINGS {
        // The representative (first) stays: joining is decided against it.
        let Some(weakest) = c
            .wordings
            .iter()
            .enumerate()
            .skip(1)
            .min_by(|a, b| {
                a.1.used
                    .value(now_ms, hl)
                    .total_cmp(&b.1.used.value(now_ms, hl))
            })
            .map(|(i, _)| i)
        else {
            return;
        };
        c.wordings.remove(weakest);
    }
    let mut used = Decayed::default();
    used.add(1.0, now_ms, hl);
    c.wordings.push(Wording {
        text: text.to_string(),
        used,
    });
}

/// Drops the `n` least recently touched clusters (their nodes are reassigned when next seen).
pub(super) fn forget_oldest_clusters(clusters: &mut HashMap<u64, Cluster>, n: usize) {
    let mut ages: Vec<(u64, u64)> = clusters.iter().map(|(k, v)| (v.touched_ms, *k)).collect();
    ages.sort_unstable();
    for (_, k) in ages.into_iter().take(n.max(1)) {
        clusters.remove(&k);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefetch::model::tests::{first_word, params};

    #[test]
    fn clusters_pool_wordings_for_counting_and_prediction() {
        let mut m = Model::new(3600.0);
        // Three wordings of "open" and of "save", each its own entry (as per context and
        // wording); no entry is seen twice, but the clusters are.
        let opens = ["open a file?", "open files how", "open where?"];
        let saves = ["save it how?", "save the file?", "save now?"];
        for i in 0..3u128 {
            let (o, s) = (EntryId(10 + i), EntryId(20 + i));
            m.observe("ns", o, opens[i as usize], None, 0, first_word);
            m.observe("ns", s, saves[i as usize], None, 0, first_word);
            m.link("ns", o, s, true, 0);
        }
        // A fresh entry of "open" predicts the "save" cluster from the cluster counts.
        let fresh = EntryId(99);
        m.observe("ns", fresh, "open a file?", None, 0, first_word);
        let p = m.predict("ns", fresh, &params(), 0);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].borrowed);
        // 3 follow-ups over the cluster's 3 sightings known (the fresh one awaits its own).
        assert!((p[0].probability - 1.0).abs() < 1e-9, "{p:?}");
        assert!(saves.contains(&p[0].prompt.as_str()));
        let mut all = p[0].wordings.clone();
        all.push(p[0].prompt.clone());
        all.sort();
        let mut want: Vec<String> = saves.iter().map(|s| s.to_string()).collect();
        want.sort();
        assert_eq!(all, want);
        // A prompt that does not join stays apart.
        m.observe("ns", EntryId(50), "close it?", None, 0, first_word);
        let clusters = m.clusters("ns");
        assert_eq!(clusters.len(), 3);
    }

    #[test]
    fn wordings_are_bounded_and_keep_the_representative() {
        let mut m = Model::new(3600.0);
        for i in 0..(MAX_WORDINGS as u128 + 5) {
            m.observe("ns", EntryId(i), &format!("q {i}"), None, 0, first_word);
        }
        let c = m.clusters("ns");
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].len(), MAX_WORDINGS);
        assert_eq!(c[0][0], "q 0");
    }
}
