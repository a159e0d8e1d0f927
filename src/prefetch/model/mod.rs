//! The transition model: per namespace, decayed counts of which entry answered the turn that
//! followed which entry, and of which *cluster* of questions followed which.
//!
//! Every observed entry is a *node* holding the text it was matched by (its prompt), its
//! embedding, how often it was served (`seen`) and how often each other entry answered the
//! next turn (`next`). Counts decay exponentially with the configured half-life, so old habits
//! fade. The probability of a follow-up `Y` after `E` is `next[Y] / seen(E)`: the share of the
//! times `E` was served that were followed by `Y` (ending the conversation is the rest),
//! leaving out a latest serving still awaiting its follow-up (see [`Model::observe`]).
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
//!
//! This file holds the data (nodes, clusters, namespaces) and the counting (`observe`,
//! `link`, `rename`); `clusters.rs` places prompts in clusters, `predict.rs` ranks the
//! follow-ups, `regroup.rs` merges clusters used alike, `snapshot.rs` exports and imports
//! the counts.

mod clusters;
mod predict;
mod regroup;
mod snapshot;

use std::collections::HashMap;
use std::sync::Arc;

use reprise_cache::EntryId;

use clusters::note_wording;
pub use predict::PredictParams;
pub use regroup::RegroupParams;
pub use snapshot::{ClusterSnapshot, NamespaceSnapshot, NodeSnapshot, Snapshot, SNAPSHOT_VERSION};

/// Nodes kept per namespace; beyond this the least recently touched tenth is forgotten.
const MAX_NODES: usize = 20_000;
/// Clusters kept per namespace; beyond this the least recently touched tenth is forgotten.
/// Assigning a new node scans them, so this also bounds that cost.
const MAX_CLUSTERS: usize = 4096;
/// Namespaces kept; beyond this the least recently touched one of the tenant holding the
/// most is forgotten.
const MAX_NAMESPACES: usize = 1024;
/// Namespaces kept of one tenant while others' are held too (namespaces are picked by a
/// header): beyond this its own least recently touched one is forgotten, so one tenant
/// naming new namespaces cannot push the others' learned follow-ups out.
const MAX_TENANT_NAMESPACES: usize = 256;
/// Follow-ups kept per node and per cluster; beyond this the weakest is forgotten.
const MAX_NEXT: usize = 64;
/// Wordings kept per cluster; beyond this the least used one (never the representative)
/// makes room.
pub const MAX_WORDINGS: usize = 16;
/// Longest question (bytes) the model learns; longer ones are not predicted.
pub const MAX_PROMPT_BYTES: usize = 4096;
/// Bytes counted for a node or cluster besides its texts, vector and follow-ups (maps,
/// counters, its key).
const ITEM_OVERHEAD: usize = 160;
/// Bytes counted per follow-up count (key, count, map slot).
const NEXT_BYTES: usize = 48;

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
    /// Its latest observation has had no follow-up yet: see [`Model::observe`].
    awaiting: bool,
    touched_ms: u64,
    /// The cluster its prompt belongs to (assigned on first observation).
    cluster: Option<u64>,
}

impl Node {
    /// Observations whose outcome is known: every one but an awaiting latest.
    fn known(&self, now_ms: u64, half_life_ms: f64) -> f64 {
        known(&self.seen, self.awaiting, now_ms, half_life_ms)
    }
}

impl Cluster {
    /// Observations whose outcome is known, as for a node.
    fn known(&self, now_ms: u64, half_life_ms: f64) -> f64 {
        known(&self.seen, self.awaiting, now_ms, half_life_ms)
    }
}

/// `seen` less the latest observation when it still awaits its follow-up.
fn known(seen: &Decayed, awaiting: bool, now_ms: u64, half_life_ms: f64) -> f64 {
    (seen.value(now_ms, half_life_ms) - f64::from(u8::from(awaiting))).max(0.0)
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
    /// Its latest observation has had no follow-up yet, as for a node.
    awaiting: bool,
    touched_ms: u64,
}

/// Whether prompt `a` (with its embedding) may be counted as the same question as a
/// cluster's representative `b`.
type JoinRule<'a> = dyn Fn(&str, Option<&[f32]>, &str, Option<&[f32]>) -> bool + 'a;

