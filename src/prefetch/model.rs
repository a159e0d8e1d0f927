//! The transition model: per namespace, decayed counts of which entry answered the turn that
//! followed which entry.
//!
//! Every observed entry is a *node* holding the text it was matched by (its prompt), its
//! embedding, how often it was served (`seen`) and how often each other entry answered the
//! next turn (`next`). Counts decay exponentially with the configured half-life, so old habits
//! fade. The probability of a follow-up `Y` after `E` is `next[Y] / seen(E)`: the share of the
//! times `E` was served that were followed by `Y` (ending the conversation is the rest).
//!
//! A node seen too rarely borrows the counts of its nearest neighbours by embedding, so a
//! brand-new answer (the same question in a new conversation context, or after its entry
//! expired) still gets predictions. Follow-ups pooled from several nodes are merged when they
//! are the same question (same entry, same text, or what the semantic tier would serve one
//! for the other), so their counts add up instead of splitting.

use std::collections::HashMap;
use std::sync::Arc;

use reprise_cache::EntryId;
use serde::{Deserialize, Serialize};

/// Nodes kept per namespace; beyond this the least recently touched tenth is forgotten.
const MAX_NODES: usize = 20_000;
/// Namespaces kept; beyond this the least recently touched one is forgotten.
const MAX_NAMESPACES: usize = 1024;
/// Follow-ups kept per node; beyond this the weakest is forgotten.
const MAX_NEXT: usize = 64;
/// Neighbours pooled for a rarely seen node.
const MAX_NEIGHBOURS: usize = 16;
/// Version of the exported snapshot; imports skip any other.
pub const SNAPSHOT_VERSION: u32 = 1;

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
}

/// One entry as the model knows it.
#[derive(Debug, Clone, Default)]
struct Node {
    prompt: String,
    embedding: Option<Arc<[f32]>>,
    seen: Decayed,
    next: HashMap<EntryId, Decayed>,
    touched_ms: u64,
}

/// One namespace's nodes, and how its follow-ups arrive (multi-turn history or single-turn
/// prompts linked by a session id).
#[derive(Debug, Default)]
struct Namespace {
    nodes: HashMap<EntryId, Node>,
    multi: Decayed,
    single: Decayed,
    touched_ms: u64,
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

/// A predicted follow-up.
#[derive(Debug, Clone)]
pub struct Prediction {
    /// The entry that answered this follow-up before.
    pub target: EntryId,
    /// Its prompt text: what to ask.
    pub prompt: String,
    /// Estimated probability that the next turn asks it.
    pub probability: f64,
    /// Whether the counts were borrowed from similar entries.
    pub borrowed: bool,
}

/// What one node carries into a pooled prediction.
struct Candidate<'a> {
    target: EntryId,
    prompt: &'a str,
    embedding: Option<&'a [f32]>,
    count: f64,
    members: Vec<EntryId>,
}

/// The transition counts of every namespace.
#[derive(Debug)]
pub struct Model {
    half_life_ms: f64,
    namespaces: HashMap<String, Namespace>,
    changed: bool,
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

