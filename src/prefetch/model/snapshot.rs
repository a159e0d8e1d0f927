//! Persistence: the model exported as a [`Snapshot`] (counts decayed to when it was taken)
//! and imported again, added to what was learned meanwhile.

use std::collections::HashMap;
use std::sync::Arc;

use reprise_cache::EntryId;
use serde::{Deserialize, Serialize};

use super::clusters::forget_oldest_clusters;
use super::{forget_oldest, same_text, Cluster, Decayed, Model, Wording};
use super::{MAX_CLUSTERS, MAX_NODES, MAX_WORDINGS};

/// Version of the exported snapshot; imports read this one and the previous one (which has
/// no clusters: each imported node then founds or joins one by its exact prompt).
pub const SNAPSHOT_VERSION: u32 = 2;

impl Model {
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
                families: saved_families(&space.families, |c| space.clusters.contains_key(&c)),
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            saved_ms: now_ms,
            embedder: None,
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
                        // Restored counts are of conversations that went on or ended.
                        awaiting: false,
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
            // A saved family joins only clusters imported now (what was learned here keeps
            // its own until the next regrouping replaces them all).
            for (c, f) in &ns.families {
                if let (Some(c), Some(f)) = (ids.get(c), ids.get(f)) {
                    space.families.insert(*c, *f);
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
        // Measured against the budget at once (a saved model may be larger).
        self.grew(usize::MAX);
        read
    }
}

/// The families as saved: each family's clusters still held (`held`), each to the smallest
/// of them (a family whose first cluster was forgotten keeps its other members together);
/// a family left with one cluster is none.
fn saved_families(families: &HashMap<u64, u64>, held: impl Fn(u64) -> bool) -> Vec<(u64, u64)> {
    let mut members: HashMap<u64, Vec<u64>> = HashMap::new();
    for (&c, &f) in families {
        if held(c) {
            members.entry(f).or_default().push(c);
        }
    }
    let mut out = Vec::new();
    for (_, mut m) in members {
        if m.len() < 2 {
            continue;
        }
        m.sort_unstable();
        out.extend(m.iter().map(|&c| (c, m[0])));
    }
    out.sort_unstable();
    out
}

/// The model as saved: counts are decayed to `saved_ms`; ids are 32 hex digits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Snapshot {
    /// Format version ([`SNAPSHOT_VERSION`]).
    pub version: u32,
    /// When the counts were taken, milliseconds since the Unix epoch.
    pub saved_ms: u64,
    /// The fingerprint (hex) of the embedder that made its vectors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedder: Option<String>,
    /// Every namespace.
    pub namespaces: Vec<NamespaceSnapshot>,
}

impl Snapshot {
    /// Drops every vector, keeping the counts: the questions join clusters again by their
    /// exact wording until new vectors are learned.
    pub fn forget_vectors(&mut self) {
        for ns in &mut self.namespaces {
            for n in &mut ns.nodes {
                n.embedding = None;
            }
            for c in &mut ns.clusters {
                c.embedding = None;
            }
        }
    }
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
    /// Question families (see `RegroupParams::family_score`): a cluster and its family's
    /// first cluster, both ids of this snapshot's clusters. Absent from older snapshots
    /// (families then wait for the next regrouping that finishes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub families: Vec<(u64, u64)>,
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
    use crate::prefetch::model::tests::params;

    /// A family whose first cluster was forgotten is saved with its other members together;
    /// one left alone is no family.
    #[test]
    fn families_are_saved_by_the_clusters_still_held() {
        let families = HashMap::from([(1, 1), (2, 1), (3, 1), (4, 4), (5, 4)]);
        let held = |c: u64| c != 1 && c != 5;
        assert_eq!(saved_families(&families, held), [(2, 2), (3, 2)]);
        assert_eq!(
            saved_families(&families, |_| true),
            [(1, 1), (2, 1), (3, 1), (4, 4), (5, 4)]
        );
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