/// One namespace's nodes and clusters, and how its follow-ups arrive (multi-turn history or
/// single-turn prompts linked by a session id).
#[derive(Debug, Clone, Default)]
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
    /// Clusters that regrouping would join at the looser `family_score` (see
    /// [`RegroupParams::family_score`]), each to its family's first cluster: a prediction
    /// weighs a follow-up by its family's counts. Set by the last regrouping that finished.
    families: HashMap<u64, u64>,
}

/// The transition counts of every namespace.
#[derive(Debug)]
pub struct Model {
    half_life_ms: f64,
    namespaces: HashMap<String, Namespace>,
    changed: bool,
    /// Bytes the model may hold ([`Model::bytes`]); the least recently touched go first.
    budget: u64,
    /// [`Model::bytes`] when last measured, plus what was added since (an overestimate:
    /// what left since is not subtracted), so the model is measured again only when it may
    /// have passed the budget.
    estimate: u64,
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
    // Three vectorised passes are several times faster than one pass of three running sums.
    use reprise_cache::vector::dot as dot_of;
    let (dot, na, nb) = (dot_of(a, b), dot_of(a, a), dot_of(b, b));
    if na == 0.0 || nb == 0.0 {
        return 0.0;
    }
    dot / (na.sqrt() * nb.sqrt())
}

impl Model {
    /// An empty model whose counts halve every `half_life_secs`, without a byte budget.
    #[cfg(test)]
    pub fn new(half_life_secs: f64) -> Model {
        Model::with_budget(half_life_secs, u64::MAX)
    }

    /// An empty model that holds at most about `budget` bytes ([`Model::bytes`]).
    pub fn with_budget(half_life_secs: f64, budget: u64) -> Model {
        Model {
            half_life_ms: (half_life_secs * 1000.0).max(1.0),
            namespaces: HashMap::new(),
            changed: false,
            budget,
            estimate: 0,
        }
    }

    /// What the model holds, in bytes: texts, vectors, follow-up counts and a fixed overhead
    /// per node, cluster and namespace.
    pub fn bytes(&self) -> u64 {
        let mut total = 0usize;
        for (name, space) in &self.namespaces {
            total += name.len() + ITEM_OVERHEAD;
            total += space.nodes.values().map(node_bytes).sum::<usize>();
            total += space.clusters.values().map(cluster_bytes).sum::<usize>();
            total += space.families.len() * 2 * std::mem::size_of::<u64>();
        }
        total as u64
    }

    /// Counts `added` bytes; past the budget, measures the model and forgets nodes and
    /// clusters until it holds at most nine tenths of it, so the next measurement is a tenth
    /// of the budget away. The tenant holding the most gives first, its least recently
    /// touched first: one tenant's flood of questions takes room from itself once it holds
    /// the most, never the whole model from the others (with one budget in least recently
    /// touched order, a tenant asking many new questions emptied every quieter tenant's
    /// model).
    fn grew(&mut self, added: usize) {
        self.estimate = self.estimate.saturating_add(added as u64);
        if self.estimate <= self.budget {
            return;
        }
        let goal = self.budget / 10 * 9;
        let mut bytes = self.bytes();
        if bytes > goal {
            #[derive(Clone, Copy)]
            enum Item {
                Node(EntryId),
                Cluster(u64),
            }
            /// A tenant's bytes and its items, the least recently touched last.
            #[derive(Default)]
            struct Share {
                bytes: usize,
                items: Vec<(u64, String, Item)>,
            }
            let mut shares: HashMap<String, Share> = HashMap::new();
            for (ns, space) in &self.namespaces {
                let share = shares
                    .entry(crate::auth::scope_of(ns).to_string())
                    .or_default();
                share.bytes += ns.len() + ITEM_OVERHEAD;
                for (id, n) in &space.nodes {
                    share.bytes += node_bytes(n);
                    share
                        .items
                        .push((n.touched_ms, ns.clone(), Item::Node(*id)));
                }
                for (k, c) in &space.clusters {
                    share.bytes += cluster_bytes(c);
                    share
                        .items
                        .push((c.touched_ms, ns.clone(), Item::Cluster(*k)));
                }
            }
            for s in shares.values_mut() {
                s.items
                    .sort_unstable_by_key(|(touched, _, _)| std::cmp::Reverse(*touched));
            }
            let mut largest: std::collections::BinaryHeap<(usize, String)> = shares
                .iter()
                .map(|(tenant, s)| (s.bytes, tenant.clone()))
                .collect();
            while bytes > goal {
                let Some((_, tenant)) = largest.pop() else {
                    break;
                };
                let Some(share) = shares.get_mut(&tenant) else {
                    continue;
                };
                // A tenant with nothing left to forget leaves the heap.
                let Some((_, ns, item)) = share.items.pop() else {
                    continue;
                };
                let Some(space) = self.namespaces.get_mut(&ns) else {
                    largest.push((share.bytes, tenant));
                    continue;
                };
                // A node whose cluster went is placed again when next seen.
                let freed = match item {
                    Item::Node(id) => space.nodes.remove(&id).as_ref().map_or(0, node_bytes),
                    Item::Cluster(k) => space.clusters.remove(&k).as_ref().map_or(0, cluster_bytes),
                };
                bytes = bytes.saturating_sub(freed as u64);
                share.bytes = share.bytes.saturating_sub(freed);
                largest.push((share.bytes, tenant));
            }
            self.namespaces
                .retain(|_, s| !(s.nodes.is_empty() && s.clusters.is_empty()));
            bytes = self.bytes();
        }
        self.estimate = bytes;
    }