    /// Number of nodes over every namespace.
    pub fn node_count(&self) -> usize {
        self.namespaces.values().map(|n| n.nodes.len()).sum()
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

    /// Records that `id` was served (creating its node with its prompt and embedding).
    pub fn observe(
        &mut self,
        ns: &str,
        id: EntryId,
        prompt: &str,
        embedding: Option<&Arc<[f32]>>,
        now_ms: u64,
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
        if multi {
            space.multi.add(1.0, now_ms, hl);
        } else {
            space.single.add(1.0, now_ms, hl);
        }
        let node = space.nodes.entry(prev).or_default();
        node.touched_ms = now_ms;
        node.next.entry(next).or_default().add(1.0, now_ms, hl);
        if node.next.len() > MAX_NEXT {
            if let Some(weakest) = node
                .next
                .iter()
                .map(|(k, d)| (*k, d.value(now_ms, hl)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(k, _)| k)
            {
                node.next.remove(&weakest);
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

    /// Ranks the follow-ups of `id`. `same(a, b)` says whether two prompts are one question
    /// (used to merge follow-ups pooled from several nodes).
    pub fn predict(
        &self,
        ns: &str,
        id: EntryId,
        p: &PredictParams,
        now_ms: u64,
        same: impl Fn(&str, Option<&[f32]>, &str, Option<&[f32]>) -> bool,
    ) -> Vec<Prediction> {
        let hl = self.half_life_ms;
        let Some(space) = self.namespaces.get(ns) else {
            return Vec::new();
        };
        let Some(node) = space.nodes.get(&id) else {
            return Vec::new();
        };
        let mut sources: Vec<&Node> = vec![node];
        let own = node.seen.value(now_ms, hl);
        let borrowed = own < p.min_observations;
        if borrowed {
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
        }
        let total: f64 = sources.iter().map(|n| n.seen.value(now_ms, hl)).sum();
        if total < p.min_observations || total <= 0.0 {
            return Vec::new();
        }
        let mut pooled: Vec<Candidate<'_>> = Vec::new();
        for src in &sources {
            for (target, count) in &src.next {
                if *target == id {
                    continue;
                }
                // A target forgotten since (or never seen served) has no prompt to ask.
                let Some(t) = space.nodes.get(target).filter(|t| !t.prompt.is_empty()) else {
                    continue;
                };
                let count = count.value(now_ms, hl);
                let temb = t.embedding.as_deref();
                match pooled.iter_mut().find(|c| {
                    c.members.contains(target) || same(c.prompt, c.embedding, &t.prompt, temb)
                }) {
                    Some(c) => {
                        c.count += count;
                        c.members.push(*target);
                    }
                    None => pooled.push(Candidate {
                        target: *target,
                        prompt: &t.prompt,
                        embedding: temb,
                        count,
                        members: vec![*target],
                    }),
                }
            }
        }
        let mut out: Vec<Prediction> = pooled
            .into_iter()
            .map(|c| Prediction {
                target: c.target,
                prompt: c.prompt.to_string(),
                probability: (c.count / total).min(1.0),
                borrowed,
            })
            .filter(|pr| pr.probability >= p.min_probability)
            .collect();
        out.sort_by(|a, b| b.probability.total_cmp(&a.probability));
        out.truncate(p.max_predictions);
        out
    }

    /// Moves everything known about `old` to `new` (a refreshed entry replaces its
    /// predecessor), in both directions.
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
    /// number of nodes read; a snapshot of another version is ignored.
    pub fn import(&mut self, snap: &Snapshot, now_ms: u64) -> usize {
        if snap.version != SNAPSHOT_VERSION {
            return 0;
        }
        let hl = self.half_life_ms;
        let at = snap.saved_ms.min(now_ms);
        let mut read = 0;
        for ns in &snap.namespaces {
            let space = self.namespace(&ns.name, now_ms);
            space.multi.add(
                Decayed {
                    value: ns.multi,
                    at_ms: at,
                }
                .value(now_ms, hl),
                now_ms,
                hl,
            );
            space.single.add(
                Decayed {
                    value: ns.single,
                    at_ms: at,
                }
                .value(now_ms, hl),
                now_ms,
                hl,
            );
            for n in &ns.nodes {
                let Ok(id) = n.id.parse::<EntryId>() else {
                    continue;
                };
                let decay = |v: f64| {
                    Decayed {
                        value: v,
                        at_ms: at,
                    }
                    .value(now_ms, hl)
                };
                let node = space.nodes.entry(id).or_default();
                if node.prompt.is_empty() {
                    node.prompt = n.prompt.clone();
                }
                if node.embedding.is_none() {
                    node.embedding = n.embedding.as_ref().map(|e| Arc::from(e.as_slice()));
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
            if space.nodes.len() > MAX_NODES {
                let excess = space.nodes.len() - MAX_NODES;
                forget_oldest(&mut space.nodes, excess);
            }
        }
        self.changed = true;
        read
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

    fn same_text(a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>) -> bool {
        a == b
    }

    #[test]
    fn counts_become_probabilities() {
        let mut m = Model::new(3600.0);
        let (x, y, z) = (EntryId(1), EntryId(2), EntryId(3));
        for i in 0..4 {
            m.observe("ns", x, "x?", None, 1000);
            let next = if i < 3 { y } else { z };
            m.observe("ns", next, if i < 3 { "y?" } else { "z?" }, None, 1000);
            m.link("ns", x, next, true, 1000);
        }
        let p = m.predict("ns", x, &params(), 1000, same_text);
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].target, y);
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
            m.observe("ns", x, "x?", Some(&e1), 0);
            m.observe("ns", y, "y?", None, 0);
            m.link("ns", x, y, true, 0);
        }
        m.observe("ns", x2, "x again?", Some(&e2), 0);
        m.observe("ns", w, "w?", Some(&far), 0);
        let p = m.predict("ns", x2, &params(), 0, same_text);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].prompt, "y?");
        assert!(p[0].borrowed);
        assert!(m.predict("ns", w, &params(), 0, same_text).is_empty());
    }

    #[test]
    fn snapshot_round_trip_and_rename() {
        let mut m = Model::new(3600.0);
        let (x, y, y2) = (EntryId(1), EntryId(2), EntryId(5));
        for _ in 0..2 {
            m.observe("ns", x, "x?", None, 0);
            m.observe("ns", y, "y?", None, 0);
            m.link("ns", x, y, false, 0);
        }
        let json = serde_json::to_string(&m.export(0)).unwrap();
        let snap: Snapshot = serde_json::from_str(&json).unwrap();
        let mut m2 = Model::new(3600.0);
        assert_eq!(m2.import(&snap, 0), 2);
        let p = m2.predict("ns", x, &params(), 0, same_text);
        assert_eq!(p[0].target, y);
        m2.rename("ns", y, y2);
        let p = m2.predict("ns", x, &params(), 0, same_text);
        assert_eq!(p[0].target, y2);
        assert_eq!(m2.prefers_multi("ns", 0), Some(false));
    }
}
