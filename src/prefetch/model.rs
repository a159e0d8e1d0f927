//! The transition model: per namespace, decayed counts of which entry answered the turn that
//! followed which entry, and of which *cluster* of questions followed which.
//!
//! Every observed entry is a *node* holding the text it was matched by (its prompt), its
//! embedding, how often it was served (`seen`) and how often each other entry answered the
//! next turn (`next`). Counts decay exponentially with the configured half-life, so old habits
//! fade. The probability of a follow-up `Y` after `E` is `next[Y] / seen(E)`: the share of the
//! times `E` was served that were followed by `Y` (ending the conversation is the rest).
//!
//! # Clusters
//!
//! Users ask one question in many wordings, and the semantic tier (rightly strict) serves one
//! wording's answer for few of the others, so per-entry counts fragment: each wording, in each
//! conversation context, is an entry of its own. For *counting*, every node therefore also
//! belongs to a cluster: the first cluster whose representative (the prompt that founded it)
//! the node's prompt joins by the caller's rule (a looser similarity than serving, plus the
//! false-hit gate), or a new one. A cluster keeps its own decayed `seen` and cluster → cluster
//! follow-up counts, and the wordings observed for it (bounded, the most used kept).
//!
//! A prediction names a follow-up cluster, the wording to ask (the most used one) and the
//! cluster's other wordings, so the prefetcher can make one generated answer reachable for
//! each of them. Counts come from the node itself when it was seen often enough, else from
//! its cluster, else from nodes with a similar embedding (a brand-new question).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use reprise_cache::EntryId;
use serde::{Deserialize, Serialize};

/// Nodes kept per namespace; beyond this the least recently touched tenth is forgotten.
const MAX_NODES: usize = 20_000;
/// Clusters kept per namespace; beyond this the least recently touched tenth is forgotten.
/// Assigning a new node scans them, so this also bounds that cost.
const MAX_CLUSTERS: usize = 4096;
/// Namespaces kept; beyond this the least recently touched one is forgotten.
const MAX_NAMESPACES: usize = 1024;
/// Follow-ups kept per node and per cluster; beyond this the weakest is forgotten.
const MAX_NEXT: usize = 64;
/// Wordings kept per cluster; beyond this the least used one (never the representative)
/// makes room.
pub const MAX_WORDINGS: usize = 16;
/// Neighbours pooled for a rarely seen node.
const MAX_NEIGHBOURS: usize = 16;
/// Clusters compared by [`Model::regroup`] per namespace (the most seen); bounds its cost
/// (pairs grow with the square).
const MAX_REGROUP: usize = 512;
/// Merge passes of one [`Model::regroup`] (each pass merges disjoint pairs, then the
/// profiles are computed again).
const MAX_REGROUP_PASSES: usize = 16;
/// Version of the exported snapshot; imports read this one and the previous one (which has
/// no clusters: each imported node then founds or joins one by its exact prompt).
pub const SNAPSHOT_VERSION: u32 = 2;

/// A count that halves every half-life.
#[derive(Debug, Clone, Copy, Default)]
struct Decayed {
    value: f64,
    at_ms: u64,
}

impl Decayed {
    fn value(&self, now_ms: u64, half_life_ms: f64) -> f64 {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.value * (-dt / half_life_ms).exp2()
    }

    fn add(&mut self, x: f64, now_ms: u64, half_life_ms: f64) {
        self.value = self.value(now_ms, half_life_ms) + x;
        self.at_ms = now_ms.max(self.at_ms);
    }

    fn at(value: f64, at_ms: u64) -> Decayed {
        Decayed { value, at_ms }
    }
}

/// One entry as the model knows it.
#[derive(Debug, Clone, Default)]
struct Node {
    prompt: String,
    embedding: Option<Arc<[f32]>>,
    seen: Decayed,
    next: HashMap<EntryId, Decayed>,
    touched_ms: u64,
    /// The cluster its prompt belongs to (assigned on first observation).
    cluster: Option<u64>,
}