    /// Whether anything changed since the last [`Model::take_changed`].
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Marks the counts changed again (a save that did not happen).
    pub fn set_changed(&mut self) {
        self.changed = true;
    }

    fn namespace(&mut self, ns: &str, now_ms: u64) -> &mut Namespace {
        if !self.namespaces.contains_key(ns) {
            let tenant = crate::auth::scope_of(ns);
            let own = |name: &&String| crate::auth::scope_of(name) == tenant;
            let mine = self.namespaces.keys().filter(own).count();
            let full = mine >= MAX_TENANT_NAMESPACES && mine < self.namespaces.len();
            // Past its share, a tenant gives up its own least recently used namespace; with
            // every namespace taken (one tenant, alone at first, may take them all), the
            // tenant holding the most gives up one of its own, never one that holds fewer.
            let giver = if full {
                Some(tenant.to_string())
            } else if self.namespaces.len() >= MAX_NAMESPACES {
                let mut held: HashMap<&str, usize> = HashMap::new();
                for name in self.namespaces.keys() {
                    *held.entry(crate::auth::scope_of(name)).or_default() += 1;
                }
                held.into_iter()
                    .max_by_key(|(t, n)| (*n, std::cmp::Reverse(*t)))
                    .map(|(t, _)| t.to_string())
            } else {
                None
            };
            if let Some(giver) = giver {
                if let Some(oldest) = self
                    .namespaces
                    .iter()
                    .filter(|(name, _)| crate::auth::scope_of(name) == giver)
                    .min_by_key(|(_, n)| n.touched_ms)
                    .map(|(k, _)| k.clone())
                {
                    self.namespaces.remove(&oldest);
                }
            }
        }
        let n = self.namespaces.entry(ns.to_string()).or_default();
        n.touched_ms = now_ms;
        n
    }

