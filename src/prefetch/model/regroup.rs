//! Regrouping by use: clusters whose representatives are moderately similar and that are
//! used alike (what follows them, what precedes them) are merged, the gate vetting each pair
//! and each moved wording.

use std::collections::HashMap;
use std::time::Instant;

use reprise_cache::vector::dot;

use super::{cosine, trim_next, Cluster, Decayed, Model, Namespace, MAX_WORDINGS};

/// Clusters compared by [`Model::regroup`] per namespace (the most seen); bounds its cost
/// (pairs grow with the square).
const MAX_REGROUP: usize = 512;
/// Merge passes of one [`Model::regroup`] (each pass merges disjoint pairs, then the
/// profiles are computed again).
const MAX_REGROUP_PASSES: usize = 16;

impl Namespace {
    /// Merges clusters that are one question by how they are used; returns the merges.
    ///
    /// Each cluster gets two profiles: what follows it (the counts of its follow-up
    /// clusters, each as its representative's embedding, plus the share of conversations
    /// that end there) and what precedes it (the same over the clusters it follows, plus the
    /// share of times it opened a conversation). Wordings of one question are asked in the
    /// same places of a conversation and lead to the same next questions, so their profiles
    /// agree even when their embeddings are far apart; two different questions that look
    /// alike ("How do I upload photos?" / "Why won't my photos upload?") lead elsewhere.
    /// A pair merges when the representatives' cosine, plus the cosines of both profiles,
    /// reaches `p.min_score`, the representatives' cosine reaches `p.min_cosine` and
    /// `allow` (the false-hit gate) accepts the two representatives. A side (follow-ups or
    /// predecessors) on which neither cluster has `p.min_seen` links is left out and the
    /// score scaled to the same range; questions never linked (single-turn traffic) are
    /// never merged.
    ///
    /// Returns the merges and whether the work is finished (`false`: `deadline` came first
    /// or the passes ran out with merges still found; call again). With `progress`, the
    /// first pass ignores the deadline: a pass cut short merges nothing, so a namespace
    /// whose one pass takes longer than any budget would otherwise never be regrouped (a
    /// pass is bounded by [`MAX_REGROUP`] clusters).
    fn regroup(
        &mut self,
        p: &RegroupParams,
        now_ms: u64,
        hl: f64,
        deadline: Instant,
        progress: bool,
        allow: &dyn Fn(&str, &str) -> bool,
    ) -> (usize, bool) {
        let mut merged = 0;
        for pass in 0..MAX_REGROUP_PASSES {
            let pass_deadline = if progress && pass == 0 {
                Instant::now() + std::time::Duration::from_secs(3600)
            } else {
                deadline
            };
            let Some((pairs, loose)) = self.merge_candidates(p, now_ms, hl, pass_deadline, allow)
            else {
                return (merged, false);
            };
            if pairs.is_empty() {
                self.families = families(&loose);
                return (merged, true);
            }
            let mut done: std::collections::HashSet<u64> = std::collections::HashSet::new();
            for (a, b) in pairs {
                if done.contains(&a) || done.contains(&b) {
                    continue;
                }
                done.insert(a);
                done.insert(b);
                self.merge(a, b, now_ms, hl, allow);
                merged += 1;
            }
        }
        (merged, false)
    }