/// One observed wording of a cluster.
#[derive(Debug, Clone)]
struct Wording {
    text: String,
    used: Decayed,
}

/// Questions counted as one: a representative and the wordings that joined it.
#[derive(Debug, Clone, Default)]
struct Cluster {
    /// The prompt that founded the cluster; joining is decided against it alone, so a chain
    /// of near neighbours cannot drift into another question.
    prompt: String,
    embedding: Option<Arc<[f32]>>,
    /// Observed wordings, the representative first.
    wordings: Vec<Wording>,
    seen: Decayed,
    next: HashMap<u64, Decayed>,
    touched_ms: u64,
}

/// Whether prompt `a` (with its embedding) may be counted as the same question as a
/// cluster's representative `b`.
type JoinRule<'a> = dyn Fn(&str, Option<&[f32]>, &str, Option<&[f32]>) -> bool + 'a;

/// One namespace's nodes and clusters, and how its follow-ups arrive (multi-turn history or
/// single-turn prompts linked by a session id).
#[derive(Debug, Default)]
struct Namespace {
    nodes: HashMap<EntryId, Node>,
    clusters: HashMap<u64, Cluster>,
    next_cluster: u64,
    multi: Decayed,
    single: Decayed,
    touched_ms: u64,
    /// Links were learned since the last regrouping, or it was cut short.
    regroup_due: bool,
    /// When it was last regrouped.
    regrouped_ms: u64,
}

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
            if best.is_none_or(|(s, _)| score > s) {
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
    fn cluster_of(&mut self, id: EntryId, now_ms: u64, join: &JoinRule) -> Option<u64> {
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
            let Some(pairs) = self.merge_candidates(p, now_ms, hl, pass_deadline, allow) else {
                return (merged, false);
            };
            if pairs.is_empty() {
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

    /// Pairs of clusters worth merging, best first (see [`Namespace::regroup`]); `None`
    /// when `deadline` passed before all pairs were compared.
    fn merge_candidates(
        &self,
        p: &RegroupParams,
        now_ms: u64,
        hl: f64,
        deadline: Instant,
        allow: &dyn Fn(&str, &str) -> bool,
    ) -> Option<Vec<(u64, u64)>> {
        let Some(dim) = self
            .clusters
            .values()
            .find_map(|c| c.embedding.as_ref().map(|e| e.len()))
        else {
            return Some(Vec::new());
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
            return Some(Vec::new());
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
        for (from_id, from) in &self.clusters {
            let from_idx = index.get(from_id).copied();
            let from_emb = emb(from, dim);
            for (to_id, count) in &from.next {
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
                if score >= p.min_score && allow(&ci.prompt, &cj.prompt) {
                    // The more seen cluster (first in `cands`) absorbs the other.
                    pairs.push((score, cands[i].1, cands[j].1));
                }
            }
        }
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0));
        Some(pairs.into_iter().map(|(_, a, b)| (a, b)).collect())
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

/// `y += a * x` over the common length.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Scales `v` to norm 1 (a zero vector stays zero).
fn normalise(v: &mut [f32]) {
    let n = dot(v, v).sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
}

/// Thresholds of a prediction.
#[derive(Debug, Clone, Copy)]
pub struct PredictParams {
    /// Lowest probability kept.
    pub min_probability: f64,
    /// Most predictions returned.
    pub max_predictions: usize,
    /// Lowest decayed count of observations a prediction rests on.
    pub min_observations: f64,
    /// Lowest cosine similarity of a neighbour whose counts a rarely seen node borrows.
    pub similar_threshold: f32,
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
    /// The cluster's other observed wordings, most used first (at most [`MAX_WORDINGS`]).
    pub wordings: Vec<String>,
    /// Estimated probability that the next turn asks it (in any of its wordings).
    pub probability: f64,
    /// Whether the counts were borrowed (from the cluster or from similar entries).
    pub borrowed: bool,
}

/// The transition counts of every namespace.
#[derive(Debug)]
pub struct Model {
    half_life_ms: f64,
    namespaces: HashMap<String, Namespace>,
    changed: bool,
}

/// Two prompts are one question by exact text only (the join rule when nothing better is
/// known, e.g. for imported nodes of an older snapshot).
fn same_text(a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>) -> bool {
    a == b
}

/// Cosine similarity (vectors are L2-normalised by the embedder; normalised again here so
/// imported or foreign vectors cannot skew it).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() || a.is_empty() {
        return 0.0;
    }
    let (mut dot, mut na, mut nb) = (0.0f32, 0.0f32, 0.0f32);
    for (x, y) in a.iter().zip(b) {
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    dot / (na.sqrt() * nb.sqrt())
}

impl Model {
    /// An empty model whose counts halve every `half_life_secs`.
    pub fn new(half_life_secs: f64) -> Model {
        Model {
            half_life_ms: (half_life_secs * 1000.0).max(1.0),
            namespaces: HashMap::new(),
            changed: false,
        }
    }

    /// Whether anything changed since the last [`Model::take_changed`].
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    fn namespace(&mut self, ns: &str, now_ms: u64) -> &mut Namespace {
        if !self.namespaces.contains_key(ns) && self.namespaces.len() >= MAX_NAMESPACES {
            if let Some(oldest) = self
                .namespaces
                .iter()
                .min_by_key(|(_, n)| n.touched_ms)
                .map(|(k, _)| k.clone())
            {
                self.namespaces.remove(&oldest);
            }
        }
        let n = self.namespaces.entry(ns.to_string()).or_default();
        n.touched_ms = now_ms;
        n
    }

    /// Records that `id` was served (creating its node with its prompt and embedding, and
    /// placing it in a cluster: `join(a, ea, b, eb)` says whether prompt `a` may be counted
    /// as the same question as a cluster's representative `b`).
    pub fn observe(
        &mut self,
        ns: &str,
        id: EntryId,
        prompt: &str,
        embedding: Option<&Arc<[f32]>>,
        now_ms: u64,
        join: impl Fn(&str, Option<&[f32]>, &str, Option<&[f32]>) -> bool,
    ) {
        let hl = self.half_life_ms;
        let space = self.namespace(ns, now_ms);
        let node = space.nodes.entry(id).or_default();
        if node.prompt.is_empty() {
            node.prompt = prompt.to_string();
        }
        if node.embedding.is_none() {
            node.embedding = embedding.cloned();
        }
        node.seen.add(1.0, now_ms, hl);
        node.touched_ms = now_ms;
        let text = node.prompt.clone();
        if let Some(cid) = space.cluster_of(id, now_ms, &join) {
            if let Some(c) = space.clusters.get_mut(&cid) {
                c.seen.add(1.0, now_ms, hl);
                c.touched_ms = now_ms;
                note_wording(c, &text, now_ms, hl);
            }
        }
        if space.nodes.len() > MAX_NODES {
            forget_oldest(&mut space.nodes, MAX_NODES / 10);
        }
        self.changed = true;
    }

    /// Records that `next` answered the turn after `prev`; `multi`: the follow-up carried the
    /// conversation history (otherwise it was linked by its session id).
    pub fn link(&mut self, ns: &str, prev: EntryId, next: EntryId, multi: bool, now_ms: u64) {
        if prev == next {
            return;
        }
        let hl = self.half_life_ms;
        let space = self.namespace(ns, now_ms);
        space.regroup_due = true;
        if multi {
            space.multi.add(1.0, now_ms, hl);
        } else {
            space.single.add(1.0, now_ms, hl);
        }
        let node = space.nodes.entry(prev).or_default();
        node.touched_ms = now_ms;
        node.next.entry(next).or_default().add(1.0, now_ms, hl);
        trim_next(&mut node.next, now_ms, hl);
        // Cluster counts: both ends were observed before they are linked, so both normally
        // have a cluster; a node observed only through an old snapshot may lack one.
        let from = space.cluster_of(prev, now_ms, &same_text);
        let to = space.cluster_of(next, now_ms, &same_text);
        if let (Some(from), Some(to)) = (from, to) {
            if let Some(c) = space.clusters.get_mut(&from) {
                c.touched_ms = now_ms;
                c.next.entry(to).or_default().add(1.0, now_ms, hl);
                trim_next(&mut c.next, now_ms, hl);
            }
        }
        self.changed = true;
    }

    /// Whether follow-ups in `ns` mostly carry their history (`Some(true)`), mostly arrive as
    /// single-turn prompts of a session (`Some(false)`), or nothing is known yet.
    pub fn prefers_multi(&self, ns: &str, now_ms: u64) -> Option<bool> {
        let space = self.namespaces.get(ns)?;
        let m = space.multi.value(now_ms, self.half_life_ms);
        let s = space.single.value(now_ms, self.half_life_ms);
        if m == 0.0 && s == 0.0 {
            return None;
        }
        Some(m >= s)
    }

    /// Ranks the follow-up clusters of `id`. The counts come from the node itself when it
    /// was seen at least `min_observations` times (its own context says most), else from its
    /// cluster (every wording of the question, in every context), else from the nodes with a
    /// similar embedding.
    pub fn predict(
        &self,
        ns: &str,
        id: EntryId,
        p: &PredictParams,
        now_ms: u64,
    ) -> Vec<Prediction> {
        let hl = self.half_life_ms;
        let Some(space) = self.namespaces.get(ns) else {
            return Vec::new();
        };
        let Some(node) = space.nodes.get(&id) else {
            return Vec::new();
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
        let own = node.seen.value(now_ms, hl);
        let cluster_seen = own_cluster
            .and_then(|c| space.clusters.get(&c))
            .map_or(0.0, |c| c.seen.value(now_ms, hl));
        let (total, borrowed) = if own >= p.min_observations {
            add_nodes(&[node], &mut counts);
            (own, false)
        } else if cluster_seen >= p.min_observations {
            let c = &space.clusters[&own_cluster.unwrap_or_default()];
            for (target, count) in &c.next {
                if space.clusters.contains_key(target) && Some(*target) != own_cluster {
                    // The representative entry is unknown at cluster level: the best node
                    // target is looked up below when needed.
                    counts.insert(*target, (count.value(now_ms, hl), id, 0.0));
                }
            }
            (cluster_seen, true)
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
            let total: f64 = sources.iter().map(|n| n.seen.value(now_ms, hl)).sum();
            add_nodes(&sources, &mut counts);
            (total, true)
        };
        if total < p.min_observations || total <= 0.0 {
            return Vec::new();
        }
        let mut out: Vec<Prediction> = counts
            .into_iter()
            .filter_map(|(cid, (count, target, _))| {
                let probability = (count / total).min(1.0);
                if probability < p.min_probability {
                    return None;
                }
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
                Some(Prediction {
                    target,
                    cluster: cid,
                    wordings: words.iter().skip(1).map(|w| w.1.to_string()).collect(),
                    prompt,
                    probability,
                    borrowed,
                })
            })
            .collect();
        out.sort_by(|a, b| b.probability.total_cmp(&a.probability));
        out.truncate(p.max_predictions);
        out
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

    /// Moves everything known about `old` to `new` (a refreshed entry replaces its
    /// predecessor), in both directions. Cluster counts are about questions, not entries, and
    /// stay as they are.
    pub fn rename(&mut self, ns: &str, old: EntryId, new: EntryId) {
        let hl = self.half_life_ms;
        let Some(space) = self.namespaces.get_mut(ns) else {
            return;
        };
        if let Some(node) = space.nodes.remove(&old) {
            match space.nodes.get_mut(&new) {
                Some(n) => {
                    let now = node.touched_ms.max(n.touched_ms);
                    n.seen.add(node.seen.value(now, hl), now, hl);
                    n.cluster = n.cluster.or(node.cluster);
                    for (k, d) in node.next {
                        n.next.entry(k).or_default().add(d.value(now, hl), now, hl);
                    }
                }
                None => {
                    space.nodes.insert(new, node);
                }
            }
        }
        for n in space.nodes.values_mut() {
            if let Some(d) = n.next.remove(&old) {
                let now = d.at_ms;
                n.next
                    .entry(new)
                    .or_default()
                    .add(d.value(now, hl), now, hl);
            }
        }
        self.changed = true;
    }

    /// The clusters of `ns`, each as its wordings (the representative first), for
    /// diagnostics: a cluster mixing two questions is a false hit waiting to happen.
    pub fn clusters(&self, ns: &str) -> Vec<Vec<String>> {
        self.namespaces.get(ns).map_or_else(Vec::new, |space| {
            space
                .clusters
                .values()
                .map(|c| c.wordings.iter().map(|w| w.text.clone()).collect())
                .collect()
        })
    }

    /// Every count, for persistence.
    pub fn export(&self, now_ms: u64) -> Snapshot {
        let hl = self.half_life_ms;
        let namespaces = self
            .namespaces
            .iter()
            .map(|(name, space)| NamespaceSnapshot {
                name: name.clone(),
                multi: space.multi.value(now_ms, hl),
                single: space.single.value(now_ms, hl),
                nodes: space
                    .nodes
                    .iter()
                    .map(|(id, n)| NodeSnapshot {
                        id: id.to_string(),
                        prompt: n.prompt.clone(),
                        embedding: n.embedding.as_ref().map(|e| e.to_vec()),
                        seen: n.seen.value(now_ms, hl),
                        next: n
                            .next
                            .iter()
                            .map(|(k, d)| (k.to_string(), d.value(now_ms, hl)))
                            .collect(),
                        cluster: n.cluster.filter(|c| space.clusters.contains_key(c)),
                    })
                    .collect(),
                clusters: space
                    .clusters
                    .iter()
                    .map(|(id, c)| ClusterSnapshot {
                        id: *id,
                        prompt: c.prompt.clone(),
                        embedding: c.embedding.as_ref().map(|e| e.to_vec()),
                        wordings: c
                            .wordings
                            .iter()
                            .map(|w| (w.text.clone(), w.used.value(now_ms, hl)))
                            .collect(),
                        seen: c.seen.value(now_ms, hl),
                        next: c
                            .next
                            .iter()
                            .map(|(k, d)| (*k, d.value(now_ms, hl)))
                            .collect(),
                    })
                    .collect(),
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            saved_ms: now_ms,
            namespaces,
        }
    }

    /// Adds a snapshot's counts to the model (decayed from when it was saved). Returns the
    /// number of nodes read; a snapshot of an unknown version is ignored.
    pub fn import(&mut self, snap: &Snapshot, now_ms: u64) -> usize {
        if snap.version != SNAPSHOT_VERSION && snap.version != 1 {
            return 0;
        }
        let hl = self.half_life_ms;
        let at = snap.saved_ms.min(now_ms);
        let decay = |v: f64| Decayed::at(v, at).value(now_ms, hl);
        let mut read = 0;
        for ns in &snap.namespaces {
            let space = self.namespace(&ns.name, now_ms);
            space.regroup_due = true;
            space.multi.add(decay(ns.multi), now_ms, hl);
            space.single.add(decay(ns.single), now_ms, hl);
            // Saved cluster ids → ids here (a merged import must not collide with ours).
            let mut ids: HashMap<u64, u64> = HashMap::new();
            for c in &ns.clusters {
                let id = space.next_cluster;
                space.next_cluster += 1;
                ids.insert(c.id, id);
                space.clusters.insert(
                    id,
                    Cluster {
                        prompt: c.prompt.clone(),
                        embedding: c.embedding.as_ref().map(|e| Arc::from(e.as_slice())),
                        wordings: c
                            .wordings
                            .iter()
                            .take(MAX_WORDINGS)
                            .map(|(t, v)| Wording {
                                text: t.clone(),
                                used: Decayed::at(decay(*v), now_ms),
                            })
                            .collect(),
                        seen: Decayed::at(decay(c.seen), now_ms),
                        next: HashMap::new(),
                        touched_ms: at,
                    },
                );
            }
            for c in &ns.clusters {
                let Some(cl) = space.clusters.get_mut(&ids[&c.id]) else {
                    continue;
                };
                for (k, v) in &c.next {
                    if let Some(k) = ids.get(k) {
                        cl.next.entry(*k).or_default().add(decay(*v), now_ms, hl);
                    }
                }
            }
            for n in &ns.nodes {
                let Ok(id) = n.id.parse::<EntryId>() else {
                    continue;
                };
                let node = space.nodes.entry(id).or_default();
                if node.prompt.is_empty() {
                    node.prompt = n.prompt.clone();
                }
                if node.embedding.is_none() {
                    node.embedding = n.embedding.as_ref().map(|e| Arc::from(e.as_slice()));
                }
                if node.cluster.is_none() {
                    node.cluster = n.cluster.and_then(|c| ids.get(&c).copied());
                }
                node.seen.add(decay(n.seen), now_ms, hl);
                node.touched_ms = node.touched_ms.max(at);
                for (k, v) in &n.next {
                    if let Ok(k) = k.parse::<EntryId>() {
                        node.next.entry(k).or_default().add(decay(*v), now_ms, hl);
                    }
                }
                read += 1;
            }
            // Nodes of an older snapshot have no cluster: found or join one by exact text.
            let orphans: Vec<EntryId> = space
                .nodes
                .iter()
                .filter(|(_, n)| n.cluster.is_none())
                .map(|(k, _)| *k)
                .collect();
            for id in orphans {
                space.cluster_of(id, now_ms, &same_text);
            }
            if space.nodes.len() > MAX_NODES {
                let excess = space.nodes.len() - MAX_NODES;
                forget_oldest(&mut space.nodes, excess);
            }
            if space.clusters.len() > MAX_CLUSTERS {
                let excess = space.clusters.len() - MAX_CLUSTERS;
                forget_oldest_clusters(&mut space.clusters, excess);
            }
        }
        self.changed = true;
        read
    }
}

/// Counts one more use of `text` for a cluster, keeping at most [`MAX_WORDINGS`].
fn note_wording(c: &mut Cluster, text: &str, now_ms: u64, hl: f64) {
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

/// Forgets the weakest follow-up beyond [`MAX_NEXT`].
fn trim_next<K: Copy + Eq + std::hash::Hash>(next: &mut HashMap<K, Decayed>, now_ms: u64, hl: f64) {
    if next.len() <= MAX_NEXT {
        return;
    }
    if let Some(weakest) = next
        .iter()
        .map(|(k, d)| (*k, d.value(now_ms, hl)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(k, _)| k)
    {
        next.remove(&weakest);
    }
}

/// Drops the `n` least recently touched nodes.
fn forget_oldest(nodes: &mut HashMap<EntryId, Node>, n: usize) {
    let mut ages: Vec<(u64, EntryId)> = nodes.iter().map(|(k, v)| (v.touched_ms, *k)).collect();
    ages.sort_unstable();
    for (_, k) in ages.into_iter().take(n.max(1)) {
        nodes.remove(&k);
    }
}

/// Drops the `n` least recently touched clusters (their nodes are reassigned when next seen).
fn forget_oldest_clusters(clusters: &mut HashMap<u64, Cluster>, n: usize) {
    let mut ages: Vec<(u64, u64)> = clusters.iter().map(|(k, v)| (v.touched_ms, *k)).collect();
    ages.sort_unstable();
    for (_, k) in ages.into_iter().take(n.max(1)) {
        clusters.remove(&k);
    }
}

/// The model as saved: counts are decayed to `saved_ms`; ids are 32 hex digits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Format version ([`SNAPSHOT_VERSION`]).
    pub version: u32,
    /// When the counts were taken, milliseconds since the Unix epoch.
    pub saved_ms: u64,
    /// Every namespace.
    pub namespaces: Vec<NamespaceSnapshot>,
}

/// One namespace of a [`Snapshot`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NamespaceSnapshot {
    /// Namespace name.
    pub name: String,
    /// Follow-ups that carried their history.
    pub multi: f64,
    /// Follow-ups linked by session id.
    pub single: f64,
    /// Every node.
    pub nodes: Vec<NodeSnapshot>,
    /// Every cluster (absent from version 1).
    #[serde(default)]
    pub clusters: Vec<ClusterSnapshot>,
}

/// One node of a [`NamespaceSnapshot`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeSnapshot {
    /// Entry id.
    pub id: String,
    /// The text the entry was matched by.
    pub prompt: String,
    /// Its embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
    /// Times served.
    pub seen: f64,
    /// Follow-ups: entry id and count.
    pub next: Vec<(String, f64)>,
    /// Its cluster (an id of this snapshot's [`ClusterSnapshot`]s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<u64>,
}

/// One cluster of a [`NamespaceSnapshot`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterSnapshot {
    /// Id within the snapshot.
    pub id: u64,
    /// The representative prompt.
    pub prompt: String,
    /// Its embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
    /// Observed wordings and their use counts, the representative first.
    pub wordings: Vec<(String, f64)>,
    /// Times a member was served.
    pub seen: f64,
    /// Follow-up clusters (ids of this snapshot) and counts.
    pub next: Vec<(u64, f64)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> PredictParams {
        PredictParams {
            min_probability: 0.2,
            max_predictions: 3,
            min_observations: 2.0,
            similar_threshold: 0.8,
        }
    }

    /// Joins prompts that share their first word (a stand-in for "similar and gate passes").
    fn first_word(a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>) -> bool {
        a.split(' ').next() == b.split(' ').next()
    }

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
    fn counts_decay_with_half_life() {
        let mut d = Decayed::default();
        d.add(8.0, 0, 1000.0);
        assert!((d.value(1000, 1000.0) - 4.0).abs() < 1e-9);
        assert!((d.value(3000, 1000.0) - 1.0).abs() < 1e-9);
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
        // 3 follow-ups over 4 sightings of the cluster.
        assert!((p[0].probability - 0.75).abs() < 1e-9, "{p:?}");
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
        }
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

    #[test]
    fn snapshot_round_trip_and_rename() {
        let mut m = Model::new(3600.0);
        let (x, y, y2) = (EntryId(1), EntryId(2), EntryId(5));
        for _ in 0..2 {
            m.observe("ns", x, "x?", None, 0, same_text);
            m.observe("ns", y, "y?", None, 0, same_text);
            m.link("ns", x, y, false, 0);
        }
        let json = serde_json::to_string(&m.export(0)).unwrap();
        let snap: Snapshot = serde_json::from_str(&json).unwrap();
        let mut m2 = Model::new(3600.0);
        assert_eq!(m2.import(&snap, 0), 2);
        let p = m2.predict("ns", x, &params(), 0);
        assert_eq!(p[0].target, y);
        // A fresh entry of x's question predicts from the imported cluster counts.
        m2.observe("ns", EntryId(7), "x?", None, 0, same_text);
        assert_eq!(m2.predict("ns", EntryId(7), &params(), 0)[0].prompt, "y?");
        m2.rename("ns", y, y2);
        let p = m2.predict("ns", x, &params(), 0);
        assert_eq!(p[0].target, y2);
        assert_eq!(m2.prefers_multi("ns", 0), Some(false));
        // A version-1 snapshot (no clusters) still imports.
        let mut old = snap.clone();
        old.version = 1;
        for ns in &mut old.namespaces {
            ns.clusters.clear();
            for n in &mut ns.nodes {
                n.cluster = None;
            }
        }
        let mut m3 = Model::new(3600.0);
        assert_eq!(m3.import(&old, 0), 2);
        assert_eq!(m3.predict("ns", x, &params(), 0)[0].target, y);
    }
}
