//! Thresholds per entry (under an error bound): the verdicts on one entry's answers, kept
//! beside its scope's, and the threshold they allow that entry alone.
//!
//! The scope's threshold serves every entry of a tenant's rule alike, and most entries are
//! served too few times to say more. A popular answer gathers verdicts of its own, and they
//! speak of it where the scope's cannot: an entry whose lookalike questions keep being
//! served it wrongly is raised above its scope's threshold by its own wrong verdicts (for
//! every question, not only those around the one reported), and one whose near misses keep
//! proving right opens a band under the scope's threshold for itself once its own verdicts
//! certify that band. Both by the scope's estimator ([`Evidence::threshold`]) with the
//! scope's learned threshold as the configured one, so the same levels and margins hold for
//! each entry: with few verdicts an entry follows its scope; wrong verdicts raise it at
//! once; loosening takes about `11 / delta` verdicts of its own at or above the band.
//! (vCache, arXiv 2502.03771, learns a threshold per cached entry; here per entry where its
//! own verdicts allow, and per scope otherwise.)
//!
//! Only the running policy's verdicts count here: a canary candidate's stay in its own scope,
//! so a candidate never moves what the running policy serves.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use reprise_cache::EntryId;
use reprise_policies::bound::{bin_of, Evidence, Learned};

use super::Bins;

/// Entries' verdicts as published and snapshotted: each entry by its id as text (an id is
/// 128 bits, which a JSON number read as a `serde_json::Value` cannot hold).
pub(super) type Shared = Vec<(String, Bins)>;

/// Verdicts kept per entry before old ones weigh half.
pub(super) const DECAY_AT: f64 = 10_000.0;
/// The entries whose verdicts a replica publishes: those with the most.
pub(super) const MAX_PUBLISHED: usize = 1024;
/// Entries taken from the other replicas, all of them together.
const MAX_PEERS: usize = 16_384;
/// What one entry's record costs besides its bins (key, `Arc`, moka's bookkeeping).
const RECORD_BYTES: usize = 160;