    /// Pairs of clusters worth merging, best first (see [`Namespace::regroup`]), and the
    /// pairs that only reach `p.family_score`; `None` when `deadline` passed before all
    /// pairs were compared.
    #[allow(clippy::type_complexity)]
    fn merge_candidates(
        &self,
        p: &RegroupParams,
        now_ms: u64,
        hl: f64,
        deadline: Instant,
        allow: &dyn Fn(&str, &str) -> bool,
    ) -> Option<(Vec<(u64, u64)>, Vec<(u64, u64)>)> {
        let Some(dim) = self
            .clusters
            .values()
            .find_map(|c| c.embedding.as_ref().map(|e| e.len()))
        else {
            return Some(Default::default());
        };
        fn emb(c: &Cluster, dim: usize) -> Option<&[f32]> {
            c.embedding.as_deref().filter(|e| e.len() == dim)
        }
        let mut cands: Vec<(f64, u64)> = self
            .clusters
            .iter()
            .filter(|(_, c)| emb(c, dim).is_some())
            .map(|(id, c)| (c.seen.value(now_ms, hl), *id))
            .filter(|(seen, _)| *seen >= p.min_seen && *seen > 0.0)
            .collect();
        if cands.len() < 2 {
            return Some(Default::default());
        }
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        cands.truncate(MAX_REGROUP);
        let index: HashMap<u64, usize> = cands
            .iter()
            .enumerate()
            .map(|(i, (_, id))| (*id, i))
            .collect();
        // Profiles: `dim` components of neighbour embeddings, then the end (or start) share.
        let mut succ = vec![vec![0.0f32; dim + 1]; cands.len()];
        let mut pred = vec![vec![0.0f32; dim + 1]; cands.len()];
        let mut out = vec![0.0f64; cands.len()];
        let mut inc = vec![0.0f64; cands.len()];
        // In cluster order, so the sums (and the scores compared below) are the same for
        // the same clusters whatever the map's order.
        let mut order: Vec<u64> = self.clusters.keys().copied().collect();
        order.sort_unstable();
        for from_id in &order {
            let from = &self.clusters[from_id];
            let from_idx = index.get(from_id).copied();
            let from_emb = emb(from, dim);
            let mut next: Vec<(&u64, &Decayed)> = from.next.iter().collect();
            next.sort_unstable_by_key(|(id, _)| **id);
            for (to_id, count) in next {
                let v = count.value(now_ms, hl);
                let Some(to) = self.clusters.get(to_id) else {
                    continue;
                };
                if let (Some(i), Some(e)) = (from_idx, emb(to, dim)) {
                    axpy(&mut succ[i], v as f32, e);
                    out[i] += v;
                }
                if let (Some(j), Some(e)) = (index.get(to_id), from_emb) {
                    axpy(&mut pred[*j], v as f32, e);
                    inc[*j] += v;
                }
            }
        }
        for (i, (seen, _)) in cands.iter().enumerate() {
            succ[i][dim] = (seen - out[i]).max(0.0) as f32;
            pred[i][dim] = (seen - inc[i]).max(0.0) as f32;
            normalise(&mut succ[i]);
            normalise(&mut pred[i]);
        }
        // A side counts with at least one link (with `min_seen` 0 too: a profile of
        // nothing but the end or start share is no evidence).
        let min_links = p.min_seen.max(1.0);
        let mut pairs: Vec<(f32, u64, u64)> = Vec::new();
        let mut loose: Vec<(u64, u64)> = Vec::new();
        for i in 0..cands.len() {
            if Instant::now() >= deadline {
                return None;
            }
            let ci = &self.clusters[&cands[i].1];
            let ei = emb(ci, dim).unwrap_or_default();
            for j in i + 1..cands.len() {
                let cj = &self.clusters[&cands[j].1];
                let q = cosine(ei, emb(cj, dim).unwrap_or_default());
                if q < p.min_cosine {
                    continue;
                }
                // A side on which neither cluster was linked often enough says nothing
                // (every question can open or end a conversation): it is left out and the
                // score scaled back to 3. With no side left, there is no evidence at all.
                let (mut sum, mut sides) = (q, 1.0f32);
                if out[i] >= min_links || out[j] >= min_links {
                    sum += dot(&succ[i], &succ[j]);
                    sides += 1.0;
                }
                if inc[i] >= min_links || inc[j] >= min_links {
                    sum += dot(&pred[i], &pred[j]);
                    sides += 1.0;
                }
                if sides == 1.0 {
                    continue;
                }
                let score = sum / sides * 3.0;
                if score >= p.min_score.min(p.family_score) && allow(&ci.prompt, &cj.prompt) {
                    if score >= p.min_score {
                        // The more seen cluster (first in `cands`) absorbs the other.
                        pairs.push((score, cands[i].1, cands[j].1));
                    } else {
                        loose.push((cands[i].1, cands[j].1));
                    }
                }
            }
        }
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        Some((pairs.into_iter().map(|(_, a, b)| (a, b)).collect(), loose))
    }