    /// Records that `id` was served (creating its node with its prompt and embedding, and
    /// placing it in a cluster: `join(a, ea, b, eb)` says whether prompt `a` may be counted
    /// as the same question as a cluster's representative `b`).
    ///
    /// The observation awaits its follow-up until a [`Model::link`] from `id` comes: a
    /// prediction made meanwhile (the prefetcher predicts right after observing) leaves it out
    /// of the total it divides by, since its outcome is what is being predicted. Counting it
    /// as a conversation that ended would put every estimate from `n` observations at
    /// `n - 1` outcomes over `n`: one follow-up seen in five served reads 0.2 where it was
    /// one in four known.
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
        node.awaiting = true;
        node.touched_ms = now_ms;
        let text = node.prompt.clone();
        if let Some(cid) = space.cluster_of(id, now_ms, &join) {
            if let Some(c) = space.clusters.get_mut(&cid) {
                c.seen.add(1.0, now_ms, hl);
                c.awaiting = true;
                c.touched_ms = now_ms;
                note_wording(c, &text, now_ms, hl);
            }
        }
        if space.nodes.len() > MAX_NODES {
            forget_oldest(&mut space.nodes, MAX_NODES / 10);
        }
        self.changed = true;
        // A new node (and perhaps a cluster and a wording): its texts and vector at most.
        let vector = embedding.map_or(0, |e| e.len() * 4);
        self.grew(3 * (ITEM_OVERHEAD + prompt.len() + vector));
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
        node.awaiting = false;
        node.next.entry(next).or_default().add(1.0, now_ms, hl);
        trim_next(&mut node.next, now_ms, hl);
        // Cluster counts: both ends were observed before they are linked, so both normally
        // have a cluster; a node observed only through an old snapshot may lack one.
        let from = space.cluster_of(prev, now_ms, &same_text);
        let to = space.cluster_of(next, now_ms, &same_text);
        if let (Some(from), Some(to)) = (from, to) {
            if let Some(c) = space.clusters.get_mut(&from) {
                c.touched_ms = now_ms;
                c.awaiting = false;
                c.next.entry(to).or_default().add(1.0, now_ms, hl);
                trim_next(&mut c.next, now_ms, hl);
            }
        }
        self.changed = true;
        self.grew(ITEM_OVERHEAD + 2 * NEXT_BYTES);
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
                    n.awaiting |= node.awaiting;
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

/// What [`Model::bytes`] counts for a node.
fn node_bytes(n: &Node) -> usize {
    ITEM_OVERHEAD
        + n.prompt.len()
        + n.embedding.as_ref().map_or(0, |e| e.len() * 4)
        + n.next.len() * NEXT_BYTES
}

/// What [`Model::bytes`] counts for a cluster.
fn cluster_bytes(c: &Cluster) -> usize {
    ITEM_OVERHEAD
        + c.prompt.len()
        + c.embedding.as_ref().map_or(0, |e| e.len() * 4)
        + c.next.len() * NEXT_BYTES
        + c.wordings.iter().map(|w| w.text.len() + 48).sum::<usize>()
}

/// Drops the `n` least recently touched nodes.
fn forget_oldest(nodes: &mut HashMap<EntryId, Node>, n: usize) {
    let mut ages: Vec<(u64, EntryId)> = nodes.iter().map(|(k, v)| (v.touched_ms, *k)).collect();
    ages.sort_unstable();
    for (_, k) in ages.into_iter().take(n.max(1)) {
        nodes.remove(&k);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tenant naming ever new namespaces forgets its own oldest once it holds its share,
    /// never another tenant's; alone, it may use them all.
    #[test]
    fn one_tenants_namespaces_never_push_anothers_out() {
        let scoped = |tenant: &str, sub: usize| crate::auth::scope(tenant, &format!("n{sub}"));
        let mut m = Model::with_budget(3600.0, 64 << 20);
        m.observe(&scoped("beta", 0), EntryId(1), "q", None, 0, same_text);
        for i in 0..MAX_NAMESPACES * 2 {
            let now = 1 + i as u64;
            m.observe(
                &scoped("acme", i),
                EntryId(2 + i as u128),
                "q",
                None,
                now,
                same_text,
            );
        }
        assert!(m.namespaces.contains_key(&scoped("beta", 0)));
        let acme = m
            .namespaces
            .keys()
            .filter(|n| crate::auth::scope_of(n) == "acme");
        assert_eq!(acme.count(), MAX_TENANT_NAMESPACES);
        let mut alone = Model::with_budget(3600.0, 64 << 20);
        for i in 0..MAX_NAMESPACES * 2 {
            let now = i as u64;
            alone.observe(
                &scoped("acme", i),
                EntryId(1 + i as u128),
                "q",
                None,
                now,
                same_text,
            );
        }
        assert_eq!(alone.namespaces.len(), MAX_NAMESPACES);

        // Alone first, acme took every namespace and keeps them in use; newcomers still get
        // and keep theirs, out of acme's.
        let mut t = MAX_NAMESPACES as u64 * 2;
        let mut tick = || {
            t += 1;
            t
        };
        alone.observe(
            &scoped("beta", 0),
            EntryId(1 << 40),
            "q",
            None,
            tick(),
            same_text,
        );
        for i in MAX_NAMESPACES..MAX_NAMESPACES * 2 {
            let now = tick();
            alone.observe(
                &scoped("acme", i),
                EntryId(1 + i as u128),
                "q",
                None,
                now,
                same_text,
            );
        }
        alone.observe(
            &scoped("beta", 1),
            EntryId((1 << 40) + 1),
            "q",
            None,
            tick(),
            same_text,
        );
        alone.observe(
            &scoped("gamma", 0),
            EntryId((1 << 40) + 2),
            "q",
            None,
            tick(),
            same_text,
        );
        for name in [scoped("beta", 0), scoped("beta", 1), scoped("gamma", 0)] {
            assert!(alone.namespaces.contains_key(&name), "{name}");
        }
        assert_eq!(alone.namespaces.len(), MAX_NAMESPACES);
    }

    /// However many questions arrive, over however many namespaces, the model stays within
    /// its byte budget, keeping the most recently used.
    #[test]
    fn the_model_stays_within_its_byte_budget() {
        let budget = 1 << 20;
        let mut m = Model::with_budget(3600.0, budget);
        let vector: Arc<[f32]> = Arc::from(vec![0.1f32; 384]);
        let mut last = EntryId(0);
        for i in 0..5_000u128 {
            let ns = format!("ns{}", i % 50);
            let prompt = format!("{} question number {i}", "long ".repeat(200));
            let id = EntryId(i + 1);
            m.observe(&ns, id, &prompt, Some(&vector), i as u64, same_text);
            m.link(&ns, last, id, true, i as u64);
            last = id;
            assert!(
                m.bytes() <= budget,
                "{} bytes after {i} questions",
                m.bytes()
            );
        }
        // The latest question is kept; the first ones are gone.
        let space = &m.namespaces[&format!("ns{}", 4_999 % 50)];
        assert!(space.nodes.contains_key(&EntryId(5_000)));
        assert!(m
            .namespaces
            .values()
            .all(|s| !s.nodes.contains_key(&EntryId(1))));
    }

    /// A tenant asking many new questions takes room from itself once it holds the most,
    /// not from a quieter tenant whose questions are older.
    #[test]
    fn a_flooding_tenant_gives_room_before_a_quiet_one() {
        let budget = 1 << 20;
        let mut m = Model::with_budget(3600.0, budget);
        let vector: Arc<[f32]> = Arc::from(vec![0.1f32; 384]);
        let quiet = crate::auth::scope("quiet", "support");
        let prompt = |i: u128| format!("{} question number {i}", "long ".repeat(200));
        let mut last = EntryId(0);
        for i in 1..=10u128 {
            m.observe(
                &quiet,
                EntryId(i),
                &prompt(i),
                Some(&vector),
                i as u64,
                same_text,
            );
            m.link(&quiet, last, EntryId(i), true, i as u64);
            last = EntryId(i);
        }
        for i in 100..5_000u128 {
            let ns = crate::auth::scope("loud", &format!("ns{}", i % 7));
            m.observe(
                &ns,
                EntryId(i),
                &prompt(i),
                Some(&vector),
                i as u64,
                same_text,
            );
            assert!(m.bytes() <= budget, "{} bytes", m.bytes());
        }
        let space = &m.namespaces[&quiet];
        let kept = (1..=10u128).all(|i| space.nodes.contains_key(&EntryId(i)));
        assert!(kept, "the quiet tenant's questions stay");
        // The loud tenant kept its newest.
        let loud = crate::auth::scope("loud", &format!("ns{}", 4_999 % 7));
        assert!(m.namespaces[&loud].nodes.contains_key(&EntryId(4_999)));
    }

    pub(crate) fn params() -> PredictParams {
        PredictParams {
            min_probability: 0.2,
            max_predictions: 3,
            min_observations: 2.0,
            similar_threshold: 0.8,
        }
    }

    /// Joins prompts that share their first word (a stand-in for "similar and gate passes").
    pub(super) fn first_word(a: &str, _: Option<&[f32]>, b: &str, _: Option<&[f32]>) -> bool {
        a.split(' ').next() == b.split(' ').next()
    }

    #[test]
    fn counts_decay_with_half_life() {
        let mut d = Decayed::default();
        d.add(8.0, 0, 1000.0);
        assert!((d.value(1000, 1000.0) - 4.0).abs() < 1e-9);
        assert!((d.value(3000, 1000.0) - 1.0).abs() < 1e-9);
    }
}