/// What a record of `bins` weighs.
fn weight(bins: &Bins) -> u32 {
    let bytes = RECORD_BYTES + bins.capacity() * std::mem::size_of::<(u8, f64, f64)>();
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// The verdicts of every entry that has any: this replica's own (bounded by bytes, the least
/// recently used going first) and the other replicas' as last read.
pub struct Entries {
    own: moka::sync::Cache<EntryId, Arc<Bins>>,
    peers: RwLock<HashMap<EntryId, Bins>>,
}

impl Entries {
    /// Keeps at most `bytes` of this replica's own verdicts.
    pub fn new(bytes: u64) -> Self {
        Entries {
            own: moka::sync::Cache::builder()
                .max_capacity(bytes)
                .weigher(|_, b: &Arc<Bins>| weight(b))
                .eviction_policy(moka::policy::EvictionPolicy::lru())
                .build(),
            peers: RwLock::new(HashMap::new()),
        }
    }

    /// Records a verdict on `entry`'s answer served (or a near miss found) at `similarity`.
    pub fn record(&self, entry: EntryId, similarity: f32, wrong: bool) {
        let b = bin_of(similarity);
        self.own.entry(entry).and_compute_with(|held| {
            let mut bins: Bins = held.map(|e| (**e.value()).clone()).unwrap_or_default();
            match bins.iter_mut().find(|x| x.0 == b) {
                Some(x) if wrong => x.2 += 1.0,
                Some(x) => x.1 += 1.0,
                None => bins.push((b, f64::from(u8::from(!wrong)), f64::from(u8::from(wrong)))),
            }
            if total(&bins) > DECAY_AT {
                for x in &mut bins {
                    x.1 /= 2.0;
                    x.2 /= 2.0;
                }
            }
            moka::ops::compute::Op::Put(Arc::new(bins))
        });
    }

    /// The threshold `entry` serves at under `delta`, from its scope's `configured` one
    /// (`floor`: the lowest it may learn); `None` when no replica has a verdict on it (it
    /// serves at its scope's).
    pub fn threshold(
        &self,
        entry: EntryId,
        delta: f64,
        alpha: f64,
        configured: f32,
        floor: f32,
    ) -> Option<Learned> {
        let own = self.own.get(&entry);
        let peers = self.peers.read();
        let theirs = peers.get(&entry);
        if own.is_none() && theirs.is_none() {
            return None;
        }
        let mut e = Evidence::default();
        for bins in own.as_deref().into_iter().chain(theirs) {
            // Kept or checked on the way in: within range.
            e.merge(&Evidence::from_bins(bins, f64::MAX)?);
        }
        Some(e.threshold(delta, alpha, configured, floor.min(configured)))
    }

    /// Entries with verdicts of this replica's own.
    pub fn count(&self) -> u64 {
        self.own.run_pending_tasks();
        self.own.entry_count()
    }

    /// How many verdicts of this replica's own each entry that has any holds.
    pub fn totals(&self) -> Vec<f64> {
        self.own.iter().map(|(_, bins)| total(&bins)).collect()
    }

    /// This replica's own verdicts, of the [`MAX_PUBLISHED`] entries with the most.
    pub(super) fn published(&self) -> Shared {
        let mut all: Vec<(EntryId, Bins)> = self
            .own
            .iter()
            .map(|(id, bins)| (*id, (*bins).clone()))
            .collect();
        if all.len() > MAX_PUBLISHED {
            all.sort_by(|a, b| total(&b.1).total_cmp(&total(&a.1)));
            all.truncate(MAX_PUBLISHED);
        }
        all.into_iter()
            .map(|(id, bins)| (id.to_string(), bins))
            .collect()
    }

    /// Takes back what a snapshot kept ([`Entries::published`]) into this replica's own,
    /// each entry's id and bins checked as a peer's are. Returns the entries taken.
    pub(super) fn restore(&self, saved: Shared) -> usize {
        let mut n = 0;
        for (id, bins) in saved.into_iter().take(MAX_PUBLISHED) {
            if let Some((id, bins)) = checked(&id, bins) {
                self.own.insert(id, Arc::new(bins));
                n += 1;
            }
        }
        n
    }

    /// Makes `from` (every other replica's published entries) the peers' verdicts: at most
    /// [`MAX_PUBLISHED`] entries of each, [`MAX_PEERS`] in all, each checked bin by bin.
    pub(super) fn set_peers(&self, from: Vec<Shared>) {
        let mut peers: HashMap<EntryId, Bins> = HashMap::new();
        for replica in from {
            for (id, bins) in replica.into_iter().take(MAX_PUBLISHED) {
                let Some((id, bins)) = checked(&id, bins) else {
                    tracing::debug!("bounds: invalid entry evidence skipped");
                    continue;
                };
                if peers.len() >= MAX_PEERS && !peers.contains_key(&id) {
                    continue;
                }
                let held = peers.entry(id).or_default();
                for (b, right, wrong) in bins {
                    match held.iter_mut().find(|x| x.0 == b) {
                        Some(x) => {
                            x.1 += right;
                            x.2 += wrong;
                        }
                        None => held.push((b, right, wrong)),
                    }
                }
            }
        }
        *self.peers.write() = peers;
    }
}

/// Verdicts in `bins` (right and wrong).
fn total(bins: &Bins) -> f64 {
    bins.iter().map(|x| x.1 + x.2).sum()
}

/// The entry `id` names and `bins`, when the id is one and every bin is in range, with
/// finite counts no larger than one entry keeps (twice [`DECAY_AT`]), and no bin twice;
/// `None` otherwise: what another replica or a snapshot sent is checked, never trusted.
fn checked(id: &str, bins: Bins) -> Option<(EntryId, Bins)> {
    let id = id.parse().ok()?;
    Evidence::from_bins(&bins, 2.0 * DECAY_AT)?;
    let mut seen = [false; 256];
    for &(b, ..) in &bins {
        if std::mem::replace(&mut seen[usize::from(b)], true) {
            return None;
        }
    }
    Some((id, bins))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALPHA: f64 = 0.05;

    /// Without verdicts of its own an entry follows its scope; one wrong verdict raises it
    /// above where it was served, for that entry alone.
    #[test]
    fn a_wrong_verdict_raises_that_entry_alone() {
        let e = Entries::new(1 << 20);
        let (a, b) = (EntryId(1), EntryId(2));
        assert_eq!(e.threshold(a, 0.05, ALPHA, 0.86, 0.7), None);
        e.record(a, 0.90, true);
        let raised = e.threshold(a, 0.05, ALPHA, 0.86, 0.7).unwrap();
        assert!(raised.threshold > 0.90, "{raised:?}");
        assert_eq!(e.threshold(b, 0.05, ALPHA, 0.86, 0.7), None);
    }

    /// Right verdicts under the scope's threshold open a band for the entry once they
    /// certify it, never with a few.
    #[test]
    fn right_near_misses_loosen_an_entry_once_they_certify_the_band() {
        let e = Entries::new(1 << 20);
        let a = EntryId(7);
        for _ in 0..5 {
            e.record(a, 0.80, false);
        }
        let few = e.threshold(a, 0.3, ALPHA, 0.97, 0.7).unwrap();
        assert_eq!(few.threshold, 0.97, "{few:?}");
        for _ in 0..40 {
            e.record(a, 0.80, false);
        }
        let many = e.threshold(a, 0.3, ALPHA, 0.97, 0.7).unwrap();
        assert!(many.learned && many.threshold <= 0.80, "{many:?}");
        assert!(many.wrong_upper <= 0.3, "{many:?}");
        // Half of them wrong: not loosened.
        let mixed = EntryId(8);
        for i in 0..90 {
            e.record(mixed, 0.80, i % 2 == 0);
        }
        let m = e.threshold(mixed, 0.3, ALPHA, 0.97, 0.7).unwrap();
        assert_eq!(m.threshold, 0.97, "{m:?}");
    }

    /// Other replicas' verdicts count with this one's; what they send is checked, and they
    /// replace what was read before.
    #[test]
    fn peers_count_and_are_checked() {
        let e = Entries::new(1 << 20);
        let a = EntryId::random();
        let text = a.to_string();
        e.set_peers(vec![vec![(text.clone(), vec![(90, 0.0, 1.0)])]]);
        let raised = e.threshold(a, 0.05, ALPHA, 0.86, 0.7).unwrap();
        assert!(raised.threshold > 0.90, "{raised:?}");
        for bad in [
            vec![(101, 1.0, 0.0)],
            vec![(90, f64::NAN, 0.0)],
            vec![(90, -1.0, 0.0)],
            vec![(90, 1.0, 0.0), (90, 1.0, 0.0)],
            vec![(90, 3.0 * DECAY_AT, 0.0)],
        ] {
            e.set_peers(vec![vec![(text.clone(), bad.clone())]]);
            assert_eq!(e.threshold(a, 0.05, ALPHA, 0.86, 0.7), None, "{bad:?}");
        }
        e.set_peers(vec![vec![("not an id".into(), vec![(90, 0.0, 1.0)])]]);
        assert!(e.peers.read().is_empty());
        // Two replicas on one entry add up.
        let two = vec![
            vec![(text.clone(), vec![(90, 1.0, 0.0)])],
            vec![(text.clone(), vec![(90, 0.0, 1.0)])],
        ];
        e.set_peers(two);
        let l = e.threshold(a, 0.05, ALPHA, 0.86, 0.7).unwrap();
        assert_eq!(l.verdicts, 0.0, "raised past both: {l:?}");
        assert!(l.threshold > 0.90);
    }

    /// The store holds its byte budget, the least recently used entry going first.
    #[test]
    fn own_verdicts_keep_to_their_budget() {
        let budget = 64 * u64::from(weight(&vec![(0, 0.0, 0.0); 4]));
        let e = Entries::new(budget);
        for i in 0..1000u128 {
            e.record(EntryId(i), 0.9, false);
        }
        e.own.run_pending_tasks();
        assert!(e.own.weighted_size() <= budget, "{}", e.own.weighted_size());
        assert!(e.count() < 1000 && e.count() > 0);
        assert!(e.threshold(EntryId(999), 0.05, ALPHA, 0.86, 0.7).is_some());
    }

    /// Decay keeps one entry's counts bounded.
    #[test]
    fn an_entrys_counts_decay() {
        let e = Entries::new(1 << 20);
        let a = EntryId(5);
        for _ in 0..(2 * DECAY_AT as usize) {
            e.record(a, 0.9, false);
        }
        let held = e.own.get(&a).unwrap();
        assert!(total(&held) <= DECAY_AT, "{}", total(&held));
        // What a replica publishes is within what a peer accepts.
        let published = e.published();
        assert_eq!(published.len(), 1);
        let (id, bins) = published.into_iter().next().unwrap();
        assert_eq!(checked(&id, bins).map(|(id, _)| id), Some(a));
    }
}