    /// Moves cluster `b` into `a`: counts, follow-ups in both directions, nodes, and the
    /// wordings that `allow` accepts against `a`'s representative (a wording only ever
    /// vetted against `b`'s must not be served `a`'s prefetched answer unchecked).
    fn merge(&mut self, a: u64, b: u64, now_ms: u64, hl: f64, allow: &dyn Fn(&str, &str) -> bool) {
        if a == b || !self.clusters.contains_key(&a) {
            return;
        }
        let Some(gone) = self.clusters.remove(&b) else {
            return;
        };
        for c in self.clusters.values_mut() {
            if let Some(d) = c.next.remove(&b) {
                c.next
                    .entry(a)
                    .or_default()
                    .add(d.value(now_ms, hl), now_ms, hl);
            }
        }
        let Some(keep) = self.clusters.get_mut(&a) else {
            return;
        };
        keep.seen.add(gone.seen.value(now_ms, hl), now_ms, hl);
        keep.awaiting |= gone.awaiting;
        keep.touched_ms = keep.touched_ms.max(gone.touched_ms);
        for (k, d) in gone.next {
            let k = if k == b { a } else { k };
            keep.next
                .entry(k)
                .or_default()
                .add(d.value(now_ms, hl), now_ms, hl);
        }
        trim_next(&mut keep.next, now_ms, hl);
        for w in gone.wordings {
            match keep.wordings.iter_mut().find(|x| x.text == w.text) {
                Some(x) => x.used.add(w.used.value(now_ms, hl), now_ms, hl),
                None if allow(&w.text, &keep.prompt) => keep.wordings.push(w),
                // Its nodes still count here; the wording itself is not aliased.
                None => {}
            }
        }
        if keep.wordings.len() > MAX_WORDINGS {
            // The representative stays first; the most used of the rest are kept.
            let mut rest = keep.wordings.split_off(1);
            rest.sort_by(|x, y| {
                y.used
                    .value(now_ms, hl)
                    .total_cmp(&x.used.value(now_ms, hl))
            });
            rest.truncate(MAX_WORDINGS - 1);
            keep.wordings.extend(rest);
        }
        for n in self.nodes.values_mut() {
            if n.cluster == Some(b) {
                n.cluster = Some(a);
            }
        }
    }
}

/// The families the loose pairs make (joined through shared clusters): each member to the
/// smallest cluster id of its family.
fn families(loose: &[(u64, u64)]) -> HashMap<u64, u64> {
    let mut root: HashMap<u64, u64> = HashMap::new();
    fn find(root: &mut HashMap<u64, u64>, x: u64) -> u64 {
        let mut r = x;
        while let Some(&up) = root.get(&r) {
            if up == r {
                break;
            }
            r = up;
        }
        root.insert(x, r);
        r
    }
    for &(a, b) in loose {
        root.entry(a).or_insert(a);
        root.entry(b).or_insert(b);
        let (ra, rb) = (find(&mut root, a), find(&mut root, b));
        let (lo, hi) = (ra.min(rb), ra.max(rb));
        root.insert(hi, lo);
    }
    let members: Vec<u64> = root.keys().copied().collect();
    members
        .into_iter()
        .map(|m| (m, find(&mut root, m)))
        .collect()
}

/// `y += a * x` over the common length.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Scales `v` to norm 1 (a zero vector stays zero).
fn normalise(v: &mut [f32]) {
    let n = dot(v, v).sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

/// When two clusters are one question by how they are used (see [`Model::regroup`]).
#[derive(Debug, Clone, Copy)]
pub struct RegroupParams {
    /// Lowest score of a merge: the cosine of the representatives plus the cosine of the
    /// follow-up profiles plus the cosine of the predecessor profiles (at most 3).
    pub min_score: f32,
    /// Lowest cosine of the representatives: wordings that share nothing are never merged,
    /// however alike their neighbours.
    pub min_cosine: f32,
    /// Lowest (decayed) number of times each cluster was served before its profiles are
    /// trusted.
    pub min_seen: f64,
    /// Lowest score of two clusters counted as one question's family (below `min_score`:
    /// not merged, since a merge aliases the wordings to one answer, but likely one
    /// question): a prediction adds up a family's counts, and each cluster of a family that
    /// passes `min_probability` is prefetched with its own wordings. At or above
    /// `min_score`: no families.
    pub family_score: f32,
}

impl Model {
    /// The clusters of namespace `ns` (as [`Model::clusters`] gives them) as they would be
    /// after regrouping with `p` until nothing more merges; the model itself is left as it
    /// is. For tuning `regroup_score` on labelled sessions learned with regrouping off.
    pub fn regrouped_clusters(
        &self,
        ns: &str,
        p: &RegroupParams,
        now_ms: u64,
        allow: impl Fn(&str, &str) -> bool,
    ) -> Vec<Vec<String>> {
        let Some(space) = self.namespaces.get(ns) else {
            return Vec::new();
        };
        let mut trial = space.clone();
        let far = Instant::now() + std::time::Duration::from_secs(3600);
        // Each call makes at most MAX_REGROUP_PASSES passes; a namespace has at most
        // MAX_CLUSTERS clusters, so merges end.
        loop {
            let (merged, finished) = trial.regroup(p, now_ms, self.half_life_ms, far, true, &allow);
            if finished || merged == 0 {
                break;
            }
        }
        trial.cluster_wordings()
    }

    /// Merges the clusters that are one question by how they are used (see
    /// [`RegroupParams`]) in the namespaces that learned links since their last regrouping,
    /// the longest waiting first, until `budget` is spent (a namespace cut short and the
    /// rest wait for the next call); `allow(a, b)` vets each pair of representatives. Returns the number of merges.
    pub fn regroup(
        &mut self,
        p: &RegroupParams,
        now_ms: u64,
        budget: std::time::Duration,
        allow: impl Fn(&str, &str) -> bool,
    ) -> usize {
        let deadline = Instant::now() + budget;
        let hl = self.half_life_ms;
        // The longest waiting first, so a namespace that needs every round's whole budget
        // cannot starve the others.
        let mut due: Vec<(u64, String)> = self
            .namespaces
            .iter()
            .filter(|(_, s)| s.regroup_due)
            .map(|(k, s)| (s.regrouped_ms, k.clone()))
            .collect();
        due.sort_by_key(|d| d.0);
        let mut merged = 0;
        for (i, (_, ns)) in due.into_iter().enumerate() {
            // No budget, no work; otherwise the first namespace of a round always gets one
            // whole pass (see `Namespace::regroup`).
            if budget.is_zero() || (i > 0 && Instant::now() >= deadline) {
                break;
            }
            if let Some(space) = self.namespaces.get_mut(&ns) {
                let (n, finished) = space.regroup(p, now_ms, hl, deadline, i == 0, &allow);
                merged += n;
                space.regroup_due = !finished;
                space.regrouped_ms = now_ms;
            }
        }
        if merged > 0 {
            self.changed = true;
        }
        merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use super::super::same_text;
    use crate::prefetch::model::tests::params;
    use crate::prefetch::model::PredictParams;
    use reprise_cache::EntryId;

    fn unit(v: &[f32]) -> Arc<[f32]> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect::<Vec<_>>().into()
    }

    const BUDGET: std::time::Duration = std::time::Duration::from_secs(60);

    fn regroup_params() -> RegroupParams {
        RegroupParams {
            min_score: 2.35,
            min_cosine: 0.4,
            min_seen: 3.0,
            family_score: 3.0,
        }
    }

    #[test]
    fn a_family_adds_up_its_clusters_and_prefetches_each_with_its_own_wordings() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        let x = EntryId(1);
        // One question in two wordings that stay apart, each followed half the time: under a
        // probability of 0.6 neither is predicted alone.
        let p = PredictParams {
            min_probability: 0.6,
            ..params()
        };
        assert!(m.predict("ns", x, &p, 0).is_empty());
        let family = RegroupParams {
            min_score: 2.9,
            family_score: 2.35,
            ..regroup_params()
        };
        assert_eq!(m.regroup(&family, 0, BUDGET, |_, _| true), 0, "not merged");
        assert_eq!(m.clusters("ns").len(), 6);
        let mut got = m.predict("ns", x, &p, 0);
        got.sort_by(|a, b| a.prompt.cmp(&b.prompt));
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            (got[0].prompt.as_str(), got[1].prompt.as_str()),
            ("a one?", "a two?")
        );
        for g in &got {
            assert!((g.probability - 1.0).abs() < 1e-9);
            assert!(g.wordings.is_empty(), "no wording aliased across clusters");
        }
        // C looks like A1 but is used otherwise: in no family, so its follow-up counts alone.
        let c = EntryId(4);
        assert_eq!(m.predict("ns", c, &params(), 0).len(), 1);
        // Families are counted once against `max_predictions`.
        let one = PredictParams {
            max_predictions: 1,
            ..p
        };
        assert_eq!(m.predict("ns", x, &one, 0).len(), 2);
        // Saved and loaded (a restart), the family predicts as before, with no regrouping.
        let json = serde_json::to_string(&m.export(0)).unwrap();
        let mut restarted = Model::new(3600.0);
        restarted.import(&serde_json::from_str(&json).unwrap(), 0);
        let mut again = restarted.predict("ns", x, &p, 0);
        again.sort_by(|a, b| a.prompt.cmp(&b.prompt));
        let prompts: Vec<&str> = again.iter().map(|g| g.prompt.as_str()).collect();
        assert_eq!(prompts, ["a one?", "a two?"], "{again:?}");
    }

    #[test]
    fn a_predicted_family_is_prefetched_in_its_clusters_that_never_followed() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        let family = RegroupParams {
            min_score: 2.9,
            family_score: 2.35,
            ..regroup_params()
        };
        assert_eq!(m.regroup(&family, 0, BUDGET, |_, _| true), 0, "not merged");
        // W is followed three times by the first wording of A, never by the second.
        let w = EntryId(100);
        for i in 0..3 {
            m.observe("ns", w, "w?", None, 0, same_text);
            let a = EntryId(200 + i);
            m.observe("ns", a, "a one?", None, 0, same_text);
            m.link("ns", w, a, true, 0);
        }
        m.observe("ns", w, "w?", None, 0, same_text);
        // The question is predicted; its other cluster is prefetched too, after the one
        // that followed, with its own wordings only.
        let got = m.predict("ns", w, &params(), 0);
        let prompts: Vec<&str> = got.iter().map(|g| g.prompt.as_str()).collect();
        assert_eq!(prompts, ["a one?", "a two?"], "{got:?}");
        assert!(got.iter().all(|g| (g.probability - 1.0).abs() < 1e-9));
        assert!(got.iter().all(|g| g.wordings.is_empty()), "{got:?}");
        // Without the family, only the wording that followed.
        let alone = RegroupParams {
            family_score: 2.9,
            ..family
        };
        m.regroup(&alone, 0, BUDGET, |_, _| true);
        let got = m.predict("ns", w, &params(), 0);
        let prompts: Vec<&str> = got.iter().map(|g| g.prompt.as_str()).collect();
        assert_eq!(prompts, ["a one?"], "{got:?}");
    }

    /// Sessions `X? → A1 → B?` and `X? → A2 → B?` (A1, A2: one question, cosine 0.55) and
    /// `C → D?` (C: cosine 0.88 to A1, but opens conversations and leads elsewhere).
    fn regroup_fixture(m: &mut Model) {
        let e_x = unit(&[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        let e_b = unit(&[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        let e_d = unit(&[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
        let e_a1 = unit(&[0.0, 0.0, 0.0, 1.0, 0.9, 0.0]);
        let e_a2 = unit(&[0.0, 0.0, 0.0, 1.0, 0.0, 0.9]);
        let e_c = unit(&[0.0, 0.0, 0.0, 1.0, 0.5, -0.5]);
        assert!((cosine(&e_a1, &e_a2) - 0.55).abs() < 0.01);
        assert!(cosine(&e_a1, &e_c) > 0.85);
        let mut id = 0u128;
        let mut step = |m: &mut Model, prompt: &str, e: &Arc<[f32]>, prev: Option<EntryId>| {
            id += 1;
            let me = EntryId(id);
            m.observe("ns", me, prompt, Some(e), 0, same_text);
            if let Some(prev) = prev {
                m.link("ns", prev, me, true, 0);
            }
            me
        };
        for i in 0..6 {
            let (a, e_a) = if i % 2 == 0 {
                ("a one?", &e_a1)
            } else {
                ("a two?", &e_a2)
            };
            let x = step(m, "x?", &e_x, None);
            let a = step(m, a, e_a, Some(x));
            step(m, "b?", &e_b, Some(a));
            let c = step(m, "c?", &e_c, None);
            step(m, "d?", &e_d, Some(c));
        }
    }

    #[test]
    fn regroup_merges_wordings_used_alike_and_only_those() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        let x = EntryId(1);
        // Before: the two wordings are two follow-ups of x, half each.
        let before = m.predict("ns", x, &params(), 0);
        assert_eq!(before.len(), 2, "{before:?}");
        assert!((before[0].probability - 0.5).abs() < 1e-9);
        assert_eq!(m.clusters("ns").len(), 6);

        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, |_, _| true), 1);
        let clusters = m.clusters("ns");
        assert_eq!(clusters.len(), 5, "{clusters:?}");
        let mut merged = clusters
            .iter()
            .find(|c| c.len() == 2)
            .expect("a merged cluster")
            .clone();
        merged.sort();
        assert_eq!(merged, ["a one?", "a two?"]);
        // After: one follow-up asked every time, reachable in both wordings.
        let after = m.predict("ns", x, &params(), 0);
        assert_eq!(after.len(), 1, "{after:?}");
        assert!((after[0].probability - 1.0).abs() < 1e-9);
        let mut all = after[0].wordings.clone();
        all.push(after[0].prompt.clone());
        all.sort();
        assert_eq!(all, ["a one?", "a two?"]);
        // Nothing more to merge.
        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, |_, _| true), 0);
    }

    #[test]
    fn regrouped_clusters_show_the_merge_without_making_it() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        let sorted = |mut c: Vec<Vec<String>>| {
            c.iter_mut().for_each(|w| w.sort());
            c.sort();
            c
        };
        let before = sorted(m.clusters("ns"));
        let trial = sorted(m.regrouped_clusters("ns", &regroup_params(), 0, |_, _| true));
        assert_eq!(sorted(m.clusters("ns")), before, "nothing merged");
        assert_eq!(before.len(), 6);
        assert_eq!(trial.len(), 5, "{trial:?}");
        assert!(trial.contains(&vec!["a one?".to_string(), "a two?".to_string()]));
        // What `regroup` then does is what the trial showed.
        m.regroup(&regroup_params(), 0, BUDGET, |_, _| true);
        assert_eq!(sorted(m.clusters("ns")), trial);
        // A higher score merges less; a gate refusing all merges nothing.
        let mut fresh = Model::new(3600.0);
        regroup_fixture(&mut fresh);
        let strict = RegroupParams {
            min_score: 2.9,
            ..regroup_params()
        };
        assert_eq!(
            fresh
                .regrouped_clusters("ns", &strict, 0, |_, _| true)
                .len(),
            6
        );
        assert_eq!(
            fresh
                .regrouped_clusters("ns", &regroup_params(), 0, |_, _| false)
                .len(),
            6
        );
        assert!(fresh
            .regrouped_clusters("other", &regroup_params(), 0, |_, _| true)
            .is_empty());
    }

    #[test]
    fn a_merge_moves_only_the_wordings_the_gate_accepts() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        // A wording more for each (joined by a looser rule than the gate's); "a one?"
        // (the older cluster, as seen as the other) absorbs "a two?"'s.
        let joins = |a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>| {
            (a.starts_with("a two") && b == "a two?") || (a.starts_with("a one") && b == "a one?")
        };
        m.observe("ns", EntryId(500), "a two extra?", None, 0, joins);
        m.observe("ns", EntryId(501), "a one more?", None, 0, joins);
        assert_eq!(m.clusters("ns").iter().filter(|c| c.len() == 2).count(), 2);
        let gate = |a: &str, b: &str| !(a.contains("extra") || b.contains("extra"));
        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, gate), 1);
        let clusters = m.clusters("ns");
        let merged = clusters
            .iter()
            .find(|c| c.contains(&"a one?".to_string()))
            .unwrap();
        assert!(merged.contains(&"a two?".to_string()), "{clusters:?}");
        assert!(
            !merged.contains(&"a two extra?".to_string()),
            "{clusters:?}"
        );
    }

    #[test]
    fn questions_never_linked_are_never_merged() {
        let mut m = Model::new(3600.0);
        regroup_fixture(&mut m);
        // Two stand-alone questions (no follow-up, no predecessor), close enough in
        // embedding, each asked often: their profiles are alike only by saying nothing.
        let e1 = unit(&[0.0, 0.0, 0.0, 0.0, 1.0, 1.0]);
        let e2 = unit(&[0.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
        for i in 0..5u128 {
            m.observe(
                "ns",
                EntryId(100 + i),
                "alone one?",
                Some(&e1),
                0,
                same_text,
            );
            m.observe(
                "ns",
                EntryId(200 + i),
                "alone two?",
                Some(&e2),
                0,
                same_text,
            );
        }
        assert!(cosine(&e1, &e2) >= 0.4);
        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, |_, _| true), 1);
        let clusters = m.clusters("ns");
        assert_eq!(clusters.len(), 7, "{clusters:?}");
        assert!(clusters
            .iter()
            .all(|c| c.len() == 1 || c.contains(&"a one?".to_string())));
    }

    #[test]
    fn regroup_respects_the_gate_the_evidence_and_the_cosine_floor() {
        let fresh = || {
            let mut m = Model::new(3600.0);
            regroup_fixture(&mut m);
            m
        };
        assert_eq!(
            fresh().regroup(&regroup_params(), 0, BUDGET, |_, _| false),
            0
        );
        let rare = RegroupParams {
            min_seen: 4.0,
            ..regroup_params()
        };
        assert_eq!(
            fresh().regroup(&rare, 0, BUDGET, |_, _| true),
            0,
            "seen 3 times"
        );
        let far = RegroupParams {
            min_cosine: 0.6,
            ..regroup_params()
        };
        assert_eq!(
            fresh().regroup(&far, 0, BUDGET, |_, _| true),
            0,
            "cosine 0.55"
        );
        // Without new links a namespace is not looked at again; a spent budget looks at none.
        let mut m = fresh();
        assert_eq!(m.regroup(&far, 0, BUDGET, |_, _| true), 0);
        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, |_, _| true), 0);
        m.link("ns", EntryId(1), EntryId(3), true, 0);
        let none = std::time::Duration::ZERO;
        assert_eq!(m.regroup(&regroup_params(), 0, none, |_, _| true), 0);
        // A budget shorter than one pass still gets the first namespace one whole pass.
        let tiny = std::time::Duration::from_nanos(1);
        assert_eq!(m.regroup(&regroup_params(), 0, tiny, |_, _| true), 1);
        assert_eq!(m.regroup(&regroup_params(), 0, BUDGET, |_, _| true), 0);
    }
}
